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

import functools
import threading
from typing import Any, Callable, Iterator

import trio

from bookie.protocol.entry_format import Entry
from ledger_client import bookkeeper as async_bookkeeper
from ledger_client import ledger_handle as async_handles
from ledger_client import read_handle as async_read_handles
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
            async with self._open_context() as value:
                self.value = value
                self._ready.set()
                await self._stop.wait()
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
        return self._loop.call(self._handle.add, data)

    def close(self) -> None:
        self._loop.call(self._handle.close)


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


__all__ = ["BookKeeper", "LedgerHandle", "LoopThread", "ReadHandle"]
