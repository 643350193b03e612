"""Garbage collection over the real core and ledger storage, on real files
(journal, entry logs, RocksDB) and on the simulated ones, driven by the real
GarbageCollector with a stand-in for the server: deleted ledgers are
dropped, entry logs deleted or compacted, live entries read back byte for
byte; restarts and crashes at each step keep a consistent state."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import trio

from bookie.compaction import EntryLogCompaction
from bookie.config import BookieConfig
from bookie.entry_index import RocksEntryIndex
from bookie.entry_log import FileEntryLog, entry_log_name
from bookie.garbage_collector import GarbageCollector
from bookie.gc_policy import live_ratio
from bookie.journal import FileJournal
from bookie.ledger_storage import LedgerStorage
from bookie.protocol import AddFlag, AddRequest, ReadFlag, ReadRequest, Status
from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from bookie.core_actions import AppendJournal, CoreLimits, DurableAdd, ReadEntries, Respond
from bookie.sim_storage import SimEntryIndex, SimEntryLog, SimJournal
from bookie.startup_recovery import recover
from coordination.cluster_layout import ledger_path
from coordination.store import ConnectionLossError
from tests.unit.test_gc_policy import metadata  # noqa: F401  (fixture)

KEY = master_key(b"pw")
ENTRY_BYTES = 4096
LOG_BYTES_MAX = 1024 * 1024  # the smallest a file entry log may be


def payload(ledger_id: int, entry_id: int) -> bytes:
    seed = hashlib.sha256(f"{ledger_id}/{entry_id}".encode()).digest()
    return (seed * (ENTRY_BYTES // len(seed)))[:ENTRY_BYTES]


class FileDisk:
    """Real files; a restart closes and reopens them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        for name in ("journal", "entrylogs", "index"):
            (directory / name).mkdir(parents=True, exist_ok=True)

    def open(self) -> tuple[FileJournal, LedgerStorage]:
        journal = FileJournal(self.directory / "journal", file_bytes_max=4 * 1024 * 1024, preallocate_bytes=64 * 1024)
        storage = LedgerStorage(
            FileEntryLog(self.directory / "entrylogs", log_bytes_max=LOG_BYTES_MAX), RocksEntryIndex(self.directory / "index"),
            write_cache_bytes=8 * 1024 * 1024, read_cache_bytes=1024 * 1024, read_ahead_bytes=64 * 1024,
        )
        return journal, storage

    def entry_log_bytes(self) -> int:
        return sum(path.stat().st_size for path in (self.directory / "entrylogs").iterdir())


class SimDisk:
    """The simulated journal, entry log and index: they outlive a restart."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.journal = SimJournal()
        self.entry_log = SimEntryLog(log_entries_max=256)
        self.entry_index = SimEntryIndex()

    def open(self) -> tuple[SimJournal, LedgerStorage]:
        storage = LedgerStorage(
            self.entry_log, self.entry_index, write_cache_bytes=8 * 1024 * 1024, read_cache_bytes=1024 * 1024, read_ahead_bytes=64 * 1024,
        )
        return self.journal, storage

    def entry_log_bytes(self) -> int:
        return sum(self.entry_log.log_bytes(log_id) for log_id in self.entry_log.log_ids())


class Bookie:
    """The real request core, journal and ledger storage, driven the way
    bookie.server drives them (each add journalled and synced at once), and
    the `StorageOwner` of a real GarbageCollector, as the server is."""

    def __init__(self, disk, metadata) -> None:
        self.disk = disk
        self.metadata = metadata
        self.config = BookieConfig(
            journal_dir=disk.directory / "j", ledger_dir=disk.directory / "l",
            gc_interval_s=1, gc_compaction_threshold=0.7, gc_compaction_stretch_bytes=128 * 1024,
        )
        self.storage_lock = trio.Lock()
        self.journal_failed = None
        self.disk_has_room = True
        self.checkpoint_held = False
        self.start()

    def start(self) -> None:
        self.journal, self.storage = self.disk.open()
        self.core, report = recover(bookie_id="b", limits=CoreLimits(), journal=self.journal, storage=self.storage)
        self.synced_position = report.mark_after
        self.collector = GarbageCollector(
            self.config, core=self.core, storage=self.storage, owner=self, ledger_metadata=self.metadata
        )
        self.responses: list = []

    def restart(self) -> None:
        """A clean stop without a final checkpoint, as after kill -9 once
        everything was synced: what the journal holds past the mark is
        replayed."""
        self.storage.close()
        self.journal.close()
        self.start()

    def close(self) -> None:
        self.storage.close()
        self.journal.close()

    # --- the server's part --------------------------------------------------------

    def execute(self, actions) -> None:
        records, tokens = [], []
        for action in actions:
            if isinstance(action, AppendJournal):
                records.append(action.record)
                tokens.append(action.token)
            elif isinstance(action, DurableAdd):
                self.storage.put(action.ledger_id, action.entry_id, action.data)
                self.responses.append((action.ledger_id, action.entry_id, Status.OK))
            elif isinstance(action, ReadEntries):
                outcome = self.storage.read(action.ledger_id, action.first_entry_id, action.entries_max, action.bytes_max)
                self.execute(self.core.read_completed(action.token, outcome))
            elif isinstance(action, Respond):
                self.responses.append(action.response)
        if records:
            self.synced_position = self.journal.append(records)
            self.journal.sync()
            self.execute(self.core.journal_synced([token for token in tokens if token], 0))

    def checkpoint(self) -> None:
        job = self.storage.begin_checkpoint(self.core.take_dirty_ledger_states(), self.synced_position)
        self.storage.run_checkpoint(job)
        self.storage.end_checkpoint()

    async def checkpoint_locked(self):
        if self.checkpoint_held:  # no room on the disk: the mark stays
            return self.storage.entry_index.load_mark()
        self.checkpoint()
        return self.synced_position

    async def has_room_for(self, entries: int, data_bytes: int) -> bool:
        return self.disk_has_room


    # --- a client's part ------------------------------------------------------------

    def write_ledger(self, ledger_id: int, entries: int, *, first_entry_id: int = 0) -> None:
        digest = DigestManager(ledger_id, DigestType.CRC32C, b"pw")
        if first_entry_id == 0 and self.metadata is not None:
            self.metadata.create(ledger_path(ledger_id), b"{}", make_parents=True)
        for entry_id in range(first_entry_id, first_entry_id + entries):
            data = digest.encode(entry_id, entry_id - 1, 0, payload(ledger_id, entry_id))
            self.execute(self.core.receive(1, AddRequest(entry_id, AddFlag.NONE, KEY, data), 0))

    def read(self, ledger_id: int, entry_id: int):
        self.responses = []
        self.execute(self.core.receive(1, ReadRequest(1, ReadFlag.NONE, ledger_id, entry_id), 0))
        [response] = self.responses
        return response

    def assert_ledger_intact(self, ledger_id: int, entries: int) -> None:
        for entry_id in range(entries):
            response = self.read(ledger_id, entry_id)
            assert response.status is Status.OK, f"ledger {ledger_id} entry {entry_id}: {response.status.name}"
            assert response.entry[-ENTRY_BYTES:] == payload(ledger_id, entry_id)

    def assert_ledger_gone(self, ledger_id: int) -> None:
        assert ledger_id not in self.core.ledgers
        assert self.read(ledger_id, 0).status is Status.NO_LEDGER
        assert self.storage.entry_index.entry_ids(ledger_id, 0, 1 << 62, 10) == []
        assert self.storage.read(ledger_id, 0, 1, 1 << 20).entries == []

    async def gc_rounds(self, rounds: int = 2) -> None:
        """Deleted ledgers need two rounds that confirm them absent."""
        for _ in range(rounds):
            await self.collector.run_round()


@pytest.fixture(params=["files", "sim"])
def disk(request, tmp_path):
    return FileDisk(tmp_path) if request.param == "files" else SimDisk(tmp_path)


@pytest.fixture
def bookie(disk, metadata):
    built = Bookie(disk, metadata)
    yield built
    built.close()


ENTRIES = 300  # 300 x 4 KiB: each ledger spans more than one log


def write_four_ledgers(bookie: Bookie) -> None:
    """Ledgers 1..4, one after the other, each checkpointed: logs hold one
    ledger, or two at a boundary."""
    for ledger_id in (1, 2, 3, 4):
        bookie.write_ledger(ledger_id, ENTRIES)
        bookie.checkpoint()


def logs_of(storage: LedgerStorage, ledger_id: int) -> set[int]:
    return {log_id for log_id, usage in storage.log_usage.items() if ledger_id in usage.ledger_bytes}


async def test_deleted_ledgers_are_dropped_their_logs_removed_and_live_ones_read_back(bookie, metadata, disk):
    write_four_ledgers(bookie)
    before = disk.entry_log_bytes()
    only_deleted = (logs_of(bookie.storage, 1) | logs_of(bookie.storage, 2)) - logs_of(bookie.storage, 3) - logs_of(bookie.storage, 4)
    assert only_deleted, "the layout should have logs that hold only ledgers 1 and 2"
    metadata.delete(ledger_path(1))
    metadata.delete(ledger_path(2))

    await bookie.gc_rounds(1)
    assert 1 in bookie.core.ledgers, "one round is not enough to drop a ledger"
    await bookie.gc_rounds(1)
    for ledger_id in (1, 2):
        bookie.assert_ledger_gone(ledger_id)
    assert not only_deleted & set(bookie.storage.log_usage)
    assert disk.entry_log_bytes() < before * 0.6
    for ledger_id in (3, 4):
        bookie.assert_ledger_intact(ledger_id, ENTRIES)
    stats = bookie.core.describe()
    assert stats["gc_ledgers_dropped"] == 2 and stats["gc_entry_logs_deleted"] >= len(only_deleted)
    assert stats["gc_bytes_reclaimed"] > 0


def write_interleaved(bookie: Bookie) -> None:
    """Ledgers 1 and 2 in every checkpoint, so that every log is about half
    ledger 1 and half ledger 2; then ledger 3, so that the log being written
    holds no entry of theirs."""
    for first in range(0, ENTRIES, 50):
        bookie.write_ledger(1, 50, first_entry_id=first)
        bookie.write_ledger(2, 50, first_entry_id=first)
        bookie.checkpoint()
    bookie.write_ledger(3, ENTRIES)
    bookie.checkpoint()


def sparse_logs(bookie: Bookie, live: set[int]) -> set[int]:
    """The logs a round should compact, once only `live` ledgers are."""
    writing = bookie.storage.entry_log.writing_log_id()
    threshold = bookie.config.gc_compaction_threshold
    return {
        log_id for log_id, usage in bookie.storage.log_usage.items()
        if log_id != writing and 0 < live_ratio(usage, live) < threshold
    }


def drop_by_hand(bookie: Bookie, ledger_ids: list[int]) -> None:
    """What the collector does once it decided the ledgers are deleted."""
    dropped = bookie.core.drop_ledgers(ledger_ids)
    assert dropped == ledger_ids
    bookie.checkpoint()
    bookie.storage.drop_ledgers(dropped)


async def test_compaction_moves_live_entries_updates_the_index_and_removes_the_old_log(bookie, metadata, disk):
    write_interleaved(bookie)
    sparse = sparse_logs(bookie, live={2, 3})
    assert sparse
    old_locations = {entry_id: bookie.storage.entry_index.get(2, entry_id) for entry_id in range(ENTRIES)}
    metadata.delete(ledger_path(1))

    await bookie.gc_rounds()
    bookie.assert_ledger_gone(1)
    for log_id in sparse:
        assert log_id not in bookie.storage.log_usage
        assert log_id not in bookie.storage.entry_log.log_ids()
    moved = [entry_id for entry_id in range(ENTRIES) if bookie.storage.entry_index.get(2, entry_id) != old_locations[entry_id]]
    assert {old_locations[entry_id].log_id for entry_id in moved} == sparse
    bookie.assert_ledger_intact(2, ENTRIES)
    assert bookie.core.describe()["gc_entry_logs_compacted"] >= 1
    # The index and the usage survive a restart as they are.
    usage = {log_id: (usage.total_bytes, usage.ledger_bytes) for log_id, usage in bookie.storage.log_usage.items()}
    bookie.restart()
    assert {log_id: (usage.total_bytes, usage.ledger_bytes) for log_id, usage in bookie.storage.log_usage.items()} == usage
    bookie.assert_ledger_intact(2, ENTRIES)


async def test_without_room_on_the_disk_compaction_waits_and_nothing_is_lost(bookie, metadata, disk):
    # Copies take room until the old log goes: on a full disk a round leaves
    # the sparse logs as they are, and compacts them once there is room.
    write_interleaved(bookie)
    sparse = sparse_logs(bookie, live={2, 3})
    assert sparse
    metadata.delete(ledger_path(1))
    bookie.disk_has_room = False
    await bookie.gc_rounds()
    bookie.assert_ledger_gone(1)
    assert sparse <= set(bookie.storage.log_usage)
    assert bookie.core.describe()["gc_entry_logs_compacted"] == 0
    bookie.assert_ledger_intact(2, ENTRIES)
    bookie.disk_has_room = True
    await bookie.gc_rounds(1)
    assert not sparse & set(bookie.storage.log_usage)
    bookie.assert_ledger_intact(2, ENTRIES)


async def test_a_held_checkpoint_delays_dropping_a_deleted_ledger_from_the_index(bookie, metadata):
    bookie.write_ledger(1, 50)
    bookie.write_ledger(2, 50)
    bookie.checkpoint()
    bookie.write_ledger(1, 50, first_entry_id=50)  # in the write cache and the journal only
    metadata.delete(ledger_path(1))
    bookie.checkpoint_held = True
    await bookie.gc_rounds()
    # Forgotten by the core and the caches (so that a held flush shrinks),
    # but kept in the index until a checkpoint covers its journal records.
    assert 1 not in bookie.core.ledgers
    assert bookie.storage.write_cache.get(1, 60) is None
    assert bookie.storage.entry_index.entry_ids(1, 0, 1 << 62, 10)
    bookie.checkpoint_held = False
    await bookie.gc_rounds(1)
    bookie.assert_ledger_gone(1)
    bookie.assert_ledger_intact(2, 50)
    bookie.restart()
    bookie.assert_ledger_gone(1)
    bookie.assert_ledger_intact(2, 50)


async def test_a_restart_after_gc_does_not_bring_a_deleted_ledger_back(bookie, metadata):
    bookie.write_ledger(1, 50)
    bookie.write_ledger(2, 50)
    bookie.checkpoint()
    # More adds after the last checkpoint: they are only in the journal, past
    # the mark, where a restart replays them.
    bookie.write_ledger(1, 50, first_entry_id=50)
    bookie.write_ledger(2, 50, first_entry_id=50)
    metadata.delete(ledger_path(1))
    await bookie.gc_rounds()
    bookie.assert_ledger_gone(1)
    bookie.restart()
    bookie.assert_ledger_gone(1)
    bookie.assert_ledger_intact(2, 100)
    # A writer that never heard of the delete starts the ledger afresh: it
    # survives a restart too, as any new ledger does.
    bookie.write_ledger(1, 3, first_entry_id=100)
    bookie.restart()
    assert bookie.read(1, 100).status is Status.OK
    assert bookie.read(1, 0).status is Status.NO_ENTRY


async def test_a_crash_between_moving_entries_and_removing_the_old_log_is_consistent(bookie, metadata):
    write_interleaved(bookie)
    drop_by_hand(bookie, [1])
    target = min(sparse_logs(bookie, live={2, 3}))
    compaction = EntryLogCompaction(bookie.storage, target, 64 * 1024)
    while not compaction.step():
        pass
    assert compaction.entries_moved > 0
    assert all(bookie.storage.entry_index.get(2, entry_id).log_id != target for entry_id in range(ENTRIES))
    # The crash: `finish`, which removes the old log, never ran.
    bookie.restart()
    assert target in bookie.storage.entry_log.log_ids()
    bookie.assert_ledger_gone(1)
    bookie.assert_ledger_intact(2, ENTRIES)
    # The next round compacts it again: nothing left to copy, then it goes.
    await bookie.collector.run_round()
    assert target not in bookie.storage.entry_log.log_ids()
    assert target not in bookie.storage.log_usage
    bookie.assert_ledger_intact(2, ENTRIES)
    bookie.assert_ledger_intact(3, ENTRIES)


async def test_a_read_in_flight_follows_an_entry_that_compaction_moved(bookie):
    write_interleaved(bookie)
    drop_by_hand(bookie, [1])
    storage = bookie.storage
    index_get = storage.entry_index.get
    entry_id = 10
    target = index_get(2, entry_id).log_id
    assert target != storage.entry_log.writing_log_id()

    def get_then_compact(ledger_id, looked_up_entry_id):
        location = index_get(ledger_id, looked_up_entry_id)
        if (ledger_id, looked_up_entry_id) == (2, entry_id) and storage.entry_index.get is get_then_compact:
            # The reader looked the entry up; compaction moves it and removes
            # the log before the reader gets to the file.
            storage.entry_index.get = index_get
            compaction = EntryLogCompaction(storage, target, 1 << 20)
            while not compaction.step():
                pass
            compaction.finish({2, 3})
        return location

    storage.entry_index.get = get_then_compact
    try:
        storage.read_cache.discard_ledgers({2})
        outcome = storage.read(2, entry_id, 1, 1 << 20)
    finally:
        storage.entry_index.get = index_get
    assert target not in storage.entry_log.log_ids()
    assert not outcome.failed
    assert outcome.entries[0][-ENTRY_BYTES:] == payload(2, entry_id)


async def test_nothing_is_deleted_while_the_metadata_store_fails(bookie, metadata):
    bookie.write_ledger(1, 10)
    bookie.checkpoint()
    metadata.delete(ledger_path(1))

    class Unreachable:
        def children(self, path):
            raise ConnectionLossError("ZooKeeper unreachable")

        get = children

    bookie.collector.ledger_metadata = Unreachable()
    await bookie.gc_rounds(3)
    assert 1 in bookie.core.ledgers
    bookie.assert_ledger_intact(1, 10)
    assert "metadata store" in bookie.core.describe()["gc_last_error"]
    bookie.collector.ledger_metadata = metadata
    await bookie.gc_rounds()
    bookie.assert_ledger_gone(1)


async def test_a_ledger_with_metadata_is_never_dropped(bookie):
    assert bookie.core.describe()["gc_rounds"] == 0  # the counters are there from the start
    write_four_ledgers(bookie)
    await bookie.gc_rounds(3)
    for ledger_id in (1, 2, 3, 4):
        bookie.assert_ledger_intact(ledger_id, ENTRIES)
    assert bookie.core.describe()["gc_ledgers_dropped"] == 0


# --- files only: what a crash or a bad disk leaves behind ----------------------------------


@pytest.fixture
def file_bookie(tmp_path, metadata):
    built = Bookie(FileDisk(tmp_path), metadata)
    yield built
    built.close()


async def test_a_log_left_by_a_crash_in_the_middle_of_a_checkpoint_is_measured_and_removed(file_bookie):
    bookie = file_bookie
    bookie.write_ledger(1, 100)
    bookie.checkpoint()
    bookie.restart()  # the next checkpoint starts a fresh log
    bookie.write_ledger(1, 100, first_entry_id=100)
    # The checkpoint writes its new log but dies before the index commit.
    job = bookie.storage.begin_checkpoint(bookie.core.take_dirty_ledger_states(), bookie.synced_position)
    for _ in bookie.storage.stage_checkpoint(job, 1 << 30):
        pass
    bookie.storage.entry_log.write_staged()
    orphan = max(bookie.storage.entry_log.log_ids())
    bookie.restart()  # the journal replay writes the entries again, into a new log
    assert orphan not in bookie.storage.log_usage
    await bookie.collector.run_round()
    assert orphan not in bookie.storage.entry_log.log_ids()
    bookie.assert_ledger_intact(1, 200)


async def test_a_damaged_log_is_kept_and_still_answers_io_error_for_its_damaged_entry(file_bookie, metadata):
    bookie = file_bookie
    write_interleaved(bookie)
    location = bookie.storage.entry_index.get(2, 5)
    log_path = bookie.disk.directory / "entrylogs" / entry_log_name(location.log_id)
    with open(log_path, "r+b") as log_file:
        log_file.seek(location.offset + location.size - 10)
        byte = log_file.read(1)
        log_file.seek(-1, 1)
        log_file.write(bytes([byte[0] ^ 0x01]))
    bookie.storage.read_cache.discard_ledgers({2})
    metadata.delete(ledger_path(1))
    await bookie.gc_rounds()
    assert location.log_id in bookie.storage.entry_log.log_ids()
    assert bookie.core.describe()["gc_compactions_aborted"] == 1
    assert bookie.read(2, 5).status is Status.IO_ERROR
    for entry_id in (*range(5), *range(6, ENTRIES)):
        assert bookie.read(2, entry_id).status is Status.OK
    await bookie.gc_rounds()  # not retried: the log stays as it is
    assert bookie.core.describe()["gc_compactions_aborted"] == 1
