"""Ledger recovery as a pure state machine: mark the
ledger IN_RECOVERY, fence the last ensemble until E - AQ + 1 bookies are
fenced, read forward from the largest LAC with the fence flag on every read,
decide each entry (present as soon as one bookie of its write set returns it
with a valid digest, absent at WQ - AQ + 1 NO_ENTRY/NO_LEDGER answers,
otherwise ask again), rewrite the present ones with RECOVERY_ADD through a
`WriteCore`, then close by compare-and-set. A concurrent recoverer's close
is adopted. No I/O, no clock, no randomness of its own: the driver or the
simulator carries out the actions.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Mapping, Union

from bookie.protocol.entry_format import DigestManager, DigestMismatchError, EntryFormatError
from bookie.protocol.wire import Status
from ledger_client.errors import BKError, LedgerStateError, MetadataVersionError, UnauthorizedError
from ledger_client.metadata import LedgerMetadata, LedgerState
from ledger_client.placement import RandomSource
from ledger_client.write_core import (
    AddsCompleted,
    AddsFailed,
    Closed,
    CloseFailed,
    MetadataPurpose,
    SendAdd,
    WriteCore,
    WriteMetadata,
)

READ_WINDOW_ENTRIES = 64  # entries being decided at once
RETRY_DELAY_MS_MIN = 50.0
RETRY_DELAY_MS_MAX = 2_000.0
START_CONFLICTS_MAX = 16

NEGATIVE = frozenset({Status.NO_ENTRY, Status.NO_LEDGER})


# --- actions -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FenceRead:
    """READ of the LAC entry with the FENCE flag and the master key."""

    bookie_id: str


@dataclass(frozen=True, slots=True)
class RecoveryRead:
    """READ of one entry; with `fence` (every read of the entries being
    recovered), the bookie fences the ledger first."""

    bookie_id: str
    entry_id: int
    fence: bool


@dataclass(frozen=True, slots=True)
class RecoveryDone:
    metadata: LedgerMetadata
    version: int


@dataclass(frozen=True, slots=True)
class RecoveryFailed:
    error: BKError


Action = Union[FenceRead, RecoveryRead, SendAdd, WriteMetadata, RecoveryDone, RecoveryFailed]


class Phase(enum.Enum):
    NEW = "new"
    MARKING = "marking"  # CAS to IN_RECOVERY in flight
    FENCING = "fencing"
    LENGTH = "length"  # reading the start entry for its total length
    READING = "reading"  # deciding and rewriting entries
    CLOSING = "closing"  # CAS to CLOSED in flight
    DONE = "done"
    FAILED = "failed"


@dataclass(slots=True)
class _Decision:
    """Answers gathered for one entry being recovered."""

    entry_id: int
    positives: dict[str, bytes] = field(default_factory=dict)
    negatives: set[str] = field(default_factory=set)
    asked: set[str] = field(default_factory=set)  # answer outstanding


@dataclass(slots=True)
class _Retry:
    due_ms: float
    delay_ms: float


class RecoveryCore:
    def __init__(
        self,
        metadata: LedgerMetadata,
        version: int,
        digest: DigestManager,
        *,
        bookies: Mapping[str, str | None],
        rng: RandomSource,
        read_window_entries: int = READ_WINDOW_ENTRIES,
        **write_options,
    ) -> None:
        self.metadata = metadata
        self.version = version
        self.digest = digest
        self.bookies = dict(bookies)
        self.rng = rng
        self.read_window_entries = read_window_entries
        self.write_options = write_options
        self.phase = Phase.NEW
        self._conflicts = 0
        # fencing
        self._fenced: set[str] = set()
        self._fence_asked: set[str] = set()
        self._lac_seen = -1
        self._known_entries: dict[int, bytes] = {}  # verified copies seen while fencing
        # reading
        self._read_metadata: LedgerMetadata | None = None  # ensembles the entries were written to
        self.start_entry_id = -1  # known confirmed: recovery reads after it
        self._decisions: dict[int, _Decision] = {}
        self._next_to_decide = 0
        self._next_to_ask = 0
        self.last_entry_id: int | None = None  # found once an entry is absent
        self._retries: dict[tuple[str, int], _Retry] = {}  # (bookie, entry id or -1 for fence)
        self.writer: WriteCore | None = None
        self._closing: LedgerMetadata | None = None
        self.result: RecoveryDone | RecoveryFailed | None = None

    # --- start: mark IN_RECOVERY ----------------------------------------------------

    def start(self, now_ms: float) -> list[Action]:
        assert self.phase is Phase.NEW
        return self._mark(now_ms)

    def _mark(self, now_ms: float) -> list[Action]:
        if self.metadata.state is LedgerState.CLOSED:
            return self._done(self.metadata, self.version)
        if self.metadata.state is LedgerState.IN_RECOVERY:
            # Already marked (by a recoverer that died, or one running now):
            # the writer is shut out of the metadata either way. Writing it
            # again would only bump the version under the other recoverer's
            # close and make both start over.
            return self._start_fencing(now_ms)
        self.phase = Phase.MARKING
        try:
            proposed = self.metadata.with_recovery_started()
        except LedgerStateError as error:
            return self._failed(error)
        return [WriteMetadata(proposed, self.version, MetadataPurpose.START_RECOVERY)]

    # --- metadata results ----------------------------------------------------------------

    def metadata_written(self, version: int, now_ms: float) -> list[Action]:
        if self.phase is Phase.MARKING:
            self.metadata = self.metadata.with_recovery_started()
            self.version = version
            return self._start_fencing(now_ms)
        if self.phase is Phase.CLOSING:
            assert self._closing is not None
            return self._done(self._closing, version)
        assert self.writer is not None and self.phase in (Phase.READING,), "metadata_written out of phase"
        return self._from_writer(self.writer.metadata_written(version, now_ms), now_ms)

    def metadata_conflict(self, current: LedgerMetadata, version: int, now_ms: float) -> list[Action]:
        if current.state is LedgerState.CLOSED:
            # Another recoverer (or the writer) closed it first: adopt that.
            return self._done(current, version)
        if self.phase is Phase.MARKING:
            self._conflicts += 1
            if self._conflicts > START_CONFLICTS_MAX:
                return self._failed(MetadataVersionError(f"ledger {current.ledger_id}: {self._conflicts} metadata conflicts while starting recovery"))
            self.metadata, self.version = current, version
            return self._mark(now_ms)
        if self.phase is Phase.CLOSING:
            assert self._read_metadata is not None and self._closing is not None
            self._conflicts += 1
            if current.ensembles == self._read_metadata.ensembles and self._conflicts <= START_CONFLICTS_MAX:
                # Only the version moved (an older client re-marked it): the
                # ensembles we read from and rewrote to still stand.
                return [WriteMetadata(self._closing, version, MetadataPurpose.CLOSE)]
            # Still IN_RECOVERY but changed: another recoverer is rewriting
            # with other ensembles. Closing over its ensembles could point
            # readers at bookies that lack our rewrites: start over instead.
            return self._failed(MetadataVersionError(f"ledger {current.ledger_id} changed during recovery by another recoverer; recover again"))
        assert self.writer is not None
        return self._from_writer(self.writer.metadata_conflict(current, version, now_ms), now_ms)

    def metadata_failed(self, error: BKError) -> list[Action]:
        if self.phase in (Phase.MARKING, Phase.CLOSING) or self.writer is None:
            return self._failed(error)
        return self._from_writer(self.writer.metadata_failed(error), 0.0)

    # --- fencing ----------------------------------------------------------------------------

    def _start_fencing(self, now_ms: float) -> list[Action]:
        self.phase = Phase.FENCING
        self._read_metadata = self.metadata
        actions: list[Action] = []
        for bookie_id in self.metadata.last_ensemble[1]:
            self._fence_asked.add(bookie_id)
            actions.append(FenceRead(bookie_id))
        return actions

    @property
    def fence_coverage(self) -> int:
        """Fenced bookies needed: then at most AQ - 1 bookies of the last
        ensemble still accept the old writer, so it can never reach AQ."""
        return self.metadata.ensemble_size - self.metadata.ack_quorum + 1

    def fence_response(self, bookie_id: str, status: Status | None, last_add_confirmed: int, entry: bytes | None, now_ms: float) -> list[Action]:
        """The answer to a FenceRead; `status` None when no answer came
        (connection failed or timed out)."""
        if self.phase is not Phase.FENCING or bookie_id not in self._fence_asked:
            return []
        self._fence_asked.discard(bookie_id)
        if status is Status.UNAUTHORIZED:
            return self._failed(UnauthorizedError(f"bookie {bookie_id} refused the master key of ledger {self.metadata.ledger_id}"))
        if status is not Status.OK and status is not Status.NO_ENTRY:
            # No answer, or an error that leaves it unknown whether the fence
            # is durable there (IO_ERROR): ask again later.
            self._schedule_retry(bookie_id, -1, now_ms)
            return []
        self._retries.pop((bookie_id, -1), None)
        self._fenced.add(bookie_id)
        self._lac_seen = max(self._lac_seen, last_add_confirmed)
        if status is Status.OK and entry is not None:
            self._remember(entry)
        if len(self._fenced) < self.fence_coverage:
            return []
        return self._start_reading(now_ms)

    def _remember(self, entry: bytes) -> int | None:
        """Keep a verified copy of an entry; returns its id, or None if the
        copy is not intact."""
        try:
            decoded = self.digest.decode(entry)
        except (DigestMismatchError, EntryFormatError):
            return None
        self._known_entries[decoded.entry_id] = entry
        return decoded.entry_id

    # --- the start entry's length -------------------------------------------------------

    def _start_reading(self, now_ms: float) -> list[Action]:
        assert self._read_metadata is not None
        self._fence_asked.clear()
        self._retries.clear()
        last_key = self._read_metadata.last_ensemble[0]
        # An ensemble keyed at k exists because every entry before k was
        # acknowledged; if its bookies know no LAC, k - 1 is still confirmed.
        # Recovery never reads or rewrites anything before the last ensemble.
        self.start_entry_id = max(self._lac_seen, last_key - 1)
        if self.start_entry_id < 0 or self.start_entry_id in self._known_entries:
            return self._begin_rewrite(now_ms)
        self.phase = Phase.LENGTH
        self._decisions = {self.start_entry_id: _Decision(self.start_entry_id)}
        return self._ask(self._decisions[self.start_entry_id], now_ms, fence=False)

    def _begin_rewrite(self, now_ms: float) -> list[Action]:
        length = 0
        if self.start_entry_id >= 0:
            length = self.digest.decode(self._known_entries[self.start_entry_id]).total_length
        self.writer = WriteCore(
            self.metadata,
            self.version,
            self.digest,
            bookies=self.bookies,
            rng=self.rng,
            recovery=True,
            last_add_confirmed=self.start_entry_id,
            length=length,
            **self.write_options,
        )
        self.phase = Phase.READING
        self._decisions = {}
        self._next_to_decide = self._next_to_ask = self.start_entry_id + 1
        return self._fill_window(now_ms)

    # --- reading and deciding --------------------------------------------------------------

    def _fill_window(self, now_ms: float) -> list[Action]:
        actions: list[Action] = []
        while self.last_entry_id is None and self._next_to_ask < self._next_to_decide + self.read_window_entries:
            decision = self._decisions[self._next_to_ask] = _Decision(self._next_to_ask)
            self._next_to_ask += 1
            actions += self._ask(decision, now_ms, fence=True)
        return actions

    def _ask(self, decision: _Decision, now_ms: float, *, fence: bool) -> list[Action]:
        assert self._read_metadata is not None
        actions: list[Action] = []
        for bookie_id in self._read_metadata.write_set(decision.entry_id):
            if bookie_id in decision.positives or bookie_id in decision.negatives or bookie_id in decision.asked:
                continue
            if (bookie_id, decision.entry_id) in self._retries:
                continue
            decision.asked.add(bookie_id)
            actions.append(self._read_action(bookie_id, decision.entry_id, fence))
        return actions

    def read_response(self, bookie_id: str, entry_id: int, status: Status | None, entry: bytes | None, now_ms: float) -> list[Action]:
        """The answer to a RecoveryRead; `status` None when no answer came."""
        decision = self._decisions.get(entry_id)
        if decision is None or bookie_id not in decision.asked or self.phase not in (Phase.LENGTH, Phase.READING):
            return []
        decision.asked.discard(bookie_id)
        if status is Status.OK and entry is not None and self._verified(entry, entry_id):
            self._retries.pop((bookie_id, entry_id), None)
            decision.positives[bookie_id] = entry
        elif self._is_negative(status) and self.phase is Phase.READING:
            self._retries.pop((bookie_id, entry_id), None)
            decision.negatives.add(bookie_id)
        elif status is Status.UNAUTHORIZED:
            return self._failed(UnauthorizedError(f"bookie {bookie_id} refused the master key of ledger {self.metadata.ledger_id}"))
        else:
            # IO_ERROR, a digest mismatch, no answer, a busy bookie: neither
            # present nor absent. A corrupt replica must never truncate the
            # ledger, so it is asked again rather than counted (another
            # bookie's intact copy may settle the entry first). (While
            # reading the start entry for its length, which is known to be
            # acknowledged, NO_ENTRY is retried too.)
            self._schedule_retry(bookie_id, entry_id, now_ms)
        if self.phase is Phase.LENGTH:
            if decision.positives:
                self._known_entries[entry_id] = next(iter(decision.positives.values()))
                return self._begin_rewrite(now_ms)
            return []
        return self._decide(now_ms)

    def _read_action(self, bookie_id: str, entry_id: int, fence: bool) -> RecoveryRead:
        return RecoveryRead(bookie_id, entry_id, fence)

    @staticmethod
    def _is_negative(status: Status | None) -> bool:
        """Only "no such entry/ledger" says an entry is absent: an IO_ERROR
        (a corrupt replica) or no answer says nothing."""
        return status in NEGATIVE

    def _verified(self, entry: bytes, entry_id: int) -> bool:
        try:
            self.digest.decode(entry, expected_entry_id=entry_id)
        except (DigestMismatchError, EntryFormatError):
            return False
        return True

    def _decide(self, now_ms: float) -> list[Action]:
        """Settle entries in order from the first undecided one: present
        ones go to the rewriter, the first absent one ends the ledger.

        One intact copy makes an entry present, as in BookKeeper: it may
        never have been acknowledged, but keeping it breaks nothing (it lies
        beyond every LAC a reader was given, and it is rewritten to an ack
        quorum before the close). Waiting for AQ copies would leave a
        WQ = AQ ledger undecidable while one bookie of a write set is down.
        Absent needs WQ - AQ + 1 bookies of the write set to say so
        themselves: then at most AQ - 1 hold it, so it never completed."""
        assert self.writer is not None and self._read_metadata is not None
        negatives_needed = self._read_metadata.write_quorum - self._read_metadata.ack_quorum + 1
        actions: list[Action] = []
        while self.last_entry_id is None:
            decision = self._decisions.get(self._next_to_decide)
            if decision is None:
                break
            if decision.positives:
                if self.writer.error is not None:
                    return actions + self._failed(self.writer.error)
                entry = next(iter(decision.positives.values()))
                del self._decisions[decision.entry_id]
                self._drop_retries(decision.entry_id)
                self._next_to_decide += 1
                actions += self._from_writer(self.writer.add_encoded(decision.entry_id, entry, now_ms), now_ms)
                if self.phase is not Phase.READING:
                    return actions
            elif len(decision.negatives) >= negatives_needed:
                # Absent: it never reached AQ, so neither did anything after
                # it (completions are in order); the ledger ends before it.
                self.last_entry_id = decision.entry_id - 1
                self._decisions.clear()
                self._retries.clear()
            else:
                break
        if self.last_entry_id is None:
            return actions + self._fill_window(now_ms)
        return actions + self._maybe_close(now_ms)

    # --- retries ---------------------------------------------------------------------------------

    def _schedule_retry(self, bookie_id: str, entry_id: int, now_ms: float) -> None:
        previous = self._retries.get((bookie_id, entry_id))
        delay_ms = RETRY_DELAY_MS_MIN if previous is None else min(previous.delay_ms * 2, RETRY_DELAY_MS_MAX)
        self._retries[(bookie_id, entry_id)] = _Retry(now_ms + delay_ms, delay_ms)

    def _drop_retries(self, entry_id: int) -> None:
        """A decided entry's other bookies need not be asked again."""
        for key in [key for key in self._retries if key[1] == entry_id]:
            del self._retries[key]

    def next_deadline_ms(self) -> float | None:
        # A retry whose question is out waits for the answer, not a time.
        deadlines = [retry.due_ms for retry in self._retries.values() if retry.due_ms != math.inf]
        if self.writer is not None and self.phase is Phase.READING:
            writer_deadline = self.writer.next_deadline_ms()
            if writer_deadline is not None:
                deadlines.append(writer_deadline)
        return min(deadlines) if deadlines else None

    def tick(self, now_ms: float) -> list[Action]:
        actions: list[Action] = []
        due = [key for key, retry in self._retries.items() if retry.due_ms <= now_ms]
        for bookie_id, entry_id in sorted(due, key=lambda key: (key[1], key[0])):
            # The retry stays (not due) while the question is out, so that
            # another unknown answer backs off further; a real answer drops it.
            if entry_id == -1 and self.phase is Phase.FENCING:
                self._retries[(bookie_id, entry_id)].due_ms = math.inf
                self._fence_asked.add(bookie_id)
                actions.append(FenceRead(bookie_id))
            elif entry_id in self._decisions:
                self._retries[(bookie_id, entry_id)].due_ms = math.inf
                self._decisions[entry_id].asked.add(bookie_id)
                actions.append(self._read_action(bookie_id, entry_id, self.phase is Phase.READING))
            else:
                del self._retries[(bookie_id, entry_id)]  # settled meanwhile
        if self.writer is not None and self.phase is Phase.READING:
            actions += self._from_writer(self.writer.tick(now_ms), now_ms)
        return actions

    # --- the rewriter ---------------------------------------------------------------------------

    def add_response(self, bookie_id: str, entry_id: int, status: Status | None, now_ms: float) -> list[Action]:
        """The answer to a RECOVERY_ADD the rewriter sent."""
        if self.writer is None or self.phase is not Phase.READING:
            return []
        if status is None:
            return self._from_writer(self.writer.bookie_failed(bookie_id, now_ms), now_ms)
        return self._from_writer(self.writer.bookie_responded(bookie_id, entry_id, status, now_ms), now_ms)

    def bookies_changed(self, bookies: Mapping[str, str | None]) -> None:
        self.bookies = dict(bookies)
        if self.writer is not None:
            self.writer.bookies_changed(bookies)

    def _from_writer(self, writer_actions: list, now_ms: float) -> list[Action]:
        """Pass the rewriter's sends on; act on its completions and failures;
        keep its ensemble changes to itself (below)."""
        actions: list[Action] = []
        writer_actions = list(writer_actions)
        for action in writer_actions:  # grows while ensemble changes are taken
            kind = type(action)
            if kind is WriteMetadata and action.purpose is MetadataPurpose.ENSEMBLE_CHANGE:
                # A replacement is not written to the metadata until the close
                # (which carries the rewriter's ensembles): were it written
                # now and this recoverer died, the next one would read entries
                # not yet rewritten from the new ensemble, miss the copies on
                # the replaced bookie and could cut off an acknowledged entry.
                # BookKeeper's recovery keeps them local the same way
                # (apache/bookkeeper#1621). The version stays the one the
                # close must expect.
                assert self.writer is not None
                writer_actions += self.writer.metadata_written(self.writer.version, now_ms)
            elif kind is SendAdd or kind is WriteMetadata:
                actions.append(action)
            elif kind is AddsCompleted:
                pass  # progress shows in writer.last_add_confirmed
            elif kind is AddsFailed or kind is CloseFailed:
                return actions + self._failed(action.error)
            elif kind is Closed:
                raise AssertionError("the recoverer closes the ledger itself")
            else:
                raise AssertionError(f"unknown writer action {action!r}")
        if self.writer is not None and self.writer.error is not None:
            # The rewriter broke with nothing pending (a late UNAUTHORIZED, or
            # a late failure it cannot replace): it reports no AddsFailed,
            # and it can never close, so recovery fails here.
            return actions + self._failed(self.writer.error)
        if self.phase is Phase.READING and self.last_entry_id is not None:
            actions += self._maybe_close(now_ms)
        return actions

    # --- closing ------------------------------------------------------------------------------

    def _maybe_close(self, now_ms: float) -> list[Action]:
        assert self.writer is not None and self.last_entry_id is not None
        writer = self.writer
        if self.phase is not Phase.READING or writer.pending_count or writer.error is not None or writer.changing_ensemble:
            return []
        assert writer.last_add_confirmed == self.last_entry_id, (writer.last_add_confirmed, self.last_entry_id)
        self.phase = Phase.CLOSING
        self._closing = writer.metadata.with_closed(self.last_entry_id, writer.length)
        return [WriteMetadata(self._closing, writer.version, MetadataPurpose.CLOSE)]

    # --- the end ---------------------------------------------------------------------------------

    def _done(self, metadata: LedgerMetadata, version: int) -> list[Action]:
        self.phase = Phase.DONE
        self._retries.clear()
        self.result = RecoveryDone(metadata, version)
        return [self.result]

    def _failed(self, error: BKError) -> list[Action]:
        if self.phase in (Phase.DONE, Phase.FAILED):
            return []
        self.phase = Phase.FAILED
        self._retries.clear()
        self.result = RecoveryFailed(error)
        return [self.result]


__all__ = [
    "Action",
    "FenceRead",
    "Phase",
    "RecoveryCore",
    "RecoveryDone",
    "RecoveryFailed",
    "RecoveryRead",
]
