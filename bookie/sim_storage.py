"""In-memory Journal, EntryLog and EntryIndex for the simulator and unit tests.

They keep what was written apart from what was synced: `crash()` throws away
everything not yet synced, as a power cut would. `corrupt()` flips a byte of a
stored entry so that reading it back fails its checksum, as on a bad disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import crc32c

from bookie.storage_interfaces import (
    JOURNAL_START,
    CorruptEntryError,
    EntryLocation,
    EntryLogUsage,
    FlatLocation,
    JournalPosition,
    JournalRecord,
    LedgerStateRecord,
    LogScan,
    StagedUsage,
)

# Simulated positions and locations count records, not bytes.
_RECORD_SIZE_OVERHEAD = 24


class SimJournal:
    def __init__(self) -> None:
        self._files: dict[int, list[JournalRecord]] = {}
        self._synced: dict[int, int] = {}  # file id -> records durable in it
        self._current = -1

    def append(self, records: list[JournalRecord]) -> JournalPosition:
        assert self._current >= 0, "start_new_file() must be called before append()"
        file = self._files[self._current]
        file.extend(records)
        return JournalPosition(self._current, len(file))

    def sync(self) -> None:
        for file_id, records in self._files.items():
            self._synced[file_id] = len(records)

    def crash(self) -> None:
        for file_id, records in self._files.items():
            del records[self._synced.get(file_id, 0) :]
        self._current = -1

    def room_bytes(self) -> int:
        return 1 << 62  # memory: no preallocation, no rolls

    def needs_prepare(self) -> bool:
        return False

    def prepare(self) -> None:
        pass

    def replay(self, start: JournalPosition) -> Iterator[tuple[JournalRecord, JournalPosition]]:
        for file_id in sorted(self._files):
            if file_id < start.file_id:
                continue
            first = start.offset if file_id == start.file_id else 0
            records = self._files[file_id]
            for index in range(first, len(records)):
                yield records[index], JournalPosition(file_id, index + 1)

    def synced_records(self, start: JournalPosition) -> Iterator[JournalRecord]:
        """The durable records at or after `start`: what a replay after a
        crash would find (for the simulator's checkers)."""
        for record, position in self.replay(start):
            if position.offset <= self._synced.get(position.file_id, 0):
                yield record

    def start_new_file(self, after: JournalPosition) -> JournalPosition:
        self._current = max([after.file_id, self._current, *self._files]) + 1
        self._files[self._current] = []
        self._synced[self._current] = 0
        return JournalPosition(self._current, 0)

    def delete_before(self, mark: JournalPosition) -> list[int]:
        deleted = [file_id for file_id in self._files if file_id < mark.file_id and file_id != self._current]
        for file_id in deleted:
            del self._files[file_id]
            del self._synced[file_id]
        return sorted(deleted)

    def file_ids(self) -> list[int]:
        return sorted(self._files)

    def close(self) -> None:
        pass


@dataclass(slots=True)
class _StoredEntry:
    ledger_id: int
    entry_id: int
    data: bytearray
    checksum: int


class SimEntryLog:
    """Locations name a record by its index in the log; sizes count bytes."""

    def __init__(self, *, log_entries_max: int = 1000) -> None:
        self.log_entries_max = log_entries_max
        self._logs: dict[int, list[_StoredEntry]] = {}
        self._synced: dict[int, int] = {}
        self._current = 0
        self._staged_usage: StagedUsage = {}

    def append(self, ledger_id: int, entry_id: int, data: bytes) -> EntryLocation:
        log = self._logs.get(self._current)
        if log is None or len(log) >= self.log_entries_max:
            self._current += 1
            log = self._logs[self._current] = []
            self._synced[self._current] = 0
        log.append(_StoredEntry(ledger_id, entry_id, bytearray(data), crc32c.crc32c(data)))
        size = len(data) + _RECORD_SIZE_OVERHEAD
        usage = self._staged_usage.setdefault(self._current, {})
        usage[ledger_id] = usage.get(ledger_id, 0) + size
        return EntryLocation(self._current, len(log) - 1, size)

    def stage_buffer(self, buffer: Mapping[int, Mapping[int, bytes]], entries_per_step: int) -> Iterator[list[FlatLocation]]:
        locations: list[FlatLocation] = []
        for ledger_id in sorted(buffer):
            for entry_id in sorted(buffer[ledger_id]):
                locations.append((ledger_id, entry_id, *self.append(ledger_id, entry_id, buffer[ledger_id][entry_id])))
                if len(locations) >= entries_per_step:
                    yield locations
                    locations = []
        if locations:
            yield locations

    def write_staged(self) -> None:
        self.sync()

    def sync(self) -> None:
        for log_id, log in self._logs.items():
            self._synced[log_id] = len(log)

    def crash(self) -> None:
        for log_id, log in self._logs.items():
            del log[self._synced[log_id] :]

    def _stored(self, location: EntryLocation) -> _StoredEntry:
        log = self._logs.get(location.log_id)
        if log is None or location.offset >= len(log):
            raise CorruptEntryError(f"entry log {location.log_id} has no record {location.offset}")
        return log[location.offset]

    def read(self, location: EntryLocation, ledger_id: int, entry_id: int) -> bytes:
        stored = self._stored(location)
        if crc32c.crc32c(bytes(stored.data)) != stored.checksum:
            raise CorruptEntryError(f"ledger {ledger_id} entry {entry_id}: checksum failure")
        if (stored.ledger_id, stored.entry_id) != (ledger_id, entry_id):
            raise CorruptEntryError(f"ledger {ledger_id} entry {entry_id}: another entry is at {location}")
        return bytes(stored.data)

    def read_following(
        self, location: EntryLocation, ledger_id: int, bytes_max: int
    ) -> list[tuple[int, EntryLocation, bytes]]:
        log = self._logs.get(location.log_id, [])
        found = []
        total = 0
        for offset in range(location.offset + 1, min(len(log), self._synced.get(location.log_id, 0))):
            stored = log[offset]
            if stored.ledger_id != ledger_id or crc32c.crc32c(bytes(stored.data)) != stored.checksum:
                break
            total += len(stored.data)
            if total > bytes_max:
                break
            found.append((stored.entry_id, EntryLocation(location.log_id, offset, len(stored.data) + _RECORD_SIZE_OVERHEAD), bytes(stored.data)))
        return found

    def intact_copy(self, location: EntryLocation, ledger_id: int, entry_id: int) -> bytes | None:
        """The synced record at `location` if it is intact and is the entry
        named, else None (for the simulator's checkers)."""
        if location.offset >= self._synced.get(location.log_id, 0):
            return None
        try:
            return self.read(location, ledger_id, entry_id)
        except CorruptEntryError:
            return None

    def corrupt_served(self, ledger_id: int, entry_id: int, byte_index: int = 0) -> int:
        """Test-only (the simulator): as `corrupt`, but each copy's checksum
        is recomputed over the bad bytes, so that the entry log serves them
        as intact and only a reader's digest check can tell."""
        copies = self.corrupt(ledger_id, entry_id, byte_index)
        for log in self._logs.values():
            for stored in log:
                if (stored.ledger_id, stored.entry_id) == (ledger_id, entry_id):
                    stored.checksum = crc32c.crc32c(bytes(stored.data))
        return copies

    def corrupt(self, ledger_id: int, entry_id: int, byte_index: int = 0) -> int:
        """Flip one byte of every stored copy of the entry; return how many."""
        copies = 0
        for log in self._logs.values():
            for stored in log:
                if (stored.ledger_id, stored.entry_id) == (ledger_id, entry_id) and stored.data:
                    stored.data[byte_index % len(stored.data)] ^= 0xFF
                    copies += 1
        return copies

    # --- garbage collection ---------------------------------------------------------------

    def take_staged_usage(self) -> StagedUsage:
        usage, self._staged_usage = self._staged_usage, {}
        return usage

    def log_ids(self) -> list[int]:
        return sorted(self._logs)

    def writing_log_id(self) -> int | None:
        return self._current if self._current in self._logs else None

    def log_bytes(self, log_id: int) -> int:
        return sum(len(stored.data) + _RECORD_SIZE_OVERHEAD for stored in self._logs.get(log_id, []))

    def scan(self, log_id: int, offset: int, bytes_max: int) -> LogScan:
        log = self._logs.get(log_id)
        if log is None:
            return LogScan([], offset, end=True, damaged=True)
        records: list[tuple[int, int, EntryLocation, bytes]] = []
        total = 0
        index = offset
        while index < len(log) and (not records or total < bytes_max):
            stored = log[index]
            data = bytes(stored.data)
            if crc32c.crc32c(data) != stored.checksum:
                return LogScan(records, index, end=True, damaged=True)
            size = len(data) + _RECORD_SIZE_OVERHEAD
            records.append((stored.ledger_id, stored.entry_id, EntryLocation(log_id, index, size), data))
            total += size
            index += 1
        return LogScan(records, index, end=index >= len(log), damaged=False)

    def delete_log(self, log_id: int) -> int:
        assert log_id != self.writing_log_id(), f"entry log {log_id} is being written"
        size = self.log_bytes(log_id)
        self._logs.pop(log_id, None)
        self._synced.pop(log_id, None)
        return size

    def close(self) -> None:
        pass


class SimEntryIndex:
    """Commits are atomic and durable at once, as a synced RocksDB batch is."""

    def __init__(self) -> None:
        self._identity: bytes | None = None
        self._locations: dict[tuple[int, int], EntryLocation] = {}
        self._states: dict[int, LedgerStateRecord] = {}
        self._log_usage: dict[int, EntryLogUsage] = {}
        self._mark = JOURNAL_START

    def get(self, ledger_id: int, entry_id: int) -> EntryLocation | None:
        return self._locations.get((ledger_id, entry_id))

    def locations_in(self, ledger_id: int, first_entry_id: int, last_entry_id: int) -> dict[int, EntryLocation]:
        locations = self._locations
        return {entry_id: locations[ledger_id, entry_id] for entry_id in range(first_entry_id, last_entry_id + 1)
                if (ledger_id, entry_id) in locations}

    def memtable_bytes(self) -> int:
        return 0

    def locations(self) -> list[tuple[tuple[int, int], EntryLocation]]:
        """Every indexed (ledger, entry) and its location, in key order."""
        return sorted(self._locations.items())

    def entry_ids(self, ledger_id: int, first_entry_id: int, last_entry_id: int, ids_max: int) -> list[int]:
        ids = sorted(entry for ledger, entry in self._locations if ledger == ledger_id and first_entry_id <= entry <= last_entry_id)
        return ids[:ids_max]

    def new_batch(self) -> list[FlatLocation]:
        return []

    def stage(self, batch: list[FlatLocation], locations: Iterable[FlatLocation]) -> None:
        batch.extend(locations)

    def commit_checkpoint(
        self,
        locations: Iterable[FlatLocation],
        ledger_states: dict[int, LedgerStateRecord],
        mark: JournalPosition,
    ) -> None:
        self.commit_staged(list(locations), ledger_states, mark)

    def commit_staged(
        self,
        batch: list[FlatLocation],
        ledger_states: dict[int, LedgerStateRecord],
        mark: JournalPosition,
        log_usage: Mapping[int, EntryLogUsage] = {},
    ) -> None:
        assert mark >= self._mark, f"checkpoint mark {mark} is behind the stored mark {self._mark}"
        self.commit_moves(batch, log_usage)
        for ledger_id, state in ledger_states.items():
            self._states[ledger_id] = LedgerStateRecord(state.master_key, state.fenced, state.last_add_confirmed)
        self._mark = mark

    def load_mark(self) -> JournalPosition:
        return self._mark

    def identity(self) -> bytes | None:
        return self._identity

    def set_identity(self, identity: bytes) -> None:
        self._identity = identity

    def load_ledger_states(self) -> Iterator[tuple[int, LedgerStateRecord]]:
        for ledger_id, state in sorted(self._states.items()):
            yield ledger_id, LedgerStateRecord(state.master_key, state.fenced, state.last_add_confirmed)

    def load_log_usage(self) -> Iterator[tuple[int, EntryLogUsage]]:
        for log_id, usage in sorted(self._log_usage.items()):
            yield log_id, EntryLogUsage(usage.total_bytes, dict(usage.ledger_bytes))

    def commit_moves(self, locations: Iterable[FlatLocation], log_usage: Mapping[int, EntryLogUsage]) -> None:
        for ledger_id, entry_id, log_id, offset, size in locations:
            self._locations[(ledger_id, entry_id)] = EntryLocation(log_id, offset, size)
        for log_id, usage in log_usage.items():
            self._log_usage[log_id] = EntryLogUsage(usage.total_bytes, dict(usage.ledger_bytes))

    def drop_ledgers(self, ledger_ids: Iterable[int]) -> None:
        dropped = set(ledger_ids)
        self._locations = {key: location for key, location in self._locations.items() if key[0] not in dropped}
        for ledger_id in dropped:
            self._states.pop(ledger_id, None)

    def delete_log_usage(self, log_id: int) -> None:
        self._log_usage.pop(log_id, None)

    def iter_locations(self) -> Iterator[FlatLocation]:
        for (ledger_id, entry_id), location in self.locations():
            yield (ledger_id, entry_id, *location)

    def close(self) -> None:
        pass
