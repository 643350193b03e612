"""The bookie request core, driven by hand with event sequences: no trio, no
files. Each test is a short story of requests, journal syncs and reads."""

from __future__ import annotations

import pytest

from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from bookie.protocol import (
    LAST_ADD_CONFIRMED,
    AddBatchRequest,
    AddBatchResponse,
    AddFlag,
    AddRequest,
    AddResponse,
    BatchReadRequest,
    GetInfoRequest,
    ListEntriesRequest,
    ReadFlag,
    ReadLacRequest,
    ReadRequest,
    Status,
)
from bookie.core_actions import AppendJournal, CoreLimits, DurableAdd, ListEntries, ReadEntries, Respond, StoreEntry
from bookie.request_core import BookieCore
from bookie.storage_interfaces import LedgerStateRecord, ReadOutcome, RecordKind

KEY = master_key(b"pw")
OTHER_KEY = master_key(b"other")
LEDGER = 7


def entry(entry_id: int, lac: int | None = None, ledger_id: int = LEDGER) -> bytes:
    digest = DigestManager(ledger_id, DigestType.CRC32C, b"pw")
    return digest.encode(entry_id, entry_id - 1 if lac is None else lac, entry_id + 1, b"x")


def add(request_id: int, entry_id: int, *, key: bytes = KEY, recovery: bool = False, lac: int | None = None) -> AddRequest:
    flags = AddFlag.RECOVERY_ADD if recovery else AddFlag.NONE
    return AddRequest(request_id, flags, key, entry(entry_id, lac))


def of(actions, kind):
    return [action for action in actions if isinstance(action, kind)]


def responses(actions):
    """The answers the actions send: a DurableAdd answers OK once stored
    (one of an ADD_BATCH leaves that to the batch's Respond)."""
    answers = []
    for action in actions:
        if isinstance(action, Respond):
            answers.append(action.response)
        elif isinstance(action, DurableAdd) and action.batch is None:
            answers.append(AddResponse(action.request_id, Status.OK, action.ledger_id, action.entry_id))
    return answers


def tokens(actions):
    return [action.token for action in of(actions, AppendJournal) if action.token]


def durable_add(core: BookieCore, entry_id: int, *, connection_id: int = 1, lac: int | None = None) -> list:
    """Add an entry and report its journal record durable."""
    actions = core.receive(connection_id, add(entry_id + 100, entry_id, lac=lac), 0)
    return core.journal_synced(tokens(actions), 0)


def test_an_add_is_answered_only_after_its_journal_record_is_durable():
    core = BookieCore(bookie_id="b1")
    actions = core.receive(1, add(1, 0), now_ms=0)
    # First sight of the ledger: its master key is journalled ahead of the add.
    journal = of(actions, AppendJournal)
    assert [record.record.kind for record in journal] == [RecordKind.MASTER_KEY, RecordKind.ADD]
    assert responses(actions) == []
    assert core.adds_in_flight == 1

    synced = core.journal_synced(tokens(actions), now_ms=1)
    # One action: store the entry, then answer OK (so a reader told OK can read it).
    (durable,) = synced
    assert isinstance(durable, DurableAdd)
    assert (durable.ledger_id, durable.entry_id, durable.data) == (LEDGER, 0, entry(0))
    assert responses(synced) == [AddResponse(1, Status.OK, LEDGER, 0)]
    assert core.adds_in_flight == 0


def test_lac_follows_the_highest_piggybacked_value():
    core = BookieCore(bookie_id="b1")
    for entry_id in range(5):
        durable_add(core, entry_id)
    assert core.ledgers[LEDGER].last_add_confirmed == 3
    # A late entry carrying an older LAC never moves it back.
    durable_add(core, 9, lac=1)
    assert core.ledgers[LEDGER].last_add_confirmed == 3
    response = responses(core.receive(2, ReadLacRequest(1, LEDGER), 0))[0]
    assert (response.status, response.last_add_confirmed) == (Status.OK, 3)


def test_wrong_master_key_is_unauthorized_for_adds_and_fences():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    assert responses(core.receive(1, add(2, 1, key=OTHER_KEY), 0))[0].status is Status.UNAUTHORIZED
    fence = ReadRequest(3, ReadFlag.FENCE, LEDGER, LAST_ADD_CONFIRMED, OTHER_KEY)
    assert responses(core.receive(1, fence, 0))[0].status is Status.UNAUTHORIZED
    assert not core.ledgers[LEDGER].fenced


def test_fencing_answers_after_the_fence_is_durable_and_then_rejects_normal_adds():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    durable_add(core, 1)
    fence = ReadRequest(5, ReadFlag.FENCE, LEDGER, LAST_ADD_CONFIRMED, KEY)
    actions = core.receive(2, fence, 0)
    assert [a.record.kind for a in of(actions, AppendJournal)] == [RecordKind.FENCE]
    assert responses(actions) == [] and of(actions, ReadEntries) == []
    # Adds are refused from the moment the fence is seen, not only once durable.
    assert responses(core.receive(1, add(6, 2), 0))[0].status is Status.FENCED

    synced = core.journal_synced(tokens(actions), 0)
    (read,) = of(synced, ReadEntries)
    assert (read.ledger_id, read.first_entry_id) == (LEDGER, 0)  # the LAC entry
    answer = responses(core.read_completed(read.token, ReadOutcome([entry(0)], False)))[0]
    assert (answer.status, answer.entry_id, answer.last_add_confirmed, answer.entry) == (Status.OK, 0, 0, entry(0))

    # Recovery adds still pass.
    recovery = core.receive(3, add(7, 2, recovery=True), 0)
    assert responses(core.journal_synced(tokens(recovery), 0))[0].status is Status.OK


def test_an_add_journalled_before_the_fence_is_still_acknowledged_and_applied_first():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    pending_add = core.receive(1, add(1, 1), 0)
    fence = core.receive(2, ReadRequest(2, ReadFlag.FENCE, LEDGER, LAST_ADD_CONFIRMED, KEY), 0)
    synced = core.journal_synced(tokens(pending_add) + tokens(fence), 0)
    # The add was admitted before the fence: it is durable, stored and acked,
    # and the fencing read is issued only after it was stored.
    kinds = [type(action).__name__ for action in synced]
    assert kinds == ["DurableAdd", "ReadEntries"]
    assert responses(synced)[0].status is Status.OK


def test_fencing_a_ledger_never_seen_creates_it_fenced():
    core = BookieCore(bookie_id="b1")
    actions = core.receive(1, ReadRequest(1, ReadFlag.FENCE, LEDGER, LAST_ADD_CONFIRMED, KEY), 0)
    assert [a.record.kind for a in of(actions, AppendJournal)] == [RecordKind.MASTER_KEY, RecordKind.FENCE]
    synced = core.journal_synced(tokens(actions), 0)
    # LAC -1: nothing to read, answered at once.
    assert responses(synced)[0].status is Status.NO_ENTRY
    assert core.reads_in_flight == 0
    # The slow writer's first add here is refused.
    assert responses(core.receive(2, add(2, 0), 0))[0].status is Status.FENCED


def test_a_fence_needs_a_master_key():
    core = BookieCore(bookie_id="b1")
    assert responses(core.receive(1, ReadRequest(1, ReadFlag.FENCE, LEDGER, 0, None), 0))[0].status is Status.BAD_REQUEST


def test_unreadable_stored_entry_is_io_error_never_no_entry():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    (read,) = of(core.receive(1, ReadRequest(1, ReadFlag.NONE, LEDGER, 0), 0), ReadEntries)
    assert responses(core.read_completed(read.token, ReadOutcome([], True)))[0].status is Status.IO_ERROR
    (read,) = of(core.receive(1, ReadRequest(2, ReadFlag.NONE, LEDGER, 5), 0), ReadEntries)
    assert responses(core.read_completed(read.token, ReadOutcome([], False)))[0].status is Status.NO_ENTRY


def test_reads_of_unknown_ledgers_are_no_ledger():
    core = BookieCore(bookie_id="b1")
    for request in (
        ReadRequest(1, ReadFlag.NONE, 99, 0),
        ReadLacRequest(2, 99),
        BatchReadRequest(3, 99, 0, 10, 1000),
        ListEntriesRequest(4, 99, 0, 10),
    ):
        assert responses(core.receive(1, request, 0))[0].status is Status.NO_LEDGER


def test_batch_read_returns_what_was_read_before_a_corrupt_entry():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    (read,) = of(core.receive(1, BatchReadRequest(1, LEDGER, 0, 100, 10**6), 0), ReadEntries)
    answer = responses(core.read_completed(read.token, ReadOutcome([entry(0), entry(1)], True)))[0]
    assert (answer.status, answer.entries) == (Status.OK, [entry(0), entry(1)])
    (read,) = of(core.receive(1, BatchReadRequest(2, LEDGER, 2, 100, 10**6), 0), ReadEntries)
    assert responses(core.read_completed(read.token, ReadOutcome([], True)))[0].status is Status.IO_ERROR


def test_batch_read_bounds_are_capped_by_the_core_limits():
    core = BookieCore(bookie_id="b1", limits=CoreLimits(batch_read_entries_max=10, batch_read_bytes_max=5000))
    durable_add(core, 0)
    (read,) = of(core.receive(1, BatchReadRequest(1, LEDGER, 0, 10**6, 10**9), 0), ReadEntries)
    assert (read.entries_max, read.bytes_max) == (10, 5000)


def test_long_poll_waits_for_the_lac_to_pass_the_previous_value():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    durable_add(core, 1)  # LAC 0
    poll = ReadRequest(9, ReadFlag.NONE, LEDGER, 1, previous_lac=0, timeout_ms=1000)
    assert core.receive(5, poll, now_ms=100) == []
    assert core.waiter_count == 1 and core.next_deadline_ms() == 1100
    woken = durable_add(core, 2)  # LAC 1 now
    (read,) = of(woken, ReadEntries)
    assert read.first_entry_id == 1
    answer = responses(core.read_completed(read.token, ReadOutcome([entry(1)], False)))[0]
    assert (answer.request_id, answer.status, answer.last_add_confirmed) == (9, Status.OK, 1)
    assert core.waiter_count == 0


def test_long_poll_times_out_with_the_unchanged_lac():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    durable_add(core, 1)
    core.receive(5, ReadRequest(9, ReadFlag.NONE, LEDGER, 1, previous_lac=0, timeout_ms=50), now_ms=0)
    assert core.tick(now_ms=49) == []
    (read,) = of(core.tick(now_ms=50), ReadEntries)
    answer = responses(core.read_completed(read.token, ReadOutcome([], False)))[0]
    assert (answer.status, answer.last_add_confirmed) == (Status.NO_ENTRY, 0)


def test_long_poll_that_is_already_satisfied_reads_at_once():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    durable_add(core, 1)
    actions = core.receive(5, ReadRequest(9, ReadFlag.NONE, LEDGER, 0, previous_lac=-1, timeout_ms=1000), 0)
    assert len(of(actions, ReadEntries)) == 1 and core.waiter_count == 0


def test_closing_a_connection_drops_its_long_polls():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    core.receive(5, ReadRequest(9, ReadFlag.NONE, LEDGER, 1, previous_lac=5, timeout_ms=1000), 0)
    core.receive(6, ReadRequest(10, ReadFlag.NONE, LEDGER, 1, previous_lac=5, timeout_ms=1000), 0)
    core.connection_closed(5)
    assert core.waiter_count == 1
    assert len(of(core.tick(now_ms=2000), ReadEntries)) == 1  # only connection 6's


def test_in_flight_bounds_answer_too_many_requests():
    core = BookieCore(bookie_id="b1", limits=CoreLimits(adds_in_flight_max=2, reads_in_flight_max=1, long_poll_waiters_max=1))
    first = core.receive(1, add(1, 0), 0)
    core.receive(1, add(2, 1), 0)
    assert responses(core.receive(1, add(3, 2), 0))[0].status is Status.TOO_MANY_REQUESTS
    core.journal_synced(tokens(first), 0)
    assert responses(core.receive(1, add(4, 3), 0)) == []  # room again
    core.receive(1, ReadRequest(5, ReadFlag.NONE, LEDGER, 0), 0)
    assert responses(core.receive(1, ReadRequest(6, ReadFlag.NONE, LEDGER, 0), 0))[0].status is Status.TOO_MANY_REQUESTS
    core.receive(1, ReadRequest(7, ReadFlag.NONE, LEDGER, 9, previous_lac=9, timeout_ms=10), 0)
    poll = ReadRequest(8, ReadFlag.NONE, LEDGER, 9, previous_lac=9, timeout_ms=10)
    assert responses(core.receive(1, poll, 0))[0].status is Status.TOO_MANY_REQUESTS


def test_read_only_refuses_adds_but_serves_reads_and_fences():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    core.set_read_only(True)
    assert responses(core.receive(1, add(1, 1), 0))[0].status is Status.READ_ONLY
    assert responses(core.receive(1, add(2, 1, recovery=True), 0))[0].status is Status.READ_ONLY
    assert len(of(core.receive(1, ReadRequest(3, ReadFlag.NONE, LEDGER, 0), 0), ReadEntries)) == 1
    fence = core.receive(1, ReadRequest(4, ReadFlag.FENCE, LEDGER, 0, KEY), 0)
    assert [a.record.kind for a in of(fence, AppendJournal)] == [RecordKind.FENCE]
    assert core.describe()["read_only"] is True


def test_adds_wait_while_the_write_cache_is_full_then_proceed_or_time_out():
    core = BookieCore(bookie_id="b1", limits=CoreLimits(write_cache_wait_ms_max=100))
    durable_add(core, 0)
    core.set_adds_paused(True, now_ms=0)
    assert core.receive(1, add(1, 1), now_ms=0) == []
    assert core.receive(1, add(2, 2), now_ms=50) == []
    assert core.next_deadline_ms() == 100
    expired = responses(core.tick(now_ms=100))
    assert [(r.request_id, r.status) for r in expired] == [(1, Status.TOO_MANY_REQUESTS)]
    resumed = core.set_adds_paused(False, now_ms=120)
    assert [a.record.entry_id for a in of(resumed, AppendJournal)] == [2]
    assert core.adds_in_flight == 1


def test_journal_failure_answers_io_error():
    core = BookieCore(bookie_id="b1")
    actions = core.receive(1, add(1, 0), 0)
    fence = core.receive(1, ReadRequest(2, ReadFlag.FENCE, LEDGER, 0, KEY), 0)
    failed = responses(core.journal_failed(tokens(actions) + tokens(fence)))
    assert [r.status for r in failed] == [Status.IO_ERROR, Status.IO_ERROR]
    assert core.adds_in_flight == 0 and core.reads_in_flight == 0


def test_malformed_entries_and_missing_keys_are_bad_requests():
    core = BookieCore(bookie_id="b1")
    assert responses(core.receive(1, AddRequest(1, 0, KEY, b"short"), 0))[0].status is Status.BAD_REQUEST
    assert responses(core.receive(1, AddRequest(2, 0, b"", entry(0)), 0))[0].status is Status.BAD_REQUEST
    list_backwards = ListEntriesRequest(3, LEDGER, 5, 1)
    durable_add(core, 0)
    assert responses(core.receive(1, list_backwards, 0))[0].status is Status.BAD_REQUEST


def test_list_entries_answers_runs():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    (listing,) = of(core.receive(1, ListEntriesRequest(1, LEDGER, 0, 100), 0), ListEntries)
    answer = responses(core.list_completed(listing.token, [0, 1, 2, 5, 7, 8], False))[0]
    assert answer.ranges == [(0, 2), (5, 5), (7, 8)]


def test_replay_rebuilds_state_and_returns_entries_to_store():
    from bookie.storage_interfaces import JournalRecord

    core = BookieCore(bookie_id="b1")
    assert core.replay(JournalRecord(RecordKind.MASTER_KEY, LEDGER, -1, KEY)) == []
    stored = core.replay(JournalRecord(RecordKind.ADD, LEDGER, 3, entry(3)))
    assert stored == [StoreEntry(LEDGER, 3, entry(3))]
    core.replay(JournalRecord(RecordKind.FENCE, LEDGER, -1, b""))
    assert core.ledgers[LEDGER] == LedgerStateRecord(KEY, True, 2)
    assert core.take_dirty_ledger_states() == {LEDGER: LedgerStateRecord(KEY, True, 2)}
    assert core.take_dirty_ledger_states() == {}


def test_get_info_reports_mode_and_counts():
    core = BookieCore(bookie_id="b1")
    core.info["free_bytes"] = 123
    durable_add(core, 0)
    info = responses(core.receive(1, GetInfoRequest(1), 0))[0].info
    assert info["bookie_id"] == "b1" and info["ledgers"] == 1 and info["free_bytes"] == 123 and info["read_only"] is False


@pytest.mark.parametrize("bad", [0, -1])
def test_limits_must_be_positive(bad):
    with pytest.raises(ValueError):
        CoreLimits(adds_in_flight_max=bad)


# --- ADD_BATCH -------------------------------------------------------------------


def batch(request_id: int, *adds: AddRequest) -> AddBatchRequest:
    """The adds as one ADD_BATCH (their own request ids are not sent)."""
    return AddBatchRequest(request_id, [field for a in adds for field in (a.flags, a.master_key, a.entry)])


def batch_answer(actions) -> AddBatchResponse | None:
    answers = [r for r in responses(actions) if isinstance(r, AddBatchResponse)]
    assert len(answers) <= 1
    return answers[0] if answers else None


def test_a_batch_is_answered_once_all_its_adds_are_durable_and_after_they_are_stored():
    core = BookieCore(bookie_id="b1")
    actions = core.receive(1, batch(9, add(0, 0), add(0, 1), add(0, 2, lac=0)), now_ms=0)
    assert [a.record.kind for a in of(actions, AppendJournal)] == [RecordKind.MASTER_KEY] + [RecordKind.ADD] * 3
    assert responses(actions) == [] and core.adds_in_flight == 3
    journalled = tokens(actions)
    first_two = core.journal_synced(journalled[:2], 0)
    assert [type(a) for a in first_two] == [DurableAdd, DurableAdd]  # stored, not answered yet
    synced = core.journal_synced(journalled[2:], 0)
    # The last add is stored, then the batch answered: OK for all three.
    assert [type(a) for a in synced] == [DurableAdd, Respond]
    assert synced[1].response == AddBatchResponse(9, [Status.OK] * 3) and synced[1].connection_id == 1
    assert core.adds_in_flight == 0 and core.ledgers[LEDGER].last_add_confirmed == 0


def test_each_add_of_a_batch_is_judged_alone_and_the_answer_lists_every_status():
    core = BookieCore(bookie_id="b1", limits=CoreLimits(adds_in_flight_max=3))
    durable_add(core, 0)
    fenced = 8
    core.receive(1, ReadRequest(1, ReadFlag.FENCE, fenced, 0, KEY), 0)  # creates ledger 8, fenced
    adds = [
        add(0, 1),
        AddRequest(0, 0, KEY, entry(0, ledger_id=fenced)),  # fenced
        AddRequest(0, 0, KEY, b"short"),  # malformed
        AddRequest(0, 0, OTHER_KEY, entry(2)),  # another key
        AddRequest(0, AddFlag.RECOVERY_ADD, KEY, entry(1, ledger_id=fenced)),  # a recovery add passes the fence
        add(0, 2),
        add(0, 3),  # past the in-flight bound of 3 (with the fence's none and two adds before)
    ]
    actions = core.receive(1, batch(5, *adds), 0)
    assert batch_answer(actions) is None
    assert [a.record.entry_id for a in of(actions, AppendJournal)] == [1, 1, 2]
    synced = core.journal_synced(tokens(actions), 0)
    assert batch_answer(synced) == AddBatchResponse(5, [
        Status.OK, Status.FENCED, Status.BAD_REQUEST, Status.UNAUTHORIZED, Status.OK, Status.OK, Status.TOO_MANY_REQUESTS,
    ])


def test_a_batch_refused_whole_is_answered_at_once():
    core = BookieCore(bookie_id="b1")
    core.set_read_only(True)
    assert batch_answer(core.receive(1, batch(3, add(0, 0), add(0, 1)), 0)) == AddBatchResponse(3, [Status.READ_ONLY] * 2)


def test_a_journal_failure_fails_the_batch_adds_still_waiting_for_it():
    core = BookieCore(bookie_id="b1")
    actions = core.receive(1, batch(4, add(0, 0), add(0, 1)), 0)
    first, second = tokens(actions)
    assert batch_answer(core.journal_synced([first], 0)) is None
    assert batch_answer(core.journal_failed([second])) == AddBatchResponse(4, [Status.OK, Status.IO_ERROR])
    assert core.adds_in_flight == 0


def test_batch_adds_wait_for_write_cache_room_then_proceed_or_time_out():
    core = BookieCore(bookie_id="b1", limits=CoreLimits(write_cache_wait_ms_max=100))
    durable_add(core, 0)
    core.set_adds_paused(True, now_ms=0)
    assert core.receive(1, batch(6, add(0, 1), add(0, 2)), now_ms=0) == []
    later = core.receive(1, batch(7, add(0, 3)), now_ms=50)
    assert later == []
    assert batch_answer(core.tick(now_ms=100)) == AddBatchResponse(6, [Status.TOO_MANY_REQUESTS] * 2)
    resumed = core.set_adds_paused(False, now_ms=120)
    assert [a.record.entry_id for a in of(resumed, AppendJournal)] == [3]
    assert batch_answer(core.journal_synced(tokens(resumed), 120)) == AddBatchResponse(7, [Status.OK])


def test_a_batch_of_a_closed_connection_is_never_answered():
    core = BookieCore(bookie_id="b1")
    durable_add(core, 0)
    core.set_adds_paused(True, now_ms=0)
    assert core.receive(2, batch(6, add(0, 1)), now_ms=0) == []
    core.connection_closed(2)
    assert core.adds_in_flight == 0
    assert core.set_adds_paused(False, now_ms=1) == [] and core.tick(now_ms=10_000) == []
