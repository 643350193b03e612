"""The bookie's write-ahead journal on disk: append, fsync, replay, roll, delete.

Files are preallocated with zeros (measured here: fdatasync of an overwrite is
about half the latency of an append that grows the file), records carry a
length and a CRC32C so that a torn tail ends replay of its file, and after any
I/O error the journal refuses further appends: the bookie must not write past
a hole whose contents it does not know. A disk with no room for more zeros or
a new file refuses appends only until a new file is started.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Iterator, NoReturn

import crc32c

from bookie.durable_files import fsync_directory, write_parts_at
from bookie.flush_room import NO_SPACE_ERRNOS

from bookie.storage_interfaces import JournalCorruptError, JournalPosition, JournalRecord, RecordKind

log = logging.getLogger(__name__)

FILE_MAGIC = b"QJNL"
FILE_VERSION = 1
FILE_HEADER = struct.Struct(">4sIQ")  # magic, version, file id
RECORD_FRAME = struct.Struct(">II")  # body length, crc32c of body
RECORD_HEAD = struct.Struct(">BQq")  # kind, ledger id, entry id
RECORD_OVERHEAD = RECORD_FRAME.size + RECORD_HEAD.size
SUFFIX = ".journal"


class JournalError(Exception):
    """The journal cannot take more records (an I/O error happened, or the
    disk has no room); the bookie must turn read-only."""


class JournalNoRoomError(JournalError):
    """The disk had no room to extend the journal's file or to start the
    next one, before any byte of a record was written: the journal refuses
    records until `start_new_file` succeeds."""


def _parse_record(data: bytes, position: int) -> tuple[JournalRecord, int] | None:
    """The intact record at `position` and the position after it, or None."""
    if position + RECORD_OVERHEAD > len(data):
        return None
    length, checksum = RECORD_FRAME.unpack_from(data, position)
    body_start = position + RECORD_FRAME.size
    body_end = body_start + length
    if length < RECORD_HEAD.size or body_end > len(data):
        return None
    if crc32c.crc32c(memoryview(data)[body_start:body_end]) != checksum:
        return None
    kind, ledger_id, entry_id = RECORD_HEAD.unpack_from(data, body_start)
    try:
        record_kind = RecordKind(kind)
    except ValueError:
        return None
    return JournalRecord(record_kind, ledger_id, entry_id, data[body_start + RECORD_HEAD.size : body_end]), body_end


def _zeros_only(data: bytes, position: int) -> bool:
    return not data[position:].strip(b"\0")


def _next_intact_record(data: bytes, start: int) -> int | None:
    """The offset of the first intact record at or after `start`. Only the
    non-zero part of the file is searched; after real corruption the next
    record is usually within a few KiB, after a torn tail there is none."""
    end = len(data.rstrip(b"\0"))
    for position in range(start, max(start, end - RECORD_OVERHEAD + 1)):
        length = int.from_bytes(data[position : position + 4], "big")
        if RECORD_HEAD.size <= length <= end - position - RECORD_FRAME.size and _parse_record(data, position):
            return position
    return None


def journal_file_name(file_id: int) -> str:
    return f"{file_id:016x}{SUFFIX}"


def encode_records(records: list[JournalRecord]) -> list[bytes]:
    """The records' bytes as parts for pwritev (joining would copy them)."""
    parts: list[bytes] = []
    for record in records:
        head = RECORD_HEAD.pack(record.kind, record.ledger_id, record.entry_id)
        checksum = crc32c.crc32c(record.data, crc32c.crc32c(head))
        parts.append(RECORD_FRAME.pack(len(head) + len(record.data), checksum))
        parts.append(head)
        parts.append(record.data)
    return parts


class FileJournal:
    """A directory of journal files. `append` and `sync` run on one thread."""

    def __init__(
        self, directory: Path, *, file_bytes_max: int = 256 * 1024 * 1024, preallocate_bytes: int = 4 * 1024 * 1024
    ) -> None:
        if file_bytes_max < 64 * 1024:
            raise ValueError("journal file_bytes_max must be at least 64 KiB")
        if preallocate_bytes < 4096:
            raise ValueError("journal preallocate_bytes must be at least 4 KiB")
        self.directory = Path(directory)
        self.file_bytes_max = file_bytes_max
        self.preallocate_bytes = preallocate_bytes
        self.failed: str | None = None  # for good: a write or fsync failed
        self.no_room: str | None = None  # until start_new_file: no room to grow
        self._fd: int | None = None
        self._file_id = -1
        self._offset = 0
        self._allocated = 0
        self._unsynced_fds: list[int] = []

    # --- files ----------------------------------------------------------------

    def file_ids(self) -> list[int]:
        ids = []
        for path in self.directory.iterdir():
            if path.name.endswith(SUFFIX):
                try:
                    ids.append(int(path.name[: -len(SUFFIX)], 16))
                except ValueError:
                    continue
        return sorted(ids)

    def start_new_file(self, after: JournalPosition) -> JournalPosition:
        """Open a fresh file with an id above every existing file and above
        `after`, so that positions (and the checkpoint mark) only move forward."""
        file_id = max([after.file_id, self._file_id, *self.file_ids()]) + 1
        self._open_file(file_id)
        self.no_room = None
        return JournalPosition(file_id, self._offset)

    def _open_file(self, file_id: int) -> None:
        path = self.directory / journal_file_name(file_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            header = FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION, file_id)
            # A short write is finished or refused: a file the disk holds
            # only in part must not pass for a preallocated one.
            write_parts_at(fd, [header + bytes(self.preallocate_bytes - len(header))], 0)
            os.fdatasync(fd)
            fsync_directory(self.directory)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        if self._fd is not None:
            # The old file may hold records not yet synced: sync() covers it.
            if self._fd not in self._unsynced_fds:
                os.close(self._fd)
        self._fd = fd
        self._file_id = file_id
        self._offset = FILE_HEADER.size
        self._allocated = self.preallocate_bytes

    # --- writing ----------------------------------------------------------------

    def append(self, records: list[JournalRecord]) -> JournalPosition:
        if self.failed:
            raise JournalError(f"journal failed earlier: {self.failed}")
        if self.no_room:
            raise JournalNoRoomError(self.no_room)
        assert self._fd is not None, "start_new_file() must be called before append()"
        parts = encode_records(records)
        size = sum(map(len, parts))
        step = ""
        try:
            if self._offset + size > self.file_bytes_max and self._offset > FILE_HEADER.size:
                step = "start a new journal file"
                self._note_unsynced(self._fd)
                self._open_file(self._file_id + 1)
            if self._offset + size > self._allocated:
                step = f"preallocate journal file {journal_file_name(self._file_id)}"
                self._preallocate(self._offset + size)
        except OSError as error:
            if error.errno in NO_SPACE_ERRNOS:
                # No byte of these records reached a file: a preallocation
                # cut short leaves only zeros past the last record (where
                # replay stops), and a new file that could not be filled is
                # removed. So no room here is no failure: the journal goes on
                # in a new file once one fits.
                self.no_room = f"cannot {step}: {error.strerror or error}"
                raise JournalNoRoomError(self.no_room) from error
            self._fail(error)
        try:
            write_parts_at(self._fd, parts, self._offset)
        except OSError as error:
            # For good, even ENOSPC (copy-on-write file systems allocate on
            # overwrite): part of a record may be on disk past the synced end,
            # and after a failed write the page cache no longer says what is.
            self._fail(error)
        self._offset += size
        self._note_unsynced(self._fd)
        return JournalPosition(self._file_id, self._offset)

    def _fail(self, error: OSError) -> NoReturn:
        self.failed = f"{error} (file {journal_file_name(self._file_id)})"
        raise JournalError(self.failed) from error

    def _note_unsynced(self, fd: int) -> None:
        if fd not in self._unsynced_fds:
            self._unsynced_fds.append(fd)

    def room_bytes(self) -> int:
        """Bytes of records that fit in space already preallocated in the
        current file: writing them needs no allocation and no roll."""
        if self.failed or self.no_room or self._fd is None:
            return 0
        return max(0, min(self._allocated, self.file_bytes_max) - self._offset - RECORD_OVERHEAD)

    def needs_prepare(self) -> bool:
        return (
            not self.failed
            and not self.no_room
            and self._fd is not None
            and self._allocated - self._offset < self.preallocate_bytes // 2
            and self._allocated < self.file_bytes_max
        )

    def prepare(self) -> None:
        """Housekeeping ahead of need, on the journal thread when idle:
        preallocate the next chunk once less than half a chunk is left."""
        if self.needs_prepare():
            try:
                self._preallocate(self._allocated + 1)
            except OSError as error:
                # A full disk shows here first; the append that needs the
                # space refuses its batch (JournalNoRoomError).
                log.warning("journal preallocation failed: %s", error)
                return
            # Sync the zeros (and the new file size) now, while the journal
            # is idle: left dirty, they would be written by the next record
            # fsync, making it take milliseconds instead of a fraction of one.
            try:
                os.fdatasync(self._fd)
            except OSError as error:
                self.failed = f"fsync failed: {error}"
                log.error("journal fsync after preallocation failed: %s", error)

    def _preallocate(self, needed_end: int) -> None:
        new_allocated = self._allocated
        while new_allocated < needed_end:
            new_allocated += self.preallocate_bytes
        zeros = bytes(min(new_allocated - self._allocated, 64 * 1024 * 1024))
        position = self._allocated
        while position < new_allocated:
            chunk = zeros[: new_allocated - position]
            write_parts_at(self._fd, [chunk], position)
            position += len(chunk)
        self._allocated = new_allocated

    def sync(self) -> None:
        if self.failed:
            raise JournalError(f"journal failed earlier: {self.failed}")
        try:
            # Older files first: a record is durable only when every record
            # before it is, and a rolled file may still hold unsynced records.
            for fd in self._unsynced_fds:
                os.fdatasync(fd)
        except OSError as error:
            # After a failed fsync the page cache no longer says what is on
            # disk; never retry it (PostgreSQL's "fsyncgate").
            self.failed = f"fsync failed: {error}"
            raise JournalError(self.failed) from error
        for fd in self._unsynced_fds:
            if fd != self._fd:
                os.close(fd)
        self._unsynced_fds.clear()

    # --- reading back -----------------------------------------------------------

    def replay(self, start: JournalPosition) -> Iterator[tuple[JournalRecord, JournalPosition]]:
        for file_id in self.file_ids():
            if file_id < start.file_id:
                continue
            yield from self._replay_file(file_id, start.offset if file_id == start.file_id else 0)

    def _replay_file(self, file_id: int, offset: int) -> Iterator[tuple[JournalRecord, JournalPosition]]:
        path = self.directory / journal_file_name(file_id)
        with open(path, "rb") as file:
            data = file.read()
        if len(data) < FILE_HEADER.size:
            log.warning("journal file %s has no complete header; treating it as empty", path)
            return
        magic, version, header_file_id = FILE_HEADER.unpack_from(data)
        if magic != FILE_MAGIC or version != FILE_VERSION or header_file_id != file_id:
            raise JournalCorruptError(f"{path} is not journal file {file_id} (magic {magic!r}, id {header_file_id})")
        position = max(offset, FILE_HEADER.size)
        while position + RECORD_OVERHEAD <= len(data):
            parsed = _parse_record(data, position)
            if parsed is None:
                if _zeros_only(data, position):
                    return  # preallocated zeros: the end of what was written
                following = _next_intact_record(data, position + 1)
                if following is not None:
                    # A torn write ends a file: bytes that never reached the
                    # disk are followed by nothing but more of the same. An
                    # intact record after a broken one means bytes that were
                    # synced changed: acknowledged entries may be gone.
                    raise JournalCorruptError(
                        f"{path}: the record at offset {position} is corrupt but an intact record follows at offset "
                        f"{following}: journal data that was synced has changed. The bookie cannot know which "
                        "acknowledged entries it lost, so it refuses to start; the file is kept for inspection. "
                        "Re-replicate its ledgers and format it (`quire bookie format`)."
                    )
                log.warning("journal %s: torn record at offset %d ends replay of this file", path, position)
                return
            record, position = parsed
            yield record, JournalPosition(file_id, position)

    # --- cleaning up ------------------------------------------------------------

    def delete_before(self, mark: JournalPosition) -> list[int]:
        deleted = []
        for file_id in self.file_ids():
            if file_id >= mark.file_id or file_id == self._file_id:
                continue
            (self.directory / journal_file_name(file_id)).unlink(missing_ok=True)
            deleted.append(file_id)
        if deleted:
            fsync_directory(self.directory)
        return deleted

    @property
    def current_file_id(self) -> int:
        return self._file_id

    def close(self) -> None:
        fds = set(self._unsynced_fds)
        if self._fd is not None:
            fds.add(self._fd)
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._unsynced_fds.clear()
        self._fd = None

