"""Auto-recovery's state in the metadata store (BookKeeper's
LedgerUnderreplicationManager): under-replicated ledger markers, the
replication locks, the switch that turns auto-recovery off, and the scan of
every ledger's ensembles. Synchronous calls over a `MetadataStore`; the
trio drivers run them in worker threads. Paths: `coordination.cluster_layout`."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from coordination.cluster_layout import ClusterLayout
from coordination.store import BadVersionError, MetadataStore, NodeExistsError, NoNodeError
from ledger_client.errors import MalformedLedgerMetadataError, NoSuchLedgerError
from ledger_client.ledger_store import LedgerStore

log = logging.getLogger(__name__)
MARK_ATTEMPTS_MAX = 5  # compare-and-set rounds to add bookies to an existing marker


@dataclass(frozen=True)
class Marker:
    """An under-replicated ledger: the lost bookies its fragments are on,
    since when each was marked lost (`lost_since_ms`, the auditor's wall
    clock, ms), when the ledger was first marked and by which auditor.
    Workers time an open ledger's grace period on their own clocks
    (`replication_core.GraceClock`); these times are for operators."""

    ledger_id: int
    lost_bookies: frozenset[str]
    marked_ms: float
    auditor: str = ""
    lost_since_ms: Mapping[str, float] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        since = {bookie_id: self.lost_since_ms.get(bookie_id, self.marked_ms) for bookie_id in sorted(self.lost_bookies)}
        document = {
            "lost_bookies": sorted(self.lost_bookies), "lost_since_ms": since,
            "marked_ms": self.marked_ms, "auditor": self.auditor,
        }
        return json.dumps(document, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, ledger_id: int, data: bytes) -> "Marker":
        try:
            document = json.loads(data)
            lost = frozenset(document["lost_bookies"])
            marked_ms = float(document["marked_ms"])
            since = document.get("lost_since_ms", {})  # absent in markers of the first version
            lost_since_ms = {bookie_id: float(since.get(bookie_id, marked_ms)) for bookie_id in lost}
            return cls(ledger_id, lost, marked_ms, document.get("auditor", ""), lost_since_ms)
        except (ValueError, KeyError, TypeError, AttributeError):
            # An unreadable marker still says the ledger needs a look; the
            # worker then treats every bookie missing from the registry as lost.
            return cls(ledger_id, frozenset(), 0.0)


def ensure_paths(store: MetadataStore, layout: ClusterLayout) -> None:
    for path in (layout.underreplicated_ledgers, layout.replication_locks, layout.auditor_election):
        store.ensure_path(path)


# -- markers ------------------------------------------------------------------------


def mark(store: MetadataStore, layout: ClusterLayout, ledger_id: int, lost: frozenset[str], now_ms: float, auditor: str) -> bool:
    """Mark the ledger under-replicated by `lost`, or add them to its marker
    (keeping the first marking time, and each bookie's own: a bookie added
    later is lost since now). Returns whether anything changed."""
    path = layout.underreplicated_ledger(ledger_id)
    for _ in range(MARK_ATTEMPTS_MAX):
        try:
            store.create(path, Marker(ledger_id, lost, now_ms, auditor).to_bytes(), make_parents=True)
            return True
        except NodeExistsError:
            pass
        try:
            data, stat = store.get(path)
        except NoNodeError:
            continue  # a worker finished it meanwhile: create it again
        marker = Marker.from_bytes(ledger_id, data)
        if lost <= marker.lost_bookies:
            return False
        since = {**{bookie_id: now_ms for bookie_id in lost}, **marker.lost_since_ms}
        updated = Marker(ledger_id, marker.lost_bookies | lost, marker.marked_ms or now_ms, auditor, since)
        try:
            store.set(path, updated.to_bytes(), stat.version)
            return True
        except (BadVersionError, NoNodeError):
            continue
    log.warning("ledger %d: could not update its under-replication marker in %d tries", ledger_id, MARK_ATTEMPTS_MAX)
    return False


def marked_ledgers(store: MetadataStore, layout: ClusterLayout) -> list[int]:
    try:
        names = store.children(layout.underreplicated_ledgers)
    except NoNodeError:
        return []
    return sorted(int(name) for name in names if name.isascii() and name.isdigit())


def read_marker(store: MetadataStore, layout: ClusterLayout, ledger_id: int) -> tuple[Marker, int] | None:
    """The marker and its version, or None when the ledger is not marked."""
    try:
        data, stat = store.get(layout.underreplicated_ledger(ledger_id))
    except NoNodeError:
        return None
    return Marker.from_bytes(ledger_id, data), stat.version


def unmark(store: MetadataStore, layout: ClusterLayout, ledger_id: int, version: int) -> bool:
    """Delete the marker if it is still at `version` (an auditor that added
    a bookie to it meanwhile wins); returns whether it was deleted."""
    try:
        store.delete(layout.underreplicated_ledger(ledger_id), version)
        return True
    except NoNodeError:
        return True
    except BadVersionError:
        return False


# -- locks --------------------------------------------------------------------------


def try_lock(store: MetadataStore, layout: ClusterLayout, ledger_id: int, owner: str) -> bool:
    """Take the ledger's replication lock (an ephemeral node: it goes with
    the worker's session). A lock node of our own session is ours already:
    an unlock that failed with the connection lost leaves it (the session
    lives on), and so can a create whose answer was lost."""
    path = layout.replication_lock(ledger_id)
    try:
        store.create(path, owner.encode(), ephemeral=True, make_parents=True)
        return True
    except NodeExistsError:
        pass
    stat = store.exists(path)
    return stat is not None and stat.ephemeral_owner == store.session_id


def unlock(store: MetadataStore, layout: ClusterLayout, ledger_id: int) -> None:
    """Release the ledger's replication lock if our session holds it (after
    our session ended, the node may be another worker's). Raises
    MetadataError when the store cannot be reached: try again later.
    ZooKeeper cannot make a delete conditional on the node's owner: should
    our session end between the two calls and another worker lock at once,
    its lock would go, which costs at most two workers copying the same
    fragments (the compare-and-set keeps one replacement), never data."""
    path = layout.replication_lock(ledger_id)
    stat = store.exists(path)
    if stat is None or stat.ephemeral_owner != store.session_id:
        return
    try:
        store.delete(path, stat.version)
    except (NoNodeError, BadVersionError):
        pass


def locks(store: MetadataStore, layout: ClusterLayout) -> dict[int, str]:
    """Ledger id -> the worker holding its lock."""
    try:
        names = store.children(layout.replication_locks)
    except NoNodeError:
        return {}
    held = {}
    for name in names:
        try:
            held[int(name)] = store.get(f"{layout.replication_locks}/{name}")[0].decode(errors="replace")
        except (NoNodeError, ValueError):
            continue
    return held


# -- the switch ---------------------------------------------------------------------


def is_enabled(store: MetadataStore, layout: ClusterLayout) -> bool:
    return store.exists(layout.autorecovery_disabled) is None


def set_enabled(store: MetadataStore, layout: ClusterLayout, enabled: bool) -> None:
    """Switch auto-recovery on or off for the whole cluster (idempotent)."""
    if enabled:
        try:
            store.delete(layout.autorecovery_disabled)
        except NoNodeError:
            pass
        return
    try:
        store.create(layout.autorecovery_disabled, b"", make_parents=True)
    except NodeExistsError:
        pass


# -- the election -------------------------------------------------------------------


CANDIDATE_PREFIX = "candidate-"


def auditor_candidates(store: MetadataStore, layout: ClusterLayout) -> list[tuple[str, str]]:
    """(node name, candidate's name) in election order: the first is the auditor."""
    try:
        names = store.children(layout.auditor_election)
    except NoNodeError:
        return []
    candidates = []
    for name in sorted(name for name in names if name.startswith(CANDIDATE_PREFIX)):
        try:
            candidates.append((name, store.get(f"{layout.auditor_election}/{name}")[0].decode(errors="replace")))
        except NoNodeError:
            continue
    return candidates


# -- the scan -----------------------------------------------------------------------


def ensemble_bookies(ledgers: LedgerStore) -> dict[int, frozenset[str]]:
    """Ledger id -> every bookie of its ensembles, for every ledger (the
    auditor's bookie-to-ledgers index, built one ledger at a time; a ledger
    deleted meanwhile is skipped, unreadable metadata is logged and skipped)."""
    found = {}
    for ledger_id in ledgers.iter_ledger_ids():
        try:
            metadata, _ = ledgers.read(ledger_id)
        except NoSuchLedgerError:
            continue
        except MalformedLedgerMetadataError as error:
            log.warning("auditor skips ledger %d: %s", ledger_id, error)
            continue
        found[ledger_id] = frozenset(metadata.all_bookies())
    return found


__all__ = [
    "CANDIDATE_PREFIX",
    "Marker",
    "auditor_candidates",
    "ensemble_bookies",
    "ensure_paths",
    "is_enabled",
    "locks",
    "mark",
    "marked_ledgers",
    "read_marker",
    "set_enabled",
    "try_lock",
    "unlock",
    "unmark",
]
