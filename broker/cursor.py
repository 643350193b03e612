"""A subscription's durable position, as Pulsar's managed cursor keeps it: the
mark-delete offset (every message at or below it is acknowledged) and the
ranges acknowledged individually beyond it.

Pure: offsets in, state out. Offsets are partition offsets (contiguous per
partition), so a cursor is a set of integers kept as ranges. The persisted
form is bounded (`ranges_persisted_max`): past it, the highest ranges are
left out, and those messages are delivered again after a restart
(at-least-once), never lost. Its owner bounds the ranges held in memory
with `acknowledge_within`, which says what it refused (`ranges_after` says
what an acknowledgement would leave, changing nothing).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Iterator

RANGES_PERSISTED_MAX_DEFAULT = 10_000


class RangeSet:
    """Disjoint, non-adjacent inclusive ranges of integers, in order."""

    __slots__ = ("_firsts", "_lasts", "count")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._firsts: list[int] = []
        self._lasts: list[int] = []
        self.count = 0  # integers in the set
        for first, last in ranges:
            self.add_range(first, last)

    def __len__(self) -> int:
        return len(self._firsts)  # ranges

    def __bool__(self) -> bool:
        return bool(self._firsts)

    def __contains__(self, value: int) -> bool:
        index = bisect.bisect_right(self._firsts, value) - 1
        return index >= 0 and value <= self._lasts[index]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self._firsts, self._lasts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RangeSet) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"RangeSet({list(self)})"

    @property
    def first(self) -> int | None:
        return self._firsts[0] if self._firsts else None

    def add(self, value: int) -> bool:
        """Add one integer; returns whether it was new."""
        return self.add_range(value, value) > 0

    def add_range(self, first: int, last: int) -> int:
        """Add [first, last]; returns how many integers were new."""
        if first > last:
            return 0
        # Every range that overlaps or touches [first, last] merges with it.
        low = bisect.bisect_left(self._lasts, first - 1)
        high = bisect.bisect_right(self._firsts, last + 1)
        removed = 0
        if low < high:
            first = min(first, self._firsts[low])
            last = max(last, self._lasts[high - 1])
            removed = sum(self._lasts[i] - self._firsts[i] + 1 for i in range(low, high))
            del self._firsts[low:high], self._lasts[low:high]
        self._firsts.insert(low, first)
        self._lasts.insert(low, last)
        added = (last - first + 1) - removed
        self.count += added
        return added

    def remove_through(self, value: int) -> None:
        """Drop every integer <= value."""
        while self._firsts and self._firsts[0] <= value:
            if self._lasts[0] <= value:
                self.count -= self._lasts[0] - self._firsts[0] + 1
                del self._firsts[0], self._lasts[0]
            else:
                self.count -= value - self._firsts[0] + 1
                self._firsts[0] = value + 1

    def touching(self, first: int, last: int) -> int:
        """How many ranges [first, last] overlaps or touches (those
        `add_range(first, last)` would merge with it)."""
        return max(0, bisect.bisect_right(self._firsts, last + 1) - bisect.bisect_left(self._lasts, first - 1))

    def count_between(self, first: int, last: int) -> int:
        """How many integers of the set lie in [first, last]."""
        if not self._firsts:
            return 0
        if first <= self._firsts[0] and self._lasts[-1] <= last:
            # The whole set (a cursor's usual case: every individual ack lies
            # between its mark-delete and the end): the running count, not
            # a walk over the ranges.
            return self.count
        total = 0
        index = max(0, bisect.bisect_right(self._firsts, first) - 1)
        while index < len(self._firsts) and self._firsts[index] <= last:
            low, high = max(first, self._firsts[index]), min(last, self._lasts[index])
            if low <= high:
                total += high - low + 1
            index += 1
        return total

    def ranges(self, ranges_max: int | None = None) -> list[list[int]]:
        """The lowest `ranges_max` ranges (all without it): a cursor's write
        takes the first 10,000 of what may be a million."""
        firsts, lasts = (self._firsts, self._lasts) if ranges_max is None else (self._firsts[:ranges_max], self._lasts[:ranges_max])
        return [[first, last] for first, last in zip(firsts, lasts)]


@dataclass(slots=True)
class Cursor:
    """Which messages of a partition a subscription has acknowledged."""

    mark_delete: int  # every offset <= mark_delete is acknowledged
    acked: RangeSet  # offsets > mark_delete acknowledged one by one

    @classmethod
    def at(cls, next_offset: int) -> "Cursor":
        """A cursor whose first unacknowledged message is `next_offset`."""
        return cls(next_offset - 1, RangeSet())

    def is_acked(self, offset: int) -> bool:
        return offset <= self.mark_delete or offset in self.acked

    def acknowledge(self, offsets: Iterable[int]) -> int:
        """Individual acknowledgements; returns how many were new. Sorted
        and taken run by run: a request of scattered offsets costs a range
        each, added in order, not a list insertion each."""
        added = 0
        for first, last in self._runs(offsets):
            added += self.acked.add_range(first, last)
        self._advance()
        return added

    def _runs(self, offsets: Iterable[int]) -> list[tuple[int, int]]:
        """The offsets beyond the mark-delete offset as runs of consecutive
        integers, lowest first; two runs never touch."""
        runs: list[tuple[int, int]] = []
        run_first = run_last = None
        for offset in sorted(offset for offset in offsets if offset > self.mark_delete):
            if run_last is not None and offset <= run_last + 1:
                run_last = max(run_last, offset)
                continue
            if run_first is not None:
                runs.append((run_first, run_last))
            run_first = run_last = offset
        if run_first is not None:
            runs.append((run_first, run_last))
        return runs

    def _range_changes(self, runs: list[tuple[int, int]]) -> list[int]:
        """For each run, how many ranges it adds to `acked` (1, or 0 and
        less when it merges with ranges or folds into the mark-delete
        offset), as if all were taken. Each is counted against the ranges
        as they are: a range and a run that touch merge into one, and no
        two runs touch, so neither does any chain of them run back on
        itself; the changes of any subset of the runs therefore add up."""
        changes = []
        for first, last in runs:
            change = 1 - self.acked.touching(first, last)
            if first == self.mark_delete + 1:
                change -= 1  # the range it makes folds into the mark-delete offset
            changes.append(change)
        return changes

    def ranges_after(self, offsets: Iterable[int]) -> int:
        """How many individually acknowledged ranges `acknowledge(offsets)`
        would leave (the cursor is not changed)."""
        return len(self.acked) + sum(self._range_changes(self._runs(offsets)))

    def acknowledge_within(self, offsets: Iterable[int], ranges_max: int) -> list[int]:
        """`acknowledge(offsets)`, except runs of offsets that would each
        start a new range past `ranges_max` ranges; returns the offsets
        refused (the others are taken). What merges with a range, extends
        one or closes a gap is always taken, and so is the oldest
        unacknowledged offset (it moves the mark-delete offset), so that a
        subscription at its bound can always make progress. Those are
        counted first; then new ranges, lowest first, while there is room."""
        offsets = list(offsets)
        runs = self._runs(offsets)
        changes = self._range_changes(runs)
        room = ranges_max - len(self.acked) - sum(change for change in changes if change <= 0)
        new_runs = [run for run, change in zip(runs, changes) if change > 0]
        if len(new_runs) <= room:
            self.acknowledge(offsets)
            return []
        refused = RangeSet(new_runs[max(0, room):])
        self.acknowledge(offset for offset in offsets if offset not in refused)
        assert len(self.acked) == max(ranges_max, ranges_max - room), (len(self.acked), ranges_max, room)
        return sorted({offset for offset in offsets if offset in refused})

    def acknowledge_cumulative(self, offset: int) -> int:
        """Everything up to `offset`; returns how many were new."""
        if offset <= self.mark_delete:
            return 0
        added = offset - self.mark_delete - self.acked.count_between(self.mark_delete + 1, offset)
        self.mark_delete = offset
        self.acked.remove_through(offset)
        self._advance()
        return added

    def _advance(self) -> None:
        # A range that starts right after the mark-delete offset folds into it.
        first = self.acked.first
        if first is not None and first == self.mark_delete + 1:
            last = next(iter(self.acked))[1]
            self.mark_delete = last
            self.acked.remove_through(last)

    def skip_to(self, first_offset: int) -> None:
        """Messages below `first_offset` no longer exist (retention removed
        them): count them as acknowledged."""
        if self.mark_delete < first_offset - 1:
            self.mark_delete = first_offset - 1
            self.acked.remove_through(self.mark_delete)
            self._advance()

    def reset(self, next_offset: int) -> None:
        """Seek: `next_offset` and everything after it become unacknowledged,
        everything before it acknowledged."""
        self.mark_delete = next_offset - 1
        self.acked = RangeSet()

    def offset_past_unacknowledged(self, count: int, last_offset: int) -> int:
        """The offset just past the first `count` unacknowledged messages up
        to `last_offset` (past all of them when there are fewer): acknowledging
        everything below it skips exactly those."""
        position, remaining = self.mark_delete, max(count, 0)
        for first, last in self.acked:
            gap = first - position - 1
            if remaining <= gap:
                return position + remaining + 1
            remaining -= gap
            position = last
        return max(min(position + remaining, last_offset), position) + 1

    def backlog(self, last_offset: int) -> int:
        """Messages up to `last_offset` not acknowledged."""
        if last_offset <= self.mark_delete:
            return 0
        return last_offset - self.mark_delete - self.acked.count_between(self.mark_delete + 1, last_offset)

    def to_record(self, ranges_max: int = RANGES_PERSISTED_MAX_DEFAULT) -> dict:
        """The persisted form: at most `ranges_max` ranges, the lowest ones
        (those beyond are delivered again after a restart)."""
        return {"mark_delete": self.mark_delete, "acked": self.acked.ranges(ranges_max)}

    @classmethod
    def from_record(cls, record: dict) -> "Cursor":
        mark_delete = record["mark_delete"]
        ranges = record.get("acked", [])
        if type(mark_delete) is not int or not all(
            type(pair) is list and len(pair) == 2 and all(type(value) is int for value in pair) and mark_delete < pair[0] <= pair[1]
            for pair in ranges
        ):
            raise ValueError(f"malformed cursor record {record!r:.200}")
        cursor = cls(mark_delete, RangeSet((first, last) for first, last in ranges))
        cursor._advance()
        return cursor


__all__ = ["Cursor", "RANGES_PERSISTED_MAX_DEFAULT", "RangeSet"]
