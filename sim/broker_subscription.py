"""A subscription on the simulated broker's load of the partition: a driver
of the real `SubscriptionCore` (acknowledgements, their group commit, the
cursor's writes, consumers and types, dispatching only within the lease),
as `broker/subscription.py` is with trio; here the dispatch loop reads the
simulated log's entries, and a read of entries delivered again may fail
(what could not be sent goes back to the dispatcher)."""

from __future__ import annotations

from typing import Any

from broker.cursor import Cursor
from broker.dispatcher import Delivery, Dispatcher, EntryRef, SubscriptionType
from broker.errors import BadRequestError, BrokerStatus, ConsumerBusyError, TopicFencedError
from broker.subscription_core import CursorWrite, SubscriptionCore
from broker.topic_records import cursor_path
from sim.broker_messages import PARTITION, SUBSCRIPTION, Closed, Deliver
from sim.broker_calls import ConsumerLink, PartitionView, Respond, write_versioned

READ_ENTRIES_MAX = 100  # entries per read, as broker/subscription.py
READ_MS_MAX = 1.0  # a read of recent entries (the entry cache, or a bookie)
READ_FAILURE_BACKOFF_MS = 500.0  # READ_FAILURE_BACKOFF_S

# What waits for a durable write: (offsets, cumulative, respond).
AckWaiter = tuple


class SimSubscription:
    def __init__(self, partition: PartitionView, kind: SubscriptionType, cursor: Cursor, cursor_version: int | None) -> None:
        self.partition = partition
        self.broker = partition.broker
        self.core: SubscriptionCore[AckWaiter] = self.broker.subscription_core_class(
            SUBSCRIPTION, kind, cursor, cursor_version=cursor_version,
            ranges_persisted_max=self.broker.parameters.cursor_ranges_max,
        )
        self.consumers: dict[int, ConsumerLink] = {}
        self._read_index: int | None = None
        self._closed = False  # unloaded: what still waited was answered
        self._finishing: Any = None  # an unload's next step, once the write in flight is done
        self._finishing_write = False
        self._dispatch_scheduled = False
        self._reading = False

    @property
    def instance(self) -> str:
        return self.partition.instance

    @property
    def closed(self) -> bool:
        return self.core.closed

    @property
    def dispatcher(self) -> Dispatcher:
        return self.core.dispatcher

    # --- consumers ------------------------------------------------------------------------

    def add_consumer(self, link: ConsumerLink, kind: SubscriptionType, priority: int) -> BrokerStatus:
        checker = self.broker.checker
        try:
            changed = self.core.add_consumer(link.consumer_id, link.name, kind, priority)
        except ConsumerBusyError:
            return BrokerStatus.CONSUMER_BUSY
        except TopicFencedError:
            return BrokerStatus.TOPIC_FENCED
        if changed:
            self._read_index = None
            checker.subscription_type_changed(self.instance, kind)
        self.consumers[link.consumer_id] = link
        checker.consumer_added(self.instance, link.consumer_id, link.name, priority)
        self.wake()
        return BrokerStatus.OK

    def remove_consumer(self, consumer_id: int) -> None:
        if self.consumers.pop(consumer_id, None) is not None:
            self.core.remove_consumer(consumer_id)
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
        try:
            outcome = self.core.acknowledge(offsets, cumulative, self.partition.confirmed_offset, (offsets, cumulative, respond))
        except BadRequestError:
            return respond(BrokerStatus.BAD_REQUEST)
        except TopicFencedError:
            return respond(BrokerStatus.TOPIC_FENCED)
        assert not outcome.refused, "the simulated runs stay far below the bound of acknowledged ranges"
        self.broker.checker.acknowledged(self.instance, offsets, cumulative)
        self.wake()
        self._answer(outcome.answer_now, self.core.cursor.to_record(self.core.ranges_persisted_max))
        self._persist()

    def _persist(self) -> None:
        """Carry out the writes the core asks for, one at a time."""
        write = self.core.next_write()
        if write is not None:
            self._write(write, lambda: self._persist())

    def write_now(self, on_written: Any) -> None:
        """The core's forced write (at load, at creation); `on_written(error)`."""
        self._write(self.core.force_write(), lambda: on_written(None), on_written)

    def _write(self, write: CursorWrite, then: Any, on_failed: Any = None) -> None:
        checker, ranges_max = self.broker.checker, self.broker.parameters.cursor_ranges_max

        def written(result: Any, error: Exception | None) -> None:
            if self._closed and on_failed is None:
                return  # unloaded meanwhile: what waited was answered then
            if error is not None:
                for _, _, respond in self.core.cursor_write_failed(write):
                    respond(BrokerStatus.TOPIC_FENCED)
                if on_failed is not None:
                    return on_failed(error)
                return self.partition.fence(f"cursor write failed: {type(error).__name__}")
            self._answer(self.core.cursor_written(write, result), write.record)
            self._finish_step()
            then()

        store_write = write_versioned(cursor_path(PARTITION, SUBSCRIPTION), write.record, write.expected_version,
                                      lambda: checker.cursor_written(write.record, ranges_max))
        self.broker.zk_call(store_write, written, f"write cursor v{write.expected_version} mark-delete "
                                                  f"{write.record['mark_delete']} ranges {len(write.record['acked'])}")

    def _answer(self, waiters: Any, record: dict) -> None:
        for offsets, cumulative, respond in waiters:
            self.broker.checker.ack_answered(offsets, cumulative, record)
            respond(BrokerStatus.OK)

    def finish(self, write: bool, then: Any) -> None:
        """The partition unloads (`Subscription.finish`): no more
        acknowledgements or deliveries; with `write`, what was taken is
        written (after a write in flight). The acknowledgements still
        waiting are answered TOPIC_FENCED, so that the client sends them
        again to the next owner; then `then()`."""
        self.core.stop()
        self._finishing = then
        self._finishing_write = write
        self._finish_step()

    def _finish_step(self) -> None:
        then = self._finishing
        if then is None or (self._finishing_write and self.core.writing):
            return
        self._finishing = None
        if self._finishing_write and self.core.unwritten:
            self._write(self.core.force_write(), lambda: self._finished(then), lambda error: self._finished(then))
        else:
            self._finished(then)

    def _finished(self, then: Any) -> None:
        self._closed = True
        for _, _, respond in self.core.close():
            respond(BrokerStatus.TOPIC_FENCED)
        then()

    def close(self) -> None:
        """Unloaded: its consumers are told to look the partition up again
        (what still waited was answered by `finish`, or is now)."""
        self._closed = True
        for _, _, respond in self.core.close():
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
        return self.core.may_dispatch(self.broker.holds_lease(self.partition.session_id))

    def _dispatch_once(self) -> None:
        self._dispatch_scheduled = False
        if self._reading or not self.may_dispatch():
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
