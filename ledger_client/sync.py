"""`BookKeeper` for code that is not async: the same calls, each run on a
trio event loop that the client keeps in a thread of its own.

    from ledger_client.sync import BookKeeper
    with BookKeeper.connect("127.0.0.1:2181", root="/quire") as bk:
        lh = bk.create_ledger(ensemble_size=3, write_quorum=3, ack_quorum=2, password=b"pw")
        entry_id = lh.add(b"payload")
        lh.close()
        for entry in bk.open_ledger(lh.ledger_id, password=b"pw").read(0, entry_id):
            print(entry.entry_id, entry.data)
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Callable, Iterable, Iterator

import trio

from bookie.protocol.entry_format import Entry
from ledger_client import bookkeeper as async_bookkeeper
from ledger_client import ledger_handle as async_handles
from ledger_client import read_handle as async_read_handles
from ledger_client.errors import LedgerStateError
from ledger_client.metadata import LedgerMetadata

READ_CHUNK_ENTRIES = 1000  # entries fetched per trip to the event loop


class LoopThread:
    """A trio loop in a daemon thread, running one async context manager
    until closed (the broker client's sync facade uses it too)."""

    def __init__(self, open_context: Callable[[], Any]) -> None:
        self._open_context = open_context
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self.value: Any = None
        self._nursery: trio.Nursery | None = None
        self._thread = threading.Thread(target=self._run, name="quire-ledger-client", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as error:  # handed to the caller's thread
            if not self._ready.is_set():
                self._error = error
                self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with self._open_context() as value, trio.open_nursery() as nursery:
                self.value = value
                self._nursery = nursery
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        except BaseException as error:
            if not self._ready.is_set():
                self._error = error
                self._ready.set()
                return
            raise

    def call(self, async_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return trio.from_thread.run(functools.partial(async_fn, *args, **kwargs), trio_token=self._token)

    def call_sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return trio.from_thread.run_sync(functools.partial(fn, *args, **kwargs), trio_token=self._token)

    def start_soon(self, async_fn: Callable[..., Any], *args: Any) -> None:
        """Start `async_fn(*args)` on the loop without waiting for it (from
        any thread; a write to the loop's wake-up socket, no round trip)."""
        self._token.run_sync_soon(self._nursery.start_soon, async_fn, *args)

    def close(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join()


class ReadHandle:
    def __init__(self, loop: LoopThread, handle: async_read_handles.ReadHandle) -> None:
        self._loop = loop
        self._handle = handle

    @property
    def ledger_id(self) -> int:
        return self._handle.ledger_id

    @property
    def metadata(self) -> LedgerMetadata:
        return self._handle.metadata

    @property
    def last_add_confirmed(self) -> int:
        return self._handle.last_add_confirmed

    @property
    def is_closed(self) -> bool:
        return self._handle.is_closed

    def read_entry(self, entry_id: int) -> Entry:
        return self._loop.call(self._handle.read_entry, entry_id)

    def read(self, first_entry_id: int, last_entry_id: int) -> Iterator[Entry]:
        """Entries first..last in order, fetched in chunks."""
        async def chunk(first: int, last: int) -> list[Entry]:
            return [entry async for entry in self._handle.read(first, last)]

        next_entry_id = first_entry_id
        while next_entry_id <= last_entry_id:
            last = min(last_entry_id, next_entry_id + READ_CHUNK_ENTRIES - 1)
            yield from self._loop.call(chunk, next_entry_id, last)
            next_entry_id = last + 1

    def read_lac(self) -> int:
        return self._loop.call(self._handle.read_lac)

    def wait_for_lac(self, previous_lac: int, timeout_ms: int = async_read_handles.LONG_POLL_TIMEOUT_MS) -> int:
        return self._loop.call(self._handle.wait_for_lac, previous_lac, timeout_ms)


class LedgerHandle(ReadHandle):
    _handle: async_handles.LedgerHandle

    def add(self, data: bytes) -> int:
        """Add one entry and wait until AQ bookies have it (one trip to the
        loop per add: for many, `add_many` or `writer`)."""
        return self._loop.call(self._handle.add, data)

    def add_many(self, entries: Iterable[bytes]) -> list[int]:
        """Add entries in order (one trip to the loop for all); returns their ids."""
        return self._loop.call(self._handle.add_many, list(entries))

    def writer(self, window: int = async_handles.WRITER_WINDOW_DEFAULT) -> "LedgerWriter":
        """`with lh.writer(window=256) as writer: writer.add(data)`: up to
        `window` adds in flight from this thread (see LedgerWriter)."""
        return LedgerWriter(self._loop, self._handle, window)

    def close(self) -> None:
        self._loop.call(self._handle.close)


class LedgerWriter:
    """Adds from a thread with up to `window` in flight:

        with lh.writer(window=256) as writer:
            for data in source:
                writer.add(data)
        # every add is acknowledged here (or the block raised why not)

    `add` checks the entry, waits only while `window` adds are in flight,
    and hands the entry to the client's loop without a round trip: entries
    added back to back are sent to the bookies together. The first failure
    is raised by the next `add`, `flush` or the end of the block."""

    def __init__(self, loop: LoopThread, handle: async_handles.LedgerHandle, window: int) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"a writer's window is at least 1 add, got {window!r}")
        self._loop = loop
        self._handle = handle
        self._room = threading.Semaphore(window)
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._waiting: collections.deque[bytes] = collections.deque()  # added, not yet handed to the ledger
        self._draining = False
        self._outstanding = 0  # added, not yet acknowledged or failed
        self._error: BaseException | None = None
        self.last_entry_id = -1  # the last entry known acknowledged

    def add(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        async_handles.LedgerHandle._check_entry(data)
        self._room.acquire()
        with self._lock:
            self._waiting.append(bytes(data))
            self._outstanding += 1
            start = not self._draining
            self._draining = True
        if start:
            self._loop.start_soon(self._drain)

    def flush(self) -> int:
        """Wait until every add so far is acknowledged; returns the last entry id (-1: none)."""
        with self._settled:
            self._settled.wait_for(lambda: self._outstanding == 0)
        if self._error is not None:
            raise self._error
        return self.last_entry_id

    async def _drain(self) -> None:
        """On the loop: hand the waiting entries to the ledger, in order."""
        handle = self._handle
        while True:
            with self._lock:
                if not self._waiting:
                    self._draining = False
                    return
                data = self._waiting.popleft()
            try:
                await handle.wait_for_room()  # (not a scheduling point while the ledger has room)
                handle.submit_add_nowait(data, self._done)
            except Exception as error:
                self._settle(error)
            except BaseException:  # the client is closing: nothing waiting will be added
                with self._lock:
                    unsent, self._waiting = len(self._waiting) + 1, collections.deque()
                for _ in range(unsent):
                    self._settle(LedgerStateError("the client closed before the entry was added"))
                raise

    def _done(self, pending: async_handles.PendingAdd) -> None:
        if pending.error is None:
            self.last_entry_id = pending.entry_id
        self._settle(pending.error)

    def _settle(self, error: BaseException | None) -> None:
        """One add acknowledged (error None) or failed."""
        if error is not None and self._error is None:
            self._error = error
        self._room.release()
        with self._lock:
            self._outstanding -= 1
            if not self._outstanding:
                self._settled.notify_all()

    def __enter__(self) -> "LedgerWriter":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error_type is None:
            self.flush()


class BookKeeper:
    def __init__(self, loop: LoopThread) -> None:
        self._loop = loop
        self._bookkeeper: async_bookkeeper.BookKeeper = loop.value

    @classmethod
    def connect(cls, zk_hosts: str = "127.0.0.1:2181", root: str = "/quire", **options: Any) -> "BookKeeper":
        return cls(LoopThread(lambda: async_bookkeeper.BookKeeper.connect(zk_hosts, root, **options)))

    def create_ledger(self, ensemble_size: int = 3, write_quorum: int | None = None, ack_quorum: int | None = None, **options: Any) -> LedgerHandle:
        async def create() -> async_handles.LedgerHandle:
            return await self._bookkeeper.create_ledger(ensemble_size, write_quorum, ack_quorum, **options)

        return LedgerHandle(self._loop, self._loop.call(create))

    def open_ledger(self, ledger_id: int, password: bytes = b"", *, recovery: bool = True) -> ReadHandle:
        async def open_() -> async_read_handles.ReadHandle:
            return await self._bookkeeper.open_ledger(ledger_id, password, recovery=recovery)

        return ReadHandle(self._loop, self._loop.call(open_))

    def ledger_metadata(self, ledger_id: int) -> LedgerMetadata:
        return self._loop.call(self._bookkeeper.ledger_metadata, ledger_id)

    def list_ledgers(self) -> list[int]:
        return self._loop.call(self._bookkeeper.list_ledgers)

    def delete_ledger(self, ledger_id: int) -> None:
        self._loop.call(self._bookkeeper.delete_ledger, ledger_id)

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> "BookKeeper":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["BookKeeper", "LedgerHandle", "LedgerWriter", "LoopThread", "ReadHandle"]
