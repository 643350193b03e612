"""Decisions about a partition's chain of ledgers, as pure functions: where an
offset lives, when the open ledger rolls over, and which old ledgers
retention lets go."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from broker.topic_store import LedgerInfo, TopicPolicies


@dataclass(frozen=True, slots=True)
class OpenLedgerState:
    """What the owner knows of the ledger it writes."""

    entries: int
    messages: int
    bytes: int
    created_ms: float
    last_add_ms: float | None  # None: nothing added yet


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


__all__ = ["OpenLedgerState", "ledger_index_of", "rollover_reason", "stored_bytes", "trimmable_count"]
