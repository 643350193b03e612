"""A subscription on the simulated broker's load of the partition, as
`broker/subscription.py`: the real `Cursor` and `Dispatcher`, acknowledgements
group-committed and answered once a cursor write covering them is durable,
and the dispatch loop (reads, deliveries, what could not be sent given
back). It dispatches only while its broker's lease on its ZooKeeper
session holds (see `sim.broker_node`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.cursor import Cursor
from broker.dispatcher import ConsumerRefusedError, Delivery, EntryRef, SubscriptionType
from broker.errors import BrokerStatus
from broker.topic_store import cursor_path
from sim.broker_messages import PARTITION, SUBSCRIPTION, Closed, Deliver
from sim.broker_partition import ConsumerLink, Respond, write_versioned

if TYPE_CHECKING:
    from sim.broker_partition import SimPartition

READ_ENTRIES_MAX = 100  # entries per read, as broker/subscription.py
READ_MS_MAX = 1.0  # a read of recent entries (the entry cache, or a bookie)
READ_FAILURE_BACKOFF_MS = 500.0  # READ_FAILURE_BACKOFF_S


class SimSubscription:
    def __init__(self, partition: "SimPartition", kind: SubscriptionType, cursor: Cursor, cursor_version: int) -> None:
        self.partition = partition
        self.broker = partition.broker
        self.kind = kind
        self.cursor = cursor
        self.dispatcher = partition.dispatcher_class(kind, cursor)
        self.consumers: dict[int, ConsumerLink] = {}
        self.closed = False
        self._version = cursor_version
        self._changes = 0
        self._persisted = 0
        self._writing = False
        self._waiting: list[tuple[int, tuple[int, ...], bool, Respond]] = []  # (change, offsets, cumulative, respond)
        self._read_index: int | None = None
        self._dispatch_scheduled = False
        self._reading = False

    @property
    def instance(self) -> str:
        return self.partition.instance

    # --- consumers ------------------------------------------------------------------------

    def add_consumer(self, link: ConsumerLink, kind: SubscriptionType, priority: int) -> BrokerStatus:
        checker = self.broker.checker
        if kind is not self.kind:
            if self.consumers:
                return BrokerStatus.CONSUMER_BUSY
            self.kind = kind
            self.dispatcher = self.partition.dispatcher_class(kind, self.cursor)
            self._read_index = None
            checker.subscription_type_changed(self.instance, kind)
        try:
            self.dispatcher.add_consumer(link.consumer_id, link.name, priority=priority)
        except ConsumerRefusedError:
            return BrokerStatus.CONSUMER_BUSY
        self.consumers[link.consumer_id] = link
        checker.consumer_added(self.instance, link.consumer_id, link.name, priority)
        self.wake()
        return BrokerStatus.OK

    def remove_consumer(self, consumer_id: int) -> None:
        if self.consumers.pop(consumer_id, None) is not None:
            self.dispatcher.remove_consumer(consumer_id)
            self.broker.checker.consumer_removed(self.instance, consumer_id)
            self.wake()

    def flow(self, consumer_id: int, permits: int) -> None:
        self.dispatcher.flow(consumer_id, permits)
        self.wake()

    def redeliver(self, consumer_id: int, offsets: tuple[int, ...]) -> None:
        self.dispatcher.redeliver(consumer_id, offsets)
        self.broker.checker.redeliver_requested(self.instance, consumer_id, offsets)
        self.wake()

    # --- acknowledgements -------------------------------------------------------------------

    def acknowledge(self, offsets: tuple[int, ...], cumulative: bool, respond: Respond) -> None:
        """Take acknowledgements; `respond` once a cursor write covering them is durable."""
        # (The trio driver also bounds the ranges a cursor holds in memory,
        # ACKED_RANGES_MAX = 100,000, refusing past it only what would start
        # a new range: `Cursor.acknowledge_within`, tested on its own. The
        # simulated runs hold a few hundred messages, far from it.)
        if any(offset > self.partition.confirmed_offset for offset in offsets) or (cumulative and len(offsets) != 1):
            return respond(BrokerStatus.BAD_REQUEST)
        if cumulative and self.kind in (SubscriptionType.SHARED, SubscriptionType.KEY_SHARED):
            return respond(BrokerStatus.BAD_REQUEST)  # as Pulsar: it would acknowledge what others hold
        if cumulative:
            self.cursor.acknowledge_cumulative(offsets[0])
            self.dispatcher.acknowledged_through(offsets[0])
        else:
            self.cursor.acknowledge(offsets)
            self.dispatcher.acknowledged(offsets)
        self.broker.checker.acknowledged(self.instance, offsets, cumulative)
        self.wake()
        self._changes += 1
        self._await_durable(offsets, cumulative, respond)
        self._persist()

    def _await_durable(self, offsets: tuple[int, ...], cumulative: bool, respond: Respond) -> None:
        self._waiting.append((self._changes, offsets, cumulative, respond))

    def _persist(self) -> None:
        """Write the cursor whenever it changed; one write at a time (`persist_loop`)."""
        if self._writing or self._persisted == self._changes or self.closed:
            return
        target = self._changes
        record = {**self.cursor.to_record(self.broker.parameters.cursor_ranges_max), "type": self.kind.value}
        self._writing = True

        def written(result: Any, error: Exception | None) -> None:
            self._writing = False
            if self.closed:
                return  # unloaded meanwhile: what waited was answered then
            if error is not None:
                return self.partition.fence(f"cursor write failed: {type(error).__name__}")
            self._version = result
            self._persisted = target
            self._answer_durable(record)
            self._persist()

        checker, ranges_max = self.broker.checker, self.broker.parameters.cursor_ranges_max
        write = write_versioned(cursor_path(PARTITION, SUBSCRIPTION), record, self._version,
                                lambda: checker.cursor_written(record, ranges_max))
        self.broker.zk_call(write, written,
                            f"write cursor v{self._version} mark-delete {record['mark_delete']} ranges {len(record['acked'])}")

    def _answer_durable(self, record: dict) -> None:
        durable = [waiting for waiting in self._waiting if waiting[0] <= self._persisted]
        self._waiting = [waiting for waiting in self._waiting if waiting[0] > self._persisted]
        for _, offsets, cumulative, respond in durable:
            self.broker.checker.ack_answered(offsets, cumulative, record)
            respond(BrokerStatus.OK)

    def close(self) -> None:
        """Unloaded. The acknowledgements still waiting for a write are
        answered TOPIC_FENCED, so that the client sends them again to the
        next owner, as `Subscription.finish` does (left unanswered, they
        would wait for ever: `acks-wait-on-unload` in sim.broker_mistakes)."""
        self.closed = True
        waiting, self._waiting = self._waiting, []
        for _, _, _, respond in waiting:
            respond(BrokerStatus.TOPIC_FENCED)
        for link in sorted(self.consumers.values(), key=lambda link: link.consumer_id):
            self.broker.send_to(link.connection, Closed(link.handle, "partition moved"))

    # --- dispatching ----------------------------------------------------------------------------

    def wake(self) -> None:
        if not self._dispatch_scheduled and not self.closed:
            self._dispatch_scheduled = True
            self.broker.after(0, self._dispatch_once)

    def may_dispatch(self) -> bool:
        """Only while the broker's lease on its session holds (see sim.broker_node)."""
        return self.broker.holds_lease()

    def _dispatch_once(self) -> None:
        self._dispatch_scheduled = False
        if self.closed or self._reading or not self.may_dispatch():
            return  # woken again when the lease is renewed
        deliveries = self.dispatcher.dispatch_replay()
        if deliveries:
            # Messages delivered again are read again (a bookie read that may
            # fail): what could not be sent goes back to the dispatcher.
            world = self.broker.world
            for index, delivery in enumerate(deliveries):
                if world.chance(self.broker.parameters.read_error_probability):
                    for unsent in deliveries[index:]:
                        self.dispatcher.give_back(unsent)
                    self._send(deliveries[:index])
                    self._reading = True
                    self.broker.after(READ_FAILURE_BACKOFF_MS, self._read_failed_backoff)
                    return
            self._send(deliveries)
            self.wake()
            return
        if not self.dispatcher.wants_read():
            return
        partition = self.partition
        if self._read_index is None:
            self._read_index = partition.entry_index_of(self.dispatcher.read_offset)
        if self._read_index >= len(partition.entries):
            return  # woken again when an entry is persisted
        self._reading = True
        self.broker.after(self.broker.world.uniform(0, READ_MS_MAX), self._read_done, self._read_index)

    def _read_failed_backoff(self) -> None:
        self._reading = False
        self.wake()

    def _read_done(self, start: int) -> None:
        self._reading = False
        if self.closed or not self.may_dispatch():
            return
        deliveries: list[Delivery] = []
        for index, entry in enumerate(self.partition.entries[start:start + READ_ENTRIES_MAX], start=start):
            deliveries += self.dispatcher.entry_read(
                EntryRef(entry.ledger_id, entry.entry_id, entry.first_offset, entry.message_count, entry.keys)
            )
            self._read_index = index + 1
            if not self.dispatcher.wants_read():
                break
        self._send(deliveries)
        self.wake()

    def _send(self, deliveries: list[Delivery]) -> None:
        broker, checker = self.broker, self.broker.checker
        stale = not broker.owns_now(self.partition.session_id)
        for delivery in deliveries:
            link = self.consumers.get(delivery.consumer_id)
            if link is None:
                continue
            entry = delivery.entry
            offsets = tuple(entry.first_offset + index for index in delivery.batch_indexes)
            keys = tuple(entry.key_of(offset) for offset in offsets)
            checker.delivered(self.instance, delivery.consumer_id, offsets, keys, stale=stale)
            broker.send_to(link.connection, Deliver(link.handle, offsets, keys, delivery.redelivery_count))
