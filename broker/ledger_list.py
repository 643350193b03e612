"""Decisions about a partition's chain of ledgers, as pure functions: where an
offset lives, when the open ledger rolls over, and which old ledgers
retention lets go; and the open ledger's bounded index of offsets."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from broker.topic_records import LedgerInfo, TopicPolicies


@dataclass(frozen=True, slots=True)
class OpenLedgerState:
    """What the owner knows of the ledger it writes."""

    entries: int
    messages: int
    bytes: int
    created_ms: float
    last_add_ms: float | None  # None: nothing added yet


OPEN_LEDGER_INDEX_POINTS_MAX = 4096  # first offsets the open ledger's index keeps


class OpenLedgerIndex:
    """Where the open ledger's messages are: the first offset of every
    `stride`-th entry, at most `points_max` of them. When it is full, every
    other point goes and the stride doubles, so that its memory stays
    bounded however long a rollover is held back (`rollover_min_time_ms`);
    finding an offset then takes a bisection of at most `stride` entries,
    read back (`entry_range`)."""

    __slots__ = ("points_max", "stride", "entries", "_firsts")

    def __init__(self, points_max: int = OPEN_LEDGER_INDEX_POINTS_MAX) -> None:
        if points_max < 2 or points_max % 2:
            raise ValueError(f"points_max must be an even number of at least 2, got {points_max}")
        self.points_max = points_max
        self.stride = 1
        self.entries = 0  # entries appended (their ids are 0 .. entries - 1)
        self._firsts: list[int] = []  # first offset of entries 0, stride, 2 * stride, ...

    def __len__(self) -> int:
        return len(self._firsts)

    def append(self, first_offset: int) -> None:
        """The next entry of the ledger, whose first message is `first_offset`."""
        if self.entries % self.stride == 0:
            if len(self._firsts) == self.points_max:
                # Full: entries == points_max * stride, a multiple of the new stride too.
                del self._firsts[1::2]
                self.stride *= 2
            self._firsts.append(first_offset)
        self.entries += 1

    def entry_range(self, offset: int) -> tuple[int, int]:
        """The entries (first and last id, inclusive) one of which holds
        `offset`, an offset of this ledger's messages."""
        assert self.entries and offset >= self._firsts[0], f"offset {offset} is not in this ledger"
        index = bisect.bisect_right(self._firsts, offset) - 1
        first = index * self.stride
        return first, min(self.entries, first + self.stride) - 1


def rollover_reason(state: OpenLedgerState, policies: TopicPolicies, now_ms: float) -> str | None:
    """Why the open ledger should be closed and a new one started now, or None.
    An empty ledger never rolls over (that would only make empty ledgers);
    one younger than `rollover_min_time_ms` not for its size."""
    if state.entries == 0:
        return None
    old_enough = now_ms - state.created_ms >= policies.rollover_min_time_ms
    if state.entries >= policies.rollover_entries and old_enough:
        return f"{state.entries} entries"
    if state.bytes >= policies.rollover_bytes and old_enough:
        return f"{state.bytes} bytes"
    if now_ms - state.created_ms >= policies.rollover_time_ms:
        return "age"
    if state.last_add_ms is not None and now_ms - state.last_add_ms >= policies.rollover_idle_ms:
        return "idle"
    return None


def ledger_index_of(ledgers: Sequence[LedgerInfo], offset: int) -> int | None:
    """Index of the ledger whose offsets include `offset` (the last one,
    open or not, takes every offset from its first on); None when the offset
    is below the first ledger's (trimmed away) or there are no ledgers."""
    firsts = [info.first_offset for info in ledgers]
    # An empty closed ledger shares its first offset with the next ledger:
    # bisect_right picks the later one, which holds the offset.
    index = bisect.bisect_right(firsts, offset) - 1
    return None if index < 0 else index


def trimmable_count(
    ledgers: Sequence[LedgerInfo],
    policies: TopicPolicies,
    now_ms: float,
    held_from_offset: int | None,
    open_ledger_bytes: int = 0,
) -> int:
    """How many ledgers at the head of the chain may be deleted: closed, not
    the last one, past retention (older than `retention_time_ms`, or beyond
    the newest `retention_bytes`), and wholly below `held_from_offset`, the
    first offset an important subscription has not acknowledged (None: no
    important subscription holds anything)."""
    if policies.retention_time_ms is None and policies.retention_bytes is None:
        return 0
    # Bytes kept by the ledgers after each one.
    newer_bytes = [0] * len(ledgers)
    running = open_ledger_bytes
    for index in range(len(ledgers) - 1, -1, -1):
        newer_bytes[index] = running
        running += ledgers[index].bytes or 0
    count = 0
    for index, info in enumerate(ledgers[:-1]):  # the last ledger always stays
        if not info.is_closed:
            break
        expired_by_time = (
            policies.retention_time_ms is not None
            and info.closed_ms is not None
            and now_ms - info.closed_ms >= policies.retention_time_ms
        )
        # By size, as Pulsar: a ledger goes only if what stays after it still
        # holds the retained bytes.
        expired_by_size = policies.retention_bytes is not None and newer_bytes[index] >= policies.retention_bytes
        if not (expired_by_time or expired_by_size):
            break
        if held_from_offset is not None and info.messages and info.last_offset >= held_from_offset:
            break
        count += 1
    return count


def stored_bytes(ledgers: Sequence[LedgerInfo], open_ledger_bytes: int) -> int:
    return sum(info.bytes or 0 for info in ledgers if info.is_closed) + open_ledger_bytes


__all__ = ["OPEN_LEDGER_INDEX_POINTS_MAX", "OpenLedgerIndex", "OpenLedgerState", "ledger_index_of", "rollover_reason", "stored_bytes", "trimmable_count"]
