"""The file journal: append, sync, replay from a mark, torn tails, rolling,
deleting covered files, refusing to go on after an I/O error, and refusing
records only until a new file fits when the disk has no room to grow."""

from __future__ import annotations

import errno
import os

import pytest

from bookie.journal import (
    FILE_HEADER,
    FileJournal,
    JournalCorruptError,
    JournalError,
    JournalNoRoomError,
    journal_file_name,
)
from bookie.storage_interfaces import JOURNAL_START, JournalPosition, JournalRecord, RecordKind


def records(count: int, start: int = 0, size: int = 100) -> list[JournalRecord]:
    return [JournalRecord(RecordKind.ADD, 1, entry_id, bytes([entry_id % 251]) * size) for entry_id in range(start, start + count)]


def open_journal(directory, **options) -> FileJournal:
    journal = FileJournal(directory, **{"file_bytes_max": 64 * 1024, "preallocate_bytes": 8192, **options})
    journal.start_new_file(JOURNAL_START)
    return journal


def test_replay_returns_every_synced_record_with_positions(tmp_path):
    journal = open_journal(tmp_path)
    written = records(10)
    journal.append(written[:4])
    end = journal.append(written[4:])
    journal.sync()
    replayed = list(FileJournal(tmp_path).replay(JOURNAL_START))
    assert [record for record, _ in replayed] == written
    assert replayed[-1][1] == end
    # Replaying from a position in the middle yields only what follows it.
    middle = replayed[3][1]
    assert [record for record, _ in FileJournal(tmp_path).replay(middle)] == written[4:]


def test_torn_tail_ends_replay_of_that_file_only(tmp_path):
    journal = open_journal(tmp_path)
    journal.append(records(5))
    journal.sync()
    first_file = journal.current_file_id
    path = tmp_path / journal_file_name(first_file)
    # Tear the last record: keep its length word, garble its body.
    data = bytearray(path.read_bytes())
    last_end = list(FileJournal(tmp_path).replay(JOURNAL_START))[-1][1].offset
    data[last_end - 10 : last_end] = b"\xff" * 10
    path.write_bytes(bytes(data))
    # A restart continues in a new file, whose records still replay.
    journal = FileJournal(tmp_path)
    position = journal.start_new_file(JournalPosition(first_file, last_end))
    journal.append(records(2, start=100))
    journal.sync()
    replayed = [record.entry_id for record, _ in FileJournal(tmp_path).replay(JOURNAL_START)]
    assert replayed == [0, 1, 2, 3, 100, 101]
    assert position.file_id == first_file + 1


def test_zeros_after_the_last_record_end_the_file(tmp_path):
    journal = open_journal(tmp_path, preallocate_bytes=1 << 20)
    journal.append(records(3))
    journal.sync()
    assert os.path.getsize(tmp_path / journal_file_name(journal.current_file_id)) >= 1 << 20
    assert len(list(FileJournal(tmp_path).replay(JOURNAL_START))) == 3


def test_rolls_to_new_files_and_deletes_only_covered_ones(tmp_path):
    journal = open_journal(tmp_path, file_bytes_max=64 * 1024)
    positions = [journal.append(records(50, start=batch * 50, size=200)) for batch in range(20)]
    journal.sync()
    files = journal.file_ids()
    assert len(files) >= 3
    assert [record.entry_id for record, _ in FileJournal(tmp_path).replay(JOURNAL_START)] == list(range(1000))
    mark = positions[10]
    deleted = journal.delete_before(mark)
    assert deleted == [file_id for file_id in files if file_id < mark.file_id]
    remaining = [record.entry_id for record, _ in FileJournal(tmp_path).replay(mark)]
    assert remaining == list(range(550, 1000))


def test_a_new_file_is_never_behind_the_mark(tmp_path):
    journal = FileJournal(tmp_path)
    # Even with no files on disk, a mark in file 41 makes the next file 42.
    assert journal.start_new_file(JournalPosition(41, 999)) == JournalPosition(42, FILE_HEADER.size)


def test_a_foreign_file_refuses_replay(tmp_path):
    (tmp_path / journal_file_name(3)).write_bytes(FILE_HEADER.pack(b"QJNL", 1, 4) + bytes(100))
    with pytest.raises(JournalCorruptError):
        list(FileJournal(tmp_path).replay(JOURNAL_START))


def test_after_an_io_error_the_journal_refuses_more_records(tmp_path):
    journal = open_journal(tmp_path)
    journal.append(records(1))
    os.close(journal._fd)  # the disk goes away under it
    with pytest.raises(JournalError):
        journal.append(records(1, start=1))
    with pytest.raises(JournalError, match="failed earlier"):
        journal.append(records(1, start=2))
    journal._fd = None
    journal._unsynced_fds.clear()


def test_records_larger_than_preallocation_are_written_whole(tmp_path):
    journal = open_journal(tmp_path, preallocate_bytes=4096, file_bytes_max=1 << 20)
    big = [JournalRecord(RecordKind.ADD, 1, 0, b"z" * 100_000)]
    journal.append(big)
    journal.sync()
    assert [record for record, _ in FileJournal(tmp_path).replay(JOURNAL_START)] == big


def test_a_corrupt_record_followed_by_intact_ones_refuses_replay(tmp_path):
    # Bit rot in synced data is not a torn tail: replay must not quietly stop
    # there (losing acknowledged entries) but refuse, keeping the file.
    journal = open_journal(tmp_path)
    journal.append(records(10))
    journal.sync()
    path = tmp_path / journal_file_name(journal.current_file_id)
    data = bytearray(path.read_bytes())
    third = list(FileJournal(tmp_path).replay(JOURNAL_START))[2][1].offset  # the end of record 2
    data[third + 40] ^= 0x01  # a byte inside record 3
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError, match="intact record follows"):
        list(FileJournal(tmp_path).replay(JOURNAL_START))
    assert path.exists()


def test_a_corrupt_length_field_followed_by_intact_records_is_found_too(tmp_path):
    journal = open_journal(tmp_path)
    journal.append(records(10))
    journal.sync()
    path = tmp_path / journal_file_name(journal.current_file_id)
    data = bytearray(path.read_bytes())
    fourth = list(FileJournal(tmp_path).replay(JOURNAL_START))[3][1].offset  # the start of record 4
    data[fourth] ^= 0x80  # its length field
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError):
        list(FileJournal(tmp_path).replay(JOURNAL_START))


class SmallDisk:
    """os.pwrite and os.pwritev on a disk with `room_bytes` left: a write
    past the room is cut short (as Linux does), the next one refused with
    ENOSPC."""

    def __init__(self, monkeypatch, room_bytes: int) -> None:
        self.room_bytes = room_bytes
        self._pwrite = os.pwrite
        monkeypatch.setattr(os, "pwrite", self.pwrite)
        monkeypatch.setattr(os, "pwritev", self.pwritev)

    def pwrite(self, fd: int, data, offset: int) -> int:
        if self.room_bytes <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        written = self._pwrite(fd, bytes(data)[: self.room_bytes], offset)
        self.room_bytes -= written
        return written

    def pwritev(self, fd: int, parts, offset: int) -> int:
        return self.pwrite(fd, b"".join(parts), offset)


def test_a_new_file_the_disk_holds_only_in_part_is_refused_and_removed(tmp_path, monkeypatch):
    # The preallocation's short write went unnoticed: the file passed for a
    # preallocated one, and a bookie started on a full journal disk took it
    # for room it did not have.
    SmallDisk(monkeypatch, room_bytes=64 * 1024)
    journal = FileJournal(tmp_path, preallocate_bytes=1024 * 1024)
    with pytest.raises(OSError) as raised:
        journal.start_new_file(JOURNAL_START)
    assert raised.value.errno == errno.ENOSPC
    assert journal.file_ids() == [] and list(tmp_path.iterdir()) == []



def replayed_ids(directory) -> list[int]:
    return [record.entry_id for record, _ in FileJournal(directory).replay(JOURNAL_START)]


@pytest.mark.parametrize(
    "synced, step",
    [(60, "preallocate journal file 0000000000000001.journal"), (500, "start a new journal file")],
    ids=["preallocating", "rolling"],
)
def test_no_room_to_grow_refuses_records_until_a_new_file_fits(tmp_path, monkeypatch, synced, step):
    # 60 records fill most of the first 8 KiB chunk, 500 most of the 64 KiB
    # file; 100 more need another chunk or a new file. The disk cuts those
    # zeros (or the new file) short: no byte of a record is written, so the
    # journal has not failed, it waits for room.
    journal = open_journal(tmp_path)
    end = journal.append(records(synced))
    journal.sync()
    disk = SmallDisk(monkeypatch, room_bytes=100)
    with pytest.raises(JournalNoRoomError, match=f"^cannot {step}: No space left on device$"):
        journal.append(records(100, start=synced))
    assert journal.failed is None and journal.room_bytes() == 0 and not journal.needs_prepare()
    assert journal.file_ids() == [1]  # a new file cut short is removed
    assert not (tmp_path / journal_file_name(1)).read_bytes()[end.offset :].strip(b"\0")
    # Refused until a new file is started, even records that would fit.
    disk.room_bytes = 1 << 30
    with pytest.raises(JournalNoRoomError):
        journal.append(records(1, start=synced))
    assert replayed_ids(tmp_path) == list(range(synced))
    assert journal.start_new_file(end) == JournalPosition(2, FILE_HEADER.size)
    journal.append(records(100, start=synced))
    journal.sync()
    assert journal.no_room is None
    assert replayed_ids(tmp_path) == list(range(synced + 100))
    journal.close()


def test_no_room_while_writing_records_fails_the_journal_for_good(tmp_path, monkeypatch):
    # The chunk is preallocated, but a copy-on-write file system allocates on
    # overwrite: the write is cut short, so part of a record may be on disk.
    journal = open_journal(tmp_path)
    journal.append(records(5))
    journal.sync()
    disk = SmallDisk(monkeypatch, room_bytes=150)
    with pytest.raises(JournalError) as raised:
        journal.append(records(5, start=5))
    assert not isinstance(raised.value, JournalNoRoomError) and "No space left on device" in journal.failed
    disk.room_bytes = 1 << 30
    journal.start_new_file(JOURNAL_START)  # a new file does not clear it
    with pytest.raises(JournalError, match="failed earlier"):
        journal.append(records(1, start=10))
    journal.close()


def test_an_io_error_while_preallocating_fails_the_journal_for_good(tmp_path, monkeypatch):
    journal = open_journal(tmp_path)

    def preallocate(needed_end: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(journal, "_preallocate", preallocate)
    with pytest.raises(JournalError) as raised:
        journal.append(records(100))
    assert not isinstance(raised.value, JournalNoRoomError) and "Input/output error" in journal.failed
    assert journal.no_room is None
    journal.close()
