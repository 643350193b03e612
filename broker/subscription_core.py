"""The rules of one subscription on a loaded partition, as a pure state
machine: its consumers and their type, acknowledgements (checked, bounded,
applied to the cursor and the dispatcher), when the cursor is written and
which acknowledgements a durable write answers, seeking, retention's skips,
and whether it may dispatch at all (only within the broker's lease on its
ZooKeeper session).

Acknowledgements are group-committed: whatever arrives while a write of the
cursor is in flight goes into the next write, and an acknowledgement is
answered only once a write that covers it is durable. So an acknowledged
message never comes back after a crash or a takeover (unless the cursor
holds more individually acknowledged ranges than a record keeps: those
beyond come back); one acknowledged but not yet answered may
(at-least-once). In memory a cursor holds at most `acked_ranges_max` ranges:
past it, an individual acknowledgement that would start a new range is
refused, while one that closes a gap or extends a range is taken, and so
always is the oldest unacknowledged message's.

The trio driver (broker/subscription.py) and the simulator
(sim/broker_subscription.py) carry out its decisions: reading entries,
sending deliveries, writing the cursor. Waiters are the drivers' own
objects, handed back when their acknowledgement is answered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from broker.cursor import RANGES_PERSISTED_MAX_DEFAULT, Cursor
from broker.delayed_index import MemorySpillFile, SpillFactory
from broker.dispatcher import DELAYED_MAX_DEFAULT, ConsumerRefusedError, Dispatcher, HashRanges, SubscriptionType
from broker.errors import BadRequestError, ConsumerBusyError, TopicFencedError

# Individually acknowledged ranges a cursor holds in memory (about 48 bytes
# each). Delayed delivery acknowledges in time order, not offset order: a
# shared subscription working through a million delayed messages holds up
# to a quarter of a million ranges.
ACKED_RANGES_MAX = 1_000_000

Waiter = TypeVar("Waiter")


@dataclass(frozen=True, slots=True)
class CursorWrite:
    """Write this record (compare-and-set against `expected_version`; None:
    create it), then tell the core `cursor_written` or `cursor_write_failed`."""

    record: dict
    expected_version: int | None
    change: int  # the changes it covers
    # Into the cursor's ZooKeeper node itself, not appended to its ledger
    # (broker/cursor_ledger_core.py): the forced writes (at load, at
    # creation, at an unload, when it turns important).
    inline: bool = False


@dataclass(frozen=True, slots=True)
class AckOutcome(Generic[Waiter]):
    """What an acknowledgement did: `answer_now` are waiters to answer OK at
    once (nothing to make durable); `refused` are offsets not taken (the
    range bound), to report after the rest is durable."""

    answer_now: tuple
    refused: tuple[int, ...]


class SubscriptionCore(Generic[Waiter]):
    dispatcher_class: type[Dispatcher] = Dispatcher

    def __init__(
        self,
        name: str,
        subscription_type: SubscriptionType,
        cursor: Cursor,
        *,
        durable: bool = True,
        important: bool = False,
        created_ms: int = 0,
        cursor_version: int | None = None,
        partition_index: int = -1,
        acked_ranges_max: int = ACKED_RANGES_MAX,
        ranges_persisted_max: int = RANGES_PERSISTED_MAX_DEFAULT,
        delayed_spill: SpillFactory = MemorySpillFile,
        delayed_max: int = DELAYED_MAX_DEFAULT,
    ) -> None:
        self.name = name
        self.subscription_type = subscription_type
        self.cursor = cursor
        self.durable = durable
        self.important = important
        self.created_ms = created_ms
        self.partition_index = partition_index
        self.acked_ranges_max = acked_ranges_max
        self.ranges_persisted_max = ranges_persisted_max
        self.delayed_spill = delayed_spill  # where dispatchers spill delayed messages past their memory
        self.delayed_max = delayed_max  # ... and how many they hold in memory
        self.dispatcher = self._new_dispatcher()
        self.consumer_count = 0
        self.closed = False
        self.cursor_version = cursor_version
        self._changes = 0  # changes made to the cursor
        self._persisted = 0  # changes durable
        self._writing: CursorWrite | None = None
        self.write_failed = False
        self._waiting: list[tuple[int, Waiter]] = []  # (change, waiter), in change order

    # --- consumers ---------------------------------------------------------------------------

    def add_consumer(self, consumer_id: int, name: str, subscription_type: SubscriptionType, priority: int,
                     hash_ranges: HashRanges | None = None) -> bool:
        """Add a consumer (raises ConsumerBusyError or TopicFencedError);
        True when the subscription changed type (nobody was connected: it
        takes the new one, and the driver reads again from the cursor).
        `hash_ranges`: the key hashes a sticky key-shared consumer takes."""
        if self.closed:
            raise TopicFencedError(f"subscription {self.name} is closing")
        changed = False
        if subscription_type is not self.subscription_type:
            if self.consumer_count:
                raise ConsumerBusyError(
                    f"subscription {self.name} is {self.subscription_type.value} with consumers connected; "
                    f"asked for {subscription_type.value}"
                )
            self.subscription_type = subscription_type
            self.dispatcher.close()
            self.dispatcher = self._new_dispatcher()
            changed = True
        try:
            self.dispatcher.add_consumer(consumer_id, name, priority=priority, hash_ranges=hash_ranges)
        except ConsumerRefusedError as error:
            raise ConsumerBusyError(f"subscription {self.name}: {error}") from None
        self.consumer_count += 1
        return changed

    def _new_dispatcher(self) -> Dispatcher:
        return self.dispatcher_class(self.subscription_type, self.cursor, partition_index=self.partition_index,
                                     delayed_spill=self.delayed_spill, delayed_max=self.delayed_max)

    def remove_consumer(self, consumer_id: int) -> None:
        """A consumer the driver had added went away."""
        self.dispatcher.remove_consumer(consumer_id)
        self.consumer_count -= 1

    # --- acknowledgements --------------------------------------------------------------------

    def acknowledge(self, offsets: list[int] | tuple[int, ...], cumulative: bool, confirmed_offset: int, waiter: Waiter) -> AckOutcome:
        """Take acknowledgements of messages up to `confirmed_offset` (the
        last persisted). Raises BadRequestError (nothing taken) or
        TopicFencedError (closing). The waiter is answered once a write
        covering what was taken is durable (`answer_now` when nothing needs one)."""
        if self.closed or self.write_failed:
            raise TopicFencedError(f"subscription {self.name} is being unloaded: acknowledge again once reconnected")
        if any(offset > confirmed_offset for offset in offsets):
            raise BadRequestError(f"acknowledgement of an offset beyond the last message ({confirmed_offset})")
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
        if not offsets:
            return AckOutcome((waiter,), tuple(refused))
        return AckOutcome(self._await_durable(waiter), tuple(refused))

    def _await_durable(self, waiter: Waiter) -> tuple:
        """An acknowledgement changed the cursor: the waiter is answered once that is durable."""
        self.changed()
        return self.when_durable(waiter)

    def when_durable(self, waiter: Waiter) -> tuple:
        """Answer `waiter` once every change made so far is durable: returns
        it at once when nothing needs writing. Raises TopicFencedError when
        the write can no longer come (closed, or a write failed)."""
        if not self.durable or not self.unwritten:
            return (waiter,)
        if self.closed or self.write_failed:
            raise TopicFencedError(f"subscription {self.name} is being unloaded: make the change again once it is served")
        self._waiting.append((self._changes, waiter))
        return ()

    def refused_error(self, refused: tuple[int, ...], taken: int) -> BadRequestError:
        return BadRequestError(
            f"subscription {self.name} holds {len(self.cursor.acked)} ranges of individually acknowledged messages, "
            f"its bound: {len(refused)} of {len(refused) + taken} acknowledgements refused, each would start a "
            f"new range (offsets {refused[0]}..{refused[-1]}); the others are taken. Acknowledge the oldest "
            f"unacknowledged message first (offset {self.cursor.mark_delete + 1}): it is always taken, and so is "
            "one that closes a gap or extends a range"
        )

    # --- the cursor's writes -----------------------------------------------------------------

    def record(self) -> dict:
        return {
            **self.cursor.to_record(self.ranges_persisted_max),
            "type": self.subscription_type.value,
            "important": self.important,
            "created_ms": self.created_ms,
        }

    def changed(self) -> None:
        """The cursor moved without an acknowledgement (a seek, a skip by
        retention, the important flag): it is written like one."""
        if self.durable:
            self._changes += 1

    def next_write(self) -> CursorWrite | None:
        """The write to make now: one at a time, of everything changed so far."""
        if not self.durable or self.closed or self._writing is not None or self._persisted == self._changes:
            return None
        self._writing = CursorWrite(self.record(), self.cursor_version, self._changes)
        return self._writing

    def force_write(self) -> CursorWrite:
        """A write whatever changed (at load, so that the version moves on
        before anything is dispatched, and when the cursor is created)."""
        assert self._writing is None, "a forced cursor write while another is in flight"
        self._writing = CursorWrite(self.record(), self.cursor_version, self._changes, inline=True)
        return self._writing

    def cursor_written(self, write: CursorWrite, version: int) -> list[Waiter]:
        """A write is durable: returns the waiters it answers (OK)."""
        assert self._writing is write, "a cursor write completed that was not in flight"
        self._writing = None
        self.cursor_version = version
        self._persisted = max(self._persisted, write.change)
        answered = 0
        while answered < len(self._waiting) and self._waiting[answered][0] <= self._persisted:
            answered += 1
        done, self._waiting = self._waiting[:answered], self._waiting[answered:]
        return [waiter for _, waiter in done]

    def cursor_write_failed(self, write: CursorWrite) -> list[Waiter]:
        """A write failed (the driver fences the partition: another owner
        may have the cursor). Returns every waiter, to answer with the error."""
        assert self._writing is write, "a cursor write failed that was not in flight"
        self._writing = None
        self.write_failed = True  # another owner may have the cursor: nothing more is taken
        waiting, self._waiting = self._waiting, []
        return [waiter for _, waiter in waiting]

    @property
    def writing(self) -> bool:
        return self._writing is not None

    @property
    def unwritten(self) -> bool:
        """Changes not yet durable."""
        return self._persisted < self._changes

    @property
    def unwritten_changes(self) -> int:
        """Changes taken (acknowledgement batches, seeks, skips) not yet durable."""
        return self._changes - self._persisted

    def stop(self) -> None:
        """Take no more acknowledgements and dispatch nothing more; the
        acknowledgements taken may still be written (a graceful unload)
        before `close`."""
        self.closed = True

    def close(self) -> list[Waiter]:
        """Unloaded (or deleted): no more acknowledgements or dispatching.
        Returns the waiters still unanswered, to answer TOPIC_FENCED so that
        their clients acknowledge again through the next owner."""
        self.closed = True
        self.dispatcher.close()
        waiting, self._waiting = self._waiting, []
        return [waiter for _, waiter in waiting]

    # --- seeking and retention ---------------------------------------------------------------

    def seek(self, offset: int, first_offset: int, confirmed_offset: int) -> int:
        """Move the subscription: the returned offset (clamped to what is
        stored) is the next message delivered."""
        offset = min(max(offset, first_offset), confirmed_offset + 1)
        self.cursor.reset(offset)
        self.dispatcher.reset(offset)
        self.changed()
        return offset

    def skip_to(self, first_offset: int) -> bool:
        """Retention deleted everything below `first_offset`; True when the
        read position moved (the driver reads again from there)."""
        if self.cursor.mark_delete >= first_offset - 1:
            return False
        self.cursor.skip_to(first_offset)
        self.dispatcher.acknowledged_through(first_offset - 1)
        self.changed()
        if self.dispatcher.read_offset < first_offset:
            self.dispatcher.read_offset = first_offset
            return True
        return False

    def backlog(self, confirmed_offset: int) -> int:
        return self.cursor.backlog(confirmed_offset)

    # --- dispatching -------------------------------------------------------------------------

    def may_dispatch(self, lease_valid: bool) -> bool:
        """Only within the lease: a broker cut off from ZooKeeper (or
        paused) may no longer own the partition (its session may have
        expired and another broker taken over), and must deliver nothing
        until its session is known alive again."""
        return lease_valid and not self.closed


__all__ = ["ACKED_RANGES_MAX", "AckOutcome", "CursorWrite", "SubscriptionCore"]
