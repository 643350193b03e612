"""Whether a checkpoint's flush fits on the ledger disk (bookie.flush_room):
the estimate of what a flush writes, checked against real entry log and
RocksDB files; the reserve kept for the journal and the index; the shrunk
flush trigger; what a failed write means; and the retry backoff."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from bookie.entry_index import RocksEntryIndex
from bookie.entry_log import FileEntryLog
from bookie.flush_room import (
    FLUSH_TRIGGER_BYTES_MIN,
    IO_ERROR_RETRY_DELAY_S_MAX,
    LEDGER_DISK_MARGIN_BYTES,
    RETRY_DELAY_S_MAX,
    RETRY_DELAY_S_MIN,
    DiskRoom,
    FailureKind,
    Reserve,
    RetryBackoff,
    check_flush,
    classify_failure,
    describe_failure,
    flush_bytes,
    flush_trigger_bytes,
    journal_reserve_bytes,
)
from bookie.ledger_storage import LedgerStorage
from bookie.storage_interfaces import IndexWriteError, JournalPosition

MIB = 1024 * 1024
RESERVE = Reserve(journal_bytes=9 * MIB)


def room(free_mib: float, *, shares: bool = False, memtable_bytes: int = 0, queued_bytes: int = 0) -> DiskRoom:
    return DiskRoom(int(free_mib * MIB), memtable_bytes, shares, queued_bytes)


# --- the estimate -----------------------------------------------------------


def allocated_bytes(directory: Path) -> int:
    return sum(os.stat(os.path.join(root, name)).st_blocks * 512 for root, _, names in os.walk(directory) for name in names)


@pytest.mark.parametrize(
    "entries, entry_bytes",
    [
        (20_000, 40),  # small entries: the index grows more than the entry log
        (300, 60_000),  # large entries: the entry log is nearly all of it
    ],
)
def test_the_estimate_covers_what_a_real_flush_writes(tmp_path, entries, entry_bytes):
    # A real checkpoint into real files: the disk they take afterwards (WAL
    # included, as RocksDB has not flushed its memtable yet) is within what
    # the estimate promised. A wrong constant makes this fail.
    (tmp_path / "entrylogs").mkdir()
    (tmp_path / "index").mkdir()
    storage = LedgerStorage(
        FileEntryLog(tmp_path / "entrylogs", log_bytes_max=4 * MIB), RocksEntryIndex(tmp_path / "index"),
        write_cache_bytes=64 * MIB,
    )
    try:
        before = allocated_bytes(tmp_path)
        for entry_id in range(entries):
            storage.put(7, entry_id, os.urandom(entry_bytes))
        checkpoint = storage.begin_checkpoint({}, JournalPosition(1, 100))
        estimate = flush_bytes(storage.write_cache.flushing_entries, storage.write_cache.flushing_bytes, 4 * MIB)
        storage.run_checkpoint(checkpoint)
        storage.end_checkpoint()
        written = allocated_bytes(tmp_path) - before
        memtable_bytes = storage.entry_index.memtable_bytes()
    finally:
        storage.close()
    assert 0 < written <= estimate
    # Not absurdly pessimistic either: a reserve that is mostly air would
    # hold checkpoints that fit.
    assert estimate <= 2 * written + 64 * 1024
    # What RocksDB still holds in memory is reported, for the reserve.
    assert memtable_bytes > 0


def test_a_flush_spread_over_more_logs_needs_more_slack():
    one_log = flush_bytes(100, 10 * MIB, 1024 * MIB)
    many_logs = flush_bytes(100, 10 * MIB, MIB)
    assert many_logs > one_log


# --- the check --------------------------------------------------------------------


def test_a_flush_fits_when_free_space_less_the_reserve_holds_it():
    needed = 10 * MIB
    just_enough = room((needed + LEDGER_DISK_MARGIN_BYTES) / MIB)
    verdict = check_flush(needed, just_enough, RESERVE)
    assert verdict.fits and verdict.reason == "" and verdict.room_after_bytes == 0
    one_byte_short = DiskRoom(just_enough.free_bytes - 1, 0, False)
    verdict = check_flush(needed, one_byte_short, RESERVE)
    assert not verdict.fits and verdict.room_after_bytes == -1


def test_the_journal_reserve_counts_only_on_a_shared_disk():
    # 15 MiB free, 10 MiB to flush: fine when the journal has its own disk;
    # held when it shares this one (2 MiB margin + 9 MiB for the journal).
    assert check_flush(10 * MIB, room(15), RESERVE).fits
    verdict = check_flush(10 * MIB, room(15, shares=True), RESERVE)
    assert not verdict.fits
    assert verdict.kept_bytes == LEDGER_DISK_MARGIN_BYTES + 9 * MIB
    assert verdict.reason == (
        "checkpoint held: 10.0 MiB to flush, 15.0 MiB free on the ledger disk, 11.0 MiB of it kept for the journal and the index"
    )


def test_adds_queued_for_a_shared_journal_and_the_index_memtables_are_kept_free_too():
    assert check_flush(10 * MIB, room(22, shares=True), RESERVE).fits
    assert not check_flush(10 * MIB, room(22, shares=True, queued_bytes=2 * MIB), RESERVE).fits
    assert not check_flush(10 * MIB, room(22, shares=True, memtable_bytes=2 * MIB), RESERVE).fits
    # The journal's queue is not on this disk when the journal is not.
    assert check_flush(10 * MIB, room(13, queued_bytes=50 * MIB), RESERVE).fits


def test_a_full_disk_holds_even_an_empty_flush_only_below_the_margin():
    # Ledger states alone (no entries) still go to the index: a tiny flush.
    needed = flush_bytes(0, 0, 1024 * MIB)
    assert check_flush(needed, room(3), RESERVE).fits
    assert not check_flush(needed, room(1), RESERVE).fits


def test_the_journal_reserve_is_two_preallocation_chunks_and_a_batch():
    assert journal_reserve_bytes(4 * MIB, 1 * MIB) == 9 * MIB


# --- shrinking the write cache's flush trigger ---------------------------------------


def test_the_flush_trigger_shrinks_to_half_the_room_left_and_no_lower_than_its_floor():
    half_bytes = 32 * MIB
    assert flush_trigger_bytes(half_bytes, 10 * 1024 * MIB) == half_bytes  # plenty of room
    assert flush_trigger_bytes(half_bytes, 20 * MIB) == 10 * MIB
    assert flush_trigger_bytes(half_bytes, 100 * 1024) == FLUSH_TRIGGER_BYTES_MIN
    assert flush_trigger_bytes(half_bytes, -5 * MIB) == FLUSH_TRIGGER_BYTES_MIN  # a held flush


# --- failures ------------------------------------------------------------------------


def test_no_space_and_quota_are_a_state_other_io_errors_and_the_index_are_not():
    assert classify_failure(OSError(errno.ENOSPC, "No space left on device"), index_error=False) is FailureKind.NO_SPACE
    assert classify_failure(OSError(errno.EDQUOT, "Disk quota exceeded"), index_error=False) is FailureKind.NO_SPACE
    assert classify_failure(OSError(errno.EIO, "Input/output error"), index_error=False) is FailureKind.IO_ERROR
    # RocksDB refuses every write after one that found the disk full.
    error = IndexWriteError("index write failed: IO error: No space left on device")
    assert classify_failure(error, index_error=True) is FailureKind.INDEX


def test_each_failure_says_whether_it_clears_by_itself():
    no_space = describe_failure(FailureKind.NO_SPACE, OSError(errno.ENOSPC, "No space left on device"))
    assert no_space == "checkpoint held: the ledger disk refused the flush (No space left on device); retrying"
    io_error = describe_failure(FailureKind.IO_ERROR, OSError(errno.EIO, "Input/output error"))
    assert io_error == "checkpoint failed: Input/output error; read-only until restarted"
    index = describe_failure(FailureKind.INDEX, IndexWriteError("index write failed: IO error"))
    assert index == "index failed: index write failed: IO error; read-only until restarted"


# --- backoff ----------------------------------------------------------------------------


def test_retries_back_off_to_a_cap_with_jitter_and_never_give_up():
    backoff = RetryBackoff(random.Random(7))
    delays = [backoff.next_delay_s() for _ in range(200)]
    assert delays[0] <= RETRY_DELAY_S_MIN * 1.2
    assert all(delay <= RETRY_DELAY_S_MAX for delay in delays)
    assert min(delays[50:]) >= RETRY_DELAY_S_MAX * 0.8  # capped, still trying
    assert len(set(delays[50:])) > 1  # jitter: bookies do not retry in step


def test_after_an_io_error_retries_wait_longer_and_a_success_resets_them():
    backoff = RetryBackoff(random.Random(7))
    delays = [backoff.next_delay_s(FailureKind.IO_ERROR) for _ in range(30)]
    assert max(delays) > RETRY_DELAY_S_MAX
    assert all(delay <= IO_ERROR_RETRY_DELAY_S_MAX for delay in delays)
    backoff.reset()
    assert backoff.next_delay_s() <= RETRY_DELAY_S_MIN * 1.2
