"""Ledger storage in the manner of BookKeeper's DbLedgerStorage.

Durable entries land in a double-buffered write cache; a checkpoint writes the
full buffer sorted into the entry log, commits the index, ledger states and
journal mark in one synced batch, then drops the buffer. Reads go write cache
-> read cache -> index -> entry log, with read-ahead into the read cache. The
logic only talks to the EntryLog and EntryIndex interfaces, so the simulator
runs it over memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from bookie.read_cache import ReadCache
from bookie.storage_interfaces import (
    CorruptEntryError,
    EntryIndex,
    EntryLocation,
    EntryLog,
    FlatLocation,
    JournalPosition,
    LedgerStateRecord,
    ReadOutcome,
)
from bookie.write_cache import WriteCache


@dataclass(slots=True)
class Checkpoint:
    """One checkpoint's work: kept whole and retried as is if it fails."""

    buffer: dict[int, dict[int, bytes]]  # the swapped-out write cache, read-only
    ledger_states: dict[int, LedgerStateRecord]
    mark: JournalPosition
    attempts: int = 0
    locations: list[FlatLocation] = field(default_factory=list)
    index_batch: object = None


class LedgerStorage:
    def __init__(
        self,
        entry_log: EntryLog,
        entry_index: EntryIndex,
        *,
        write_cache_bytes: int = 64 * 1024 * 1024,
        read_cache_bytes: int = 32 * 1024 * 1024,
        read_ahead_bytes: int = 256 * 1024,
    ) -> None:
        self.entry_log = entry_log
        self.entry_index = entry_index
        self.write_cache = WriteCache(write_cache_bytes)
        self.read_cache = ReadCache(read_cache_bytes)
        self.read_ahead_bytes = read_ahead_bytes

    # --- writes (event loop) --------------------------------------------------

    def put(self, ledger_id: int, entry_id: int, data: bytes) -> None:
        self.write_cache.put(ledger_id, entry_id, data)
        # A recovery add may rewrite an entry that read-ahead cached: once
        # the write cache is flushed, the read cache must not serve the old copy.
        if self.read_cache.bytes:
            self.read_cache.discard(ledger_id, entry_id)

    # --- reads ----------------------------------------------------------------

    def read_memory(self, ledger_id: int, first_entry_id: int, entries_max: int, bytes_max: int) -> tuple[list[bytes], bool]:
        """Entries served from the caches alone, and whether reading stopped
        at an entry that is not in memory (so the disk must be asked)."""
        entries: list[bytes] = []
        total = 0
        entry_id = first_entry_id
        while len(entries) < entries_max:
            data = self.write_cache.get(ledger_id, entry_id)
            if data is None:
                data = self.read_cache.get(ledger_id, entry_id)
                if data is None:
                    return entries, True
            if entries and total + len(data) > bytes_max:
                break
            entries.append(data)
            total += len(data)
            entry_id += 1
        return entries, False

    def read(self, ledger_id: int, first_entry_id: int, entries_max: int, bytes_max: int) -> ReadOutcome:
        """Consecutive entries from `first_entry_id`; may do disk I/O, so the
        trio driver calls it from a worker thread."""
        entries: list[bytes] = []
        total = 0
        entry_id = first_entry_id
        while len(entries) < entries_max:
            try:
                data = self._get(ledger_id, entry_id)
            except (CorruptEntryError, OSError):
                return ReadOutcome(entries, True)
            if data is None:
                break
            if entries and total + len(data) > bytes_max:
                break
            entries.append(data)
            total += len(data)
            entry_id += 1
        return ReadOutcome(entries, False)

    def _get(self, ledger_id: int, entry_id: int) -> bytes | None:
        data = self.write_cache.get(ledger_id, entry_id)
        if data is not None:
            return data
        data = self.read_cache.get(ledger_id, entry_id)
        if data is not None:
            return data
        location = self.entry_index.get(ledger_id, entry_id)
        if location is None:
            # A checkpoint may have moved the entry from the write cache to
            # the index between the two lookups above: look once more.
            return self.write_cache.get(ledger_id, entry_id)
        data = self.entry_log.read(location, ledger_id, entry_id)
        if self.read_ahead_bytes:
            self._read_ahead(ledger_id, location)
        return data

    def _read_ahead(self, ledger_id: int, location: EntryLocation) -> None:
        try:
            following = self.entry_log.read_following(location, ledger_id, self.read_ahead_bytes)
        except OSError:
            return  # read-ahead is an optimisation; the read itself succeeded
        for entry_id, entry_location, data in following:
            # Only the copy the index points at: a recovery add may have
            # written a newer copy of the entry into a later log.
            if self.entry_index.get(ledger_id, entry_id) == entry_location:
                self.read_cache.put(ledger_id, entry_id, data)

    def entry_ids(self, ledger_id: int, first_entry_id: int, last_entry_id: int, ids_max: int) -> list[int]:
        # The write cache first: a checkpoint that ends between the two
        # looks moves entries into the index, never out of it.
        cached = self.write_cache.entry_ids(ledger_id, first_entry_id, last_entry_id)
        indexed = self.entry_index.entry_ids(ledger_id, first_entry_id, last_entry_id, ids_max)
        return sorted(set(indexed).union(cached))[:ids_max]

    # --- checkpoints ------------------------------------------------------------

    def begin_checkpoint(self, ledger_states: dict[int, LedgerStateRecord], mark: JournalPosition) -> Checkpoint:
        """Event loop: swap the write cache out. `mark` must be the journal
        position of the last record whose effect is in the cache or in
        `ledger_states`."""
        return Checkpoint(self.write_cache.begin_flush(), ledger_states, mark)

    def stage_checkpoint(self, checkpoint: Checkpoint, entries_per_step: int) -> Iterator[None]:
        """Event loop, in slices of `entries_per_step` entries: frame the
        entries into entry-log records and index changes, without I/O. The
        trio driver yields to other tasks between slices; doing this CPU
        work on a thread instead costs about twice as much, in fights over
        the GIL with the event loop (measured: bench/bookie_add.py)."""
        checkpoint.attempts += 1
        checkpoint.index_batch = self.entry_index.new_batch()
        checkpoint.locations = []
        for locations in self.entry_log.stage_buffer(checkpoint.buffer, entries_per_step):
            self.entry_index.stage(checkpoint.index_batch, locations)
            checkpoint.locations += locations
            yield

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Worker thread: write and sync the staged records, then commit
        the index, the ledger states and the mark in one synced batch."""
        self.entry_log.write_staged()
        self.entry_index.commit_staged(checkpoint.index_batch, checkpoint.ledger_states, checkpoint.mark)

    def run_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Stage and write in one go (startup, the simulator, tests)."""
        for _ in self.stage_checkpoint(checkpoint, 1 << 62):
            pass
        self.write_checkpoint(checkpoint)

    def end_checkpoint(self) -> None:
        """Event loop: the checkpoint is durable; drop the flushed buffer."""
        self.write_cache.end_flush()

    def close(self) -> None:
        self.entry_log.close()
        self.entry_index.close()
