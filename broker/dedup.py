"""Producer deduplication for one partition (exactly-once publishing, as
Pulsar's MessageDeduplication and YDB's producer sessions).

Pure: the broker tells it what producers send, what was persisted and what
failed; it answers whether a batch is new, a duplicate, or "unknown, retry"
(a batch with that sequence id is still being written). Its state is the
last persisted sequence id per producer; a snapshot of it is stored now and
then with the entry position it covers, and a new owner rebuilds the map
from the snapshot by replaying the entries after it (`replayed`).

Bounded: at most `producers_max` producers are remembered; past it the one
idle longest (nothing in flight) is forgotten, and a message it resends
after that is taken as new (as Pulsar forgets producers after an
inactivity timeout).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

PRODUCERS_MAX_DEFAULT = 10_000
SNAPSHOT_BYTES_MAX = 512 * 1024  # a snapshot is one ZooKeeper node (1 MB at most)


class Verdict(enum.Enum):
    NEW = "new"
    DUPLICATE = "duplicate"  # persisted before: drop it, tell the producer so
    IN_FLIGHT = "in flight"  # being written now: the producer must ask again


@dataclass(frozen=True, slots=True)
class DedupSnapshot:
    """The last persisted sequence id of each producer, as of the entry
    at `ledger_id`:`entry_id` (every entry up to it is counted)."""

    ledger_id: int
    entry_id: int
    sequences: dict[str, int]

    def to_record(self) -> dict:
        return {"ledger_id": self.ledger_id, "entry_id": self.entry_id, "sequences": dict(self.sequences)}

    @classmethod
    def from_record(cls, record: dict) -> "DedupSnapshot":
        sequences = record["sequences"]
        if not (type(record["ledger_id"]) is int and type(record["entry_id"]) is int and type(sequences) is dict
                and all(type(key) is str and type(value) is int for key, value in sequences.items())):
            raise ValueError(f"malformed deduplication snapshot {record!r:.200}")
        return cls(record["ledger_id"], record["entry_id"], dict(sequences))


class Dedup:
    def __init__(self, *, producers_max: int = PRODUCERS_MAX_DEFAULT) -> None:
        if producers_max < 1:
            raise ValueError("producers_max must be at least 1")
        self.producers_max = producers_max
        # producer id -> last persisted sequence id; least recently used first.
        self._persisted: OrderedDict[str, int] = OrderedDict()
        # producer id -> highest sequence id handed to storage and not yet persisted or failed.
        self._pushed: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}  # producer id -> batches being written

    # --- questions ----------------------------------------------------------------

    def last_persisted(self, producer_id: str) -> int:
        """-1 when the producer has nothing persisted (or was forgotten)."""
        return self._persisted.get(producer_id, -1)

    def last_taken(self, producer_id: str) -> int:
        """The highest sequence id persisted or being written: what a
        producer that (re)connects must continue after, lest its new
        messages be judged copies of ones still in flight."""
        return max(self._persisted.get(producer_id, -1), self._pushed.get(producer_id, -1))

    def check(self, producer_id: str, last_sequence_id: int) -> Verdict:
        """Whether a batch whose highest sequence id is `last_sequence_id` is
        new. As in Pulsar, a batch is judged by its highest id."""
        if last_sequence_id <= self._persisted.get(producer_id, -1):
            return Verdict.DUPLICATE
        if last_sequence_id <= self._pushed.get(producer_id, -1):
            return Verdict.IN_FLIGHT
        return Verdict.NEW

    # --- what happened --------------------------------------------------------------

    def pushed(self, producer_id: str, last_sequence_id: int) -> None:
        """A NEW batch was handed to storage."""
        assert last_sequence_id > self._pushed.get(producer_id, -1), "sequence ids of one producer must increase"
        self._pushed[producer_id] = last_sequence_id
        self._in_flight[producer_id] = self._in_flight.get(producer_id, 0) + 1

    def persisted(self, producer_id: str, last_sequence_id: int) -> None:
        """A batch is durable (completions arrive in entry order)."""
        self._leave_flight(producer_id)
        self._record(producer_id, last_sequence_id)

    def failed(self, producer_id: str) -> None:
        """A batch's write failed: the partition is fenced and reloaded, so
        what it pushed is no longer in flight here."""
        self._leave_flight(producer_id)
        if producer_id not in self._in_flight:
            self._pushed.pop(producer_id, None)

    def replayed(self, producer_id: str, last_sequence_id: int) -> None:
        """An entry found while rebuilding the map after a takeover."""
        self._record(producer_id, last_sequence_id)

    def _leave_flight(self, producer_id: str) -> None:
        remaining = self._in_flight.get(producer_id, 0) - 1
        assert remaining >= 0, f"producer {producer_id} finished a batch it never pushed"
        if remaining:
            self._in_flight[producer_id] = remaining
        else:
            del self._in_flight[producer_id]

    def _record(self, producer_id: str, last_sequence_id: int) -> None:
        if last_sequence_id > self._persisted.get(producer_id, -1):
            self._persisted[producer_id] = last_sequence_id
        self._persisted.move_to_end(producer_id)
        while len(self._persisted) > self.producers_max:
            if not self._forget_one_idle():
                break

    def _forget_one_idle(self) -> bool:
        for candidate in self._persisted:
            if candidate not in self._in_flight:
                del self._persisted[candidate]
                self._pushed.pop(candidate, None)
                return True
        return False

    # --- snapshots ------------------------------------------------------------------

    def snapshot(self, ledger_id: int, entry_id: int, *, bytes_max: int = SNAPSHOT_BYTES_MAX) -> DedupSnapshot:
        """The map as of the last persisted entry, `ledger_id`:`entry_id`.
        Past `bytes_max` (counted roughly, as JSON), the producers idle
        longest are left out: after a takeover they are forgotten, as if
        evicted."""
        kept: list[str] = []
        size = 0
        for producer_id in reversed(self._persisted):  # most recently used first
            size += len(producer_id) + 24
            if size > bytes_max:
                break
            kept.append(producer_id)
        # Least recently used first, as the map keeps them.
        return DedupSnapshot(ledger_id, entry_id, {producer_id: self._persisted[producer_id] for producer_id in reversed(kept)})

    @classmethod
    def from_snapshot(cls, snapshot: DedupSnapshot | None, *, producers_max: int = PRODUCERS_MAX_DEFAULT) -> "Dedup":
        dedup = cls(producers_max=producers_max)
        if snapshot is not None:
            for producer_id, sequence_id in snapshot.sequences.items():
                dedup._record(producer_id, sequence_id)
        return dedup

    @property
    def producer_count(self) -> int:
        return len(self._persisted)


__all__ = ["Dedup", "DedupSnapshot", "PRODUCERS_MAX_DEFAULT", "Verdict"]
