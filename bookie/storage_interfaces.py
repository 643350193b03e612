"""The small storage interfaces a bookie is built on: Journal, EntryLog, EntryIndex.

Each has a real implementation (files, RocksDB) and a simulated one (memory,
where data not yet synced is lost on a simulated crash), so that the request
core and the ledger storage logic run unchanged in production and in `sim/`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
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


class ReadOutcome(NamedTuple):
    entries: list[bytes]  # consecutive entries from the first asked for
    failed: bool  # reading stopped at an entry that is stored but unreadable


class JournalCorruptError(Exception):
    """The journal cannot be replayed faithfully: refuse to start."""


class CorruptEntryError(Exception):
    """A stored entry cannot be read back intact (checksum or framing failure).
    A bookie answers IO_ERROR for it, never NO_ENTRY."""


class Journal(Protocol):
    def append(self, records: list[JournalRecord]) -> JournalPosition:
        """Write records after everything written before (not durable yet);
        return the position just after the last one."""

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

    def close(self) -> None: ...


class EntryIndex(Protocol):
    def get(self, ledger_id: int, entry_id: int) -> EntryLocation | None: ...

    def entry_ids(self, ledger_id: int, first_entry_id: int, last_entry_id: int, ids_max: int) -> list[int]:
        """Indexed entry ids of the ledger within [first, last], ascending."""

    def new_batch(self) -> object:
        """An empty batch of index changes (memory only)."""

    def stage(self, batch: object, locations: Iterable[FlatLocation]) -> None:
        """Add entry locations to a batch (memory only)."""

    def commit_staged(self, batch: object, ledger_states: dict[int, LedgerStateRecord], mark: JournalPosition) -> None:
        """Durably and atomically record a batch's locations, ledger states
        and the journal mark that they cover."""

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

    def close(self) -> None: ...
