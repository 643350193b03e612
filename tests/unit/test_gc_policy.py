"""The pure garbage-collection decisions: which entry logs to delete or
compact, which ledgers count as deleted after rounds of metadata listings;
the entry logs' usage as staging counts it; finding absent ledgers in a
metadata store; and which ledgers the request core lets go."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bookie.entry_log import FileEntryLog
from bookie.garbage_collector import find_absent_ledgers
from bookie.gc_policy import DeletedLedgerDetector, live_ratio, plan_entry_logs
from bookie.protocol import AddFlag, AddRequest, ReadFlag, ReadRequest
from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from bookie.core_actions import AppendJournal, ReadEntries
from bookie.request_core import BookieCore
from bookie.sim_storage import SimEntryLog
from bookie.storage_interfaces import EntryLogUsage, ReadOutcome
from coordination.cluster_layout import ledger_path
from coordination.memory_store import InMemoryMetadataServer
from coordination.store import ConnectionLossError

MIB = 1024 * 1024


def usage(total: int, **ledgers: int) -> EntryLogUsage:
    """Usage of a log from keyword arguments like l7=300 (ledger 7, 300 bytes)."""
    return EntryLogUsage(total, {int(name[1:]): size for name, size in ledgers.items()})


def plan(logs, live, *, writing=None, threshold=0.5, bytes_max=MIB):
    return plan_entry_logs(logs, live, writing_log_id=writing, compaction_threshold=threshold, compaction_bytes_max=bytes_max)


# --- which entry logs ---------------------------------------------------------------


def test_a_log_whose_ledgers_are_all_deleted_is_deleted_and_a_sparse_one_compacted():
    logs = {
        1: usage(1000, l1=500, l2=500),  # both deleted
        2: usage(1000, l3=100, l2=900),  # 10% live
        3: usage(1000, l3=600, l4=400),  # all live
        4: usage(1000, l4=450, l1=550),  # 45% live
    }
    result = plan(logs, live={3, 4})
    assert result.delete == [1]
    assert result.compact == [2, 4]  # least live first


def test_the_log_being_written_is_never_touched():
    logs = {1: usage(1000, l1=1000), 2: usage(1000, l1=100, l2=900)}
    result = plan(logs, live={2}, writing=1)
    assert result.delete == [] and result.compact == []
    assert plan(logs, live=set(), writing=2).delete == [1]


def test_the_threshold_decides_and_zero_turns_compaction_off():
    logs = {1: usage(1000, l1=200, l2=800)}  # 20% live
    assert plan(logs, live={1}, threshold=0.2).compact == []  # strictly below
    assert plan(logs, live={1}, threshold=0.21).compact == [1]
    assert plan(logs, live={1}, threshold=0).compact == []
    assert plan(logs, live=set(), threshold=0).delete == [1]  # deletion needs no compaction
    with pytest.raises(ValueError):
        plan(logs, live={1}, threshold=1.5)


def test_a_damaged_log_is_not_compacted_but_still_deleted_once_its_ledgers_are():
    logs = {1: usage(1000, l1=100, l2=900)}
    keep = {"writing_log_id": None, "compaction_threshold": 0.5, "compaction_bytes_max": MIB, "uncompactable": {1}}
    assert plan_entry_logs(logs, {1}, **keep).compact == []
    assert plan_entry_logs(logs, set(), **keep).delete == [1]


def test_compaction_copies_within_its_byte_bound_but_always_takes_one_log():
    logs = {1: usage(1000, l1=300), 2: usage(1000, l1=100), 3: usage(1000, l1=200)}
    assert plan(logs, live={1}, bytes_max=250).compact == [2]  # 100 fits, then 200 would not
    assert plan(logs, live={1}, bytes_max=350).compact == [2, 3]
    assert plan(logs, live={1}, bytes_max=10).compact == [2]  # over the bound, still one


def test_live_ratio_of_an_empty_log_is_zero_and_never_above_one():
    assert live_ratio(EntryLogUsage(), {1}) == 0.0
    assert live_ratio(usage(100, l1=150), {1}) == 1.0


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.integers(1, 20),
        st.dictionaries(st.integers(1, 6), st.integers(1, 1000), max_size=4),
        max_size=12,
    ),
    st.sets(st.integers(1, 6)),
    st.one_of(st.none(), st.integers(1, 20)),
    st.floats(0, 1),
)
def test_a_plan_never_deletes_live_data_nor_touches_the_writing_log(ledgers_by_log, live, writing, threshold):
    logs = {log_id: EntryLogUsage(sum(sizes.values()) + 10, dict(sizes)) for log_id, sizes in ledgers_by_log.items()}
    result = plan(logs, live, writing=writing, threshold=threshold)
    assert writing not in result.delete + result.compact
    assert not set(result.delete) & set(result.compact)
    for log_id in result.delete:
        assert not set(logs[log_id].ledger_bytes) & live
    for log_id in result.compact:
        assert 0 < live_ratio(logs[log_id], live) < threshold


# --- which ledgers are deleted -------------------------------------------------------------


def test_a_ledger_is_dropped_only_after_two_rounds_confirm_it_absent():
    detector = DeletedLedgerDetector()
    assert detector.round({1, 2, 3}, {2}) == set()
    assert detector.round({1, 2, 3}, {2, 3}) == {2}  # 3 is absent for the first time
    assert detector.round({1, 3}, {3}) == {3}


def test_a_ledger_listed_again_starts_over():
    detector = DeletedLedgerDetector()
    detector.round({1}, {1})
    detector.round({1}, set())  # the listing had it after all (a lagging server)
    assert detector.round({1}, {1}) == set()
    assert detector.round({1}, {1}) == {1}


def test_a_ledger_kept_because_it_was_busy_is_dropped_the_next_round():
    detector = DeletedLedgerDetector(absent_rounds_to_drop=1)
    assert detector.round({5}, {5}) == {5}
    assert detector.round({5}, {5}) == {5}  # still known: asked for again


def test_only_ledgers_known_before_the_listing_can_be_confirmed_absent():
    with pytest.raises(ValueError):
        DeletedLedgerDetector().round({1}, {2})


# --- finding absent ledgers in a metadata store ------------------------------------------------


@pytest.fixture
def metadata():
    """A metadata store (in memory) for ledger nodes."""
    server = InMemoryMetadataServer()
    store = server.connect(session_timeout_ms=10_000)
    yield store
    store.close()


def create_ledger_node(store, ledger_id: int) -> None:
    store.create(ledger_path(ledger_id), b"{}", make_parents=True)


def test_absent_ledgers_are_those_missing_from_the_listing_and_a_direct_read(metadata):
    for ledger_id in (1, 5, 10_001, 20_000_000):
        create_ledger_node(metadata, ledger_id)
    assert find_absent_ledgers(metadata, {1, 2, 5, 10_000, 10_001, 20_000_000, 30_000_000}) == {2, 10_000, 30_000_000}
    assert find_absent_ledgers(metadata, set()) == set()


class LedgerCreatedDuringListing:
    """A store whose listing misses a ledger that is created while it runs:
    the direct read must find it."""

    def __init__(self, store, ledger_id: int) -> None:
        self.store = store
        self.ledger_id = ledger_id

    def children(self, path):
        names = self.store.children(path)
        if path == "/ledgers/000/0000/0000/0000":
            create_ledger_node(self.store, self.ledger_id)  # too late for this listing
        return names

    def get(self, path):
        return self.store.get(path)


def test_a_ledger_created_while_the_listing_runs_is_not_absent(metadata):
    create_ledger_node(metadata, 1)
    assert find_absent_ledgers(LedgerCreatedDuringListing(metadata, 7), {1, 7}) == set()


class FailingStore:
    def __init__(self, store, fail_on: str) -> None:
        self.store = store
        self.fail_on = fail_on

    def children(self, path):
        if self.fail_on == "children":
            raise ConnectionLossError("ZooKeeper unreachable")
        return self.store.children(path)

    def get(self, path):
        if self.fail_on == "get":
            raise ConnectionLossError("ZooKeeper unreachable")
        return self.store.get(path)


@pytest.mark.parametrize("fail_on", ["children", "get"])
def test_a_failing_store_raises_rather_than_calling_ledgers_absent(metadata, fail_on):
    create_ledger_node(metadata, 1)
    with pytest.raises(ConnectionLossError):
        find_absent_ledgers(FailingStore(metadata, fail_on), {1, 2})


# --- entry log usage, as staging counts it --------------------------------------------------


def test_staging_counts_each_ledgers_bytes_per_log_across_a_roll(tmp_path):
    entry_log = FileEntryLog(tmp_path, log_bytes_max=MIB)
    entry_bytes = 100 * 1024
    buffer = {1: {e: bytes([e]) * entry_bytes for e in range(6)}, 2: {e: b"x" * entry_bytes for e in range(6)}}
    locations = [location for chunk in entry_log.stage_buffer(buffer, 4) for location in chunk]
    staged = entry_log.take_staged_usage()
    expected: dict[int, dict[int, int]] = {}
    for ledger_id, _, log_id, _, size in locations:
        expected.setdefault(log_id, {}).setdefault(ledger_id, 0)
        expected[log_id][ledger_id] += size
    assert len(expected) == 2, "the buffer should span two logs"
    assert staged == expected
    assert entry_log.take_staged_usage() == {}
    entry_log.write_staged()
    for log_id, ledgers in staged.items():
        assert entry_log.log_bytes(log_id) == sum(ledgers.values())
    entry_log.close()


def test_single_appends_are_counted_too(tmp_path):
    for entry_log in (FileEntryLog(tmp_path, log_bytes_max=MIB), SimEntryLog(log_entries_max=2)):
        appended = [(3, entry_log.append(3, 0, b"a" * 10)), (3, entry_log.append(3, 1, b"b" * 20)), (4, entry_log.append(4, 0, b"c" * 30))]
        expected: dict[int, dict[int, int]] = {}
        for ledger_id, location in appended:
            expected.setdefault(location.log_id, {}).setdefault(ledger_id, 0)
            expected[location.log_id][ledger_id] += location.size
        assert entry_log.take_staged_usage() == expected
        entry_log.write_staged()
        entry_log.close()


def test_a_failed_write_removes_the_logs_it_created_and_forgets_their_usage(tmp_path, monkeypatch):
    import bookie.entry_log as entry_log_module

    entry_log = FileEntryLog(tmp_path, log_bytes_max=MIB)
    entry_log.stage_buffer({1: {0: b"x" * 100}}, 10).__next__()
    assert entry_log.take_staged_usage()

    def refuse(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(entry_log_module, "write_parts_at", refuse)
    with pytest.raises(OSError):
        entry_log.write_staged()
    assert entry_log.log_ids() == []
    assert entry_log.writing_log_id() is None
    entry_log.close()


def test_usage_merges_without_changing_the_original():
    original = usage(100, l1=100)
    merged = original.merged({1: 50, 2: 25})
    assert (merged.total_bytes, merged.ledger_bytes) == (175, {1: 150, 2: 25})
    assert (original.total_bytes, original.ledger_bytes) == (100, {1: 100})


# --- which ledgers the core lets go ------------------------------------------------------------

KEY = master_key(b"pw")


def add_request(request_id: int, ledger_id: int, entry_id: int) -> AddRequest:
    data = DigestManager(ledger_id, DigestType.CRC32C, b"pw").encode(entry_id, entry_id - 1, 0, b"payload")
    return AddRequest(request_id, AddFlag.NONE, KEY, data)


def journal_tokens(actions) -> list[int]:
    return [action.token for action in actions if isinstance(action, AppendJournal) and action.token]


def test_the_core_keeps_a_ledger_with_a_request_in_flight_and_drops_the_rest():
    core = BookieCore(bookie_id="b")
    created = core.receive(1, add_request(1, 1, 0), 0) + core.receive(1, add_request(2, 2, 0), 0)
    created += core.receive(1, add_request(3, 4, 0), 0)
    core.journal_synced(journal_tokens(created), 0)
    in_flight = journal_tokens(core.receive(1, add_request(4, 1, 1), 0))  # ledger 1: an add waits for the journal
    core.receive(1, ReadRequest(5, ReadFlag.NONE, 2, 0, previous_lac=5, timeout_ms=1000), 0)  # a long poll
    core.receive(1, add_request(6, 3, 0), 0)  # ledger 3: created, its first add in flight
    assert core.drop_ledgers([1, 2, 3, 4, 99]) == [4]
    core.journal_synced(in_flight, 0)
    assert core.drop_ledgers([1, 2]) == [1]
    [read] = [action for action in core.tick(2000) if isinstance(action, ReadEntries)]  # the poll expires: a read
    assert core.drop_ledgers([2]) == []
    core.read_completed(read.token, ReadOutcome([b"entry"], False))
    assert core.drop_ledgers([2]) == [2]
    assert set(core.ledgers) == {3}


def test_a_dropped_ledger_answers_no_ledger_and_a_late_add_starts_it_afresh():
    core = BookieCore(bookie_id="b")
    core.journal_synced(journal_tokens(core.receive(1, add_request(1, 7, 0), 0)), 0)
    assert core.drop_ledgers([7]) == [7]
    assert 7 not in core.ledgers
    [response] = core.receive(1, ReadRequest(2, ReadFlag.NONE, 7, 0), 0)
    assert response.response.status.name == "NO_LEDGER"
    actions = core.receive(1, add_request(3, 7, 1), 0)
    records = [action.record for action in actions if isinstance(action, AppendJournal)]
    assert [record.kind.name for record in records] == ["MASTER_KEY", "ADD"]
