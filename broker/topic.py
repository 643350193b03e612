"""One partition served by this broker: its managed ledger, producer
deduplication, subscriptions, and the housekeeping that rolls ledgers over,
applies retention and snapshots the deduplication map.

A partition is loaded when this broker takes its ownership and unloaded when
it gives it up (gracefully: pending writes finish, cursors and the
deduplication snapshot are written, the ledger is closed) or when it is
fenced (a write or a compare-and-set failed: nothing more is written, and
clients are told to look the partition up again).
"""

from __future__ import annotations

import collections
import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import trio

from framing.codec import describe
from broker.compaction import CompactedView, CompactionState, CompactionStatus, Compactor
from broker.compaction_core import CompactionRecord
from broker.cursor import Cursor
from broker.cursor_ledger import CursorWritePacer, read_stored_cursor
from broker.cursor_ledger_core import stored_placement
from broker.dispatcher import DELAYED_MAX_DEFAULT, HashRanges, SubscriptionType
from broker.errors import (
    BadRequestError,
    BrokerError,
    BrokerStatus,
    ConflictError,
    ConsumerBusyError,
    NotAllowedError,
    ProducerBusyError,
    ProducerFencedError,
    RetryLaterError,
    SubscriptionNotFoundError,
    TopicFencedError,
)
from broker.housekeeping import HousekeepingClock
from broker.lease import Lease
from broker.managed_ledger import EntryCache, EntryGoneError, ManagedLedger, Position
from broker.metrics import PartitionStats
from broker.message_format import BatchHeader, CheckedBatch, check_batch, encode_entry
from broker.protocol import Send, SendReceipt
from broker.publish_buffer import PublishPermit, batch_cost_bytes
from broker import partition_core
from broker.partition_core import UNLOAD_WRITES_MS, PartitionCore
from broker.publish_core import DEDUP_SNAPSHOT_ENTRIES, AccessMode, ProducerAnswer, PublishCore
from broker.subscription import ConsumerLink, Subscription
from broker.subscription_core import SubscriptionCore
from broker.topic_records import TopicPolicies, check_name
from broker.topic_store import TopicStore
from broker.tenant_store import TenantStore
from coordination.store import MetadataError, NodeExistsError
from ledger_client import BKError, BookKeeper, NoSuchLedgerError

log = logging.getLogger(__name__)

PUBLISH_QUEUE_BATCHES_MAX = 1_000  # batches taken from connections and not yet handed to the ledger
PRODUCER_EARLIER_BATCHES_WAIT_S = 10.0  # a reconnecting producer waits at most this long for its earlier batches
LIFECYCLE_COMMANDS_MAX = 8  # the partition core's commands waiting to be carried out (a few at a time, by its rules)
POLICY_REFRESH_INTERVAL_S = 5.0
CURSOR_LOADS_AT_ONCE = 16  # cursors read (and their ledgers recovered) at once while a partition loads
NON_DURABLE_IDLE_S = 60.0  # a reader's subscription without its consumer this long is dropped
COMPACTION_RETRY_AFTER_S = 60.0  # the compaction threshold starts no compaction this soon after one failed


@dataclass
class BrokerContext:
    """What a partition needs of its broker."""

    bookkeeper: BookKeeper
    topic_store: TopicStore
    ledger_password: bytes
    cache: EntryCache  # one for the broker: its bound holds whatever the number of partitions
    request_unload: Callable[["PartitionService", BrokerError], None]
    retention_check_interval_s: float = POLICY_REFRESH_INTERVAL_S
    lease: Lease = field(default_factory=Lease)
    delayed_memory_messages: int = DELAYED_MAX_DEFAULT  # per subscription; past it, spilled (broker/delayed_index.py)
    cursor_pacer: CursorWritePacer = field(default_factory=CursorWritePacer)  # the broker's cursor-ledger appends
    housekeeping: HousekeepingClock = field(default_factory=HousekeepingClock)  # run by the broker's hosting
    # The cores' classes (the simulator's planted mistakes replace one).
    publish_core_class: type[PublishCore] = PublishCore
    subscription_core_class: type[SubscriptionCore] = SubscriptionCore


@dataclass(slots=True)
class ProducerLink:
    handle: int
    producer_id: str
    send_receipt: Callable[[SendReceipt], None]
    messages_in: int = 0
    # Closes the producer on its connection, saying why (an exclusive
    # producer fenced it out); None: nothing to tell.
    close: Callable[[str], None] | None = None


@dataclass(slots=True, eq=False)
class PublishedBatch:
    """A producer's batch from when it is taken from its connection until it
    is answered. Every path that ends it goes through `answer`, which gives
    its bytes back to the broker's publish buffer; the paths that end it
    unanswered (cancelled, or its partition stopped) release its permit in
    a `finally` (releasing twice does nothing)."""

    link: ProducerLink
    send: Send
    permit: PublishPermit
    checked: CheckedBatch | None = None  # what checking its message told

    def answer(self, status: BrokerStatus, message: str = "", position: Position | None = None, first_offset: int = -1) -> None:
        self.permit.release()
        self.link.send_receipt(SendReceipt(
            self.link.handle, self.send.last_sequence_id, int(status),
            -1 if position is None else position.ledger_id, -1 if position is None else position.entry_id,
            first_offset, message,
        ))


class PartitionService:
    def __init__(self, context: BrokerContext, name: str, topic: str, partition_index: int, policies: TopicPolicies, *,
                 session_id: int) -> None:
        self.context = context
        self.session_id = session_id  # the ZooKeeper session that owns it: it delivers only within that session's lease
        self.name = name
        self.topic = topic
        self.partition_index = partition_index
        self.policies = policies
        self.topic_store = context.topic_store
        self.cursor_pacer = context.cursor_pacer
        self.managed_ledger = ManagedLedger(
            context.bookkeeper, context.topic_store, name, policies,
            password=context.ledger_password, cache=context.cache, on_fenced=self.fence,
        )
        self.publishing: PublishCore[ProducerLink] = context.publish_core_class(
            name, deduplication=policies.deduplication, snapshot_entries=DEDUP_SNAPSHOT_ENTRIES)
        self.subscriptions: dict[str, Subscription] = {}
        self.stats = PartitionStats()
        self.fenced: BrokerError | None = None
        self.closing = False
        self._nursery: trio.Nursery | None = None
        self._subscribe_lock = trio.Lock()
        self.lifecycle = PartitionCore(name, self.publishing, self.managed_ledger.core)
        self._lifecycle_commands: collections.deque[partition_core.Command] = collections.deque()
        self._lifecycle_wakeup = trio.Event()
        self._housekeeping_due = trio.Event()  # set by the broker's housekeeping clock
        # Monotonic: policies, TTL and retention last checked (0: never, so
        # at the first tick). After its first check each partition keeps its
        # own point of the interval (from its name), so that a broker's
        # thousands of partitions do not all check in the same tick.
        self._retention_checked_s = 0.0
        self._retention_phase = (zlib.crc32(name.encode()) % 1024) / 1024
        self._stopped = trio.Event()
        self._batch_finished = trio.Event()
        self._producers_left = trio.Event()  # set when a producer goes (one waiting for exclusive access asks again)
        self._publish_queue, self._publish_queue_receive = trio.open_memory_channel(PUBLISH_QUEUE_BATCHES_MAX)
        self.loaded_ms = int(time.time() * 1000)
        # Compaction: its last record (None: never compacted), the view read
        # from it, and what this broker knows of the compactions it ran.
        self.compaction = CompactionState()
        self.compaction_record: CompactionRecord | None = None
        self.compacted_view: CompactedView | None = None
        self._compaction_hold: int | None = None  # while one runs: the first offset it reads

    # --- lifetime -------------------------------------------------------------------------

    async def load(self) -> None:
        """Open the managed ledger (fencing the previous owner), rebuild the
        deduplication map and load the durable cursors, in the order
        `PartitionCore` gives."""
        commands = collections.deque(self.lifecycle.load())
        while not self.lifecycle.serving:
            assert commands, f"partition {self.name}: the load stopped at {self.lifecycle.phase.value}"
            commands.extend(await self._carry_out(commands.popleft()))
        if self.compaction_record is None:
            found = await self.topic_store.read_compaction(self.name)
            if found is not None:
                self._compaction_switched(found[0])
        log.info("partition %s: deduplication map of %d producers (%d entries replayed after the snapshot at %s)",
                 self.name, self.publishing.producer_count, self.publishing.replayed_entries, self.lifecycle.snapshot_covered)

    @property
    def producers(self) -> dict[str, ProducerLink]:
        return self.publishing.producers

    async def _carry_out(self, command: partition_core.Command) -> list[partition_core.Command]:
        """One of the partition core's commands; returns what it says next."""
        core = self.lifecycle
        if isinstance(command, partition_core.WriteSnapshot):
            snapshot = command.snapshot
            try:
                version = await self.topic_store.write_dedup(self.name, snapshot.to_record(), self.publishing.snapshot_version)
            except MetadataError as error:
                return core.snapshot_failed(snapshot, str(error))
            return core.snapshot_written(snapshot, version)
        if isinstance(command, partition_core.ReadEntries):
            entries = await self.managed_ledger.read(command.position, command.count)
            return core.entries_read([(entry.position, entry.header.producer_id,
                                       None if entry.header.partial_chunk else entry.header.last_sequence_id)
                                      for entry in entries])
        if isinstance(command, partition_core.OpenLedger):
            await self.managed_ledger.open()
            return core.ledger_opened()
        if isinstance(command, partition_core.ReadSnapshot):
            commands = core.snapshot_read(await self.topic_store.read_dedup(self.name))
            if self.publishing.snapshot_problem is not None:
                log.error("partition %s: deduplication snapshot unreadable, rebuilding from every entry: %s", self.name,
                          self.publishing.snapshot_problem)
            return commands
        if isinstance(command, partition_core.ReadCursors):
            return core.cursors_read(await self._load_cursors())
        if isinstance(command, partition_core.WriteCursor):
            await self.subscriptions[command.name].write_cursor()
            return core.cursor_written(command.name)
        if isinstance(command, partition_core.LoadFailed):
            raise TopicFencedError(f"partition {self.name}: {command.reason}")
        if isinstance(command, partition_core.Fence):
            self.fence(TopicFencedError(f"partition {self.name}: {command.reason}"))
            return []
        if isinstance(command, partition_core.CloseLedger):
            try:
                await self.managed_ledger.close()
            except (BrokerError, BKError, MetadataError) as error:
                log.warning("partition %s: closing its ledger failed (the next owner recovers it): %s", self.name, error)
            return core.ledger_closed()
        if isinstance(command, partition_core.FinishSubscriptions):
            for subscription in list(self.subscriptions.values()):
                await subscription.finish(write=command.write)
            return core.subscriptions_finished()
        if isinstance(command, partition_core.Stopped):
            self._stopped.set()
            return []
        assert isinstance(command, partition_core.Serve), f"unknown command {command!r}"
        return []

    async def _load_cursors(self) -> list[str]:
        """Make the durable subscriptions from their cursors (an unreadable
        one is left alone); their names."""
        found = await self.topic_store.read_compaction(self.name)
        if found is not None:
            self._compaction_switched(found[0])
        stored = await self.topic_store.read_cursors(self.name)
        loaded: dict[str, Subscription] = {}
        failures: list[TopicFencedError] = []

        # Each may recover its cursor ledger: a few at a time.
        limiter = trio.CapacityLimiter(CURSOR_LOADS_AT_ONCE)

        async def load(subscription_name: str, record: dict, version: int) -> None:
            async with limiter:
                try:
                    loaded[subscription_name] = await self._stored_subscription(subscription_name, record, version)
                except ValueError as error:
                    log.error("partition %s: cursor %s unreadable, left alone: %s", self.name, subscription_name, error)
                except TopicFencedError as error:
                    failures.append(error)

        async with trio.open_nursery() as nursery:
            for subscription_name, (record, version) in stored.items():
                nursery.start_soon(load, subscription_name, record, version)
        if failures:
            raise failures[0]
        for subscription_name in stored:
            if subscription_name in loaded:
                self.subscriptions[subscription_name] = loaded[subscription_name]
        return list(self.subscriptions)

    async def _stored_subscription(self, subscription_name: str, node_record: dict, version: int) -> Subscription:
        """A durable subscription from its stored cursor: the node's record,
        or the last entry of the cursor ledger it names (recovered, which
        fences the previous owner's appends). ValueError: malformed;
        TopicFencedError: its ledger cannot be recovered now (the load
        fails, and is tried again)."""
        try:
            record, retired = await read_stored_cursor(self.context.bookkeeper, self.context.ledger_password, self.name,
                                                       subscription_name, node_record)
        except (BKError, MetadataError) as error:
            raise TopicFencedError(f"partition {self.name}: the ledger of cursor {subscription_name} cannot be "
                                   f"recovered now: {error}") from None
        try:
            cursor = Cursor.from_record(record)
            kind = SubscriptionType.parse(record.get("type", "exclusive"))
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"malformed cursor record {record!r:.200}: {error!r}") from None
        subscription = Subscription(
            self, subscription_name, kind, cursor, durable=True, important=bool(record.get("important")),
            cursor_version=version, retired_ledgers=retired, core_class=self.context.subscription_core_class,
            delayed_memory_messages=self.context.delayed_memory_messages, created_ms=record.get("created_ms", 0),
        )
        self._skip_trimmed(subscription)
        return subscription

    def _lifecycle(self, commands: list[partition_core.Command]) -> None:
        """Commands of the partition core while it serves or unloads: carried
        out in order by `_lifecycle_loop` (the core issues a few at a time:
        one snapshot write, an unload's steps)."""
        if commands:
            self._lifecycle_commands.extend(commands)
            assert len(self._lifecycle_commands) <= LIFECYCLE_COMMANDS_MAX, "the partition core issued too many commands"
            self._lifecycle_wakeup.set()

    async def _lifecycle_loop(self) -> None:
        commands = self._lifecycle_commands
        while True:
            while commands:
                self._lifecycle(await self._carry_out(commands.popleft()))
            await self._lifecycle_wakeup.wait()
            self._lifecycle_wakeup = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for subscription in self.subscriptions.values():
                    self._start_subscription(subscription)
                nursery.start_soon(self._housekeeping_loop)
                nursery.start_soon(self._rollover_loop)
                nursery.start_soon(self._append_loop, self._publish_queue_receive)
                nursery.start_soon(self._lifecycle_loop)
                task_status.started()
        finally:
            self._stop_publishing()

    def _stop_publishing(self) -> None:
        """The appender is gone: answer the batches it left queued (their
        producers look the partition up again and resend them), and close
        the queue, so that a connection waiting for room in it is answered
        too instead of waiting for ever."""
        receive = self._publish_queue_receive
        while True:
            try:
                batch = receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            batch.answer(BrokerStatus.TOPIC_FENCED, f"partition {self.name} is no longer served here: look it up again")
        receive.close()

    @property
    def lease(self) -> Lease:
        return self.context.lease

    def delivered(self, count: int) -> None:
        self.stats.messages_out += count

    def spawn(self, async_fn, *args) -> None:
        """A task of the partition (cancelled when it unloads)."""
        assert self._nursery is not None
        self._nursery.start_soon(async_fn, *args)

    def _start_subscription(self, subscription: Subscription) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(subscription.dispatch_loop)
        self._nursery.start_soon(subscription.persist_loop)

    def fence(self, error: BrokerError) -> None:
        """Stop: something failed that only a fresh load can settle
        (`PartitionCore.fence`)."""
        if not self.lifecycle.fence(str(error)):
            return
        self.fenced = error
        log.warning("partition %s fenced: %s", self.name, error)
        self.context.request_unload(self, error)

    async def unload(self, *, graceful: bool) -> None:
        """Stop serving, in the order `PartitionCore` gives. Graceful: appends
        taken finish, acknowledgements taken are made durable (and
        answered), the deduplication map is written, the ledger is closed.
        Fenced: nothing more is written, and acknowledgements still waiting
        are answered with an error (the client sends them again to the next
        owner)."""
        self.closing = True
        try:
            self._lifecycle(self.lifecycle.unload(graceful=graceful))
            with trio.move_on_after(UNLOAD_WRITES_MS / 1000) as deadline:
                await self._stopped.wait()
            if deadline.cancelled_caught:
                log.warning("partition %s: unloading took more than %.0fs; stopped waiting", self.name, UNLOAD_WRITES_MS / 1000)
                for command in self.lifecycle.timed_out():
                    await self._carry_out(command)
        finally:
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()

    # --- producers ---------------------------------------------------------------------------

    async def add_producer(self, link: ProducerLink, access: AccessMode = AccessMode.SHARED,
                           on_waiting: Callable[[], None] | None = None) -> int:
        """Register a producer; returns the last sequence id persisted for
        it, once none of its batches (from an earlier connection) is still
        queued or being written (PublishCore.add_producer). A producer
        waiting for exclusive access waits until the others are gone (for
        as long as its caller waits), `on_waiting` called once when it starts
        to; the producers an exclusive one fences out are closed."""
        deadline = trio.current_time() + PRODUCER_EARLIER_BATCHES_WAIT_S
        told_waiting = False
        while True:
            answer, last_sequence_id = self.publishing.add_producer(link.producer_id, link, access)
            if answer is ProducerAnswer.WAIT:
                with trio.move_on_at(deadline):
                    await self._batch_finished.wait()
                if trio.current_time() >= deadline:
                    break
                continue
            if answer is ProducerAnswer.WAIT_EXCLUSIVE:
                if not told_waiting and on_waiting is not None:
                    told_waiting = True
                    on_waiting()
                await self._producers_left.wait()
                continue
            break
        if answer is ProducerAnswer.OK:
            for fenced in self.publishing.take_fenced():
                if fenced.close is not None:
                    fenced.close(f"producer {link.producer_id!r} took {self.name} with exclusive access and fenced this one out")
            return last_sequence_id
        if answer is ProducerAnswer.BUSY:
            raise ProducerBusyError(f"producer {link.producer_id!r} is already connected to {self.name}")
        if answer is ProducerAnswer.EXCLUDED:
            if self.publishing.fenced_by is not None:
                raise ProducerFencedError(f"producer {self.publishing.fenced_by!r} has {self.name} to itself and fenced "
                                          f"the others out")
            holder = self.publishing.exclusive
            raise ProducerBusyError(f"producer {holder!r} has exclusive access to {self.name}" if holder is not None else
                                    f"{self.name} has other producers connected: exclusive access refused")
        if answer is ProducerAnswer.WAIT:
            raise RetryLaterError(f"producer {link.producer_id!r} still has batches being written to {self.name}; retry")
        self._check_serving()
        raise TopicFencedError(f"partition {self.name} is being unloaded")

    def _batch_finished_for(self, producer_id: str) -> None:
        if self.publishing.finished(producer_id):
            finished, self._batch_finished = self._batch_finished, trio.Event()
            finished.set()

    def remove_producer(self, producer_id: str, handle: int) -> None:
        link = self.producers.get(producer_id)
        if link is not None and link.handle == handle and self.publishing.remove_producer(producer_id, link):
            left, self._producers_left = self._producers_left, trio.Event()
            left.set()

    def _check_serving(self) -> None:
        if self.fenced is not None:
            raise TopicFencedError(f"partition {self.name} is being unloaded: {self.fenced}")
        if self.closing:
            raise TopicFencedError(f"partition {self.name} is being unloaded")

    async def publish(self, link: ProducerLink, send: Send, permit: PublishPermit | None = None) -> None:
        """A producer's batch from its connection, holding `permit` (its
        share of the broker's publish buffer, released once the batch is
        answered or dropped): checked, then queued for the partition's
        appender (waiting while the queue is full: that is the connection's
        back-pressure). Answers go through `link.send_receipt`. Cancelling
        the wait loses nothing: the batch was not taken, and its producer
        resends it after reconnecting."""
        if permit is None:
            permit = PublishPermit.unbounded(batch_cost_bytes(send.body, send.message_count))
        batch = PublishedBatch(link, send, permit)
        queued = False
        try:
            try:
                self._check_serving()
                # Before anything is queued: a batch whose body does not hold
                # what it declares would take offsets for messages no consumer
                # can read (MalformedBatchError, answered to this producer only).
                batch.checked = check_batch(send.body, send.first_sequence_id, send.last_sequence_id, send.message_count,
                                            link.producer_id)
            except BrokerError as error:
                batch.answer(error.status, str(error))
                return
            try:
                try:
                    # No scheduling point while the queue has room: one per batch
                    # would cost more than storing it.
                    self._publish_queue.send_nowait(batch)
                except trio.WouldBlock:
                    await self._publish_queue.send(batch)
            except trio.BrokenResourceError:
                # The partition stopped (its appender is gone) while the batch waited.
                batch.answer(BrokerStatus.TOPIC_FENCED, f"partition {self.name} is no longer served here: look it up again")
                return
            queued = True
            self.publishing.taken(link.producer_id)
        finally:
            if not queued:
                batch.permit.release()  # answered, or cancelled while waiting for room

    async def _append_loop(self, receive: trio.MemoryReceiveChannel) -> None:
        """The partition's appender: batches in the order they were taken,
        whatever becomes of the connections that brought them, so that a
        batch is either appended (and deduplication told) or never taken.
        Only the partition's unloading stops it."""
        while True:
            try:
                batch = receive.receive_nowait()
            except trio.WouldBlock:
                batch = await receive.receive()
            if not await self._append(batch):
                self._batch_finished_for(batch.link.producer_id)

    async def _append(self, batch: PublishedBatch) -> bool:
        """Append a batch taken from a producer; True if it went to the
        ledger (its answer comes when it is persisted or fails), False if it
        was answered at once (or the partition stopped meanwhile: then it is
        dropped, and its producer resends it to the next owner)."""
        handed = False
        try:
            handed = await self._append_or_answer(batch)
            return handed
        finally:
            if not handed:
                batch.permit.release()

    async def _append_or_answer(self, batch: PublishedBatch) -> bool:
        link, send = batch.link, batch.send
        producer_id, first_sequence_id, last_sequence_id = link.producer_id, send.first_sequence_id, send.last_sequence_id
        publishing = self.publishing
        checked = batch.checked
        assert checked is not None, "a batch is checked before it is queued"
        judgement = publishing.judge(producer_id, first_sequence_id, last_sequence_id,
                                     stored_bytes=self.backlog_bytes() if self.policies.backlog_quota_bytes is not None else 0,
                                     backlog_quota_bytes=self.policies.backlog_quota_bytes, partial_chunk=checked.partial_chunk)
        if judgement.status is not BrokerStatus.OK:
            batch.answer(judgement.status, judgement.detail)
            return False

        def make_entry(first_offset: int, publish_ms: int) -> bytes:
            header = BatchHeader(producer_id, first_sequence_id, last_sequence_id, first_offset, send.message_count,
                                 publish_ms, checked.codec, checked.keys)
            return encode_entry(header, send.body, store_keys=checked.store_keys)

        def done(position: Position | None, first_offset: int, error: BrokerError | None) -> None:
            self._batch_finished_for(producer_id)
            if error is not None:
                publishing.failed(producer_id, judgement)
                batch.answer(error.status, str(error))
                return
            assert position is not None
            if publishing.persisted(producer_id, first_sequence_id, last_sequence_id, (position.ledger_id, position.entry_id),
                                    judgement):
                self._lifecycle(self.lifecycle.persisted())
            self.stats.messages_in += send.message_count
            self.stats.bytes_in += len(send.body)
            link.messages_in += send.message_count
            batch.answer(BrokerStatus.OK, "", position, first_offset)
            for subscription in self.subscriptions.values():
                subscription.wake()

        def pushed() -> None:
            # Called by the managed ledger right before it hands the entry
            # to the ledger, with no scheduling point in between.
            publishing.pushed(producer_id, first_sequence_id, last_sequence_id, judgement)

        try:
            await self.managed_ledger.append(make_entry, send.message_count, done, pushed)
        except BrokerError as error:
            batch.answer(error.status, str(error))
            return False
        return True

    # --- subscriptions -----------------------------------------------------------------------

    async def subscribe(
        self,
        link: ConsumerLink,
        subscription_name: str,
        subscription_type: SubscriptionType,
        *,
        priority: int,
        initial_position: str,
        durable: bool,
        important: bool,
        start_offset: int | None,
        hash_ranges: HashRanges | None = None,
        read_compacted: bool = False,
    ) -> Subscription:
        if read_compacted and subscription_type not in (SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER):
            raise NotAllowedError("read compacted can only be used with exclusive or failover subscriptions (Pulsar's rule)")
        async with self._subscribe_lock:
            subscription = await self._open_subscription(subscription_name, subscription_type, initial_position=initial_position,
                                                         durable=durable, important=important, start_offset=start_offset,
                                                         read_compacted=read_compacted)
            # Set before the consumer is added: its first read (from the
            # cursor) takes the view.
            subscription.read_compacted = read_compacted
            subscription.add_consumer(link, subscription_type, priority, hash_ranges)
            return subscription

    async def create_subscription(self, subscription_name: str, *, initial_position: str = "latest",
                                  start_offset: int | None = None) -> Subscription:
        """A durable subscription without consumers (Pulsar's admin
        create-subscription): ConflictError if it exists."""
        async with self._subscribe_lock:
            if subscription_name in self.subscriptions:
                raise ConflictError(f"subscription {subscription_name} exists on {self.name}")
            return await self._open_subscription(subscription_name, SubscriptionType.EXCLUSIVE, initial_position=initial_position,
                                                 durable=True, important=False, start_offset=start_offset)

    async def _open_subscription(self, subscription_name: str, subscription_type: SubscriptionType, *,
                                 initial_position: str, durable: bool, important: bool, start_offset: int | None,
                                 read_compacted: bool = False) -> Subscription:
        """The subscription, made (and, if durable, its cursor written) when
        it does not exist. The caller holds the subscribe lock."""
        self._check_serving()
        check_name(subscription_name, "subscription")
        if initial_position not in ("earliest", "latest"):
            raise BadRequestError(f"initial position must be earliest or latest, got {describe(initial_position)}")
        subscription = self.subscriptions.get(subscription_name)
        if subscription is not None and subscription.durable != durable:
            raise ConsumerBusyError(f"{subscription_name} exists as a {'durable' if subscription.durable else 'non-durable'} subscription")
        if subscription is None:
            if start_offset is not None:
                next_offset = start_offset
            elif initial_position == "earliest":
                next_offset = 0 if read_compacted else self.managed_ledger.first_offset
            else:
                next_offset = self.managed_ledger.confirmed_offset + 1
            # A read-compacted subscription may start before what retention
            # left: the compacted view holds keys from there.
            floor = 0 if read_compacted and self.compaction_record is not None else self.managed_ledger.first_offset
            next_offset = min(max(next_offset, floor), self.managed_ledger.confirmed_offset + 1)
            subscription = Subscription(
                self, subscription_name, subscription_type, Cursor.at(next_offset),
                durable=durable, important=important, cursor_version=None, core_class=self.context.subscription_core_class, delayed_memory_messages=self.context.delayed_memory_messages, created_ms=int(time.time() * 1000),
            )
            if durable:
                # Durable before the consumer hears of it: a restart keeps its position.
                try:
                    await subscription.write_cursor()
                except NodeExistsError:
                    # A subscribe cancelled after writing it (or a race):
                    # the cursor is there; use it.
                    subscription = await self._adopt_cursor(subscription_name)
            self.subscriptions[subscription_name] = subscription
            self._start_subscription(subscription)
        elif important and not subscription.important:
            subscription.important = True
            await subscription.write_cursor()
        return subscription

    async def offset_of_message(self, ledger_id: int, entry_id: int, batch_index: int) -> int:
        """The offset of message (ledger id, entry id, batch index), or BadRequestError."""
        position = Position(ledger_id, entry_id)
        if not self.managed_ledger.has_entry(position):
            raise BadRequestError(f"{self.name} holds no entry {ledger_id}:{entry_id}")
        header = (await self.managed_ledger.read_entry(position)).header
        if not 0 <= batch_index < header.message_count:
            raise BadRequestError(f"entry {ledger_id}:{entry_id} holds {header.message_count} messages")
        return header.first_offset + batch_index

    async def _adopt_cursor(self, subscription_name: str) -> Subscription:
        stored = (await self.topic_store.read_cursors(self.name)).get(subscription_name)
        if stored is None:
            raise TopicFencedError(f"the cursor of {subscription_name} on {self.name} came and went: subscribe again")
        record, version = stored
        return await self._stored_subscription(subscription_name, record, version)

    def remove_consumer(self, subscription_name: str, consumer_id: int, *, keep: bool = False) -> None:
        """A consumer went away; a non-durable subscription goes with its
        last consumer (unless `keep`: housekeeping removes it if nobody
        comes back within NON_DURABLE_IDLE_S)."""
        subscription = self.subscriptions.get(subscription_name)
        if subscription is None:
            return
        subscription.remove_consumer(consumer_id)
        if not subscription.durable and not subscription.consumers and not keep:
            self._drop_subscription(subscription)

    def _drop_subscription(self, subscription: Subscription) -> None:
        subscription.close()
        if self.subscriptions.get(subscription.name) is subscription:
            del self.subscriptions[subscription.name]

    async def unsubscribe(self, subscription_name: str, consumer_id: int | None) -> None:
        """Delete a subscription (its only consumer may be the one asking)."""
        subscription = self.subscriptions.get(subscription_name)
        if subscription is None:
            raise SubscriptionNotFoundError(f"no subscription {subscription_name!r} on {self.name}")
        others = [other for other in subscription.consumers if other != consumer_id]
        if others:
            raise ConsumerBusyError(f"subscription {subscription_name!r} has {len(others)} other consumers connected")
        subscription.close()
        del self.subscriptions[subscription_name]
        if subscription.durable:
            # Under the subscribe lock: a subscribe of the same name waits,
            # rather than adopting the cursor being deleted.
            async with self._subscribe_lock:
                try:
                    await subscription.delete_cursor()
                except (BrokerError, MetadataError) as error:
                    # Left half-deleted (its node lists what is left, or
                    # another broker wrote it): the partition loads again,
                    # finding the subscription, which can be deleted again.
                    failure = TopicFencedError(f"deleting subscription {subscription_name!r} of {self.name} did not "
                                               f"finish: {error}")
                    self.fence(failure)
                    raise failure from None

    # --- housekeeping ------------------------------------------------------------------------

    def housekeeping_tick(self, now: float) -> None:
        """The broker's housekeeping clock, once a second: what needs no
        waiting is done here; the rest wakes `_housekeeping_loop`."""
        if (self.managed_ledger.rollover_reason() is not None
                or now - self._retention_checked_s >= self.context.retention_check_interval_s):
            self._housekeeping_due.set()
        self.stats.sample(now)
        for subscription in list(self.subscriptions.values()):
            subscription.history.sample(now, subscription.counts())
            if not subscription.durable and not subscription.consumers and now - subscription.idle_since >= NON_DURABLE_IDLE_S:
                self._drop_subscription(subscription)

    async def _housekeeping_loop(self) -> None:
        self.context.housekeeping.join(self.housekeeping_tick)
        try:
            while True:
                await self._housekeeping_due.wait()
                self._housekeeping_due = trio.Event()
                try:
                    if self.managed_ledger.rollover_reason() is not None:
                        await self.managed_ledger.rollover()
                    now = time.monotonic()
                    interval_s = self.context.retention_check_interval_s
                    if now - self._retention_checked_s >= interval_s:
                        first = self._retention_checked_s == 0.0
                        self._retention_checked_s = now - (interval_s * self._retention_phase if first else 0.0)
                        await self._refresh_policies()
                        await self.expire_messages()
                        await self.apply_retention()
                        if self.compaction_due():
                            self.compact()
                except BrokerError as error:
                    self.fence(error)
                    return
                except (BKError, MetadataError) as error:
                    log.warning("partition %s: housekeeping failed, retried later: %s", self.name, error)
        finally:
            self.context.housekeeping.leave(self.housekeeping_tick)

    async def _rollover_loop(self) -> None:
        """Roll the open ledger over as soon as it is full (housekeeping
        handles age and idleness)."""
        while True:
            await self.managed_ledger.rollover_due.wait()
            try:
                await self.managed_ledger.rollover()
            except BrokerError as error:
                self.fence(error)
                return
            if self.managed_ledger.rollover_due.is_set():
                # Not rolled over (the policies changed meanwhile): wait for the next entry.
                self.managed_ledger.rollover_due = trio.Event()

    async def _refresh_policies(self) -> None:
        record = await self.topic_store.read_topic_watched(self.topic)
        if record is None:
            return
        policies = await TenantStore(self.topic_store).policies_in_effect(self.topic, record)
        if policies != self.policies:
            self.policies = self.managed_ledger.policies = policies
            self.publishing.deduplication = self.policies.deduplication
            log.info("partition %s: policies now %s", self.name, self.policies)

    def held_from_offset(self) -> int | None:
        """The first offset retention must keep for the subscriptions (None:
        none holds anything): by Pulsar's model, the first any durable
        subscription has not acknowledged; by YDB's, the first an important
        one has not. A compacted partition also keeps what its next
        compaction reads (the messages after the last one's horizon), as
        Pulsar's compaction cursor does."""
        every = self.policies.retention_model == "pulsar"
        held = [subscription.cursor.mark_delete + 1 for subscription in self.subscriptions.values()
                if subscription.durable and (every or subscription.important)]
        if self.compaction_record is not None:
            held.append(self.compaction_record.horizon + 1)
        if self._compaction_hold is not None:
            held.append(self._compaction_hold)
        return min(held) if held else None

    # --- compaction --------------------------------------------------------------------------

    def compact(self) -> None:
        """Start compacting (Pulsar's trigger); ConflictError while a
        compaction runs."""
        self._check_serving()
        if self.compaction.running:
            raise ConflictError(f"compaction of {self.name} already in progress")
        state = self.compaction
        state.running, state.status, state.last_error = True, CompactionStatus.RUNNING, ""
        state.messages_read = state.bytes_read = 0
        state.started_s = time.monotonic()
        self._compaction_hold = (self.compaction_record.horizon + 1 if self.compaction_record is not None
                                 else self.managed_ledger.first_offset)
        self.spawn(self._compaction_task)

    async def _compaction_task(self) -> None:
        state = self.compaction
        compactor = Compactor(partition=self.name, bookkeeper=self.context.bookkeeper, topic_store=self.topic_store,
                              managed_ledger=self.managed_ledger, policies=self.policies, password=self.context.ledger_password,
                              state=state, on_switched=self._compaction_switched)
        try:
            error = await compactor.run()
        finally:
            state.running = False
            state.duration_s = time.monotonic() - state.started_s
            self._compaction_hold = None
        if error is None:
            state.status, state.last_error = CompactionStatus.SUCCESS, ""
            state.messages_kept = self.compaction_record.messages if self.compaction_record is not None else 0
            state.last_succeeded_ms = int(time.time() * 1000)
        else:
            state.status, state.last_error = CompactionStatus.ERROR, error
            state.last_failed_ms = int(time.time() * 1000)
            log.warning("%s", error)

    def _compaction_switched(self, record: CompactionRecord) -> None:
        """A compaction's record is in use (loaded, or just switched in)."""
        self.compaction_record = record
        self.compacted_view = (CompactedView(self.context.bookkeeper, self.context.ledger_password, record)
                               if record.ledger_id is not None else None)
        for subscription in self.subscriptions.values():
            subscription.wake()

    async def cursor_ledgers(self) -> tuple[int, ...]:
        """Every cursor ledger of the partition's durable subscriptions:
        those their nodes name or list as retired, and those this load made."""
        ledger_ids = {ledger_id for subscription in self.subscriptions.values() if subscription.durable
                      for ledger_id in subscription.cursor_ledger.owned_ledgers()}
        for subscription_name, (record, _) in (await self.topic_store.read_cursors(self.name)).items():
            try:
                named, retired = stored_placement(record)
            except ValueError as error:
                log.error("partition %s: cursor %s unreadable, its ledgers left alone: %s", self.name, subscription_name, error)
                continue
            ledger_ids.update(retired)
            if named is not None:
                ledger_ids.add(named)
        return tuple(sorted(ledger_ids))

    async def delete_ledgers(self, ledger_ids: tuple[int, ...]) -> None:
        """The partition is deleted: so are these ledgers of its own (one
        gone already is no error)."""
        for ledger_id in ledger_ids:
            try:
                await self.context.bookkeeper.delete_ledger(ledger_id)
            except NoSuchLedgerError:
                pass

    async def delete_compacted_ledgers(self, record: CompactionRecord) -> None:
        """The partition is deleted: so are the ledgers its compaction record names."""
        await self.delete_ledgers(tuple(record.ledger_ids))

    def compaction_due(self) -> bool:
        """Whether the compaction threshold asks for a compaction now."""
        threshold = self.policies.compaction_threshold_bytes
        if threshold is None or self.compaction.running or self.closing or self.fenced is not None:
            return False
        if self.compaction.status == CompactionStatus.ERROR and \
                time.time() * 1000 - self.compaction.last_failed_ms < COMPACTION_RETRY_AFTER_S * 1000:
            return False  # a compaction that failed is not started again at every check
        since = self.compaction_record.horizon + 1 if self.compaction_record is not None else self.managed_ledger.first_offset
        if since > self.managed_ledger.confirmed_offset:
            return False
        return self.managed_ledger.core.bytes_after(since) >= max(threshold, 1)

    def backlog_bytes(self) -> int:
        """What the backlog quota bounds: by Pulsar's model, the bytes from
        the oldest message a durable subscription has not acknowledged on;
        by YDB's, every byte stored."""
        managed_ledger = self.managed_ledger
        if self.policies.retention_model != "pulsar":
            return managed_ledger.stored_bytes
        held = self.held_from_offset()
        return 0 if held is None else managed_ledger.core.bytes_from(held)

    async def expire_messages(self, ttl_s: int | None = None, subscriptions: list[Subscription] | None = None) -> dict[str, int]:
        """Acknowledge, on behalf of `subscriptions` (default: every one),
        the messages published more than `ttl_s` seconds ago (default: the
        message TTL policy; nothing without one). Returns how many each
        subscription had expired."""
        ttl_s = self.policies.message_ttl_s if ttl_s is None else ttl_s
        chosen = list(self.subscriptions.values()) if subscriptions is None else subscriptions
        if ttl_s is None or not chosen:
            return {}
        cutoff_ms = int(time.time() * 1000) - ttl_s * 1000
        if all(subscription.backlog() == 0 for subscription in chosen):
            return {subscription.name: 0 for subscription in chosen}
        try:
            offset = await self.managed_ledger.offset_at_time(cutoff_ms)
        except EntryGoneError:
            return {}  # retention trimmed the partition meanwhile: the next check looks again
        expired = {}
        for subscription in chosen:
            if subscription.closed:
                continue
            try:
                count = await subscription.acknowledge_before(offset)
            except TopicFencedError:
                continue  # deleted or closed meanwhile
            subscription.expired_messages += count
            expired[subscription.name] = count
        return expired

    async def apply_retention(self) -> list[int]:
        deleted = await self.managed_ledger.trim(self.held_from_offset())
        if deleted:
            for subscription in self.subscriptions.values():
                self._skip_trimmed(subscription)
        return deleted

    def _skip_trimmed(self, subscription: Subscription) -> None:
        """Retention deleted what lies before the first offset: the
        subscription's cursor moves past it, unless the partition has a
        compacted view, which still holds keys from there (a read-compacted
        consumer reads them; the others' reads start at the first entry
        stored, and the next retention that deletes a ledger moves the
        cursors of those connected without reading compacted)."""
        if self.compaction_record is not None and (subscription.read_compacted or not subscription.consumers):
            return
        subscription.skip_to(self.managed_ledger.first_offset)

    # --- stats -------------------------------------------------------------------------------

    def describe(self) -> dict:
        managed_ledger = self.managed_ledger
        state = managed_ledger.open_ledger_state
        ledgers = []
        for info in managed_ledger.record.ledgers:
            entry = {"ledger_id": info.ledger_id, "first_offset": info.first_offset, "created_ms": info.created_ms}
            if info.is_closed:
                entry.update(entries=info.entries, messages=info.messages, bytes=info.bytes, closed_ms=info.closed_ms, state="closed")
            else:
                entry.update(entries=state.entries, messages=state.messages, bytes=state.bytes, state="open")
            ledgers.append(entry)
        return {
            "partition": self.name,
            "first_offset": managed_ledger.first_offset,
            "next_offset": managed_ledger.confirmed_offset + 1,
            "stored_bytes": managed_ledger.stored_bytes,
            "backlog_quota_bytes": self.policies.backlog_quota_bytes,
            "messages_in": self.stats.messages_in,
            "bytes_in": self.stats.bytes_in,
            "messages_out": self.stats.messages_out,
            **self.stats.rates(time.monotonic()),
            "producers": [{"producer_id": link.producer_id, "messages_in": link.messages_in,
                           "last_sequence_id": self.publishing.last_persisted(link.producer_id)} for link in self.producers.values()],
            "subscriptions": {name: subscription.stats() for name, subscription in self.subscriptions.items()},
            "ledgers": ledgers,
            "policies": self.policies.to_dict(),
            "compaction": self.compaction_stats(),
        }

    def compaction_stats(self) -> dict:
        state, record = self.compaction, self.compaction_record
        stats = {"status": state.status, "last_error": state.last_error, "running": state.running,
                 "messages_read": state.messages_read, "bytes_read": state.bytes_read,
                 "removed_messages": max(0, state.messages_read - state.messages_kept) if state.status == CompactionStatus.SUCCESS else 0,
                 "duration_ms": int(state.duration_s * 1000), "last_succeeded_ms": state.last_succeeded_ms,
                 "last_failed_ms": state.last_failed_ms}
        if record is not None:
            stats.update(horizon=record.horizon, ledger_id=record.ledger_id, entries=record.entries, messages=record.messages,
                         bytes=record.bytes, compacted_ms=record.compacted_ms)
        return stats


__all__ = ["BrokerContext", "PartitionService", "ProducerLink"]
