"""The in-memory metadata store: ZooKeeper's semantics without a server.

For unit tests and the deterministic simulator it starts no thread, reads no
clock and uses no global randomness: time enters as `now_ms` arguments.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from coordination.store import (
    ANY_VERSION,
    BadVersionError,
    ConnectionLossError,
    EventType,
    MetadataStore,
    NoChildrenForEphemeralsError,
    NodeExistsError,
    NodeStat,
    NoNodeError,
    NotEmptyError,
    SessionExpiredError,
    SessionListener,
    SessionState,
    StoreClosedError,
    Watcher,
    WatchEvent,
    parent_of,
    validate_data,
    validate_path,
    validate_version,
)

_log = logging.getLogger(__name__)

# A callback to run once the server lock is released and the tree is whole.
_Callback = Callable[[], None]


@dataclass(slots=True)
class _Node:
    data: bytes
    ephemeral_owner: int
    created_ms: int
    created_txid: int
    modified_ms: int
    modified_txid: int
    version: int = 0
    children_version: int = 0
    # ZooKeeper numbers sequential children by the count of child creations
    # (deletions bump `children_version` but not the sequence): checked
    # against ZooKeeper 3.8.
    children_created: int = 0
    children: set[str] = field(default_factory=set)

    def stat(self) -> NodeStat:
        return NodeStat(
            version=self.version,
            children_version=self.children_version,
            ephemeral_owner=self.ephemeral_owner,
            created_ms=self.created_ms,
            modified_ms=self.modified_ms,
            children_count=len(self.children),
            created_txid=self.created_txid,
            modified_txid=self.modified_txid,
        )


@dataclass(eq=False, slots=True)
class _Session:
    session_id: int
    timeout_ms: int
    heartbeat_ms: int
    store: "InMemoryMetadataStore"
    ephemeral_paths: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Watch:
    store: "InMemoryMetadataStore"
    session_id: int
    watcher: Watcher


class _State(enum.Enum):
    CONNECTED = "connected"
    SUSPENDED = "suspended"  # connection lost, session alive on the server
    SUSPENDED_EXPIRED = "suspended, session expired"  # the store learns it on resume
    EXPIRED = "expired"  # waiting for reconnect()
    CLOSED = "closed"


# The store's connection state machine: (state, event) -> next state. Any pair
# not listed is a misuse and raises ValueError.
_TRANSITIONS: dict[tuple[_State, str], _State] = {
    (_State.CONNECTED, "suspend"): _State.SUSPENDED,
    (_State.SUSPENDED, "suspend"): _State.SUSPENDED,
    (_State.SUSPENDED_EXPIRED, "suspend"): _State.SUSPENDED_EXPIRED,
    (_State.CONNECTED, "resume"): _State.CONNECTED,
    (_State.SUSPENDED, "resume"): _State.CONNECTED,
    (_State.SUSPENDED_EXPIRED, "resume"): _State.EXPIRED,
    (_State.CONNECTED, "expire"): _State.EXPIRED,
    (_State.SUSPENDED, "expire"): _State.SUSPENDED_EXPIRED,
    (_State.CLOSED, "expire"): _State.CLOSED,
    (_State.EXPIRED, "reconnect"): _State.CONNECTED,
    (_State.CONNECTED, "close"): _State.CLOSED,
    (_State.SUSPENDED, "close"): _State.CLOSED,
    (_State.SUSPENDED_EXPIRED, "close"): _State.CLOSED,
    (_State.EXPIRED, "close"): _State.CLOSED,
    (_State.CLOSED, "close"): _State.CLOSED,
}


def _run_callbacks(callbacks: list[_Callback]) -> None:
    # A failing watcher must not undo or interrupt someone else's mutation;
    # kazoo logs such failures too.
    for callback in callbacks:
        try:
            callback()
        except Exception:
            _log.exception("metadata watch callback or session listener failed")


class InMemoryMetadataServer:
    """The shared tree, the store-wide transaction counter and the sessions.

    Every store made by `connect` sees the same tree. The clock moves only by
    `advance(now_ms)`, which expires the sessions that missed their timeout.
    Thread-safe (one lock) so that the trio adapter may call it from worker
    threads; it never starts a thread itself.
    """

    def __init__(self, now_ms: int = 0) -> None:
        self._lock = threading.RLock()
        self._now_ms = now_ms
        self._txid = 0
        self._session_id_last = 0
        self._sessions: dict[int, _Session] = {}
        self._nodes: dict[str, _Node] = {"/": self._new_node(b"", 0)}
        self._data_watches: dict[str, list[_Watch]] = {}
        self._child_watches: dict[str, list[_Watch]] = {}

    @property
    def now_ms(self) -> int:
        return self._now_ms

    def connect(
        self, session_timeout_ms: int, root: str = "/", *, auto_reconnect: bool = True
    ) -> InMemoryMetadataStore:
        """A store with a new session whose paths live under `root` (created,
        with its parents, if missing)."""
        if not isinstance(session_timeout_ms, int) or session_timeout_ms <= 0:
            raise ValueError(f"session_timeout_ms must be a positive int, got {session_timeout_ms!r}")
        validate_path(root)
        callbacks: list[_Callback] = []
        with self._lock:
            store = InMemoryMetadataStore(self, session_timeout_ms, root, auto_reconnect)
            if root not in self._nodes:
                self._create_locked(root, b"", None, sequential=False, make_parents=True, callbacks=callbacks)
            store._session = self._open_session_locked(store)
        _run_callbacks(callbacks)
        return store

    def advance(self, now_ms: int) -> None:
        """Move the clock to `now_ms` and expire every session whose last
        heartbeat is more than its timeout old."""
        if now_ms < self._now_ms:
            raise ValueError(f"the clock cannot go back from {self._now_ms} to {now_ms} ms")
        with self._lock:
            self._now_ms = now_ms
            overdue = [
                session
                for session_id, session in sorted(self._sessions.items())
                if now_ms - session.heartbeat_ms > session.timeout_ms
            ]
        for session in overdue:
            self._expire(session)

    def expire_session(self, session_id: int) -> None:
        """Expire one session at once, as ZooKeeper does when it times out."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise ValueError(f"no live session {session_id:#x}")
        self._expire(session)

    def session_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._sessions)

    # -- sessions -----------------------------------------------------------

    def _open_session_locked(self, store: "InMemoryMetadataStore") -> _Session:
        self._session_id_last += 1
        session = _Session(self._session_id_last, store._session_timeout_ms, self._now_ms, store)
        self._sessions[session.session_id] = session
        return session

    def _end_session_locked(self, session: _Session, callbacks: list[_Callback], *, watch_event: bool) -> None:
        """Remove the session, its watches (firing SESSION events if
        `watch_event`) and its ephemeral nodes (firing other sessions' watches)."""
        del self._sessions[session.session_id]
        dropped = self._drop_watches_locked(session.session_id)
        if watch_event:
            callbacks.extend(_watch_callback(watch, EventType.SESSION, path) for path, watch in dropped)
        for path in sorted(session.ephemeral_paths):
            self._delete_one_locked(path, callbacks)

    def _drop_watches_locked(self, session_id: int) -> list[tuple[str, _Watch]]:
        dropped: list[tuple[str, _Watch]] = []
        for table in (self._data_watches, self._child_watches):
            for path in list(table):
                kept = [watch for watch in table[path] if watch.session_id != session_id]
                dropped.extend((path, watch) for watch in table[path] if watch.session_id == session_id)
                if kept:
                    table[path] = kept
                else:
                    del table[path]
        return dropped

    def _expire(self, session: _Session) -> None:
        callbacks: list[_Callback] = []
        with self._lock:
            if self._sessions.get(session.session_id) is not session:
                return  # already gone
            store = session.store
            self._end_session_locked(session, callbacks, watch_event=True)
            store._session = None
            if store._transition("expire") is _State.EXPIRED:
                callbacks.extend(store._listener_callbacks(SessionState.LOST))
        _run_callbacks(callbacks)
        if store._state is _State.EXPIRED and store.auto_reconnect:
            store._start_new_session()

    # -- the tree -----------------------------------------------------------

    def _new_node(self, data: bytes, ephemeral_owner: int) -> _Node:
        return _Node(
            data=data,
            ephemeral_owner=ephemeral_owner,
            created_ms=self._now_ms,
            created_txid=self._txid,
            modified_ms=self._now_ms,
            modified_txid=self._txid,
        )

    def _create_locked(
        self,
        path: str,
        data: bytes,
        session: _Session | None,
        *,
        sequential: bool,
        make_parents: bool,
        callbacks: list[_Callback],
    ) -> str:
        parent_path = parent_of(path)
        if parent_path not in self._nodes:
            if not make_parents:
                raise NoNodeError(f"parent of {path} does not exist")
            self._create_locked(parent_path, b"", None, sequential=False, make_parents=True, callbacks=callbacks)
        parent = self._nodes[parent_path]
        if sequential:
            path = f"{path}{parent.children_created:010d}"
        if path in self._nodes:
            raise NodeExistsError(f"{path} already exists")
        if parent.ephemeral_owner:
            raise NoChildrenForEphemeralsError(f"{parent_path} is ephemeral and cannot have children")
        self._txid += 1
        owner = session.session_id if session is not None else 0
        self._nodes[path] = self._new_node(data, owner)
        if session is not None:
            session.ephemeral_paths.add(path)
        parent.children.add(path.rsplit("/", 1)[1])
        parent.children_version += 1
        parent.children_created += 1
        self._fire_locked(self._data_watches, path, EventType.CREATED, callbacks)
        self._fire_locked(self._child_watches, parent_path, EventType.CHILD, callbacks)
        return path

    def _delete_one_locked(self, path: str, callbacks: list[_Callback]) -> None:
        node = self._nodes.pop(path)
        assert not node.children, f"deleting {path} with children"
        self._txid += 1
        if node.ephemeral_owner:
            owner = self._sessions.get(node.ephemeral_owner)
            if owner is not None:
                owner.ephemeral_paths.discard(path)
        parent_path = parent_of(path)
        parent = self._nodes[parent_path]
        parent.children.discard(path.rsplit("/", 1)[1])
        parent.children_version += 1
        self._fire_locked(self._data_watches, path, EventType.DELETED, callbacks)
        self._fire_locked(self._child_watches, path, EventType.DELETED, callbacks)
        self._fire_locked(self._child_watches, parent_path, EventType.CHILD, callbacks)

    def _descendants_bottom_up(self, path: str) -> list[str]:
        """Every node under `path`, children before their parents."""
        found: list[str] = []
        prefix = "" if path == "/" else path
        for name in sorted(self._nodes[path].children):
            child = f"{prefix}/{name}"
            found.extend(self._descendants_bottom_up(child))
            found.append(child)
        return found

    def _fire_locked(
        self, table: dict[str, list[_Watch]], path: str, event_type: EventType, callbacks: list[_Callback]
    ) -> None:
        for watch in table.pop(path, []):
            callbacks.append(_watch_callback(watch, event_type, path))

    @staticmethod
    def _add_watch_locked(table: dict[str, list[_Watch]], path: str, watch: _Watch) -> None:
        # One registration per (session, watcher) and path, so a watcher set
        # twice fires once, as in ZooKeeper.
        watches = table.setdefault(path, [])
        if watch not in watches:
            watches.append(watch)


def _watch_callback(watch: _Watch, event_type: EventType, path: str) -> _Callback:
    return lambda: watch.store._deliver_watch(watch.watcher, event_type, path)


class InMemoryMetadataStore(MetadataStore):
    """One client of an `InMemoryMetadataServer`, bound to one session at a time.

    Made by `InMemoryMetadataServer.connect`. Besides the `MetadataStore`
    calls it offers the levers a test or the simulator pulls: `heartbeat`,
    `suspend`/`resume` (a lost and regained connection) and `reconnect` (after
    an expiry when `auto_reconnect` is off).
    """

    def __init__(
        self, server: InMemoryMetadataServer, session_timeout_ms: int, root: str, auto_reconnect: bool
    ) -> None:
        self._server = server
        self._session_timeout_ms = session_timeout_ms
        self._root = "" if root == "/" else root
        self.auto_reconnect = auto_reconnect
        self._state = _State.CONNECTED
        self._session: _Session | None = None
        self._listeners: list[SessionListener] = []

    # -- session levers ------------------------------------------------------

    @property
    def session_id(self) -> int:
        """The current session's id, or 0 while there is none."""
        session = self._session
        return session.session_id if session is not None else 0

    @property
    def session_timeout_ms(self) -> int:
        return self._session_timeout_ms

    def heartbeat(self, now_ms: int) -> None:
        """Tell the server the client is alive at `now_ms`. Ignored while the
        connection is suspended or the session expired."""
        with self._server._lock:
            if self._state is _State.CLOSED:
                raise StoreClosedError("the metadata store is closed")
            if self._state is _State.CONNECTED and self._session is not None:
                self._session.heartbeat_ms = max(self._session.heartbeat_ms, now_ms)

    def suspend(self) -> None:
        """Lose the connection: calls raise ConnectionLossError, listeners get
        SUSPENDED, watches fire SESSION (kazoo drops them), heartbeats stop."""
        callbacks: list[_Callback] = []
        with self._server._lock:
            if self._state is _State.CLOSED:
                raise StoreClosedError("the metadata store is closed")
            previous = self._state
            self._transition("suspend")
            if previous is _State.CONNECTED and self._session is not None:
                dropped = self._server._drop_watches_locked(self._session.session_id)
                callbacks.extend(self._listener_callbacks(SessionState.SUSPENDED))
                callbacks.extend(_watch_callback(watch, EventType.SESSION, path) for path, watch in dropped)
        _run_callbacks(callbacks)

    def resume(self, now_ms: int) -> None:
        """Regain the connection at `now_ms`: CONNECTED if the session is still
        alive; otherwise LOST, then a new session if `auto_reconnect`."""
        callbacks: list[_Callback] = []
        with self._server._lock:
            if self._state is _State.CLOSED:
                raise StoreClosedError("the metadata store is closed")
            previous = self._state
            state = self._transition("resume")
            if previous is _State.SUSPENDED and self._session is not None:
                self._session.heartbeat_ms = max(self._session.heartbeat_ms, now_ms)
                callbacks.extend(self._listener_callbacks(SessionState.CONNECTED))
            elif state is _State.EXPIRED:
                callbacks.extend(self._listener_callbacks(SessionState.LOST))
        _run_callbacks(callbacks)
        if self._state is _State.EXPIRED and self.auto_reconnect:
            self._start_new_session()

    def reconnect(self) -> None:
        """Start a new session after an expiry (needed when `auto_reconnect`
        is off)."""
        if self._state is _State.CLOSED:
            raise StoreClosedError("the metadata store is closed")
        self._start_new_session()

    def _start_new_session(self) -> None:
        with self._server._lock:
            self._transition("reconnect")
            self._session = self._server._open_session_locked(self)
            callbacks = self._listener_callbacks(SessionState.CONNECTED)
        _run_callbacks(callbacks)

    def _transition(self, event: str) -> _State:
        next_state = _TRANSITIONS.get((self._state, event))
        if next_state is None:
            raise ValueError(f"cannot {event} a metadata store that is {self._state.value}")
        self._state = next_state
        return next_state

    def _listener_callbacks(self, state: SessionState) -> list[_Callback]:
        return [functools.partial(self._deliver_session_state, listener, state) for listener in self._listeners]

    def _deliver_session_state(self, listener: SessionListener, state: SessionState) -> None:
        if self._state is not _State.CLOSED:
            listener(state)

    def _deliver_watch(self, watcher: Watcher, event_type: EventType, full_path: str) -> None:
        if self._state is not _State.CLOSED:
            watcher(WatchEvent(event_type, self._relative(full_path)))

    def add_session_listener(self, listener: SessionListener) -> None:
        with self._server._lock:
            self._listeners.append(listener)

    def close(self) -> None:
        """End the session: its ephemeral nodes go at once. A suspended store
        cannot reach the server, so its session lingers until it times out,
        as with ZooKeeper. No callback runs after close."""
        callbacks: list[_Callback] = []
        with self._server._lock:
            previous = self._state
            self._transition("close")
            session = self._session
            if previous is _State.CONNECTED and session is not None:
                self._server._end_session_locked(session, callbacks, watch_event=False)
                self._session = None
        _run_callbacks(callbacks)

    # -- paths ---------------------------------------------------------------

    def _full(self, path: str) -> str:
        validate_path(path)
        if path == "/":
            return self._root or "/"
        return self._root + path

    def _relative(self, full_path: str) -> str:
        if not self._root:
            return full_path
        return full_path[len(self._root) :] or "/"

    def _live_session_locked(self) -> _Session:
        """The session for a call; touching it counts as a heartbeat, as any
        request does in ZooKeeper."""
        if self._state is _State.CLOSED:
            raise StoreClosedError("the metadata store is closed")
        if self._state in (_State.SUSPENDED, _State.SUSPENDED_EXPIRED):
            raise ConnectionLossError("the connection to the metadata store is lost")
        if self._state is _State.EXPIRED or self._session is None:
            raise SessionExpiredError("the metadata session expired")
        self._session.heartbeat_ms = max(self._session.heartbeat_ms, self._server.now_ms)
        return self._session

    # -- MetadataStore -------------------------------------------------------

    def create(
        self,
        path: str,
        data: bytes = b"",
        *,
        ephemeral: bool = False,
        sequential: bool = False,
        make_parents: bool = False,
    ) -> str:
        validate_data(data)
        if sequential:
            # ZooKeeper allows "/queue/" for a sequential create: the name is
            # then the bare sequence number.
            validate_path(path + "0")
            full = self._root + path
        else:
            full = self._full(path)
        server = self._server
        callbacks: list[_Callback] = []
        try:
            with server._lock:
                session = self._live_session_locked()
                created = server._create_locked(
                    full,
                    data,
                    session if ephemeral else None,
                    sequential=sequential,
                    make_parents=make_parents,
                    callbacks=callbacks,
                )
        finally:
            # Parents made before a failure stay, as with kazoo's makepath,
            # and their watches fire.
            _run_callbacks(callbacks)
        return self._relative(created)

    def _node_at_version_locked(self, full: str, path: str, expected_version: int):
        node = self._server._nodes.get(full)
        if node is None:
            raise NoNodeError(f"{path} does not exist")
        if expected_version != ANY_VERSION and expected_version != node.version:
            raise BadVersionError(f"{path} is at version {node.version}, not {expected_version}")
        return node

    def get(self, path: str, watch: Watcher | None = None) -> tuple[bytes, NodeStat]:
        full = self._full(path)
        server = self._server
        with server._lock:
            session = self._live_session_locked()
            node = self._node_at_version_locked(full, path, ANY_VERSION)
            if watch is not None:
                server._add_watch_locked(server._data_watches, full, _Watch(self, session.session_id, watch))
            return node.data, node.stat()

    def set(self, path: str, data: bytes, expected_version: int = ANY_VERSION) -> NodeStat:
        validate_data(data)
        validate_version(expected_version)
        full = self._full(path)
        server = self._server
        callbacks: list[_Callback] = []
        with server._lock:
            self._live_session_locked()
            node = self._node_at_version_locked(full, path, expected_version)
            server._txid += 1
            node.data = data
            node.version += 1
            node.modified_ms = server.now_ms
            node.modified_txid = server._txid
            stat = node.stat()
            server._fire_locked(server._data_watches, full, EventType.CHANGED, callbacks)
        _run_callbacks(callbacks)
        return stat

    def delete(self, path: str, expected_version: int = ANY_VERSION, *, recursive: bool = False) -> None:
        validate_version(expected_version)
        full = self._full(path)
        if path == "/":
            raise ValueError("cannot delete the root of a metadata store")
        server = self._server
        callbacks: list[_Callback] = []
        with server._lock:
            self._live_session_locked()
            node = self._node_at_version_locked(full, path, expected_version)
            if node.children and not recursive:
                raise NotEmptyError(f"{path} has children")
            # Recursive deletion is one atomic step here; the events are those
            # of deleting child before parent, as ZooKeeper would send them.
            for descendant in server._descendants_bottom_up(full):
                server._delete_one_locked(descendant, callbacks)
            server._delete_one_locked(full, callbacks)
        _run_callbacks(callbacks)

    def exists(self, path: str, watch: Watcher | None = None) -> NodeStat | None:
        full = self._full(path)
        server = self._server
        with server._lock:
            session = self._live_session_locked()
            if watch is not None:
                server._add_watch_locked(server._data_watches, full, _Watch(self, session.session_id, watch))
            node = server._nodes.get(full)
            return node.stat() if node is not None else None

    def children(self, path: str, watch: Watcher | None = None) -> list[str]:
        full = self._full(path)
        server = self._server
        with server._lock:
            session = self._live_session_locked()
            node = self._node_at_version_locked(full, path, ANY_VERSION)
            if watch is not None:
                server._add_watch_locked(server._child_watches, full, _Watch(self, session.session_id, watch))
            return sorted(node.children)
