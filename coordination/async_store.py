"""A trio face for a synchronous `MetadataStore` (kazoo or in-memory).

Each blocking call runs in a worker thread under a `trio.CapacityLimiter`;
one-shot watches and session changes come back to the trio loop as events.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

import trio

from coordination.store import ANY_VERSION, MetadataStore, NodeStat, SessionState, Watcher, WatchEvent

T = TypeVar("T")


class AsyncMetadataStore:
    """Async calls and watch events over `store`, which it owns from now on
    (`aclose` closes it). Create it inside `trio.run`: it remembers that
    loop to deliver callbacks to.

    Callbacks from the store (kazoo's threads, or the worker threads running
    in-memory calls) are handed to the loop with `TrioToken.run_sync_soon`
    rather than `trio.from_thread.run_sync`: the latter blocks the calling
    thread until the loop runs, which deadlocks if the loop is itself blocked
    in a synchronous `close()` that joins that thread. A callback made on the
    loop's own thread (the in-memory store driven directly from trio code)
    runs at once.

    A call cancelled while its thread runs is abandoned: it may still take
    effect, exactly like a call that failed with ConnectionLossError. The
    thread keeps its limiter slot until it ends, so `threads_max` holds.
    """

    def __init__(self, store: MetadataStore, *, threads_max: int = 4) -> None:
        if not isinstance(threads_max, int) or threads_max < 1:
            raise ValueError(f"threads_max must be a positive int, got {threads_max!r}")
        try:
            self._trio_token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            raise RuntimeError("AsyncMetadataStore must be created inside trio.run") from None
        self._trio_thread_id = threading.get_ident()
        self._limiter = trio.CapacityLimiter(threads_max)
        self.store = store
        self._session_generation = 0
        self._session_id_seen = store.session_id
        self._session_changed = trio.Event()
        self._session_losses = 0
        self._session_lost = trio.Event()
        self._session_news = trio.Event()  # set at each loss and each new session

        store.add_session_listener(self._on_session_state)

    # -- delivery to the trio loop ---------------------------------------------

    def _call_on_trio_thread(self, fn: Callable[[], None]) -> None:
        if threading.get_ident() == self._trio_thread_id:
            fn()
            return
        try:
            self._trio_token.run_sync_soon(fn)
        except trio.RunFinishedError:
            pass  # the loop is gone: nobody is waiting any more

    def _setter(self, event: trio.Event) -> Watcher:
        def on_watch(_: WatchEvent) -> None:
            self._call_on_trio_thread(event.set)

        return on_watch

    # -- sessions --------------------------------------------------------------

    @property
    def session_id(self) -> int:
        return self.store.session_id

    @property
    def session_generation(self) -> int:
        """Grows by one each time a new session starts (not when the same
        session reconnects after a suspension)."""
        return self._session_generation

    def _on_session_state(self, state: SessionState) -> None:
        # Read now, on the store's thread, so the id matches this change.
        session_id = self.store.session_id
        self._call_on_trio_thread(functools.partial(self._note_session_state, state, session_id))

    def _note_session_state(self, state: SessionState, session_id: int) -> None:
        if state is SessionState.LOST:
            self._session_losses += 1
            lost, self._session_lost = self._session_lost, trio.Event()
            lost.set()
            self._tell_session_news()
            return
        if state is not SessionState.CONNECTED or session_id in (0, self._session_id_seen):
            return
        self._session_id_seen = session_id
        self._session_generation += 1
        changed, self._session_changed = self._session_changed, trio.Event()
        changed.set()
        self._tell_session_news()

    def _tell_session_news(self) -> None:
        news, self._session_news = self._session_news, trio.Event()
        news.set()

    @property
    def session_losses(self) -> int:
        """Grows by one each time the store reports its session expired."""
        return self._session_losses

    async def wait_session_lost(self, losses: int) -> int:
        """Return the count of session losses once it differs from `losses`
        (reported at once, before any new session starts)."""
        while self._session_losses == losses:
            await self._session_lost.wait()
        return self._session_losses

    async def wait_session_news(self, losses: int, generation: int) -> tuple[int, int]:
        """Return (session losses, session generation) once either differs
        from the one given: one waiter sees a loss and the new session that
        follows it in the order they happened."""
        while self._session_losses == losses and self._session_generation == generation:
            await self._session_news.wait()
        return self._session_losses, self._session_generation

    async def wait_session_change(self, generation: int) -> int:
        """Return the session generation once it differs from `generation`."""
        while self._session_generation == generation:
            await self._session_changed.wait()
        return self._session_generation

    # -- calls -----------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await trio.to_thread.run_sync(
            functools.partial(fn, *args, **kwargs), limiter=self._limiter, abandon_on_cancel=True
        )

    async def create(
        self,
        path: str,
        data: bytes = b"",
        *,
        ephemeral: bool = False,
        sequential: bool = False,
        make_parents: bool = False,
    ) -> str:
        return await self._run(
            self.store.create, path, data, ephemeral=ephemeral, sequential=sequential, make_parents=make_parents
        )

    async def get(self, path: str) -> tuple[bytes, NodeStat]:
        return await self._run(self.store.get, path)

    async def set(self, path: str, data: bytes, expected_version: int = ANY_VERSION) -> NodeStat:
        return await self._run(self.store.set, path, data, expected_version)

    async def delete(self, path: str, expected_version: int = ANY_VERSION, *, recursive: bool = False) -> None:
        await self._run(self.store.delete, path, expected_version, recursive=recursive)

    async def exists(self, path: str) -> NodeStat | None:
        return await self._run(self.store.exists, path)

    async def children(self, path: str) -> list[str]:
        return await self._run(self.store.children, path)

    async def ensure_path(self, path: str) -> None:
        await self._run(self.store.ensure_path, path)

    # -- watches ---------------------------------------------------------------

    async def get_watch(self, path: str) -> tuple[bytes, NodeStat, trio.Event]:
        """The node's data and stat, and an event set when the node next
        changes or is deleted (or the watch is lost with the connection)."""
        event = trio.Event()
        data, stat = await self._run(self.store.get, path, self._setter(event))
        return data, stat, event

    async def exists_watch(self, path: str) -> tuple[NodeStat | None, trio.Event]:
        """The node's stat (None if absent), and an event set when it is next
        created, changed or deleted (or the watch is lost)."""
        event = trio.Event()
        stat = await self._run(self.store.exists, path, self._setter(event))
        return stat, event

    async def children_watch(self, path: str) -> tuple[list[str], trio.Event]:
        """The node's children, and an event set when a child is next created
        or deleted, or the node is deleted (or the watch is lost)."""
        event = trio.Event()
        names = await self._run(self.store.children, path, self._setter(event))
        return names, event

    # -- lifetime --------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the store, even in a cancelled scope: a store left open
        would keep its session (and ephemeral nodes) alive."""
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.store.close, limiter=self._limiter)

    async def __aenter__(self) -> "AsyncMetadataStore":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def connect_zookeeper(zk_hosts: str, root: str, **options: Any) -> MetadataStore:
    """Connect a `KazooMetadataStore` from trio (kazoo connects on a worker
    thread); options as `KazooMetadataStore.connect`."""
    from coordination.zk_store import KazooMetadataStore

    return await trio.to_thread.run_sync(functools.partial(KazooMetadataStore.connect, zk_hosts, root, **options))

