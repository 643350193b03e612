"""Which consumer of a subscription gets which message (Pulsar's
dispatchers), as a pure core: consumers, permits, acknowledgements and
entries in; deliveries out. The driver reads entries, fetches their bytes
and sends the deliveries, in the order given.

Every message passes one path, in offset order: first the replay set
(messages to deliver again: negatively acknowledged, timed out, left by a
consumer that went away, or held back), then newly read entries. A
consumer's messages are delivered in offset order: once one of its messages
is held back (no permits, or a key-shared consumer that joined recently), its
later messages are held back too, in the replay set. The replay set is
bounded (`replay_max`): no new entries are read while it is full. So are the
messages out and not acknowledged, per consumer (`unacked_per_consumer_max`)
and for the whole subscription (`unacked_per_subscription_max`, Pulsar's
maxUnackedMessagesPerSubscription): past either, nothing more is delivered
until acknowledgements (or redeliveries) come.

Subscription types:
- exclusive: one consumer; another is refused.
- failover: one active consumer (lowest priority value, then name; for a
  partition of a partitioned topic, the one at partition index mod count);
  the others take over, with what it had not acknowledged, if it goes.
- shared: round-robin over consumers with permits; an entry's messages go
  together to one consumer.
- key_shared: a message goes to the consumer its key hashes to, as Pulsar
  hashes it: Murmur3 (32 bits, seed 0) of the key's UTF-8 bytes (of
  "NONE_KEY" for a message without one) modulo 65,536. Either the
  consumers share the hash range on a ring (`VIRTUAL_NODES` points each,
  Pulsar's AUTO_SPLIT), or each names the ranges it takes (Pulsar's STICKY:
  ranges may not overlap; a hash no consumer takes waits). A consumer that joins while others are connected gets no message at
  or after the read position of its joining until every message before it is
  acknowledged, so that a key moving to it never overtakes an earlier message
  of that key still out at another consumer (Pulsar's "recently joined
  consumers"). Messages before that position that were held back (no
  permits) or given back move with their key too, so a consumer also waits
  for any earlier message of a key that is still out at another consumer.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from typing import Iterable

import mmh3

from framing.codec import describe
from broker.cursor import Cursor
from broker.delayed_index import DelayedIndex, MemorySpillFile, SpillFactory
from broker.entry_types import EntryRef

REPLAY_MAX_DEFAULT = 10_000  # messages held for (re)delivery
UNACKED_PER_CONSUMER_MAX_DEFAULT = 50_000  # delivered, not acknowledged; past it a consumer gets nothing more
UNACKED_PER_SUBSCRIPTION_MAX_DEFAULT = 200_000  # ... by all of a subscription's consumers together
PERMITS_MAX = 1_000_000  # a consumer's permits never add up past this
DELAYED_MAX_DEFAULT = 100_000  # delayed messages indexed in memory; past it they are sealed into a spilled run
# Entries' bytes the delayed index hands over per release (take_released_data):
# past it, messages coming due at once are read back from the ledger instead
# (the broker's entry cache, where they go, is shared by every partition).
RELEASED_BYTES_MAX = 8 * 1024 * 1024
VIRTUAL_NODES = 64  # hash ring points per key-shared consumer
KEY_HASH_RANGE = 65_536  # key-shared hashes are 0 .. KEY_HASH_RANGE - 1 (Pulsar's range size)
NONE_KEY = b"NONE_KEY"  # what a message without a key hashes as (as Pulsar does)
HashRanges = tuple[tuple[int, int], ...]  # inclusive (start, end) pairs


class SubscriptionType(str, enum.Enum):
    EXCLUSIVE = "exclusive"
    FAILOVER = "failover"
    SHARED = "shared"
    KEY_SHARED = "key_shared"

    @classmethod
    def parse(cls, value: "SubscriptionType | str") -> "SubscriptionType":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown subscription type {describe(value)}; known: {', '.join(kind.value for kind in cls)}"
            ) from None


class ConsumerRefusedError(Exception):
    """The subscription cannot take this consumer (exclusive and taken, or
    of another type)."""


@dataclass(slots=True)
class Delivery:
    consumer_id: int
    entry: EntryRef
    batch_indexes: list[int]
    redelivery_count: int


@dataclass(slots=True)
class _Consumer:
    consumer_id: int
    name: str
    priority: int
    permits: int = 0
    unacked: dict[int, EntryRef] = field(default_factory=dict)  # offset -> entry
    join_offset: int | None = None  # key-shared: held back from here until the mark-delete passes it
    hash_ranges: HashRanges | None = None  # key-shared STICKY: the key hashes it takes


class Dispatcher:
    def __init__(
        self,
        subscription_type: SubscriptionType,
        cursor: Cursor,
        *,
        partition_index: int = -1,
        replay_max: int = REPLAY_MAX_DEFAULT,
        unacked_per_consumer_max: int = UNACKED_PER_CONSUMER_MAX_DEFAULT,
        unacked_per_subscription_max: int = UNACKED_PER_SUBSCRIPTION_MAX_DEFAULT,
        delayed_max: int = DELAYED_MAX_DEFAULT,
        delayed_spill: SpillFactory = MemorySpillFile,
    ) -> None:
        if replay_max < 1 or unacked_per_consumer_max < 1 or unacked_per_subscription_max < 1 or delayed_max < 1:
            raise ValueError("replay_max, unacked_per_consumer_max, unacked_per_subscription_max and delayed_max must be at least 1")
        self.subscription_type = subscription_type
        self.cursor = cursor
        self.partition_index = partition_index
        self.replay_max = replay_max
        self.unacked_per_consumer_max = unacked_per_consumer_max
        self.unacked_per_subscription_max = unacked_per_subscription_max
        self._consumers: dict[int, _Consumer] = {}  # in joining order
        self._owner: dict[int, int] = {}  # delivered offset -> consumer id
        self._replay: dict[int, EntryRef] = {}
        self._replay_offsets: list[int] = []  # sorted keys of _replay
        self._redeliveries: dict[int, int] = {}  # offset -> times delivered again
        self.read_offset = cursor.mark_delete + 1  # the next offset a read gives
        self._seen_through = self.read_offset  # every offset below it was read once (a rewind reads some again)
        # Delayed delivery (shared and key-shared): the messages held until
        # their time, `delayed_max` in memory and the rest in spilled runs.
        self.delayed_max = delayed_max
        self._delayed = DelayedIndex(delayed_max, delayed_spill)
        self._released_data: dict[tuple[int, int], bytes] = {}  # see take_released_data
        self._released_bytes = 0
        self._round_robin = 0
        self._ring: list[tuple[int, int]] = []  # key-shared: (point, consumer id), sorted
        self._sticky: list[tuple[int, int, int]] = []  # key-shared: (start, end, consumer id) of the named ranges, sorted
        self._active: int | None = None  # exclusive / failover
        # Key-shared: key -> consumer id -> offsets of that key out at it (sorted).
        self._out_by_key: dict[str, dict[int, list[int]]] = {}

    # --- consumers ------------------------------------------------------------------

    @property
    def consumer_ids(self) -> list[int]:
        return list(self._consumers)

    @property
    def active_consumer_id(self) -> int | None:
        return self._active

    def add_consumer(self, consumer_id: int, name: str, *, priority: int = 0, hash_ranges: HashRanges | None = None) -> None:
        """`hash_ranges`: a key-shared consumer that takes these key hashes
        only (STICKY); None shares the hashes with the others (AUTO_SPLIT).
        A subscription's consumers are all of one kind."""
        assert consumer_id not in self._consumers, f"consumer {consumer_id} added twice"
        if self.subscription_type is SubscriptionType.EXCLUSIVE and self._consumers:
            raise ConsumerRefusedError("the exclusive subscription already has a consumer")
        if hash_ranges is not None:
            self._check_ranges(hash_ranges)
        consumer = _Consumer(consumer_id, name, priority, hash_ranges=hash_ranges)
        if self.subscription_type is SubscriptionType.KEY_SHARED and self._consumers:
            if hash_ranges is None and any(other.hash_ranges is not None for other in self._consumers.values()):
                raise ConsumerRefusedError("the subscription's consumers name their hash ranges (sticky): a consumer "
                                           "sharing key hashes (auto split) cannot join them")
            consumer.join_offset = self.read_offset
        self._consumers[consumer_id] = consumer
        self._membership_changed()

    def _check_ranges(self, hash_ranges: HashRanges) -> None:
        if self.subscription_type is not SubscriptionType.KEY_SHARED:
            raise ConsumerRefusedError("hash ranges are for key-shared subscriptions")
        if not hash_ranges:
            raise ConsumerRefusedError("a sticky key-shared consumer names at least one hash range")
        for start, end in hash_ranges:
            if not 0 <= start <= end < KEY_HASH_RANGE:
                raise ConsumerRefusedError(f"hash range [{start}, {end}] is not within [0, {KEY_HASH_RANGE - 1}]")
        if any(consumer.hash_ranges is None for consumer in self._consumers.values()):
            raise ConsumerRefusedError("the subscription's consumers share key hashes (auto split): a consumer "
                                       "naming hash ranges (sticky) cannot join them")
        ordered = sorted(hash_ranges)
        for (_, end), (start, _) in zip(ordered, ordered[1:]):
            if start <= end:
                raise ConsumerRefusedError(f"the consumer's hash ranges overlap at {start}")
        for other in self._consumers.values():
            for start, end in hash_ranges:
                for other_start, other_end in other.hash_ranges or ():
                    if start <= other_end and other_start <= end:
                        raise ConsumerRefusedError(f"hash range [{start}, {end}] overlaps [{other_start}, {other_end}] "
                                                   f"of consumer {other.name}")

    def remove_consumer(self, consumer_id: int) -> None:
        """The consumer went away: what it had not acknowledged is delivered again."""
        consumer = self._consumers.pop(consumer_id, None)
        if consumer is None:
            return
        self._to_replay(consumer, list(consumer.unacked))
        self._membership_changed()

    def _membership_changed(self) -> None:
        kind = self.subscription_type
        if kind is SubscriptionType.KEY_SHARED:
            self._ring = sorted(
                (_ring_point(f"{consumer.name}\0{consumer.consumer_id}\0{point}"), consumer.consumer_id)
                for consumer in self._consumers.values() if consumer.hash_ranges is None
                for point in range(VIRTUAL_NODES)
            )
            self._sticky = sorted((start, end, consumer.consumer_id) for consumer in self._consumers.values()
                                  for start, end in consumer.hash_ranges or ())
        elif kind in (SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER):
            ordered = sorted(self._consumers.values(), key=lambda consumer: (consumer.priority, consumer.name, consumer.consumer_id))
            if not ordered:
                active = None
            elif self.partition_index >= 0 and kind is SubscriptionType.FAILOVER:
                active = ordered[self.partition_index % len(ordered)].consumer_id
            else:
                active = ordered[0].consumer_id
            if active != self._active:
                # The new active consumer takes over what the others hold.
                for consumer in self._consumers.values():
                    if consumer.consumer_id != active:
                        self._to_replay(consumer, list(consumer.unacked))
                self._active = active

    def flow(self, consumer_id: int, permits: int) -> None:
        consumer = self._consumers.get(consumer_id)
        if consumer is not None:
            # Capped: permits come from the client, and they are what bounds
            # the messages sent to it and not yet acknowledged.
            consumer.permits = min(consumer.permits + permits, PERMITS_MAX)

    def give_back(self, delivery: Delivery) -> None:
        """A delivery the driver could not send: its messages go back to the
        replay set (as if never delivered) and its permits to its consumer."""
        consumer = self._consumers.get(delivery.consumer_id)
        entry = delivery.entry
        for batch_index in delivery.batch_indexes:
            offset = entry.first_offset + batch_index
            if self._owner.get(offset) == delivery.consumer_id:
                del self._owner[offset]
                if consumer is not None and consumer.unacked.pop(offset, None) is not None:
                    self._taken_back(delivery.consumer_id, offset, entry)
            if not self.cursor.is_acked(offset):
                self._hold(offset, entry)
            else:
                self._redeliveries.pop(offset, None)
        if consumer is not None:
            consumer.permits += len(delivery.batch_indexes)

    def permits(self, consumer_id: int) -> int:
        return self._consumers[consumer_id].permits

    def unacked_count(self, consumer_id: int) -> int:
        return len(self._consumers[consumer_id].unacked)

    # --- acknowledgements and redelivery --------------------------------------------

    def acknowledged(self, offsets: Iterable[int]) -> None:
        """The cursor took these acknowledgements (individual ones)."""
        for offset in offsets:
            self._forget(offset)

    def acknowledged_through(self, offset: int) -> None:
        """A cumulative acknowledgement (or a cursor that skipped ahead)."""
        self._delayed.drop_through(offset)
        for delivered in [delivered for delivered in self._owner if delivered <= offset]:
            self._forget(delivered)
        cut = bisect.bisect_right(self._replay_offsets, offset)
        for replayed in self._replay_offsets[:cut]:
            del self._replay[replayed]
            self._redeliveries.pop(replayed, None)
        del self._replay_offsets[:cut]

    def _forget(self, offset: int) -> None:
        owner = self._owner.pop(offset, None)
        if owner is not None:
            entry = self._consumers[owner].unacked.pop(offset, None)
            if entry is not None:
                self._taken_back(owner, offset, entry)
        if self._replay.pop(offset, None) is not None:
            del self._replay_offsets[bisect.bisect_left(self._replay_offsets, offset)]
        self._redeliveries.pop(offset, None)

    def redeliver(self, consumer_id: int, offsets: Iterable[int] | None = None) -> None:
        """Negative acknowledgement or ack timeout: deliver these again (all
        of the consumer's unacknowledged messages when `offsets` is None)."""
        consumer = self._consumers.get(consumer_id)
        if consumer is None:
            return
        if offsets is None:
            chosen = list(consumer.unacked)
        else:
            # A client may name an offset twice, or one it does not hold.
            chosen = [offset for offset in dict.fromkeys(offsets) if offset in consumer.unacked]
        self._to_replay(consumer, chosen)

    def _to_replay(self, consumer: _Consumer, offsets: list[int]) -> None:
        for offset in offsets:
            entry = consumer.unacked.pop(offset)
            del self._owner[offset]
            self._taken_back(consumer.consumer_id, offset, entry)
            if self.cursor.is_acked(offset):
                continue
            self._redeliveries[offset] = self._redeliveries.get(offset, 0) + 1
            self._hold(offset, entry)

    def _hold(self, offset: int, entry: EntryRef) -> None:
        if offset not in self._replay:
            self._replay[offset] = entry
            bisect.insort(self._replay_offsets, offset)

    def reset(self, next_offset: int) -> None:
        """Seek: forget every delivery and held message; read from
        `next_offset` on (the cursor was reset by the caller)."""
        for consumer in self._consumers.values():
            consumer.unacked.clear()
            if consumer.join_offset is not None:
                consumer.join_offset = next_offset
        self._owner.clear()
        self._out_by_key.clear()
        self._replay.clear()
        self._replay_offsets.clear()
        self._redeliveries.clear()
        self._delayed.clear()
        self._released_data.clear()
        self._released_bytes = 0
        self.read_offset = self._seen_through = next_offset

    # --- dispatching ------------------------------------------------------------------

    @property
    def replay_count(self) -> int:
        return len(self._replay_offsets)

    @property
    def unacked_total(self) -> int:
        """Messages out at the consumers and not acknowledged."""
        return len(self._owner)

    def wants_read(self) -> bool:
        """Whether a new entry could be delivered (so the driver should read one)."""
        return len(self._replay_offsets) < self.replay_max and len(self._owner) < self.unacked_per_subscription_max and any(
            consumer.permits > 0 and len(consumer.unacked) < self.unacked_per_consumer_max
            for consumer in self._consumers.values()
        )

    def dispatch_replay(self) -> list[Delivery]:
        """Deliver what the replay set holds, where consumers can take it."""
        if not self._replay_offsets:
            return []
        candidates = [(offset, self._replay[offset]) for offset in self._replay_offsets]
        return self._dispatch(candidates, from_replay=True)

    def entry_read(self, entry: EntryRef, now_ms: int = 0, data: bytes | None = None) -> list[Delivery]:
        """A new entry, read in order from the partition: deliver what of it
        the cursor has not acknowledged (on a shared subscription, once its
        delivery time has come). `data`, the entry's bytes, is kept with
        its messages if they are held back (see `take_released_data`)."""
        fresh = entry.first_offset >= self._seen_through
        self.read_offset = max(self.read_offset, entry.last_offset + 1)
        self._seen_through = max(self._seen_through, entry.last_offset + 1)
        if entry.deliver_at_ms > now_ms and self.subscription_type in (SubscriptionType.SHARED, SubscriptionType.KEY_SHARED):
            self._delay(entry, data)
            return []
        retained = entry.retained
        if fresh and self.subscription_type is not SubscriptionType.KEY_SHARED and not self._replay_offsets and retained is None:
            whole = self._deliver_whole(entry)
            if whole is not None:
                return whole
        candidates = [
            (offset, entry)
            for offset in (range(entry.first_offset, entry.last_offset + 1) if retained is None else sorted(retained))
            if not self.cursor.is_acked(offset) and offset not in self._owner and offset not in self._replay
        ]
        return self._dispatch(candidates, from_replay=False)

    def read_past(self, offset: int) -> None:
        """Reading goes on at `offset`: what lies before it was left out (a
        compacted view's superseded messages)."""
        self.read_offset = max(self.read_offset, offset)
        self._seen_through = max(self._seen_through, offset)

    # --- delayed delivery ----------------------------------------------------------------

    def _delay(self, entry: EntryRef, data: bytes | None) -> None:
        """Hold an entry's messages until their time (as Pulsar's delayed
        delivery tracker does), in the delayed index: bounded memory, the
        rest spilled in runs sorted by time (`broker/delayed_index.py`)."""
        offsets = [offset for offset in range(entry.first_offset, entry.last_offset + 1)
                   if not (self.cursor.is_acked(offset) or offset in self._owner or offset in self._replay)]
        self._delayed.add(entry.deliver_at_ms, offsets, entry, data)

    def next_delayed_ms(self) -> int | None:
        """When the earliest held message is due; None when none is held,
        or while the replay set is full (nothing could be released then:
        acknowledgements and flow wake the driver)."""
        if len(self._replay_offsets) >= self.replay_max:
            return None
        return self._delayed.next_due_ms()

    @property
    def delayed_count(self) -> int:
        """Messages held back (those acknowledged meanwhile, by a skip or an
        expiry, count until their time, when they are dropped)."""
        return len(self._delayed)

    def release_due(self, now_ms: int) -> None:
        """Messages whose time came join the replay set (as far as it has
        room); those acknowledged or delivered meanwhile are dropped.
        SpillError: the delayed index could not read a spilled run back
        (what was released before it stays released; call again later)."""
        delayed = self._delayed
        while len(self._replay_offsets) < self.replay_max:
            taken = delayed.take(now_ms)
            if taken is None:
                break
            offset, entry, data = taken
            if not (self.cursor.is_acked(offset) or offset in self._owner):
                self._hold(offset, entry)
                key = (entry.ledger_id, entry.entry_id)
                if data is not None and key not in self._released_data and self._released_bytes < RELEASED_BYTES_MAX:
                    self._released_data[key] = data
                    self._released_bytes += len(data)

    def take_released_data(self) -> dict[tuple[int, int], bytes]:
        """The bytes of the entries whose held messages came due, where the
        index carried them ((ledger, entry) -> bytes; each handed out once):
        the driver keeps them where deliveries read entries, rather than
        reading them back one by one."""
        released, self._released_data, self._released_bytes = self._released_data, {}, 0
        return released

    def close(self) -> None:
        """The subscription is done with this dispatcher: the delayed index's spill files go."""
        self._delayed.close()

    @property
    def delayed_spill_failures(self) -> tuple[int, str]:
        """How many times the delayed index could not write its spill file, and the last reason."""
        return self._delayed.spill_failures, self._delayed.spill_error

    def _deliver_whole(self, entry: EntryRef) -> list[Delivery] | None:
        """The common case, without a step per message: an entry nobody saw
        yet, nothing held for redelivery, none of it acknowledged, going
        whole to one consumer (what `_dispatch` would decide, message by
        message). None: take the general path."""
        first, last = entry.first_offset, entry.last_offset
        cursor = self.cursor
        if cursor.mark_delete >= first or (cursor.acked and cursor.acked.count_between(first, last)):
            return None
        consumer_id = self._choose(first, entry, set(), None)
        if consumer_id is None:
            return None
        consumer = self._consumers[consumer_id]
        offsets = range(first, last + 1)
        consumer.unacked.update(dict.fromkeys(offsets, entry))
        self._owner.update(dict.fromkeys(offsets, consumer_id))
        consumer.permits -= entry.message_count
        return [Delivery(consumer_id, entry, list(range(entry.message_count)), 0)]

    def _dispatch(self, candidates: list[tuple[int, EntryRef]], *, from_replay: bool) -> list[Delivery]:
        deliveries: list[Delivery] = []
        blocked: set[int] = set()  # consumers that must not receive more in this pass
        # A consumer with messages held in the replay set gets new messages
        # only after those (its messages go out in offset order).
        if not from_replay and self._replay_offsets:
            blocked.update(self._consumers)
            if self.subscription_type is SubscriptionType.KEY_SHARED:
                held_for = {self._key_consumer(self._replay[offset].key_of(offset)) for offset in self._replay_offsets}
                blocked = {consumer_id for consumer_id in blocked if consumer_id in held_for}
        current: Delivery | None = None
        for offset, entry in candidates:
            consumer_id = self._choose(offset, entry, blocked, current)
            if consumer_id is None:
                if not from_replay:
                    self._hold(offset, entry)
                continue
            consumer = self._consumers[consumer_id]
            if from_replay:
                del self._replay[offset]
            consumer.unacked[offset] = entry
            self._owner[offset] = consumer_id
            if self.subscription_type is SubscriptionType.KEY_SHARED:
                bisect.insort(self._out_by_key.setdefault(entry.key_of(offset) or "", {}).setdefault(consumer_id, []), offset)
            batch_index = offset - entry.first_offset
            redeliveries = self._redeliveries.get(offset, 0)
            if current is not None and current.consumer_id == consumer_id and current.entry is entry:
                current.batch_indexes.append(batch_index)
                current.redelivery_count = max(current.redelivery_count, redeliveries)
            else:
                # A new delivery (other consumer or entry): the consumer's
                # permits pay for it by message count.
                current = Delivery(consumer_id, entry, [batch_index], redeliveries)
                deliveries.append(current)
            consumer.permits -= 1
        if from_replay and deliveries:
            self._replay_offsets = [offset for offset in self._replay_offsets if offset in self._replay]
        return deliveries

    def _choose(self, offset: int, entry: EntryRef, blocked: set[int], current: Delivery | None) -> int | None:
        kind = self.subscription_type
        if kind is SubscriptionType.KEY_SHARED:
            consumer_id = self._key_consumer(entry.key_of(offset))
            if consumer_id is None or consumer_id in blocked:
                return None
            consumer = self._consumers[consumer_id]
            if consumer.join_offset is not None:
                if self.cursor.mark_delete >= consumer.join_offset - 1:
                    consumer.join_offset = None  # everything before its joining is acknowledged
                elif offset >= consumer.join_offset:
                    blocked.add(consumer_id)
                    return None
            if self._earlier_out_elsewhere(entry.key_of(offset) or "", consumer_id, offset):
                # Its key moved here (a consumer joined) while an earlier
                # message of it is still out at the consumer it came from.
                blocked.add(consumer_id)
                return None
            if not self._can_take(consumer):
                blocked.add(consumer_id)
                return None
            return consumer_id
        if kind is SubscriptionType.SHARED:
            # The rest of an entry follows its first message to one consumer.
            if current is not None and current.entry is entry and current.consumer_id not in blocked:
                return current.consumer_id
            ids = [consumer_id for consumer_id in self._consumers if consumer_id not in blocked]
            for step in range(len(ids)):
                consumer_id = ids[(self._round_robin + step) % len(ids)]
                if self._can_take(self._consumers[consumer_id]):
                    self._round_robin = (self._round_robin + step + 1) % max(1, len(ids))
                    return consumer_id
                blocked.add(consumer_id)
            return None
        # Exclusive and failover: the active consumer; an entry it started
        # goes to it whole, even past its permits.
        active = self._active
        if active is None or active in blocked:
            return None
        if current is not None and current.entry is entry and current.consumer_id == active:
            return active
        if not self._can_take(self._consumers[active]):
            blocked.add(active)
            return None
        return active

    def _earlier_out_elsewhere(self, key: str, consumer_id: int, offset: int) -> bool:
        out = self._out_by_key.get(key)
        return out is not None and any(offsets[0] < offset for other, offsets in out.items() if other != consumer_id)

    def _taken_back(self, consumer_id: int, offset: int, entry: EntryRef) -> None:
        """A message out at a consumer is no longer (acknowledged or given back)."""
        if self.subscription_type is not SubscriptionType.KEY_SHARED:
            return
        key = entry.key_of(offset) or ""
        out = self._out_by_key[key]
        offsets = out[consumer_id]
        del offsets[bisect.bisect_left(offsets, offset)]
        if not offsets:
            del out[consumer_id]
            if not out:
                del self._out_by_key[key]

    def _can_take(self, consumer: _Consumer) -> bool:
        return (consumer.permits > 0 and len(consumer.unacked) < self.unacked_per_consumer_max
                and len(self._owner) < self.unacked_per_subscription_max)

    def _key_consumer(self, key: str | None) -> int | None:
        hashed = key_hash(key)
        if self._sticky:
            index = bisect.bisect_right(self._sticky, (hashed, KEY_HASH_RANGE, 0)) - 1
            if index >= 0 and self._sticky[index][0] <= hashed <= self._sticky[index][1]:
                return self._sticky[index][2]
            return None  # no consumer takes this hash: its messages wait
        if not self._ring:
            return None
        index = bisect.bisect_left(self._ring, (hashed, -1))
        return self._ring[index % len(self._ring)][1]


def key_hash(key: str | None) -> int:
    """A key's hash as Pulsar's key-shared dispatch computes it."""
    return mmh3.hash(NONE_KEY if key is None else key.encode(), 0, signed=False) % KEY_HASH_RANGE


def _ring_point(text: str) -> int:
    return mmh3.hash(text.encode(), 0, signed=False) % KEY_HASH_RANGE


__all__ = [
    "ConsumerRefusedError",
    "Delivery",
    "Dispatcher",
    "EntryRef",
    "HashRanges",
    "KEY_HASH_RANGE",
    "PERMITS_MAX",
    "REPLAY_MAX_DEFAULT",
    "SubscriptionType",
    "UNACKED_PER_CONSUMER_MAX_DEFAULT",
    "UNACKED_PER_SUBSCRIPTION_MAX_DEFAULT",
    "VIRTUAL_NODES",
    "key_hash",
]
