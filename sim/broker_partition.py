"""One simulated broker's load of the partition: a driver of the real
`PartitionCore` (the order of its load and unload, its deduplication
snapshots) and `PublishCore` (producers, deduplication) and, through
`sim.broker_subscription`, of the real `SubscriptionCore`, as
`broker/topic.py` drives them with trio, over the simulated managed ledger
and metadata store. Any failed write fences the load: the broker unloads it.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable

from broker import partition_core
from broker.cursor import Cursor
from broker.dispatcher import SubscriptionType
from broker.errors import BrokerStatus
from broker.partition_core import UNLOAD_WRITES_MS, PartitionCore
from broker.publish_core import Judgement, ProducerAnswer, PublishCore
from broker.topic_records import cursor_path, dedup_path
from sim.broker_calls import BrokerView, ConsumerLink, ProducerLink, Respond, read_versioned, write_versioned
from sim.broker_calls import LogEntry
from sim.broker_ledger import SimManagedLedger
from sim.broker_messages import PARTITION, SUBSCRIPTION, Closed, Send, SendReceipt
from broker.entry_cache import Position


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
        self.lifecycle = PartitionCore(instance, self.publishing, self.ledger.core)
        self.entries: list[LogEntry] = []  # persisted, as this load knows them (the entry cache)
        self._first_offsets: list[int] = []
        self._entry_index: dict[tuple[int, int], int] = {}
        self.confirmed_offset = -1
        self.subscription: Any = None
        self._loaded_subscription: Any = None  # made from the stored cursor, started once the load is done
        self._creating: list[tuple[ConsumerLink, str, int, Respond]] | None = None  # subscribes waiting for the cursor's creation
        self._on_loaded: Callable[[str | None], None] = lambda error: None
        self._on_stopped: Callable[[], None] = lambda: None

    @property
    def serving(self) -> bool:
        return self.lifecycle.serving

    @property
    def fenced(self) -> str | None:
        """Why it fenced itself (`PartitionCore.fenced`)."""
        return self.lifecycle.fenced

    # --- the partition core's commands ----------------------------------------------------------

    def _run(self, commands: list[partition_core.Command]) -> None:
        for command in commands:
            self._carry_out(command)

    def _carry_out(self, command: partition_core.Command) -> None:
        broker, core = self.broker, self.lifecycle
        if isinstance(command, partition_core.WriteSnapshot):
            snapshot = command.snapshot

            def written(result: Any, error: Exception | None) -> None:
                if error is not None:
                    return self._run(core.snapshot_failed(snapshot, type(error).__name__))
                self._run(core.snapshot_written(snapshot, result))

            broker.zk_call(write_versioned(dedup_path(PARTITION), snapshot.to_record(), self.publishing.snapshot_version),
                           written, f"write dedup snapshot at {snapshot.ledger_id}:{snapshot.entry_id}")
        elif isinstance(command, partition_core.ReadEntries):
            start = self._entry_index[(command.position.ledger_id, command.position.entry_id)]
            self._run(core.entries_read([(Position(entry.ledger_id, entry.entry_id), entry.producer_id, entry.last_sequence_id)
                                         for entry in self.entries[start:start + command.count]]))
        elif isinstance(command, partition_core.OpenLedger):
            self.ledger.open(self._ledger_opened)
        elif isinstance(command, partition_core.ReadSnapshot):
            broker.zk_call(read_versioned(dedup_path(PARTITION)), self._snapshot_read, "read dedup snapshot")
        elif isinstance(command, partition_core.ReadCursors):
            broker.zk_call(read_versioned(cursor_path(PARTITION, SUBSCRIPTION)), self._cursor_read, "read cursor")
        elif isinstance(command, partition_core.WriteCursor):
            # Written once now, before anything is dispatched: its version
            # moves on, fencing a previous owner's late write.
            self._loaded_subscription.write_now(
                lambda error: self._run(core.failed(f"writing the cursor failed: {type(error).__name__}") if error is not None
                                        else core.cursor_written(command.name)))
        elif isinstance(command, partition_core.Serve):
            broker.world.log(f"{self.instance} dedup: snapshot {core.snapshot_covered}, "
                             f"{self.publishing.replayed_entries} entries replayed")
            if self._loaded_subscription is not None:
                self._start_subscription(self._loaded_subscription)
            self._on_loaded(None)
        elif isinstance(command, partition_core.LoadFailed):
            self._on_loaded(command.reason)
        elif isinstance(command, partition_core.Fence):
            self.fence(command.reason)
        elif isinstance(command, partition_core.CloseLedger):
            self.ledger.close(lambda: self._run(core.ledger_closed()))
        elif isinstance(command, partition_core.FinishSubscriptions):
            if self.subscription is None:
                self._run(core.subscriptions_finished())
            else:
                self.subscription.finish(command.write, lambda: self._run(core.subscriptions_finished()))
        else:
            assert isinstance(command, partition_core.Stopped), f"unknown command {command!r}"
            self.broker.world.log(f"{self.instance} stopped ({'gracefully' if command.graceful else 'fenced'})")
            on_stopped, self._on_stopped = self._on_stopped, lambda: None
            on_stopped()

    # --- loading ------------------------------------------------------------------------------

    def load(self, on_loaded: Callable[[str | None], None]) -> None:
        """Load in the order `PartitionCore` gives; `on_loaded(None)` or the error."""
        self._on_loaded = on_loaded
        self._run(self.lifecycle.load())

    def _ledger_opened(self, error: str | None, entries: list[LogEntry]) -> None:
        if error is not None:
            return self._run(self.lifecycle.failed(error))
        self.entries = list(entries)
        self._first_offsets = [entry.first_offset for entry in self.entries]
        self._entry_index = {(entry.ledger_id, entry.entry_id): index for index, entry in enumerate(self.entries)}
        self.confirmed_offset = self.ledger.core.confirmed_offset
        self._run(self.lifecycle.ledger_opened())

    def _snapshot_read(self, result: Any, error: Exception | None) -> None:
        if error is not None:
            return self._run(self.lifecycle.failed(f"{type(error).__name__}: {error}"))
        self._run(self.lifecycle.snapshot_read(result))

    def _cursor_read(self, result: Any, error: Exception | None) -> None:
        if error is not None:
            return self._run(self.lifecycle.failed(f"{type(error).__name__}: {error}"))
        if result is not None:
            record, version = result
            subscription = self._loaded_subscription = self.broker.subscription_class(
                self, SubscriptionType.parse(record["type"]), Cursor.from_record(record), version)
            subscription.core.skip_to(self.ledger.core.first_offset)
        self._run(self.lifecycle.cursors_read([] if result is None else [SUBSCRIPTION]))

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
        self._entry_index[(entry.ledger_id, entry.entry_id)] = len(self.entries)
        self.entries.append(entry)
        self._first_offsets.append(entry.first_offset)
        self.confirmed_offset = entry.last_offset
        if publishing.persisted(producer_id, send.first_sequence_id, send.last_sequence_id, (entry.ledger_id, entry.entry_id),
                                judgement):
            self._run(self.lifecycle.persisted())
        answer(BrokerStatus.OK, entry.first_offset)
        if self.subscription is not None:
            self.subscription.wake()

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
            if error is not None or self.fenced is not None or not self.serving:
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
        """Stop: something failed that only a fresh load can settle
        (`PartitionCore.fence`); the broker unloads it, fenced."""
        if not self.lifecycle.fence(reason):
            return
        self.broker.world.log(f"{self.instance} fenced: {reason}")
        self.broker.partition_fenced(self)

    def cancel_load(self) -> None:
        """The session that owned it is gone: the load stops where it is
        (its later answers change nothing)."""
        self.ledger.stop()
        self._run(self.lifecycle.failed("cancelled: the ZooKeeper session that owned it is gone"))

    def unload(self, graceful: bool, on_stopped: Callable[[], None]) -> None:
        """Stop, in the order `PartitionCore` gives (`PartitionService.unload`):
        graceful, appends taken finish and the ledger is closed and recorded,
        the acknowledgements taken are written, the deduplication map is
        snapshotted; fenced, nothing more is written. Then `on_stopped()`."""
        self._on_stopped = on_stopped
        self.broker.world.log(f"{self.instance} unloads {'gracefully' if graceful else 'fenced'}")
        self.broker.after(UNLOAD_WRITES_MS, self._unload_too_long)
        self._run(self.lifecycle.unload(graceful=graceful))

    def _unload_too_long(self) -> None:
        if self.lifecycle.phase is not partition_core.Phase.STOPPED:
            self.broker.world.log(f"{self.instance}: unloading took more than {UNLOAD_WRITES_MS:.0f} ms: stopped waiting")
            self._run(self.lifecycle.timed_out())

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
