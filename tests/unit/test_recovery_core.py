"""Ledger recovery as a pure core: fencing coverage, the
present / absent / ask-again rule for each entry (present at one intact copy,
absent at WQ - AQ + 1 NO_ENTRY/NO_LEDGER answers), the rewrite with
RECOVERY_ADD, and the close by compare-and-set. A small model of bookies and of
the metadata store answers the core's actions; scenario tests first, then
random scenarios (hypothesis)."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from bookie.protocol.entry_format import HEADER_BYTES, DigestManager, DigestType, parse_header
from bookie.protocol.wire import Status
from ledger_client.errors import MetadataVersionError, NotEnoughBookiesError, UnauthorizedError
from ledger_client.metadata import LedgerMetadata, LedgerState, password_hash
from ledger_client.recovery_core import (
    RETRY_DELAY_MS_MAX,
    RETRY_DELAY_MS_MIN,
    START_CONFLICTS_MAX,
    FenceRead,
    Phase,
    RecoveryCore,
    RecoveryDone,
    RecoveryFailed,
    RecoveryRead,
)
from ledger_client.write_core import MetadataPurpose, SendAdd, WriteMetadata

LEDGER_ID = 7
PASSWORD = b"pw"
DIGEST = DigestManager(LEDGER_ID, DigestType.CRC32C, PASSWORD)
NEGATIVE = (Status.NO_ENTRY, Status.NO_LEDGER)

# Faults a test can inject in place of a bookie's own answer (besides any
# `Status`): LOST means the core sees no answer at all, BAD_DIGEST that the
# entry came back with damaged bytes.
LOST = "lost"
BAD_DIGEST = "bad digest"


def damaged(entry: bytes) -> bytes:
    """The entry with the low byte of its total length flipped: the header
    still parses (a bookie indexes it and knows its LAC) but the digest no
    longer matches, and a recoverer that trusted it would close with a wrong
    length."""
    last = HEADER_BYTES - 1
    return entry[:last] + bytes([entry[last] ^ 0xFF]) + entry[last + 1 :]


def garbled_in_transit(entry: bytes) -> bytes:
    """The entry with the first byte of its digest flipped (a BAD_DIGEST
    fault): never intact, even when the stored copy was already `damaged`
    (damaging it the same way twice would give the intact bytes back)."""
    return entry[:HEADER_BYTES] + bytes([entry[HEADER_BYTES] ^ 0xFF]) + entry[HEADER_BYTES + 1 :]


# --- the model of the bookies -----------------------------------------------------


@dataclass
class ModelBookie:
    """What one bookie holds of the ledger, answering like
    `bookie/request_core.py`: a fencing read of the LAC fences first, then
    answers the LAC entry (or NO_ENTRY) with the LAC; a stored entry that
    cannot be read back intact is IO_ERROR, never NO_ENTRY; RECOVERY_ADD is
    taken on a fenced ledger, a normal ADD is not."""

    entries: dict[int, bytes] = field(default_factory=dict)
    unreadable: set[int] = field(default_factory=set)  # stored, but fail their checksum on disk
    fenced: bool = False
    known: bool = False  # has seen the ledger (an add or a fence)
    unauthorized: bool = False  # knows the ledger under another master key
    read_only: bool = False  # disk full: refuses adds, still reads and fences

    @property
    def last_add_confirmed(self) -> int:
        return max((parse_header(entry).last_add_confirmed for entry in self.entries.values()), default=-1)

    def fence_read(self) -> tuple[Status, int, bytes | None]:
        if self.unauthorized:
            return Status.UNAUTHORIZED, -1, None
        self.fenced = self.known = True
        lac = self.last_add_confirmed
        if lac < 0:
            return Status.NO_ENTRY, lac, None
        status, entry = self._read(lac)
        return status, lac, entry

    def read(self, entry_id: int, fence: bool) -> tuple[Status, bytes | None]:
        if self.unauthorized:
            return Status.UNAUTHORIZED, None
        if fence:
            self.fenced = self.known = True
        if not self.known:
            return Status.NO_LEDGER, None
        return self._read(entry_id)

    def _read(self, entry_id: int) -> tuple[Status, bytes | None]:
        if entry_id in self.unreadable:
            return Status.IO_ERROR, None
        if entry_id in self.entries:
            return Status.OK, self.entries[entry_id]
        return Status.NO_ENTRY, None

    def add(self, entry_id: int, entry: bytes, *, recovery: bool) -> Status:
        if self.unauthorized:
            return Status.UNAUTHORIZED
        if self.read_only:
            return Status.READ_ONLY
        if self.fenced and not recovery:
            return Status.FENCED
        self.known = True
        self.entries[entry_id] = entry
        self.unreadable.discard(entry_id)  # a new copy replaces a damaged one
        return Status.OK

    def holds_intact(self, entry_id: int, entry: bytes) -> bool:
        return entry_id not in self.unreadable and self.entries.get(entry_id) == entry


@dataclass
class ModelMetadataStore:
    """One versioned value changed only by compare-and-set."""

    value: LedgerMetadata
    version: int = 0

    def compare_and_set(self, proposed: LedgerMetadata, expected_version: int) -> bool:
        if expected_version != self.version:
            return False
        self.value, self.version = proposed, self.version + 1
        return True

    def replace(self, value: LedgerMetadata) -> None:
        """Someone else (the old writer, another recoverer) changed it."""
        self.value, self.version = value, self.version + 1


def make_metadata(ensemble_size: int, write_quorum: int, ack_quorum: int, ensembles) -> LedgerMetadata:
    return LedgerMetadata(
        ledger_id=LEDGER_ID,
        ensemble_size=ensemble_size,
        write_quorum=write_quorum,
        ack_quorum=ack_quorum,
        ensembles=tuple((first, tuple(bookies)) for first, bookies in ensembles),
        digest_type=DigestType.CRC32C,
        password_hash=password_hash(PASSWORD),
        creation_time_ms=0,
    )


class Cluster:
    """Bookies b0, b1, ... (the first ensemble, then `spares` more), the
    metadata store, and what the old writer sent before it crashed."""

    def __init__(self, ensemble_size=3, write_quorum=3, ack_quorum=2, *, spares=0, ensembles=None) -> None:
        ensembles = ensembles or [(0, [f"b{index}" for index in range(ensemble_size)])]
        self.store = ModelMetadataStore(make_metadata(ensemble_size, write_quorum, ack_quorum, ensembles))
        self.bookies: dict[str, ModelBookie] = {}
        for bookie_id in sorted(self.store.value.all_bookies(), key=lambda name: int(name[1:])):
            self.bookies[bookie_id] = ModelBookie()
        for _ in range(spares):
            self.new_bookie()
        self.written: list[bytes] = []  # entry id -> the bytes the old writer sent
        self.lengths: list[int] = []  # entry id -> total length up to it

    def new_bookie(self) -> str:
        bookie_id = f"b{1 + max(int(name[1:]) for name in self.bookies)}"
        self.bookies[bookie_id] = ModelBookie()
        return bookie_id

    @property
    def metadata(self) -> LedgerMetadata:
        return self.store.value

    # --- the old writer ---------------------------------------------------------

    def write(self, payload: bytes | None = None, *, holders=None, lac: int | None = None) -> int:
        """The old writer sends its next entry, carrying `lac` (default: the
        previous entry, as when each add completes before the next is sent);
        it reaches `holders` (default: its whole write set)."""
        entry_id = len(self.written)
        payload = b"entry-%d" % entry_id if payload is None else payload
        total_length = (self.lengths[-1] if self.lengths else 0) + len(payload)
        entry = DIGEST.encode(entry_id, entry_id - 1 if lac is None else lac, total_length, payload)
        write_set = self.metadata.write_set(entry_id)
        holders = write_set if holders is None else holders
        for bookie_id in holders:
            assert bookie_id in write_set, (bookie_id, entry_id, write_set)
            self.bookies[bookie_id].entries[entry_id] = entry
            self.bookies[bookie_id].known = True
        self.written.append(entry)
        self.lengths.append(total_length)
        return entry_id

    def write_quorum_prefix(self, count: int) -> None:
        """Entries the old writer saw acknowledged, each on exactly AQ
        bookies of its write set (the first ones)."""
        for _ in range(count):
            self.write(holders=self.metadata.write_set(len(self.written))[: self.metadata.ack_quorum])

    def change_ensemble(self, first_entry_id: int, replacements: dict[int, str]) -> None:
        """The old writer replaced bookies (position -> new bookie) from
        `first_entry_id` on."""
        bookies = list(self.metadata.last_ensemble[1])
        for index, bookie_id in replacements.items():
            self.bookies.setdefault(bookie_id, ModelBookie())
            bookies[index] = bookie_id
        self.store.replace(self.metadata.with_ensemble(first_entry_id, bookies))

    def corrupt(self, bookie_id: str, entry_id: int, kind: str) -> None:
        """Damage a stored replica: 'io' fails its checksum on the bookie
        (IO_ERROR), 'digest' returns bytes whose digest does not match."""
        bookie = self.bookies[bookie_id]
        assert entry_id in bookie.entries
        if kind == "io":
            bookie.unreadable.add(entry_id)
        else:
            bookie.entries[entry_id] = damaged(bookie.entries[entry_id])

    def restore(self, bookie_id: str, entry_id: int) -> None:
        """The operator replaces a damaged replica with the bytes the old
        writer sent."""
        bookie = self.bookies[bookie_id]
        bookie.unreadable.discard(entry_id)
        bookie.entries[entry_id] = self.written[entry_id]

    # --- checks -------------------------------------------------------------------

    def fence_blocked(self, bookie_id: str) -> bool:
        """The bookie's own LAC entry is unreadable: a fencing read fences it
        but answers IO_ERROR, which recovery never counts as fenced (it may
        mean the fence is not durable), so its fence can never be confirmed."""
        bookie = self.bookies[bookie_id]
        return bookie.last_add_confirmed in bookie.unreadable

    def intact_copies(self, metadata: LedgerMetadata, entry_id: int) -> list[str]:
        """Bookies of the entry's write set (in `metadata`) that return the
        bytes the old writer sent."""
        entry = self.written[entry_id]
        return [bookie for bookie in metadata.write_set(entry_id) if self.bookies[bookie].holds_intact(entry_id, entry)]

    def length_up_to(self, entry_id: int) -> int:
        return self.lengths[entry_id] if entry_id >= 0 else 0

    def recovery_core(self, *, seed: int = 0, down=(), **options) -> RecoveryCore:
        """A recoverer of the ledger as the store holds it now; the registry
        it picks replacements from lists every bookie not `down`."""
        return RecoveryCore(
            self.store.value,
            self.store.version,
            DIGEST,
            bookies={bookie_id: None for bookie_id in self.bookies if bookie_id not in down},
            rng=random.Random(seed),
            **options,
        )


# --- the driver -------------------------------------------------------------------------


@dataclass
class ReadAnswer:
    bookie_id: str
    entry_id: int
    status: Status | None  # as the core saw it
    genuine_negative: bool  # the bookie itself answered NO_ENTRY / NO_LEDGER


class Driver:
    """Carries the core's actions out against the model. Requests wait in
    flight until answered (oldest first, or in an order `choose` picks);
    with nothing in flight, time passes to the core's next deadline.
    `fault(action)` may replace a bookie's own answer (LOST, BAD_DIGEST or a
    Status); `down` bookies never answer; `before_cas(write, store)` lets a
    concurrent client change the metadata first."""

    def __init__(
        self,
        cluster: Cluster,
        core: RecoveryCore,
        *,
        choose: Callable[[list], int] | None = None,
        fault: Callable[[object], object] | None = None,
        before_cas: Callable[[WriteMetadata, ModelMetadataStore], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.core = core
        self.choose = choose
        self.fault = fault
        self.before_cas = before_cas
        self.down: set[str] = set()
        self.now_ms = 0.0
        self.in_flight: list = []
        self.log: list[tuple[float, object]] = []  # (time, action) for every action the core returned
        self.reads: list[ReadAnswer] = []
        self.fence_lacs: list[int] = []  # LACs of fencing answers fed while the core was fencing
        self.metadata_writes: list[tuple[WriteMetadata, bool]] = []  # (write, succeeded)
        self.result: RecoveryDone | RecoveryFailed | None = None

    # --- running ------------------------------------------------------------------------

    def start(self) -> None:
        self.feed(self.core.start(self.now_ms))

    def run(self, steps_max: int = 5_000) -> RecoveryDone | RecoveryFailed | None:
        """Step until the core reports its result, nothing can happen any
        more, or `steps_max` steps passed; returns the result (None if none)."""
        if not self.log:
            self.start()
        for _ in range(steps_max):
            if self.result is not None or not self.step():
                break
        return self.result

    def step(self) -> bool:
        if self.in_flight:
            index = self.choose(self.in_flight) if self.choose else 0
            self.feed(self.answer(self.in_flight.pop(index)))
            return True
        deadline = self.core.next_deadline_ms()
        if deadline is None:
            return False
        assert math.isfinite(deadline), "a deadline with nothing in flight must be finite"
        self.now_ms = max(self.now_ms, deadline)
        self.feed(self.core.tick(self.now_ms))
        return True

    def feed(self, actions: list) -> None:
        for action in actions:
            self.log.append((self.now_ms, action))
            if isinstance(action, (RecoveryDone, RecoveryFailed)):
                assert self.result is None, f"a second result {action!r} after {self.result!r}"
                self.result = action
            else:
                assert isinstance(action, (FenceRead, RecoveryRead, SendAdd, WriteMetadata)), action
                self.in_flight.append(action)

    def drain_bookie_answers(self) -> None:
        """After the end: every late bookie answer changes nothing."""
        assert self.result is not None
        for action in [action for action in self.in_flight if not isinstance(action, WriteMetadata)]:
            self.in_flight.remove(action)
            assert self.answer(action) == [], f"late answer to {action!r} produced actions"

    # --- answers ----------------------------------------------------------------------------

    def answer(self, action) -> list:
        if isinstance(action, WriteMetadata):
            return self._write_metadata(action)
        bookie = self.cluster.bookies[action.bookie_id]
        fault = LOST if action.bookie_id in self.down else (self.fault(action) if self.fault else None)
        # A LOST answer from a live bookie: the request arrived, the answer did not.
        reached = action.bookie_id not in self.down and fault in (None, LOST, BAD_DIGEST)
        if isinstance(action, FenceRead):
            status, lac, entry = bookie.fence_read() if reached else (None, -1, None)
            if fault is not None and fault != BAD_DIGEST:
                status, lac, entry = (None if fault == LOST else fault), -1, None
            elif fault == BAD_DIGEST and entry is not None:
                entry = garbled_in_transit(entry)
            if self.core.phase is Phase.FENCING and status in (Status.OK, Status.NO_ENTRY):
                self.fence_lacs.append(lac)
            return self.core.fence_response(action.bookie_id, status, lac, entry, self.now_ms)
        if isinstance(action, RecoveryRead):
            status, entry = bookie.read(action.entry_id, action.fence) if reached else (None, None)
            genuine_negative = fault in (None, BAD_DIGEST) and status in NEGATIVE
            if fault is not None and fault != BAD_DIGEST:
                status, entry = (None if fault == LOST else fault), None
            elif fault == BAD_DIGEST and entry is not None:
                entry = garbled_in_transit(entry)
            self.reads.append(ReadAnswer(action.bookie_id, action.entry_id, status, genuine_negative))
            return self.core.read_response(action.bookie_id, action.entry_id, status, entry, self.now_ms)
        assert isinstance(action, SendAdd)
        assert action.recovery, "a recoverer rewrites with RECOVERY_ADD only"
        if fault is None:
            status = bookie.add(action.entry_id, action.entry, recovery=action.recovery)
        else:
            status = None if fault == LOST else fault
        return self.core.add_response(action.bookie_id, action.entry_id, status, self.now_ms)

    def _write_metadata(self, write: WriteMetadata) -> list:
        store = self.cluster.store
        if self.before_cas is not None:
            self.before_cas(write, store)
        succeeded = store.compare_and_set(write.metadata, write.expected_version)
        self.metadata_writes.append((write, succeeded))
        if succeeded:
            return self.core.metadata_written(store.version, self.now_ms)
        return self.core.metadata_conflict(store.value, store.version, self.now_ms)

    # --- what happened ----------------------------------------------------------------------

    def sent(self, kind) -> list:
        return [action for _, action in self.log if isinstance(action, kind)]

    def purposes(self) -> list[MetadataPurpose]:
        return [write.purpose for write, _ in self.metadata_writes]

    def times_sent(self, predicate) -> list[float]:
        return [now_ms for now_ms, action in self.log if predicate(action)]


def closed_at(driver: Driver) -> LedgerMetadata:
    """The run ended with the ledger closed, by this recoverer, in the store."""
    assert isinstance(driver.result, RecoveryDone), driver.result
    metadata = driver.result.metadata
    assert metadata.state is LedgerState.CLOSED
    assert (metadata, driver.result.version) == (driver.cluster.store.value, driver.cluster.store.version)
    return metadata


def assert_recovered(driver: Driver, last_entry_id: int, copies_before: dict[int, int] | None = None) -> LedgerMetadata:
    """Closed at `last_entry_id` with the right length; every entry up to it
    is intact on AQ bookies of its write set in the closed metadata. With
    `copies_before` (entry -> intact copies before recovery), an entry up to
    the start entry, which recovery does not rewrite, need only keep as many
    as it had, up to AQ."""
    cluster = driver.cluster
    metadata = closed_at(driver)
    assert metadata.last_entry_id == last_entry_id
    assert metadata.length == cluster.length_up_to(last_entry_id)
    assert_copies(cluster, metadata, driver.core.start_entry_id, copies_before)
    # No ensemble keyed after the last entry survives the close.
    assert all(first == 0 or first <= last_entry_id for first in metadata.ensemble_keys)
    return metadata


def assert_copies(cluster: Cluster, metadata: LedgerMetadata, start_entry_id: int, copies_before: dict[int, int] | None) -> None:
    for entry_id in range(metadata.last_entry_id + 1):
        copies = cluster.intact_copies(metadata, entry_id)
        needed = metadata.ack_quorum
        if copies_before is not None and entry_id <= start_entry_id:
            needed = min(needed, copies_before[entry_id])
        assert len(copies) >= needed, (entry_id, copies, metadata.ensembles)


def assert_reads_fenced(driver: Driver) -> None:
    """Every read of an entry being recovered carries the fence flag; the only
    other read is of the start entry, for its length."""
    start = driver.core.start_entry_id
    for action in driver.sent(RecoveryRead):
        if action.entry_id > start:
            assert action.fence, action
        else:
            assert action.entry_id == start and not action.fence, (action, start)


def assert_old_writer_locked_out(driver: Driver, fenced_ensemble) -> None:
    """At most AQ - 1 bookies of the ensemble the old writer used still take
    its normal adds: it can never complete another add."""
    cluster = driver.cluster
    open_bookies = [bookie for bookie in fenced_ensemble if not cluster.bookies[bookie].fenced]
    assert len(open_bookies) <= cluster.metadata.ack_quorum - 1, open_bookies


def answer_last(*deferred) -> Callable[[list], int]:
    """Answer requests oldest first, except `deferred` ones, which wait until
    nothing else is in flight."""
    return lambda in_flight: next((index for index, action in enumerate(in_flight) if action not in deferred), 0)


def adds_first(last_bookie: str | None = None) -> Callable[[list], int]:
    """Answer rewrites before anything else, those to `last_bookie` last."""

    def choose(in_flight: list) -> int:
        adds = [index for index, action in enumerate(in_flight) if isinstance(action, SendAdd)]
        if not adds:
            return 0
        others = [index for index in adds if in_flight[index].bookie_id != last_bookie]
        return (others or adds)[0]

    return choose


QUORUMS = [pytest.param((3, 3, 2), id="E3-WQ3-AQ2"), pytest.param((5, 3, 2), id="E5-WQ3-AQ2")]


# --- the crashed writer ------------------------------------------------------------------


@pytest.mark.parametrize("quorums", QUORUMS)
def test_an_entry_that_reached_one_bookie_is_dropped_when_the_bookies_without_it_answer_first(quorums):
    # The writer saw entries 0..9 acknowledged (each on exactly AQ bookies),
    # sent entry 10 to a single bookie and crashed. The other WQ - AQ + 1 = 2
    # bookies of entry 10's write set answer "no entry" before the one that
    # holds it: entry 10 is absent and the ledger closes at exactly 9, never
    # below.
    cluster = Cluster(*quorums)
    cluster.write_quorum_prefix(10)
    holder = cluster.metadata.write_set(10)[0]
    cluster.write(holders=[holder])
    fenced_ensemble = cluster.metadata.last_ensemble[1]
    driver = Driver(cluster, cluster.recovery_core(), choose=answer_last(RecoveryRead(holder, 10, True)))
    driver.run()
    metadata = assert_recovered(driver, 9)
    assert driver.purposes() == [MetadataPurpose.START_RECOVERY, MetadataPurpose.CLOSE]
    assert metadata.ensembles == cluster.metadata.ensembles and len(metadata.ensembles) == 1
    assert_reads_fenced(driver)
    assert_old_writer_locked_out(driver, fenced_ensemble)
    # Only the last ensemble was fenced, each bookie asked once.
    assert sorted(action.bookie_id for action in driver.sent(FenceRead)) == sorted(fenced_ensemble)
    assert driver.core.next_deadline_ms() is None


@pytest.mark.parametrize("quorums", QUORUMS)
def test_an_entry_that_reached_one_bookie_is_kept_when_its_copy_answers_first(quorums):
    # As above, but the bookie holding entry 10 answers first: one intact
    # copy makes it present (as in BookKeeper). It was never acknowledged,
    # and keeping it is allowed: it is rewritten to its write set and the
    # ledger closes at 10.
    cluster = Cluster(*quorums)
    cluster.write_quorum_prefix(10)
    holder = cluster.metadata.write_set(10)[0]
    cluster.write(holders=[holder])
    driver = Driver(cluster, cluster.recovery_core())
    driver.run()
    metadata = assert_recovered(driver, 10)
    assert len(cluster.intact_copies(metadata, 10)) >= metadata.ack_quorum
    assert 10 in {action.entry_id for action in driver.sent(SendAdd)}
    assert_reads_fenced(driver)


@pytest.mark.parametrize("quorums", QUORUMS)
def test_an_entry_that_reached_the_ack_quorum_is_kept_though_never_acknowledged(quorums):
    # The writer crashed before hearing back about entry 10, but AQ bookies
    # stored it: recovery finds it and closes at 10, with entry 10 rewritten
    # to its whole write set.
    cluster = Cluster(*quorums)
    cluster.write_quorum_prefix(10)
    cluster.write(holders=cluster.metadata.write_set(10)[:2])
    driver = Driver(cluster, cluster.recovery_core())
    driver.run()
    metadata = assert_recovered(driver, 10)
    assert len(cluster.intact_copies(metadata, 10)) >= 2
    rewritten = {action.entry_id for action in driver.sent(SendAdd)}
    assert 10 in rewritten and all(entry_id > driver.core.start_entry_id for entry_id in rewritten)
    assert_reads_fenced(driver)


def test_pipelined_entries_that_all_reached_the_quorum_are_kept_up_to_the_first_gap():
    # Entries 0..7 were in flight together (each carrying LAC -1); 0..5
    # reached all bookies, 6 reached none, 7 reached all. The writer saw
    # nothing acknowledged. Recovery keeps 0..5 and stops at the gap: entry 7
    # can never have been acknowledged since completions are in order.
    cluster = Cluster(3, 3, 2)
    for _ in range(6):
        cluster.write(lac=-1)
    cluster.write(lac=-1, holders=[])
    cluster.write(lac=-1)
    driver = Driver(cluster, cluster.recovery_core())
    driver.run()
    assert_recovered(driver, 5)
    # All bookies report LAC -1, so reading starts at entry 0.
    assert driver.core.start_entry_id == -1
    assert_reads_fenced(driver)


# --- empty and closed ledgers -------------------------------------------------------------


@pytest.mark.parametrize("quorums", QUORUMS)
def test_an_empty_ledger_closes_at_minus_one_with_length_zero(quorums):
    # The writer created the ledger and crashed before its first add.
    cluster = Cluster(*quorums)
    driver = Driver(cluster, cluster.recovery_core())
    driver.run()
    metadata = assert_recovered(driver, -1)
    assert metadata.length == 0
    assert {action.entry_id for action in driver.sent(RecoveryRead)} >= {0}
    assert driver.sent(SendAdd) == []
    assert_reads_fenced(driver)


def test_a_closed_ledger_is_returned_as_is_without_any_metadata_write():
    # Someone already closed the ledger: nothing to fence, read or write.
    cluster = Cluster(3, 3, 2)
    cluster.write_quorum_prefix(5)
    cluster.store.replace(cluster.metadata.with_closed(4, cluster.length_up_to(4)))
    closed, version = cluster.metadata, cluster.store.version
    core = cluster.recovery_core()
    assert core.start(0) == [RecoveryDone(closed, version)]
    assert core.next_deadline_ms() is None
    assert not any(bookie.fenced for bookie in cluster.bookies.values())


def test_a_ledger_left_in_recovery_by_a_dead_recoverer_is_recovered_again():
    # A recoverer marked the ledger IN_RECOVERY and died; the next one does
    # not mark it again (that would only bump the version under any other
    # recoverer's close), fences and finishes the job.
    cluster = Cluster(3, 3, 2)
    cluster.write_quorum_prefix(4)
    cluster.store.replace(cluster.metadata.with_recovery_started())
    driver = Driver(cluster, cluster.recovery_core())
    driver.run()
    assert_recovered(driver, 3)
    assert driver.purposes() == [MetadataPurpose.CLOSE]


# --- one intact copy decides -----------------------------------------------------------------


@pytest.mark.parametrize(
    "quorums, down",
    [
        pytest.param((3, 3, 2), ["b1"], id="E3-WQ3-AQ2-one-down"),
        pytest.param((3, 3, 3), ["b1", "b2"], id="E3-WQ3-AQ3-two-down"),
    ],
)
def test_one_intact_copy_with_the_other_bookies_down_makes_an_entry_present(quorums, down):
    # Entries 0..9 reached every bookie; entry 10 was acknowledged by AQ
    # bookies, b0 among them, and the writer crashed. Then the others went
    # down for good: b0 holds the only copy that answers, and fencing still
    # reaches its coverage (E - AQ + 1 bookies). That one intact copy makes
    # entry 10 present; entry 11 is absent at WQ - AQ + 1 "no entry"
    # answers from the bookies left. The rewrite replaces the bookies down.
    ack_quorum = quorums[2]
    cluster = Cluster(*quorums, spares=len(down))
    for _ in range(10):
        cluster.write()
    cluster.write(holders=["b0", "b1", "b2"][:ack_quorum])
    driver = Driver(cluster, cluster.recovery_core(down=down))
    driver.down.update(down)
    driver.run()
    metadata = assert_recovered(driver, 10)
    assert not set(down) & set(metadata.last_ensemble[1])
    positives = [answer for answer in driver.reads if answer.entry_id == 10 and answer.status is Status.OK]
    assert [answer.bookie_id for answer in positives] == ["b0"]
    assert_reads_fenced(driver)


@pytest.mark.parametrize("quorums", [pytest.param((3, 2, 2), id="E3-WQ2-AQ2"), pytest.param((2, 2, 2), id="E2-WQ2-AQ2")])
def test_a_write_quorum_equal_to_the_ack_quorum_ledger_closes_with_a_bookie_down(quorums):
    # WQ = AQ: every acknowledged entry is on its whole write set. b1 died
    # with the writer; each entry of a write set with b1 in it has one copy
    # left. Fencing needs E - AQ + 1 = E - 1 bookies, absent needs
    # WQ - AQ + 1 = 1 "no entry": the ledger closes at its last entry, with
    # b1 replaced for the rewrite.
    cluster = Cluster(*quorums, spares=1)
    cluster.write_quorum_prefix(10)
    assert any("b1" in cluster.metadata.write_set(entry_id) for entry_id in range(10))
    driver = Driver(cluster, cluster.recovery_core(down=["b1"]))
    driver.down.add("b1")
    driver.run()
    metadata = assert_recovered(driver, 9)
    assert "b1" not in metadata.last_ensemble[1]
    assert_reads_fenced(driver)


def test_io_errors_are_never_counted_as_absent_however_many():
    # Hand-written events. E=3 WQ=3 AQ=2: absent needs two "no entry"
    # answers. Every bookie answers IO_ERROR for entry 0, again and again:
    # recovery asks again each time (later and later) and never decides.
    # One NO_ENTRY is not enough either; the second one ends the ledger.
    cluster = Cluster(3, 3, 2)
    core = cluster.recovery_core(read_window_entries=1)
    [mark] = core.start(0)
    assert cluster.store.compare_and_set(mark.metadata, mark.expected_version)
    core.metadata_written(cluster.store.version, 0)
    core.fence_response("b0", Status.NO_ENTRY, -1, None, 0)
    assert core.fence_response("b1", Status.NO_ENTRY, -1, None, 0) == [RecoveryRead(bookie, 0, True) for bookie in ("b0", "b1", "b2")]
    now_ms = 0.0
    for _ in range(8):
        for bookie_id in ("b0", "b1", "b2"):
            assert core.read_response(bookie_id, 0, Status.IO_ERROR, None, now_ms) == []
        now_ms = core.next_deadline_ms()
        assert core.tick(now_ms) == [RecoveryRead(bookie, 0, True) for bookie in ("b0", "b1", "b2")]
    assert core.phase is Phase.READING and core.last_entry_id is None
    assert core.read_response("b0", 0, Status.IO_ERROR, None, now_ms) == []
    assert core.read_response("b1", 0, Status.NO_ENTRY, None, now_ms) == []
    assert core.last_entry_id is None
    [close] = core.read_response("b2", 0, Status.NO_ENTRY, None, now_ms)
    assert close.purpose is MetadataPurpose.CLOSE and close.metadata.last_entry_id == -1


@pytest.mark.parametrize("quorums", QUORUMS)
def test_a_digest_mismatch_on_one_replica_and_an_intact_copy_on_another_make_the_entry_present(quorums):
    # Entry 10 reached two bookies of its write set, never acknowledged;
    # the first one's copy comes back with a bad digest, the third bookie
    # lacks it. The damaged copy and the "no entry" decide nothing (were
    # the damaged copy counted as absent, WQ - AQ + 1 = 2 negatives would
    # drop the entry); the intact copy, answering last, makes it present.
    # The rewrite leaves an intact copy where the damaged one was.
    cluster = Cluster(*quorums)
    cluster.write_quorum_prefix(10)
    damaged_on, intact_on, without = cluster.metadata.write_set(10)
    cluster.write(holders=[damaged_on, intact_on])
    cluster.corrupt(damaged_on, 10, "digest")
    driver = Driver(cluster, cluster.recovery_core(), choose=answer_last(RecoveryRead(intact_on, 10, True)))
    driver.run()
    metadata = assert_recovered(driver, 10)
    answers = {answer.bookie_id: answer for answer in driver.reads if answer.entry_id == 10}
    assert answers[damaged_on].status is Status.OK and not answers[damaged_on].genuine_negative
    assert answers[without].genuine_negative
    assert damaged_on in cluster.intact_copies(metadata, 10)


# --- corrupt replicas -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["io", "digest"])
@pytest.mark.parametrize("quorums", QUORUMS)
def test_a_corrupt_copy_of_the_last_entry_is_not_counted_and_the_entry_is_recovered(quorums, kind):
    # Entries 0..9 reached their whole write sets; one bookie's copy of entry
    # 9 is damaged (IO_ERROR from the bookie, or bytes with a bad digest).
    # The other two copies decide it: closed at 9, and the rewrite leaves an
    # intact copy on the bookie that had the damaged one.
    cluster = Cluster(*quorums)
    for _ in range(10):
        cluster.write()
    victim = cluster.metadata.write_set(9)[0]
    cluster.corrupt(victim, 9, kind)
    driver = Driver(cluster, cluster.recovery_core())
    driver.run()
    metadata = assert_recovered(driver, 9)
    answers = [answer for answer in driver.reads if (answer.bookie_id, answer.entry_id) == (victim, 9)]
    assert answers and all(not answer.genuine_negative for answer in answers)
    assert driver.core.start_entry_id == 8
    assert victim in cluster.intact_copies(metadata, 9)
    assert_reads_fenced(driver)


@pytest.mark.parametrize("kind", ["io", "digest"])
def test_a_corrupt_replica_holds_recovery_up_rather_than_truncating_the_ledger(kind):
    # Entry 9 was acknowledged by b0 and b1 only; b1's copy is damaged and
    # b0, which holds the only intact copy, is down. b2's NO_ENTRY alone
    # decides nothing (absent needs two): were the damaged copy counted as
    # absent, entry 9 (acknowledged!) would be cut off. Recovery keeps
    # asking b0 and b1, backing off, until one of them has a copy to give.
    cluster = Cluster(3, 3, 2, spares=1)  # to replace b0 in the rewrite
    for _ in range(9):
        cluster.write()
    cluster.write(holders=["b0", "b1"])
    cluster.corrupt("b1", 9, kind)
    driver = Driver(cluster, cluster.recovery_core(read_window_entries=1))
    # b0 answered the fence and then went down.
    driver.start()
    while not driver.sent(RecoveryRead):
        assert driver.step()
    driver.down.add("b0")
    assert driver.run(steps_max=400) is None
    assert MetadataPurpose.CLOSE not in driver.purposes()
    answers = [answer for answer in driver.reads if (answer.bookie_id, answer.entry_id) == ("b1", 9)]
    assert len(answers) > 10 and not any(answer.genuine_negative for answer in answers)
    asked_at = driver.times_sent(lambda action: isinstance(action, RecoveryRead) and (action.bookie_id, action.entry_id) == ("b1", 9))
    gaps = [later - earlier for earlier, later in zip(asked_at, asked_at[1:])]
    assert gaps[0] >= RETRY_DELAY_MS_MIN
    assert gaps == sorted(gaps) and max(gaps) == RETRY_DELAY_MS_MAX
    # The operator restores b1's copy; the next retry finds it.
    cluster.bookies["b1"].unreadable.discard(9)
    cluster.bookies["b1"].entries[9] = cluster.written[9]
    driver.run()
    assert_recovered(driver, 9)


def test_a_damaged_lac_entry_in_a_fencing_answer_is_not_used_for_the_length():
    # Entry 8 reached b0 and b1, and b0's copy is damaged; every bookie's LAC
    # is 8. b0 and b2 answer the fence first: b0 counts as fenced, but its
    # copy of entry 8 must not give the length; b2 lacks it. Entry 8 is then
    # read (without the fence flag) and b1's intact copy gives the length.
    cluster = Cluster(3, 3, 2)
    for _ in range(8):
        cluster.write()
    cluster.write(holders=["b0", "b1"])
    cluster.write()
    cluster.corrupt("b0", 8, "digest")
    driver = Driver(cluster, cluster.recovery_core(), choose=answer_last(FenceRead("b1")))
    driver.run()
    metadata = closed_at(driver)
    assert (metadata.last_entry_id, metadata.length) == (9, cluster.length_up_to(9))
    assert driver.core.start_entry_id == 8
    length_reads = [action for action in driver.sent(RecoveryRead) if action.entry_id == 8]
    assert length_reads and not any(action.fence for action in length_reads)
    assert_reads_fenced(driver)


# --- an ensemble with nothing in it -------------------------------------------------------


@pytest.mark.parametrize("quorums", QUORUMS)
def test_an_empty_last_ensemble_starts_after_its_key_and_reads_only_the_length_before_it(quorums):
    # The writer pipelined entries 0..5 (all carrying LAC -1), saw them
    # acknowledged, then bookie b2 failed: the new ensemble is keyed at 6 and
    # nothing reached it. b2 is gone for good. Its bookies report LAC -1, yet
    # 5 is known confirmed (an ensemble keyed at 6 exists): recovery reads
    # entry 5 for its length only, finds entry 6 absent and closes at 5,
    # dropping the ensemble keyed at 6.
    ensemble_size = quorums[0]
    cluster = Cluster(*quorums)
    for _ in range(6):
        cluster.write(lac=-1)
    first_ensemble = cluster.metadata.last_ensemble[1]
    cluster.change_ensemble(6, {2: f"b{ensemble_size}"})
    last_ensemble = cluster.metadata.last_ensemble[1]
    driver = Driver(cluster, cluster.recovery_core())
    driver.down.add("b2")
    driver.run()
    metadata = assert_recovered(driver, 5)
    assert metadata.ensembles == ((0, first_ensemble),)
    assert driver.core.start_entry_id == 5
    assert {action.bookie_id for action in driver.sent(FenceRead)} == set(last_ensemble)
    earlier = [action for action in driver.sent(RecoveryRead) if action.entry_id < 6]
    assert earlier and all(action.entry_id == 5 and not action.fence for action in earlier)
    assert driver.sent(SendAdd) == []
    assert_reads_fenced(driver)


def test_the_start_entry_known_from_a_fencing_answer_is_not_read_again():
    # Every bookie's LAC is 8 and its fencing answer carries entry 8: its
    # length is known, no read of entry 8 is needed.
    cluster = Cluster(3, 3, 2)
    for _ in range(10):
        cluster.write()
    driver = Driver(cluster, cluster.recovery_core())
    driver.run()
    assert_recovered(driver, 9)
    assert driver.core.start_entry_id == 8
    assert all(action.entry_id > 8 for action in driver.sent(RecoveryRead))


# --- fencing coverage ---------------------------------------------------------------------


@pytest.mark.parametrize("quorums", QUORUMS)
def test_no_recovery_read_before_e_minus_aq_plus_one_bookies_are_fenced(quorums):
    # Only E - AQ bookies answer the fencing reads: the old writer could
    # still reach AQ through the others, so recovery must not read on. Once
    # one more comes back, it goes on and closes (the entries are on whole
    # write sets, so the bookie still down is not needed to decide them).
    ensemble_size, _, ack_quorum = quorums
    cluster = Cluster(*quorums, spares=1)  # to replace the one still down in the rewrite
    for _ in range(6):
        cluster.write()
    driver = Driver(cluster, cluster.recovery_core())
    silent = [f"b{index}" for index in range(ensemble_size - ack_quorum, ensemble_size)]
    driver.down.update(silent)
    assert driver.run(steps_max=300) is None
    assert driver.sent(RecoveryRead) == []
    assert sum(bookie.fenced for bookie in cluster.bookies.values()) == ensemble_size - ack_quorum
    # The silent ones are asked again and again, later each time.
    asked_at = driver.times_sent(lambda action: action == FenceRead(silent[0]))
    assert len(asked_at) > 5
    gaps = [later - earlier for earlier, later in zip(asked_at, asked_at[1:])]
    assert gaps == sorted(gaps) and gaps[0] == RETRY_DELAY_MS_MIN and gaps[-1] == RETRY_DELAY_MS_MAX
    driver.down.discard(silent[0])
    driver.run()
    assert_recovered(driver, 5)


def test_fencing_answers_that_leave_the_fence_unknown_are_retried_with_backoff():
    # Hand-written events. E=3 AQ=2: two fenced bookies suffice. b1 answers
    # IO_ERROR, then nothing, then TOO_MANY_REQUESTS: each time it is asked
    # again later, never counted. b2's NO_ENTRY (it is fenced, its LAC is
    # -1) completes the coverage with b0.
    cluster = Cluster(3, 3, 2)
    cluster.write(lac=-1, holders=["b0"])
    core = cluster.recovery_core(read_window_entries=1)
    [mark] = core.start(0)
    assert mark.purpose is MetadataPurpose.START_RECOVERY and mark.metadata.state is LedgerState.IN_RECOVERY
    assert cluster.store.compare_and_set(mark.metadata, mark.expected_version)
    assert core.metadata_written(cluster.store.version, 0) == [FenceRead("b0"), FenceRead("b1"), FenceRead("b2")]
    assert core.fence_response("b0", Status.NO_ENTRY, -1, None, 0) == []
    assert core.fence_response("b1", Status.IO_ERROR, -1, None, 0) == []
    assert core.next_deadline_ms() == 50
    assert core.tick(49) == []
    assert core.tick(50) == [FenceRead("b1")]
    assert core.next_deadline_ms() is None  # the question is out
    assert core.fence_response("b1", None, -1, None, 60) == []
    assert core.next_deadline_ms() == 160
    assert core.tick(160) == [FenceRead("b1")]
    assert core.fence_response("b1", Status.TOO_MANY_REQUESTS, -1, None, 170) == []
    assert core.next_deadline_ms() == 370
    # A late or unasked answer changes nothing.
    assert core.fence_response("b0", Status.NO_ENTRY, 5, None, 200) == []
    actions = core.fence_response("b2", Status.NO_ENTRY, -1, None, 200)
    assert actions == [RecoveryRead(bookie, 0, True) for bookie in ("b0", "b1", "b2")]
    # The retry of b1 is dropped: fencing is over.
    assert core.tick(370) == []
    assert core.fence_response("b1", Status.OK, 0, None, 380) == []


def test_the_largest_lac_among_the_fenced_bookies_is_where_reading_starts():
    # b2 holds entry 6, which carries LAC 5; b0 and b1 know only LAC 4. Once
    # b2 is among the fenced ones, reading starts after 5 (and b2's copy of
    # entry 6, answering first, keeps it).
    cluster = Cluster(3, 3, 2)
    for _ in range(6):
        cluster.write()
    cluster.write(holders=["b2"])
    driver = Driver(cluster, cluster.recovery_core(), choose=lambda in_flight: len(in_flight) - 1)
    driver.run()
    assert_recovered(driver, 6)
    assert driver.core.start_entry_id == 5
    assert min(action.entry_id for action in driver.sent(RecoveryRead)) == 6


# --- the fence flag ---------------------------------------------------------------------------


def test_every_read_of_an_entry_being_recovered_carries_the_fence_flag_retries_too():
    # The writer pipelined entries 0..7 (all carrying LAC -1, so every entry
    # is read) and entry 8 reached no bookie. The first read of each entry
    # from each bookie fails (IO_ERROR or no answer, alternately), so nothing
    # is decided before `tick` asks again: those retries carry the flag too.
    cluster = Cluster(5, 3, 2)
    for entry_id in range(8):
        cluster.write(lac=-1, holders=cluster.metadata.write_set(entry_id)[:2])
    cluster.write(lac=-1, holders=[])
    seen: set[tuple[str, int]] = set()

    def first_read_fails(action):
        if isinstance(action, RecoveryRead) and (action.bookie_id, action.entry_id) not in seen:
            seen.add((action.bookie_id, action.entry_id))
            return Status.IO_ERROR if action.entry_id % 2 else LOST
        return None

    driver = Driver(cluster, cluster.recovery_core(read_window_entries=4), fault=first_read_fails)
    driver.run()
    assert_recovered(driver, 7)
    assert driver.core.start_entry_id == -1
    asked = Counter((action.bookie_id, action.entry_id) for action in driver.sent(RecoveryRead))
    assert {entry_id for (_, entry_id), count in asked.items() if count > 1} >= set(range(8))
    assert_reads_fenced(driver)


# --- concurrent recoverers and writers -------------------------------------------------------


def test_a_concurrent_recoverers_close_is_adopted_when_ours_loses():
    # Another recoverer closes the ledger while we are rewriting: our close
    # loses the compare-and-set and we adopt theirs as it is.
    cluster = Cluster(3, 3, 2)
    cluster.write_quorum_prefix(10)
    theirs: list[LedgerMetadata] = []

    def other_recoverer_closes_first(write: WriteMetadata, store: ModelMetadataStore) -> None:
        if write.purpose is MetadataPurpose.CLOSE and not theirs:
            theirs.append(store.value.with_closed(9, cluster.length_up_to(9)))
            store.replace(theirs[0])

    driver = Driver(cluster, cluster.recovery_core(), before_cas=other_recoverer_closes_first)
    driver.run()
    assert driver.result == RecoveryDone(theirs[0], cluster.store.version)
    assert driver.metadata_writes[-1][1] is False


def test_a_close_found_while_marking_in_recovery_is_adopted_without_fencing():
    # The ledger was closed between our read of the metadata and our mark.
    cluster = Cluster(3, 3, 2)
    cluster.write_quorum_prefix(3)

    def closed_meanwhile(write: WriteMetadata, store: ModelMetadataStore) -> None:
        if store.value.state is not LedgerState.CLOSED:
            store.replace(store.value.with_closed(2, cluster.length_up_to(2)))

    driver = Driver(cluster, cluster.recovery_core(), before_cas=closed_meanwhile)
    driver.run()
    assert driver.result == RecoveryDone(cluster.store.value, cluster.store.version)
    assert driver.sent(FenceRead) == [] and driver.sent(RecoveryRead) == []


def test_a_conflict_while_marking_takes_the_new_ensemble_and_marks_again():
    # The old writer, still alive, changed its ensemble (b2 -> b3 from entry
    # 5) just before our mark: the mark conflicts, is retried against the new
    # version, and the new last ensemble is the one fenced.
    cluster = Cluster(3, 3, 2)
    cluster.write_quorum_prefix(5)
    changed: list[bool] = []

    def writer_changes_ensemble(write: WriteMetadata, store: ModelMetadataStore) -> None:
        if not changed:
            changed.append(True)
            cluster.change_ensemble(5, {2: "b3"})

    driver = Driver(cluster, cluster.recovery_core(), before_cas=writer_changes_ensemble)
    driver.run()
    metadata = assert_recovered(driver, 4)
    assert [(write.purpose, succeeded) for write, succeeded in driver.metadata_writes] == [
        (MetadataPurpose.START_RECOVERY, False),
        (MetadataPurpose.START_RECOVERY, True),
        (MetadataPurpose.CLOSE, True),
    ]
    assert driver.metadata_writes[1][0].expected_version == 1
    assert {action.bookie_id for action in driver.sent(FenceRead)} == {"b0", "b1", "b3"}
    assert metadata.ensembles == ((0, ("b0", "b1", "b2")),)


def test_marking_gives_up_after_too_many_conflicts():
    # Something keeps changing the metadata under us: the mark is retried a
    # bounded number of times, then recovery fails.
    cluster = Cluster(3, 3, 2)

    def always_changed(write: WriteMetadata, store: ModelMetadataStore) -> None:
        store.replace(store.value)

    driver = Driver(cluster, cluster.recovery_core(), before_cas=always_changed)
    driver.run()
    assert isinstance(driver.result, RecoveryFailed)
    assert isinstance(driver.result.error, MetadataVersionError)
    assert driver.purposes() == [MetadataPurpose.START_RECOVERY] * (START_CONFLICTS_MAX + 1)
    assert driver.sent(FenceRead) == []


def test_a_close_that_conflicts_with_another_recoverers_rewrite_fails_rather_than_closing_over_it():
    # Another recoverer replaced a bookie while we were rewriting (the ledger
    # is still IN_RECOVERY but changed): our close must not go through.
    cluster = Cluster(3, 3, 2, spares=1)
    cluster.write_quorum_prefix(4)

    def other_recoverer_changes_ensemble(write: WriteMetadata, store: ModelMetadataStore) -> None:
        if write.purpose is MetadataPurpose.CLOSE and store.value.state is LedgerState.IN_RECOVERY:
            store.replace(store.value.with_ensemble(4, ["b0", "b1", "b3"]))

    driver = Driver(cluster, cluster.recovery_core(), before_cas=other_recoverer_changes_ensemble)
    driver.run()
    assert isinstance(driver.result, RecoveryFailed)
    assert isinstance(driver.result.error, MetadataVersionError)
    assert cluster.metadata.state is LedgerState.IN_RECOVERY


def test_a_rewrite_that_raises_a_bookies_lac_onto_its_unreadable_copy_holds_a_second_recoverer_in_fencing():
    # E=4 WQ=2 AQ=1: fencing needs all four bookies. Entry 0 was acknowledged
    # on b0 and b1, and b1's copy has since become unreadable; entry 1
    # (carrying LAC 0) reached b2 only. b1's LAC is -1, so it fences for R1,
    # which keeps entry 1 and rewrites it to b1 and b2: b1's LAC is now 0,
    # the entry it cannot read, and every fencing read it answers from now
    # on is IO_ERROR, never counted as fenced. R2, which read the metadata
    # while it was IN_RECOVERY, is held up fencing, as any recoverer would be
    # with that replica from the start; nothing is lost meanwhile (R1 closed
    # at 1 with entry 0 intact on b0). Once the operator restores b1's copy,
    # R2 is fenced everywhere and adopts R1's close.
    # (Found by hypothesis: the @example of the property test below.)
    cluster = Cluster(4, 2, 1)
    cluster.write(holders=["b0", "b1"])
    cluster.write(holders=["b2"])
    cluster.corrupt("b1", 0, "io")
    first = Driver(cluster, cluster.recovery_core())
    first.start()
    first.step()  # the mark
    assert cluster.metadata.state is LedgerState.IN_RECOVERY
    second = Driver(cluster, cluster.recovery_core())
    first.run()
    metadata = assert_recovered(first, 1)
    assert cluster.intact_copies(metadata, 0) == ["b0"]
    assert not cluster.fence_blocked("b0") and cluster.fence_blocked("b1")
    assert second.run(steps_max=300) is None
    assert second.core.phase is Phase.FENCING
    b1_answers = second.times_sent(lambda action: action == FenceRead("b1"))
    assert len(b1_answers) > 10
    assert second.sent(RecoveryRead) == [] and second.metadata_writes == []
    cluster.restore("b1", 0)
    second.run()
    assert second.result == RecoveryDone(metadata, cluster.store.version)
    assert cluster.metadata == metadata


# --- failures during the rewrite --------------------------------------------------------------


@pytest.mark.parametrize("quorums", QUORUMS)
def test_a_bookie_that_refuses_the_rewrite_is_replaced_and_the_close_carries_the_new_ensemble(quorums):
    # b2's disk filled up just before recovery: it still fences and answers
    # reads, but refuses the RECOVERY_ADDs (READ_ONLY). The rewriter
    # replaces it and recovery closes correctly; the new ensemble reaches
    # the metadata with the close, never before (see the next test).
    ensemble_size = quorums[0]
    cluster = Cluster(*quorums, spares=1)
    cluster.write_quorum_prefix(10)
    # Entries 10 and 11 reached the ack quorum but were never acknowledged;
    # both have b2 in their write sets.
    for entry_id in (10, 11):
        write_set = cluster.metadata.write_set(entry_id)
        cluster.write(lac=9, holders=[bookie for bookie in write_set if bookie != "b2"][:2])
        assert "b2" in write_set
    cluster.bookies["b2"].read_only = True
    original = cluster.metadata.ensembles
    seen_at_close: list[tuple] = []

    def remember_ensembles(write: WriteMetadata, store: ModelMetadataStore) -> None:
        if write.purpose is MetadataPurpose.CLOSE:
            seen_at_close.append(store.value.ensembles)

    driver = Driver(cluster, cluster.recovery_core(), before_cas=remember_ensembles)
    driver.run()
    metadata = assert_recovered(driver, 11)
    assert driver.purposes() == [MetadataPurpose.START_RECOVERY, MetadataPurpose.CLOSE]
    assert seen_at_close == [original]
    first_entry_id, ensemble = metadata.last_ensemble
    assert "b2" not in ensemble and f"b{ensemble_size}" in ensemble
    # Keyed after the entries already rewritten: where b2 failed.
    assert driver.core.start_entry_id < first_entry_id <= 11
    assert metadata.ensembles[:-1] == original
    assert_reads_fenced(driver)


def test_a_recoverer_that_dies_after_replacing_a_bookie_leaves_every_acknowledged_entry_readable():
    # The writer pipelined entries 0..5 (all carrying LAC -1) and saw them
    # all acknowledged; entry 5 is on b0 and b2 only. Recoverer R1 reads
    # from entry 0 and rewrites it; b0 and b1 take it, b2 refuses (READ_ONLY)
    # and R1 replaces b2 with b3 from entry 1 -- then R1 dies before any
    # other rewrite lands. Recoverer R2 must still find entry 5 on b0 and b2,
    # where the writer put it. (Had R1 written its replacement to the
    # metadata, R2 would read entry 5 from b3, b0, b1, and two NO_ENTRY
    # answers arriving before b0's copy would cut off an acknowledged entry:
    # BookKeeper's recovery keeps its ensemble changes local and writes them
    # with the close, apache/bookkeeper#1621.)
    cluster = Cluster(3, 3, 2, spares=1)
    for _ in range(5):
        cluster.write(lac=-1)
    cluster.write(lac=-1, holders=["b0", "b2"])
    cluster.bookies["b2"].read_only = True

    def only_entry_0_is_rewritten(in_flight: list) -> int:
        held = lambda action: isinstance(action, SendAdd) and action.entry_id >= 1  # noqa: E731
        return next((index for index, action in enumerate(in_flight) if not held(action)), 0)

    first = Driver(cluster, cluster.recovery_core(), choose=only_entry_0_is_rewritten)
    first.start()
    while not any(isinstance(action, SendAdd) and action.bookie_id == "b3" for action in first.in_flight):
        assert first.result is None and first.step()
    # R1 dies; its requests in flight are lost. b2 is writable again.
    cluster.bookies["b2"].read_only = False
    assert cluster.bookies["b1"].entries.get(5) is None and not cluster.bookies["b3"].entries
    second = Driver(cluster, cluster.recovery_core(seed=1))
    second.run()
    metadata = assert_recovered(second, 5)
    assert metadata.ensembles == ((0, ("b0", "b1", "b2")),)


def test_a_rewrite_with_no_replacement_bookie_fails_recovery():
    # As above, but there is no spare bookie to replace b2 with.
    cluster = Cluster(3, 3, 2)
    cluster.write_quorum_prefix(10)
    cluster.write(lac=9, holders=["b0", "b1"])
    cluster.bookies["b2"].read_only = True
    driver = Driver(cluster, cluster.recovery_core())
    driver.run()
    assert isinstance(driver.result, RecoveryFailed)
    assert isinstance(driver.result.error, NotEnoughBookiesError)
    assert MetadataPurpose.CLOSE not in driver.purposes()


def test_a_late_rewrite_failure_with_no_replacement_fails_recovery_rather_than_hanging():
    # Entry 10 is rewritten and acknowledged by b0 and b1 before b2 turns it
    # down (READ_ONLY); there is no bookie to replace b2 with. The rewriter
    # is broken although nothing is pending: recovery must say so, not wait
    # forever for a close that never comes.
    cluster = Cluster(3, 3, 2)
    cluster.write_quorum_prefix(10)
    cluster.write(lac=9, holders=["b0", "b1"])
    cluster.bookies["b2"].read_only = True
    driver = Driver(cluster, cluster.recovery_core(), choose=adds_first(last_bookie="b2"))
    driver.run()
    assert isinstance(driver.result, RecoveryFailed), (driver.result, driver.in_flight, driver.core.phase)
    assert isinstance(driver.result.error, NotEnoughBookiesError)


# --- unauthorized ---------------------------------------------------------------------------


def refuse(kind, **fields) -> Callable[[object], object]:
    """A fault: UNAUTHORIZED for requests of `kind` with these fields."""
    return lambda action: (
        Status.UNAUTHORIZED
        if isinstance(action, kind) and all(getattr(action, name) == value for name, value in fields.items())
        else None
    )


@pytest.mark.parametrize(
    "where, fault, choose",
    [
        pytest.param("fence", None, None, id="fence"),
        pytest.param("read", refuse(RecoveryRead, entry_id=11), None, id="read"),
        pytest.param("rewrite", refuse(SendAdd, bookie_id="b1"), None, id="rewrite"),
        # b2 refuses after b0 and b1 acknowledged the rewrite of entry 10:
        # nothing is pending any more, yet the rewriter is broken.
        pytest.param("late rewrite", refuse(SendAdd, bookie_id="b2"), adds_first(last_bookie="b2"), id="late-rewrite"),
    ],
)
def test_unauthorized_from_a_bookie_fails_recovery(where, fault, choose):
    # A bookie knows the ledger under another master key (wrong password):
    # recovery fails with UnauthorizedError wherever that shows up.
    cluster = Cluster(3, 3, 2)
    cluster.write_quorum_prefix(10)
    cluster.write(lac=9, holders=["b0", "b1"])
    if where == "fence":
        cluster.bookies["b0"].unauthorized = True  # it answers every request so
    driver = Driver(cluster, cluster.recovery_core(), fault=fault, choose=choose)
    driver.run()
    assert isinstance(driver.result, RecoveryFailed), (where, driver.result, driver.core.phase)
    assert isinstance(driver.result.error, UnauthorizedError)
    assert MetadataPurpose.CLOSE not in driver.purposes()


def test_unauthorized_from_a_bookie_fails_recovery_during_the_length_read():
    # Entry 6 reached only b0 and carries LAC 5; b0 lost its copy of entry 5,
    # so no fencing answer carries it and entry 5 is read for its length.
    # The bookie that refuses the key there fails recovery.
    cluster = Cluster(3, 3, 2)
    for _ in range(6):
        cluster.write()
    cluster.write(holders=["b0"])
    cluster.bookies["b0"].entries.pop(5)
    driver = Driver(cluster, cluster.recovery_core(), fault=refuse(RecoveryRead, entry_id=5))
    driver.run()
    assert driver.core.start_entry_id == 5
    assert isinstance(driver.result, RecoveryFailed) and isinstance(driver.result.error, UnauthorizedError)
    assert [action.fence for action in driver.sent(RecoveryRead)] == [False] * len(driver.sent(RecoveryRead))


# --- random scenarios ---------------------------------------------------------------------------


@dataclass
class Scenario:
    quorums: tuple[int, int, int]
    ensembles: list[tuple[int, list[str]]]
    acknowledged: int  # the last entry the old writer saw acknowledged
    entries: list[tuple[bytes, int, list[str]]]  # payload, piggybacked LAC, holders
    corrupt: dict[int, tuple[str, str]]  # entry id -> (bookie, 'io' | 'digest')
    spares: int
    # Bookies that never answer: those the old writer replaced, and up to
    # AQ - 1 of the last ensemble.
    down: frozenset[str] = frozenset()

    def build(self) -> Cluster:
        cluster = Cluster(*self.quorums, spares=self.spares, ensembles=self.ensembles)
        for payload, lac, holders in self.entries:
            cluster.write(payload, holders=holders, lac=lac)
        for entry_id, (bookie_id, kind) in sorted(self.corrupt.items()):
            cluster.corrupt(bookie_id, entry_id, kind)
        return cluster

    def ensembles_metadata(self) -> LedgerMetadata:
        return make_metadata(*self.quorums, self.ensembles)

    def intact_copies_before(self, cluster: Cluster) -> dict[int, int]:
        return {entry_id: len(cluster.intact_copies(cluster.metadata, entry_id)) for entry_id in range(len(self.entries))}

    def may_be_present(self, cluster: Cluster, entry_id: int) -> bool:
        """A bookie that answers holds an intact copy."""
        entry = cluster.written[entry_id]
        return any(
            bookie_id not in self.down and cluster.bookies[bookie_id].holds_intact(entry_id, entry)
            for bookie_id in cluster.metadata.write_set(entry_id)
        )

    def may_be_absent(self, cluster: Cluster, entry_id: int) -> bool:
        """WQ - AQ + 1 bookies that answer lack it (a damaged copy counts
        neither way)."""
        _, write_quorum, ack_quorum = self.quorums
        without = sum(
            1 for bookie_id in cluster.metadata.write_set(entry_id)
            if bookie_id not in self.down and entry_id not in cluster.bookies[bookie_id].entries
        )
        return without >= write_quorum - ack_quorum + 1

    def possible_last_entry_ids(self) -> tuple[int, int]:
        """The lowest and highest entry recovery may close at. Entries are
        decided in order, and the first one found absent ends the ledger;
        whether an entry with both an intact copy and enough bookies
        without it is found present or absent is a race between their
        answers. So the close is before the first entry that may be absent
        at the lowest, and before the first that cannot be present at the
        highest. (Entries before the last ensemble were acknowledged and
        are never decided.)"""
        cluster = self.build()
        count = len(self.entries)
        decided = range(cluster.metadata.last_ensemble[0], count)
        first_may_be_absent = next((e for e in decided if self.may_be_absent(cluster, e)), count)
        first_cannot_be_present = next((e for e in decided if not self.may_be_present(cluster, e)), count)
        return first_may_be_absent - 1, first_cannot_be_present - 1

    def can_end(self) -> bool:
        """Recovery can end with these bookies down: E - AQ + 1 of the last
        ensemble answer the fence (a bookie whose LAC entry is unreadable
        answers IO_ERROR, which is no fence); every entry of the last
        ensemble may be found present or absent; the entry before the last
        ensemble (read for its length) has an intact copy that answers."""
        cluster = self.build()
        ensemble_size, _, ack_quorum = self.quorums
        last_key, last_ensemble = cluster.metadata.last_ensemble
        fenceable = [bookie_id for bookie_id in last_ensemble if bookie_id not in self.down and not cluster.fence_blocked(bookie_id)]
        if len(fenceable) < ensemble_size - ack_quorum + 1:
            return False
        for entry_id in range(last_key, len(self.entries)):
            if not (self.may_be_present(cluster, entry_id) or self.may_be_absent(cluster, entry_id)):
                return False
        return last_key == 0 or self.may_be_present(cluster, last_key - 1)


@st.composite
def scenarios(draw) -> Scenario:
    ensemble_size = draw(st.integers(3, 5), label="E")
    write_quorum = draw(st.integers(1, ensemble_size), label="WQ")
    ack_quorum = draw(st.integers(1, write_quorum), label="AQ")
    count = draw(st.integers(0, 12), label="entries")
    acknowledged = draw(st.integers(-1, count - 1), label="acknowledged")
    # The old writer's ensemble changes, each keyed at its LAC + 1 at the
    # time, so at most one past the last acknowledged entry.
    keys = sorted(draw(st.sets(st.integers(1, acknowledged + 1), max_size=2), label="ensemble keys")) if acknowledged >= 0 else []
    ensembles = [(0, [f"b{index}" for index in range(ensemble_size)])]
    next_bookie = ensemble_size
    for key in keys:
        bookies = list(ensembles[-1][1])
        bookies[draw(st.integers(0, ensemble_size - 1), label="replaced")] = f"b{next_bookie}"
        next_bookie += 1
        ensembles.append((key, bookies))
    metadata = make_metadata(ensemble_size, write_quorum, ack_quorum, ensembles)
    entries: list[tuple[bytes, int, list[str]]] = []
    corrupt: dict[int, tuple[str, str]] = {}
    lac = -1
    for entry_id in range(count):
        write_set = metadata.write_set(entry_id)
        # Acknowledged entries are on AQ bookies at least; later ones on any.
        minimum = ack_quorum if entry_id <= acknowledged else 0
        reached = draw(st.permutations(write_set), label=f"order {entry_id}")
        holders = sorted(reached[: draw(st.integers(minimum, write_quorum), label=f"holders {entry_id}")])
        # LACs grow in entry order and never pass the acknowledged prefix.
        lac = draw(st.integers(lac, min(entry_id - 1, acknowledged)), label=f"lac {entry_id}")
        payload = draw(st.binary(max_size=6), label=f"payload {entry_id}")
        entries.append((payload, lac, holders))
        kind = draw(st.sampled_from([None, None, "io", "digest"]), label=f"corrupt {entry_id}")
        if kind and holders:
            intact = len(holders) - 1
            absent = write_quorum - len(holders)
            # At most one damaged copy, and only where the entry can still be
            # decided: another intact copy, or (never acknowledged) enough
            # bookies without it. (An entry whose only intact copy is on a
            # bookie that does not answer holds recovery up: see the
            # scenario test.)
            if intact >= 1 or (entry_id > acknowledged and absent >= write_quorum - ack_quorum + 1):
                corrupt[entry_id] = (draw(st.sampled_from(holders), label=f"victim {entry_id}"), kind)
    # A bookie whose own LAC entry is unreadable can never confirm its fence
    # (IO_ERROR); keep E - AQ + 1 of the last ensemble fenceable.
    scenario = Scenario((ensemble_size, write_quorum, ack_quorum), ensembles, acknowledged, entries, corrupt, 2)
    cluster = scenario.build()
    blocked = [bookie_id for bookie_id in cluster.metadata.last_ensemble[1] if cluster.fence_blocked(bookie_id)]
    for bookie_id in blocked[ack_quorum - 1 :]:
        del corrupt[cluster.bookies[bookie_id].last_add_confirmed]
    # The bookies the old writer replaced have usually failed for good; and
    # up to AQ - 1 of the last ensemble may be down too (fencing needs
    # E - AQ + 1): with WQ = AQ an entry then keeps a single copy that
    # answers. Each is kept only where recovery can still end.
    replaced = frozenset(cluster.metadata.all_bookies() - set(cluster.metadata.last_ensemble[1]))
    replaced_down = replaced if draw(st.sampled_from([True, True, False]), label="replaced bookies down") else frozenset()
    last_down_count = draw(st.sampled_from([0, 0, 1, 2]), label="last ensemble bookies down")
    last_order = draw(st.permutations(cluster.metadata.last_ensemble[1]), label="last ensemble order")
    last_down = frozenset(last_order[: min(last_down_count, ack_quorum - 1)])
    for down in (replaced_down | last_down, last_down, replaced_down):
        scenario.down, scenario.spares = down, 2 + len(down & last_down)
        if scenario.can_end():
            break
    else:
        scenario.down, scenario.spares = frozenset(), 2
        assert scenario.can_end()
    return scenario


class RandomFaults:
    """Transient faults: each (request kind, bookie, entry) fails at most
    `per_question_max` times, so everything is answered in the end."""

    def __init__(self, rng: random.Random, read_rate: float, add_rate: float) -> None:
        self.rng = rng
        self.read_rate = read_rate
        self.add_rate = add_rate
        self.counts: dict[tuple, int] = {}
        self.add_faults = 0

    per_question_max = 3
    add_faults_max = 3

    def __call__(self, action):
        if isinstance(action, SendAdd):
            if self.add_faults < self.add_faults_max and self.rng.random() < self.add_rate:
                self.add_faults += 1
                return self.rng.choice([LOST, Status.READ_ONLY, Status.IO_ERROR])
            return None
        key = (type(action), action.bookie_id, getattr(action, "entry_id", -1))
        if self.counts.get(key, 0) >= self.per_question_max or self.rng.random() >= self.read_rate:
            return None
        self.counts[key] = self.counts.get(key, 0) + 1
        if isinstance(action, FenceRead):
            return self.rng.choice([LOST, Status.TOO_MANY_REQUESTS, Status.IO_ERROR])
        return self.rng.choice([LOST, Status.TOO_MANY_REQUESTS, Status.IO_ERROR, BAD_DIGEST])


@settings(max_examples=200, deadline=None)
@given(
    scenario=scenarios(),
    # A seed rather than st.randoms(): the driver makes thousands of choices,
    # more than hypothesis' buffer holds.
    seed=st.integers(0, 2**32 - 1),
    read_rate=st.sampled_from([0.0, 0.1, 0.3, 0.5]),
    add_rate=st.sampled_from([0.0, 0.1, 0.3]),
    read_window_entries=st.sampled_from([1, 3, 64]),
)
def test_random_scenarios_recover_every_acknowledged_entry(scenario, seed, read_rate, add_rate, read_window_entries):
    # The old writer crashed leaving `scenario` on the bookies; one recoverer
    # runs, with answers in random order and transient faults on the way.
    rng = random.Random(seed)
    cluster = scenario.build()
    copies_before = scenario.intact_copies_before(cluster)
    last_key, fenced_ensemble = cluster.metadata.last_ensemble
    ack_quorum = cluster.metadata.ack_quorum
    negatives_needed = cluster.metadata.write_quorum - ack_quorum + 1
    core = cluster.recovery_core(
        seed=rng.randrange(1 << 30), down=scenario.down, read_window_entries=read_window_entries
    )
    driver = Driver(
        cluster,
        core,
        choose=lambda in_flight: rng.randrange(len(in_flight)),
        fault=RandomFaults(rng, read_rate, add_rate),
    )
    driver.down = set(scenario.down)
    driver.start()
    absent_checked = False
    for _ in range(20_000):
        if driver.result is not None:
            break
        before = core.last_entry_id
        assert driver.step(), "recovery stalled with nothing in flight and no deadline"
        if before is None and core.last_entry_id is not None:
            # The first absent entry: WQ - AQ + 1 bookies of its write set
            # themselves answered NO_ENTRY / NO_LEDGER. An IO_ERROR, a
            # damaged copy or a missing answer never counts.
            absent = core.last_entry_id + 1
            genuine = {answer.bookie_id for answer in driver.reads if answer.entry_id == absent and answer.genuine_negative}
            assert len(genuine) >= negatives_needed, (absent, genuine, driver.reads)
            absent_checked = True
    # Recovery ends, and closes where the replicas allow: never below an
    # entry that cannot be absent, never past one that cannot be present.
    assert isinstance(driver.result, RecoveryDone), driver.result
    lowest, highest = scenario.possible_last_entry_ids()
    assert scenario.acknowledged <= lowest <= highest
    closed = driver.result.metadata.last_entry_id
    assert lowest <= closed <= highest, (lowest, closed, highest)
    metadata = assert_recovered(driver, closed, copies_before)
    assert absent_checked
    # Reading starts after the largest LAC the counted fencing answers gave,
    # or after the last ensemble's key - 1; nothing before is read but the
    # start entry (for its length).
    assert core.start_entry_id == max([last_key - 1, *driver.fence_lacs])
    assert all(action.entry_id >= last_key - 1 for action in driver.sent(RecoveryRead))
    assert_reads_fenced(driver)
    assert_old_writer_locked_out(driver, fenced_ensemble)
    # Every entry up to the close reads back as the old writer sent it.
    for entry_id in range(closed + 1):
        for bookie_id in cluster.intact_copies(metadata, entry_id):
            assert cluster.bookies[bookie_id].entries[entry_id] == cluster.written[entry_id]
    # The metadata changed twice: marked, then closed (with the rewriter's
    # replacements, if any); the writer's ensembles before the close stay.
    assert driver.purposes() == [MetadataPurpose.START_RECOVERY, MetadataPurpose.CLOSE]
    original = dict(scenario.ensembles_metadata().ensembles)
    for first_entry_id, bookies in metadata.ensembles:
        if first_entry_id <= core.start_entry_id:
            assert original.get(first_entry_id) == bookies
    assert core.next_deadline_ms() is None
    driver.drain_bookie_answers()
    # What the example exercised (shown with --hypothesis-show-statistics).
    event(f"closed {'beyond' if closed > scenario.acknowledged else 'at'} the acknowledged prefix")
    if lowest < highest:
        event(f"closed {'at the lowest' if closed == lowest else 'above the lowest'} of a race")
    event(f"old writer's ensembles: {len(scenario.ensembles)}")
    if scenario.corrupt:
        event("damaged replicas")
    if scenario.down - set(fenced_ensemble):
        event("replaced bookies down")
    if scenario.down & set(fenced_ensemble):
        event(f"last ensemble bookies down (WQ {'=' if cluster.metadata.write_quorum == ack_quorum else '>'} AQ)")
    if core.writer is not None and core.writer.ensemble_changes:
        event("the rewriter changed the ensemble")
    if any(action.entry_id == core.start_entry_id for action in driver.sent(RecoveryRead)):
        event("start entry read for its length")


def held_up_fencing(cluster: Cluster, driver: Driver, down) -> bool:
    """The recoverer is fencing and can never reach E - AQ + 1 fenced
    bookies as the replicas are now: too many of its ensemble are down or
    `fence_blocked`."""
    core = driver.core
    if driver.result is not None or core.phase is not Phase.FENCING:
        return False
    ensemble = core.metadata.last_ensemble[1]
    fenceable = [bookie_id for bookie_id in ensemble if bookie_id not in down and not cluster.fence_blocked(bookie_id)]
    return len(fenceable) < core.fence_coverage


@settings(max_examples=150, deadline=None)
@given(
    scenario=scenarios(),
    seed=st.integers(0, 2**32 - 1),
    first_steps=st.integers(0, 150),
    first_dies=st.booleans(),
    # Rewrites fail often, so that R1 replaces bookies before it stops.
    add_rate=st.sampled_from([0.3, 0.5]),
)
# Found by hypothesis: R1's rewrite of entry 1 raises b1's LAC to 0, whose
# copy on b1 is unreadable; R2, alongside, is held up fencing (AQ = 1 needs
# all four bookies) until b1's copy is restored.
@example(
    scenario=Scenario(
        quorums=(4, 2, 1),
        ensembles=[(0, ["b0", "b1", "b2", "b3"])],
        acknowledged=0,
        entries=[
            (b"", -1, ["b0", "b1"]), (b"", 0, ["b2"]), (b"", 0, []), (b"", 0, ["b0", "b3"]),
            (b"", 0, []), (b"", 0, []), (b"", 0, []),
        ],
        corrupt={0: ("b1", "io")},
        spares=2,
        down=frozenset(),
    ),
    seed=3,
    first_steps=3,
    first_dies=False,
    add_rate=0.3,
)
def test_a_second_recoverer_after_or_alongside_the_first_keeps_every_acknowledged_entry(
    scenario, seed, first_steps, first_dies, add_rate
):
    # Recoverer R1 runs for a while (its rewrites failing now and then, so
    # that it replaces bookies), then dies or keeps going alongside R2, which
    # starts from the metadata as it is then. Whoever closes, the ledger
    # closes where the replicas allow, and every entry up to there is
    # intact on AQ bookies of its write set.
    #
    # The scenario leaves E - AQ + 1 bookies of the last ensemble able to
    # confirm a fence, but R1's rewrites may not: a RECOVERY_ADD raises a
    # bookie's LAC to the one its entry carries, and that LAC entry may be
    # the bookie's unreadable copy (`fence_blocked`). A recoverer still
    # fencing is then held up, as one recovering from that state would be
    # from the start (an IO_ERROR never counts as fenced; the simulator
    # excuses the same). It is never excused anything else: once the
    # operator restores those copies, it must finish too.
    rng = random.Random(seed)
    cluster = scenario.build()
    copies_before = scenario.intact_copies_before(cluster)
    drivers: list[Driver] = []
    started: list[Driver] = []  # every one that ran, the dead one too
    for name in ("R1", "R2"):
        if name == "R2":
            for _ in range(first_steps):
                if drivers[0].result is not None or not drivers[0].step():
                    break
            if first_dies:
                drivers[0].in_flight.clear()
                started.append(drivers.pop())
        core = cluster.recovery_core(seed=rng.randrange(1 << 30), down=scenario.down, read_window_entries=3)
        driver = Driver(
            cluster, core, choose=lambda in_flight: rng.randrange(len(in_flight)), fault=RandomFaults(rng, 0.1, add_rate)
        )
        driver.down = set(scenario.down)
        driver.start()
        drivers.append(driver)
    def run_both() -> None:
        for _ in range(40_000):
            running = [driver for driver in drivers if driver.result is None]
            if not running or all(held_up_fencing(cluster, driver, scenario.down) for driver in running):
                break
            driver = rng.choice(running)
            if not driver.step():
                # Idle: let the other one go first if it can, else this one is stuck.
                assert any(other.in_flight or other.core.next_deadline_ms() is not None for other in running if other is not driver)

    run_both()
    held_up = [driver for driver in drivers if held_up_fencing(cluster, driver, scenario.down)]
    if held_up:
        for bookie_id in held_up[0].core.metadata.last_ensemble[1]:
            if cluster.fence_blocked(bookie_id):
                cluster.restore(bookie_id, cluster.bookies[bookie_id].last_add_confirmed)
        run_both()
        event("a recoverer held up fencing until a replica was restored")
    results = [driver.result for driver in drivers]
    assert all(result is not None for result in results), results
    # A recoverer that lost the race to another one's changes may fail (the
    # trio driver starts it over); one of them closed the ledger.
    for result in results:
        assert isinstance(result, RecoveryDone) or isinstance(result.error, MetadataVersionError), result
    done = [driver for driver in drivers if isinstance(driver.result, RecoveryDone)]
    assert done
    lowest, highest = scenario.possible_last_entry_ids()
    metadata = cluster.metadata
    assert metadata.state is LedgerState.CLOSED
    closed = metadata.last_entry_id
    assert lowest <= closed <= highest, (lowest, closed, highest)
    assert metadata.length == cluster.length_up_to(closed)
    for driver in done:
        assert driver.result.metadata == metadata
    # The one that closed (perhaps R1 before it died) rewrote every entry
    # after its start entry.
    assert_copies(cluster, metadata, max(driver.core.start_entry_id for driver in started + drivers), copies_before)
