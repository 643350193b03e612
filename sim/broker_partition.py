"""One simulated broker's load of the partition: a driver of the real
`PublishCore` (producers, deduplication, snapshots) and, through
`sim.broker_subscription`, of the real `SubscriptionCore`, as
`broker/topic.py` drives them with trio, over the simulated log and
metadata store. Loading opens (fences) the log, rebuilds the deduplication
map from its snapshot and the entries after it, and reads the durable
cursor; publishing asks the core, appends and answers once persisted. Any
failed write fences the load: the broker unloads it.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable

from broker.cursor import Cursor
from broker.dedup import DedupSnapshot
from broker.dispatcher import SubscriptionType
from broker.errors import BrokerStatus
from broker.publish_core import Judgement, ProducerAnswer, PublishCore
from broker.topic_records import cursor_path, dedup_path
from sim.broker_calls import BrokerView, ConsumerLink, ProducerLink, Respond, read_versioned, write_versioned
from sim.broker_calls import LogEntry
from sim.broker_ledger import SimManagedLedger
from sim.broker_messages import PARTITION, SUBSCRIPTION, Closed, Send, SendReceipt


UNLOAD_WRITES_MS = 10_000.0  # UNLOAD_WRITES_S of broker/topic.py: a graceful unload's writes wait at most this long

_PRODUCER_STATUS = {
    ProducerAnswer.OK: BrokerStatus.OK,
    ProducerAnswer.BUSY: BrokerStatus.PRODUCER_BUSY,
    ProducerAnswer.WAIT: BrokerStatus.SERVICE_UNAVAILABLE,  # the producer asks again
    ProducerAnswer.FENCED: BrokerStatus.TOPIC_FENCED,
}


class SimPartition:
    """PartitionService's bookkeeping for one load (`instance`) of the partition."""

    def __init__(self, broker: BrokerView, instance: str, session_id: int) -> None:
        self.broker = broker
        self.instance = instance
        self.session_id = session_id  # the ZooKeeper session that claimed it
        self.publishing: PublishCore[ProducerLink] = broker.publish_core_class(
            instance, snapshot_entries=broker.parameters.dedup_snapshot_entries)
        self.ledger = SimManagedLedger(broker, broker.policies, on_fenced=self.fence,
                                       on_persisted=broker.checker.entry_persisted)
        self.entries: list[LogEntry] = []  # persisted, as this load knows them (the entry cache)
        self._first_offsets: list[int] = []
        self.confirmed_offset = -1
        self.subscription: Any = None
        self._cursor_loaded: tuple[dict, int] | None = None
        self._creating: list[tuple[ConsumerLink, str, int, Respond]] | None = None  # subscribes waiting for the cursor's creation
        self.serving = False
        self.fenced: str | None = None

    # --- loading ------------------------------------------------------------------------------

    def load(self, on_loaded: Callable[[str | None], None]) -> None:
        """Open the managed ledger (fencing the previous owner), rebuild the
        deduplication map, read the cursor; `on_loaded(None)` or the error."""
        broker = self.broker

        def failed(error: Exception | str) -> None:
            on_loaded(error if isinstance(error, str) else f"{type(error).__name__}: {error}")

        def opened(error: str | None, entries: list[LogEntry]) -> None:
            if error is not None:
                return failed(error)
            self.entries = list(entries)
            self._first_offsets = [entry.first_offset for entry in self.entries]
            self.confirmed_offset = self.ledger.core.confirmed_offset
            broker.zk_call(read_versioned(dedup_path(PARTITION)), dedup_read, "read dedup snapshot")

        def dedup_read(result: Any, error: Exception | None) -> None:
            if error is not None:
                return failed(error)
            self._rebuild_dedup(result)
            # The snapshot of what this owner starts from, written at once:
            # its version moves on, fencing a previous owner's late write.
            last = self.entries[-1] if self.entries else None
            snapshot = self.publishing.loaded(None if last is None else (last.ledger_id, last.entry_id))
            if snapshot is None:
                return read_cursor()
            self._write_snapshot(snapshot, lambda: read_cursor(), failed)

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
            subscription = broker.subscription_class(self, SubscriptionType.parse(record["type"]), Cursor.from_record(record), version)
            subscription.write_now(lambda write_error: cursor_written(subscription, write_error))

        def cursor_written(subscription: Any, error: Exception | None) -> None:
            if error is not None:
                return failed(error)
            self._start_subscription(subscription)
            serve()

        def serve() -> None:
            self.serving = True
            on_loaded(None)

        self.ledger.open(opened)

    def _rebuild_dedup(self, stored: tuple[dict, int] | None) -> None:
        """As `PartitionService._rebuild_dedup`: the snapshot, then every entry after it."""
        publishing = self.publishing
        covered = publishing.restore(stored)
        start = 0
        if covered is not None:
            for index, entry in enumerate(self.entries):
                if (entry.ledger_id, entry.entry_id) == covered:
                    start = index + 1
                    break
        for entry in self.entries[start:]:
            publishing.replayed(entry.producer_id, entry.last_sequence_id)
        self.broker.world.log(f"{self.instance} dedup: snapshot {covered}, {publishing.replayed_entries} entries replayed")

    # --- producers ------------------------------------------------------------------------------

    @property
    def producers(self) -> dict[str, ProducerLink]:
        return self.publishing.producers

    def add_producer(self, link: ProducerLink) -> tuple[BrokerStatus, int]:
        """A producer is told what to continue after once none of its
        batches of an earlier connection is unanswered (it asks again
        meanwhile), as broker/topic.py waits for them (`PublishCore.add_producer`)."""
        if not self.serving:
            return BrokerStatus.TOPIC_FENCED, -1
        answer, last_sequence_id = self.publishing.add_producer(link.producer_id, link)
        return _PRODUCER_STATUS[answer], last_sequence_id

    def remove_producer(self, link: ProducerLink) -> None:
        self.publishing.remove_producer(link.producer_id, link)

    def publish(self, link: ProducerLink, send: Send) -> None:
        """A producer's batch: judged by the core right before it goes to the
        ledger (batches go in the order they came, waiting while the chain
        changes, as broker/topic.py's appender takes them), answered once
        persisted."""
        broker, publishing = self.broker, self.publishing

        def answer(status: BrokerStatus, first_offset: int = -1, detail: str = "") -> None:
            publishing.finished(producer_id)
            broker.send_to(link.connection, SendReceipt(link.handle, send.last_sequence_id, status, first_offset, detail))

        producer_id, first_sequence_id, last_sequence_id = link.producer_id, send.first_sequence_id, send.last_sequence_id
        publishing.taken(producer_id)
        if not self.serving:
            return answer(BrokerStatus.TOPIC_FENCED, detail="partition unloaded")

        judged: list[Judgement] = []

        def admit() -> bool:
            judgement = publishing.judge(producer_id, first_sequence_id, last_sequence_id, stored_bytes=0, backlog_quota_bytes=None)
            if judgement.status is not BrokerStatus.OK:
                answer(judgement.status, detail=judgement.detail)
                return False
            publishing.pushed(producer_id, first_sequence_id, last_sequence_id, judgement)
            judged.append(judgement)
            return True

        def done(entry: LogEntry | None, pushed: bool) -> None:
            if not pushed:
                return answer(BrokerStatus.TOPIC_FENCED, detail="partition unloaded")
            self._append_done(send, producer_id, judged[0], entry, answer)

        self.ledger.append(producer_id, send.sequence_ids, send.keys, admit, done)

    def _append_done(self, send: Send, producer_id: str, judgement: Judgement, entry: LogEntry | None, answer: Respond) -> None:
        publishing = self.publishing
        if entry is None:
            publishing.failed(producer_id, judgement)
            self.fence("an append failed")
            return answer(BrokerStatus.TOPIC_FENCED, detail="append failed")
        self.entries.append(entry)
        self._first_offsets.append(entry.first_offset)
        self.confirmed_offset = entry.last_offset
        if publishing.persisted(producer_id, send.first_sequence_id, send.last_sequence_id, (entry.ledger_id, entry.entry_id),
                                judgement):
            self._write_snapshot(publishing.next_snapshot())
        answer(BrokerStatus.OK, entry.first_offset)
        if self.subscription is not None:
            self.subscription.wake()

    def _write_snapshot(self, snapshot: DedupSnapshot | None, then: Callable[[], None] = lambda: None,
                        on_failed: Callable[[Exception], None] | None = None) -> None:
        """Write the snapshots the core hands out, one after the other (`_write_snapshot` of broker/topic.py)."""
        if snapshot is None:
            return then()
        publishing = self.publishing

        def written(result: Any, error: Exception | None) -> None:
            if error is not None:
                publishing.snapshot_failed(snapshot)
                if on_failed is not None:
                    return on_failed(error)
                return self.fence(f"deduplication snapshot write failed: {type(error).__name__}")
            self._write_snapshot(publishing.snapshot_written(snapshot, result), then, on_failed)

        self.broker.zk_call(write_versioned(dedup_path(PARTITION), snapshot.to_record(), publishing.snapshot_version), written,
                            f"write dedup snapshot at {snapshot.ledger_id}:{snapshot.entry_id}")

    # --- the subscription -----------------------------------------------------------------------

    def _start_subscription(self, subscription: Any) -> None:
        self.subscription = subscription
        self.broker.checker.serving_started(self.instance, subscription.core.subscription_type)

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
        subscription = self.broker.subscription_class(self, SubscriptionType.parse(subscription_type), Cursor.at(0), None)

        def created(error: Exception | None) -> None:
            waiting, self._creating = self._creating or [], None
            if error is not None or self.fenced is not None:
                if error is not None:
                    self.fence(f"creating the cursor failed: {type(error).__name__}")
                for *_, respond_later in waiting:
                    respond_later(BrokerStatus.TOPIC_FENCED)
                return
            self._start_subscription(subscription)
            for waiting_link, waiting_type, waiting_priority, respond_later in waiting:
                respond_later(subscription.add_consumer(waiting_link, SubscriptionType.parse(waiting_type), waiting_priority))

        subscription.write_now(created)

    def entry_index_of(self, offset: int) -> int:
        """The index in `entries` of the entry holding `offset` (len when beyond)."""
        return max(0, bisect.bisect_right(self._first_offsets, offset) - 1) if offset <= self.confirmed_offset else len(self.entries)

    # --- fencing ------------------------------------------------------------------------------

    def fence(self, reason: str) -> None:
        """Stop: something failed that only a fresh load can settle."""
        if self.fenced is not None:
            return
        self.fenced = reason
        self.publishing.stop(reason)
        self.broker.world.log(f"{self.instance} fenced: {reason}")
        self.broker.unload(self)

    def unload_gracefully(self) -> None:
        """An operator's unload, a rebalance or a shutdown
        (`PartitionService.unload` when not fenced): appends taken finish and
        the ledger is closed and recorded, the acknowledgements taken are
        written, the deduplication map is snapshotted; then the broker lets
        the partition go."""
        if self.fenced is not None or not self.serving:
            return
        self.serving = False
        self.publishing.stop("unloading")
        self.broker.world.log(f"{self.instance} unloads gracefully")

        def ledger_closed() -> None:
            if self.subscription is not None:
                self.subscription.finish(snapshot)
            else:
                snapshot()

        def snapshot() -> None:
            self._write_snapshot(self.publishing.final_snapshot(), done, lambda error: done())

        def done() -> None:
            self.fence("unloaded gracefully")

        def too_long() -> None:
            self.fence(f"unloading took more than {UNLOAD_WRITES_MS:.0f} ms: stopped waiting")

        self.broker.after(UNLOAD_WRITES_MS, too_long)
        self.ledger.close(ledger_closed)

    def close_clients(self) -> None:
        """Unloading: tell every producer and consumer to look the partition up again."""
        broker = self.broker
        if self.subscription is not None:
            self.subscription.close()
        self.publishing.stop("unloaded")
        for link in sorted(self.publishing.forget_producers().values(), key=lambda link: link.producer_id):
            broker.send_to(link.connection, Closed(link.handle, "partition moved"))
        if self._creating:
            for link, *_, respond in self._creating:
                respond(BrokerStatus.TOPIC_FENCED)
            self._creating = None
