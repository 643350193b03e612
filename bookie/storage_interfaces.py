"""The small storage interfaces a bookie is built on: Journal, EntryLog, EntryIndex.

Each has a real implementation (files, RocksDB) and a simulated one (memory,
where data not yet synced is lost on a simulated crash), so that the request
core and the ledger storage logic run unchanged in production and in `sim/`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, NamedTuple, Protocol


class RecordKind(enum.IntEnum):
    ADD = 1  # data = the entry bytes
    MASTER_KEY = 2  # data = the ledger's master key
    FENCE = 3  # data = b""


@dataclass(slots=True)
class JournalRecord:
    kind: RecordKind
    ledger_id: int
    entry_id: int  # -1 for records that are not about one entry
    data: bytes


class JournalPosition(NamedTuple):
    """A point in the journal: everything before it has been written there.
    Positions order lexicographically, which is journal order."""

    file_id: int
    offset: int


JOURNAL_START = JournalPosition(0, 0)


class EntryLocation(NamedTuple):
    log_id: int
    offset: int  # where the record starts
    size: int  # whole record, framing included


# (ledger id, entry id, log id, offset, size): what a checkpoint hands from
# the entry log to the index, flat so that no object is built per entry.
FlatLocation = tuple[int, int, int, int, int]


@dataclass(slots=True)
class LedgerStateRecord:
    """What a bookie keeps about each ledger besides its entries."""

    master_key: bytes
    fenced: bool = False
    last_add_confirmed: int = -1


@dataclass(slots=True)
class EntryLogUsage:
    """BookKeeper's EntryLogMetadata: how many bytes of records an entry log
    holds in all (`total_bytes`) and per ledger. A ledger's count includes
    copies that a later rewrite (a recovery add) superseded, as BookKeeper's
    does: they count as live until the ledger is deleted, and compaction,
    which copies only what the index points at, drops them."""

    total_bytes: int = 0
    ledger_bytes: dict[int, int] = field(default_factory=dict)

    def add(self, ledger_id: int, size: int) -> None:
        self.ledger_bytes[ledger_id] = self.ledger_bytes.get(ledger_id, 0) + size
        self.total_bytes += size

    def merged(self, staged: Mapping[int, int]) -> "EntryLogUsage":
        """A copy with the bytes of `staged` ({ledger: bytes}) added."""
        usage = EntryLogUsage(self.total_bytes, dict(self.ledger_bytes))
        for ledger_id, size in staged.items():
            usage.add(ledger_id, size)
        return usage


# {log id: {ledger id: bytes}}: what staging put into each entry log.
StagedUsage = dict[int, dict[int, int]]


@dataclass(slots=True)
class LogScan:
    """A stretch of an entry log read in order (compaction, and accounting
    for a log whose usage was never recorded)."""

    records: list[tuple[int, int, EntryLocation, bytes]]  # (ledger id, entry id, location, data), intact ones
    next_offset: int  # where the next stretch starts
    end: bool  # nothing follows: the log ends here (or with a torn, never-synced tail)
    damaged: bool  # the scan stopped at bytes that are not an intact record, with more after them


class ReadOutcome(NamedTuple):
    entries: list[bytes]  # consecutive entries from the first asked for
    failed: bool  # reading stopped at an entry that is stored but unreadable


class JournalCorruptError(Exception):
    """The journal cannot be replayed faithfully: refuse to start."""


class CorruptEntryError(Exception):
    """A stored entry cannot be read back intact (checksum or framing failure).
    A bookie answers IO_ERROR for it, never NO_ENTRY."""


class IndexWriteError(Exception):
    """The index refused a write (RocksDB's "IO error: No space left on
    device", for one). RocksDB then takes no write until it is reopened:
    the bookie stays read-only until restarted, and reads go on."""


class Journal(Protocol):
    def append(self, records: list[JournalRecord]) -> JournalPosition:
        """Write records after everything written before (not durable yet);
        return the position just after the last one. Raises JournalError
        (bookie.journal) for good once a write fails; JournalNoRoomError, a
        kind of it, when the disk had no room and nothing was written: then
        appends are refused until `start_new_file` succeeds."""

    def sync(self) -> None:
        """Make everything appended so far durable."""

    def room_bytes(self) -> int:
        """How many bytes of records fit without allocating or rolling."""

    def needs_prepare(self) -> bool:
        """Whether `prepare` has work to do."""

    def prepare(self) -> None:
        """Slow housekeeping ahead of need (preallocation), when idle."""

    def replay(self, start: JournalPosition) -> Iterator[tuple[JournalRecord, JournalPosition]]:
        """Every intact record at or after `start`, in order, each with the
        position just after it. A torn tail ends a file; replay goes on with
        the next file."""

    def start_new_file(self, after: JournalPosition) -> JournalPosition:
        """Continue in a fresh file with an id above `after` and above every
        file there is (after replay, never append behind a torn tail);
        return the position of its first record."""

    def file_ids(self) -> list[int]:
        """Ids of the journal files there are, ascending."""

    def delete_before(self, mark: JournalPosition) -> list[int]:
        """Delete files that hold only records before `mark`; return their ids."""

    def close(self) -> None: ...


class EntryLog(Protocol):
    """A checkpoint stages records (framing only, no I/O) and then writes
    what it staged; reads only ever name written records."""

    def append(self, ledger_id: int, entry_id: int, data: bytes) -> EntryLocation:
        """Stage one entry (durable after `write_staged`)."""

    def stage_buffer(self, buffer: Mapping[int, Mapping[int, bytes]], entries_per_step: int) -> Iterator[list[FlatLocation]]:
        """Stage a checkpoint's {ledger: {entry: data}} sorted by (ledger,
        entry), yielding the flat locations of each slice of entries."""

    def write_staged(self) -> None:
        """Write and make durable everything staged. After a failure the
        staged records are dropped, to be staged again."""

    def read(self, location: EntryLocation, ledger_id: int, entry_id: int) -> bytes:
        """The entry at `location`; CorruptEntryError if it is not intact or is
        not the entry named."""

    def read_following(
        self, location: EntryLocation, ledger_id: int, bytes_max: int
    ) -> list[tuple[int, EntryLocation, bytes]]:
        """Read-ahead: the intact records of `ledger_id` stored right after
        `location`, up to about `bytes_max`, as (entry id, location, data)."""

    # --- garbage collection (with no checkpoint running) ---

    def take_staged_usage(self) -> StagedUsage:
        """Bytes staged into each log, per ledger, since the last call."""

    def log_ids(self) -> list[int]:
        """Ids of the entry logs there are, ascending."""

    def writing_log_id(self) -> int | None:
        """The log that staging appends to next, if any: never compacted or deleted."""

    def log_bytes(self, log_id: int) -> int:
        """Bytes of records (intact or not) the log holds."""

    def scan(self, log_id: int, offset: int, bytes_max: int) -> LogScan:
        """The records from `offset` (0: the first) on, about `bytes_max` of them."""

    def delete_log(self, log_id: int) -> int:
        """Remove the log for good (readers that hold it open finish); return its size."""

    def close(self) -> None: ...


class EntryIndex(Protocol):
    def get(self, ledger_id: int, entry_id: int) -> EntryLocation | None: ...

    def locations_in(self, ledger_id: int, first_entry_id: int, last_entry_id: int) -> dict[int, EntryLocation]:
        """The indexed locations of the ledger's entries within [first, last]
        (one range scan: a read-ahead checks a run of entries at once)."""

    def entry_ids(self, ledger_id: int, first_entry_id: int, last_entry_id: int, ids_max: int) -> list[int]:
        """Indexed entry ids of the ledger within [first, last], ascending."""

    def new_batch(self) -> object:
        """An empty batch of index changes (memory only)."""

    def stage(self, batch: object, locations: Iterable[FlatLocation]) -> None:
        """Add entry locations to a batch (memory only)."""

    def commit_staged(
        self,
        batch: object,
        ledger_states: dict[int, LedgerStateRecord],
        mark: JournalPosition,
        log_usage: Mapping[int, EntryLogUsage] = {},
    ) -> None:
        """Durably and atomically record a batch's locations, ledger states,
        the journal mark that they cover, and the new usage of the entry
        logs the batch's entries went to."""

    def commit_checkpoint(
        self,
        locations: Iterable[FlatLocation],
        ledger_states: dict[int, LedgerStateRecord],
        mark: JournalPosition,
    ) -> None:
        """`new_batch` + `stage` + `commit_staged` in one call."""

    def load_mark(self) -> JournalPosition: ...

    def identity(self) -> bytes | None:
        """Which bookie the index belongs to; None for a new index."""

    def set_identity(self, identity: bytes) -> None: ...

    def load_ledger_states(self) -> Iterator[tuple[int, LedgerStateRecord]]: ...

    # --- garbage collection ---

    def load_log_usage(self) -> Iterator[tuple[int, EntryLogUsage]]: ...

    def commit_moves(self, locations: Iterable[FlatLocation], log_usage: Mapping[int, EntryLogUsage]) -> None:
        """Durably and atomically: entries now live at these locations (compaction)."""

    def drop_ledgers(self, ledger_ids: Iterable[int]) -> None:
        """Durably and atomically forget the ledgers' entries and states."""

    def delete_log_usage(self, log_id: int) -> None:
        """Durably forget an entry log's usage (its file is gone)."""

    def iter_locations(self) -> Iterator[FlatLocation]:
        """Every indexed entry, in (ledger, entry) order."""

    def memtable_bytes(self) -> int:
        """Index data held in memory that a later flush of the index writes
        to disk (RocksDB's memtables); room is kept for it on a full disk."""

    def close(self) -> None: ...
