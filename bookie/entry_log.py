"""Entry log files: where entries rest after a checkpoint, sorted by (ledger, entry).

Each record carries the bookie's own CRC32C of the entry bytes, whatever
digest the client chose, and the ledger and entry ids, which a read compares
with what it asked for; so a flipped bit on disk is always found when the
entry is read back (and answered with IO_ERROR, never NO_ENTRY). Staging
counts the bytes each ledger puts into each log, for garbage collection,
which also scans logs (compaction) and deletes them.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from dataclasses import dataclass
from typing import Iterator, Mapping

import crc32c

from bookie.durable_files import fsync_directory, write_parts_at
from bookie.storage_interfaces import CorruptEntryError, EntryLocation, FlatLocation, LogScan, StagedUsage

LOG_MAGIC = b"QLOG"
LOG_VERSION = 1
LOG_HEADER = struct.Struct(">4sIQ")  # magic, version, log id
RECORD_HEAD = struct.Struct(">IIQQ")  # body length, crc32c of the entry bytes, ledger id, entry id
RECORD_OVERHEAD = RECORD_HEAD.size
SUFFIX = ".log"


@dataclass(slots=True)
class _Segment:
    """Staged records for one log, from `start` on."""

    log_id: int
    start: int
    parts: list[bytes]
    new_log: bool


def entry_log_name(log_id: int) -> str:
    return f"{log_id:016x}{SUFFIX}"


class FileEntryLog:
    """A checkpoint first stages its records (framing only, no I/O: the event
    loop does it in slices, so that it does not fight the loop for the GIL
    from another thread), then writes them (`write_staged`, on a worker
    thread). Reads may come from any thread and only ever name records that
    a write made durable."""

    def __init__(
        self,
        directory: Path,
        *,
        log_bytes_max: int = 1024 * 1024 * 1024,
        read_fds_max: int = 256,
    ):
        if log_bytes_max < 1024 * 1024:
            raise ValueError("entry log_bytes_max must be at least 1 MiB")
        self.directory = Path(directory)
        self.log_bytes_max = log_bytes_max
        # Open read descriptors by log id, least recently used first; one
        # evicted while a reader uses it is closed when the reader is done.
        self.read_fds_max = read_fds_max
        self._read_fds: OrderedDict[int, int] = OrderedDict()
        self._fd_users: dict[int, int] = {}
        self._evicted_fds: set[int] = set()
        self._read_fds_lock = threading.Lock()
        # Where the next staged record goes. A log is never appended to after
        # a restart or a failed write: staging then starts a fresh log.
        self._log_id = max(self.log_ids(), default=0)
        self._offset = 0
        self._fresh_log_needed = True
        self._fd: int | None = None  # the current log, once created
        self._fd_log_id: int | None = None
        self._segments: list[_Segment] = []
        self._staged_usage: StagedUsage = {}

    def log_ids(self) -> list[int]:
        ids = []
        for path in self.directory.iterdir():
            if path.name.endswith(SUFFIX):
                try:
                    ids.append(int(path.name[: -len(SUFFIX)], 16))
                except ValueError:
                    continue
        return sorted(ids)

    # --- staging (no I/O) ---------------------------------------------------------

    def _segment_for(self, size: int) -> "_Segment":
        if self._fresh_log_needed or (self._offset + size > self.log_bytes_max and self._offset > LOG_HEADER.size):
            self._fresh_log_needed = False
            self._log_id += 1
            self._offset = LOG_HEADER.size
            self._segments.append(_Segment(self._log_id, self._offset, [], new_log=True))
        elif not self._segments:
            self._segments.append(_Segment(self._log_id, self._offset, [], new_log=False))
        return self._segments[-1]

    def append(self, ledger_id: int, entry_id: int, data: bytes) -> EntryLocation:
        """Stage one record; durable after `write_staged`."""
        size = RECORD_OVERHEAD + len(data)
        segment = self._segment_for(size)
        segment.parts += (RECORD_HEAD.pack(size - 8, crc32c.crc32c(data), ledger_id, entry_id), data)
        location = EntryLocation(self._log_id, self._offset, size)
        self._offset += size
        self._count_staged(ledger_id, location.offset)
        return location

    def _count_staged(self, ledger_id: int, counted_from: int) -> None:
        """Note the bytes of `ledger_id` staged into the current log from
        offset `counted_from` up to now."""
        if self._offset > counted_from:
            usage = self._staged_usage.setdefault(self._log_id, {})
            usage[ledger_id] = usage.get(ledger_id, 0) + self._offset - counted_from

    def take_staged_usage(self) -> StagedUsage:
        """Bytes staged into each log per ledger since the last call. A
        ledger's records are adjacent in a checkpoint, so this costs a few
        operations per ledger and log, not per entry."""
        usage, self._staged_usage = self._staged_usage, {}
        return usage

    def stage_buffer(self, buffer: Mapping[int, Mapping[int, bytes]], entries_per_step: int) -> Iterator[list[FlatLocation]]:
        """Stage a checkpoint's {ledger: {entry: data}} sorted by (ledger,
        entry), yielding the flat locations of each slice of
        `entries_per_step` entries. One tight loop without per-entry
        objects: it runs for every entry the bookie stores."""
        locations: list[FlatLocation] = []
        add_location = locations.append
        pack, checksum = RECORD_HEAD.pack, crc32c.crc32c
        segment = None
        for ledger_id in sorted(buffer):
            entries = buffer[ledger_id]
            counted_from = self._offset  # where this ledger's bytes in the current log start
            for entry_id in sorted(entries):
                data = entries[entry_id]
                size = RECORD_OVERHEAD + len(data)
                if segment is None or self._offset + size > self.log_bytes_max:
                    self._count_staged(ledger_id, counted_from)  # before a roll changes the log
                    segment = self._segment_for(size)
                    parts = segment.parts
                    counted_from = self._offset
                parts += (pack(size - 8, checksum(data), ledger_id, entry_id), data)
                offset = self._offset
                self._offset = offset + size
                add_location((ledger_id, entry_id, self._log_id, offset, size))
                if len(locations) >= entries_per_step:
                    yield locations
                    locations = []
                    add_location = locations.append
            self._count_staged(ledger_id, counted_from)
        if locations:
            yield locations

    # --- writing (worker thread) --------------------------------------------------

    def write_staged(self) -> None:
        """Write every staged record and make it durable. After a failure
        the staged records are dropped and staging continues in a fresh log:
        the caller stages and writes them again."""
        created: list[int] = []
        try:
            wrote = False
            for segment in self._segments:
                if segment.new_log:
                    self._create_log(segment.log_id)  # syncs and closes the previous log
                    created.append(segment.log_id)
                write_parts_at(self._fd, segment.parts, segment.start)
                wrote = True
            if wrote:
                os.fdatasync(self._fd)
        except OSError:
            self._fresh_log_needed = True
            self._staged_usage = {}
            # Logs this write created hold nothing that the index knows of:
            # remove them now rather than leave them to garbage collection.
            for log_id in created:
                try:
                    self.delete_log(log_id)
                except OSError:
                    pass
            raise
        finally:
            self._segments = []

    def sync(self) -> None:
        self.write_staged()

    def _create_log(self, log_id: int) -> None:
        path = self.directory / entry_log_name(log_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.pwrite(fd, LOG_HEADER.pack(LOG_MAGIC, LOG_VERSION, log_id), 0)
            fsync_directory(self.directory)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        if self._fd is not None:
            os.fdatasync(self._fd)
            os.close(self._fd)
        self._fd, self._fd_log_id = fd, log_id

    # --- reading ----------------------------------------------------------------

    def _pread(self, log_id: int, size: int, offset: int) -> bytes:
        with self._read_fds_lock:
            fd = self._read_fds.get(log_id)
            if fd is None:
                try:
                    fd = os.open(self.directory / entry_log_name(log_id), os.O_RDONLY)
                except FileNotFoundError:
                    raise CorruptEntryError(f"entry log {entry_log_name(log_id)} is missing") from None
                self._read_fds[log_id] = fd
                while len(self._read_fds) > self.read_fds_max:
                    _, evicted = self._read_fds.popitem(last=False)
                    self._release(evicted, evict=True)
            else:
                self._read_fds.move_to_end(log_id)
            self._fd_users[fd] = self._fd_users.get(fd, 0) + 1
        try:
            return os.pread(fd, size, offset)
        finally:
            with self._read_fds_lock:
                self._fd_users[fd] -= 1
                self._release(fd)

    def _release(self, fd: int, *, evict: bool = False) -> None:
        """Under the lock: close an evicted descriptor once nobody reads it."""
        if evict:
            self._evicted_fds.add(fd)
        if fd in self._evicted_fds and not self._fd_users.get(fd):
            self._evicted_fds.discard(fd)
            self._fd_users.pop(fd, None)
            os.close(fd)

    def read(self, location: EntryLocation, ledger_id: int, entry_id: int) -> bytes:
        raw = self._pread(location.log_id, location.size, location.offset)
        parsed = _parse_record(raw, 0)
        where = f"{entry_log_name(location.log_id)}@{location.offset}"
        if parsed is None or parsed[3] != location.size:
            raise CorruptEntryError(f"ledger {ledger_id} entry {entry_id}: checksum or framing failure at {where}")
        record_ledger, record_entry, data, _ = parsed
        if (record_ledger, record_entry) != (ledger_id, entry_id):
            raise CorruptEntryError(
                f"index says ledger {ledger_id} entry {entry_id} is at {where}, "
                f"but ledger {record_ledger} entry {record_entry} is there"
            )
        return data

    def read_following(
        self, location: EntryLocation, ledger_id: int, bytes_max: int
    ) -> list[tuple[int, EntryLocation, bytes]]:
        start = location.offset + location.size
        raw = self._pread(location.log_id, bytes_max, start)
        found = []
        position = 0
        while True:
            parsed = _parse_record(raw, position)
            if parsed is None or parsed[0] != ledger_id:
                break
            _, entry_id, data, size = parsed
            found.append((entry_id, EntryLocation(location.log_id, start + position, size), data))
            position += size
        return found

    # --- garbage collection (never while a checkpoint stages or writes) ------------

    def writing_log_id(self) -> int | None:
        """The log the next staged record goes to, unless staging starts a
        fresh one (after a restart or a failed write)."""
        return None if self._fresh_log_needed else self._log_id

    def log_bytes(self, log_id: int) -> int:
        try:
            size = (self.directory / entry_log_name(log_id)).stat().st_size
        except FileNotFoundError:
            return 0
        return max(0, size - LOG_HEADER.size)

    def scan(self, log_id: int, offset: int, bytes_max: int) -> LogScan:
        """The intact records from `offset` (0: the first) in about
        `bytes_max` bytes (a larger record is read whole). Stops for good at
        the end of the file or at bytes that are not an intact record."""
        start = max(offset, LOG_HEADER.size)
        file_end = LOG_HEADER.size + self.log_bytes(log_id)
        if start >= file_end:
            return LogScan([], start, end=True, damaged=False)
        raw = self._pread(log_id, min(max(bytes_max, RECORD_OVERHEAD), file_end - start), start)
        records: list[tuple[int, int, EntryLocation, bytes]] = []
        position = 0
        while start + position < file_end:
            if position + RECORD_OVERHEAD <= len(raw):
                record_size = 8 + RECORD_HEAD.unpack_from(raw, position)[0]
            elif position + RECORD_OVERHEAD <= file_end - start:
                break  # the next header lies past this stretch: the next call reads it
            else:
                return LogScan(records, start + position, end=True, damaged=True)  # a torn header at the end
            if record_size < RECORD_OVERHEAD or start + position + record_size > file_end:
                return LogScan(records, start + position, end=True, damaged=True)
            if position + record_size > len(raw):
                if records:
                    break
                raw = self._pread(log_id, record_size, start)  # one record larger than bytes_max
            parsed = _parse_record(raw, position)
            if parsed is None:
                return LogScan(records, start + position, end=True, damaged=True)
            ledger_id, entry_id, data, size = parsed
            records.append((ledger_id, entry_id, EntryLocation(log_id, start + position, size), data))
            position += size
        next_offset = start + position
        return LogScan(records, next_offset, end=next_offset >= file_end, damaged=False)

    def delete_log(self, log_id: int) -> int:
        """Unlink the log and make that durable; a reader holding it open
        finishes its read, a later one finds it missing (and looks up the
        index again). Returns the bytes the file held."""
        assert log_id != self.writing_log_id(), f"entry log {log_id} is being written"
        path = self.directory / entry_log_name(log_id)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        path.unlink(missing_ok=True)
        fsync_directory(self.directory)
        if log_id == self._fd_log_id:
            # Its write descriptor would keep the space allocated.
            os.close(self._fd)
            self._fd = self._fd_log_id = None
        with self._read_fds_lock:
            fd = self._read_fds.pop(log_id, None)
            if fd is not None:
                self._release(fd, evict=True)
        return size

    def close(self) -> None:
        if self._segments:
            self.write_staged()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = self._fd_log_id = None
        with self._read_fds_lock:
            for fd in list(self._read_fds.values()) + list(self._evicted_fds):
                os.close(fd)
            self._read_fds.clear()
            self._evicted_fds.clear()
            self._fd_users.clear()


def _parse_record(raw: bytes, position: int) -> tuple[int, int, bytes, int] | None:
    """(ledger id, entry id, data, record size) of an intact record at
    `position`, or None if the bytes there are not one."""
    if position + RECORD_OVERHEAD > len(raw):
        return None
    length, checksum, ledger_id, entry_id = RECORD_HEAD.unpack_from(raw, position)
    end = position + 8 + length
    if length < RECORD_OVERHEAD - 8 or end > len(raw):
        return None
    data = bytes(memoryview(raw)[position + RECORD_OVERHEAD : end])
    if crc32c.crc32c(data) != checksum:
        return None
    return ledger_id, entry_id, data, 8 + length
