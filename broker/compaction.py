"""Topic compaction driven with trio: `Compactor` carries out a
`broker.compaction_core.CompactionCore`'s steps over BookKeeper, the
partition's managed ledger and the metadata store; `CompactedView` reads a
partition's compacted ledger for the subscriptions that read compacted.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import trio

from broker.compaction_core import (
    CloseLedger,
    CompactedEntry,
    CompactionCore,
    CompactionError,
    CompactionRecord,
    Copy,
    CreateLedger,
    DeleteLedgers,
    Finished,
    Phase,
    Scan,
    Switched,
    WriteRecord,
)
from broker.entry_types import MalformedEntryError
from broker.errors import BrokerError
from broker.managed_ledger import EntryGoneError, ManagedLedger, Position, StoredEntry
from broker.message_format import chunk_of, compacted_out, decode_entry, null_values
from broker.topic_records import TopicPolicies
from broker.topic_store import TopicStore
from coordination.store import BadVersionError, MetadataError, NodeExistsError
from ledger_client import BKError, BookKeeper, NoSuchLedgerError, ReadHandle

log = logging.getLogger(__name__)

READ_ENTRIES_MAX = 100  # entries per read, of the partition or a compacted ledger
ENTRY_HINTS_MAX = 1_024  # a view's remembered (offset -> entry id) starting points


class CompactionStatus:
    """What Pulsar's compaction status tells: NOT_RUN, RUNNING, SUCCESS or ERROR."""

    NOT_RUN = "NOT_RUN"
    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    ERROR = "ERROR"


@dataclass
class CompactionState:
    """A partition's compaction as this broker knows it."""

    status: str = CompactionStatus.NOT_RUN
    last_error: str = ""
    running: bool = False
    messages_read: int = 0
    bytes_read: int = 0
    started_s: float = 0.0  # monotonic
    duration_s: float = 0.0
    messages_kept: int = 0  # by the last compaction that succeeded
    last_succeeded_ms: int = 0
    last_failed_ms: int = 0

    def to_dict(self) -> dict:
        return {"status": self.status, "lastError": self.last_error}


class CompactedView:
    """A partition's compacted ledger, read by offset."""

    def __init__(self, bookkeeper: BookKeeper, password: bytes, record: CompactionRecord) -> None:
        assert record.ledger_id is not None
        self.bookkeeper = bookkeeper
        self.password = password
        self.record = record
        self._handle: ReadHandle | None = None
        self._hints: collections.OrderedDict[int, int] = collections.OrderedDict()  # next offset -> entry id

    @property
    def horizon(self) -> int:
        return self.record.horizon

    async def handle(self) -> ReadHandle:
        if self._handle is None:
            self._handle = await self.bookkeeper.open_ledger(self.record.ledger_id, self.password, recovery=False)
        return self._handle

    async def _entry(self, entry_id: int) -> CompactedEntry:
        return CompactedEntry.from_bytes((await (await self.handle()).read_entry(entry_id)).data)

    async def _first_entry_id(self, offset: int) -> int:
        """The first entry whose messages reach `offset` or past it (the
        entry count when none does): a remembered starting point, else a
        binary search (entries rise by offset)."""
        hint = self._hints.get(offset)
        if hint is not None:
            return hint
        low, high = 0, self.record.entries
        while low < high:
            middle = (low + high) // 2
            if (await self._entry(middle)).last_offset < offset:
                low = middle + 1
            else:
                high = middle
        return low

    async def read(self, offset: int, entries_max: int = READ_ENTRIES_MAX) -> list[CompactedEntry]:
        """Compacted entries holding kept messages at `offset` or past it, in order."""
        if self.record.entries == 0:
            return []
        first = await self._first_entry_id(offset)
        last = min(self.record.entries - 1, first + entries_max - 1)
        if first > last:
            return []
        entries = [CompactedEntry.from_bytes(entry.data) async for entry in (await self.handle()).read(first, last)]
        if entries:
            self._hints[entries[-1].last_offset + 1] = first + len(entries)
            while len(self._hints) > ENTRY_HINTS_MAX:
                self._hints.popitem(last=False)
        return entries

    async def entry_at(self, first_offset: int) -> CompactedEntry | None:
        """The compacted entry of the original entry starting at `first_offset`."""
        entries = await self.read(first_offset, 1)
        return entries[0] if entries and entries[0].first_offset == first_offset else None


async def view_entries(bookkeeper: BookKeeper, password: bytes, ledger_id: int) -> AsyncIterator[CompactedEntry]:
    """Every entry of a compacted ledger, in order."""
    handle = await bookkeeper.open_ledger(ledger_id, password, recovery=False)
    last = handle.last_add_confirmed
    for first in range(0, last + 1, READ_ENTRIES_MAX):
        async for entry in handle.read(first, min(last, first + READ_ENTRIES_MAX - 1)):
            yield CompactedEntry.from_bytes(entry.data)


async def partition_entries(managed_ledger: ManagedLedger, from_offset: int, through_offset: int) -> AsyncIterator[StoredEntry]:
    """The partition's entries holding offsets from `from_offset` through
    `through_offset`, in order (retention must not trim them meanwhile)."""
    if from_offset > through_offset:
        return
    position = await managed_ledger.position_of_offset(from_offset)
    while position is not None:
        position = managed_ledger.readable_position(position)
        if not managed_ledger.has_entry(position):
            return
        entries = await managed_ledger.read(position, READ_ENTRIES_MAX)
        if not entries:
            return
        for entry in entries:
            if entry.header.first_offset > through_offset:
                return
            if entry.header.last_offset >= from_offset:
                yield entry
        last = entries[-1].position
        position = Position(last.ledger_id, last.entry_id + 1)


class Compactor:
    """One compaction of one partition, from start to end; `run` returns
    None once the new view is in use, else why not."""

    def __init__(self, *, partition: str, bookkeeper: BookKeeper, topic_store: TopicStore, managed_ledger: ManagedLedger,
                 policies: TopicPolicies, password: bytes, state: CompactionState,
                 on_switched: Callable[[CompactionRecord], None]) -> None:
        self.partition = partition
        self.bookkeeper = bookkeeper
        self.topic_store = topic_store
        self.managed_ledger = managed_ledger
        self.policies = policies
        self.password = password
        self.state = state
        self.on_switched = on_switched
        self._writer = None

    async def run(self) -> str | None:
        found = await self.topic_store.read_compaction(self.partition)
        record, version = found if found is not None else (None, None)
        core = CompactionCore(self.partition, record, version, self.managed_ledger.confirmed_offset, int(time.time() * 1000))
        commands = collections.deque(core.start())
        while commands:
            command = commands.popleft()
            if isinstance(command, Finished):
                return command.error
            try:
                commands.extend(await self._carry_out(core, command))
            except (BadVersionError, BKError, MetadataError, BrokerError, CompactionError, MalformedEntryError,
                    EntryGoneError) as error:
                if core.phase is Phase.DONE:
                    # Cleaning up after a failure failed too: what is left is
                    # named in the record, and the next compaction deletes it.
                    return f"compaction of {self.partition} failed: {type(command).__name__}: {error}"
                if isinstance(error, BadVersionError):
                    commands = collections.deque(core.failed(f"another broker wrote the compaction record: {error}",
                                                             record_refused=True))
                else:
                    commands = collections.deque(core.failed(f"{type(command).__name__}: {error}"))
        raise AssertionError("the compaction core stopped without finishing")

    async def _carry_out(self, core: CompactionCore, command) -> list:
        if isinstance(command, DeleteLedgers):
            for ledger_id in command.ledger_ids:
                try:
                    await self.bookkeeper.delete_ledger(ledger_id)
                except NoSuchLedgerError:
                    pass
            return core.deleted() if core.phase in (Phase.CLEANING, Phase.RETIRING) else []
        if isinstance(command, Scan):
            await self._scan(core, command)
            return core.scanned()
        if isinstance(command, CreateLedger):
            policies = self.policies
            self._writer = await self.bookkeeper.create_ledger(
                policies.ensemble_size, policies.write_quorum, policies.ack_quorum, password=self.password,
                custom_metadata={"partition": self.partition.encode(), "compaction": b"1"},
            )
            return core.created(self._writer.ledger_id)
        if isinstance(command, WriteRecord):
            try:
                version = await self.topic_store.write_compaction(self.partition, command.record, command.expected_version)
            except NodeExistsError as error:
                raise BadVersionError(str(error)) from None
            return core.record_written(version)
        if isinstance(command, Copy):
            await self._copy(core, command)
            return core.copied()
        if isinstance(command, CloseLedger):
            assert self._writer is not None and self._writer.ledger_id == command.ledger_id
            await self._writer.close()
            return core.closed()
        assert isinstance(command, Switched), f"unknown command {command!r}"
        self.on_switched(command.record)
        log.info("partition %s compacted through offset %d: %d messages kept in %d entries of ledger %d", self.partition,
                 command.record.horizon, command.record.messages, command.record.entries, command.record.ledger_id)
        return []

    async def _sources(self, view_ledger_id: int | None, from_offset: int, through_offset: int):
        """(first offset, message count, original ledger id, entry id,
        indexes to look at, entry data, header) of the previous view then
        of the partition."""
        if view_ledger_id is not None:
            async for compacted in view_entries(self.bookkeeper, self.password, view_ledger_id):
                yield compacted.first_offset, compacted.message_count, compacted.ledger_id, compacted.entry_id, \
                    compacted.retained, compacted.data
        async for entry in partition_entries(self.managed_ledger, from_offset, through_offset):
            header = entry.header
            first = max(0, from_offset - header.first_offset)
            last = min(header.message_count - 1, through_offset - header.first_offset)
            yield header.first_offset, header.message_count, entry.position.ledger_id, entry.position.entry_id, \
                tuple(range(first, last + 1)), entry.data

    async def _scan(self, core: CompactionCore, command: Scan) -> None:
        scan = core.scan
        state = self.state
        async for first_offset, _, _, _, indexes, data in self._sources(command.view_ledger_id, command.from_offset,
                                                                         command.through_offset):
            header, body = decode_entry(data)
            state.bytes_read += len(data)
            state.messages_read += len(indexes)
            if header.chunked:
                chunk = chunk_of(header, body)
                assert chunk is not None
                scan.chunk(first_offset, chunk.uuid, chunk.chunk_id, chunk.chunks, header.keys[0] if header.keys else None)
                continue
            if header.keys is None:
                for index in indexes:
                    scan.message(first_offset + index, None, False)
                continue
            nulls = null_values(header, body)
            for index in indexes:
                scan.message(first_offset + index, header.keys[index], nulls[index])
            await trio.lowlevel.checkpoint()

    async def _copy(self, core: CompactionCore, command: Copy) -> None:
        writer = self._writer
        assert writer is not None
        pending: collections.deque = collections.deque()
        async for first_offset, count, ledger_id, entry_id, indexes, data in self._sources(
                command.view_ledger_id, command.from_offset, command.through_offset):
            kept = core.keep(first_offset, count)
            if not kept:
                continue
            # The messages left out lose their payloads (Pulsar's compacted_out).
            compacted = CompactedEntry(ledger_id, entry_id, first_offset, count, kept, compacted_out(data, kept))
            packed = compacted.to_bytes()
            pending.append(await writer.submit_add(packed))
            core.copied_entry(compacted, len(packed))
            while pending and pending[0].done:
                await pending.popleft().wait()
        for add in pending:
            await add.wait()


__all__ = ["CompactedView", "CompactionState", "CompactionStatus", "Compactor", "partition_entries", "view_entries"]
