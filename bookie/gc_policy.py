"""The bookie's garbage-collection decisions, as pure functions and classes:
which ledgers are deleted (from rounds of metadata listings), and which entry
logs to delete or compact (from each log's per-ledger byte counts). No I/O;
the trio driver (`bookie.garbage_collector`) carries the decisions out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Iterable, Mapping

from bookie.storage_interfaces import EntryLogUsage

# A ledger is dropped once it was confirmed absent from the metadata store in
# this many consecutive rounds (see DeletedLedgerDetector).
ABSENT_ROUNDS_TO_DROP = 2


@dataclass(frozen=True, slots=True)
class EntryLogPlan:
    delete: list[int]  # logs that hold no live ledger: remove the file
    compact: list[int]  # logs below the threshold, least live first: copy live entries out, then remove


def plan_entry_logs(
    usage: Mapping[int, EntryLogUsage],
    live_ledgers: AbstractSet[int],
    *,
    writing_log_id: int | None,
    compaction_threshold: float,
    compaction_bytes_max: int,
    uncompactable: AbstractSet[int] = frozenset(),
) -> EntryLogPlan:
    """Which entry logs to delete and which to compact this round.

    The log being written (`writing_log_id`) is never touched: appends still
    go to it. A log none of whose ledgers is live is deleted. A log whose live
    fraction is below `compaction_threshold` (0 turns compaction off) is
    compacted, unless `uncompactable` (found damaged), least live first (the most space for the least copying, as
    BookKeeper sorts by usage), while the live bytes to copy stay within
    `compaction_bytes_max` (the first candidate is always taken, so that a
    log larger than the bound still gets compacted)."""
    if not 0 <= compaction_threshold <= 1:
        raise ValueError(f"compaction_threshold must be in [0, 1], got {compaction_threshold}")
    delete: list[int] = []
    candidates: list[tuple[float, int, int]] = []
    for log_id in sorted(usage):
        if log_id == writing_log_id:
            continue
        live_bytes = live_bytes_of(usage[log_id], live_ledgers)
        if live_bytes == 0:
            delete.append(log_id)
        elif log_id not in uncompactable and live_ratio(usage[log_id], live_ledgers) < compaction_threshold:
            candidates.append((live_ratio(usage[log_id], live_ledgers), log_id, live_bytes))
    compact: list[int] = []
    budget = compaction_bytes_max
    for _, log_id, live_bytes in sorted(candidates):
        if compact and live_bytes > budget:
            continue
        compact.append(log_id)
        budget -= live_bytes
    return EntryLogPlan(delete, compact)


def live_bytes_of(usage: EntryLogUsage, live_ledgers: AbstractSet[int]) -> int:
    return sum(size for ledger_id, size in usage.ledger_bytes.items() if ledger_id in live_ledgers)


def live_ratio(usage: EntryLogUsage, live_ledgers: AbstractSet[int]) -> float:
    """The fraction of the log's bytes that belong to live ledgers."""
    if usage.total_bytes <= 0:
        return 0.0
    return min(1.0, live_bytes_of(usage, live_ledgers) / usage.total_bytes)


class DeletedLedgerDetector:
    """Which ledgers a bookie may drop, from rounds of "ledgers this bookie
    knew before the listing began" and "those of them that the metadata
    store confirmed absent (a listing without them, then a direct read that
    found no node)".

    A ledger is dropped only once it was confirmed absent in
    `absent_rounds_to_drop` consecutive successful rounds. The snapshot taken
    before the listing keeps out ledgers created while it ran (BookKeeper's
    race: a bookie learns of a ledger only after its metadata exists, so a
    ledger known before the listing began had metadata before it began). The
    second round, an interval later, guards against a ZooKeeper follower that
    lags behind the leader: a bookie's session may for a moment not see a
    ledger that a client on another server has just created and written to.
    A failed round (the store unreachable or erring) decides nothing and
    forgets nothing."""

    def __init__(self, absent_rounds_to_drop: int = ABSENT_ROUNDS_TO_DROP) -> None:
        if absent_rounds_to_drop < 1:
            raise ValueError("absent_rounds_to_drop must be at least 1")
        self.absent_rounds_to_drop = absent_rounds_to_drop
        self._absent_rounds: dict[int, int] = {}

    def round(self, known_before_listing: Iterable[int], confirmed_absent: Iterable[int]) -> set[int]:
        """One successful round; returns the ledgers to drop now."""
        known = set(known_before_listing)
        absent = set(confirmed_absent)
        if not absent <= known:
            raise ValueError(f"ledgers {sorted(absent - known)} were confirmed absent but not known before the listing")
        # A ledger listed (or no longer known) in this round starts over.
        self._absent_rounds = {ledger_id: self._absent_rounds.get(ledger_id, 0) + 1 for ledger_id in absent}
        return {ledger_id for ledger_id, rounds in self._absent_rounds.items() if rounds >= self.absent_rounds_to_drop}

    @property
    def suspects(self) -> dict[int, int]:
        """Ledgers confirmed absent in recent rounds, and in how many in a row."""
        return dict(self._absent_rounds)
