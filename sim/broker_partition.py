"""One simulated broker's load of the partition: the real `Dedup`, `Cursor`
and `Dispatcher` cores driven as `broker/topic.py` and
`broker/subscription.py` drive them, over the simulated log and metadata
store. Loading opens (fences) the log, rebuilds the deduplication map from
its snapshot and the entries after it, and reads the durable cursor;
publishing checks deduplication, appends and answers once persisted;
acknowledgements are answered once a cursor write covering them is
durable (`sim.broker_subscription`). Any failed write fences the load:
the broker unloads it. Where the trio driver does otherwise, a comment
says so.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from broker.cursor import Cursor
from broker.dedup import Dedup, DedupSnapshot, Verdict
from broker.dispatcher import Dispatcher, SubscriptionType
from broker.errors import BrokerStatus
from broker.topic_store import cursor_path, dedup_path, managed_ledger_path
from coordination.store import NoNodeError
from sim.broker_log import LogEntry
from sim.broker_messages import PARTITION, SUBSCRIPTION, Closed, Send, SendReceipt

if TYPE_CHECKING:
    from sim.broker_links import Connection
    from sim.broker_node import SimBroker
    from sim.broker_subscription import SimSubscription

LOAD_STEP_MS_MAX = 20.0  # ledger recovery and the like while loading

Respond = Callable[..., None]


@dataclass(slots=True)
class ProducerLink:
    connection: "Connection"
    handle: int
    producer_id: str


@dataclass(slots=True)
class ConsumerLink:
    connection: "Connection"
    handle: int
    consumer_id: int
    name: str


def write_versioned(path: str, record: dict, expected_version: int | None,
                    on_written: Callable[[], None] = lambda: None):
    """`TopicStore._write_versioned` as a metadata call: create when there
    is no version yet, else compare-and-set; returns the new version.
    `on_written` runs where the write takes effect (for the checkers)."""
    data = json.dumps(record, separators=(",", ":")).encode()

    def write(store) -> int:
        if expected_version is None:
            store.create(path, data, make_parents=True)
            version = 0
        else:
            version = store.set(path, data, expected_version).version
        on_written()
        return version

    return write


def read_versioned(path: str):
    def read(store) -> tuple[dict, int] | None:
        try:
            data, stat = store.get(path)
        except NoNodeError:
            return None
        return json.loads(data), stat.version

    return read


class SimPartition:
    """PartitionService's bookkeeping for one load (`instance`) of the partition."""

    dedup_class: type[Dedup] = Dedup

    def __init__(self, broker: "SimBroker", instance: str, session_id: int, *,
                 subscription_class: "type[SimSubscription]", dispatcher_class: type[Dispatcher]) -> None:
        self.broker = broker
        self.instance = instance
        self.session_id = session_id  # the ZooKeeper session that claimed it
        self.subscription_class = subscription_class
        self.dispatcher_class = dispatcher_class
        parameters = broker.parameters
        self.snapshot_entries = parameters.dedup_snapshot_entries  # DEDUP_SNAPSHOT_ENTRIES in broker/topic.py
        self.epoch = -1
        self.entries: list[LogEntry] = []  # persisted, as this load knows them
        self._first_offsets: list[int] = []
        self.next_offset = 0
        self.confirmed_offset = -1
        self.dedup: Dedup = self.dedup_class()
        self.producers: dict[str, ProducerLink] = {}
        self.subscription: "SimSubscription | None" = None
        self._cursor_loaded: tuple[dict, int] | None = None
        self._creating: list[tuple[ConsumerLink, str, int, Respond]] | None = None  # subscribes waiting for the cursor's creation
        self.serving = False
        self.fenced: str | None = None
        self._dedup_version: int | None = None
        self._dedup_pending: DedupSnapshot | None = None
        self._dedup_written: DedupSnapshot | None = None
        self._dedup_writing = False
        self._entries_since_snapshot = 0
        self.replayed = 0

    # --- loading ------------------------------------------------------------------------------

    def load(self, on_loaded: Callable[[str | None], None]) -> None:
        """Open the log (fencing the previous owner), rebuild the
        deduplication map, read the cursor; `on_loaded(None)` or the error."""
        broker = self.broker

        def failed(error: Exception) -> None:
            on_loaded(f"{type(error).__name__}: {error}")

        # The managed ledger's record first (a broker whose session is gone
        # fails here, before fencing anyone), then recovery of the log.
        def record_read(result: Any, error: Exception | None) -> None:
            if error is not None:
                return failed(error)
            broker.after(broker.world.uniform(0.1, LOAD_STEP_MS_MAX), log_open)

        def log_open() -> None:
            self.epoch, self.entries = broker.log.open()
            self._first_offsets = [entry.first_offset for entry in self.entries]
            self.next_offset = self.entries[-1].last_offset + 1 if self.entries else 0
            self.confirmed_offset = self.next_offset - 1
            broker.zk_call(read_versioned(dedup_path(PARTITION)), dedup_read, "read dedup snapshot")

        def dedup_read(result: Any, error: Exception | None) -> None:
            if error is not None:
                return failed(error)
            self._rebuild_dedup(result)
            if not self.entries:
                return read_cursor()
            # The snapshot of what this owner starts from, written at once:
            # its version moves on, fencing a previous owner's late write.
            last = self.entries[-1]
            snapshot = self.dedup.snapshot(last.ledger_id, last.entry_id)
            broker.zk_call(write_versioned(dedup_path(PARTITION), snapshot.to_record(), self._dedup_version),
                           dedup_written, f"write dedup snapshot at load {last.ledger_id}:{last.entry_id}")

        def dedup_written(result: Any, error: Exception | None) -> None:
            if error is not None:
                return failed(error)
            self._dedup_version = result
            read_cursor()

        def read_cursor() -> None:
            broker.zk_call(read_versioned(cursor_path(PARTITION, SUBSCRIPTION)), cursor_read, "read cursor")

        def cursor_read(result: Any, error: Exception | None) -> None:
            if error is not None:
                return failed(error)
            if result is None:
                return serve()
            record, version = result
            # Written once now, before anything is dispatched (as the dedup
            # snapshot above).
            checker, ranges_max = broker.checker, broker.parameters.cursor_ranges_max
            write = write_versioned(cursor_path(PARTITION, SUBSCRIPTION), record, version,
                                    lambda: checker.cursor_written(record, ranges_max))
            broker.zk_call(write, lambda written, write_error: cursor_written(record, written, write_error),
                           f"write cursor at load v{version}")

        def cursor_written(record: dict, version: Any, error: Exception | None) -> None:
            if error is not None:
                return failed(error)
            self._start_subscription(SubscriptionType.parse(record["type"]), Cursor.from_record(record), version)
            serve()

        def serve() -> None:
            self.serving = True
            on_loaded(None)

        broker.zk_call(lambda store: store.exists(managed_ledger_path(PARTITION)), record_read, "read managed ledger")

    def _rebuild_dedup(self, stored: tuple[dict, int] | None) -> None:
        """As `PartitionService._rebuild_dedup`: the snapshot, then every entry after it."""
        snapshot = None
        if stored is not None:
            record, self._dedup_version = stored
            snapshot = DedupSnapshot.from_record(record)
        self.dedup = self.dedup_class.from_snapshot(snapshot)
        start = 0
        if snapshot is not None:
            for index, entry in enumerate(self.entries):
                if (entry.ledger_id, entry.entry_id) == (snapshot.ledger_id, snapshot.entry_id):
                    start = index + 1
                    break
        for entry in self.entries[start:]:
            self.dedup.replayed(entry.producer_id, entry.last_sequence_id)
        self.replayed = len(self.entries) - start
        self.broker.world.log(f"{self.instance} dedup: snapshot {None if snapshot is None else (snapshot.ledger_id, snapshot.entry_id)}, "
                              f"{self.replayed} entries replayed")

    # --- producers ------------------------------------------------------------------------------

    def add_producer(self, link: ProducerLink) -> tuple[BrokerStatus, int]:
        if not self.serving or self.fenced is not None:
            return BrokerStatus.TOPIC_FENCED, -1
        if link.producer_id in self.producers:
            return BrokerStatus.PRODUCER_BUSY, -1
        last_sequence_id = self.last_sequence_id_for(link.producer_id)
        if last_sequence_id is None:
            return BrokerStatus.SERVICE_UNAVAILABLE, -1
        self.producers[link.producer_id] = link
        return BrokerStatus.OK, last_sequence_id

    def last_sequence_id_for(self, producer_id: str) -> int | None:
        """What a (re)connecting producer must continue after, once it is
        known: None while a batch of an earlier connection is still being
        written (the producer asks again), as broker/topic.py waits for
        those batches before it answers. Answering at once goes wrong either
        way: with the last id persisted or being written
        (`Dedup.last_taken`), a batch being written may then fail, and a
        producer started again after a crash never sends its messages
        (`resume-after-last-taken` in sim.broker_mistakes); with the last
        persisted id, it sends them again in batches that overlap the one
        being written, persisted twice (`resume-after-last-persisted`)."""
        last_persisted = self.dedup.last_persisted(producer_id)
        return last_persisted if self.dedup.last_taken(producer_id) == last_persisted else None

    def remove_producer(self, link: ProducerLink) -> None:
        if self.producers.get(link.producer_id) is link:
            del self.producers[link.producer_id]

    def judged_sequence_id(self, send: Send) -> int:
        """The sequence id deduplication judges a batch by: its highest."""
        return send.last_sequence_id

    def publish(self, link: ProducerLink, send: Send) -> None:
        broker = self.broker

        def answer(status: BrokerStatus, first_offset: int = -1, detail: str = "") -> None:
            broker.send_to(link.connection, SendReceipt(link.handle, send.last_sequence_id, status, first_offset, detail))

        if self.fenced is not None or not self.serving:
            return answer(BrokerStatus.TOPIC_FENCED, detail="partition unloaded")
        producer_id, sequence_id = link.producer_id, self.judged_sequence_id(send)
        verdict = self.dedup.check(producer_id, sequence_id)
        if verdict is Verdict.DUPLICATE:
            return answer(BrokerStatus.DUPLICATE)
        if verdict is Verdict.IN_FLIGHT:
            return answer(BrokerStatus.RETRY)
        self.dedup.pushed(producer_id, sequence_id)
        first_offset = self.next_offset
        self.next_offset += len(send.sequence_ids)

        def done(entry: LogEntry | None) -> None:
            # A completion reaches the broker as any event does: not at all
            # after a crash, once it runs again after a pause.
            broker.after(0, self._append_done, producer_id, sequence_id, entry, answer)

        broker.log.append(self.epoch, producer_id, send.sequence_ids, send.keys, first_offset, done)

    def _append_done(self, producer_id: str, sequence_id: int, entry: LogEntry | None, answer: Respond) -> None:
        if entry is None:
            self.dedup.failed(producer_id)
            self.fence("an append failed")
            return answer(BrokerStatus.TOPIC_FENCED, detail="append failed")
        self.entries.append(entry)
        self._first_offsets.append(entry.first_offset)
        self.confirmed_offset = entry.last_offset
        self.dedup.persisted(producer_id, sequence_id)
        self._entries_since_snapshot += 1
        if self._entries_since_snapshot >= self.snapshot_entries:
            self._entries_since_snapshot = 0
            self._dedup_pending = self.dedup.snapshot(entry.ledger_id, entry.entry_id)
            self._write_dedup_snapshot()
        answer(BrokerStatus.OK, entry.first_offset)
        if self.subscription is not None:
            self.subscription.wake()

    def _write_dedup_snapshot(self) -> None:
        """One write at a time, of the newest snapshot (`_dedup_snapshot_loop`)."""
        snapshot = self._dedup_pending
        if self._dedup_writing or snapshot is None or snapshot is self._dedup_written or self.fenced is not None:
            return
        self._dedup_writing = True

        def written(result: Any, error: Exception | None) -> None:
            self._dedup_writing = False
            if error is not None:
                return self.fence(f"deduplication snapshot write failed: {type(error).__name__}")
            self._dedup_version = result
            self._dedup_written = snapshot
            self._write_dedup_snapshot()

        self.broker.zk_call(write_versioned(dedup_path(PARTITION), snapshot.to_record(), self._dedup_version), written,
                            f"write dedup snapshot at {snapshot.ledger_id}:{snapshot.entry_id}")

    # --- the subscription -----------------------------------------------------------------------

    def _start_subscription(self, kind: SubscriptionType, cursor: Cursor, version: int) -> None:
        self.subscription = self.subscription_class(self, kind, cursor, version)
        self.broker.checker.serving_started(self.instance, kind)

    def subscribe(self, link: ConsumerLink, subscription_type: str, priority: int, respond: Respond) -> None:
        if not self.serving or self.fenced is not None:
            return respond(BrokerStatus.TOPIC_FENCED)
        if self.subscription is not None:
            return respond(self.subscription.add_consumer(link, SubscriptionType.parse(subscription_type), priority))
        if self._creating is not None:
            self._creating.append((link, subscription_type, priority, respond))
            return
        # A new durable subscription is written before its consumer hears of
        # it, at the earliest position (offset 0: nothing is trimmed here).
        self._creating = [(link, subscription_type, priority, respond)]
        kind = SubscriptionType.parse(subscription_type)
        cursor = Cursor.at(0)
        record = {**cursor.to_record(), "type": kind.value}

        def created(result: Any, error: Exception | None) -> None:
            waiting, self._creating = self._creating or [], None
            if error is not None:
                self.fence(f"creating the cursor failed: {type(error).__name__}")
                for *_, respond_later in waiting:
                    respond_later(BrokerStatus.TOPIC_FENCED)
                return
            if self.fenced is not None:
                for *_, respond_later in waiting:
                    respond_later(BrokerStatus.TOPIC_FENCED)
                return
            self._start_subscription(kind, cursor, result)
            for waiting_link, waiting_type, waiting_priority, respond_later in waiting:
                respond_later(self.subscription.add_consumer(waiting_link, SubscriptionType.parse(waiting_type), waiting_priority))

        self.broker.zk_call(write_versioned(cursor_path(PARTITION, SUBSCRIPTION), record, None), created, "create cursor")

    def entry_index_of(self, offset: int) -> int:
        """The index in `entries` of the entry holding `offset` (len when beyond)."""
        return max(0, bisect.bisect_right(self._first_offsets, offset) - 1) if offset <= self.confirmed_offset else len(self.entries)

    # --- fencing ------------------------------------------------------------------------------

    def fence(self, reason: str) -> None:
        """Stop: something failed that only a fresh load can settle."""
        if self.fenced is not None:
            return
        self.fenced = reason
        self.broker.world.log(f"{self.instance} fenced: {reason}")
        self.broker.unload(self)

    def close_clients(self) -> None:
        """Unloading: tell every producer and consumer to look the partition up again."""
        broker = self.broker
        if self.subscription is not None:
            self.subscription.close()
        for link in sorted(self.producers.values(), key=lambda link: link.producer_id):
            broker.send_to(link.connection, Closed(link.handle, "partition moved"))
        self.producers.clear()
        if self._creating:
            for link, *_, respond in self._creating:
                respond(BrokerStatus.TOPIC_FENCED)
            self._creating = None
