"""A subscription on a partition this broker owns, driven with trio: the
task that reads entries and sends them to consumers, and the task that
writes the cursor. Its rules (acknowledgements, their group commit, the
cursor's writes, seeking, consumers and types, dispatching only within the
lease) are `broker.subscription_core.SubscriptionCore`'s; which consumer
gets which message is `broker.dispatcher.Dispatcher`'s. Delivery stops
while the broker's ZooKeeper lease is not known valid (see
PartitionHosting._lease_loop in broker/hosting.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

import trio

from broker.compaction import CompactedView
from broker.compaction_core import CompactedEntry, CompactionError
from broker.cursor import Cursor
from broker.cursor_ledger import CursorLedger, CursorWritePacer
from broker.cursor_ledger_core import CursorPlacement
from broker.delayed_index import DiskSpillFile, SpillError
from broker.dispatcher import DELAYED_MAX_DEFAULT, Delivery, Dispatcher, EntryRef, HashRanges, SubscriptionType
from broker.errors import BrokerError, TopicFencedError
from broker.managed_ledger import EntryGoneError, ManagedLedger, Position, StoredEntry
from broker.message_format import MalformedEntryError, decode_entry
from broker.metrics import CounterRates
from broker.subscription_core import CursorWrite, SubscriptionCore
from ledger_client import BKError
from broker.protocol import MessageDelivery
from coordination.store import MetadataError, NodeExistsError
from broker.lease import Lease
from broker.topic_store import TopicStore

log = logging.getLogger(__name__)

READ_ENTRIES_MAX = 100  # entries per read from the managed ledger
READ_FAILURE_BACKOFF_S = 0.5
# Entries read again at once for one pass's deliveries (redeliveries and
# delayed messages come from anywhere in the backlog, an entry each).
READS_AGAIN_IN_FLIGHT_MAX = 64
READS_AGAIN_AHEAD = 256  # deliveries whose entries are read before they are sent
CURSOR_WRITE_PAUSE_S_PER_RANGE = 0.0001  # after a cursor write of N ranges, the next waits N times this


@dataclass(slots=True)
class ConsumerLink:
    """How the broker reaches one consumer: its connection's send."""

    consumer_id: int  # unique in this broker
    handle: int  # the client's handle for it on its connection
    name: str
    send: Callable[[MessageDelivery], None]
    wait_for_room: Callable[[], Awaitable[None]]  # until the connection's queued output is under its bound
    messages_out: int = 0


class PartitionAccess(Protocol):
    """What a subscription needs of its partition (PartitionService is one)."""

    name: str
    partition_index: int
    session_id: int  # the ZooKeeper session that owns it: its lease is the one that counts
    managed_ledger: ManagedLedger
    topic_store: TopicStore
    compacted_view: CompactedView | None  # the partition's last compaction, if any
    cursor_pacer: CursorWritePacer  # the broker's bound on cursor-ledger appends

    @property
    def lease(self) -> Lease: ...

    def fence(self, error: BrokerError) -> None: ...

    def spawn(self, async_fn: Callable, *args: object) -> None: ...

    def delivered(self, count: int) -> None: ...


class AckWaiter:
    """One acknowledgement request waiting for a durable cursor write."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BrokerError | None = None

    def answer(self, error: BrokerError | None = None) -> None:
        self.error = error
        self.done.set()


class TakenAcknowledgement:
    """Acknowledgements a subscription took; `durable()` returns once their
    cursor write is (raising what refused any of them)."""

    __slots__ = ("subscription", "waiter", "refused", "taken")

    def __init__(self, subscription: "Subscription", waiter: AckWaiter, refused: list[int], taken: int) -> None:
        self.subscription = subscription
        self.waiter = waiter
        self.refused = refused
        self.taken = taken

    async def durable(self) -> None:
        await self.waiter.done.wait()
        if self.waiter.error is not None:
            raise self.waiter.error
        if self.refused:
            raise self.subscription.core.refused_error(self.refused, self.taken)


class Subscription:
    def __init__(
        self,
        partition: PartitionAccess,
        name: str,
        subscription_type: SubscriptionType,
        cursor: Cursor,
        *,
        durable: bool,
        important: bool,
        cursor_version: int | None,
        created_ms: int,
        retired_ledgers: tuple[int, ...] = (),
        core_class: type[SubscriptionCore] = SubscriptionCore,
        delayed_memory_messages: int = DELAYED_MAX_DEFAULT,
    ) -> None:
        """`retired_ledgers`: cursor ledgers of an earlier load, deleted
        once the cursor's node no longer names them (read_stored_cursor)."""
        self.partition = partition
        self.core: SubscriptionCore[AckWaiter] = core_class(
            name, subscription_type, cursor, durable=durable, important=important, created_ms=created_ms,
            cursor_version=cursor_version, partition_index=partition.partition_index, delayed_spill=DiskSpillFile,
            delayed_max=delayed_memory_messages,
        )
        managed_ledger = partition.managed_ledger
        self.cursor_ledger = CursorLedger(
            managed_ledger.bookkeeper, partition.topic_store, partition.name, name,
            CursorPlacement(cursor_version, retired=retired_ledgers), password=managed_ledger.password,
            policies=lambda: managed_ledger.policies, pacer=partition.cursor_pacer,
        )
        self.consumers: dict[int, ConsumerLink] = {}
        self.messages_out = 0
        self.expired_messages = 0  # acknowledged on its behalf: message TTL, an admin's expiry
        self.history = CounterRates("messages_out_per_s", "expired_per_s")  # sampled by the partition's housekeeping
        self.read_position: Position | None = None
        self.idle_since = time.monotonic()  # when its last consumer left
        self._wakeup = trio.Event()
        self._persist_wakeup = trio.Event()
        self._write_lock = trio.Lock()
        self._read_ahead_done: trio.Event | None = None  # set while a read-ahead is in flight
        self._spill_failures_logged = 0
        # Its consumers read the compacted view first (exclusive and
        # failover: the consumer that subscribed last says).
        self.read_compacted = False

    # What the core holds, named as the rest of the broker reads it.
    name = property(lambda self: self.core.name)
    cursor = property(lambda self: self.core.cursor)
    durable = property(lambda self: self.core.durable)
    closed = property(lambda self: self.core.closed)
    subscription_type = property(lambda self: self.core.subscription_type)

    @property
    def dispatcher(self) -> Dispatcher:
        return self.core.dispatcher

    @property
    def important(self) -> bool:
        return self.core.important

    @important.setter
    def important(self, important: bool) -> None:
        self.core.important = important

    @property
    def managed_ledger(self) -> ManagedLedger:
        return self.partition.managed_ledger

    # --- consumers ---------------------------------------------------------------------

    def add_consumer(self, link: ConsumerLink, subscription_type: SubscriptionType, priority: int,
                     hash_ranges: HashRanges | None = None) -> None:
        if self.core.add_consumer(link.consumer_id, link.name, subscription_type, priority, hash_ranges):
            self.read_position = None  # a new dispatcher reads from the cursor
        self.consumers[link.consumer_id] = link
        self.wake()

    def remove_consumer(self, consumer_id: int) -> None:
        if self.consumers.pop(consumer_id, None) is not None:
            self.core.remove_consumer(consumer_id)
            self.wake()
        if not self.consumers:
            self.idle_since = time.monotonic()

    def flow(self, consumer_id: int, permits: int) -> None:
        self.dispatcher.flow(consumer_id, permits)
        self.wake()

    def redeliver(self, consumer_id: int, offsets: list[int] | None) -> None:
        self.dispatcher.redeliver(consumer_id, offsets)
        self.wake()

    def wake(self) -> None:
        self._wakeup.set()

    # --- acknowledgements ----------------------------------------------------------------

    async def acknowledge(self, offsets: list[int], *, cumulative: bool) -> None:
        """Take acknowledgements; returns once they are durable."""
        await self.take_acknowledgement(offsets, cumulative=cumulative).durable()

    def take_acknowledgement(self, offsets: list[int], *, cumulative: bool) -> "TakenAcknowledgement":
        """Take acknowledgements now, in the order the connection brought
        them (a seek that follows must not be overtaken by them); what is
        returned waits until they are durable."""
        waiter = AckWaiter()
        outcome = self.core.acknowledge(offsets, cumulative, self.managed_ledger.confirmed_offset, waiter)
        taken = len(offsets) - len(outcome.refused)
        if taken:
            # The mark-delete position may have moved: a key-shared consumer
            # held back may take messages now.
            self.wake()
        for answered in outcome.answer_now:
            answered.answer()
        self._persist_wakeup.set()
        return TakenAcknowledgement(self, waiter, outcome.refused, taken)

    async def persist_loop(self) -> None:
        """Write the cursor whenever it changed; one write at a time (all
        writes hold the write lock, so the core never has two in flight)."""
        if not self.durable:
            return
        while not self.closed:
            self._persist_wakeup = trio.Event()
            pause_s = 0.0
            async with self._write_lock:
                write = self.core.next_write()
                if write is not None:
                    try:
                        await self._write(write)
                    except BrokerError as error:
                        if not self.closed:  # a subscription deleted meanwhile fences nothing
                            self.partition.fence(error)
                        return
                    # A cursor of many acknowledged ranges costs a large
                    # write: the next one waits in proportion (10,000
                    # ranges, 1 s, Pulsar's pace for every cursor), taking
                    # every acknowledgement that came meanwhile.
                    pause_s = len(write.record.get("acked", ())) * CURSOR_WRITE_PAUSE_S_PER_RANGE
            if write is not None:
                if pause_s > 0:
                    await trio.sleep(pause_s)
                continue
            await self._persist_wakeup.wait()

    async def _write(self, write: CursorWrite) -> None:
        """Carry out a cursor write the core asked for, and answer the
        acknowledgements it covers (or, if it failed, every one waiting)."""
        partition = self.partition
        failure: BrokerError = TopicFencedError(f"subscription {self.name} of {partition.name}: cursor write did not finish")
        written = False
        try:
            version = await self.cursor_ledger.write(write.record, inline=write.inline)
            written = True
        except NodeExistsError:
            if write.expected_version is None:
                raise
            failure = TopicFencedError(f"subscription {self.name} of {partition.name}: cursor created by another broker")
            raise failure from None
        except (MetadataError, BKError) as error:
            failure = TopicFencedError(f"subscription {self.name} of {partition.name}: cursor write failed: {error}")
            raise failure from None
        finally:
            if not written:  # failed, or cancelled (the partition unloads)
                for waiter in self.core.cursor_write_failed(write):
                    waiter.answer(failure)
        for waiter in self.core.cursor_written(write, version):
            waiter.answer()

    async def finish(self, *, write: bool) -> None:
        """The partition unloads: stop dispatching and taking
        acknowledgements; with `write`, make every acknowledgement taken
        durable first. Every acknowledgement still waiting is answered
        (with an error if its write did not happen: the client sends it
        again to the next owner)."""
        self.core.stop()
        self.wake()
        self._persist_wakeup.set()
        if write and self.durable:
            async with self._write_lock:  # after the write in flight, whose waiters it answers
                # Into the node, retiring the cursor's ledger: the next
                # owner reads the node alone, recovering no ledger.
                if self.core.unwritten or self.cursor_ledger.ledger_id is not None:
                    try:
                        await self._write(self.core.force_write())
                    except BrokerError as error:
                        log.warning("%s", error)
        self.close()

    async def delete_cursor(self) -> None:
        """The subscription is deleted (closed already): after the write in
        flight, its cursor ledgers are retired into its node and deleted,
        then the node. Raises TopicFencedError when a step fails: the node
        stays, listing what is left to delete, and the next load finds the
        subscription (delete it again)."""
        partition = self.partition
        async with self._write_lock:  # a write in flight must not land after the node is gone
            if self.cursor_ledger.owned_ledgers():
                await self._write(self.core.force_write())  # inline: every ledger retired, then deleted
            left = self.cursor_ledger.owned_ledgers()
            if left:
                raise TopicFencedError(f"subscription {self.name} of {partition.name}: cursor ledgers {list(left)} not "
                                       "deleted yet; its cursor is kept, listing them: delete the subscription again")
            # At the version this broker wrote: one another broker wrote
            # since is not this broker's to delete.
            await partition.topic_store.delete_cursor(partition.name, self.name, expected_version=self.core.cursor_version)

    async def write_cursor(self) -> None:
        """Write the cursor now, whatever changed (at load, at creation,
        when it turns important). Raises NodeExistsError when creating it
        finds it there already, and TopicFencedError when any other write
        fails."""
        async with self._write_lock:
            await self._write(self.core.force_write())

    # --- seeking and retention -------------------------------------------------------------

    async def seek(self, offset: int) -> None:
        """Move the subscription: `offset` is the next message delivered."""
        managed_ledger = self.managed_ledger
        self.core.seek(offset, managed_ledger.first_offset, managed_ledger.confirmed_offset)
        self.read_position = None
        self.wake()
        await self._durable()

    async def _durable(self) -> None:
        """Until every change of the cursor made so far is durable."""
        waiter = AckWaiter()
        for answered in self.core.when_durable(waiter):
            answered.answer()
        self._persist_wakeup.set()
        await waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error

    async def acknowledge_before(self, offset: int) -> int:
        """Acknowledge every message below `offset` (an admin's skip, clear
        backlog or expiry; message TTL); returns how many that acknowledged,
        once the cursor holding it is durable."""
        offset = min(offset, self.managed_ledger.confirmed_offset + 1)
        backlog = self.backlog()
        if self.core.skip_to(offset):
            self.read_position = None
        self.wake()
        await self._durable()
        return backlog - self.backlog()

    def skip_to(self, first_offset: int) -> None:
        """Retention deleted everything below `first_offset`."""
        if self.core.skip_to(first_offset):
            self.read_position = None
        self._persist_wakeup.set()
        self.wake()

    def backlog(self) -> int:
        return self.core.backlog(self.managed_ledger.confirmed_offset)

    # --- dispatching --------------------------------------------------------------------------

    async def dispatch_loop(self) -> None:
        lease, session_id = self.partition.lease, self.partition.session_id
        while not self.closed:
            if not self.core.may_dispatch(lease.valid(session_id)):
                # Cut off from ZooKeeper (or paused), this broker may no
                # longer own the partition: its session may have expired and
                # another broker taken over. Deliver nothing until the
                # session is known alive again.
                await lease.wait_valid(session_id)
                continue
            self._wakeup = trio.Event()
            try:
                progressed = await self._dispatch_once()
            except BrokerError as error:
                self.partition.fence(error)
                return
            except (BKError, MalformedEntryError, CompactionError, SpillError) as error:  # a read failed: retry later
                log.warning("subscription %s of %s: reading failed: %s", self.name, self.partition.name, error)
                await trio.sleep(READ_FAILURE_BACKOFF_S)
                continue
            if progressed:
                await trio.lowlevel.checkpoint()
                continue
            due_ms = self.dispatcher.next_delayed_ms()
            if due_ms is None:
                await self._wakeup.wait()
            else:
                # Delayed messages: wake when the earliest is due, too.
                with trio.move_on_after(max(0.0, (due_ms - time.time() * 1000) / 1000)):
                    await self._wakeup.wait()

    async def _dispatch_once(self) -> bool:
        now_ms = int(time.time() * 1000)
        self.dispatcher.release_due(now_ms)
        released = self.dispatcher.take_released_data()
        if released:
            self.managed_ledger.remember(released)
        failures, reason = self.dispatcher.delayed_spill_failures
        if failures > self._spill_failures_logged:
            self._spill_failures_logged = failures
            log.warning("subscription %s of %s: the delayed index could not spill to disk (%d times; its messages stay "
                        "in memory until it can): %s", self.name, self.partition.name, failures, reason)
        deliveries = self.dispatcher.dispatch_replay()
        if deliveries:
            await self._send(deliveries, {})
            return True
        if not self.dispatcher.wants_read():
            return False
        view = self.partition.compacted_view if self.read_compacted else None
        if view is not None and self.dispatcher.read_offset <= view.horizon:
            return await self._dispatch_compacted(view, now_ms)
        managed_ledger = self.managed_ledger
        if self.read_position is None:
            offset = self.dispatcher.read_offset
            position = await managed_ledger.position_of_offset(offset)
            self.read_position = position if position is not None else managed_ledger.end_position()
        position = self.read_position = managed_ledger.readable_position(self.read_position)
        if not managed_ledger.has_entry(position):
            return False
        if self._read_ahead_done is not None:
            await self._read_ahead_done.wait()  # what it reads is what we want next
        entries = await managed_ledger.read(position, READ_ENTRIES_MAX)
        if not entries:
            return False
        stored: dict[tuple[int, int], StoredEntry] = {}
        deliveries = []
        for entry in entries:
            header = entry.header
            ref = EntryRef(entry.position.ledger_id, entry.position.entry_id, header.first_offset, header.message_count, header.keys,
                           header.deliver_at_ms)
            stored[(ref.ledger_id, ref.entry_id)] = entry
            deliveries += self.dispatcher.entry_read(ref, now_ms, entry.data)
            self.read_position = Position(entry.position.ledger_id, entry.position.entry_id + 1)
            if not self.dispatcher.wants_read():
                break
        await self._send(deliveries, stored)
        self._start_read_ahead()
        return True

    async def _dispatch_compacted(self, view: CompactedView, now_ms: int) -> bool:
        """Deliver from the compacted view (the latest message of each key up
        to its horizon); once it is read through, reading goes on in the
        partition after the horizon."""
        compacted = await view.read(self.dispatcher.read_offset)
        if not compacted:
            self.dispatcher.read_past(view.horizon + 1)
            self.read_position = None
            return True
        stored: dict[tuple[int, int], StoredEntry] = {}
        deliveries = []
        for entry in compacted:
            stored_entry = _stored(entry)
            header = stored_entry.header
            ref = EntryRef(entry.ledger_id, entry.entry_id, entry.first_offset, entry.message_count, header.keys, 0,
                           frozenset(entry.retained_offsets))
            stored[(ref.ledger_id, ref.entry_id)] = stored_entry
            deliveries += self.dispatcher.entry_read(ref, now_ms)
            if not self.dispatcher.wants_read():
                break
        self.read_position = None
        await self._send(deliveries, stored)
        return True

    def _start_read_ahead(self) -> None:
        """Read the next stretch of a backlog into the entry cache while the
        consumers work through what was just sent (one read at a time)."""
        position = self.read_position
        if self._read_ahead_done is not None or position is None or self.closed:
            return
        position = self.managed_ledger.readable_position(position)
        if not self.managed_ledger.has_entry(position) or self.managed_ledger.cache.get(position.ledger_id, position.entry_id) is not None:
            return
        done = self._read_ahead_done = trio.Event()

        async def read_ahead() -> None:
            try:
                await self.managed_ledger.read(position, READ_ENTRIES_MAX)
            except (BKError, MalformedEntryError, BrokerError) as error:
                log.debug("subscription %s of %s: reading ahead failed: %s", self.name, self.partition.name, error)
            finally:
                self._read_ahead_done = None
                done.set()

        self.partition.spawn(read_ahead)

    async def _send(self, deliveries: list[Delivery], stored: dict[tuple[int, int], StoredEntry]) -> None:
        """Send what the dispatcher decided. A delivery that cannot be sent
        (its entry unreadable now) and every one after it go back to the
        dispatcher, permits included, to be delivered again."""
        for index, delivery in enumerate(deliveries):
            if index % READS_AGAIN_AHEAD == 0:
                # The entries of the next deliveries, read together (bounded:
                # sending them waits for the consumers' sockets in between).
                await self._read_again_all(deliveries[index:index + READS_AGAIN_AHEAD], stored)
            ref = delivery.entry
            entry = stored.get((ref.ledger_id, ref.entry_id))
            if entry is None:
                try:
                    entry = await self._read_again(ref)
                except EntryGoneError:
                    continue  # retention deleted it meanwhile: the cursor skips past it
                except BaseException:
                    for unsent in deliveries[index:]:
                        self.dispatcher.give_back(unsent)
                    raise
                stored[(ref.ledger_id, ref.entry_id)] = entry
            link = self.consumers.get(delivery.consumer_id)
            if link is None:
                continue  # it left meanwhile; its messages went back to the replay set
            link.send(MessageDelivery(link.handle, ref.ledger_id, ref.entry_id, delivery.batch_indexes,
                                      delivery.redelivery_count, entry.data))
            count = len(delivery.batch_indexes)
            link.messages_out += count
            self.messages_out += count
            self.partition.delivered(count)
            # A consumer's socket that does not keep up: wait before queueing
            # more for it (permits bound messages, this bounds bytes).
            await link.wait_for_room()

    async def _read_again_all(self, deliveries: list[Delivery], stored: dict[tuple[int, int], StoredEntry]) -> None:
        """Read the entries the deliveries need and `stored` lacks, up to
        READS_AGAIN_IN_FLIGHT_MAX at a time rather than one after another.
        What fails here is left out: `_send` reads it again and handles the
        error in delivery order."""
        missing: dict[tuple[int, int], EntryRef] = {}
        for delivery in deliveries:
            ref = delivery.entry
            key = (ref.ledger_id, ref.entry_id)
            if key not in stored:
                missing.setdefault(key, ref)
        if len(missing) < 2:
            return
        limiter = trio.CapacityLimiter(READS_AGAIN_IN_FLIGHT_MAX)

        async def read(key: tuple[int, int], ref: EntryRef) -> None:
            async with limiter:
                try:
                    stored[key] = await self._read_again(ref)
                except (EntryGoneError, BKError, MalformedEntryError, CompactionError, BrokerError):
                    pass

        async with trio.open_nursery() as nursery:
            for key, ref in missing.items():
                nursery.start_soon(read, key, ref)

    async def _read_again(self, ref: EntryRef) -> StoredEntry:
        """An entry delivered before (to be delivered again): from the
        compacted view when it came from there (retention may have deleted
        its original), else from the partition."""
        view = self.partition.compacted_view
        if ref.retained is not None and view is not None:
            compacted = await view.entry_at(ref.first_offset)
            if compacted is not None:
                return _stored(compacted)
        return await self.managed_ledger.read_entry(Position(ref.ledger_id, ref.entry_id))

    def close(self) -> None:
        """Unloaded or deleted: acknowledgements still waiting for a write
        are answered with an error (their clients send them again to the
        next owner)."""
        for waiter in self.core.close():
            waiter.answer(TopicFencedError(
                f"subscription {self.name} of {self.partition.name} was unloaded before this acknowledgement was durable"))
        self.wake()
        self._persist_wakeup.set()

    def counts(self) -> tuple[int, int]:
        """The counters its rates are of (`history`)."""
        return self.messages_out, self.expired_messages

    def stats(self) -> dict:
        return {
            "type": self.subscription_type.value,
            "durable": self.durable,
            "important": self.important,
            "mark_delete_offset": self.cursor.mark_delete,
            "individually_acknowledged_ranges": len(self.cursor.acked),
            # Where its acknowledgements are written (None: into its node).
            "cursor_ledger": self.cursor_ledger.ledger_id,
            "cursor_ledger_entries": self.cursor_ledger.placement.entries,
            # Acknowledgement batches (and seeks, skips) taken, not yet durable:
            # those a crash now would deliver again.
            "cursor_unwritten_changes": self.core.unwritten_changes,
            "backlog_messages": self.backlog(),
            "messages_out": self.messages_out,
            "expired_messages": self.expired_messages,
            **self.history.rates(time.monotonic(), self.counts()),
            "held_for_redelivery": self.dispatcher.replay_count,
            "unacknowledged_messages": self.dispatcher.unacked_total,
            "delayed_messages": self.dispatcher.delayed_count,
            "consumers": [
                {"name": link.name, "permits": self.dispatcher.permits(link.consumer_id),
                 "unacknowledged": self.dispatcher.unacked_count(link.consumer_id), "messages_out": link.messages_out,
                 "active": self.dispatcher.active_consumer_id in (None, link.consumer_id)
                 if self.subscription_type in (SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER) else True}
                for link in self.consumers.values()
            ],
        }


def _stored(entry: CompactedEntry) -> StoredEntry:
    """A compacted entry as the partition stored its original."""
    header, _ = decode_entry(entry.data)
    return StoredEntry(Position(entry.ledger_id, entry.entry_id), header, entry.data)


__all__ = ["ConsumerLink", "Subscription"]
