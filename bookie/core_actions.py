"""What the bookie's request core (`request_core.BookieCore`) returns for a
driver to carry out, and the limits it is given. Apart from the core so that
drivers (the trio server, the simulator) name what they carry out without
the core's internals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from bookie.protocol.wire import AddBatchResponse, Response, Status
from bookie.storage_interfaces import JournalRecord, RecordKind


@dataclass(slots=True)
class Respond:
    connection_id: int
    response: Response


@dataclass(slots=True)
class AppendJournal:
    """Append the record; report `journal_synced([token])` once it is durable
    (token 0: nobody waits for this record on its own)."""

    record: JournalRecord | DurableAdd
    token: int


@dataclass(slots=True)
class StoreEntry:
    """Put a durable entry into ledger storage (the write cache)."""

    ledger_id: int
    entry_id: int
    data: bytes


class BatchAnswer:
    """The answer an ADD_BATCH gets once every one of its adds is settled:
    one status per add, OK unless an add was refused or failed."""

    __slots__ = ("connection_id", "request_id", "statuses", "unsettled")

    def __init__(self, connection_id: int, request_id: int, count: int) -> None:
        self.connection_id = connection_id
        self.request_id = request_id
        self.statuses = [Status.OK] * count
        self.unsettled = count

    def settled(self) -> list[Action]:
        """One more add is settled: the Respond once it was the last."""
        self.unsettled -= 1
        if self.unsettled:
            return []
        return [Respond(self.connection_id, AddBatchResponse(self.request_id, self.statuses))]


@dataclass(slots=True)
class DurableAdd:
    """An add on its way: `AppendJournal` carries it as the journal record
    (it has a record's kind, ledger_id, entry_id and data); once durable,
    `journal_synced` returns the same object as the action "store the entry
    and acknowledge it". One object per add instead of five keeps the hot
    path short. An add of an ADD_BATCH (`batch`) is only stored: the
    batch's one answer follows as a Respond once all its adds are settled."""

    connection_id: int
    request_id: int
    ledger_id: int
    entry_id: int
    last_add_confirmed: int
    data: bytes
    batch: BatchAnswer | None = None
    index: int = 0  # in the batch
    kind = RecordKind.ADD


@dataclass(slots=True)
class ReadEntries:
    """Read consecutive entries from `first_entry_id`, stopping at the first
    missing or unreadable one; report `read_completed(token, ReadOutcome)`."""

    token: int
    ledger_id: int
    first_entry_id: int
    entries_max: int
    bytes_max: int


@dataclass(slots=True)
class ListEntries:
    """List stored entry ids; report `list_completed(token, ids, failed)`."""

    token: int
    ledger_id: int
    first_entry_id: int
    last_entry_id: int
    ids_max: int


Action = Union[Respond, AppendJournal, StoreEntry, DurableAdd, ReadEntries, ListEntries]


@dataclass(frozen=True, slots=True)
class CoreLimits:
    adds_in_flight_max: int = 20_000
    reads_in_flight_max: int = 10_000
    long_poll_waiters_max: int = 10_000
    long_poll_timeout_ms_max: int = 120_000
    write_cache_wait_ms_max: int = 10_000
    batch_read_entries_max: int = 10_000
    batch_read_bytes_max: int = 8 * 1024 * 1024
    read_bytes_max: int = 15 * 1024 * 1024
    list_entries_ids_max: int = 1_000_000

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


__all__ = ["Action", "AppendJournal", "BatchAnswer", "CoreLimits", "DurableAdd", "ListEntries", "ReadEntries", "Respond", "StoreEntry"]
