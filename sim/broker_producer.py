"""A simulated producer, as `broker/client/producer.py`: numbered messages
with explicit sequence ids (its application's outbox, fixed by the seed),
batched, several batches in flight, each batch kept as sent until its
receipt and resent as it was, in order, after every reconnection. DUPLICATE
is success, RETRY "ask again later". A crashed producer's application
starts a new one, which learns the last persisted sequence id on connecting
and goes on from the message after it (the broker says the last id it
persisted or is writing: `Dedup.last_taken`)."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from broker.errors import BrokerStatus
from sim.broker_checker import BrokerChecker
from sim.broker_client import RECONNECT_STATUSES, SimBrokerClient
from sim.broker_links import Links
from sim.broker_messages import ProducerOpen, Response, Send, SendReceipt
from sim.broker_parameters import BrokerSimParameters
from sim.network import Network
from sim.world import World

RETRY_DELAY_MS = 50.0  # RETRY_DELAY_S in broker/client/producer.py


@dataclass(frozen=True, slots=True)
class _Batch:
    sequence_ids: tuple[int, ...]
    keys: tuple[str | None, ...]


class SimProducer(SimBrokerClient):
    def __init__(self, name: str, world: World, network: Network, links: Links, brokers: list[str], checker: BrokerChecker,
                 parameters: BrokerSimParameters) -> None:
        self.producer_id = name
        self.checker = checker
        self.parameters = parameters
        rng = world.rng
        # The outbox: every message this producer's application will send.
        self.plan: list[tuple[int, str | None]] = []
        sequence_id = -1
        for _ in range(parameters.messages_per_producer):
            sequence_id += rng.randint(2, 4) if rng.random() < parameters.sequence_gap_probability else 1
            self.plan.append((sequence_id, f"key-{rng.randrange(parameters.keys)}" if parameters.keys > 1 else None))
        self.active = True
        self.duplicates_sent = 0
        self.retries = 0
        super().__init__(name, world, network, links, brokers)
        self.start()

    @property
    def planned(self) -> list[int]:
        return [sequence_id for sequence_id, _ in self.plan]

    def start(self) -> None:
        super().start()
        self._next = 0  # index in the plan of the next message handed over
        self._resume_from_broker = self.restarts > 0  # a new process: ask the broker where it stopped
        self._pending: collections.OrderedDict[int, _Batch] = collections.OrderedDict()  # by last sequence id
        self._building: list[tuple[int, str | None]] = []
        self._batch_target = 1
        self._flush_scheduled = False
        self.after(self.world.exponential(self.parameters.send_gap_ms_mean), self._produce)

    @property
    def done(self) -> bool:
        return self._next >= len(self.plan) and not self._pending and not self._building

    @property
    def pending_messages(self) -> int:
        return sum(len(batch.sequence_ids) for batch in self._pending.values()) + len(self._building)

    # --- connecting --------------------------------------------------------------------

    def open_request(self, request_id: int) -> ProducerOpen:
        return ProducerOpen(request_id, self.handle, self.producer_id)

    def on_connected(self, response: Response) -> None:
        if self._resume_from_broker:
            # The application of a new process goes on after what the broker
            # says it persisted.
            self._resume_from_broker = False
            last = response.last_sequence_id
            while self._next < len(self.plan) and self.plan[self._next][0] <= last:
                self._next += 1
            self.world.log(f"{self.name} resumes after sequence id {last}")
        for batch in self._pending.values():
            self._send(batch)

    # --- producing ------------------------------------------------------------------------

    def _produce(self) -> None:
        if self._resume_from_broker and not self.connected:
            self.after(self.parameters.send_gap_ms_mean + 1, self._produce)
            return
        if self.active and self._next < len(self.plan) and self.pending_messages < self.parameters.pending_messages_max:
            if not self._building:
                self._batch_target = self.world.rng.randint(1, self.parameters.batch_messages_max)
            self._building.append(self.plan[self._next])
            self._next += 1
            if len(self._building) >= self._batch_target:
                self._flush()
            elif not self._flush_scheduled:
                self._flush_scheduled = True
                self.after(self.parameters.batch_delay_ms, self._flush_timer)
        self.after(self.world.exponential(self.parameters.send_gap_ms_mean), self._produce)

    def _flush_timer(self) -> None:
        self._flush_scheduled = False
        self._flush()

    def _flush(self) -> None:
        if not self._building:
            return
        batch = _Batch(tuple(sequence_id for sequence_id, _ in self._building), tuple(key for _, key in self._building))
        self._building = []
        self._pending[batch.sequence_ids[-1]] = batch
        self._send(batch)

    def _send(self, batch: _Batch) -> None:
        if not self.connected:
            return  # sent on reconnection
        send = Send(self.handle, self.producer_id, batch.sequence_ids, batch.keys)
        self.links.send(self.connection, self.name, send)
        if self.world.chance(self.parameters.duplicate_probability):
            self.duplicates_sent += 1
            self.links.send(self.connection, self.name, send)

    # --- receipts ------------------------------------------------------------------------------

    def on_message(self, message: SendReceipt) -> None:
        assert isinstance(message, SendReceipt), message
        batch = self._pending.get(message.last_sequence_id)
        if batch is None:
            return  # settled already (answered twice after a resend)
        status = message.status
        if status in (BrokerStatus.OK, BrokerStatus.DUPLICATE):
            del self._pending[message.last_sequence_id]
            self.checker.producer_acknowledged(self.producer_id, batch.sequence_ids, status.name)
        elif status is BrokerStatus.RETRY:
            self.retries += 1
            self.after(RETRY_DELAY_MS, self._resend, batch)
        elif status in RECONNECT_STATUSES:
            self.lost()
        else:
            raise AssertionError(f"{self.name}: unexpected receipt {message}")

    def _resend(self, batch: _Batch) -> None:
        if self._pending.get(batch.sequence_ids[-1]) is batch:
            self._send(batch)
