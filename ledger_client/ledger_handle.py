"""`LedgerHandle`, the write path of a ledger this client created: the trio
driver of a `WriteCore`. It hands adds to the core under the pending-adds
bound, sends what the core decides to the bookies, hears their answers (as
the AddListener of its adds), completes `PendingAdd`s in entry order, and
closes the ledger. Reading is inherited from `ReadHandle`
(`ledger_client.read_handle`); fencing recovery is `ledger_client.recovery`.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Iterable

import trio

from bookie.protocol.wire import AddFlag, Status, encode_add_tail_after, encode_add_tail_prefix
from framing.codec import FRAME_BYTES_MAX_DEFAULT
from ledger_client.bookie_client import AddListener, BookieConnectionError
from ledger_client.client_services import ClientServices
from ledger_client.driver_support import carry_out_metadata_write, now_ms
from ledger_client.errors import BKError
from ledger_client.fifo_semaphore import FifoSemaphore
from ledger_client.metadata import LedgerMetadata
from ledger_client.read_handle import ReadHandle
from ledger_client.write_core import (
    AddsCompleted,
    AddsFailed,
    Closed,
    CloseFailed,
    SendAdd,
    WriteCore,
    WriteMetadata,
)

log = logging.getLogger(__name__)
PENDING_ADDS_MAX_DEFAULT = 10_000
WRITER_WINDOW_DEFAULT = 256
# Room for the entry's header, digest and the frame around it within a
# bookie's default frame bound.
ENTRY_BYTES_MAX = FRAME_BYTES_MAX_DEFAULT - 4096


class PendingAdd:
    """An add handed to the ledger; `await pending.wait()` gives its entry id
    once AQ bookies have it, or raises why it failed."""

    __slots__ = ("entry_id", "done", "_error", "_on_done", "_waiters")

    def __init__(self, entry_id: int, on_done: Callable[["PendingAdd"], None] | None = None) -> None:
        self.entry_id = entry_id
        self.done = False
        self._error: BKError | None = None
        self._on_done = on_done
        # The tasks parked in wait_done: None, one task, or a list of them.
        # (Parked directly, not on a trio.Event: an Event and its parking
        # lot cost a task per add some 8 µs more, a fifth of its share of
        # the client's time at full speed.)
        self._waiters: Any = None

    def _complete(self, error: BKError | None) -> None:
        self._error = error
        self.done = True
        waiters = self._waiters
        if waiters is not None:
            self._waiters = None
            if type(waiters) is list:
                for task in waiters:
                    trio.lowlevel.reschedule(task)
            else:
                trio.lowlevel.reschedule(waiters)
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
        await self.wait_done()
        if self._error is not None:
            raise self._error
        return self.entry_id

    async def wait_done(self) -> None:
        """Wait until the add completed or failed (without raising). Not a
        scheduling point when it is done already (a cancelled caller is
        still cancelled here): a task that awaits each of its adds in turn
        then hands the next ones over without yielding, and they leave for
        the bookies together."""
        if self.done:
            await trio.lowlevel.checkpoint_if_cancelled()
            return
        task = trio.lowlevel.current_task()
        waiters = self._waiters
        if waiters is None:
            self._waiters = task
        elif type(waiters) is list:
            waiters.append(task)
        else:
            self._waiters = [waiters, task]

        def abort(_raise_cancel) -> trio.lowlevel.Abort:
            waiters = self._waiters
            if waiters is task:
                self._waiters = None
            elif type(waiters) is list and task in waiters:
                waiters.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class LedgerWriter:
    """Adds from one task with up to `window` in flight, for a loop that
    has entries to write and nothing to do while they are replicated:

        async with lh.writer(window=256) as writer:
            for data in source:
                await writer.add(data)
        # every add is acknowledged here (or the block raised why not)

    `add` returns at once while fewer than `window` adds are in flight
    (adds handed over back to back leave for the bookies together), else
    waits for the oldest. The first failure is raised by the next `add`,
    `flush` or the end of the block; adds after it fail too, since a
    ledger's adds complete in order. `last_entry_id` is the last entry
    known acknowledged."""

    __slots__ = ("_handle", "_window", "_in_flight", "last_entry_id")

    def __init__(self, handle: "LedgerHandle", window: int) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"a writer's window is at least 1 add, got {window!r}")
        self._handle = handle
        self._window = window
        self._in_flight: collections.deque[PendingAdd] = collections.deque()
        self.last_entry_id = -1

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def add(self, data: bytes) -> PendingAdd:
        """Hand `data` to the ledger; returns its PendingAdd (awaiting it is optional)."""
        in_flight = self._in_flight
        while in_flight and in_flight[0].done:
            self._settled(in_flight.popleft())
        if len(in_flight) >= self._window:
            oldest = in_flight.popleft()
            await oldest.wait_done()
            self._settled(oldest)
        pending = await self._handle.submit_add(data)
        in_flight.append(pending)
        return pending

    async def flush(self) -> int:
        """Wait until every add so far is acknowledged; returns the last entry id (-1: none)."""
        in_flight = self._in_flight
        if not in_flight:
            await trio.lowlevel.checkpoint()
        while in_flight:
            oldest = in_flight[0]
            await oldest.wait_done()
            self._settled(in_flight.popleft())
        return self.last_entry_id

    def _settled(self, pending: PendingAdd) -> None:
        if pending.error is not None:
            self._in_flight.clear()  # the later ones fail with it: the ledger's adds complete in order
            raise pending.error
        self.last_entry_id = pending.entry_id

    async def __aenter__(self) -> "LedgerWriter":
        return self

    async def __aexit__(self, error_type, error, traceback) -> None:
        if error_type is None:
            await self.flush()


class LedgerHandle(ReadHandle, AddListener):
    """A ledger this client writes (from `BookKeeper.create_ledger`)."""

    def __init__(
        self,
        services: ClientServices,
        core: WriteCore,
        master_key: bytes,
        *,
        pending_adds_max: int = PENDING_ADDS_MAX_DEFAULT,
    ) -> None:
        super().__init__(services, core.metadata, core.version, core.digest, master_key)
        self._core = core
        self._pending_add_slots = FifoSemaphore(pending_adds_max)
        self._slot_reserved = False
        self._adds: dict[int, PendingAdd] = {}
        # The client's one timer for add timeouts, which looks at this
        # handle while it has adds pending (from its first add on, until a
        # look finds none).
        self._timeouts = services.add_timeouts
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

    async def add_many(self, entries: Iterable[bytes]) -> list[int]:
        """Add entries in order and wait until AQ bookies have all of them;
        returns their ids. Every entry is checked before any is sent (a bad
        one adds none); past the pending-adds bound it waits for room, so
        the list may be longer than the bound."""
        entries = list(entries)
        for data in entries:
            self._check_entry(data)
        pendings = []
        for data in entries:
            await self.wait_for_room()
            pendings.append(self._submit_checked(data, None))
        if not pendings:
            await trio.lowlevel.checkpoint()
            return []
        # Completions come in entry order: once the last is done, all are.
        await pendings[-1].wait_done()
        for pending in pendings:
            if pending.error is not None:
                raise pending.error
        return [pending.entry_id for pending in pendings]

    def writer(self, window: int = WRITER_WINDOW_DEFAULT) -> "LedgerWriter":
        """`async with lh.writer(window=256) as writer: await writer.add(data)`:
        adds from one task with up to `window` in flight (see LedgerWriter)."""
        return LedgerWriter(self, window)

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
                self._services.connections.send_add_tail(action.bookie_id, tail, self, self._ledger_id, tail_entry_id)
            elif kind is AddsCompleted:
                for entry_id in action.entry_ids:
                    self._finish(entry_id, None)
            elif kind is AddsFailed:
                for entry_id in action.entry_ids:
                    self._finish(entry_id, action.error)
            elif kind is WriteMetadata:
                self._services.spawn(self._write_metadata, action)
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
            core.bookies_changed(self._services.bookies.writable_racks())
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
            self._core.bookies_changed(self._services.bookies.writable_racks())
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
            self._core.bookies_changed(self._services.bookies.writable_racks())
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
        self._execute(await carry_out_metadata_write(self._services.ledger_store, self._core, action))

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


__all__ = ["ENTRY_BYTES_MAX", "LedgerHandle", "LedgerWriter", "PENDING_ADDS_MAX_DEFAULT", "PendingAdd", "WRITER_WINDOW_DEFAULT"]
