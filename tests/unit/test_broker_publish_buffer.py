"""The broker's publish buffer: the bytes of producers' batches taken and not
yet answered, all partitions together. First the accounting core (pause past
the bound, resume at half, a permit released once), then a partition driven
over a stand-in ledger: every path that ends a batch gives its bytes back."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import trio

from broker import topic
from broker.entry_cache import EntryCache, Position
from broker.errors import BadRequestError, BrokerStatus, TopicFencedError
from broker.codecs import Codec
from broker.pulsar_message import OutMessage, build_batch
from broker.protocol import Send
from broker.publish_buffer import PublishBuffer, PublishPermit, batch_cost_bytes
from broker.topic import BrokerContext, PartitionService, ProducerLink
from broker.topic_records import TopicPolicies

DEADLINE_S = 10.0

# --- the accounting core ---------------------------------------------------------------


def test_the_buffer_pauses_past_its_bound_and_resumes_at_half():
    # Bound 100: 60 + 50 passes it (paused); giving back 50 leaves 60, above
    # half, still paused; giving back 60 resumes it, once.
    resumed = []
    buffer = PublishBuffer(100, on_resume=lambda: resumed.append(buffer.bytes))
    first = buffer.take(60)
    assert not buffer.paused and buffer.bytes == 60
    second = buffer.take(50)
    assert buffer.paused and buffer.bytes == 110 and buffer.batches == 2 and buffer.pauses == 1
    second.release()
    assert buffer.paused and buffer.bytes == 60 and resumed == []
    first.release()
    assert not buffer.paused and buffer.bytes == 0 and buffer.batches == 0 and resumed == [0]


def test_the_buffer_resumes_as_soon_as_half_is_left():
    resumed = []
    buffer = PublishBuffer(100, on_resume=lambda: resumed.append(buffer.bytes))
    permits = [buffer.take(30) for _ in range(4)]  # 120: paused
    permits[0].release()  # 90
    permits[1].release()  # 60
    assert buffer.paused and resumed == []
    permits[2].release()  # 30, under half
    assert not buffer.paused and resumed == [30]
    buffer.take(80)  # 110 again: paused a second time
    assert buffer.paused and buffer.pauses == 2


def test_a_permit_is_released_once_whatever_calls_it():
    buffer = PublishBuffer(100)
    permit = buffer.take(40)
    other = buffer.take(10)
    permit.release()
    permit.release()
    assert permit.released and buffer.bytes == 10 and buffer.batches == 1
    other.release()
    assert buffer.bytes == 0 and buffer.batches == 0


def test_a_batch_larger_than_the_bound_is_taken_and_pauses():
    # The bound stops reading, it never refuses a batch already read.
    buffer = PublishBuffer(10)
    permit = buffer.take(1000)
    assert buffer.paused
    permit.release()
    assert not buffer.paused


def test_bad_bounds_and_sizes_are_refused():
    with pytest.raises(ValueError):
        PublishBuffer(0)
    with pytest.raises(ValueError):
        PublishBuffer(10).take(-1)
    unbounded = PublishPermit.unbounded(5)
    unbounded.release()
    assert unbounded.released


# --- a partition's paths: every batch gives its bytes back ------------------------------


class StandInLedger:
    """What a partition asks of its managed ledger: appends are held until
    the test persists or fails them; `stalled` makes appends wait (a ledger
    with no room, bookies gone)."""

    def __init__(self) -> None:
        self.rollover_due = trio.Event()
        self.stored_bytes = 0
        self.next_offset = 0
        self.pending: list = []  # (done, first_offset, entry bytes)
        self.refuse: Exception | None = None
        self.stalled = trio.Event()
        self.stalled.set()  # set: appends go through

    def rollover_reason(self):
        return None

    async def trim(self, held_from_offset):
        return []

    async def append(self, make_entry, message_count, on_done, on_pushed) -> int:
        await self.stalled.wait()
        if self.refuse is not None:
            raise self.refuse
        first_offset = self.next_offset
        data = make_entry(first_offset, 0)
        self.next_offset += message_count
        on_pushed()
        self.pending.append((on_done, first_offset, data))
        return first_offset

    def persist_all(self) -> None:
        pending, self.pending = self.pending, []
        for entry_id, (on_done, first_offset, _) in enumerate(pending):
            on_done(Position(1, entry_id), first_offset, None)

    def fail_all(self, error) -> None:
        pending, self.pending = self.pending, []
        for on_done, first_offset, _ in pending:
            on_done(None, first_offset, error)


class Harness:
    def __init__(self, monkeypatch, *, queue_batches_max: int = 1_000, policies: TopicPolicies | None = None) -> None:
        monkeypatch.setattr(topic, "PUBLISH_QUEUE_BATCHES_MAX", queue_batches_max)
        self.buffer = PublishBuffer(1 << 20)
        self.unloads: list = []
        store = SimpleNamespace(read_topic=self._no_topic)
        context = BrokerContext(None, store, b"", EntryCache(1 << 20), lambda service, error: self.unloads.append(error),
                                retention_check_interval_s=3600)
        self.service = PartitionService(context, "t", "t", -1, policies or TopicPolicies(), session_id=1)
        self.ledger = self.service.managed_ledger = StandInLedger()
        self.receipts: list = []
        self.link = ProducerLink(1, "producer-1", self.receipts.append)

    @staticmethod
    async def _no_topic(name):
        return None

    def send(self, sequence_id: int, payload: bytes = b"x" * 100, *, malformed: bool = False) -> Send:
        body = build_batch(self.link.producer_id, 0, [OutMessage(sequence_id, payload)], Codec.NONE, batched=False)
        # Malformed: it says it holds two messages, its body holds one.
        return Send(1, sequence_id, sequence_id + 1 if malformed else sequence_id, 2 if malformed else 1, body)

    def keyed_send(self, first_sequence_id: int, keys: list[str]) -> Send:
        """One batch of len(keys) 1-byte messages, one key each."""
        messages = [OutMessage(first_sequence_id + index, b"x", key) for index, key in enumerate(keys)]
        last_sequence_id = first_sequence_id + len(keys) - 1
        return Send(1, first_sequence_id, last_sequence_id, len(keys), build_batch(self.link.producer_id, 0, messages, Codec.NONE))

    async def publish(self, send: Send) -> None:
        # As the server takes it.
        await self.service.publish(self.link, send, self.buffer.take(batch_cost_bytes(send.body, send.message_count)))

    def statuses(self) -> list[str]:
        return [BrokerStatus(receipt.status).name for receipt in self.receipts]

    async def settle(self) -> None:
        await trio.testing.wait_all_tasks_blocked()


async def test_persisted_duplicate_and_in_flight_batches_give_their_bytes_back(monkeypatch):
    harness = Harness(monkeypatch)
    with trio.fail_after(DEADLINE_S):  # a batch left waiting fails, not hangs
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.service.run)
            await harness.publish(harness.send(0))
            await harness.publish(harness.send(1))
            await harness.settle()
            assert harness.buffer.batches == 2 and harness.buffer.bytes > 0  # handed to the ledger, not answered
            await harness.publish(harness.send(1))  # being written: RETRY
            await harness.settle()
            assert harness.statuses() == ["RETRY"] and harness.buffer.batches == 2
            harness.ledger.persist_all()
            assert harness.buffer.batches == 0 and harness.buffer.bytes == 0
            await harness.publish(harness.send(0))  # persisted before: DUPLICATE
            await harness.settle()
            assert harness.statuses() == ["RETRY", "OK", "OK", "DUPLICATE"]
            assert harness.buffer.bytes == 0
            nursery.cancel_scope.cancel()


async def test_refused_and_failed_batches_give_their_bytes_back(monkeypatch):
    harness = Harness(monkeypatch, policies=TopicPolicies(backlog_quota_bytes=1_000, retention_model="ydb"))
    with trio.fail_after(DEADLINE_S):  # a batch left waiting fails, not hangs
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.service.run)
            await harness.publish(harness.send(0, malformed=True))  # malformed: refused before the queue
            await harness.publish(harness.send(1))
            await harness.settle()
            harness.ledger.fail_all(TopicFencedError("ledger failed"))  # a failed write
            harness.ledger.refuse = BadRequestError("too large")  # the ledger refuses the entry
            await harness.publish(harness.send(2))
            await harness.settle()
            harness.ledger.refuse = None
            harness.ledger.stored_bytes = 2_000  # past the backlog quota
            await harness.publish(harness.send(3))
            await harness.settle()
            assert harness.statuses() == ["BAD_REQUEST", "TOPIC_FENCED", "BAD_REQUEST", "PARTITION_OVERFLOW"]
            assert harness.buffer.bytes == 0 and harness.buffer.batches == 0
            nursery.cancel_scope.cancel()


async def test_a_partition_that_stops_with_batches_queued_answers_them_and_gives_their_bytes_back(monkeypatch):
    # The ledger is stalled: one batch waits in the appender, two in the
    # queue (its bound), a fourth connection waits for room. The partition
    # is fenced and unloaded: every one is answered TOPIC_FENCED (or, for
    # the one in the appender, dropped unanswered, as before: its producer
    # is told to look the partition up again) and every byte comes back.
    harness = Harness(monkeypatch, queue_batches_max=2)
    harness.ledger.stalled = trio.Event()
    with trio.fail_after(DEADLINE_S):  # a batch left waiting fails, not hangs
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.service.run)
            for sequence_id in range(3):
                await harness.publish(harness.send(sequence_id))
            nursery.start_soon(harness.publish, harness.send(3))
            await harness.settle()
            assert harness.buffer.batches == 4 and harness.receipts == []
            harness.service.fence(TopicFencedError("lost the ledger"))
            await harness.service.unload(graceful=True)
            await harness.settle()
        assert harness.statuses() == ["TOPIC_FENCED"] * 3
        assert harness.buffer.bytes == 0 and harness.buffer.batches == 0
        # A batch for the stopped partition is answered at once.
        await harness.publish(harness.send(4))
        assert harness.statuses() == ["TOPIC_FENCED"] * 4 and harness.buffer.bytes == 0


async def test_a_connection_closed_while_its_batch_waits_for_room_gives_the_bytes_back(monkeypatch):
    harness = Harness(monkeypatch, queue_batches_max=1)
    harness.ledger.stalled = trio.Event()
    with trio.fail_after(DEADLINE_S):  # a batch left waiting fails, not hangs
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.service.run)
            await harness.publish(harness.send(0))  # in the appender
            await harness.publish(harness.send(1))  # in the queue
            connection = trio.CancelScope()  # the connection's read loop

            async def read_loop() -> None:
                with connection:
                    await harness.publish(harness.send(2))  # waits for room

            nursery.start_soon(read_loop)
            await harness.settle()
            assert harness.buffer.batches == 3
            connection.cancel()  # the connection goes
            await harness.settle()
            assert harness.buffer.batches == 2 and harness.receipts == []
            # The stalled ledger comes back: the two taken are persisted.
            harness.ledger.stalled.set()
            await harness.settle()
            harness.ledger.persist_all()
            assert harness.statuses() == ["OK", "OK"] and harness.buffer.bytes == 0
            nursery.cancel_scope.cancel()


async def test_a_keyed_batch_counts_its_keys_until_it_is_answered(monkeypatch):
    # 10,000 messages of 1 byte, each with its own 5-character key: checked,
    # the keys are 10,000 string objects in a tuple, several times the bytes
    # they took in the body. The buffer counts them, and gives them all back
    # once the batch is persisted.
    keys = [f"k{index:04d}" for index in range(10_000)]
    harness = Harness(monkeypatch)
    send = harness.keyed_send(0, keys)
    cost = batch_cost_bytes(send.body, send.message_count)
    strings_bytes = sum(map(sys.getsizeof, keys))
    assert cost >= len(send.body) + strings_bytes + 8 * len(keys)  # the strings and a slot each in the tuple
    assert cost > 2 * len(send.body)
    with trio.fail_after(DEADLINE_S):  # a batch left waiting fails, not hangs
        async with trio.open_nursery() as nursery:
            await nursery.start(harness.service.run)
            await harness.publish(send)
            await harness.settle()
            assert harness.buffer.batches == 1 and harness.buffer.bytes == cost
            harness.ledger.persist_all()
            assert harness.statuses() == ["OK"] and harness.buffer.bytes == 0 and harness.buffer.batches == 0
            nursery.cancel_scope.cancel()
