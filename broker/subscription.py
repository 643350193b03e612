"""A subscription on a partition this broker owns: its cursor, its
dispatcher, the task that reads entries and sends them to consumers, and the
cursor's persistence.

Acknowledgements are group-committed: whatever arrived while a write of the
cursor was in flight goes into the next write, and an acknowledgement is
answered only once a write that covers it is durable. So an acknowledged
message never comes back after a crash or a takeover (unless the cursor
holds more individually acknowledged ranges than a record keeps,
RANGES_PERSISTED_MAX: those beyond come back); one acknowledged but not yet
answered may (at-least-once). In memory a cursor holds at most
ACKED_RANGES_MAX ranges: past it, an individual acknowledgement that would
start a new range is refused, while one that closes a gap or extends a
range is taken, and so always is the oldest unacknowledged message's.
Delivery stops while the broker's ZooKeeper lease is not known valid (see
BrokerServer._lease_loop).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

import trio

from broker.cursor import Cursor
from broker.dispatcher import ConsumerRefusedError, Delivery, Dispatcher, EntryRef, SubscriptionType
from broker.errors import BadRequestError, BrokerError, ConsumerBusyError, TopicFencedError
from broker.managed_ledger import EntryGoneError, ManagedLedger, Position, StoredEntry
from broker.message_format import MalformedEntryError
from ledger_client import BKError
from broker.protocol import MessageDelivery
from coordination.store import MetadataError, NodeExistsError

if TYPE_CHECKING:
    from broker.topic import PartitionService

log = logging.getLogger(__name__)

READ_ENTRIES_MAX = 100  # entries per read from the managed ledger
READ_FAILURE_BACKOFF_S = 0.5
ACKED_RANGES_MAX = 100_000  # individually acknowledged ranges a cursor holds in memory


@dataclass(slots=True)
class ConsumerLink:
    """How the broker reaches one consumer: its connection's send."""

    consumer_id: int  # unique in this broker
    handle: int  # the client's handle for it on its connection
    name: str
    send: Callable[[MessageDelivery], None]
    wait_for_room: Callable[[], Awaitable[None]]  # until the connection's queued output is under its bound
    messages_out: int = 0


class Subscription:
    def __init__(
        self,
        partition: "PartitionService",
        name: str,
        subscription_type: SubscriptionType,
        cursor: Cursor,
        *,
        durable: bool,
        important: bool,
        cursor_version: int | None,
        created_ms: int,
    ) -> None:
        self.partition = partition
        self.name = name
        self.subscription_type = subscription_type
        self.cursor = cursor
        self.durable = durable
        self.important = important
        self.created_ms = created_ms
        self.dispatcher = Dispatcher(subscription_type, cursor, partition_index=partition.partition_index)
        self.consumers: dict[int, ConsumerLink] = {}
        self.closed = False
        self.acked_ranges_max = ACKED_RANGES_MAX
        self.messages_out = 0
        self.read_position: Position | None = None
        self.idle_since = time.monotonic()  # when its last consumer left
        self._wakeup = trio.Event()
        # Persistence (durable subscriptions): generations of changes.
        self._cursor_version = cursor_version
        self._changes = 0  # changes made
        self._persisted = 0  # changes durable
        self._persist_wakeup = trio.Event()
        self._persisted_event = trio.Event()
        self._persist_error: BrokerError | None = None
        self._write_lock = trio.Lock()
        self._read_ahead_done: trio.Event | None = None  # set while a read-ahead is in flight

    @property
    def managed_ledger(self) -> ManagedLedger:
        return self.partition.managed_ledger

    # --- consumers ---------------------------------------------------------------------

    def add_consumer(self, link: ConsumerLink, subscription_type: SubscriptionType, priority: int) -> None:
        if self.closed:
            raise TopicFencedError(f"subscription {self.name} is closing")
        if subscription_type is not self.subscription_type:
            if self.consumers:
                raise ConsumerBusyError(
                    f"subscription {self.name} is {self.subscription_type.value} with consumers connected; "
                    f"asked for {subscription_type.value}"
                )
            # Nobody is connected: the subscription takes the new type.
            self.subscription_type = subscription_type
            self.dispatcher = Dispatcher(subscription_type, self.cursor, partition_index=self.partition.partition_index)
            self.read_position = None
        try:
            self.dispatcher.add_consumer(link.consumer_id, link.name, priority=priority)
        except ConsumerRefusedError as error:
            raise ConsumerBusyError(f"subscription {self.name}: {error}") from None
        self.consumers[link.consumer_id] = link
        self.wake()

    def remove_consumer(self, consumer_id: int) -> None:
        if self.consumers.pop(consumer_id, None) is not None:
            self.dispatcher.remove_consumer(consumer_id)
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
        if self.closed:
            raise TopicFencedError(f"subscription {self.name} of {self.partition.name} is being unloaded: acknowledge again once reconnected")
        confirmed = self.managed_ledger.confirmed_offset
        if any(offset > confirmed for offset in offsets):
            raise BadRequestError(f"acknowledgement of an offset beyond the last message ({confirmed})")
        refused: list[int] = []
        if cumulative:
            if len(offsets) != 1:
                raise BadRequestError("a cumulative acknowledgement names one offset")
            if self.subscription_type in (SubscriptionType.SHARED, SubscriptionType.KEY_SHARED):
                # As Pulsar: with several consumers, "everything up to here"
                # would acknowledge what other consumers hold.
                raise BadRequestError(f"cumulative acknowledgement is not allowed on a {self.subscription_type.value} subscription")
            self.cursor.acknowledge_cumulative(offsets[0])
            self.dispatcher.acknowledged_through(offsets[0])
        elif len(self.cursor.acked) + len(offsets) <= self.acked_ranges_max:
            # (Each offset adds at most one range: no need to look closer.)
            self.cursor.acknowledge(offsets)
            self.dispatcher.acknowledged(offsets)
        else:
            # Near the bound, only what would start a new range past it is
            # refused: acknowledgements that close a gap or extend a range,
            # and the oldest unacknowledged message's, are always taken.
            refused = self.cursor.acknowledge_within(offsets, self.acked_ranges_max)
            if refused:
                refused_set = set(refused)
                offsets = [offset for offset in offsets if offset not in refused_set]
            self.dispatcher.acknowledged(offsets)
        if offsets:
            # The mark-delete position may have moved: a key-shared consumer
            # held back may take messages now.
            self.wake()
            await self._changed_and_persisted()
        if refused:
            raise BadRequestError(
                f"subscription {self.name} holds {len(self.cursor.acked)} ranges of individually acknowledged messages, "
                f"its bound: {len(refused)} of {len(refused) + len(offsets)} acknowledgements refused, each would start a "
                f"new range (offsets {refused[0]}..{refused[-1]}); the others are taken. Acknowledge the oldest "
                f"unacknowledged message first (offset {self.cursor.mark_delete + 1}): it is always taken, and so is "
                "one that closes a gap or extends a range"
            )

    async def _changed_and_persisted(self) -> None:
        if not self.durable:
            return
        self._changes += 1
        target = self._changes
        self._persist_wakeup.set()
        while self._persisted < target:
            if self._persist_error is not None:
                raise self._persist_error
            await self._persisted_event.wait()
        if self._persist_error is not None:
            raise self._persist_error

    async def persist_loop(self) -> None:
        """Write the cursor whenever it changed; one write at a time."""
        if not self.durable:
            return
        while not self.closed:
            while self._persisted == self._changes and not self.closed:
                self._persist_wakeup = trio.Event()
                await self._persist_wakeup.wait()
            if self.closed:
                return
            try:
                await self._persist()
            except BrokerError as error:
                self._fail_waiters(error)
                if not self.closed:  # a subscription deleted meanwhile fences nothing
                    self.partition.fence(error)
                return

    async def _persist(self) -> None:
        """Write what changed so far, then answer the acknowledgements it covers."""
        target = self._changes
        await self.write_cursor()
        self._persisted = max(self._persisted, target)
        self._persisted_event.set()
        self._persisted_event = trio.Event()

    def _fail_waiters(self, error: BrokerError) -> None:
        if self._persist_error is None:
            self._persist_error = error
        self._persisted_event.set()

    async def finish(self, *, write: bool) -> None:
        """The partition unloads: stop dispatching and taking
        acknowledgements; with `write`, make every acknowledgement taken
        durable first. Every acknowledgement still waiting is answered
        (with an error if its write did not happen: the client sends it
        again to the next owner)."""
        self.close()
        if write and self.durable and self._persisted < self._changes:
            try:
                await self._persist()
            except BrokerError as error:
                log.warning("%s", error)
        if self._persisted < self._changes:
            self._fail_waiters(TopicFencedError(
                f"subscription {self.name} of {self.partition.name} was unloaded before this acknowledgement was durable"))

    async def write_cursor(self) -> None:
        """Compare-and-set the cursor (creating it the first time: a
        NodeExistsError then means it was there already). Writes are one at
        a time; any other failure is a TopicFencedError."""
        async with self._write_lock:
            record = {
                **self.cursor.to_record(),
                "type": self.subscription_type.value,
                "important": self.important,
                "created_ms": self.created_ms,
            }
            try:
                self._cursor_version = await self.partition.topic_store.write_cursor(
                    self.partition.name, self.name, record, self._cursor_version
                )
            except NodeExistsError:
                if self._cursor_version is None:
                    raise
                raise TopicFencedError(f"subscription {self.name} of {self.partition.name}: cursor created by another broker") from None
            except MetadataError as error:
                raise TopicFencedError(f"subscription {self.name} of {self.partition.name}: cursor write failed: {error}") from None

    # --- seeking and retention -------------------------------------------------------------

    async def seek(self, offset: int) -> None:
        """Move the subscription: `offset` is the next message delivered."""
        offset = max(offset, self.managed_ledger.first_offset)
        offset = min(offset, self.managed_ledger.confirmed_offset + 1)
        self.cursor.reset(offset)
        self.dispatcher.reset(offset)
        self.read_position = None
        self.wake()
        await self._changed_and_persisted()

    def skip_to(self, first_offset: int) -> None:
        """Retention deleted everything below `first_offset`."""
        if self.cursor.mark_delete < first_offset - 1:
            self.cursor.skip_to(first_offset)
            self.dispatcher.acknowledged_through(first_offset - 1)
            if self.dispatcher.read_offset < first_offset:
                self.dispatcher.read_offset = first_offset
                self.read_position = None
            self._changes += 1
            self._persist_wakeup.set()
            self.wake()

    def backlog(self) -> int:
        return self.cursor.backlog(self.managed_ledger.confirmed_offset)

    # --- dispatching --------------------------------------------------------------------------

    async def dispatch_loop(self) -> None:
        lease = self.partition.context.lease
        while not self.closed:
            if not lease.valid():
                # Cut off from ZooKeeper (or paused), this broker may no
                # longer own the partition: its session may have expired and
                # another broker taken over. Deliver nothing until the
                # session is known alive again.
                await lease.wait_valid()
                continue
            self._wakeup = trio.Event()
            try:
                progressed = await self._dispatch_once()
            except BrokerError as error:
                self.partition.fence(error)
                return
            except (BKError, MalformedEntryError) as error:  # a bookie read failed: retry later
                log.warning("subscription %s of %s: reading failed: %s", self.name, self.partition.name, error)
                await trio.sleep(READ_FAILURE_BACKOFF_S)
                continue
            if progressed:
                await trio.lowlevel.checkpoint()
                continue
            await self._wakeup.wait()

    async def _dispatch_once(self) -> bool:
        deliveries = self.dispatcher.dispatch_replay()
        if deliveries:
            await self._send(deliveries, {})
            return True
        if not self.dispatcher.wants_read():
            return False
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
            ref = EntryRef(entry.position.ledger_id, entry.position.entry_id, header.first_offset, header.message_count, header.keys)
            stored[(ref.ledger_id, ref.entry_id)] = entry
            deliveries += self.dispatcher.entry_read(ref)
            self.read_position = Position(entry.position.ledger_id, entry.position.entry_id + 1)
            if not self.dispatcher.wants_read():
                break
        await self._send(deliveries, stored)
        self._start_read_ahead()
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
            ref = delivery.entry
            entry = stored.get((ref.ledger_id, ref.entry_id))
            if entry is None:
                try:
                    entry = await self.managed_ledger.read_entry(Position(ref.ledger_id, ref.entry_id))
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
            self.partition.stats.messages_out += count
            # A consumer's socket that does not keep up: wait before queueing
            # more for it (permits bound messages, this bounds bytes).
            await link.wait_for_room()

    def close(self) -> None:
        self.closed = True
        self.wake()
        self._persist_wakeup.set()

    def stats(self) -> dict:
        return {
            "type": self.subscription_type.value,
            "durable": self.durable,
            "important": self.important,
            "mark_delete_offset": self.cursor.mark_delete,
            "individually_acknowledged_ranges": len(self.cursor.acked),
            "backlog_messages": self.backlog(),
            "messages_out": self.messages_out,
            "held_for_redelivery": self.dispatcher.replay_count,
            "unacknowledged_messages": self.dispatcher.unacked_total,
            "consumers": [
                {"name": link.name, "permits": self.dispatcher.permits(link.consumer_id),
                 "unacknowledged": self.dispatcher.unacked_count(link.consumer_id), "messages_out": link.messages_out,
                 "active": self.dispatcher.active_consumer_id in (None, link.consumer_id)
                 if self.subscription_type in (SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER) else True}
                for link in self.consumers.values()
            ],
        }


__all__ = ["ConsumerLink", "Subscription"]
