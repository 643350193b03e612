"""The client processes of a broker run (`quire jepsen --broker`), each
recording its operations in a history file of its own, one per incarnation
(a process killed and started again writes a new file):

- a producer has a fixed producer id and gives every message an explicit
  sequence id (per partition, as the broker deduplicates); a restarted
  producer first sends again, with their sequence ids, the messages its
  earlier incarnations never heard back about, then goes on after them;
- a consumer runs sessions of one durable subscription, each on a client of
  its own: it receives, acknowledges individually (cumulatively part of the
  time on exclusive and failover), negatively acknowledges or leaves a few
  messages unacknowledged, and ends the session after a while;
- the drain (after the faults heal) reads every subscription to the end,
  acknowledging everything, until the broker reports no backlog.

Each dials the brokers through its own proxies, by the listener the brokers
advertise under its name. Run as `python -m sim.jepsen.broker_client
producer|consumer|drain ...`."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import random
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from broker.client import BrokerError, Client, Consumer, Message, partition_for_key
from sim.jepsen.client_process import (
    client_parser,
    error_text,
    role_nursery,
    run_client,
)
from sim.jepsen.history import HistoryWriter, read_history

KEYS_PER_PRODUCER = 8
BATCH_DELAY_MS = 5.0
RETRY_DELAY_S = 0.5  # after a client call that failed
STOP_FLUSH_S = 20.0  # a producer told to stop waits this long for its answers
RECEIVE_IDLE_S = 1.0  # a receive that gets nothing this long is recorded as idle
RECEIVER_QUEUE_SIZE = 50  # messages waiting in the client, per partition
NEGATIVE_ACK_DELAY_MS = 300.0
SESSION_S_MIN = 4.0
SESSION_S_MAX = 15.0
ACK_SETTLE_S = 5.0  # at a session's end, for its acknowledgements to be answered
NEGATIVE_ACK_PROBABILITY = 0.02
UNACKNOWLEDGED_PROBABILITY = 0.02  # left for a later session
CUMULATIVE_PROBABILITY = 0.3  # of the acknowledgements on exclusive and failover
DRAIN_IDLE_S = 2.0  # nothing received this long: ask whether the backlog is empty
DRAIN_RECEIVER_QUEUE_SIZE = 500

log = logging.getLogger("quire.jepsen.broker_client")


def history_path(work_dir: Path, name: str, incarnation: int) -> Path:
    return work_dir / f"history-{name}.{incarnation}.jsonl"


def next_incarnation(work_dir: Path, name: str) -> int:
    """1 for a process's first start, one more for each restart (the
    controller never runs two at once)."""
    incarnation = 1
    while history_path(work_dir, name, incarnation).exists():
        incarnation += 1
    return incarnation


class OpIds:
    """Operation ids unique across a process's incarnations."""

    def __init__(self, incarnation: int) -> None:
        self._prefix = f"{incarnation}."
        self._numbers = itertools.count()

    def __call__(self) -> str:
        return self._prefix + str(next(self._numbers))


@contextlib.asynccontextmanager
async def connect(options: argparse.Namespace, rng: random.Random) -> AsyncIterator[Client]:
    """A client dialling the brokers through this process's proxies."""
    async with Client.connect(service_url=options.service_url, listener_name=options.name, rng=rng,
                              client_name=options.name) as client:
        yield client


# --- producers ----------------------------------------------------------------------


def unanswered_sends(work_dir: Path, name: str, incarnation: int) -> tuple[dict[tuple[int, int], dict], dict[int, int]]:
    """What the earlier incarnations of a producer sent and never heard
    back about ((partition, sequence id) -> the send's record), and the
    highest sequence id each sent per partition."""
    sent: dict[tuple[int, int], dict] = {}
    answered: set[tuple[int, int]] = set()
    highest: dict[int, int] = {}
    for earlier in range(1, incarnation):
        path = history_path(work_dir, name, earlier)
        if not path.exists():
            continue
        by_op_id: dict[str, tuple[int, int]] = {}
        for operation in read_history(path):
            if operation.f != "produce":
                continue
            if operation.type == "invoke":
                message = (operation.value["partition"], operation.value["seq"])
                by_op_id[operation.value["op_id"]] = message
                sent.setdefault(message, operation.value)
                highest[message[0]] = max(highest.get(message[0], -1), message[1])
            elif operation.type == "ok":
                answered.add(by_op_id[operation.value["op_id"]])
    return {message: value for message, value in sent.items() if message not in answered}, highest


async def producer(options: argparse.Namespace, history: HistoryWriter, incarnation: int, stopping: trio.Event) -> None:
    name = options.name
    rng = random.Random(f"{options.seed}-{name}-{incarnation}")
    keys = [f"{name}-key-{index}" for index in range(KEYS_PER_PRODUCER)]
    unanswered, highest = unanswered_sends(options.work_dir, name, incarnation)
    op_ids = OpIds(incarnation)
    outstanding: set[str] = set()

    def settled(future, op_id: str) -> None:
        outstanding.discard(op_id)
        try:
            result = future.result()
        except BrokerError as error:
            history.append(name, "info", "produce", {"op_id": op_id, "error": error_text(error)})
            return
        message_id = result.message_id
        if message_id.is_duplicate:
            # The broker dropped it: an earlier send of this sequence id is stored.
            history.append(name, "ok", "produce", {"op_id": op_id, "duplicate": True, "message_id": None, "offset": None})
        else:
            history.append(name, "ok", "produce", {
                "op_id": op_id, "duplicate": False,
                "message_id": [message_id.ledger_id, message_id.entry_id, message_id.batch_index], "offset": result.offset,
            })

    async def send(topic_producer, partition: int, seq: int, key: str, payload: str, *, resend: bool) -> None:
        op_id = op_ids()
        history.append(name, "invoke", "produce", {"op_id": op_id, "producer": name, "partition": partition, "seq": seq,
                                                   "key": key, "payload": payload, "resend": resend})
        outstanding.add(op_id)
        future = None
        try:
            future = await topic_producer.send_async(payload.encode(), key=key, sequence_id=seq, partition=partition)
        except BrokerError as error:
            history.append(name, "info", "produce", {"op_id": op_id, "error": error_text(error)})
        finally:
            if future is None:
                outstanding.discard(op_id)
        if future is not None:
            future.add_done_callback(lambda done: settled(done, op_id))

    async def produce(topic_producer) -> None:
        # What earlier incarnations left unanswered goes first, in order, with
        # the same sequence ids: the broker stores each that it had not yet.
        for (partition, seq), value in sorted(unanswered.items()):
            await send(topic_producer, partition, seq, value["key"], value["payload"], resend=True)
        next_seq = {
            partition: max(highest.get(partition, -1), topic_producer.partitions[partition].last_persisted_sequence_id) + 1
            for partition in range(options.partitions)
        }
        while True:
            key = rng.choice(keys)
            partition = partition_for_key(key, options.partitions)
            seq = next_seq[partition]
            next_seq[partition] += 1
            await send(topic_producer, partition, seq, key, f"{name}:{partition}:{seq}", resend=False)
            await trio.sleep(rng.expovariate(options.rate))

    async with connect(options, rng) as client:
        topic_producer = None
        while topic_producer is None and not stopping.is_set():
            try:
                topic_producer = await client.create_producer(
                    options.topic, producer_id=name, batching=options.batching, batch_delay_ms=BATCH_DELAY_MS,
                    pending_messages_max=options.window,
                )
            except BrokerError as error:
                log.warning("creating the producer: %s", error_text(error))
                await trio.sleep(RETRY_DELAY_S)
        if topic_producer is None:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce, topic_producer)
            await stopping.wait()
            nursery.cancel_scope.cancel()
        # Stopping: what is on its way gets its answer (or stays indeterminate).
        with trio.move_on_after(STOP_FLUSH_S):
            while outstanding:
                await trio.sleep(0.05)


# --- consumers ----------------------------------------------------------------------


async def receive(consumer: Consumer, history: HistoryWriter, name: str, op_ids: OpIds, session: str, subscription: str,
                  idle_s: float) -> Message | None:
    """One receive, recorded with whether the session's queue was empty when
    it began (the checker relies on it), or as idle after `idle_s`."""
    op_id = op_ids()
    history.append(name, "invoke", "receive", {"op_id": op_id, "session": session})
    message = consumer.receive_nowait()
    waited = message is None
    if waited:
        with trio.move_on_after(idle_s):
            message = await consumer.receive()
    if message is None:
        history.append(name, "fail", "receive", {"op_id": op_id, "session": session, "error": f"nothing within {idle_s}s"})
        return None
    message_id = message.message_id
    history.append(name, "ok", "receive", {
        "op_id": op_id, "subscription": subscription, "session": session, "partition": message_id.partition,
        "offset": message.offset, "message_id": [message_id.ledger_id, message_id.entry_id, message_id.batch_index],
        "key": message.key, "producer": message.producer_id, "seq": message.sequence_id,
        "payload": bytes(message.data).decode(errors="replace"), "redelivery_count": message.redelivery_count,
        "waited": waited,
    })
    return message


class Acknowledgements:
    """A session's acknowledgements on their way, each recorded ok once the
    broker made it durable (info if it failed or the session ended first)."""

    def __init__(self, nursery: trio.Nursery, history: HistoryWriter, name: str, op_ids: OpIds, session: str,
                 subscription: str) -> None:
        self.nursery = nursery
        self.history = history
        self.name = name
        self.op_ids = op_ids
        self.session = session
        self.subscription = subscription
        self.in_flight = 0

    def acknowledge(self, consumer: Consumer, message: Message, *, cumulative: bool) -> None:
        op_id = self.op_ids()
        self.history.append(self.name, "invoke", "ack", {
            "op_id": op_id, "subscription": self.subscription, "session": self.session,
            "partition": message.message_id.partition, "offset": message.offset, "cumulative": cumulative,
        })
        # Taken at the call (a redelivery is dropped from now on); durable
        # when the awaitable returns.
        done = consumer.acknowledge_cumulative(message) if cumulative else consumer.acknowledge(message)
        self.in_flight += 1
        self.nursery.start_soon(self._settle, done, op_id)

    async def _settle(self, done, op_id: str) -> None:
        try:
            await done
        except BrokerError as error:
            self.history.append(self.name, "info", "ack", {"op_id": op_id, "error": error_text(error)})
        else:
            self.history.append(self.name, "ok", "ack", {"op_id": op_id})
        finally:
            self.in_flight -= 1

    async def settle(self, deadline_s: float) -> None:
        with trio.move_on_after(deadline_s):
            while self.in_flight:
                await trio.sleep(0.05)


async def subscribe(client: Client, history: HistoryWriter, name: str, op_ids: OpIds, options: argparse.Namespace,
                    subscription: str, kind: str, session: str, receiver_queue_size: int) -> Consumer | None:
    op_id = op_ids()
    history.append(name, "invoke", "subscribe", {"op_id": op_id, "subscription": subscription, "type": kind, "session": session})
    try:
        consumer = await client.subscribe(
            options.topic, subscription, kind, consumer_name=name, receiver_queue_size=receiver_queue_size,
            negative_ack_delay_ms=NEGATIVE_ACK_DELAY_MS, initial_position="earliest",
        )
    except BrokerError as error:
        # Partitions subscribed before the failing one stay subscribed until
        # the client closes: a new session gets a new client.
        history.append(name, "fail", "subscribe", {"op_id": op_id, "error": error_text(error)})
        return None
    history.append(name, "ok", "subscribe", {"op_id": op_id, "subscription": subscription, "session": session})
    return consumer


async def close(consumer: Consumer, history: HistoryWriter, name: str, op_ids: OpIds, session: str) -> None:
    op_id = op_ids()
    history.append(name, "invoke", "close", {"op_id": op_id, "session": session})
    with trio.move_on_after(ACK_SETTLE_S):
        await consumer.close()
        history.append(name, "ok", "close", {"op_id": op_id, "session": session})


async def consumer_session(options: argparse.Namespace, history: HistoryWriter, op_ids: OpIds, rng: random.Random,
                           session: str, stopping: trio.Event) -> None:
    name, subscription, kind = options.name, options.subscription, options.subscription_type
    length_s = rng.uniform(SESSION_S_MIN, SESSION_S_MAX)
    async with connect(options, rng) as client:
        consumer = await subscribe(client, history, name, op_ids, options, subscription, kind, session, RECEIVER_QUEUE_SIZE)
        if consumer is None:
            await trio.sleep(RETRY_DELAY_S)
            return
        async with trio.open_nursery() as acks_nursery:
            acks = Acknowledgements(acks_nursery, history, name, op_ids, session, subscription)
            async with trio.open_nursery() as receiving:
                async def end_on_stop() -> None:
                    await stopping.wait()
                    receiving.cancel_scope.cancel()

                receiving.start_soon(end_on_stop)
                receiving.cancel_scope.deadline = trio.current_time() + length_s
                while True:
                    message = await receive(consumer, history, name, op_ids, session, subscription, RECEIVE_IDLE_S)
                    if message is None:
                        continue
                    chance = rng.random()
                    if chance < NEGATIVE_ACK_PROBABILITY:
                        op_id = op_ids()
                        value = {"op_id": op_id, "session": session, "partition": message.message_id.partition, "offset": message.offset}
                        history.append(name, "invoke", "nack", value)
                        consumer.negative_acknowledge(message)
                        history.append(name, "ok", "nack", {"op_id": op_id})
                    elif chance >= NEGATIVE_ACK_PROBABILITY + UNACKNOWLEDGED_PROBABILITY:
                        cumulative = kind in ("exclusive", "failover") and rng.random() < CUMULATIVE_PROBABILITY
                        acks.acknowledge(consumer, message, cumulative=cumulative)
            await acks.settle(ACK_SETTLE_S)
            acks_nursery.cancel_scope.cancel()
        await close(consumer, history, name, op_ids, session)


async def consumer(options: argparse.Namespace, history: HistoryWriter, incarnation: int, stopping: trio.Event) -> None:
    rng = random.Random(f"{options.seed}-{options.name}-{incarnation}")
    op_ids = OpIds(incarnation)
    for number in itertools.count():
        if stopping.is_set():
            return
        await consumer_session(options, history, op_ids, rng, f"{options.name}.{incarnation}.{number}", stopping)


# --- the drain ----------------------------------------------------------------------


async def backlog_of(client: Client, topic: str, subscription: str) -> int | None:
    """Messages the subscription has not acknowledged, all partitions
    together, as their owners say; None when some partition did not answer."""
    try:
        stats = await client.topic_stats(topic)
    except BrokerError:
        return None
    backlog = 0
    for partition in stats["partitions"].values():
        described = partition.get("subscriptions", {}).get(subscription)
        if described is None:
            return None
        backlog += described["backlog_messages"]
    return backlog


async def drain_session(options: argparse.Namespace, history: HistoryWriter, op_ids: OpIds, rng: random.Random,
                        subscription: str, kind: str, session: str) -> int | None:
    """Receive and acknowledge everything until idle with no backlog left;
    returns the last backlog the broker reported (0: drained)."""
    name = options.name
    async with connect(options, rng) as client:
        consumer = await subscribe(client, history, name, op_ids, options, subscription, kind, session, DRAIN_RECEIVER_QUEUE_SIZE)
        if consumer is None:
            await trio.sleep(RETRY_DELAY_S)
            return None
        async with trio.open_nursery() as acks_nursery:
            acks = Acknowledgements(acks_nursery, history, name, op_ids, session, subscription)
            while True:
                message = await receive(consumer, history, name, op_ids, session, subscription, DRAIN_IDLE_S)
                if message is not None:
                    acks.acknowledge(consumer, message, cumulative=False)
                    continue
                await acks.settle(ACK_SETTLE_S)
                backlog = await backlog_of(client, options.topic, subscription)
                if backlog == 0:
                    break
            acks_nursery.cancel_scope.cancel()
        await close(consumer, history, name, op_ids, session)
        return backlog


async def drain(options: argparse.Namespace, history: HistoryWriter, incarnation: int, stopping: trio.Event) -> None:
    rng = random.Random(f"{options.seed}-{options.name}-{incarnation}")
    op_ids = OpIds(incarnation)
    deadline = trio.current_time() + options.deadline_s

    async def drain_one(subscription: str, kind: str) -> None:
        op_id = op_ids()
        history.append(options.name, "invoke", "drain", {"op_id": op_id, "subscription": subscription, "type": kind})
        backlog = None
        with trio.move_on_at(deadline):
            for attempt in itertools.count():
                backlog = await drain_session(options, history, op_ids, rng, subscription, kind,
                                              f"{options.name}.{incarnation}.{subscription}.{attempt}")
                if backlog == 0:
                    break
        history.append(options.name, "ok", "drain", {"op_id": op_id, "subscription": subscription, "complete": backlog == 0,
                                                     "backlog": backlog})

    async with trio.open_nursery() as nursery:
        async def cancel_on_stop() -> None:
            # Stopped before its deadline: what was not drained has no record.
            await stopping.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(cancel_on_stop)
        async with trio.open_nursery() as drains:
            for subscription, kind in json.loads(options.subscriptions).items():
                drains.start_soon(drain_one, subscription, kind)
        nursery.cancel_scope.cancel()


ROLES = {"producer": producer, "consumer": consumer, "drain": drain}


async def main_async(options: argparse.Namespace) -> None:
    incarnation = next_incarnation(options.work_dir, options.name)
    # Times are taken from the controller's start, on the shared monotonic clock.
    with HistoryWriter(history_path(options.work_dir, options.name, incarnation), origin_s=options.start_monotonic) as history:
        # A signal asks the role to stop, which it does in its own way (a
        # producer first waits for the answers on their way).
        stopping = trio.Event()
        async with role_nursery(stopping.set):
            await ROLES[options.role](options, history, incarnation, stopping)


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = client_parser("python -m sim.jepsen.broker_client", ROLES, name_help="also the listener it dials the brokers by")
    parser.add_argument("--service-url", required=True, help="HOST:PORT,...: this client's proxies to the brokers")
    parser.add_argument("--work-dir", type=Path, required=True, help="where its history files go")
    parser.add_argument("--topic", default="jepsen")
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--rate", type=float, default=40.0, help="producer: messages per second")
    parser.add_argument("--window", type=int, default=200, help="producer: messages sent and not yet answered")
    parser.add_argument("--batching", action="store_true", help="producer: batch messages")
    parser.add_argument("--subscription", help="consumer: the subscription")
    parser.add_argument("--subscription-type", choices=["exclusive", "failover", "shared", "key_shared"])
    parser.add_argument("--subscriptions", default="{}", help="drain: JSON, subscription -> type")
    parser.add_argument("--deadline-s", type=float, default=180.0, help="drain: give up after this long")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_client(parse_arguments, main_async, argv)


if __name__ == "__main__":
    sys.exit(main())
