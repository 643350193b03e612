"""A partition's storage: a chain of ledgers (Pulsar's managed ledger), owned
by one broker at a time, driven with trio. Its rules (opening with the fenced
recovery of the last ledger, offsets, rollover, trimming, closing, fencing on
any failure) are `broker.managed_ledger_core.ManagedLedgerCore`'s; this
driver carries out its commands over BookKeeper and the metadata store, and
reads entries (through the broker's entry cache).
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
from broker.ledger_list import OpenLedgerState
from broker.managed_ledger_core import (
    ClosedDone,
    CloseLedger,
    Command,
    CreateLedger,
    CreateRecord,
    DeleteLedgers,
    Fenced,
    ManagedLedgerCore,
    ReadRecord,
    RecoverLedger,
    State,
    Writable,
    WriteRecord,
)
from broker.message_format import decode_entry
from broker.topic_records import LedgerInfo, TopicPolicies
from broker.topic_store import TopicStore
from coordination.store import BadVersionError, MetadataError
from ledger_client import BKError, BookKeeper, LedgerHandle, NoSuchLedgerError, PendingAdd, ReadHandle
from ledger_client.ledger_handle import ENTRY_BYTES_MAX

log = logging.getLogger(__name__)

READ_HANDLES_MAX = 16  # closed ledgers kept open for reading
READ_BYTES_MAX = 16 * 1024 * 1024  # one read of a backlog stops past this
ORPHAN_DELETE_S = 5.0  # deleting a ledger that was never recorded is tried this long


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
        self.password = password
        self.on_fenced = on_fenced
        self.cache = cache if cache is not None else EntryCache(ENTRY_CACHE_BYTES_DEFAULT)  # the broker's, shared
        self.core = ManagedLedgerCore(partition, policies)
        self.handle: LedgerHandle | None = None
        self._append_lock = trio.StrictFIFOLock()
        self._appended = trio.Event()  # set (and renewed) whenever an entry is persisted
        self._changed = trio.Event()  # set (and renewed) whenever the core leaves a busy state
        self._read_handles: collections.OrderedDict[int, ReadHandle] = collections.OrderedDict()
        self._trimmed: list[int] = []
        self._opening = False  # a failure while opening is raised by `open`, not reported through on_fenced
        # Set once the open ledger is full (entries or bytes): the owner rolls it over.
        self.rollover_due = trio.Event()

    # What the core holds, named as the rest of the broker reads it.
    record = property(lambda self: self.core.record)
    next_offset = property(lambda self: self.core.next_offset)
    confirmed_offset = property(lambda self: self.core.confirmed_offset)
    fenced = property(lambda self: self.core.fenced)
    first_offset = property(lambda self: self.core.first_offset)
    stored_bytes = property(lambda self: self.core.stored_bytes)

    @property
    def policies(self) -> TopicPolicies:
        return self.core.policies

    @policies.setter
    def policies(self, policies: TopicPolicies) -> None:
        self.core.policies = policies

    @property
    def closed(self) -> bool:
        return self.core.state in (State.CLOSING, State.RECORDING_CLOSE, State.CLOSED)

    @property
    def open_ledger_state(self) -> OpenLedgerState:
        return self.core.open_state

    @property
    def current_ledger_id(self) -> int | None:
        return None if self.handle is None else self.handle.ledger_id

    # --- carrying out the core's commands ------------------------------------------------------

    async def _run(self, commands: list[Command]) -> None:
        """Carry out commands, and those the answers bring, until none is left."""
        queue = collections.deque(commands)
        while queue:
            command = queue.popleft()
            queue.extend(await self._carry_out(command))

    async def _carry_out(self, command: Command) -> list[Command]:
        core = self.core
        kind = type(command)
        try:
            if kind is ReadRecord:
                return core.record_read(await self.topic_store.read_managed_ledger(self.partition))
            if kind is CreateRecord:
                return core.record_read(await self.topic_store.create_managed_ledger(self.partition))
            if kind is RecoverLedger:
                return await self._recover(command.ledger_id)
            if kind is CreateLedger:
                policies = command.policies
                self.handle = await self.bookkeeper.create_ledger(
                    policies.ensemble_size, policies.write_quorum, policies.ack_quorum, password=self.password,
                    custom_metadata={"partition": self.partition.encode()},
                )
                return core.ledger_created(self.handle.ledger_id, wall_ms())
            if kind is WriteRecord:
                try:
                    version = await self.topic_store.write_managed_ledger(self.partition, command.record, command.expected_version)
                except BadVersionError as error:
                    return core.record_write_failed(True, str(error))
                except MetadataError as error:
                    return core.record_write_failed(False, str(error))
                return core.record_written(version, wall_ms())
            if kind is CloseLedger:
                handle = self.handle
                assert handle is not None and handle.ledger_id == command.ledger_id
                await handle.close()
                return core.ledger_closed(wall_ms())
            if kind is DeleteLedgers:
                await self._delete(command)
                return []
            if kind is Writable:
                if command.new_ledger:
                    # The rollover loop waits on this event: wake it (it finds
                    # nothing due) before it waits on a fresh one.
                    due, self.rollover_due = self.rollover_due, trio.Event()
                    due.set()
                    if not self._opening:
                        log.info("partition %s rolled over to ledger %d", self.partition, command.ledger_id)
                self._wake_appenders()
                return []
            if kind is Fenced:
                self._fenced(command.error)
                return []
            if kind is ClosedDone:
                self._wake_appenders()
                return []
        except (BKError, MetadataError) as error:
            if core.closed_requested:
                log.warning("partition %s: closing its ledger failed (the next owner recovers it): %s", self.partition, error)
            return core.fail(f"{type(command).__name__} failed: {error}")
        raise AssertionError(f"unknown command {command!r}")

    async def _recover(self, ledger_id: int) -> list[Command]:
        """Fence and close the previous owner's open ledger; learn what it holds."""
        handle = await self.bookkeeper.open_ledger(ledger_id, self.password, recovery=True)
        last_entry_id = handle.last_add_confirmed
        last_offset = last_publish_ms = None
        if last_entry_id >= 0:
            header, _ = decode_entry((await handle.read_entry(last_entry_id)).data)
            last_offset, last_publish_ms = header.last_offset, header.publish_time_ms
        log.info("partition %s: recovered ledger %d of the previous owner: %d entries", self.partition, ledger_id, last_entry_id + 1)
        return self.core.ledger_recovered(ledger_id, last_entry_id + 1, handle.length, last_offset, last_publish_ms, wall_ms())

    async def _delete(self, command: DeleteLedgers) -> None:
        for ledger_id in command.ledger_ids:
            self._read_handles.pop(ledger_id, None)
            self.cache.drop_ledger(ledger_id)
            try:
                if command.orphans:
                    with trio.CancelScope(shield=True), trio.move_on_after(ORPHAN_DELETE_S):
                        await self.bookkeeper.delete_ledger(ledger_id)
                else:
                    await self.bookkeeper.delete_ledger(ledger_id)
            except NoSuchLedgerError:
                pass
            except (BKError, MetadataError) as error:
                log.warning("partition %s: ledger %d left out of the chain but not deleted: %s", self.partition, ledger_id, error)
                continue
            if not command.orphans:
                self._trimmed.append(ledger_id)

    def _fenced(self, error: TopicFencedError) -> None:
        log.warning("%s", error)
        self._appended.set()
        self._wake_appenders()
        if not self._opening:
            self.on_fenced(error)

    def _wake_appenders(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    # --- opening -----------------------------------------------------------------------

    async def open(self) -> None:
        """Recover the chain and start a new ledger at its end. Raises the
        error that fenced it when it could not be opened."""
        self._opening = True
        try:
            await self._run(self.core.open())
        finally:
            self._opening = False
        if self.core.fenced is not None:
            raise self.core.fenced
        log.info("partition %s open: %d ledgers, next offset %d, writing ledger %d",
                 self.partition, len(self.core.record.ledgers), self.core.next_offset, self.core.current_ledger_id)

    # --- appending -----------------------------------------------------------------------

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
        core = self.core
        async with _locked(self._append_lock):
            while True:
                slot = core.next_append(wall_ms())
                if slot is None:
                    await self._changed.wait()
                    continue
                handle = self.handle
                assert handle is not None and handle.ledger_id == slot.ledger_id
                # Room under the ledger's pending bound first, so that nothing
                # below (offsets, the ledger's state) waits once it has changed.
                await handle.wait_for_room()
                slot = core.next_append(wall_ms())
                if slot is not None and slot.ledger_id == handle.ledger_id:
                    break
            data = make_entry(slot.first_offset, slot.publish_ms)
            if len(data) > ENTRY_BYTES_MAX:
                raise BadRequestError(f"a batch of {len(data)} bytes is more than an entry holds ({ENTRY_BYTES_MAX})")
            first_offset = slot.first_offset

            def done(pending: PendingAdd) -> None:
                error = pending.error
                if error is not None:
                    self._after_add_failed(handle.ledger_id, error)
                    on_done(None, first_offset, self._failure(handle.ledger_id, error))
                    return
                self._persisted(handle, pending.entry_id, first_offset, message_count, data)
                on_done(Position(handle.ledger_id, pending.entry_id), first_offset, None)

            core.appended(slot, message_count)
            on_pushed()
            try:
                handle.submit_add_nowait(data, on_done=done)
            except BKError as error:
                self._after_add_failed(handle.ledger_id, error)
                raise self._failure(handle.ledger_id, error) from None
            return first_offset

    def _after_add_failed(self, ledger_id: int, error: BKError) -> None:
        """Carry out what the core decides (a completion callback cannot
        wait: the commands it gives here, Fenced or ClosedDone, do not)."""
        for command in self.core.add_failed(ledger_id, str(error)):
            if type(command) is Fenced:
                self._fenced(command.error)
            elif type(command) is ClosedDone:
                self._wake_appenders()
            else:
                raise AssertionError(f"an add failure asked for {command!r}")

    def _failure(self, ledger_id: int, error: BKError) -> BrokerError:
        """The error an append that failed is answered with."""
        return self.core.fenced or TopicFencedError(f"partition {self.partition}: ledger {ledger_id} failed while closing: {error}")

    def _persisted(self, handle: LedgerHandle, entry_id: int, first_offset: int, message_count: int, data: bytes) -> None:
        header, _ = decode_entry(data)
        self.cache.put(StoredEntry(Position(handle.ledger_id, entry_id), header, data))
        if self.core.add_persisted(handle.ledger_id, first_offset, message_count, len(data), wall_ms()):
            self.rollover_due.set()
        self._appended.set()
        self._appended = trio.Event()

    async def wait_for_append(self) -> None:
        """Until the next entry is persisted (or the ledger is fenced)."""
        await self._appended.wait()

    # --- rolling over, trimming, closing --------------------------------------------------

    def rollover_reason(self) -> str | None:
        return self.core.rollover_reason(wall_ms())

    async def rollover(self) -> None:
        """Close the open ledger (after its pending adds) and start another."""
        await self._run(self.core.rollover(wall_ms()))
        self.core.check_writable()

    async def close(self) -> None:
        """Unload gracefully: close the open ledger and record it closed, so
        that the next owner has nothing to recover."""
        await self._run(self.core.close())
        # A change of the chain under way (a rollover) closes it when done.
        while self.core.state not in (State.CLOSED, State.FENCED):
            await self._changed.wait()
        self._appended.set()

    async def trim(self, held_from_offset: int | None) -> list[int]:
        """Delete the ledgers at the head of the chain that retention and
        important subscriptions let go; returns their ids."""
        self.core.check_writable()
        self._trimmed = []
        await self._run(self.core.trim(held_from_offset, wall_ms()))
        self.core.check_writable()
        deleted, self._trimmed = self._trimmed, []
        if deleted:
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

    def first_position(self) -> Position | None:
        return self.core.first_position()

    def end_position(self) -> Position:
        """Where the next entry appended will be."""
        return self.core.end_position()

    def readable_position(self, position: Position) -> Position:
        return self.core.readable_position(position)

    def has_entry(self, position: Position) -> bool:
        return self.core.has_entry(position)

    async def read(self, position: Position, entries_max: int, bytes_max: int = READ_BYTES_MAX) -> list[StoredEntry]:
        """Persisted entries from `position` on, within its ledger: at most
        `entries_max`, and no more once `bytes_max` are read (at least one)."""
        info = self.core.ledger_info(position.ledger_id)
        if info is None:
            return []
        last_entry_id = min(self.core.last_entry_id(info), position.entry_id + entries_max - 1)
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
            entry_bytes = self.core.mean_entry_bytes(info)
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

    def remember(self, entries: dict[tuple[int, int], bytes]) -> None:
        """Put entries known by other means ((ledger, entry) -> bytes: the
        delayed index carried them) in the entry cache, where reads find
        them; those of ledgers the partition no longer has are dropped."""
        for (ledger_id, entry_id), data in entries.items():
            if self.core.ledger_info(ledger_id) is not None:
                header, _ = decode_entry(data)
                self.cache.put(StoredEntry(Position(ledger_id, entry_id), header, data))

    async def read_entry(self, position: Position) -> StoredEntry:
        entries = await self.read(position, 1)
        if not entries:
            raise EntryGoneError(f"partition {self.partition} no longer holds entry {position.ledger_id}:{position.entry_id}")
        return entries[0]

    async def _read_handle(self, info: LedgerInfo) -> ReadHandle:
        if self.handle is not None and info.ledger_id == self.handle.ledger_id and not info.is_closed:
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
        found = self.core.entries_holding(offset)
        if found is None or isinstance(found, Position):
            return found
        ledger_id, first_entry_id, last_entry_id = found

        async def first_offset_of(index: int) -> int:
            return (await self.read_entry(Position(ledger_id, first_entry_id + index))).header.first_offset

        if first_entry_id == last_entry_id:
            return Position(ledger_id, first_entry_id)
        return Position(ledger_id, first_entry_id + await _bisect_entries(first_offset_of, last_entry_id - first_entry_id + 1, offset))

    async def offset_at_time(self, publish_time_ms: int) -> int:
        """The first offset whose entry was appended at or after the time
        (the next offset to be written if none was)."""
        for info in self.record.ledgers:
            if info.is_closed and (info.closed_ms or 0) < publish_time_ms:
                continue
            last_entry_id = self.core.last_entry_id(info)
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
