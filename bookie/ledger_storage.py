"""Ledger storage in the manner of BookKeeper's DbLedgerStorage.

Durable entries land in a double-buffered write cache; a checkpoint writes the
full buffer sorted into the entry log, commits the index, ledger states and
journal mark in one synced batch, then drops the buffer. Reads go write cache
-> read cache -> index -> entry log, with read-ahead into the read cache. The
logic only talks to the EntryLog and EntryIndex interfaces, so the simulator
runs it over memory. It also keeps each entry log's usage (bytes per ledger)
and carries out garbage collection's storage steps: dropping deleted
ledgers, deleting entry logs, and moving entries out of a log being
compacted (see bookie.garbage_collector for when and under which lock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

from bookie.read_cache import ReadCache
from bookie.storage_interfaces import (
    CorruptEntryError,
    EntryIndex,
    EntryLocation,
    EntryLog,
    EntryLogUsage,
    FlatLocation,
    JournalPosition,
    LedgerStateRecord,
    ReadOutcome,
    StagedUsage,
)
from bookie.write_cache import WriteCache

# How often a read follows an entry that compaction moved while the read was
# under way; one move per read is all compaction can do (it waits for a
# garbage-collection interval between moves of the same entry).
LOCATION_LOOKUPS_MAX = 3
# A read-ahead checks its entries against the index with one range scan
# while their ids span less than this many times their number; past it (ids
# far apart), with a lookup each.
READ_AHEAD_SCAN_SPAN_MAX = 2


@dataclass(slots=True)
class Checkpoint:
    """One checkpoint's work: kept whole and retried as is if it fails."""

    buffer: dict[int, dict[int, bytes]]  # the swapped-out write cache, read-only
    ledger_states: dict[int, LedgerStateRecord]
    mark: JournalPosition
    attempts: int = 0
    locations: list[FlatLocation] = field(default_factory=list)
    index_batch: object = None
    log_usage: StagedUsage = field(default_factory=dict)


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
        # Each entry log's usage (BookKeeper's EntryLogMetadata map), kept in
        # the index with the locations it counts, so that it needs no scan
        # on start. Changed only by checkpoints and garbage collection, which
        # never run at the same time.
        self.log_usage: dict[int, EntryLogUsage] = dict(entry_index.load_log_usage())

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
        data, location = self._read_located(ledger_id, entry_id, location)
        if self.read_ahead_bytes:
            self._read_ahead(ledger_id, location)
        return data

    def _read_located(self, ledger_id: int, entry_id: int, location: EntryLocation) -> tuple[bytes, EntryLocation]:
        """Read the entry at `location`. Compaction may have copied it
        elsewhere, pointed the index there and removed the old log since the
        location was looked up: a read that finds the log missing (or another
        record there) looks the index up again and follows a changed
        location. An unchanged location means the stored copy is damaged."""
        for _ in range(LOCATION_LOOKUPS_MAX):
            try:
                return self.entry_log.read(location, ledger_id, entry_id), location
            except CorruptEntryError:
                moved = self.entry_index.get(ledger_id, entry_id)
                if moved is None or moved == location:
                    raise
                location = moved
        return self.entry_log.read(location, ledger_id, entry_id), location

    def _read_ahead(self, ledger_id: int, location: EntryLocation) -> None:
        try:
            following = self.entry_log.read_following(location, ledger_id, self.read_ahead_bytes)
        except (OSError, CorruptEntryError):
            # Read-ahead is an optimisation and the read itself succeeded;
            # compaction may just have removed the log.
            return
        if not following:
            return
        entry_ids = [entry_id for entry_id, _, _ in following]
        first, last = min(entry_ids), max(entry_ids)
        if last - first < READ_AHEAD_SCAN_SPAN_MAX * len(entry_ids):
            located = self.entry_index.locations_in(ledger_id, first, last).get
        else:
            # Ids far apart (compaction puts survivors of several logs side
            # by side): a lookup each, not a scan of every entry between.
            def located(entry_id: int) -> EntryLocation | None:
                return self.entry_index.get(ledger_id, entry_id)
        # Only the copies the index points at: a recovery add may have
        # written a newer copy of an entry into a later log.
        self.read_cache.put_many(ledger_id, [(entry_id, data) for entry_id, entry_location, data in following
                                             if located(entry_id) == entry_location])

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
        self.entry_log.take_staged_usage()  # whatever a failed attempt staged is gone
        for locations in self.entry_log.stage_buffer(checkpoint.buffer, entries_per_step):
            self.entry_index.stage(checkpoint.index_batch, locations)
            checkpoint.locations += locations
            yield
        checkpoint.log_usage = self.entry_log.take_staged_usage()

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Worker thread: write and sync the staged records, then commit
        the index, the ledger states, the mark and the usage of the logs
        written to in one synced batch."""
        self.entry_log.write_staged()
        usage = self._merged_usage(checkpoint.log_usage)
        self.entry_index.commit_staged(checkpoint.index_batch, checkpoint.ledger_states, checkpoint.mark, usage)
        self.log_usage.update(usage)

    def _merged_usage(self, staged: StagedUsage) -> dict[int, EntryLogUsage]:
        return {log_id: self.log_usage.get(log_id, EntryLogUsage()).merged(ledgers) for log_id, ledgers in staged.items()}

    def run_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Stage and write in one go (startup, the simulator, tests)."""
        for _ in self.stage_checkpoint(checkpoint, 1 << 62):
            pass
        self.write_checkpoint(checkpoint)

    def end_checkpoint(self) -> None:
        """Event loop: the checkpoint is durable; drop the flushed buffer."""
        self.write_cache.end_flush()

    # --- garbage collection: never while a checkpoint runs ----------------------

    def drop_ledgers(self, ledger_ids: Iterable[int]) -> None:
        """`discard_cached` and `drop_from_index` in one go."""
        ledger_ids = set(ledger_ids)
        self.discard_cached(ledger_ids)
        self.drop_from_index(ledger_ids)

    def discard_cached(self, ledger_ids: Iterable[int]) -> None:
        """Event loop: forget the ledgers' entries in the write and read
        caches, the buffer of a checkpoint held for room included (so that
        deleting ledgers lets it fit)."""
        ledger_ids = set(ledger_ids)
        self.write_cache.discard_ledgers(ledger_ids)
        self.read_cache.discard_ledgers(ledger_ids)

    def drop_from_index(self, ledger_ids: Iterable[int]) -> None:
        """Worker thread: forget the ledgers' entries and states in one
        synced batch (their reads then find nothing). Their bytes in entry
        logs stay counted in the logs' usage, under ledgers that are no
        longer live, until the logs are deleted or compacted."""
        ledger_ids = set(ledger_ids)
        self.entry_index.drop_ledgers(ledger_ids)
        # Read-ahead may have cached an entry while the index still had it.
        self.read_cache.discard_ledgers(ledger_ids)

    def entry_logs_without_usage(self) -> list[int]:
        """Logs whose usage was never recorded: a crash between a
        checkpoint's write and its commit leaves one behind (nothing in it is
        indexed; the journal replay wrote its entries again). The log being
        written is left out."""
        writing = self.entry_log.writing_log_id()
        return [log_id for log_id in self.entry_log.log_ids() if log_id not in self.log_usage and log_id != writing]

    def measure_entry_logs(self, log_ids: Iterable[int]) -> dict[int, EntryLogUsage]:
        """Worker thread, beside checkpoints if need be (they never write to
        these logs): the usage of logs without one, from what the index
        points at in them, the rest of the file counting as dead bytes. The
        index, not a scan of the file, so that a damaged record can never
        hide live entries behind it. One pass over the whole index: rare
        (only after a crash in the middle of a checkpoint)."""
        usage = {log_id: EntryLogUsage() for log_id in log_ids}
        for ledger_id, _, log_id, _, size in self.entry_index.iter_locations():
            log_usage = usage.get(log_id)
            if log_usage is not None:
                log_usage.add(ledger_id, size)
        for log_id, log_usage in usage.items():
            log_usage.total_bytes = max(log_usage.total_bytes, self.entry_log.log_bytes(log_id))
        return usage

    def record_log_usage(self, usage: Mapping[int, EntryLogUsage]) -> None:
        """Worker thread: durably record measured usage."""
        self.entry_index.commit_moves([], usage)
        self.log_usage.update(usage)

    def move_entries(self, entries: Mapping[int, Mapping[int, bytes]]) -> list[FlatLocation]:
        """Worker thread: write {ledger: {entry: data}} again, into the log
        being written, then point the index at the new copies in one synced
        batch with the usage they add. Until that commit the index points at
        the old copies, which stay readable."""
        staged_locations = [location for chunk in self.entry_log.stage_buffer(entries, 1 << 62) for location in chunk]
        staged = self.entry_log.take_staged_usage()
        self.entry_log.write_staged()
        usage = self._merged_usage(staged)
        self.entry_index.commit_moves(staged_locations, usage)
        self.log_usage.update(usage)
        return staged_locations

    def delete_entry_log(self, log_id: int) -> int:
        """Worker thread: remove a log that holds nothing the index points
        at, then its usage; return the bytes its file held. A crash in
        between leaves usage without a file, which a later round forgets."""
        freed = self.entry_log.delete_log(log_id)
        self.entry_index.delete_log_usage(log_id)
        self.log_usage.pop(log_id, None)
        return freed

    def close(self) -> None:
        self.entry_log.close()
        self.entry_index.close()
