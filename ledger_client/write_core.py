"""The write path of one ledger, as a pure state machine: pending adds, the
acknowledgements of their write sets, in-order completion and the LAC, and
ensemble changes when a bookie fails. The trio driver (and the simulator)
feed it events and carry out the actions it returns; it does no I/O, reads
no clock (time comes in as `now_ms`) and takes randomness from an injected
`random.Random` (for picking replacement bookies).

Safety rules it keeps:
- an add completes when AQ bookies of its write set, in the metadata as
  written, acknowledged it; completions go out in entry order;
- a failed bookie is replaced in a new ensemble keyed at LAC + 1, and that
  metadata is written (compare-and-set) before anything is sent to the
  replacement or any add completes; acknowledgements from a replaced bookie
  are forgotten;
- `FENCED` from a bookie, or metadata that turned IN_RECOVERY/CLOSED,
  means another client recovers the ledger: every pending add fails and the
  writer never gets another acknowledgement.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Union

from bookie.protocol.entry_format import DigestManager, parse_header
from bookie.protocol.wire import Status
from ledger_client.errors import (
    BKError,
    LedgerClosedError,
    LedgerFencedError,
    LedgerStateError,
    MetadataVersionError,
    NotEnoughBookiesError,
    TooManyEnsembleChangesError,
    UnauthorizedError,
)
from ledger_client.metadata import LedgerMetadata, LedgerState
from ledger_client.placement import RandomSource, choose_replacement

ENSEMBLE_CHANGES_MAX_DEFAULT = 32
METADATA_CONFLICTS_MAX = 16  # compare-and-set retries of one metadata change
ADD_TIMEOUT_MS_DEFAULT = 10_000
_NONE_FAILED: frozenset[str] = frozenset()


# --- actions -------------------------------------------------------------------
# Actions are values nobody changes once made. The two a writer makes for
# every entry (three sends and a completion) are not frozen dataclasses: a
# frozen one sets each field through object.__setattr__, four times the cost.


@dataclass(slots=True)
class SendAdd:
    """Send `entry` (header | digest | payload) to `bookie_id`."""

    bookie_id: str
    entry_id: int
    entry: bytes
    recovery: bool


class MetadataPurpose(enum.Enum):
    ENSEMBLE_CHANGE = "ensemble_change"
    START_RECOVERY = "start_recovery"
    CLOSE = "close"


@dataclass(frozen=True, slots=True)
class WriteMetadata:
    """Compare-and-set the ledger's metadata. Answer with `metadata_written`,
    `metadata_conflict` (with the current value) or `metadata_failed`."""

    metadata: LedgerMetadata
    expected_version: int
    purpose: MetadataPurpose


@dataclass(slots=True)
class AddsCompleted:
    """These entries (in order) are acknowledged: AQ bookies have them."""

    entry_ids: list[int]


@dataclass(frozen=True, slots=True)
class AddsFailed:
    entry_ids: list[int]
    error: BKError


@dataclass(frozen=True, slots=True)
class Closed:
    """The metadata says CLOSED with this last entry; the handle is done."""

    metadata: LedgerMetadata
    version: int


@dataclass(frozen=True, slots=True)
class CloseFailed:
    error: BKError


Action = Union[SendAdd, WriteMetadata, AddsCompleted, AddsFailed, Closed, CloseFailed]


# --- state -----------------------------------------------------------------------


@dataclass(slots=True)
class _PendingAdd:
    entry_id: int
    entry: bytes
    total_length: int
    sent_at_ms: float
    # Each bookie it was sent to -> whether that bookie acknowledged it;
    # `acks` counts the True values. (One dict of str -> bool, not two
    # sets: the garbage collector does not track such a dict, and an add
    # pending across a collection would otherwise bring two more objects
    # into the older generations, whose full collections cost a writer
    # with many ledgers open several microseconds per entry.)
    sent_to: dict[str, bool] = field(default_factory=dict)
    acks: int = 0

    def keep_only(self, bookie_ids: set[str]) -> None:
        """Forget the sends to (and acknowledgements from) every other bookie."""
        self.sent_to = {bookie_id: acked for bookie_id, acked in self.sent_to.items() if bookie_id in bookie_ids}
        self.acks = sum(self.sent_to.values())


class WriteCore:
    """One writer (or recovery rewriter) of one ledger.

    Entries are added with `add` (payload, encoded here with the LAC
    piggybacked) or, for recovery, `add_encoded` (bytes a recoverer read
    back, sent with RECOVERY_ADD). Events: `bookie_responded`,
    `bookie_failed`, `tick`, `metadata_written` / `metadata_conflict` /
    `metadata_failed`, `bookies_changed`, `close`.
    """

    def __init__(
        self,
        metadata: LedgerMetadata,
        version: int,
        digest: DigestManager,
        *,
        bookies: Mapping[str, str | None],
        rng: RandomSource,
        recovery: bool = False,
        last_add_confirmed: int = -1,
        length: int = 0,
        ensemble_changes_max: int = ENSEMBLE_CHANGES_MAX_DEFAULT,
        add_timeout_ms: float = ADD_TIMEOUT_MS_DEFAULT,
    ) -> None:
        expected_state = LedgerState.IN_RECOVERY if recovery else LedgerState.OPEN
        if metadata.state is not expected_state:
            raise LedgerStateError(f"ledger {metadata.ledger_id} is {metadata.state.value}, a {'recoverer' if recovery else 'writer'} needs {expected_state.value}")
        self.metadata = metadata
        self.version = version
        # A ledger's quorums never change: kept here, an answer does not
        # reach into the metadata (one object more to fetch per answer).
        self._ack_quorum = metadata.ack_quorum
        self.digest = digest
        self.recovery = recovery
        self.bookies = dict(bookies)  # writable bookies (id -> rack) to replace failed ones from
        self.rng = rng
        self.ensemble_changes_max = ensemble_changes_max
        self.add_timeout_ms = add_timeout_ms
        self.last_add_confirmed = last_add_confirmed
        self.length = length  # payload bytes up to and including the LAC entry
        self.next_entry_id = last_add_confirmed + 1
        self._pushed_length = length  # payload bytes up to the last entry added
        self._pending: OrderedDict[int, _PendingAdd] = OrderedDict()
        self.ensemble_changes = 0
        # Bookies of the last ensemble that failed and wait to be replaced;
        # nothing is sent to them meanwhile. (A frozenset, replaced on each
        # change: while none failed, every core shares the same empty one,
        # which every send looks at.)
        self._failed: frozenset[str] = _NONE_FAILED
        self._change_in_flight: LedgerMetadata | None = None
        self._conflicts = 0
        self._closing = False
        self._close_in_flight = False
        self._closing_metadata: LedgerMetadata | None = None
        self.error: BKError | None = None  # once set, the handle is broken for good
        self.closed = False

    @property
    def metadata(self) -> LedgerMetadata:
        return self._metadata

    @metadata.setter
    def metadata(self, metadata: LedgerMetadata) -> None:
        self._metadata = metadata
        # The last ensemble's write sets (by entry id modulo E), from the
        # entry id it starts at: every add's sends look them up here rather
        # than through the metadata's ensembles (four objects more to fetch
        # per add, each out of the caches when many ledgers are open).
        self._last_ensemble_key = metadata.last_ensemble[0]
        self._last_write_sets = metadata.last_write_sets

    # --- adding ---------------------------------------------------------------------

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def changing_ensemble(self) -> bool:
        return self._change_in_flight is not None

    def _check_can_add(self) -> None:
        if self.error is not None:
            raise self.error
        if self.closed or self._closing:
            raise LedgerClosedError(f"ledger {self.metadata.ledger_id} is closed")

    def add(self, payload: bytes, now_ms: float) -> tuple[int, list[Action]]:
        """Add an entry; returns its id and the sends to make."""
        assert not self.recovery, "a recoverer rewrites entries with add_encoded"
        self._check_can_add()
        entry_id = self.next_entry_id
        total_length = self._pushed_length + len(payload)
        entry = self.digest.encode(entry_id, self.last_add_confirmed, total_length, payload)
        return entry_id, self._push(entry_id, entry, total_length, now_ms)

    def add_encoded(self, entry_id: int, entry: bytes, now_ms: float) -> list[Action]:
        """Rewrite an entry read back during recovery, bytes unchanged."""
        assert self.recovery, "only a recoverer sends entries it did not encode"
        self._check_can_add()
        if entry_id != self.next_entry_id:
            raise ValueError(f"recovery must rewrite entries in order: expected {self.next_entry_id}, got {entry_id}")
        return self._push(entry_id, entry, parse_header(entry).total_length, now_ms)

    def _push(self, entry_id: int, entry: bytes, total_length: int, now_ms: float) -> list[Action]:
        self.next_entry_id = entry_id + 1
        self._pushed_length = total_length
        pending = self._pending[entry_id] = _PendingAdd(entry_id, entry, total_length, now_ms)
        return self._send_missing(pending, now_ms)

    def _send_missing(self, pending: _PendingAdd, now_ms: float) -> list[Action]:
        """Send the entry to each bookie of its write set that does not have
        it yet, except failed bookies waiting for their replacement."""
        actions: list[Action] = []
        entry_id = pending.entry_id
        if entry_id >= self._last_ensemble_key:
            write_sets = self._last_write_sets
            write_set = write_sets[entry_id % len(write_sets)]
        else:
            write_set = self._metadata.write_set_tuple(entry_id)
        failed = self._failed
        for bookie_id in write_set:
            if bookie_id not in pending.sent_to and bookie_id not in failed:
                pending.sent_to[bookie_id] = False
                actions.append(SendAdd(bookie_id, pending.entry_id, pending.entry, self.recovery))
        if actions:
            pending.sent_at_ms = now_ms
        return actions

    # --- responses ------------------------------------------------------------------

    def bookie_responded(self, bookie_id: str, entry_id: int, status: Status, now_ms: float) -> list[Action]:
        if status is Status.OK:
            return self.bookie_acknowledged(bookie_id, [entry_id])
        if self.error is not None or self.closed:
            return []
        pending = self._pending.get(entry_id)
        if status is Status.FENCED:
            return self._fail(LedgerFencedError(f"ledger {self.metadata.ledger_id} was fenced by a recoverer (bookie {bookie_id})"))
        if status is Status.UNAUTHORIZED:
            return self._fail(UnauthorizedError(f"bookie {bookie_id} refused the master key of ledger {self.metadata.ledger_id}"))
        if pending is not None and bookie_id not in pending.sent_to:
            return []  # an answer to a send made before a replacement
        # Any other error (IO_ERROR, READ_ONLY, TOO_MANY_REQUESTS, ...):
        # the bookie cannot take writes now, replace it.
        return self.bookie_failed(bookie_id, now_ms)

    def bookie_acknowledged(self, bookie_id: str, entry_ids: list[int]) -> list[Action]:
        """The bookie answered OK for each of `entry_ids` (`bookie_responded`
        with Status.OK is this for one). Taken together, the result is that
        of one at a time, the completions in one action: a writer's answers
        arrive by the thousand, and this checks for completions once. (No
        time: nothing here depends on it, and a writer with many ledgers
        open would read the clock for every answer.)"""
        if self.error is not None or self.closed or not entry_ids or max(entry_ids) <= self.last_add_confirmed:
            # (The last: only adds that completed already, such as the third
            # answer of three with AQ 2.)
            return []
        pending_adds = self._pending
        ack_quorum = self._ack_quorum
        quorum_reached = False
        for entry_id in entry_ids:
            pending = pending_adds.get(entry_id)
            # Not pending or not sent there: late, duplicate, or from a bookie replaced since.
            if pending is not None and pending.sent_to.get(bookie_id) is False:
                pending.sent_to[bookie_id] = True
                pending.acks += 1
                if pending.acks >= ack_quorum:
                    quorum_reached = True
        # Adds complete only when the first pending one has AQ answers: an
        # answer that leaves every add it names short of AQ completes none
        # (the first of three, with AQ 2).
        return self._deliver() if quorum_reached else []

    def bookie_failed(self, bookie_id: str, now_ms: float) -> list[Action]:
        """The connection to a bookie broke or it answered an error: replace
        it if it is in the last ensemble."""
        if self.error is not None or self.closed or not self._mark_failed(bookie_id):
            return []
        return self._maybe_change_ensemble(now_ms)

    def _mark_failed(self, bookie_id: str) -> bool:
        if bookie_id not in self.metadata.last_ensemble[1] or bookie_id in self._failed:
            return False
        self._failed = self._failed | {bookie_id}
        # Sends to it that were not acknowledged are void; the entries go to
        # the replacement once the new ensemble is written.
        for pending in self._pending.values():
            if pending.sent_to.get(bookie_id) is False:
                del pending.sent_to[bookie_id]
        return True

    def tick(self, now_ms: float) -> list[Action]:
        """Bookies that leave the oldest pending add unacknowledged past the
        add timeout count as failed."""
        if self.error is not None or self.closed or not self._pending or self._change_in_flight is not None:
            return []
        oldest = next(iter(self._pending.values()))
        # The same sum as `next_deadline_ms`: a timer that fires at that
        # deadline must find it due (now - sent < timeout can differ from
        # sent + timeout <= now in floating point, and the timer would spin).
        if now_ms < oldest.sent_at_ms + self.add_timeout_ms:
            return []
        # Every bookie late on it is replaced in one ensemble change.
        if not any([self._mark_failed(bookie_id) for bookie_id in sorted(bookie_id for bookie_id, acked in oldest.sent_to.items() if not acked)]):
            return []
        return self._maybe_change_ensemble(now_ms)

    def next_deadline_ms(self) -> float | None:
        if self.error is not None or self.closed or not self._pending or self._change_in_flight is not None:
            return None
        return next(iter(self._pending.values())).sent_at_ms + self.add_timeout_ms

    def bookies_changed(self, bookies: Mapping[str, str | None]) -> None:
        """The writable bookies (id -> rack) the registry lists now."""
        self.bookies = dict(bookies)

    # --- completion -----------------------------------------------------------------

    def _deliver(self) -> list[Action]:
        if self._change_in_flight is not None:
            return []  # nothing completes while the ensemble is being changed
        completed: list[int] = []
        ack_quorum = self._ack_quorum
        pending_adds = self._pending
        last = None
        for entry_id, pending in pending_adds.items():
            if pending.acks < ack_quorum:
                break
            completed.append(entry_id)
            last = pending
        actions: list[Action] = []
        if last is not None:
            for _ in completed:
                pending_adds.popitem(last=False)
            self.last_add_confirmed = last.entry_id
            self.length = last.total_length
            actions.append(AddsCompleted(completed))
        if self._closing and not self._pending:
            actions += self._start_close()
        return actions

    # --- ensemble changes ------------------------------------------------------------

    def _maybe_change_ensemble(self, now_ms: float) -> list[Action]:
        if self._change_in_flight is not None or self._close_in_flight or not self._failed:
            return []
        if self.ensemble_changes >= self.ensemble_changes_max:
            return self._fail(TooManyEnsembleChangesError(
                f"ledger {self.metadata.ledger_id}: {self.ensemble_changes} ensemble changes, the bound is {self.ensemble_changes_max}"
            ))
        first_entry_id, ensemble = self.metadata.last_ensemble
        new_ensemble = list(ensemble)
        exclude = self._failed | set(ensemble)
        try:
            for index, bookie_id in enumerate(ensemble):
                if bookie_id in self._failed:
                    new_ensemble[index] = choose_replacement(
                        new_ensemble, index, self.bookies, self.metadata.write_quorum, exclude=exclude, rng=self.rng
                    )
                    exclude = exclude | {new_ensemble[index]}
        except NotEnoughBookiesError as error:
            return self._fail(NotEnoughBookiesError(f"cannot replace bookies {sorted(self._failed)} of ledger {self.metadata.ledger_id}: {error}"))
        # Keyed at LAC + 1: every entry before it is acknowledged and stays
        # where it is. (Only when another recoverer keyed an ensemble later
        # can the last key be ahead; an ensemble never goes before it.)
        key = max(self.last_add_confirmed + 1, first_entry_id)
        proposed = self.metadata.with_ensemble(key, new_ensemble)
        self._change_in_flight = proposed
        return [WriteMetadata(proposed, self.version, MetadataPurpose.ENSEMBLE_CHANGE)]

    def metadata_written(self, version: int, now_ms: float) -> list[Action]:
        if self._close_in_flight:
            assert self._closing_metadata is not None
            self._close_in_flight = False
            self.metadata, self.version = self._closing_metadata, version
            self.closed = True
            return [Closed(self.metadata, version)]
        proposed = self._change_in_flight
        assert proposed is not None, "metadata_written without a change in flight"
        self._change_in_flight = None
        self._conflicts = 0
        self.ensemble_changes += 1
        self.metadata, self.version = proposed, version
        return self._adopt_ensemble(now_ms)

    def _adopt_ensemble(self, now_ms: float) -> list[Action]:
        """The metadata now in force may have a new last ensemble: forget
        sends to and acknowledgements from bookies no longer in each pending
        entry's write set, send to the new members, and go on."""
        current = set(self.metadata.last_ensemble[1])
        self._failed = (self._failed & current) or _NONE_FAILED  # replaced ones are gone; others still wait
        actions: list[Action] = []
        for pending in self._pending.values():
            write_set = set(self.metadata.write_set(pending.entry_id))
            pending.keep_only(write_set)
            actions += self._send_missing(pending, now_ms)
        if self._failed:
            return actions + self._maybe_change_ensemble(now_ms)
        return actions + self._deliver()

    def metadata_conflict(self, current: LedgerMetadata, version: int, now_ms: float) -> list[Action]:
        """The compare-and-set lost: `current` is what the store holds now."""
        if self._close_in_flight:
            self._close_in_flight = False
            return self._close_conflict(current, version)
        assert self._change_in_flight is not None, "metadata_conflict without a change in flight"
        self._change_in_flight = None
        if current.state is not self.metadata.state:
            if self.recovery and current.state is LedgerState.CLOSED:
                return self._fail(LedgerClosedError(f"ledger {current.ledger_id} was closed by another recoverer"))
            return self._fail(LedgerFencedError(f"ledger {current.ledger_id} is {current.state.value}: another client is recovering it"))
        self._conflicts += 1
        if self._conflicts > METADATA_CONFLICTS_MAX:
            return self._fail(MetadataVersionError(f"ledger {current.ledger_id}: {self._conflicts} metadata conflicts in a row"))
        # Someone else changed the metadata in the same state (another
        # recoverer, or an operator tool): take its ensembles and retry.
        self.metadata, self.version = current, version
        return self._adopt_ensemble(now_ms)

    def metadata_failed(self, error: BKError) -> list[Action]:
        """The metadata store failed (session lost, unreachable): the outcome
        of the compare-and-set is unknown, so the handle is broken."""
        if self._close_in_flight:
            self._close_in_flight = False
            return [CloseFailed(error)]
        self._change_in_flight = None
        return self._fail(error)

    # --- closing ------------------------------------------------------------------------

    def close(self, now_ms: float) -> list[Action]:
        """Close once every pending add is settled: CAS to CLOSED at the LAC."""
        if self.closed:
            return [Closed(self.metadata, self.version)]
        if self.error is not None:
            return [CloseFailed(self.error)]
        if self._closing:
            return []
        self._closing = True
        if self._pending or self._change_in_flight is not None:
            return []  # _deliver starts the close once the last add settles
        return self._start_close()

    def _start_close(self) -> list[Action]:
        if self._close_in_flight or self._change_in_flight is not None:
            return []
        self._closing_metadata = self.metadata.with_closed(self.last_add_confirmed, self.length)
        self._close_in_flight = True
        return [WriteMetadata(self._closing_metadata, self.version, MetadataPurpose.CLOSE)]

    def _close_conflict(self, current: LedgerMetadata, version: int) -> list[Action]:
        if current.state is LedgerState.CLOSED:
            if current.last_entry_id == self.last_add_confirmed and current.length == self.length:
                # Closed by a recoverer that found exactly what we wrote.
                self.metadata, self.version, self.closed = current, version, True
                return [Closed(current, version)]
            error: BKError = LedgerFencedError(
                f"ledger {current.ledger_id} was closed by another client at entry {current.last_entry_id}, "
                f"this writer confirmed up to {self.last_add_confirmed}"
            )
        elif current.state is not self.metadata.state:
            error = LedgerFencedError(f"ledger {current.ledger_id} is {current.state.value}: another client is recovering it")
        else:
            self._conflicts += 1
            if self._conflicts > METADATA_CONFLICTS_MAX:
                error = MetadataVersionError(f"ledger {current.ledger_id}: {self._conflicts} metadata conflicts in a row")
            else:
                self.metadata, self.version = current, version
                return self._start_close()
        self.error = error
        return [CloseFailed(error)]

    # --- failure ----------------------------------------------------------------------

    def _fail(self, error: BKError) -> list[Action]:
        """The handle is broken for good: fail every pending add. Said even
        with nothing pending (an empty AddsFailed), so that a driver learns
        it now and not at the next add."""
        first = self.error is None
        if first:
            self.error = error
        failed = list(self._pending)
        self._pending.clear()
        actions: list[Action] = [AddsFailed(failed, self.error)] if failed or first else []
        if self._closing and not self.closed:
            actions.append(CloseFailed(self.error))
        return actions


__all__ = [
    "Action",
    "AddsCompleted",
    "AddsFailed",
    "Closed",
    "CloseFailed",
    "MetadataPurpose",
    "SendAdd",
    "WriteCore",
    "WriteMetadata",
]
