"""A simulated consumer of the durable subscription, as
`broker/client/consumer.py`: permits (a receiver queue, given back once half
of it was taken), messages of an older connection dropped, acknowledgements
gathered into groups and sent again over reconnections until answered,
cumulative acknowledgements (exclusive and failover), negative
acknowledgements after a delay, and an optional ack timeout for messages
its application forgot."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from broker.dispatcher import SubscriptionType
from broker.errors import BrokerStatus
from sim.broker_checker import BrokerChecker
from sim.broker_client import RECONNECT_STATUSES, SimBrokerClient
from sim.broker_links import Links
from sim.broker_messages import Ack, Deliver, Flow, Redeliver, Response, Subscribe
from sim.broker_parameters import BrokerSimParameters
from sim.network import Network
from sim.world import World


@dataclass(eq=False)
class _AckGroup:
    cumulative: bool
    offsets: list[int] = field(default_factory=list)
    in_flight: bool = False


class SimConsumer(SimBrokerClient):
    def __init__(self, name: str, world: World, network: Network, links: Links, brokers: list[str], checker: BrokerChecker,
                 parameters: BrokerSimParameters, *, priority: int) -> None:
        self.checker = checker
        self.parameters = parameters
        self.priority = priority
        self.acks_answered = 0
        self.nacks = 0
        self.forgotten = 0
        self.received_total = 0
        super().__init__(name, world, network, links, brokers)
        self.start()

    def start(self) -> None:
        super().start()
        self._generation = 0
        self._queue: collections.deque[tuple[int, int, str | None]] = collections.deque()  # (generation, offset, key)
        self._given_since_flow = 0
        self._unacked_deadlines: dict[int, float] = {}
        self._group = _AckGroup(False)
        self._group_scheduled = False
        self._groups: list[_AckGroup] = []  # sent or waiting to be, until answered
        self.after(self.world.exponential(self.parameters.process_ms_mean), self._process)
        if self.parameters.ack_timeout_ms:
            self.after(self.parameters.ack_timeout_ms / 4, self._ack_timeouts)

    @property
    def acks_in_flight(self) -> int:
        """Acknowledgement requests sent and not answered yet. (Groups that
        wait for a connection do not count: an exclusive subscription's
        other consumers never get one.)"""
        return sum(1 for group in self._groups if group.in_flight)

    # --- subscribing ---------------------------------------------------------------------

    def open_request(self, request_id: int) -> Subscribe:
        return Subscribe(request_id, self.handle, self.parameters.subscription_type, self.name, self.priority)

    def on_connected(self, response: Response) -> None:
        self._generation += 1
        # What was queued from the last connection is delivered again by the broker.
        self._queue.clear()
        self._unacked_deadlines.clear()
        self._given_since_flow = 0
        self.links.send(self.connection, self.name, Flow(self.handle, self.parameters.receiver_queue_size))
        for group in self._groups:
            if not group.in_flight:
                self._send_group(group)

    def on_message(self, message: Deliver) -> None:
        assert isinstance(message, Deliver), message
        self.received_total += len(message.offsets)
        self.checker.consumer_received(message.offsets)
        for offset, key in zip(message.offsets, message.keys):
            self._queue.append((self._generation, offset, key))

    # --- the application ---------------------------------------------------------------------

    def _process(self) -> None:
        parameters, world = self.parameters, self.world
        while self._queue:
            generation, offset, key = self._queue.popleft()
            if generation != self._generation:
                continue  # from a connection since replaced: the broker delivers it again
            self._given(offset)
            if world.chance(parameters.nack_probability):
                self.nacks += 1
                self.after(parameters.negative_ack_delay_ms, self._redeliver, (offset,))
            elif world.chance(parameters.forget_probability):
                self.forgotten += 1  # the ack timeout brings it back
            elif world.chance(parameters.cumulative_ack_probability):
                self._groups.append(_AckGroup(True, [offset]))
                self._send_group(self._groups[-1])
            else:
                self._group.offsets.append(offset)
                if not self._group_scheduled:
                    self._group_scheduled = True
                    self.after(parameters.ack_group_ms, self._flush_group)
            break
        self.after(world.exponential(parameters.process_ms_mean), self._process)

    def _given(self, offset: int) -> None:
        """The application took a message: track its ack timeout, and give
        permits back once half the queue was taken."""
        if self.parameters.ack_timeout_ms:
            self._unacked_deadlines[offset] = self.world.now_ms + self.parameters.ack_timeout_ms
        self._given_since_flow += 1
        if self._given_since_flow >= self.parameters.receiver_queue_size // 2 and self.connected:
            self.links.send(self.connection, self.name, Flow(self.handle, self._given_since_flow))
            self._given_since_flow = 0

    def _redeliver(self, offsets: tuple[int, ...]) -> None:
        if self.connected:
            self.links.send(self.connection, self.name, Redeliver(self.handle, offsets))

    def _ack_timeouts(self) -> None:
        now_ms = self.world.now_ms
        expired = tuple(sorted(offset for offset, deadline_ms in self._unacked_deadlines.items() if deadline_ms <= now_ms))
        for offset in expired:
            del self._unacked_deadlines[offset]
        if expired:
            self._redeliver(expired)
        self.after(self.parameters.ack_timeout_ms / 4, self._ack_timeouts)

    # --- acknowledgements --------------------------------------------------------------------------

    def _flush_group(self) -> None:
        self._group_scheduled = False
        group, self._group = self._group, _AckGroup(False)
        if group.offsets:
            self._groups.append(group)
            self._send_group(group)

    def _send_group(self, group: _AckGroup) -> None:
        """Send until the broker takes it (over reconnections: an
        acknowledgement names an offset, valid for any consumer)."""
        for offset in group.offsets if not group.cumulative else ():
            self._unacked_deadlines.pop(offset, None)
        if group.cumulative:
            for offset in [offset for offset in self._unacked_deadlines if offset <= group.offsets[0]]:
                del self._unacked_deadlines[offset]
        if not self.connected:
            return  # sent once connected
        group.in_flight = True
        connection = self.connection
        make = lambda request_id: Ack(request_id, self.handle, group.cumulative, tuple(group.offsets))  # noqa: E731
        self.request(connection, make, lambda response: self._answered(group, connection, response))
        if self.world.chance(self.parameters.duplicate_probability):
            self.request(connection, make, lambda response: None)

    def _answered(self, group: _AckGroup, connection, response: Response | None) -> None:
        group.in_flight = False
        if response is not None and response.status is BrokerStatus.OK:
            self._groups.remove(group)
            self.acks_answered += 1
            return
        if response is None or response.status in RECONNECT_STATUSES:
            if connection is self.connection:
                self.lost()
            elif self.connected:
                self._send_group(group)
            return
        # Refused (BAD_REQUEST): the application's acknowledgement fails.
        self._groups.remove(group)
        self.world.log(f"{self.name} acknowledgement of {group.offsets} refused: {response.status.name}")


def consumer_priorities(kind: SubscriptionType, count: int, rng) -> list[int]:
    """Failover consumers get priorities (the lowest value is active); others 0."""
    return [rng.randint(0, 1) if kind is SubscriptionType.FAILOVER else 0 for _ in range(count)]
