"""The trio driver on a full ledger disk, over loopback with simulated
storage and a ledger disk whose free space the test sets: a checkpoint that
does not fit is held, the bookie turns read-only with the reason (in
GET_INFO, the metrics and the log, once), keeps serving every read, and
turns writable again by itself once there is room; a real I/O error keeps it
read-only until restarted, and a failed index write stops the tries. The same
for a journal disk with no room for a new file, at start-up or while
serving."""

from __future__ import annotations

import errno
import logging
import random

import pytest
import trio

import bookie.journal as journal_module
import bookie.server as server_module
from bookie.config import BookieConfig
from bookie.flush_room import DiskRoom
from bookie.journal import FileJournal, journal_file_name
from bookie.ledger_storage import LedgerStorage
from bookie.protocol import Status
from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from bookie.read_only_mode import Cause
from bookie.server import BookieServer
from bookie.sim_storage import SimEntryIndex, SimEntryLog, SimJournal
from bookie.startup_recovery import recover
from bookie.storage_interfaces import IndexWriteError
from coordination.cluster_layout import ledger_path
from ledger_client.bookie_client import BookieClient
from tests.support import wait_until_async
from tests.unit.test_gc_policy import metadata  # noqa: F401  (fixture)

MIB = 1024 * 1024
KEY = master_key(b"pw")
LEDGER = 9


class Disk:
    """The ledger disk as the server measures it; the test sets its free space."""

    def __init__(self) -> None:
        self.free_bytes = 10 * 1024 * MIB
        self.measured = 0

    def measure(self, config, storage) -> DiskRoom:
        self.measured += 1
        return DiskRoom(self.free_bytes, 0, False)


class FlakyEntryLog(SimEntryLog):
    """Refuses the next `failures` writes with `error`."""

    def __init__(self) -> None:
        super().__init__()
        self.error: Exception | None = None
        self.failures = 0

    def write_staged(self) -> None:
        if self.failures:
            self.failures -= 1
            raise self.error
        super().write_staged()


class FlakyIndex(SimEntryIndex):
    def __init__(self) -> None:
        super().__init__()
        self.refuse = False

    def commit_staged(self, *args, **kwargs) -> None:
        if self.refuse:
            raise IndexWriteError("index write failed: IO error: No space left on device")
        super().commit_staged(*args, **kwargs)


@pytest.fixture
def disk(monkeypatch) -> Disk:
    measured = Disk()
    monkeypatch.setattr(server_module, "measure_ledger_room", measured.measure)
    return measured


def entry(entry_id: int) -> bytes:
    return DigestManager(LEDGER, DigestType.CRC32C, b"pw").encode(entry_id, entry_id - 1, 0, b"%06d" % entry_id * 100)


async def add(client: BookieClient, entry_id: int) -> Status:
    return (await client.add(entry(entry_id), KEY)).status


async def assert_all_readable(client: BookieClient, count: int) -> None:
    for entry_id in range(count):
        response = await client.read(LEDGER, entry_id)
        assert response.status is Status.OK, (entry_id, response.status)
        assert response.entry == entry(entry_id)


async def wait_for(condition, what: str, deadline_s: float = 10.0) -> None:
    await wait_until_async(condition, deadline_s=deadline_s, what=what)


class Running:
    def __init__(self, server: BookieServer, address: str, modes: list[bool]) -> None:
        self.server = server
        self.address = address
        self.modes = modes  # what registration was told, in order


def bookie_config(tmp_path) -> BookieConfig:
    (tmp_path / "journal").mkdir(exist_ok=True)
    (tmp_path / "ledgers").mkdir(exist_ok=True)
    return BookieConfig(
        journal_dir=tmp_path / "journal", ledger_dir=tmp_path / "ledgers",
        gc_interval_s=3600,  # rounds run when the test says
        checkpoint_interval_ms=60_000, write_cache_bytes=4 * MIB,
    )


def new_storage(config: BookieConfig) -> LedgerStorage:
    return LedgerStorage(FlakyEntryLog(), FlakyIndex(), write_cache_bytes=config.write_cache_bytes)


async def serve(config: BookieConfig, journal, storage: LedgerStorage, metadata, nursery) -> Running:
    """Recover `storage` and `journal` as start-up does, and serve them."""
    core, report = recover(bookie_id="b", limits=config.limits, journal=journal, storage=storage)
    server = BookieServer(config, core=core, storage=storage, journal=journal, journal_position=report.mark_after,
                          ledger_metadata=metadata, rng=random.Random(5), journal_no_file=report.journal_no_file)
    modes: list[bool] = []
    server.on_read_only_change = modes.append
    port = await server.listen(await trio.open_tcp_listeners(0, host="127.0.0.1"))
    await nursery.start(server.run)
    return Running(server, f"127.0.0.1:{port}", modes)


@pytest.fixture
async def running(tmp_path, disk, metadata, nursery):
    config = bookie_config(tmp_path)
    running = await serve(config, SimJournal(), new_storage(config), metadata, nursery)
    yield running
    running.server.stop()


async def test_a_held_checkpoint_keeps_the_bookie_read_only_and_serving_until_room_comes_back(running, disk, caplog):
    caplog.set_level(logging.WARNING, logger="bookie.server")
    server = running.server
    async with BookieClient.connect(running.address) as client:
        for entry_id in range(100):
            assert await add(client, entry_id) is Status.OK
        disk.free_bytes = 1 * MIB  # below the 2 MiB margin: nothing fits
        async with server.storage_lock:
            await server.checkpoint_locked()
        assert server.core.read_only and server.read_only_causes == {Cause.CHECKPOINT_HELD}
        info = (await client.get_info()).info
        assert info["read_only"] and info["read_only_reason"].startswith("checkpoint held: ")
        assert "1.0 MiB free on the ledger disk, 2.0 MiB of it kept for the index" in info["read_only_reason"]
        assert server.checkpoint_held_bytes > 100 * 600
        assert await add(client, 100) is Status.READ_ONLY
        # Tried again and again with backoff; reads go on meanwhile.
        measured = disk.measured
        await assert_all_readable(client, 100)
        await wait_for(lambda: disk.measured >= measured + 2, "two more tries of the held checkpoint")
        await assert_all_readable(client, 100)
        assert server.core.read_only and server.stats.checkpoints == 0
        # Room comes back: the held checkpoint is written, the bookie turns
        # writable by itself and registration follows.
        disk.free_bytes = 10 * 1024 * MIB
        await wait_for(lambda: not server.core.read_only, "writable again")
        assert server.stats.checkpoints == 1 and server.checkpoint_held_bytes == 0
        assert (await client.get_info()).info["read_only_reason"] == ""
        assert running.modes == [True, False]
        assert server.storage.entry_index.get(LEDGER, 99) is not None
        assert await add(client, 100) is Status.OK
        await assert_all_readable(client, 101)
    # One line when it turned read-only and one when it turned back, not one per try.
    lines = [record.getMessage() for record in caplog.records if "bookie turns" in record.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("bookie turns read-only: checkpoint held: ")
    assert lines[1] == "bookie turns writable (checkpoint_held cleared)"


async def test_the_disk_cause_and_a_held_checkpoint_clear_independently(running, disk):
    server = running.server
    async with BookieClient.connect(running.address) as client:
        for entry_id in range(20):
            assert await add(client, entry_id) is Status.OK
        server.set_disk_read_only(True, "disk 97.0% full, threshold 95.0%")
        disk.free_bytes = 1 * MIB
        async with server.storage_lock:
            await server.checkpoint_locked()
        assert server.read_only_causes == {Cause.DISK_FULL, Cause.CHECKPOINT_HELD}
        reason = (await client.get_info()).info["read_only_reason"]
        assert reason.startswith("checkpoint held: ") and reason.endswith("; disk 97.0% full, threshold 95.0%")
        # Under the low water mark, but the flush is still held: read-only.
        server.set_disk_read_only(False)
        assert server.core.read_only and server.read_only_causes == {Cause.CHECKPOINT_HELD}
        disk.free_bytes = 10 * 1024 * MIB
        await wait_for(lambda: not server.core.read_only, "writable again")
        await assert_all_readable(client, 20)
    assert running.modes == [True, False]


async def test_a_refusal_for_room_while_writing_is_retried_until_it_succeeds(running, disk):
    server = running.server
    entry_log = server.storage.entry_log
    async with BookieClient.connect(running.address) as client:
        for entry_id in range(30):
            assert await add(client, entry_id) is Status.OK
        entry_log.error, entry_log.failures = OSError(errno.ENOSPC, "No space left on device"), 3
        async with server.storage_lock:
            await server.checkpoint_locked()
        info = (await client.get_info()).info
        assert info["read_only_reason"] == "checkpoint held: the ledger disk refused the flush (No space left on device); retrying"
        await wait_for(lambda: not server.core.read_only, "writable again")
        assert entry_log.failures == 0
        await assert_all_readable(client, 30)


async def test_a_real_io_error_keeps_the_bookie_read_only_until_restarted(running, disk):
    server = running.server
    entry_log = server.storage.entry_log
    async with BookieClient.connect(running.address) as client:
        for entry_id in range(30):
            assert await add(client, entry_id) is Status.OK
        entry_log.error, entry_log.failures = OSError(errno.EIO, "Input/output error"), 1
        async with server.storage_lock:
            await server.checkpoint_locked()
        assert server.read_only_causes == {Cause.CHECKPOINT_FAILED}
        # The retry succeeds (a fresh entry log), the journal mark moves, but
        # the bookie stays read-only: the disk said it is failing.
        await wait_for(lambda: server.stats.checkpoints == 1, "the retry")
        assert server.core.read_only
        assert (await client.get_info()).info["read_only_reason"] == "checkpoint failed: Input/output error; read-only until restarted"
        await assert_all_readable(client, 30)


async def test_a_failed_index_write_stops_the_tries_and_reads_go_on(running, disk):
    server = running.server
    async with BookieClient.connect(running.address) as client:
        for entry_id in range(30):
            assert await add(client, entry_id) is Status.OK
        server.storage.entry_index.refuse = True
        async with server.storage_lock:
            await server.checkpoint_locked()
        assert server.read_only_causes == {Cause.INDEX_FAILED}
        measured = disk.measured
        await trio.sleep(1)
        assert disk.measured == measured  # no more tries: RocksDB takes no write until reopened
        await assert_all_readable(client, 30)


async def test_deleting_a_ledger_lets_a_held_checkpoint_fit(running, disk, metadata):
    # The operator's way out without new disks: delete ledgers. Garbage
    # collection drops their entries from the held flush, which then fits.
    server = running.server
    other = 10
    metadata.create(ledger_path(LEDGER), b"{}", make_parents=True)
    metadata.create(ledger_path(other), b"{}", make_parents=True)
    async with BookieClient.connect(running.address) as client:
        for entry_id in range(200):
            assert await add(client, entry_id) is Status.OK
        kept = DigestManager(other, DigestType.CRC32C, b"pw").encode(0, -1, 0, b"kept")
        assert (await client.add(kept, KEY)).status is Status.OK
        disk.free_bytes = 2 * MIB + 40 * 1024  # room for a tiny flush, not for 200 entries
        async with server.storage_lock:
            await server.checkpoint_locked()
        assert server.read_only_causes == {Cause.CHECKPOINT_HELD}
        metadata.delete(ledger_path(LEDGER))
        for _ in range(2):  # a ledger is dropped once two rounds confirm it gone
            await server.garbage_collector.run_round()
        await wait_for(lambda: not server.core.read_only, "writable again")
        assert (await client.read(LEDGER, 0)).status is Status.NO_LEDGER
        response = await client.read(other, 0)
        assert response.status is Status.OK and response.entry == kept
        assert server.storage.entry_index.get(other, 0) is not None


# --- a journal disk with no room for a new file at start-up ------------------------------------


class JournalDisk(SimJournal):
    """The journal's disk: no room for a new journal file while `full`
    (a failed try leaves nothing behind, as FileJournal's does); appends
    fail with `append_error` when set."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False
        self.tries = 0
        self.append_error: OSError | None = None

    def start_new_file(self, after):
        self.tries += 1
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().start_new_file(after)

    def append(self, records):
        if self.append_error is not None:
            raise self.append_error
        return super().append(records)


@pytest.fixture
async def started_on_a_full_journal_disk(tmp_path, disk, metadata, nursery):
    """A bookie that wrote entries 0..9, was restarted while its journal
    disk had no room for a new file, and serves (read-only)."""
    config = bookie_config(tmp_path)
    journal = JournalDisk()
    storage = new_storage(config)
    async with trio.open_nursery() as first_run:
        first = await serve(config, journal, storage, metadata, first_run)
        async with BookieClient.connect(first.address) as client:
            for entry_id in range(10):
                assert await add(client, entry_id) is Status.OK
        first.server.stop()
    journal.full = True
    storage = LedgerStorage(storage.entry_log, storage.entry_index, write_cache_bytes=config.write_cache_bytes)
    running = await serve(config, journal, storage, metadata, nursery)
    assert running.server.journal_failed == "journal has no file: cannot start a new journal file: No space left on device"
    yield running, journal
    running.server.stop()


async def test_a_bookie_started_on_a_full_journal_disk_turns_writable_once_a_journal_file_fits(
    started_on_a_full_journal_disk, caplog
):
    # It stayed read-only until restarted; now each disk check tries again.
    caplog.set_level(logging.INFO, logger="bookie.server")
    running, journal = started_on_a_full_journal_disk
    server = running.server
    assert server.core.read_only and server.read_only_causes == {Cause.JOURNAL_NO_FILE}
    async with BookieClient.connect(running.address) as client:
        info = (await client.get_info()).info
        assert info["read_only_reason"] == "journal has no file: cannot start a new journal file: No space left on device"
        assert await add(client, 10) is Status.READ_ONLY
        await assert_all_readable(client, 10)
        # Still full: the next check tries, fails, and changes nothing.
        tries = journal.tries
        await server.retry_journal_file()
        assert journal.tries == tries + 1 and server.read_only_causes == {Cause.JOURNAL_NO_FILE}
        # Room again: the next check makes the file, and the bookie takes adds.
        journal.full = False
        await server.retry_journal_file()
        assert not server.core.read_only and server.read_only_causes == frozenset()
        assert (await client.get_info()).info["read_only_reason"] == ""
        assert running.modes == [False]
        for entry_id in range(10, 20):
            assert await add(client, entry_id) is Status.OK
        await assert_all_readable(client, 20)
        # Written to the new file, and a checkpoint moves the mark past the old ones.
        async with server.storage_lock:
            mark = await server.checkpoint_locked()
        assert mark.file_id == max(journal.file_ids())
        tries = journal.tries
        await server.retry_journal_file()
        assert journal.tries == tries  # nothing more to try
    assert any(record.getMessage() == "bookie turns writable (journal_no_file cleared)" for record in caplog.records)


async def test_a_journal_whose_write_failed_stays_read_only_whatever_the_disk_checks_find(started_on_a_full_journal_disk):
    running, journal = started_on_a_full_journal_disk
    server = running.server
    journal.full = False
    await server.retry_journal_file()
    assert not server.core.read_only
    async with BookieClient.connect(running.address) as client:
        journal.append_error = OSError(errno.EIO, "Input/output error")
        assert await add(client, 10) is not Status.OK
        assert server.read_only_causes == {Cause.JOURNAL_FAILED}
        journal.append_error = None
        await server.retry_journal_file()
        assert server.core.read_only and server.read_only_causes == {Cause.JOURNAL_FAILED}
        assert await add(client, 11) is Status.READ_ONLY
        await assert_all_readable(client, 10)


# --- a journal disk that fills while the bookie serves ------------------------------------------


class FillingJournal(FileJournal):
    """A file journal (4 KiB chunks) whose disk refuses to preallocate or to
    start a file with `growth_error` while that is set."""

    growth_error: OSError | None = None

    def _preallocate(self, needed_end: int) -> None:
        if self.growth_error is not None:
            raise self.growth_error
        super()._preallocate(needed_end)

    def _open_file(self, file_id: int) -> None:
        if self.growth_error is not None:
            raise self.growth_error
        super()._open_file(file_id)


@pytest.fixture
async def filling_journal_disk(tmp_path, disk, metadata, nursery):
    config = bookie_config(tmp_path)
    journal = FillingJournal(config.journal_dir, file_bytes_max=64 * 1024, preallocate_bytes=4096)
    running = await serve(config, journal, new_storage(config), metadata, nursery)
    yield running, journal
    running.server.stop()


async def add_until_refused(client: BookieClient, first_entry_id: int) -> int:
    """Add entries from `first_entry_id` on until one is refused; its id."""
    for entry_id in range(first_entry_id, first_entry_id + 50):  # 50 entries: more than 7 chunks
        status = await add(client, entry_id)
        if status is not Status.OK:
            assert status is Status.IO_ERROR
            return entry_id
    raise AssertionError("the journal never needed more room")


async def test_a_journal_disk_that_fills_while_serving_turns_writable_once_a_new_journal_file_fits(
    filling_journal_disk, caplog
):
    # No byte of the refused add was written, and it was never acknowledged:
    # nothing is lost, so the bookie need not wait for a restart.
    caplog.set_level(logging.INFO, logger="bookie.server")
    running, journal = filling_journal_disk
    server = running.server
    async with BookieClient.connect(running.address) as client:
        for entry_id in range(5):
            assert await add(client, entry_id) is Status.OK
        journal.growth_error = OSError(errno.ENOSPC, "No space left on device")
        refused = await add_until_refused(client, 5)
        assert server.read_only_causes == {Cause.JOURNAL_NO_FILE} and journal.failed is None
        assert (await client.get_info()).info["read_only_reason"] == (
            f"journal has no room: cannot preallocate journal file {journal_file_name(journal.current_file_id)}: "
            "No space left on device"
        )
        assert await add(client, refused) is Status.READ_ONLY
        await assert_all_readable(client, refused)
        # Room again: a disk check (once the refused batches are back) makes
        # a new file, and the bookie takes adds again.
        journal.growth_error = None

        async def writable_after_a_retry() -> bool:
            await server.retry_journal_file()
            return not server.core.read_only

        await wait_for(writable_after_a_retry, "writable once a retry makes a journal file")
        assert server.read_only_causes == frozenset() and running.modes == [True, False]
        for entry_id in range(refused, refused + 10):
            assert await add(client, entry_id) is Status.OK
        await assert_all_readable(client, refused + 10)
        async with server.storage_lock:
            mark = await server.checkpoint_locked()
        assert mark.file_id == journal.current_file_id
    lines = [record.getMessage() for record in caplog.records if "bookie turns" in record.getMessage()]
    assert lines[0].startswith("bookie turns read-only: journal has no room: ")
    assert lines[1] == "bookie turns writable (journal_no_file cleared)"


def refuse_growth_with_an_io_error(journal: FillingJournal, patch: pytest.MonkeyPatch) -> None:
    patch.setattr(journal, "growth_error", OSError(errno.EIO, "Input/output error"))


def refuse_record_writes_for_room(journal: FillingJournal, patch: pytest.MonkeyPatch) -> None:
    def write_parts_at(fd: int, parts: list[bytes], position: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    patch.setattr(journal_module, "write_parts_at", write_parts_at)


@pytest.mark.parametrize("refuse", [refuse_growth_with_an_io_error, refuse_record_writes_for_room])
async def test_a_failed_journal_write_keeps_the_bookie_read_only_though_room_comes_back(filling_journal_disk, refuse):
    # An I/O error, or no room once bytes of records were being written:
    # what is on disk past the synced end is unknown, so only a restart
    # (which replays the journal) clears it.
    running, journal = filling_journal_disk
    server = running.server
    async with BookieClient.connect(running.address) as client:
        with pytest.MonkeyPatch.context() as patch:
            refuse(journal, patch)
            refused = await add_until_refused(client, 0)
        assert server.read_only_causes == {Cause.JOURNAL_FAILED} and journal.failed
        for _ in range(3):
            await server.retry_journal_file()
            await trio.sleep(0.01)
        assert server.read_only_causes == {Cause.JOURNAL_FAILED}
        assert (await client.get_info()).info["read_only_reason"].endswith("; read-only until restarted")
        assert await add(client, refused) is Status.READ_ONLY
        await assert_all_readable(client, refused)
