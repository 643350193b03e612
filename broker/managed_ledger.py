"""A partition's storage: a chain of ledgers (Pulsar's managed ledger), owned
by one broker at a time.

Opening recovers (fences) the last ledger of the chain first, so that a
previous owner can never append again, then starts a new ledger and records
it by compare-and-set. Appends go to the open ledger, in the order of their
partition offsets; the open ledger rolls over by entries, bytes, age or
idleness. Any failure to write (a ledger fenced by another owner, a lost
compare-and-set, bookies gone) fences the managed ledger: it stops taking
appends and the broker unloads the partition, which is then opened afresh
(by this broker or another) on the next lookup. Nothing is ever guessed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import AsyncIterator, Callable

import trio

from broker.entry_cache import ENTRY_CACHE_BYTES_DEFAULT, EntryCache, Position, StoredEntry
from broker.errors import BadRequestError, BrokerError, TopicFencedError
from broker.ledger_list import OpenLedgerIndex, OpenLedgerState, ledger_index_of, rollover_reason, stored_bytes, trimmable_count
from broker.message_format import decode_entry
from broker.topic_store import LedgerInfo, ManagedLedgerRecord, TopicPolicies, TopicStore
from coordination.store import BadVersionError, MetadataError
from ledger_client import BKError, BookKeeper, LedgerHandle, NoSuchLedgerError, PendingAdd, ReadHandle
from ledger_client.ledger_handle import ENTRY_BYTES_MAX

log = logging.getLogger(__name__)

READ_HANDLES_MAX = 16  # closed ledgers kept open for reading
READ_BYTES_MAX = 16 * 1024 * 1024  # one read of a backlog stops past this


class EntryGoneError(Exception):
    """The entry is no longer stored (retention deleted its ledger)."""


def wall_ms() -> int:
    return int(time.time() * 1000)


class ManagedLedger:
    def __init__(
        self,
        bookkeeper: BookKeeper,
        topic_store: TopicStore,
        partition: str,
        policies: TopicPolicies,
        *,
        password: bytes,
        cache: "EntryCache | None" = None,
        on_fenced: Callable[[BrokerError], None] = lambda error: None,
    ) -> None:
        self.bookkeeper = bookkeeper
        self.topic_store = topic_store
        self.partition = partition
        self.policies = policies
        self.password = password
        self.on_fenced = on_fenced
        self.cache = cache if cache is not None else EntryCache(ENTRY_CACHE_BYTES_DEFAULT)  # the broker's, shared
        self.record = ManagedLedgerRecord()
        self.version = -1
        self.handle: LedgerHandle | None = None
        self.next_offset = 0  # offset of the next message appended
        self.confirmed_offset = -1  # last offset of the last entry persisted
        self.fenced: BrokerError | None = None
        self.closed = False
        self._open = OpenLedgerState(0, 0, 0, 0.0, None)
        self._open_index = OpenLedgerIndex()  # where the open ledger's persisted messages are
        self._append_lock = trio.StrictFIFOLock()
        self._appended = trio.Event()  # set (and renewed) whenever an entry is persisted
        self._read_handles: collections.OrderedDict[int, ReadHandle] = collections.OrderedDict()
        self._last_publish_ms = 0
        # Set once the open ledger is full (entries or bytes): the owner rolls it over.
        self.rollover_due = trio.Event()

    # --- opening -----------------------------------------------------------------------

    async def open(self) -> None:
        """Recover the chain and start a new ledger at its end."""
        existing = await self.topic_store.read_managed_ledger(self.partition)
        record, version = existing if existing is not None else await self.topic_store.create_managed_ledger(self.partition)
        ledgers = list(record.ledgers)
        if ledgers and not ledgers[-1].is_closed:
            ledgers[-1] = await self._recover(ledgers[-1])
        next_offset = ledgers[-1].last_offset + 1 if ledgers else 0
        self.record, self.version = ManagedLedgerRecord(tuple(ledgers)), version
        self.next_offset = next_offset
        self.confirmed_offset = next_offset - 1
        await self._start_ledger(list(ledgers))
        log.info("partition %s open: %d ledgers, next offset %d, writing ledger %d",
                 self.partition, len(self.record.ledgers), self.next_offset, self.handle.ledger_id)

    async def _recover(self, info: LedgerInfo) -> LedgerInfo:
        """Fence and close the previous owner's open ledger; learn what it holds."""
        handle = await self.bookkeeper.open_ledger(info.ledger_id, self.password, recovery=True)
        last_entry_id = handle.last_add_confirmed
        messages = 0
        if last_entry_id >= 0:
            last = await handle.read_entry(last_entry_id)
            header, _ = decode_entry(last.data)
            messages = header.last_offset + 1 - info.first_offset
            # Append times keep growing across owners (seeking by time bisects).
            self._last_publish_ms = max(self._last_publish_ms, header.publish_time_ms)
        log.info("partition %s: recovered ledger %d of the previous owner: %d entries", self.partition, info.ledger_id, last_entry_id + 1)
        return info.closed(last_entry_id + 1, messages, handle.length, wall_ms())

    async def _start_ledger(self, ledgers: list[LedgerInfo]) -> None:
        """Create a ledger and record it after `ledgers` (compare-and-set)."""
        policies = self.policies
        handle = await self.bookkeeper.create_ledger(
            policies.ensemble_size, policies.write_quorum, policies.ack_quorum, password=self.password,
            custom_metadata={"partition": self.partition.encode()},
        )
        info = LedgerInfo(handle.ledger_id, self.next_offset, wall_ms())
        record = ManagedLedgerRecord(tuple(ledgers) + (info,))
        try:
            self.version = await self.topic_store.write_managed_ledger(self.partition, record, self.version)
        except BadVersionError:
            # Certainly not recorded (another broker changed the record): the
            # ledger is nobody's, drop it (best effort). After any other
            # failure the write may have landed, and the ledger is kept.
            with trio.CancelScope(shield=True):
                with trio.move_on_after(5):
                    try:
                        await self.bookkeeper.delete_ledger(handle.ledger_id)
                    except (BKError, MetadataError):
                        pass
            raise
        self.record = record
        self.handle = handle
        self._open = OpenLedgerState(0, 0, 0, time.monotonic() * 1000, None)
        self._open_index = OpenLedgerIndex()
        self.rollover_due = trio.Event()

    # --- appending -----------------------------------------------------------------------

    @property
    def current_ledger_id(self) -> int | None:
        return None if self.handle is None else self.handle.ledger_id

    async def append(
        self,
        make_entry: Callable[[int, int], bytes],
        message_count: int,
        on_done: Callable[[Position | None, int, BrokerError | None], None],
        on_pushed: Callable[[], None] = lambda: None,
    ) -> int:
        """Append one entry of `message_count` messages; returns its first
        offset. `make_entry(first_offset, publish_time_ms)` builds its bytes;
        `on_pushed()` runs right before they go to the ledger;
        `on_done(position, first_offset, error)` runs once the entry is
        persisted (in append order) or failed. Waits while the ledger rolls
        over or the open ledger has too many adds pending. An entry larger
        than a ledger takes is refused (BadRequestError) and changes nothing."""
        async with _locked(self._append_lock):
            self._check_writable()
            handle = self.handle
            assert handle is not None
            # Room under the ledger's pending bound first, so that nothing
            # below (offsets, the ledger's state) waits once it has changed.
            await handle.wait_for_room()
            self._check_writable()
            first_offset = self.next_offset
            # The broker's append time: never goes back, so that seeking by
            # publish time can bisect.
            publish_ms = max(self._last_publish_ms, wall_ms())
            data = make_entry(first_offset, publish_ms)
            if len(data) > ENTRY_BYTES_MAX:
                raise BadRequestError(f"a batch of {len(data)} bytes is more than an entry holds ({ENTRY_BYTES_MAX})")
            self._last_publish_ms = publish_ms

            def done(pending: PendingAdd) -> None:
                error = pending.error
                if error is not None:
                    fenced = self._fence(TopicFencedError(f"partition {self.partition}: ledger {handle.ledger_id} failed: {error}"))
                    on_done(None, first_offset, fenced)
                    return
                self._persisted(handle, pending.entry_id, first_offset, message_count, data)
                on_done(Position(handle.ledger_id, pending.entry_id), first_offset, None)

            self.next_offset += message_count
            on_pushed()
            try:
                handle.submit_add_nowait(data, on_done=done)
            except BKError as error:
                raise self._fence(TopicFencedError(f"partition {self.partition}: ledger {handle.ledger_id} failed: {error}")) from None
            return first_offset

    def _persisted(self, handle: LedgerHandle, entry_id: int, first_offset: int, message_count: int, data: bytes) -> None:
        state = self._open
        self._open = OpenLedgerState(
            state.entries + 1, state.messages + message_count, state.bytes + len(data), state.created_ms, time.monotonic() * 1000
        )
        self._open_index.append(first_offset)
        self.confirmed_offset = first_offset + message_count - 1
        header, _ = decode_entry(data)
        self.cache.put(StoredEntry(Position(handle.ledger_id, entry_id), header, data))
        self._appended.set()
        self._appended = trio.Event()
        if rollover_reason(self._open, self.policies, time.monotonic() * 1000) is not None:
            self.rollover_due.set()

    def _check_writable(self) -> None:
        if self.fenced is not None:
            raise self.fenced
        if self.closed or self.handle is None:
            raise TopicFencedError(f"partition {self.partition} is closed")

    def _fence(self, error: BrokerError) -> BrokerError:
        if self.fenced is None:
            self.fenced = error
            log.warning("%s", error)
            self._appended.set()
            self.on_fenced(error)
        return self.fenced

    async def wait_for_append(self) -> None:
        """Until the next entry is persisted (or the ledger is fenced)."""
        await self._appended.wait()

    # --- rolling over, trimming, closing --------------------------------------------------

    def rollover_reason(self) -> str | None:
        if self.fenced is not None or self.closed or self.handle is None:
            return None
        return rollover_reason(self._open, self.policies, time.monotonic() * 1000)

    async def rollover(self) -> None:
        """Close the open ledger (after its pending adds) and start another."""
        async with self._append_lock:
            self._check_writable()
            if rollover_reason(self._open, self.policies, time.monotonic() * 1000) is None:
                return
            try:
                closed = await self._close_current()
                await self._start_ledger(list(self.record.ledgers[:-1]) + [closed])
            except (BKError, MetadataError) as error:
                raise self._fence(TopicFencedError(f"partition {self.partition}: rollover failed: {error}")) from None
            log.info("partition %s rolled over to ledger %d", self.partition, self.handle.ledger_id)

    async def _close_current(self) -> LedgerInfo:
        handle = self.handle
        assert handle is not None
        await handle.close()
        state = self._open
        info = self.record.ledgers[-1]
        assert info.ledger_id == handle.ledger_id
        return info.closed(state.entries, state.messages, state.bytes, wall_ms())

    async def close(self) -> None:
        """Unload gracefully: close the open ledger and record it closed, so
        that the next owner has nothing to recover."""
        async with self._append_lock:
            if self.closed:
                return
            self.closed = True
            self._appended.set()
            if self.fenced is not None or self.handle is None:
                return
            try:
                closed = await self._close_current()
                record = ManagedLedgerRecord(self.record.ledgers[:-1] + (closed,))
                self.version = await self.topic_store.write_managed_ledger(self.partition, record, self.version)
                self.record = record
            except (BKError, MetadataError) as error:
                log.warning("partition %s: closing its ledger failed (the next owner recovers it): %s", self.partition, error)

    async def trim(self, held_from_offset: int | None) -> list[int]:
        """Delete the ledgers at the head of the chain that retention and
        important subscriptions let go; returns their ids."""
        async with self._append_lock:
            self._check_writable()
            ledgers = self.record.ledgers
            count = trimmable_count(ledgers, self.policies, wall_ms(), held_from_offset, self._open.bytes)
            if count == 0:
                return []
            record = ManagedLedgerRecord(ledgers[count:])
            try:
                self.version = await self.topic_store.write_managed_ledger(self.partition, record, self.version)
            except MetadataError as error:
                raise self._fence(TopicFencedError(f"partition {self.partition}: trimming failed: {error}")) from None
            self.record = record
        deleted = []
        for info in ledgers[:count]:
            self._read_handles.pop(info.ledger_id, None)
            self.cache.drop_ledger(info.ledger_id)
            try:
                await self.bookkeeper.delete_ledger(info.ledger_id)
            except NoSuchLedgerError:
                pass
            except (BKError, MetadataError) as error:
                log.warning("partition %s: ledger %d left out of the chain but not deleted: %s", self.partition, info.ledger_id, error)
                continue
            deleted.append(info.ledger_id)
        log.info("partition %s: retention deleted ledgers %s", self.partition, deleted)
        return deleted

    async def delete(self) -> None:
        """Delete the partition's ledgers (it was closed first)."""
        for info in self.record.ledgers:
            try:
                await self.bookkeeper.delete_ledger(info.ledger_id)
            except NoSuchLedgerError:
                pass

    # --- what it holds --------------------------------------------------------------------

    @property
    def first_offset(self) -> int:
        """The lowest offset still stored."""
        return self.record.ledgers[0].first_offset if self.record.ledgers else self.next_offset

    @property
    def stored_bytes(self) -> int:
        return stored_bytes(self.record.ledgers, self._open.bytes)

    @property
    def open_ledger_state(self) -> OpenLedgerState:
        return self._open

    def first_position(self) -> Position | None:
        for info in self.record.ledgers:
            if not info.is_closed or info.entries:
                return Position(info.ledger_id, 0)
        return None

    def end_position(self) -> Position:
        """Where the next entry appended will be."""
        assert self.handle is not None
        return Position(self.handle.ledger_id, self._open.entries)

    def readable_position(self, position: Position) -> Position:
        """Where a reader at `position` should read: past the end
        of a closed ledger is the start of the next one; a ledger no longer
        in the chain (retention deleted it) gives the first entry stored."""
        ledgers = self.record.ledgers
        for index, info in enumerate(ledgers):
            if info.ledger_id != position.ledger_id:
                continue
            if not info.is_closed or position.entry_id < info.entries:
                return position
            for later in ledgers[index + 1:]:
                if not later.is_closed or later.entries:
                    return Position(later.ledger_id, 0)
            return position  # the end of the last, closed ledger (the partition is closing)
        first = self.first_position()
        return first if first is not None else self.end_position()

    def has_entry(self, position: Position) -> bool:
        for info in self.record.ledgers:
            if info.ledger_id == position.ledger_id:
                return 0 <= position.entry_id <= self._last_entry_id(info)
        return False

    def _last_entry_id(self, info: LedgerInfo) -> int:
        if info.is_closed:
            return info.entries - 1
        assert self.handle is not None and info.ledger_id == self.handle.ledger_id
        return self._open.entries - 1

    async def read(self, position: Position, entries_max: int, bytes_max: int = READ_BYTES_MAX) -> list[StoredEntry]:
        """Persisted entries from `position` on, within its ledger: at most
        `entries_max`, and no more once `bytes_max` are read (at least one)."""
        info = self._ledger_info(position.ledger_id)
        if info is None:
            return []
        last_entry_id = min(self._last_entry_id(info), position.entry_id + entries_max - 1)
        entries: list[StoredEntry] = []
        read_bytes = 0
        entry_id = position.entry_id
        while entry_id <= last_entry_id and read_bytes < bytes_max:
            cached = self.cache.get(info.ledger_id, entry_id)
            if cached is None:
                break
            entries.append(cached)
            read_bytes += len(cached.data)
            entry_id += 1
        if entry_id <= last_entry_id and read_bytes < bytes_max:
            # Ask the bookies for about what `bytes_max` holds, not more: the
            # handle reads ranges ahead, and what it fetched past a stop here
            # would be read, checked and dropped.
            entry_bytes = self._mean_entry_bytes(info)
            if entry_bytes:
                last_entry_id = min(last_entry_id, entry_id + max(1, -(-(bytes_max - read_bytes) // entry_bytes)) - 1)
            handle = await self._read_handle(info)
            async for entry in handle.read(entry_id, last_entry_id):
                header, _ = decode_entry(entry.data)
                stored = StoredEntry(Position(info.ledger_id, entry.entry_id), header, entry.data)
                self.cache.put(stored)
                entries.append(stored)
                read_bytes += len(entry.data)
                if read_bytes >= bytes_max:
                    break  # the reads still in flight end on their own
        return entries

    async def read_entry(self, position: Position) -> StoredEntry:
        entries = await self.read(position, 1)
        if not entries:
            raise EntryGoneError(f"partition {self.partition} no longer holds entry {position.ledger_id}:{position.entry_id}")
        return entries[0]

    def _mean_entry_bytes(self, info: LedgerInfo) -> int | None:
        if info.is_closed:
            entries, stored = info.entries, info.bytes
        elif self.handle is not None and info.ledger_id == self.handle.ledger_id:
            entries, stored = self._open.entries, self._open.bytes
        else:
            return None
        return stored // entries if entries and stored else None

    def _ledger_info(self, ledger_id: int) -> LedgerInfo | None:
        for info in self.record.ledgers:
            if info.ledger_id == ledger_id:
                return info
        return None

    async def _read_handle(self, info: LedgerInfo) -> ReadHandle:
        if self.handle is not None and info.ledger_id == self.handle.ledger_id:
            return self.handle
        handle = self._read_handles.get(info.ledger_id)
        if handle is None:
            handle = await self.bookkeeper.open_ledger(info.ledger_id, self.password, recovery=False)
            self._read_handles[info.ledger_id] = handle
            while len(self._read_handles) > READ_HANDLES_MAX:
                self._read_handles.popitem(last=False)
        else:
            self._read_handles.move_to_end(info.ledger_id)
        return handle

    # --- finding offsets and times -------------------------------------------------------

    async def position_of_offset(self, offset: int) -> Position | None:
        """The entry holding message `offset` (the first entry still stored
        if it was trimmed away); None when it is not written yet."""
        if offset > self.confirmed_offset:
            return None
        ledgers = self.record.ledgers
        index = ledger_index_of(ledgers, offset)
        if index is None:
            return self.first_position()
        info = ledgers[index]
        first_entry_id, entry_count = 0, info.entries
        if not info.is_closed:
            # The index narrows it down to `stride` entries, bisected by reading them.
            first_entry_id, last_entry_id = self._open_index.entry_range(offset)
            entry_count = last_entry_id - first_entry_id + 1

        async def first_offset_of(index: int) -> int:
            return (await self.read_entry(Position(info.ledger_id, first_entry_id + index))).header.first_offset

        if entry_count == 1:
            return Position(info.ledger_id, first_entry_id)
        return Position(info.ledger_id, first_entry_id + await _bisect_entries(first_offset_of, entry_count, offset))

    async def offset_at_time(self, publish_time_ms: int) -> int:
        """The first offset whose entry was appended at or after the time
        (the next offset to be written if none was)."""
        for info in self.record.ledgers:
            if info.is_closed and (info.closed_ms or 0) < publish_time_ms:
                continue
            last_entry_id = self._last_entry_id(info)
            if last_entry_id < 0:
                continue

            async def time_of(entry_id: int, ledger_id: int = info.ledger_id) -> int:
                return (await self.read_entry(Position(ledger_id, entry_id))).header.publish_time_ms

            # The last entry whose time is before the target, plus one.
            entry_id = await _bisect_entries(time_of, last_entry_id + 1, publish_time_ms - 1)
            if await time_of(entry_id) < publish_time_ms:
                entry_id += 1
            if entry_id > last_entry_id:
                continue
            return (await self.read_entry(Position(info.ledger_id, entry_id))).header.first_offset
        return self.confirmed_offset + 1


@contextlib.asynccontextmanager
async def _locked(lock: trio.StrictFIFOLock) -> AsyncIterator[None]:
    """`async with lock`, without the scheduling point trio's acquire makes
    when the lock is free (an append each time would pay a pass of the
    scheduler)."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()
    try:
        yield
    finally:
        lock.release()


async def _bisect_entries(key_of: Callable, entry_count: int, target: int) -> int:
    """The last entry id in [0, entry_count) whose key is <= target (0 if
    none is), for keys that never decrease with the entry id."""
    low, high = 0, entry_count - 1
    while low < high:
        middle = (low + high + 1) // 2
        if await key_of(middle) <= target:
            low = middle
        else:
            high = middle - 1
    return low


__all__ = ["ENTRY_CACHE_BYTES_DEFAULT", "EntryCache", "EntryGoneError", "ManagedLedger", "Position", "StoredEntry"]
