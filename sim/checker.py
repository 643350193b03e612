"""The simulator's checkers: the ledger invariants below, as BookKeeper's
TLA+ specification states them. Fed as the run goes, they report a
violation the moment one shows:
- an entry is acknowledged only once AQ bookies of its write set have
  acknowledged the writer's add of it;
- every acknowledged entry keeps an intact durable copy in its write set;
- a closed ledger's last entry id is >= every acknowledged entry;
- no two reads of an entry disagree, and each matches what was written;
- no entry beyond the close is ever returned;
- a fenced writer never gets another acknowledgement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from ledger_client.metadata import LedgerMetadata

VIOLATIONS_KEPT_MAX = 50


@dataclass(frozen=True, slots=True)
class Violation:
    time_ms: float
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.time_ms:.3f} ms] {self.invariant}: {self.detail}"


class DurableView(Protocol):
    name: str

    def durable_entries(self) -> dict[tuple[int, int], bytes | None]: ...


class ViolationLog:
    """The violations of a run as they show, each at its virtual time."""

    def __init__(self, clock) -> None:
        self._clock = clock  # () -> now_ms
        self.violations: list[Violation] = []

    def violate(self, invariant: str, detail: str) -> None:
        if len(self.violations) < VIOLATIONS_KEPT_MAX:
            self.violations.append(Violation(self._clock(), invariant, detail))

    @property
    def ok(self) -> bool:
        return not self.violations

    def share_violations(self, other: "ViolationLog") -> None:
        """Report into `other`'s list: two checkers of one run, one verdict."""
        self.violations = other.violations


class SimChecker(ViolationLog):
    def __init__(self, clock) -> None:
        super().__init__(clock)
        self.metadata: dict[int, LedgerMetadata] = {}  # ledger -> newest metadata written
        # ledger -> newest metadata before the close: its ensembles are the
        # writer's (a close drops ensembles that begin after its last entry)
        self.open_metadata: dict[int, LedgerMetadata] = {}
        self.closed: dict[int, int] = {}  # ledger -> last entry id
        self.written: dict[tuple[int, int], tuple[bytes, bytes]] = {}  # (ledger, entry) -> (entry bytes, payload)
        self.acked: dict[int, dict[int, str]] = {}  # ledger -> entry -> writer
        self.read: dict[tuple[int, int], bytes] = {}  # first payload read of each entry
        self.read_beyond: dict[int, int] = {}  # ledger -> highest entry read while open
        self.fenced_writers: dict[int, float] = {}  # ledger -> when recovery finished fencing
        # (ledger, entry) -> bookies that acknowledged the writer's add of it
        self.accepted: dict[tuple[int, int], set[str]] = {}
        # Acknowledgements a writer got after a recoverer had fenced its
        # ledger: allowed (an add that reached its ack quorum before the
        # fence is answered late), and the close must then hold the entry,
        # which `_closed` checks. A count for the stats, not a violation.
        self.acks_racing_recovery = 0
        self.reads = 0
        self.durability_checks = 0

    # --- reporting ------------------------------------------------------------------

    def acked_count(self) -> int:
        return sum(len(entries) for entries in self.acked.values())

    # --- what happens -------------------------------------------------------------------

    def metadata_written(self, metadata: LedgerMetadata) -> None:
        """A compare-and-set of a ledger's metadata took effect."""
        self.metadata[metadata.ledger_id] = metadata
        if not metadata.is_closed:
            self.open_metadata[metadata.ledger_id] = metadata
        else:
            self._closed(metadata.ledger_id, metadata.last_entry_id)

    def _closed(self, ledger_id: int, last_entry_id: int) -> None:
        previous = self.closed.get(ledger_id)
        if previous is not None and previous != last_entry_id:
            self.violate("close is final", f"ledger {ledger_id} closed at {previous}, then at {last_entry_id}")
        self.closed[ledger_id] = last_entry_id
        above = sorted(entry_id for entry_id in self.acked.get(ledger_id, {}) if entry_id > last_entry_id)
        if above:
            self.violate(
                "closed ledger holds every acknowledged entry",
                f"ledger {ledger_id} closed at {last_entry_id}, but entries {above[:10]} were acknowledged",
            )
        self._check_fenced_writer(ledger_id)
        highest_read = self.read_beyond.get(ledger_id, -1)
        if highest_read > last_entry_id:
            self.violate(
                "no entry beyond the close is returned",
                f"ledger {ledger_id} closed at {last_entry_id}, entry {highest_read} was read while it was open",
            )

    def entry_written(self, ledger_id: int, entry_id: int, entry: bytes, payload: bytes) -> None:
        """A writer gave `payload` entry id `entry_id` (encoded as `entry`)."""
        key = (ledger_id, entry_id)
        assert key not in self.written, f"entry {key} written twice"
        self.written[key] = (entry, payload)

    def fence_complete(self, ledger_id: int) -> None:
        """A recoverer fenced enough bookies: the writer is shut out."""
        self.fenced_writers.setdefault(ledger_id, self._clock())

    def entry_acked(self, ledger_id: int, entry_id: int, writer: str, write_set: Sequence[str]) -> None:
        """`writer` was told the entry is safe; `write_set` is the entry's
        write set in the writer's metadata when it completed the add."""
        acked = self.acked.setdefault(ledger_id, {})
        if entry_id in acked:
            self.violate("an entry is acknowledged once", f"ledger {ledger_id} entry {entry_id} acknowledged twice")
        acked[entry_id] = writer
        ack_quorum = self.metadata[ledger_id].ack_quorum
        accepted = sorted(self.accepted.get((ledger_id, entry_id), set()).intersection(write_set))
        if len(accepted) < ack_quorum:
            self.violate(
                "an acknowledged entry reached an ack quorum",
                f"{writer} got entry {entry_id} of ledger {ledger_id} acknowledged, but only {accepted} of its "
                f"write set {list(write_set)} acknowledged the add (ack quorum {ack_quorum})",
            )
        if ledger_id in self.fenced_writers:
            self.acks_racing_recovery += 1
        last_entry_id = self.closed.get(ledger_id)
        if last_entry_id is not None and entry_id > last_entry_id:
            self.violate(
                "a fenced writer gets no acknowledgement",
                f"{writer} got entry {entry_id} of ledger {ledger_id} acknowledged after it was closed at {last_entry_id}",
            )

    def add_accepted(self, bookie_id: str, ledger_id: int, entry_id: int) -> None:
        """A bookie made a writer's (not a recoverer's) add durable and
        acknowledged it."""
        self.accepted.setdefault((ledger_id, entry_id), set()).add(bookie_id)
        if self.closed.get(ledger_id) == entry_id - 1:
            self._check_fenced_writer(ledger_id)

    def _check_fenced_writer(self, ledger_id: int) -> None:
        """After a close at L, no ack quorum of the writer's write set may
        ever have acknowledged the writer's entry L + 1: recovery closes at L
        only once WQ - AQ + 1 of them answered "no entry" to a fencing read,
        and those never take it afterwards. Checked at the bookies, not only
        at the writer: whether the answers reach the writer (in order, before
        a FENCED one) is only a race, and the safety rule must not rest on it."""
        metadata = self.open_metadata[ledger_id]
        entry_id = self.closed[ledger_id] + 1
        bookies = self.accepted.get((ledger_id, entry_id), set())
        in_write_set = sorted(bookies.intersection(metadata.write_set(entry_id)))
        if len(in_write_set) >= metadata.ack_quorum:
            self.violate(
                "a fenced writer gets no acknowledgement",
                f"entry {entry_id} of ledger {ledger_id} (closed at {entry_id - 1}) was acknowledged to its writer "
                f"by {in_write_set}, an ack quorum of its write set",
            )

    def entry_read(self, ledger_id: int, entry_id: int, payload: bytes, reader: str, *, ledger_closed: bool) -> None:
        self.reads += 1
        key = (ledger_id, entry_id)
        written = self.written.get(key)
        if written is None or written[1] != payload:
            self.violate("reads return what was written", f"{reader} read entry {entry_id} of ledger {ledger_id}: not what its writer wrote")
        first = self.read.setdefault(key, payload)
        if first != payload:
            self.violate("reads agree", f"{reader} read entry {entry_id} of ledger {ledger_id} differently from an earlier read")
        last_entry_id = self.closed.get(ledger_id)
        if last_entry_id is not None and entry_id > last_entry_id:
            self.violate(
                "no entry beyond the close is returned",
                f"{reader} read entry {entry_id} of ledger {ledger_id}, closed at {last_entry_id}",
            )
        if not ledger_closed and entry_id > self.read_beyond.get(ledger_id, -1):
            self.read_beyond[ledger_id] = entry_id

    # --- durability -------------------------------------------------------------------------

    def check_durability(self, bookies: Iterable[DurableView], why: str) -> None:
        """Every acknowledged entry has an intact durable copy on a bookie of
        its write set (under the newest metadata)."""
        self.durability_checks += 1
        stored = {bookie.name: bookie.durable_entries() for bookie in bookies}
        for ledger_id, entries in sorted(self.acked.items()):
            metadata = self.metadata[ledger_id]
            for entry_id in sorted(entries):
                key = (ledger_id, entry_id)
                entry = self.written[key][0]
                if not any(stored.get(bookie_id, {}).get(key) == entry for bookie_id in metadata.write_set(entry_id)):
                    self.violate(
                        "acknowledged entries stay durable",
                        f"after {why}: entry {entry_id} of ledger {ledger_id} has no intact durable copy on "
                        f"{metadata.write_set(entry_id)}",
                    )

    def recovery_cannot_decide(self, stored: dict[str, dict[tuple[int, int], bytes | None]], ledger_id: int,
                               entry_id: int) -> str | None:
        """Why recovery can never decide this entry, or None if it can:
        present needs one intact copy on its write set, absent needs
        WQ - AQ + 1 bookies of it without the entry ("no entry"); a corrupt
        copy gives neither (ledger_client.recovery_core's rule). `stored` holds the bookies
        that answer."""
        metadata = self.metadata.get(ledger_id)
        written = self.written.get((ledger_id, entry_id))
        if metadata is None:
            return None
        key = (ledger_id, entry_id)
        write_set = metadata.write_set(entry_id)
        intact = sum(1 for bookie_id in write_set if written is not None and stored.get(bookie_id, {}).get(key) == written[0])
        without = sum(1 for bookie_id in write_set if bookie_id in stored and key not in stored[bookie_id])
        negatives_needed = metadata.write_quorum - metadata.ack_quorum + 1
        if intact >= 1 or without >= negatives_needed:
            return None
        return (
            f"no intact copy on {list(write_set)}, {without} bookies without it (absent needs "
            f"{negatives_needed}), the rest corrupt or down"
        )

    def fencing_cannot_cover(self, stored: dict[str, dict[tuple[int, int], bytes | None]], ledger_id: int,
                             fence_errors: dict[str, int], corrupted: set[tuple[int, int]]) -> str | None:
        """Why fencing can never reach its coverage (E - AQ + 1 bookies of the
        last ensemble), or None if it can: a bookie answers a fence read
        with the ledger's last entry it holds, and one whose copy of that
        entry is corrupt answers IO_ERROR, which does not count as fenced."""
        metadata = self.metadata.get(ledger_id)
        if metadata is None:
            return None
        blocked = {}
        for bookie_id, entry_id in fence_errors.items():
            key = (ledger_id, entry_id)
            held = stored.get(bookie_id, {})
            written = self.written.get(key)
            corrupt_copy = key in held and (written is None or held[key] != written[0])
            if bookie_id in metadata.last_ensemble[1] and key in corrupted and corrupt_copy:
                blocked[bookie_id] = entry_id
        coverage = metadata.ensemble_size - metadata.ack_quorum + 1
        if metadata.ensemble_size - len(blocked) >= coverage:
            return None
        return f"fencing needs {coverage} of {metadata.ensemble_size} bookies, and {blocked} hold a corrupt copy of the entry a fence read returns"

    def intact_copies(self, stored: dict[str, dict[tuple[int, int], bytes | None]], ledger_id: int, entry_id: int,
                      excluding: str) -> int:
        """Intact copies of a written entry on its write set, but for one bookie."""
        metadata = self.metadata.get(ledger_id)
        written = self.written.get((ledger_id, entry_id))
        if metadata is None or written is None:
            return 0
        return sum(
            1 for bookie_id in metadata.write_set(entry_id)
            if bookie_id != excluding and stored.get(bookie_id, {}).get((ledger_id, entry_id)) == written[0]
        )
