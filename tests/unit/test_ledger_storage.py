"""Ledger storage over the real entry log and RocksDB index, and over the
simulated ones: checkpoints, the read path through every tier, read-ahead,
corruption, and what a simulated crash keeps."""

from __future__ import annotations

import pytest

from bookie.entry_index import MarkRegressionError, RocksEntryIndex
from bookie.entry_log import FileEntryLog
from bookie.ledger_storage import LedgerStorage
from bookie.sim_storage import SimEntryIndex, SimEntryLog, SimJournal
from bookie.storage_interfaces import (
    JOURNAL_START,
    CorruptEntryError,
    EntryLocation,
    JournalPosition,
    JournalRecord,
    LedgerStateRecord,
    RecordKind,
)


def payload(ledger_id: int, entry_id: int) -> bytes:
    return f"ledger {ledger_id} entry {entry_id} ".encode() * 10


@pytest.fixture(params=["files", "sim"])
def storage(request, tmp_path):
    if request.param == "files":
        (tmp_path / "logs").mkdir()
        built = LedgerStorage(
            FileEntryLog(tmp_path / "logs", log_bytes_max=1 << 20), RocksEntryIndex(tmp_path / "index"),
            write_cache_bytes=1 << 16, read_cache_bytes=1 << 16, read_ahead_bytes=4096,
        )
    else:
        built = LedgerStorage(SimEntryLog(log_entries_max=50), SimEntryIndex(), write_cache_bytes=1 << 16, read_cache_bytes=1 << 16, read_ahead_bytes=4096)
    yield built
    built.close()


def checkpoint(storage: LedgerStorage, mark=JournalPosition(1, 0), states=None):
    job = storage.begin_checkpoint(states or {}, mark)
    storage.run_checkpoint(job)
    storage.end_checkpoint()
    return job


def test_entries_are_readable_before_during_and_after_a_checkpoint(storage):
    for entry_id in range(30):
        storage.put(1, entry_id, payload(1, entry_id))
    assert storage.read(1, 0, 100, 1 << 20).entries == [payload(1, e) for e in range(30)]
    job = storage.begin_checkpoint({}, JournalPosition(1, 0))
    # While flushing, the swapped-out buffer still serves reads.
    assert storage.read_memory(1, 5, 1, 1 << 20) == ([payload(1, 5)], False)
    storage.run_checkpoint(job)
    storage.end_checkpoint()
    assert storage.read_memory(1, 5, 1, 1 << 20) == ([], True)
    assert storage.read(1, 0, 100, 1 << 20).entries == [payload(1, e) for e in range(30)]
    assert [location[:2] for location in job.locations] == [(1, e) for e in range(30)]


def test_checkpoint_writes_entries_sorted_by_ledger_then_entry(storage):
    for ledger_id, entry_id in [(2, 1), (1, 5), (2, 0), (1, 4)]:
        storage.put(ledger_id, entry_id, payload(ledger_id, entry_id))
    job = checkpoint(storage)
    assert [location[:2] for location in job.locations] == [(1, 4), (1, 5), (2, 0), (2, 1)]
    assert [location[3] for location in job.locations] == sorted(location[3] for location in job.locations)


def test_read_ahead_fills_the_read_cache(storage):
    for entry_id in range(20):
        storage.put(3, entry_id, payload(3, entry_id))
    checkpoint(storage)
    assert storage.read(3, 0, 1, 1 << 20).entries == [payload(3, 0)]
    assert len(storage.read_cache) > 1
    assert storage.read_memory(3, 1, 1, 1 << 20) == ([payload(3, 1)], False)


def test_a_range_of_locations_is_what_each_lookup_finds(storage):
    # The read-ahead checks its run of entries with one range scan of the
    # index: the same locations as one lookup each, and no other ledger's.
    for ledger_id in (2, 3, 4):
        for entry_id in range(0, 30, 3 if ledger_id == 3 else 1):
            storage.put(ledger_id, entry_id, payload(ledger_id, entry_id))
    checkpoint(storage)
    index = storage.entry_index
    found = index.locations_in(3, 4, 22)
    assert found == {entry_id: index.get(3, entry_id) for entry_id in range(6, 22, 3)}
    assert index.locations_in(3, 31, 40) == {}


def test_a_read_ahead_over_ids_far_apart_looks_each_up(storage, monkeypatch):
    # Neighbours in a log may be entries far apart (compaction puts the
    # survivors of several logs side by side): the read-ahead then looks
    # each one up instead of scanning every entry of the ledger between them.
    for entry_id in range(0, 3000, 1000):
        storage.put(5, entry_id, payload(5, entry_id))
    checkpoint(storage)
    spans = []
    scan = storage.entry_index.locations_in
    monkeypatch.setattr(storage.entry_index, "locations_in",
                        lambda ledger_id, first, last: spans.append(last - first) or scan(ledger_id, first, last))
    assert storage.read(5, 0, 1, 1 << 20).entries == [payload(5, 0)]
    assert spans == []
    assert storage.read_memory(5, 1000, 1, 1 << 20) == ([payload(5, 1000)], False)


def test_range_reads_stop_at_a_gap_and_respect_the_byte_bound(storage):
    for entry_id in (0, 1, 2, 4):
        storage.put(1, entry_id, payload(1, entry_id))
    assert len(storage.read(1, 0, 100, 1 << 20).entries) == 3
    assert len(storage.read(1, 0, 100, len(payload(1, 0)) * 2).entries) == 2
    # The first entry is returned even if it alone exceeds the bound.
    assert len(storage.read(1, 0, 100, 1).entries) == 1
    assert storage.read(1, 3, 100, 1 << 20).entries == []


def test_entry_ids_merge_index_and_write_cache(storage):
    for entry_id in range(5):
        storage.put(1, entry_id, payload(1, entry_id))
    checkpoint(storage)
    storage.put(1, 7, payload(1, 7))
    storage.put(2, 0, payload(2, 0))
    assert storage.entry_ids(1, 0, 100, 100) == [0, 1, 2, 3, 4, 7]
    assert storage.entry_ids(1, 2, 4, 100) == [2, 3, 4]
    assert storage.entry_ids(1, 0, 100, 3) == [0, 1, 2]


def test_checkpoint_commits_ledger_states_and_mark(storage):
    state = LedgerStateRecord(b"key", True, 41)
    checkpoint(storage, JournalPosition(3, 77), {9: state})
    assert storage.entry_index.load_mark() == JournalPosition(3, 77)
    assert dict(storage.entry_index.load_ledger_states()) == {9: state}


def test_the_mark_never_moves_backwards(tmp_path):
    index = RocksEntryIndex(tmp_path / "index")
    index.commit_checkpoint([], {}, JournalPosition(5, 100))
    with pytest.raises(MarkRegressionError):
        index.commit_checkpoint([], {}, JournalPosition(5, 99))
    index.close()
    # ... and survives a reopen.
    index = RocksEntryIndex(tmp_path / "index")
    assert index.load_mark() == JournalPosition(5, 100)
    index.close()


def test_a_flipped_byte_in_the_entry_log_is_a_failed_read_not_a_missing_entry(tmp_path):
    (tmp_path / "logs").mkdir()
    storage = LedgerStorage(FileEntryLog(tmp_path / "logs", log_bytes_max=1 << 20), RocksEntryIndex(tmp_path / "index"), read_ahead_bytes=0)
    for entry_id in range(3):
        storage.put(1, entry_id, payload(1, entry_id))
    job = checkpoint(storage)
    location = EntryLocation(*job.locations[1][2:])
    path = tmp_path / "logs" / f"{location.log_id:016x}.log"
    data = bytearray(path.read_bytes())
    data[location.offset + location.size - 3] ^= 0x40
    path.write_bytes(bytes(data))
    outcome = storage.read(1, 1, 1, 1 << 20)
    assert outcome.entries == [] and outcome.failed
    outcome = storage.read(1, 0, 10, 1 << 20)
    assert outcome.entries == [payload(1, 0)] and outcome.failed
    with pytest.raises(CorruptEntryError):
        storage.entry_log.read(location, 1, 1)
    storage.close()


def test_sim_entry_log_corruption_and_crash():
    log = SimEntryLog()
    location = log.append(1, 0, b"data")
    log.sync()
    unsynced = log.append(1, 1, b"more")
    log.crash()
    with pytest.raises(CorruptEntryError):
        log.read(unsynced, 1, 1)
    assert log.read(location, 1, 0) == b"data"
    assert log.corrupt(1, 0) == 1
    with pytest.raises(CorruptEntryError):
        log.read(location, 1, 0)


def test_sim_journal_crash_keeps_only_synced_records():
    journal = SimJournal()
    journal.start_new_file(JOURNAL_START)
    kept = [JournalRecord(RecordKind.ADD, 1, 0, b"a")]
    journal.append(kept)
    journal.sync()
    journal.append([JournalRecord(RecordKind.ADD, 1, 1, b"b")])
    journal.crash()
    assert [record for record, _ in journal.replay(JOURNAL_START)] == kept


def test_read_descriptors_are_bounded(tmp_path):
    (tmp_path / "logs").mkdir()
    log = FileEntryLog(tmp_path / "logs", log_bytes_max=1 << 20, read_fds_max=2)
    big = [bytes([entry_id]) * 700_000 for entry_id in range(5)]  # one entry per 1 MiB log
    locations = [log.append(1, entry_id, data) for entry_id, data in enumerate(big)]
    log.write_staged()
    assert len({location.log_id for location in locations}) == 5
    for entry_id, location in enumerate(locations):
        assert log.read(location, 1, entry_id) == big[entry_id]
    assert len(log._read_fds) == 2 and not log._evicted_fds
    assert log.read(locations[0], 1, 0) == big[0]  # reopened after eviction
    log.close()


def test_a_failed_write_continues_in_a_fresh_log(tmp_path, monkeypatch):
    # After a failed write, what was staged is staged again into a new log;
    # nothing is appended behind bytes of unknown state.
    (tmp_path / "logs").mkdir()
    log = FileEntryLog(tmp_path / "logs", log_bytes_max=1 << 20)
    first = log.append(1, 0, b"zero")
    log.write_staged()
    log.append(1, 1, b"one")
    import bookie.entry_log as entry_log_module

    def refuse(*arguments):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(entry_log_module, "write_parts_at", refuse)
    with pytest.raises(OSError):
        log.write_staged()
    monkeypatch.undo()
    again = log.append(1, 1, b"one")
    log.write_staged()
    assert again.log_id == first.log_id + 1
    assert log.read(again, 1, 1) == b"one" and log.read(first, 1, 0) == b"zero"
    log.close()


def test_a_rewritten_entry_is_not_served_from_a_stale_read_ahead_copy(storage):
    # Read-ahead caches entry 1; a recovery add rewrites it; after the next
    # checkpoint the write cache no longer holds it, and the read cache must
    # not answer with the old bytes.
    for entry_id in range(3):
        storage.put(1, entry_id, b"old %d" % entry_id)
    checkpoint(storage)
    assert storage.read(1, 0, 1, 1 << 20).entries == [b"old 0"]
    storage.put(1, 1, b"new 1")
    checkpoint(storage, JournalPosition(2, 0))
    assert storage.read(1, 1, 1, 1 << 20).entries == [b"new 1"]
    assert storage.read_memory(1, 1, 1, 1 << 20)[0] in ([], [b"new 1"])
