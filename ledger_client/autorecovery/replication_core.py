"""A replication worker's decisions, pure: which fragments of a marked ledger
sit on lost bookies, which entries each lost bookie held there (those whose
write set includes it), which bookie replaces it, how the metadata
changes once the copies are made, whether an open ledger must first wait
out its grace period or be fenced (and whether fencing could close it at all
without the lost bookies), and when to try a failed ledger again.
The trio driver is `ledger_client.autorecovery.replication_worker`."""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ledger_client.errors import LedgerStateError
from ledger_client.metadata import LedgerMetadata, LedgerState
from ledger_client.placement import RandomSource, choose_replacement


@dataclass(frozen=True)
class Fragment:
    """The entries `first_entry_id`..`last_entry_id` (none when last <
    first) written through the ensemble keyed at `first_entry_id`, seen from
    position `index`, where the lost bookie `bookie_id` stands."""

    first_entry_id: int
    last_entry_id: int
    index: int
    bookie_id: str
    ensemble: tuple[str, ...]

    def entry_ids(self, write_quorum: int) -> list[int]:
        """The entries the bookie at `index` stored: e is written to
        positions (e + i) mod E, i < WQ, so `index` holds e exactly when
        (index - e) mod E < WQ."""
        size = len(self.ensemble)
        return [
            entry_id for entry_id in range(self.first_entry_id, self.last_entry_id + 1)
            if (self.index - entry_id) % size < write_quorum
        ]

    def sources(self, entry_id: int, write_quorum: int, lost: Collection[str]) -> list[str]:
        """The other bookies of the entry's write set that are not lost, in
        write-set order: where to read a copy from."""
        size = len(self.ensemble)
        write_set = [self.ensemble[(entry_id + offset) % size] for offset in range(write_quorum)]
        return [bookie_id for bookie_id in write_set if bookie_id != self.bookie_id and bookie_id not in lost]


class Step(enum.Enum):
    DONE = "done"  # no fragment is on a lost bookie: delete the marker
    REPLICATE = "replicate"  # copy `fragments`, then replace them in the metadata
    WAIT = "wait"  # an open (or recovering) ledger's last fragment: wait until `wait_until_ms`
    RECOVER = "recover"  # the grace period is over: fence and close the ledger first
    # Recovery could not close the ledger without the lost bookies
    # `blocked_by`: leave it (and its writer) alone, look again at `wait_until_ms`.
    BLOCKED = "blocked"


BLOCKED_RECHECK_MS_MIN = 1_000.0  # a blocked ledger is looked at again at most this often


@dataclass(frozen=True)
class Plan:
    step: Step
    fragments: tuple[Fragment, ...] = ()
    wait_until_ms: float | None = None
    blocked_by: frozenset[str] = frozenset()


def fragments_on(metadata: LedgerMetadata, lost: Collection[str]) -> list[tuple[int, Fragment]]:
    """(ensemble position, fragment) for every ensemble slot held by a lost
    bookie. A closed ledger's last fragment ends at its last entry; an open
    ledger's has no known end (-1 stands for "not final")."""
    found = []
    ensembles = metadata.ensembles
    for position, (first_entry_id, bookies) in enumerate(ensembles):
        if position + 1 < len(ensembles):
            last_entry_id = ensembles[position + 1][0] - 1
        elif metadata.is_closed:
            last_entry_id = metadata.last_entry_id
        else:
            last_entry_id = -1
        for index, bookie_id in enumerate(bookies):
            if bookie_id in lost:
                found.append((position, Fragment(first_entry_id, last_entry_id, index, bookie_id, bookies)))
    return found


def recovery_blocked_by(metadata: LedgerMetadata, lost: Collection[str]) -> frozenset[str]:
    """The lost bookies of the last ensemble without which fencing recovery
    (ledger_client.recovery_core) cannot close the ledger; empty when it can without them.

    Recovery fences the last ensemble until E - AQ + 1 bookies answered,
    then decides every entry from the largest LAC the bookies know + 1 up to
    the first absent one: present at one intact copy, absent at WQ - AQ + 1
    NO_ENTRY answers. Which entries those are is known only to the bookies,
    and past the LAC they may reach any write set of the last ensemble, so
    each write set must keep WQ - AQ + 1 live members (the first entry
    nobody holds needs that many negatives; with fewer, the lost bookies
    of a write set number AQ or more and may hold every acknowledged copy
    of an entry). Fencing needs E - AQ + 1 live bookies of the ensemble,
    that is at most AQ - 1 lost; a write set, a part of the ensemble, then
    loses at most AQ - 1 of its WQ members too, so the fencing bound is the
    one that decides: recovery can close without the lost bookies exactly
    when at most AQ - 1 of the last ensemble are lost, whatever WQ is.
    Any loss there blocks an AQ = 1 ledger (its lost bookie may hold the
    only copy of an acknowledged entry). A ledger fenced while blocked would
    stay IN_RECOVERY, its writer shut out for nothing."""
    _, ensemble = metadata.last_ensemble
    down = frozenset(ensemble) & frozenset(lost)
    if len(down) > metadata.ack_quorum - 1:
        return down
    return frozenset()


def plan_replication(
    metadata: LedgerMetadata,
    lost: Collection[str],
    *,
    lost_since_ms: Mapping[str, float],
    now_ms: float,
    grace_ms: float,
) -> Plan:
    """What to do next with a marked ledger whose lost bookies are `lost`
    (the marker's bookies that are still not registered); `lost_since_ms`
    says since when each is known lost (a bookie missing from it: since now).

    A closed ledger's fragments are final: copy them all. So are the
    fragments before the last of an open ledger: copy those now. The last
    fragment of an open ledger is its writer's: a live writer replaces a
    bookie that fails its adds itself, so it is left alone until
    `grace_ms` after the last of its lost bookies was known lost
    (BookKeeper's openLedgerRereplicationGracePeriod); after that the
    ledger is fenced and closed (its writer is gone or idle) and copied as a
    closed one, unless recovery could not close it without the lost
    bookies (`recovery_blocked_by`): then it is BLOCKED, looked at again a
    grace period later (the writer's next add replaces the bookie, or the
    bookie comes back). A ledger in recovery is its recoverer's until the
    grace period ends too."""
    found = fragments_on(metadata, lost)
    if not found:
        return Plan(Step.DONE)
    if metadata.state is LedgerState.CLOSED:
        return Plan(Step.REPLICATE, tuple(fragment for _, fragment in found))
    if metadata.state is LedgerState.OPEN:
        last_position = len(metadata.ensembles) - 1
        final = tuple(fragment for position, fragment in found if position < last_position)
        if final:
            return Plan(Step.REPLICATE, final)
    grace_over_ms = max(lost_since_ms.get(fragment.bookie_id, now_ms) for _, fragment in found) + grace_ms
    if now_ms < grace_over_ms:
        return Plan(Step.WAIT, wait_until_ms=grace_over_ms)
    blocked_by = recovery_blocked_by(metadata, lost)
    if blocked_by:
        return Plan(Step.BLOCKED, wait_until_ms=now_ms + max(grace_ms, BLOCKED_RECHECK_MS_MIN), blocked_by=blocked_by)
    return Plan(Step.RECOVER)


def choose_replacements(
    metadata: LedgerMetadata,
    fragments: Sequence[Fragment],
    writable: Mapping[str, str | None],
    lost: Collection[str],
    *,
    rng: RandomSource,
) -> list[str]:
    """A replacement for each fragment's lost bookie (placement's rules:
    distinct from the ensemble, writable, not lost, racks spread). Two lost
    bookies of one ensemble get two different replacements. Raises
    NotEnoughBookiesError when no bookie can take a place."""
    ensembles = {first: list(bookies) for first, bookies in metadata.ensembles}
    chosen = []
    for fragment in fragments:
        ensemble = ensembles[fragment.first_entry_id]
        replacement = choose_replacement(
            ensemble, fragment.index, writable, metadata.write_quorum, exclude=set(lost), rng=rng
        )
        ensemble[fragment.index] = replacement
        chosen.append(replacement)
    return chosen


@dataclass(frozen=True)
class Replacement:
    first_entry_id: int
    index: int
    old: str
    new: str


def apply_replacements(metadata: LedgerMetadata, replacements: Iterable[Replacement]) -> LedgerMetadata | None:
    """The metadata with every replacement whose slot still holds its old
    bookie made; None when none applies. Pure (it runs once per
    compare-and-set attempt). A slot that changed meanwhile (a writer or
    another worker replaced the bookie first), an ensemble gone (closed
    before it held anything) or a state that refuses the change (recovery
    began) is skipped: the next plan looks again."""
    current = metadata
    for replacement in replacements:
        ensemble = dict(current.ensembles).get(replacement.first_entry_id)
        if ensemble is None or ensemble[replacement.index] != replacement.old or replacement.new in ensemble:
            continue
        try:
            current = current.with_bookie_replaced(
                replacement.first_entry_id, replacement.index, replacement.old, replacement.new
            )
        except LedgerStateError:
            continue
    return None if current is metadata else current


def password_for(metadata: LedgerMetadata, passwords: Iterable[bytes]) -> bytes | None:
    """The first of the configured passwords that opens this ledger (the
    metadata keeps only a hash; BookKeeper's bookieRecoveryPasswd plays this
    part for ledgers whose metadata has no password)."""
    for password in passwords:
        if metadata.check_password(password):
            return password
    return None


class RetryBackoff:
    """When a worker may try a ledger again: after a failure, a delay that
    doubles (from `delay_ms_initial` up to `delay_ms_max`) with each failure
    in a row, scaled by a jitter in [1 - jitter_ratio, 1 + jitter_ratio];
    after a WAIT, at the time given. Forgets ledgers no longer marked, so
    it holds at most one record per marked ledger."""

    def __init__(
        self, *, delay_ms_initial: float = 1_000.0, delay_ms_max: float = 60_000.0, jitter_ratio: float = 0.2
    ) -> None:
        if not 0 < delay_ms_initial <= delay_ms_max:
            raise ValueError(f"need 0 < delay_ms_initial <= delay_ms_max, got {delay_ms_initial}, {delay_ms_max}")
        if not 0 <= jitter_ratio < 1:
            raise ValueError(f"jitter_ratio must be within [0, 1), got {jitter_ratio}")
        self.delay_ms_initial = delay_ms_initial
        self.delay_ms_max = delay_ms_max
        self.jitter_ratio = jitter_ratio
        self._failures: dict[int, int] = {}
        self._not_before_ms: dict[int, float] = {}

    def failed(self, ledger_id: int, now_ms: float, rng) -> float:
        """Record a failure; return when to try again."""
        failures = self._failures.get(ledger_id, 0)
        self._failures[ledger_id] = failures + 1
        base_ms = min(self.delay_ms_initial * 2.0**failures, self.delay_ms_max)
        delay_ms = base_ms * rng.uniform(1 - self.jitter_ratio, 1 + self.jitter_ratio)
        self._not_before_ms[ledger_id] = now_ms + delay_ms
        return now_ms + delay_ms

    def wait_until(self, ledger_id: int, when_ms: float) -> None:
        self._not_before_ms[ledger_id] = when_ms

    def started(self, ledger_id: int) -> None:
        """An attempt starts: its retry time is spent (the failures in a
        row are kept, for the next delay). A ledger being worked on thus
        never holds a time already past, which would wake the loop at once."""
        self._not_before_ms.pop(ledger_id, None)

    def succeeded(self, ledger_id: int) -> None:
        self._failures.pop(ledger_id, None)
        self._not_before_ms.pop(ledger_id, None)

    def ready(self, ledger_ids: Iterable[int], now_ms: float) -> list[int]:
        """The ledgers of `ledger_ids` that may be tried now; forgets the
        records of every ledger not among them."""
        marked = set(ledger_ids)
        for ledger_id in list(self._not_before_ms):
            if ledger_id not in marked:
                self.succeeded(ledger_id)
        return [ledger_id for ledger_id in sorted(marked) if self._not_before_ms.get(ledger_id, -1.0) <= now_ms]

    def next_ready_ms(self) -> float | None:
        """The earliest retry time held (ledgers whose attempt started hold
        none)."""
        return min(self._not_before_ms.values(), default=None)


class GraceClock:
    """When this worker first saw each lost bookie in each marked ledger's
    marker, on its own clock: an open ledger's grace period counts from
    there, so a skewed clock elsewhere (the auditor's) never shortens it,
    and a bookie added to a marker later gets a grace period of its own.
    Holds records only for the ledgers `forget_except` was last given."""

    def __init__(self) -> None:
        self._seen_ms: dict[int, dict[str, float]] = {}

    def lost_since_ms(self, ledger_id: int, lost: Iterable[str], now_ms: float) -> dict[str, float]:
        seen = self._seen_ms.setdefault(ledger_id, {})
        lost = set(lost)
        for bookie_id in list(seen):
            if bookie_id not in lost:
                del seen[bookie_id]  # back, or replaced: a new loss starts anew
        return {bookie_id: seen.setdefault(bookie_id, now_ms) for bookie_id in sorted(lost)}

    def forget_except(self, ledger_ids: Iterable[int]) -> None:
        keep = set(ledger_ids)
        for ledger_id in [ledger_id for ledger_id in self._seen_ms if ledger_id not in keep]:
            del self._seen_ms[ledger_id]


def next_list_start(first_entry_id: int, last_entry_id: int, ranges: Iterable[tuple[int, int]]) -> int | None:
    """Where to continue a LIST_ENTRIES check of `first_entry_id`..
    `last_entry_id` after a page answered `ranges`: a bookie lists at most
    its `list_entries_ids_max` ids (the lowest), so a page that ends short
    of `last_entry_id` is asked again past its highest id; None when the
    page reached the end or held nothing in the range (the rest is missing)."""
    highest = max((last for first, last in ranges if last >= first_entry_id and first <= last_entry_id), default=None)
    if highest is None or highest >= last_entry_id:
        return None
    return highest + 1


__all__ = [
    "BLOCKED_RECHECK_MS_MIN",
    "Fragment",
    "GraceClock",
    "Plan",
    "Replacement",
    "RetryBackoff",
    "Step",
    "apply_replacements",
    "choose_replacements",
    "fragments_on",
    "next_list_start",
    "password_for",
    "plan_replication",
    "recovery_blocked_by",
]
