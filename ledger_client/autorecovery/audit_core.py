"""The auditor's decisions, pure: which bookies count as lost (gone from the
registry for `lost_bookie_delay_ms`, BookKeeper's lostBookieRecoveryDelay),
when to scan the ledgers, and which ledgers a scan marks under-replicated.
Time comes in as `now_ms`; the trio driver is `ledger_client.autorecovery.auditor`."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping


class AuditCore:
    """Follows which bookies are missing and since when.

    A bookie is *known* once it was seen registered or found in a ledger's
    ensembles; a known bookie absent from the registry is *missing*, and
    *lost* once it has been missing for `lost_bookie_delay_ms` (a bookie that
    restarts within the delay costs nothing). A scan of every ledger's
    metadata is due when a bookie became lost since the last scan, and every
    `audit_interval_ms` in any case (the periodic check, which also catches
    ledgers whose marker went missing). The first scan is due at once: it
    finds the bookies that ledgers use but that were gone before this
    auditor started, whose delay starts then.
    """

    def __init__(self, lost_bookie_delay_ms: float, audit_interval_ms: float) -> None:
        if lost_bookie_delay_ms < 0:
            raise ValueError(f"lost_bookie_delay_ms must not be negative, got {lost_bookie_delay_ms}")
        if not audit_interval_ms > 0:
            raise ValueError(f"audit_interval_ms must be positive, got {audit_interval_ms}")
        self.lost_bookie_delay_ms = lost_bookie_delay_ms
        self.audit_interval_ms = audit_interval_ms
        self.available: frozenset[str] = frozenset()
        self.known: set[str] = set()
        self.missing_since_ms: dict[str, float] = {}
        self._audited: set[str] = set()  # lost bookies the last scans covered
        self._next_scan_ms = -math.inf

    def registry_changed(self, available: Iterable[str], now_ms: float) -> None:
        """The registered bookies (writable and read-only) are now `available`."""
        self.available = frozenset(available)
        self.known |= self.available
        self._update_missing(now_ms)

    def scan_done(self, referenced: Collection[str], lost: Collection[str], now_ms: float) -> None:
        """A scan that started when `lost` were lost found `referenced` in
        the ledgers' ensembles. Bookies neither registered nor referenced
        are forgotten: nothing is left to recover from them."""
        self.known = set(self.available) | set(referenced)
        self._update_missing(now_ms)
        self._audited = set(lost) & set(self.missing_since_ms)
        self._next_scan_ms = now_ms + self.audit_interval_ms

    def _update_missing(self, now_ms: float) -> None:
        for bookie_id in list(self.missing_since_ms):
            if bookie_id in self.available or bookie_id not in self.known:
                del self.missing_since_ms[bookie_id]
                self._audited.discard(bookie_id)
        for bookie_id in self.known - self.available:
            self.missing_since_ms.setdefault(bookie_id, now_ms)

    def lost(self, now_ms: float) -> frozenset[str]:
        return frozenset(
            bookie_id for bookie_id, since_ms in self.missing_since_ms.items()
            if now_ms - since_ms >= self.lost_bookie_delay_ms
        )

    def scan_due(self, now_ms: float) -> bool:
        return now_ms >= self._next_scan_ms or bool(self.lost(now_ms) - self._audited)

    def next_deadline_ms(self) -> float:
        """When `scan_due` next turns true by itself (infinity: never)."""
        deadlines = [
            since_ms + self.lost_bookie_delay_ms for bookie_id, since_ms in self.missing_since_ms.items()
            if bookie_id not in self._audited
        ]
        return min([self._next_scan_ms, *deadlines])


def ledgers_to_mark(ensemble_bookies: Mapping[int, Collection[str]], lost: Collection[str]) -> dict[int, frozenset[str]]:
    """Ledger id -> the lost bookies in its ensembles, for every ledger
    (`ensemble_bookies`: ledger id -> every bookie of its ensembles) with a
    fragment on a lost bookie."""
    lost_set = frozenset(lost)
    marks = {}
    for ledger_id, bookies in ensemble_bookies.items():
        on_lost = lost_set.intersection(bookies)
        if on_lost:
            marks[ledger_id] = on_lost
    return marks


def referenced_bookies(ensemble_bookies: Mapping[int, Collection[str]]) -> set[str]:
    return {bookie_id for bookies in ensemble_bookies.values() for bookie_id in bookies}


__all__ = ["AuditCore", "ledgers_to_mark", "referenced_bookies"]
