"""Auto-recovery's pure cores, driven by hand: when a missing bookie counts
as lost and when the auditor scans; which fragments and entries a lost
bookie held; what a worker does with closed, open and recovering ledgers;
how replacements land in the metadata; and the under-replication markers,
locks and switch in the in-memory metadata store."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordination.cluster_layout import ClusterLayout
from coordination.memory_store import InMemoryMetadataServer
from coordination.store import ConnectionLossError
from ledger_client.autorecovery import underreplication
from ledger_client.autorecovery.audit_core import AuditCore, ledgers_to_mark
from ledger_client.autorecovery.replication_core import (
    BLOCKED_RECHECK_MS_MIN,
    Fragment,
    GraceClock,
    Replacement,
    RetryBackoff,
    Step,
    apply_replacements,
    choose_replacements,
    fragments_on,
    next_list_start,
    password_for,
    plan_replication,
    recovery_blocked_by,
)
from ledger_client.errors import LedgerStateError, NotEnoughBookiesError
from ledger_client.ledger_store import LedgerStore
from ledger_client.metadata import LedgerMetadata, LedgerState
from tests.support import ledger_metadata_for

DELAY_MS = 1_000
GRACE_MS = 5_000


def ledger(ensembles, *, state=LedgerState.CLOSED, last_entry_id=9, size=3, write_quorum=2, ack_quorum=None) -> LedgerMetadata:
    base = ledger_metadata_for(7)
    return replace(
        base, ensemble_size=size, write_quorum=write_quorum,
        ack_quorum=min(2, write_quorum) if ack_quorum is None else ack_quorum,
        ensembles=tuple((first, tuple(bookies)) for first, bookies in ensembles), state=state,
        last_entry_id=last_entry_id if state is LedgerState.CLOSED else -1,
    )


# --- the auditor ----------------------------------------------------------------------


def test_a_bookie_back_within_the_delay_is_never_lost():
    core = AuditCore(DELAY_MS, audit_interval_ms=60_000)
    core.registry_changed({"a", "b", "c"}, 0)
    assert core.scan_due(0)  # the first scan runs at once
    core.scan_done({"a", "b", "c"}, core.lost(0), 0)
    assert not core.scan_due(1)
    core.registry_changed({"a", "b"}, 100)
    assert core.next_deadline_ms() == 100 + DELAY_MS
    assert not core.scan_due(100 + DELAY_MS - 1)
    core.registry_changed({"a", "b", "c"}, 500)  # c restarted in time
    assert core.lost(10_000) == frozenset()
    assert core.next_deadline_ms() == 60_000  # only the periodic check is left


def test_a_bookie_gone_past_the_delay_is_lost_and_scanned_for_once():
    core = AuditCore(DELAY_MS, audit_interval_ms=60_000)
    core.registry_changed({"a", "b", "c"}, 0)
    core.scan_done({"a", "b", "c"}, core.lost(0), 0)
    core.registry_changed({"a", "b"}, 100)
    assert core.scan_due(100 + DELAY_MS) and core.lost(100 + DELAY_MS) == {"c"}
    core.scan_done({"a", "b", "c"}, core.lost(1_100), 1_100)
    assert not core.scan_due(2_000)  # c's ledgers are marked; next: the periodic check
    assert core.scan_due(1_100 + 60_000)
    assert core.lost(2_000) == {"c"}  # still lost: the periodic check marks again if needed


def test_bookies_gone_before_the_auditor_started_are_found_by_the_first_scan():
    core = AuditCore(DELAY_MS, audit_interval_ms=60_000)
    core.registry_changed({"a", "b"}, 0)
    core.scan_done({"a", "b", "old"}, core.lost(0), 0)  # a ledger still names "old"
    assert core.missing_since_ms == {"old": 0}
    assert core.scan_due(DELAY_MS) and core.lost(DELAY_MS) == {"old"}


def test_a_bookie_no_ledger_uses_is_forgotten():
    core = AuditCore(DELAY_MS, audit_interval_ms=60_000)
    core.registry_changed({"a", "b"}, 0)
    core.registry_changed({"a"}, 10)
    core.scan_done({"a"}, core.lost(10), 10)  # nothing references b
    assert core.missing_since_ms == {} and not core.scan_due(10 + DELAY_MS)


def test_ledgers_to_mark_names_the_lost_bookies_of_each_ledger():
    index = {1: {"a", "b", "c"}, 2: {"b", "c", "d"}, 3: {"c", "d", "e"}}
    assert ledgers_to_mark(index, {"a", "b"}) == {1: {"a", "b"}, 2: {"b"}}
    assert ledgers_to_mark(index, set()) == {}


# --- fragments and entries ------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 6), data=st.data())
def test_a_fragment_holds_exactly_the_entries_whose_write_set_names_its_bookie(size, data):
    write_quorum = data.draw(st.integers(1, size))
    first, count = data.draw(st.integers(0, 50)), data.draw(st.integers(0, 30))
    bookies = tuple(f"b{index}" for index in range(size))
    metadata = ledger([(0, bookies)], size=size, write_quorum=write_quorum, last_entry_id=first + count - 1)
    index = data.draw(st.integers(0, size - 1))
    fragment = Fragment(first, first + count - 1, index, bookies[index], bookies)
    expected = [e for e in range(first, first + count) if bookies[index] in metadata.write_set(e)]
    assert fragment.entry_ids(write_quorum) == expected
    for entry_id in expected:
        sources = fragment.sources(entry_id, write_quorum, lost={bookies[index]})
        assert set(sources) == set(metadata.write_set(entry_id)) - {bookies[index]}


def test_fragments_end_where_the_next_ensemble_starts_or_at_the_last_entry():
    metadata = ledger([(0, "abc"), (5, "dbc"), (8, "dec")], last_entry_id=12)
    found = fragments_on(metadata, {"c"})
    assert [(position, f.first_entry_id, f.last_entry_id, f.index) for position, f in found] == [
        (0, 0, 4, 2), (1, 5, 7, 2), (2, 8, 12, 2),
    ]
    open_ledger = ledger([(0, "abc"), (5, "dbc")], state=LedgerState.OPEN)
    assert [f.last_entry_id for _, f in fragments_on(open_ledger, {"b"})] == [4, -1]


# --- plans ----------------------------------------------------------------------------


def test_a_closed_ledger_is_copied_at_once_and_done_when_no_fragment_is_on_a_lost_bookie():
    metadata = ledger([(0, "abc"), (5, "dbc")])
    plan = plan_replication(metadata, {"b"}, lost_since_ms={"b": 0}, now_ms=0, grace_ms=GRACE_MS)
    assert plan.step is Step.REPLICATE and [f.first_entry_id for f in plan.fragments] == [0, 5]
    assert plan_replication(metadata, {"z"}, lost_since_ms={"z": 0}, now_ms=0, grace_ms=GRACE_MS).step is Step.DONE


def test_an_open_ledger_copies_final_fragments_then_waits_then_is_fenced():
    # The writer moved on from "a" once; "b" is in both ensembles (3/3/2:
    # recovery can close the ledger without one bookie).
    metadata = ledger([(0, "abc"), (5, "dbc")], state=LedgerState.OPEN, write_quorum=3)
    since = {"b": 1_000}
    plan = plan_replication(metadata, {"b"}, lost_since_ms=since, now_ms=1_000, grace_ms=GRACE_MS)
    assert plan.step is Step.REPLICATE and [f.first_entry_id for f in plan.fragments] == [0]
    copied = metadata.with_bookie_replaced(0, 1, "b", "e")
    plan = plan_replication(copied, {"b"}, lost_since_ms=since, now_ms=2_000, grace_ms=GRACE_MS)
    assert plan.step is Step.WAIT and plan.wait_until_ms == 1_000 + GRACE_MS
    plan = plan_replication(copied, {"b"}, lost_since_ms=since, now_ms=1_000 + GRACE_MS, grace_ms=GRACE_MS)
    assert plan.step is Step.RECOVER


def test_a_ledger_in_recovery_is_left_to_its_recoverer_for_the_grace_period():
    metadata = ledger([(0, "abc")], state=LedgerState.OPEN, write_quorum=3).with_recovery_started()
    assert plan_replication(metadata, {"a"}, lost_since_ms={"a": 0}, now_ms=1, grace_ms=GRACE_MS).step is Step.WAIT
    assert plan_replication(metadata, {"a"}, lost_since_ms={"a": 0}, now_ms=GRACE_MS, grace_ms=GRACE_MS).step is Step.RECOVER


def test_each_lost_bookie_has_its_own_grace_period():
    # "c" joined the marker later than "a": the writer gets a full grace
    # period for it too, not what was left of a's.
    metadata = ledger([(0, "abcde")], state=LedgerState.OPEN, size=5, write_quorum=3)
    since = {"a": 0, "c": 4_000}
    plan = plan_replication(metadata, {"a", "c"}, lost_since_ms=since, now_ms=GRACE_MS, grace_ms=GRACE_MS)
    assert plan.step is Step.WAIT and plan.wait_until_ms == 4_000 + GRACE_MS
    # A bookie the worker has not seen marked before counts from now.
    plan = plan_replication(metadata, {"a", "e"}, lost_since_ms={"a": 0}, now_ms=GRACE_MS, grace_ms=GRACE_MS)
    assert plan.step is Step.WAIT and plan.wait_until_ms == 2 * GRACE_MS


@pytest.mark.parametrize(
    "quorums, lost, blocked",
    [
        ((3, 3, 2), "a", False),  # fencing needs 2 of 3; every write set keeps WQ - AQ + 1 = 2 live
        ((3, 2, 2), "a", False),  # WQ = AQ: an entry on (a, b) has b's copy, absent needs 1 "no entry"
        ((2, 2, 2), "a", False),
        ((3, 3, 3), "ab", False),  # fencing needs 1; one intact copy on c decides every entry
        ((3, 2, 2), "ab", True),  # fencing needs 2 of 3, and (a, b) may hold an entry no one else has
        ((3, 2, 1), "a", True),  # fencing needs all E - AQ + 1 = 3 bookies
        ((3, 1, 1), "a", True),  # a may hold the only acknowledged copy of an entry
        ((5, 3, 2), "a", False),
        ((5, 3, 2), "ad", True),  # 3 live bookies, fencing needs 4
        ((5, 4, 3), "c", False),
        ((5, 4, 3), "ae", False),  # fencing needs 3 of 5; (e, a, b, c) keeps WQ - AQ + 1 = 2 live
        ((5, 4, 3), "ace", True),
        ((5, 2, 2), "ab", True),  # fencing needs 4 of 5
    ],
)
def test_recovery_is_blocked_when_the_last_ensemble_loses_an_ack_quorum(quorums, lost, blocked):
    size, write_quorum, ack_quorum = quorums
    bookies = "abcde"[:size]
    metadata = ledger([(0, "xyzvw"[:size]), (4, bookies)], state=LedgerState.OPEN, size=size,
                      write_quorum=write_quorum, ack_quorum=ack_quorum)
    assert recovery_blocked_by(metadata, set(lost) | {"x"}) == (frozenset(lost) if blocked else frozenset())


def test_the_blocking_rule_is_fencing_coverage_and_a_decidable_entry_in_every_write_set():
    # Recovery (one intact copy present, WQ - AQ + 1 "no entry" absent) can
    # close without the lost bookies exactly when E - AQ + 1 of the last
    # ensemble are live and every write set keeps WQ - AQ + 1 live members:
    # the rule, stated in full, against every loss of every small ledger.
    for size in range(1, 6):
        ensemble = "abcde"[:size]
        for write_quorum in range(1, size + 1):
            for ack_quorum in range(1, write_quorum + 1):
                metadata = ledger([(0, ensemble)], state=LedgerState.OPEN, size=size,
                                  write_quorum=write_quorum, ack_quorum=ack_quorum)
                for mask in range(1, 2**size):
                    lost = {bookie for index, bookie in enumerate(ensemble) if mask >> index & 1}
                    write_sets = [[ensemble[(start + offset) % size] for offset in range(write_quorum)] for start in range(size)]
                    can_close = size - len(lost) >= size - ack_quorum + 1 and all(
                        sum(bookie not in lost for bookie in write_set) >= write_quorum - ack_quorum + 1
                        for write_set in write_sets
                    )
                    expected = frozenset() if can_close else frozenset(lost)
                    assert recovery_blocked_by(metadata, lost) == expected, (size, write_quorum, ack_quorum, lost)


def test_an_open_ledger_that_recovery_could_not_close_is_left_to_its_writer():
    # E3/WQ2/AQ2, a and b lost: fencing needs two live bookies of three, so
    # it would leave the ledger IN_RECOVERY for ever.
    metadata = ledger([(0, "abc")], state=LedgerState.OPEN, write_quorum=2, ack_quorum=2)
    lost = {"a", "b"}
    since = {"a": 0, "b": 0}
    plan = plan_replication(metadata, lost, lost_since_ms=since, now_ms=1_000, grace_ms=GRACE_MS)
    assert plan.step is Step.WAIT  # the grace period first, as for any open ledger
    plan = plan_replication(metadata, lost, lost_since_ms=since, now_ms=GRACE_MS, grace_ms=GRACE_MS)
    assert plan.step is Step.BLOCKED and plan.blocked_by == lost and plan.wait_until_ms == 2 * GRACE_MS
    plan = plan_replication(metadata, lost, lost_since_ms=since, now_ms=GRACE_MS, grace_ms=0)
    assert plan.wait_until_ms == GRACE_MS + BLOCKED_RECHECK_MS_MIN  # never a busy loop
    # The writer's next adds replaced a and b: the first ensemble is final and copied.
    moved_on = replace(metadata, ensembles=((0, ("a", "b", "c")), (3, ("d", "e", "c"))))
    plan = plan_replication(moved_on, lost, lost_since_ms=since, now_ms=GRACE_MS, grace_ms=GRACE_MS)
    assert plan.step is Step.REPLICATE and [f.first_entry_id for f in plan.fragments] == [0, 0]
    # A ledger someone began to recover is blocked the same way (only the
    # bookies' return helps then); lost bookies outside the last ensemble
    # are not in the way.
    recovering = metadata.with_recovery_started()
    plan = plan_replication(recovering, lost, lost_since_ms=since, now_ms=GRACE_MS, grace_ms=GRACE_MS)
    assert plan.step is Step.BLOCKED
    recovering = moved_on.with_recovery_started()
    plan = plan_replication(recovering, lost, lost_since_ms=since, now_ms=GRACE_MS, grace_ms=GRACE_MS)
    assert plan.step is Step.RECOVER


def test_an_open_write_quorum_equal_to_ack_quorum_ledger_with_a_bookie_lost_is_fenced_after_its_grace_period():
    # E3/WQ2/AQ2, b lost: every entry b held has its other copy on a or c,
    # and the first entry nobody holds needs one "no entry". Recovery can
    # close it, so past the grace period it is fenced and closed like any
    # other open ledger.
    metadata = ledger([(0, "abc")], state=LedgerState.OPEN, write_quorum=2, ack_quorum=2)
    plan = plan_replication(metadata, {"b"}, lost_since_ms={"b": 0}, now_ms=1_000, grace_ms=GRACE_MS)
    assert plan.step is Step.WAIT and plan.wait_until_ms == GRACE_MS
    plan = plan_replication(metadata, {"b"}, lost_since_ms={"b": 0}, now_ms=GRACE_MS, grace_ms=GRACE_MS)
    assert plan.step is Step.RECOVER
    recovering = metadata.with_recovery_started()
    plan = plan_replication(recovering, {"b"}, lost_since_ms={"b": 0}, now_ms=GRACE_MS, grace_ms=GRACE_MS)
    assert plan.step is Step.RECOVER


def test_the_grace_clock_counts_from_when_this_worker_first_saw_each_bookie():
    clock = GraceClock()
    assert clock.lost_since_ms(7, {"a"}, 100) == {"a": 100}
    assert clock.lost_since_ms(7, {"a", "b"}, 900) == {"a": 100, "b": 900}
    assert clock.lost_since_ms(7, {"b"}, 1_000) == {"b": 900}  # a is back
    assert clock.lost_since_ms(7, {"a", "b"}, 2_000) == {"a": 2_000, "b": 900}  # and lost again
    clock.forget_except([8])
    assert clock.lost_since_ms(7, {"b"}, 3_000) == {"b": 3_000}


def test_a_long_listing_is_checked_page_by_page():
    # A bookie lists at most its list_entries_ids_max lowest ids.
    assert next_list_start(0, 9, [(0, 4)]) == 5
    assert next_list_start(5, 9, [(5, 9)]) is None
    assert next_list_start(0, 9, [(0, 2), (4, 6)]) == 7  # a gap, then more past it
    assert next_list_start(7, 9, []) is None  # nothing more: the rest is missing
    assert next_list_start(0, 9, [(0, 12)]) is None


# --- replacements and the metadata change ---------------------------------------------


def test_replacements_are_distinct_writable_and_not_lost():
    metadata = ledger([(0, "abc")])
    fragments = [f for _, f in fragments_on(metadata, {"a", "b"})]
    writable = {"c": None, "d": None, "e": None}
    chosen = choose_replacements(metadata, fragments, writable, {"a", "b"}, rng=random.Random(1))
    assert sorted(chosen) == ["d", "e"]
    with pytest.raises(NotEnoughBookiesError):
        choose_replacements(metadata, fragments, {"c": None, "d": None}, {"a", "b"}, rng=random.Random(1))


def test_replacements_honour_racks():
    metadata = ledger([(0, ("a", "b", "c"))], write_quorum=3)
    writable = {"b": "r2", "c": "r3", "d": "r2", "e": "r1", "f": "r3"}
    fragments = [f for _, f in fragments_on(metadata, {"a"})]
    for seed in range(10):
        assert choose_replacements(metadata, fragments, writable, {"a"}, rng=random.Random(seed)) == ["e"]


def test_apply_replacements_skips_slots_that_changed_meanwhile():
    metadata = ledger([(0, "abc"), (5, "dbc")])
    wanted = [Replacement(0, 1, "b", "e"), Replacement(5, 1, "b", "e")]
    changed = apply_replacements(metadata, wanted)
    assert changed.ensembles == ((0, ("a", "e", "c")), (5, ("d", "e", "c")))
    assert changed.state is LedgerState.CLOSED
    assert apply_replacements(changed, wanted) is None  # done already: nothing to write
    # Another worker put "f" in the first slot: only the second changes.
    other = metadata.with_bookie_replaced(0, 1, "b", "f")
    assert apply_replacements(other, wanted).ensembles == ((0, ("a", "f", "c")), (5, ("d", "e", "c")))


def test_the_writers_last_ensemble_and_a_ledger_in_recovery_are_never_changed():
    open_ledger = ledger([(0, "abc"), (5, "dbc")], state=LedgerState.OPEN)
    with pytest.raises(LedgerStateError):
        open_ledger.with_bookie_replaced(5, 1, "b", "e")
    assert apply_replacements(open_ledger, [Replacement(5, 1, "b", "e")]) is None
    recovering = open_ledger.with_recovery_started()
    assert apply_replacements(recovering, [Replacement(0, 1, "b", "e")]) is None
    with pytest.raises(ValueError):
        open_ledger.with_bookie_replaced(0, 1, "a", "e")  # "a" is not there


def test_the_password_is_found_among_the_configured_ones():
    metadata = ledger([(0, "abc")])  # password b"pw"
    assert password_for(metadata, [b"", b"pw"]) == b"pw"
    assert password_for(metadata, [b"", b"other"]) is None


# --- retries --------------------------------------------------------------------------


def test_backoff_doubles_to_its_ceiling_and_forgets_unmarked_ledgers():
    backoff = RetryBackoff(delay_ms_initial=100, delay_ms_max=400, jitter_ratio=0)
    rng = random.Random(0)
    assert [backoff.failed(1, 0, rng) for _ in range(4)] == [100, 200, 400, 400]
    assert backoff.ready([1, 2], 399) == [2]
    assert backoff.ready([1, 2], 400) == [1, 2]
    backoff.wait_until(2, 5_000)
    assert backoff.next_ready_ms() == 400
    assert backoff.ready([1], 0) == []  # 2 is no longer marked: forgotten
    assert backoff.next_ready_ms() == 400
    backoff.started(1)  # an attempt began: its time is spent, its failures kept
    assert backoff.next_ready_ms() is None and backoff.ready([1], 0) == [1]
    assert backoff.failed(1, 0, rng) == 400
    backoff.succeeded(1)
    assert backoff.failed(1, 0, rng) == 100


# --- markers, locks and the switch in the metadata store ------------------------------


@pytest.fixture
def store():
    server = InMemoryMetadataServer()
    with server.connect(session_timeout_ms=10_000) as connection:
        yield connection


def test_markers_keep_their_first_time_and_gather_bookies(store):
    layout = ClusterLayout()
    underreplication.ensure_paths(store, layout)
    assert underreplication.mark(store, layout, 12, frozenset({"a"}), 1_000, "auditor-1")
    assert not underreplication.mark(store, layout, 12, frozenset({"a"}), 2_000, "auditor-1")
    assert underreplication.mark(store, layout, 12, frozenset({"b"}), 3_000, "auditor-2")
    marker, version = underreplication.read_marker(store, layout, 12)
    assert marker.lost_bookies == {"a", "b"} and marker.marked_ms == 1_000
    assert marker.lost_since_ms == {"a": 1_000, "b": 3_000}  # each bookie since its own marking
    assert store.exists("/underreplication/ledgers/12") is not None  # the layout others count
    assert underreplication.marked_ledgers(store, layout) == [12]
    # A worker that read an older version does not delete a newer marking.
    assert not underreplication.unmark(store, layout, 12, version - 1)
    assert underreplication.unmark(store, layout, 12, version)
    assert underreplication.read_marker(store, layout, 12) is None


def test_locks_are_exclusive_and_ephemeral():
    server = InMemoryMetadataServer()
    layout = ClusterLayout()
    first = server.connect(session_timeout_ms=10_000)
    with server.connect(session_timeout_ms=10_000) as second:
        assert underreplication.try_lock(first, layout, 5, "worker-1")
        assert not underreplication.try_lock(second, layout, 5, "worker-2")
        assert underreplication.locks(second, layout) == {5: "worker-1"}
        first.close()  # its session ends: the lock goes with it
        assert underreplication.try_lock(second, layout, 5, "worker-2")
        underreplication.unlock(second, layout, 5)
        assert underreplication.locks(second, layout) == {}


def test_markers_of_the_first_version_read_with_the_marking_time_for_every_bookie():
    marker = underreplication.Marker.from_bytes(3, b'{"lost_bookies": ["a", "b"], "marked_ms": 5.0, "auditor": "x"}')
    assert marker.lost_since_ms == {"a": 5.0, "b": 5.0}
    assert underreplication.Marker.from_bytes(3, b"garbage").lost_bookies == frozenset()


def test_a_lock_left_by_a_failed_unlock_is_still_ours_and_released_later():
    # ZooKeeper unreachable for a moment (shorter than the session): the
    # unlock fails, the ephemeral lock stays with our live session.
    server = InMemoryMetadataServer()
    layout = ClusterLayout()
    ours = server.connect(session_timeout_ms=10_000)
    with server.connect(session_timeout_ms=10_000) as other:
        assert underreplication.try_lock(ours, layout, 5, "worker-1")
        ours.suspend()
        with pytest.raises(ConnectionLossError):
            underreplication.unlock(ours, layout, 5)
        ours.resume(0)
        assert underreplication.try_lock(ours, layout, 5, "worker-1")  # ours: taken again
        assert not underreplication.try_lock(other, layout, 5, "worker-2")
        underreplication.unlock(other, layout, 5)  # not its lock: left alone
        assert underreplication.locks(other, layout) == {5: "worker-1"}
        underreplication.unlock(ours, layout, 5)  # the later try
        assert underreplication.try_lock(other, layout, 5, "worker-2")
        # Our session ended meanwhile and another worker holds it: our
        # pending unlock must not take its lock away.
        server.expire_session(ours.session_id)
        underreplication.unlock(ours, layout, 5)
        assert underreplication.locks(other, layout) == {5: "worker-2"}
    ours.close()


def test_the_switch_is_one_node(store):
    layout = ClusterLayout()
    assert underreplication.is_enabled(store, layout)
    underreplication.set_enabled(store, layout, False)
    underreplication.set_enabled(store, layout, False)
    assert store.exists("/underreplication/disabled") is not None
    assert not underreplication.is_enabled(store, layout)
    underreplication.set_enabled(store, layout, True)
    assert underreplication.is_enabled(store, layout)


def test_the_scan_lists_every_ledgers_bookies(store):
    ledgers = LedgerStore(store)
    first, _ = ledgers.create(ledger_metadata_for)
    second, _ = ledgers.create(lambda ledger_id: replace(ledger_metadata_for(ledger_id), ensembles=((0, ("b4", "b2", "b3")),)))
    assert underreplication.ensemble_bookies(ledgers) == {
        first.ledger_id: {"b1", "b2", "b3"}, second.ledger_id: {"b4", "b2", "b3"},
    }
