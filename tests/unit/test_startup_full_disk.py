"""Start-up recovery on a full ledger disk: a checkpoint that does not fit is
held, not written, and not a reason to refuse to start. Replay completes,
replayed entries stay readable from the write cache, the mark stays behind
every entry not yet flushed, no journal file they are in is deleted, and
once there is room the held checkpoint completes. A hypothesis machine
crashes the bookie at any point while its disk fills and empties."""

from __future__ import annotations

import errno

import pytest
from hypothesis import settings
from hypothesis.stateful import precondition, rule

from bookie.core_actions import CoreLimits
from bookie.flush_room import FailureKind
from bookie.ledger_storage import LedgerStorage
from bookie.sim_storage import SimEntryIndex, SimEntryLog, SimJournal
from bookie.startup_recovery import ReplayHeldError, recover
from bookie.storage_interfaces import JOURNAL_START, IndexWriteError
from tests.unit.test_startup_recovery import CrashingBookie

FULL = "checkpoint held: 1.0 MiB to flush, 0.5 MiB free on the ledger disk, 2.0 MiB of it kept for the index"


class FullDiskCrashingBookie(CrashingBookie):
    """The crashing bookie of test_startup_recovery, whose ledger disk fills
    and empties: while it is full, no checkpoint is written, at start-up or
    later, and recovery hands the held one to the driver."""

    def __init__(self) -> None:
        self.disk_full = False
        super().__init__()

    def restart(self) -> None:
        self.storage = LedgerStorage(self.entry_log, self.entry_index, write_cache_bytes=4000, read_cache_bytes=1000)
        self.core, report = recover(
            bookie_id="b", limits=CoreLimits(), journal=self.journal, storage=self.storage,
            flush_room=lambda checkpoint: FULL if self.disk_full else "",
        )
        self.synced_position = report.mark_after
        assert report.mark_durable == self.entry_index.load_mark()
        if report.held is None:
            assert report.mark_durable == report.mark_after
        else:
            assert report.mark_durable <= report.held.checkpoint.mark <= report.mark_after
        self.queue = []
        self.appended_unsynced = []
        self.checkpoint = None if report.held is None else report.held.checkpoint

    @rule()
    def fill_disk(self) -> None:
        self.disk_full = True

    @rule()
    def free_disk(self) -> None:
        self.disk_full = False

    @precondition(lambda self: self.checkpoint is not None and not self.disk_full)
    @rule()
    def finish_checkpoint(self) -> None:
        super().finish_checkpoint()


FullDiskCrashingBookie.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestFullDiskCrashingBookie = FullDiskCrashingBookie.TestCase


# --- one start on a full disk, step by step ----------------------------------------


def written_bookie(entries: int, entry_bytes: int = 100):
    """A bookie that journalled `entries` adds of ledger 1 and crashed before
    any checkpoint after the first start: everything is in the journal."""
    machine = CrashingBookie()
    for _ in range(entries):
        machine.add(1, entry_bytes)
    machine.sync()
    assert len(machine.acknowledged) == entries
    return machine


def restart_full(machine, **options):
    machine.journal.crash()
    machine.entry_log.crash()
    storage = LedgerStorage(machine.entry_log, machine.entry_index, write_cache_bytes=4000, read_cache_bytes=1000)
    core, report = recover(
        bookie_id="b", limits=CoreLimits(), journal=machine.journal, storage=storage, flush_room=lambda checkpoint: FULL, **options
    )
    return core, storage, report


def test_a_full_disk_at_start_holds_the_checkpoint_and_keeps_every_entry_readable():
    machine = written_bookie(50)  # 50 x ~130 bytes: past half the 4000-byte cache
    files_before = machine.journal.file_ids()
    mark_before = machine.entry_index.load_mark()
    core, storage, report = restart_full(machine)
    assert report.held is not None and report.held.kind is FailureKind.NO_SPACE and report.held.reason == FULL
    # Replay went to the end; the mark did not move past what is unflushed,
    # and no journal file was deleted.
    assert report.records_replayed >= 50
    assert report.mark_durable == mark_before == machine.entry_index.load_mark()
    assert report.journal_files_deleted == []
    assert set(files_before) <= set(machine.journal.file_ids())
    # Every acknowledged entry reads back, from the write cache.
    for (ledger_id, entry_id), data in machine.acknowledged.items():
        assert storage.read(ledger_id, entry_id, 1, 1 << 20).entries == [data]
    # Room comes back: the held checkpoint is written, then the rest.
    storage.run_checkpoint(report.held.checkpoint)
    storage.end_checkpoint()
    rest = storage.begin_checkpoint(core.take_dirty_ledger_states(), report.mark_after)
    storage.run_checkpoint(rest)
    storage.end_checkpoint()
    assert machine.entry_index.load_mark() == report.mark_after
    machine.journal.delete_before(report.mark_after)
    for (ledger_id, entry_id), data in machine.acknowledged.items():
        assert storage.read(ledger_id, entry_id, 1, 1 << 20).entries == [data]
        assert machine.entry_index.get(ledger_id, entry_id) is not None


def test_replay_that_would_hold_more_than_memory_allows_refuses_with_a_clear_error():
    machine = written_bookie(200)
    with pytest.raises(ReplayHeldError, match="more than 5000 bytes of entries not yet in the entry logs"):
        restart_full(machine, held_bytes_max=5000)
    # Nothing was lost meanwhile: a start with room replays it all.
    storage = LedgerStorage(machine.entry_log, machine.entry_index, write_cache_bytes=4000, read_cache_bytes=1000)
    _, report = recover(bookie_id="b", limits=CoreLimits(), journal=machine.journal, storage=storage)
    assert report.held is None
    for (ledger_id, entry_id), data in machine.acknowledged.items():
        assert storage.read(ledger_id, entry_id, 1, 1 << 20).entries == [data]


class FullJournal(SimJournal):
    def start_new_file(self, after):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_journal_disk_too_full_for_a_new_file_starts_without_a_journal():
    journal = FullJournal()
    storage = LedgerStorage(SimEntryLog(), SimEntryIndex(), write_cache_bytes=4000)
    core, report = recover(bookie_id="b", limits=CoreLimits(), journal=journal, storage=storage)
    assert report.journal_no_file == "journal has no file: cannot start a new journal file: No space left on device"
    assert report.mark_after == JOURNAL_START and report.held is None


class RefusingEntryLog(SimEntryLog):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def write_staged(self) -> None:
        raise self.error


@pytest.mark.parametrize(
    "error, kind",
    [
        (OSError(errno.ENOSPC, "No space left on device"), FailureKind.NO_SPACE),
        (OSError(errno.EIO, "Input/output error"), FailureKind.IO_ERROR),
        (IndexWriteError("index write failed: IO error: No space left on device"), FailureKind.INDEX),
    ],
)
def test_a_start_up_checkpoint_that_the_disk_refuses_is_held_not_fatal(error, kind):
    # The room check passed (the estimate was fine), yet the write failed.
    machine = written_bookie(10)
    machine.journal.crash()
    storage = LedgerStorage(RefusingEntryLog(error), machine.entry_index, write_cache_bytes=4000, read_cache_bytes=1000)
    core, report = recover(bookie_id="b", limits=CoreLimits(), journal=machine.journal, storage=storage)
    assert report.held is not None and report.held.kind is kind
    assert report.mark_durable == machine.entry_index.load_mark()
    for (ledger_id, entry_id), data in machine.acknowledged.items():
        assert storage.read(ledger_id, entry_id, 1, 1 << 20).entries == [data]
