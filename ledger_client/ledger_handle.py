"""Handles on one ledger, the trio drivers of the pure cores: `ReadHandle`
reads entries (any replica of the write set, next one on error or digest
mismatch; batch reads of ranges; tailing by long-polling the LAC), and
`LedgerHandle` adds to a ledger this client created, around a `WriteCore`.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, AsyncIterator, Callable

import trio

from bookie.protocol.entry_format import DigestManager, DigestMismatchError, Entry, EntryFormatError
from bookie.protocol.wire import (
    FRAME_BYTES_MAX_DEFAULT,
    AddFlag,
    encode_add_tail_after,
    encode_add_tail_prefix,
    BatchReadRequest,
    ReadFlag,
    ReadLacRequest,
    ReadRequest,
    Status,
)
from ledger_client.bookie_client import AddListener, BookieConnectionError
from ledger_client.driver_support import carry_out_metadata_write, now_ms
from ledger_client.errors import (
    BKError,
    EntryReadError,
    LedgerClosedError,
    NoSuchEntryError,
)
from ledger_client.metadata import LedgerMetadata
from ledger_client.fifo_semaphore import FifoSemaphore
from ledger_client.write_core import (
    AddsCompleted,
    AddsFailed,
    Closed,
    CloseFailed,
    SendAdd,
    WriteCore,
    WriteMetadata,
)

if TYPE_CHECKING:
    from ledger_client.bookkeeper import BookKeeper

log = logging.getLogger(__name__)
PENDING_ADDS_MAX_DEFAULT = 10_000
READ_WINDOW_ENTRIES = 256  # single-entry reads in flight while reading a range
BATCH_READ_ENTRIES_MAX = 1000
BATCH_READ_BYTES_MAX = 4 * 1024 * 1024
BATCHES_AHEAD = 4  # batch reads in flight while a range is read
LONG_POLL_TIMEOUT_MS = 10_000
# Room for the entry's header, digest and the frame around it within a
# bookie's default frame bound.
ENTRY_BYTES_MAX = FRAME_BYTES_MAX_DEFAULT - 4096
TAIL_IDLE_DELAY_S_MAX = 1.0  # back-off of a tailing reader that no bookie holds
READ_TIMEOUT_S = 5.0  # a bookie that accepts a read and never answers: try the next replica


class ReadHandle:
    """A ledger opened for reading. For a closed ledger every entry up to its
    last entry can be read; for an open one, entries up to the LAC (learned
    with `read_lac` / `wait_for_lac`)."""

    def __init__(self, bookkeeper: "BookKeeper", metadata: LedgerMetadata, version: int, digest: DigestManager, master_key: bytes) -> None:
        self._bookkeeper = bookkeeper
        self._metadata = metadata
        self._version = version
        self._digest = digest
        self._master_key = master_key
        self._last_add_confirmed = metadata.last_entry_id if metadata.is_closed else -1
        self._ledger_id = metadata.ledger_id  # never changes; read for every add answer

    @property
    def ledger_id(self) -> int:
        return self._ledger_id

    @property
    def metadata(self) -> LedgerMetadata:
        return self._metadata

    @property
    def last_add_confirmed(self) -> int:
        return self._last_add_confirmed

    @property
    def is_closed(self) -> bool:
        return self.metadata.is_closed

    @property
    def length(self) -> int:
        return self.metadata.length

    # --- single entries ------------------------------------------------------------

    def _check_readable(self, entry_id: int) -> None:
        if entry_id < 0 or entry_id > self.last_add_confirmed:
            state = "last entry" if self.is_closed else "last add confirmed"
            raise NoSuchEntryError(f"ledger {self.ledger_id} has no entry {entry_id} (its {state} is {self.last_add_confirmed})")

    async def read_entry(self, entry_id: int) -> Entry:
        self._check_readable(entry_id)
        return await self._read_unchecked(entry_id)

    async def _read_unchecked(self, entry_id: int) -> Entry:
        """Try each bookie of the write set in turn; the first intact copy wins."""
        errors: list[str] = []
        missing = 0
        for bookie_id in self.metadata.write_set(entry_id):
            try:
                with trio.fail_after(READ_TIMEOUT_S):
                    response = await self._bookkeeper.pool.call(
                        bookie_id, lambda request_id: ReadRequest(request_id, ReadFlag.NONE, self.ledger_id, entry_id, None, None, None)
                    )
            except BookieConnectionError as error:
                errors.append(f"{bookie_id}: {error}")
                continue
            except trio.TooSlowError:
                errors.append(f"{bookie_id}: no answer within {READ_TIMEOUT_S:.0f}s")
                continue
            if response.status is Status.OK and response.entry is not None:
                try:
                    return self._digest.decode(response.entry, expected_entry_id=entry_id)
                except (DigestMismatchError, EntryFormatError) as error:
                    errors.append(f"{bookie_id}: {error}")
                    continue
            if response.status in (Status.NO_ENTRY, Status.NO_LEDGER):
                missing += 1
            errors.append(f"{bookie_id}: {response.status.name}")
        if missing == self.metadata.write_quorum:
            raise NoSuchEntryError(f"no bookie of its write set has entry {entry_id} of ledger {self.ledger_id}")
        raise EntryReadError(f"cannot read entry {entry_id} of ledger {self.ledger_id}: " + "; ".join(errors))

    # --- ranges --------------------------------------------------------------------------

    async def read(self, first_entry_id: int, last_entry_id: int) -> AsyncIterator[Entry]:
        """Entries first..last (inclusive), in order."""
        if first_entry_id > last_entry_id:
            return
        self._check_readable(first_entry_id)
        self._check_readable(last_entry_id)
        if self.metadata.write_quorum == self.metadata.ensemble_size:
            # A batch read serves a range from one bookie only where that
            # bookie stores every entry of it: write quorum == ensemble.
            async for entry in self._prefetched_batches(first_entry_id, last_entry_id):
                yield entry
            return
        next_entry_id = first_entry_id
        while next_entry_id <= last_entry_id:
            entries = await self._window_read(next_entry_id, last_entry_id)
            for entry in entries:
                yield entry
            next_entry_id += len(entries)

    async def _prefetched_batches(self, first_entry_id: int, last_entry_id: int) -> AsyncIterator[Entry]:
        """Batch reads of consecutive ranges, BATCHES_AHEAD in flight (spread
        over the replicas by `_batch_read`), consumed in order. A batch that
        came back short is completed before the next range is used.

        The fetches run in the client's nursery, not in one opened here: a
        generator must not yield inside a nursery (a reader that stops early
        would leave it open). Fetches a stopped reader no longer wants end
        on their own and are dropped."""
        in_flight: collections.deque[tuple[int, trio.Event, list]] = collections.deque()
        next_start = first_entry_id
        # Ranges of about what one batch read brings back (a bookie stops at
        # BATCH_READ_BYTES_MAX): with large entries, ranges of BATCH_READ_ENTRIES_MAX
        # would leave one request in flight, its range completed one short
        # answer after another.
        entry_bytes = self._average_entry_bytes()
        range_entries = BATCH_READ_ENTRIES_MAX if entry_bytes is None else max(
            1, min(BATCH_READ_ENTRIES_MAX, BATCH_READ_BYTES_MAX // max(1, entry_bytes))
        )

        def launch() -> None:
            nonlocal next_start
            start, end = next_start, min(last_entry_id, next_start + range_entries - 1)
            next_start = end + 1
            done, result = trio.Event(), []

            async def fetch() -> None:
                try:
                    result.append(await self._batch_read(start, end))
                except BKError as error:
                    result.append(error)
                done.set()

            self._bookkeeper.nursery.start_soon(fetch)
            in_flight.append((end, done, result))

        while next_start <= last_entry_id and len(in_flight) < BATCHES_AHEAD:
            launch()
        expected = first_entry_id
        while in_flight:
            end, done, result = in_flight.popleft()
            if next_start <= last_entry_id:
                launch()
            await done.wait()
            if isinstance(result[0], BKError):
                raise result[0]
            entries = result[0]
            while True:
                for entry in entries:
                    yield entry
                expected += len(entries)
                if expected > end:
                    break
                entries = await self._batch_read(expected, end)

    def _average_entry_bytes(self) -> int | None:
        """The ledger's mean entry size, where its length is known."""
        length, entries = self.metadata.length, self.last_add_confirmed + 1
        if not length or entries <= 0:
            return None
        return length // entries

    async def _batch_read(self, first_entry_id: int, last_entry_id: int) -> list[Entry]:
        first_key, bookies = self.metadata.ensemble_at(first_entry_id)
        # Stay within this ensemble's range.
        keys = self.metadata.ensemble_keys
        position = keys.index(first_key)
        if position + 1 < len(keys):
            last_entry_id = min(last_entry_id, keys[position + 1] - 1)
        wanted = last_entry_id - first_entry_id + 1
        # Spread readers over the replicas; fall back to the next on failure.
        start = first_entry_id % len(bookies)
        for offset in range(len(bookies)):
            bookie_id = bookies[(start + offset) % len(bookies)]
            try:
                with trio.fail_after(READ_TIMEOUT_S):
                    response = await self._bookkeeper.pool.call(
                        bookie_id,
                        lambda request_id: BatchReadRequest(
                            request_id, self.ledger_id, first_entry_id, min(wanted, BATCH_READ_ENTRIES_MAX), BATCH_READ_BYTES_MAX
                        ),
                    )
            except (BookieConnectionError, trio.TooSlowError):
                continue
            if response.status is not Status.OK or not response.entries:
                continue
            # What verified; a bad entry stops it and is read on its own next.
            entries = self._digest.decode_range(response.entries[:wanted], first_entry_id)
            if entries:
                return entries
        return [await self._read_unchecked(first_entry_id)]

    async def _window_read(self, first_entry_id: int, last_entry_id: int) -> list[Entry]:
        """Entries read one by one, READ_WINDOW_ENTRIES at once (where no
        single bookie holds a whole range). The first entry that cannot be
        read is raised as itself, not wrapped in the nursery's group."""
        count = min(last_entry_id - first_entry_id + 1, READ_WINDOW_ENTRIES)
        results: list[Entry | BKError | None] = [None] * count

        async def read_one(index: int) -> None:
            try:
                results[index] = await self._read_unchecked(first_entry_id + index)
            except BKError as error:
                results[index] = error

        async with trio.open_nursery() as nursery:
            for index in range(count):
                nursery.start_soon(read_one, index)
        entries: list[Entry] = []
        for result in results:
            if isinstance(result, BKError):
                if not entries:
                    raise result
                break  # what came before it is returned; it is read again next
            entries.append(result)
        return entries

    # --- the LAC ----------------------------------------------------------------------------

    async def read_lac(self) -> int:
        """Ask the last ensemble for the LAC they know; take the largest of
        the answers once enough bookies (E - AQ + 1) answered that no write
        quorum is left out."""
        if self.is_closed:
            return self.last_add_confirmed
        _, bookies = self.metadata.last_ensemble
        needed = self.metadata.ensemble_size - self.metadata.ack_quorum + 1
        answers: list[int] = []
        enough = trio.Event()
        done = 0

        async def ask(bookie_id: str) -> None:
            nonlocal done
            try:
                with trio.fail_after(READ_TIMEOUT_S):
                    response = await self._bookkeeper.pool.call(bookie_id, lambda request_id: ReadLacRequest(request_id, self.ledger_id))
                if response.status in (Status.OK, Status.NO_ENTRY, Status.NO_LEDGER):
                    answers.append(response.last_add_confirmed if response.status is Status.OK else -1)
            except (BookieConnectionError, trio.TooSlowError):
                pass
            done += 1
            if len(answers) >= needed or done == len(bookies):
                enough.set()

        async with trio.open_nursery() as nursery:
            for bookie_id in bookies:
                nursery.start_soon(ask, bookie_id)
            await enough.wait()
            nursery.cancel_scope.cancel()
        if len(answers) < needed and not answers:
            raise EntryReadError(f"no bookie of ledger {self.ledger_id}'s last ensemble answered a LAC read")
        self._last_add_confirmed = max(self.last_add_confirmed, *answers)
        return self.last_add_confirmed

    async def wait_for_lac(self, previous_lac: int, timeout_ms: int = LONG_POLL_TIMEOUT_MS) -> int:
        """Long-poll: return once some bookie of the last ensemble knows a LAC
        beyond `previous_lac`, or after `timeout_ms` (then the LAC as known)."""
        if self.is_closed or self.last_add_confirmed > previous_lac:
            return self.last_add_confirmed
        _, bookies = self.metadata.last_ensemble
        async with trio.open_nursery() as nursery:
            async def poll(bookie_id: str) -> None:
                try:
                    response = await self._bookkeeper.pool.call(
                        bookie_id,
                        lambda request_id: ReadRequest(
                            request_id, ReadFlag.NONE, self.ledger_id, -1, None, previous_lac, timeout_ms
                        ),
                    )
                except BookieConnectionError:
                    return
                if response.last_add_confirmed > previous_lac:
                    self._last_add_confirmed = max(self.last_add_confirmed, response.last_add_confirmed)
                    nursery.cancel_scope.cancel()

            for bookie_id in bookies:
                nursery.start_soon(poll, bookie_id)
        return self.last_add_confirmed

    async def tail(self, first_entry_id: int = 0) -> AsyncIterator[Entry]:
        """Every entry from `first_entry_id` on, in order, as the writer's
        LAC advances; ends after the last entry once the ledger is closed."""
        next_entry_id = first_entry_id
        idle_delay_s = 0.0
        while True:
            if next_entry_id <= self.last_add_confirmed:
                idle_delay_s = 0.0
                async for entry in self.read(next_entry_id, self.last_add_confirmed):
                    yield entry
                    next_entry_id = entry.entry_id + 1
                continue
            if self.is_closed:
                return
            polled_at = trio.current_time()
            await self.wait_for_lac(next_entry_id - 1)
            if self.last_add_confirmed < next_entry_id:
                await self._refresh_metadata()
                if trio.current_time() - polled_at < 0.05:
                    # Nobody held the long poll (bookies that do not know the
                    # ledger yet answer at once): back off instead of spinning.
                    idle_delay_s = min(max(2 * idle_delay_s, 0.01), TAIL_IDLE_DELAY_S_MAX)
                    await trio.sleep(idle_delay_s)

    async def _refresh_metadata(self) -> None:
        metadata, version = await self._bookkeeper.ledger_store.read(self.ledger_id)
        self._metadata, self._version = metadata, version
        if metadata.is_closed:
            self._last_add_confirmed = metadata.last_entry_id


class PendingAdd:
    """An add handed to the ledger; `await pending.wait()` gives its entry id
    once AQ bookies have it, or raises why it failed."""

    __slots__ = ("entry_id", "done", "_error", "_on_done", "_event")

    def __init__(self, entry_id: int, on_done: Callable[["PendingAdd"], None] | None = None) -> None:
        self.entry_id = entry_id
        self.done = False
        self._error: BKError | None = None
        self._on_done = on_done
        self._event: trio.Event | None = None  # made only if someone waits

    def _complete(self, error: BKError | None) -> None:
        self._error = error
        self.done = True
        if self._event is not None:
            self._event.set()
        if self._on_done is not None:
            # The caller's bug stays its own: raised here, it would stop the
            # adds completing after this one, and keep their room.
            try:
                self._on_done(self)
            except Exception:
                log.exception("the on_done callback of entry %d failed", self.entry_id)

    @property
    def error(self) -> BKError | None:
        return self._error

    async def wait(self) -> int:
        if not self.done:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        else:
            await trio.lowlevel.checkpoint()
        if self._error is not None:
            raise self._error
        return self.entry_id


class LedgerHandle(ReadHandle, AddListener):
    """A ledger this client writes (from `BookKeeper.create_ledger`)."""

    def __init__(
        self,
        bookkeeper: "BookKeeper",
        core: WriteCore,
        master_key: bytes,
        *,
        pending_adds_max: int = PENDING_ADDS_MAX_DEFAULT,
    ) -> None:
        super().__init__(bookkeeper, core.metadata, core.version, core.digest, master_key)
        self._core = core
        self._pending_add_slots = FifoSemaphore(pending_adds_max)
        self._slot_reserved = False
        self._adds: dict[int, PendingAdd] = {}
        # The client's one timer for add timeouts, which looks at this
        # handle while it has adds pending (from its first add on, until a
        # look finds none).
        self._timeouts = bookkeeper.add_timeouts
        self._watched = False
        self._close_done = trio.Event()
        self._close_error: BKError | None = None
        # Flags and master key open every ADD of this writer: encoded once.
        self._tail_prefix = encode_add_tail_prefix(AddFlag.RECOVERY_ADD if core.recovery else AddFlag.NONE, master_key)

    @property
    def metadata(self) -> LedgerMetadata:
        return self._core.metadata

    @property
    def last_add_confirmed(self) -> int:
        return self._core.last_add_confirmed

    @property
    def pending_adds(self) -> int:
        return self._core.pending_count

    def _average_entry_bytes(self) -> int | None:
        entries = self._core.last_add_confirmed + 1
        return self._core.length // entries if entries > 0 and self._core.length else None

    # --- adding ---------------------------------------------------------------------

    async def add(self, data: bytes) -> int:
        """Add an entry and wait until AQ bookies have it; returns its id."""
        pending = await self.submit_add(data)
        return await pending.wait()

    async def submit_add(self, data: bytes, on_done: Callable[[PendingAdd], None] | None = None) -> PendingAdd:
        """Hand an entry to the ledger without waiting for it to be
        acknowledged (only for room under the pending-adds bound): many adds
        in flight from one task. Completions arrive in entry order;
        `on_done(pending)`, if given, runs on completion or failure (it must
        not block; what it raises is logged)."""
        self._check_entry(data)
        await self.wait_for_room()
        return self._submit_checked(data, on_done)

    async def wait_for_room(self) -> None:
        """Take room under the pending-adds bound for the next
        `submit_add_nowait` (kept until that call): a caller that must not
        wait once it has changed its own state waits here first."""
        if not self._slot_reserved:
            await self._pending_add_slots.acquire()  # (not a scheduling point while there is room)
            self._slot_reserved = True

    def submit_add_nowait(self, data: bytes, on_done: Callable[[PendingAdd], None] | None = None) -> PendingAdd:
        """`submit_add` without a scheduling point: uses the room
        `wait_for_room` took, or room free now (else trio.WouldBlock)."""
        self._check_entry(data)
        return self._submit_checked(data, on_done)

    def _submit_checked(self, data: bytes, on_done: Callable[[PendingAdd], None] | None) -> PendingAdd:
        if self._slot_reserved:
            self._slot_reserved = False
        else:
            self._pending_add_slots.acquire_nowait()
        try:
            # (The run's clock asked directly: trio.current_time() is three calls deep.)
            entry_id, actions = self._core.add(bytes(data), self._timeouts.clock_s() * 1000.0)
        except BKError:
            self._pending_add_slots.release()
            raise
        pending = self._adds[entry_id] = PendingAdd(entry_id, on_done)
        self._execute(actions)
        if not self._watched:
            self._watched = True
            self._timeouts.watch(self)
        return pending

    @staticmethod
    def _check_entry(data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"entry data must be bytes, got {type(data).__name__}")
        if len(data) > ENTRY_BYTES_MAX:
            # Checked before the core takes it: a bookie would refuse the
            # frame, and the entry would stay pending and block every later one.
            raise ValueError(f"an entry holds at most {ENTRY_BYTES_MAX} bytes, got {len(data)}")

    # --- carrying out the core's actions ----------------------------------------------

    def _execute(self, actions: list) -> None:
        tail_entry_id, tail = -1, b""
        for action in actions:
            kind = type(action)
            if kind is SendAdd:
                if action.entry_id != tail_entry_id:
                    # An entry's sends come together: encode its bytes once.
                    tail_entry_id, tail = action.entry_id, encode_add_tail_after(self._tail_prefix, action.entry)
                # The handle hears the answers itself, as an AddListener.
                self._bookkeeper.pool.send_add_tail(action.bookie_id, tail, self, self._ledger_id, tail_entry_id)
            elif kind is AddsCompleted:
                for entry_id in action.entry_ids:
                    self._finish(entry_id, None)
            elif kind is AddsFailed:
                for entry_id in action.entry_ids:
                    self._finish(entry_id, action.error)
            elif kind is WriteMetadata:
                self._bookkeeper.nursery.start_soon(self._write_metadata, action)
            elif kind is Closed:
                self._close_done.set()
            elif kind is CloseFailed:
                self._close_error = action.error
                self._close_done.set()
            else:
                raise AssertionError(f"unknown action {action!r}")

    def check_add_timeouts(self, now_ms: float) -> bool:
        """The add-timeout monitor's look (see `ledger_client.add_timeouts`):
        a bookie that left the oldest pending add unanswered past the add
        timeout counts as failed. False once there is nothing to watch."""
        core = self._core
        if core.closed or core.error is not None or not core.pending_count:
            self._watched = False
            return False
        deadline_ms = core.next_deadline_ms()
        if deadline_ms is not None and deadline_ms <= now_ms:
            # A tick may replace bookies: let it pick from the registry as it is now.
            core.bookies_changed(self._bookkeeper.registry.writable_racks())
            self._execute(core.tick(now_ms))
        return True

    def _finish(self, entry_id: int, error: BKError | None) -> None:
        pending = self._adds.pop(entry_id, None)
        if pending is not None:
            self._pending_add_slots.release()
            pending._complete(error)

    # --- answers: the handle is the AddListener of its adds -----------------------------

    def add_answered(self, bookie_id: str, response) -> None:
        """An add's answer other than OK, or the connection's failure."""
        if isinstance(response, BookieConnectionError):
            self._core.bookies_changed(self._bookkeeper.registry.writable_racks())
            self._execute(self._core.bookie_failed(bookie_id, now_ms()))
            return
        # The answer names its entry (as BookKeeper's completion keys do); one
        # naming another ledger is a bookie's bug: treat the bookie as failed.
        entry_id = response.entry_id
        if response.ledger_id != self._ledger_id:
            log.warning("bookie %s answered an add of ledger %d about ledger %d", bookie_id, self.ledger_id, response.ledger_id)
            self._execute(self._core.bookie_failed(bookie_id, now_ms()))
            return
        if response.status is not Status.OK:
            log.info("bookie %s answered %s to entry %d of ledger %d", bookie_id, response.status.name, entry_id, self.ledger_id)
            self._core.bookies_changed(self._bookkeeper.registry.writable_racks())
        self._execute(self._core.bookie_responded(bookie_id, entry_id, response.status, now_ms()))

    def adds_acknowledged(self, bookie_id: str, ledger_id: int, entry_ids: list[int]) -> None:
        """A bookie's OK answers to adds that arrived together, in order: one
        step of the core for all of them. (The handle itself, not an object
        per bookie: with many ledgers open each answer is a run of its own,
        and every object it passes through is one more out of the caches.)"""
        if ledger_id != self._ledger_id:
            log.warning("bookie %s answered an add of ledger %d about ledger %d", bookie_id, self._ledger_id, ledger_id)
            self._execute(self._core.bookie_failed(bookie_id, now_ms()))
            return
        actions = self._core.bookie_acknowledged(bookie_id, entry_ids)
        if actions:  # none: nothing completed, so no deadline moved (two answers in three, with AQ 2 of WQ 3)
            self._execute(actions)

    async def _write_metadata(self, action: WriteMetadata) -> None:
        self._execute(await carry_out_metadata_write(self._bookkeeper.ledger_store, self._core, action))

    # --- closing ------------------------------------------------------------------------

    async def close(self) -> None:
        """Wait for pending adds to settle, then close the ledger at its LAC
        (compare-and-set). Raises if the ledger was fenced meanwhile."""
        self._execute(self._core.close(now_ms()))
        await self._close_done.wait()
        if self._close_error is not None:
            raise self._close_error

    async def read_lac(self) -> int:
        return self._core.last_add_confirmed


__all__ = ["LedgerClosedError", "LedgerHandle", "PendingAdd", "ReadHandle"]
