"""The broker simulation's checkers: the broker's guarantees below. Fed as
the run goes (by the log, the brokers and the clients), they report a
violation the moment one shows:
- exactly-once publishing: the log never holds one producer's sequence id
  twice, and every sequence id a producer was told is persisted (OK or
  DUPLICATE) is in the log;
- the log is one chain: an offset never holds two messages (a new owner
  that did not fence and close the previous owner's ledger would write
  over offsets already acknowledged);
- an acknowledgement answered as durable is never delivered again to the
  subscription, by any broker, after any crash or takeover, and stays in
  every cursor record written after it (unless the record's bound on
  individually acknowledged ranges left it out: then it may come back, as
  broker/cursor.py says, and the run counts it);
- while one broker serves the partition, no message is out at two consumers
  at once, a failover or exclusive subscription delivers only to its
  active consumer, first deliveries come in offset order (per key for
  key-shared), and a key-shared message never overtakes an earlier message
  of its key still out at another consumer.
The liveness phase's checks (everything published, delivered and
acknowledged) are the runner's, with `missing_from_log` and friends here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from broker.dispatcher import SubscriptionType
from sim.broker_calls import LogEntry
from sim.checker import ViolationLog


@dataclass
class _Serving:
    """What one broker's load of the partition has out at its consumers."""

    subscription_type: SubscriptionType
    consumers: dict[int, tuple[int, str]] = field(default_factory=dict)  # id -> (priority, name)
    active: int | None = None  # exclusive / failover
    holder: dict[int, int] = field(default_factory=dict)  # offset -> consumer id
    keys: dict[int, str | None] = field(default_factory=dict)  # offset -> key, of what is out
    delivered: set[int] = field(default_factory=set)  # every offset delivered once at least
    highest_first_delivery: dict[str | None, int] = field(default_factory=dict)  # ordering key -> highest offset delivered the first time


class BrokerChecker(ViolationLog):
    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self.logged: dict[tuple[str, int], int] = {}  # (producer id, sequence id) -> offset
        self.entries: dict[tuple[int, int], LogEntry] = {}  # (ledger id, entry id) -> every entry reported
        self.at_offset: dict[int, tuple[str, int]] = {}  # offset -> (producer id, sequence id) of its message
        self.log_offsets = 0  # messages in the log
        self.producer_acks = 0
        # Acknowledgements answered as durable: everything through
        # `answered_through`, and these one by one.
        self.answered_through = -1
        self.answered: set[int] = set()
        # Answered, but a bounded cursor record left them out: they may come
        # back (at-least-once), and the run says how many did.
        self.answered_beyond_record: set[int] = set()
        self._answered_above: set[int] = set()  # answered one by one, above every record's mark-delete so far
        self.redelivered_beyond_record = 0
        self.received: set[int] = set()  # offsets some consumer got at least once
        self.deliveries = 0
        self.redeliveries = 0
        self.stale_deliveries = 0  # by a broker that no longer owned the partition
        self._serving: dict[str, _Serving] = {}

    # --- publishing -----------------------------------------------------------------------

    def entry_persisted(self, entry: LogEntry) -> None:
        """An entry is part of the partition's log: acknowledged to its
        writer, or found in the chain by a broker loading the partition
        (each may report it; it counts once)."""
        position = (entry.ledger_id, entry.entry_id)
        known = self.entries.get(position)
        if known is not None:
            if known != entry:
                self.violate("an entry never changes",
                             f"entry {entry.ledger_id}:{entry.entry_id} was {known} and is now {entry}")
            return
        self.entries[position] = entry
        for index, sequence_id in enumerate(entry.sequence_ids):
            key = (entry.producer_id, sequence_id)
            offset = entry.first_offset + index
            holder = self.at_offset.setdefault(offset, key)
            if holder != key:
                self.violate("one message per offset",
                             f"offset {offset} holds {holder[0]} sequence id {holder[1]} and {key[0]} sequence id {key[1]} "
                             f"(entry {entry.ledger_id}:{entry.entry_id})")
            if key in self.logged:
                self.violate(
                    "exactly-once publishing",
                    f"{entry.producer_id} sequence id {sequence_id} is in the log twice: offsets "
                    f"{self.logged[key]} and {entry.first_offset + index}",
                )
            else:
                self.logged[key] = entry.first_offset + index
        self.log_offsets = max(self.log_offsets, entry.last_offset + 1)

    def producer_acknowledged(self, producer_id: str, sequence_ids: Iterable[int], how: str) -> None:
        """A producer was told these are persisted (`how`: OK or DUPLICATE)."""
        self.producer_acks += 1
        missing = [sequence_id for sequence_id in sequence_ids if (producer_id, sequence_id) not in self.logged]
        if missing:
            self.violate(
                "a message acknowledged to its producer is in the log",
                f"{producer_id} was told {how} for sequence ids {missing[:10]}, which the log does not hold",
            )

    def missing_from_log(self, planned: dict[str, list[int]]) -> dict[str, list[int]]:
        return {
            producer_id: missing for producer_id, sequence_ids in sorted(planned.items())
            if (missing := [sequence_id for sequence_id in sequence_ids if (producer_id, sequence_id) not in self.logged])
        }

    # --- acknowledgements ---------------------------------------------------------------------

    def ack_answered(self, offsets: tuple[int, ...], cumulative: bool, record: dict) -> None:
        """A broker answered an acknowledgement after writing `record` (the
        cursor as persisted, which should cover it)."""
        covered = _record_covers(record)
        if cumulative:
            through = offsets[0]
            beyond = [offset for offset in range(self.answered_through + 1, through + 1) if not covered(offset)]
            self.answered_through = max(self.answered_through, through)
        else:
            beyond = [offset for offset in offsets if not covered(offset)]
            self.answered.update(offsets)
            self._answered_above.update(offsets)
        self.answered_beyond_record.update(beyond)

    def cursor_written(self, record: dict, ranges_max: int) -> None:
        """A cursor record became durable: it must still hold every
        acknowledgement answered before, unless its bound cut ranges off."""
        covered = _record_covers(record)
        truncated = len(record.get("acked", [])) >= ranges_max
        mark_delete = record["mark_delete"]
        if mark_delete < self.answered_through:
            self.violate("a durable acknowledgement stays in the cursor record",
                         f"a cursor record with mark-delete {mark_delete} was written after everything through "
                         f"{self.answered_through} was acknowledged cumulatively")
        above = set()
        for offset in sorted(self._answered_above):
            if offset <= mark_delete:
                continue
            above.add(offset)
            if covered(offset) or offset in self.answered_beyond_record:
                continue
            if truncated:
                self.answered_beyond_record.add(offset)
            else:
                self.violate("a durable acknowledgement stays in the cursor record",
                             f"offset {offset} was answered as acknowledged, and a later cursor record leaves it out")
        self._answered_above = above

    def is_answered(self, offset: int) -> bool:
        return offset <= self.answered_through or offset in self.answered

    # --- one broker's serving of the partition ---------------------------------------------------

    def serving_started(self, instance: str, subscription_type: SubscriptionType) -> None:
        self._serving[instance] = _Serving(subscription_type)

    def subscription_type_changed(self, instance: str, subscription_type: SubscriptionType) -> None:
        """The subscription had no consumer and took a new type."""
        serving = self._serving[instance]
        assert not serving.consumers
        self._serving[instance] = _Serving(subscription_type)

    def consumer_added(self, instance: str, consumer_id: int, name: str, priority: int) -> None:
        serving = self._serving[instance]
        serving.consumers[consumer_id] = (priority, name)
        self._membership_changed(serving)

    def consumer_removed(self, instance: str, consumer_id: int) -> None:
        serving = self._serving[instance]
        if serving.consumers.pop(consumer_id, None) is None:
            return
        self._give_back(serving, [offset for offset, holder in serving.holder.items() if holder == consumer_id])
        self._membership_changed(serving)

    def _membership_changed(self, serving: _Serving) -> None:
        if serving.subscription_type not in (SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER):
            return
        # The active consumer: lowest priority value, then name (Pulsar's
        # rule); the others give back what they hold.
        ranked = sorted((priority, name, consumer_id) for consumer_id, (priority, name) in serving.consumers.items())
        active = ranked[0][2] if ranked else None
        if active != serving.active:
            serving.active = active
            self._give_back(serving, [offset for offset, holder in serving.holder.items() if holder != active])

    def _give_back(self, serving: _Serving, offsets: Iterable[int]) -> None:
        for offset in offsets:
            serving.holder.pop(offset, None)
            serving.keys.pop(offset, None)

    def acknowledged(self, instance: str, offsets: tuple[int, ...], cumulative: bool) -> None:
        """The broker's cursor took an acknowledgement."""
        serving = self._serving[instance]
        if cumulative:
            self._give_back(serving, [offset for offset in serving.holder if offset <= offsets[0]])
        else:
            self._give_back(serving, offsets)

    def redeliver_requested(self, instance: str, consumer_id: int, offsets: tuple[int, ...] | None) -> None:
        serving = self._serving[instance]
        held = [offset for offset, holder in serving.holder.items()
                if holder == consumer_id and (offsets is None or offset in offsets)]
        self._give_back(serving, held)

    def delivered(self, instance: str, consumer_id: int, offsets: tuple[int, ...], keys: tuple[str | None, ...],
                  *, stale: bool) -> None:
        """A broker sent a consumer these messages; `stale` when it did no
        longer own the partition (its session was gone), unknown to it."""
        serving = self._serving[instance]
        self.deliveries += len(offsets)
        if stale:
            self.stale_deliveries += len(offsets)
        kind = serving.subscription_type
        for offset, key in zip(offsets, keys):
            if self.is_answered(offset):
                if offset in self.answered_beyond_record:
                    self.redelivered_beyond_record += 1
                else:
                    self.violate(
                        "an acknowledged message is never delivered again",
                        f"{instance}{' (no longer the owner)' if stale else ''} delivered offset {offset} to consumer "
                        f"{consumer_id}, whose acknowledgement was answered as durable",
                    )
            holder = serving.holder.get(offset)
            if holder is not None:
                self.violate(
                    "a message is out at one consumer at a time",
                    f"{instance} delivered offset {offset} to consumer {consumer_id} while consumer {holder} holds it",
                )
            if kind in (SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER) and consumer_id != serving.active:
                self.violate(
                    f"{kind.value}: only the active consumer gets messages",
                    f"{instance} delivered offset {offset} to consumer {consumer_id}; the active one is {serving.active}",
                )
            if kind is SubscriptionType.KEY_SHARED:
                earlier = sorted(other for other, other_holder in serving.holder.items()
                                 if other_holder != consumer_id and other < offset and serving.keys.get(other) == key)
                if earlier:
                    self.violate(
                        "key_shared: a message never overtakes an earlier one of its key out at another consumer",
                        f"{instance} delivered offset {offset} (key {key!r}) to consumer {consumer_id} while offset "
                        f"{earlier[0]} of that key is out at consumer {serving.holder[earlier[0]]}",
                    )
            if offset in serving.delivered:
                self.redeliveries += 1
            elif kind is not SubscriptionType.SHARED:
                ordering_key = key if kind is SubscriptionType.KEY_SHARED else None
                previous = serving.highest_first_delivery.get(ordering_key, -1)
                if offset < previous:
                    self.violate(
                        "first deliveries in offset order" + (" per key" if ordering_key is not None else ""),
                        f"{instance} delivered offset {offset}{f' (key {key!r})' if kind is SubscriptionType.KEY_SHARED else ''} "
                        f"for the first time after offset {previous}",
                    )
                serving.highest_first_delivery[ordering_key] = max(previous, offset)
            serving.delivered.add(offset)
            serving.holder[offset] = consumer_id
            serving.keys[offset] = key

    def consumer_received(self, offsets: Iterable[int]) -> None:
        self.received.update(offsets)


def _record_covers(record: dict) -> Callable[[int], bool]:
    """Whether a persisted cursor record (`Cursor.to_record`'s form) counts an
    offset as acknowledged, read here without the cursor's code."""
    mark_delete = record["mark_delete"]
    ranges = [tuple(pair) for pair in record.get("acked", [])]
    return lambda offset: offset <= mark_delete or any(first <= offset <= last for first, last in ranges)
