"""The metadata store over a real ZooKeeper, through kazoo.

Maps kazoo's errors, connection states and watch events onto
`coordination.store`, and retries lost connections under a bounded `RetryPolicy`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from kazoo import exceptions as kazoo_errors
from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import EventType as KazooEventType
from kazoo.protocol.states import KazooState
from kazoo.retry import KazooRetry
from kazoo.security import make_digest_acl

from coordination.retry import RetryPolicy, call_with_retry
from coordination.store import (
    ANY_VERSION,
    BadVersionError,
    ConnectionLossError,
    EventType,
    MetadataError,
    MetadataStore,
    NoChildrenForEphemeralsError,
    NodeExistsError,
    NodeStat,
    NoNodeError,
    NotAllowedError,
    NotEmptyError,
    SessionExpiredError,
    SessionListener,
    SessionState,
    StoreClosedError,
    Watcher,
    WatchEvent,
    validate_data,
    validate_path,
    validate_version,
)

_log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors after which the same call may simply be sent again. Their outcome is
# unknown: the request may or may not have been applied (see `create`).
_RETRYABLE = (kazoo_errors.ConnectionLoss, kazoo_errors.OperationTimeoutError, KazooTimeoutError)

# Order matters: kazoo's ConnectionClosedError is a subclass of its
# SessionExpiredError, so it must be matched first. kazoo's own messages are
# mostly empty, hence ours.
_ERROR_MAP: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], type[MetadataError], str], ...] = (
    (kazoo_errors.ConnectionClosedError, StoreClosedError, "the metadata store is closed"),
    (kazoo_errors.NoNodeError, NoNodeError, "no such node (for a create: no such parent)"),
    (kazoo_errors.NodeExistsError, NodeExistsError, "the node already exists"),
    (kazoo_errors.BadVersionError, BadVersionError, "the node is not at the expected version"),
    (kazoo_errors.NotEmptyError, NotEmptyError, "the node has children"),
    (kazoo_errors.NoChildrenForEphemeralsError, NoChildrenForEphemeralsError, "the parent is an ephemeral node"),
    (kazoo_errors.SessionExpiredError, SessionExpiredError, "the ZooKeeper session expired"),
    (_RETRYABLE, ConnectionLossError, "no answer from ZooKeeper after retries; the outcome is unknown"),
    (kazoo_errors.NoAuthError, NotAllowedError, "not allowed: the node's ACL refuses this client (see --zk-auth)"),
    (kazoo_errors.KazooException, MetadataError, "ZooKeeper refused the request"),
)

_EVENT_TYPES = {
    KazooEventType.CREATED: EventType.CREATED,
    KazooEventType.DELETED: EventType.DELETED,
    KazooEventType.CHANGED: EventType.CHANGED,
    KazooEventType.CHILD: EventType.CHILD,
    # KazooEventType.NONE: kazoo dropped every watch because the connection
    # was lost (it does not re-register watches on reconnect, unlike the Java
    # client). Anything unknown maps to SESSION too.
}

_SESSION_STATES = {
    KazooState.CONNECTED: SessionState.CONNECTED,
    KazooState.SUSPENDED: SessionState.SUSPENDED,
    KazooState.LOST: SessionState.LOST,
}

# kazoo reconnects in the background until the client stops: unbounded in
# tries by design (a session outlives a short ZooKeeper outage), but with the
# delay between attempts capped so that a ZooKeeper that comes back is found
# well within a session timeout. kazoo's own default caps it at an hour.
_RECONNECT_DELAY_INITIAL_S = 0.1
_RECONNECT_DELAY_MAX_S = 1.0


def _translate(error: BaseException, path: str) -> MetadataError:
    for kazoo_type, store_type, message in _ERROR_MAP:
        if isinstance(error, kazoo_type):
            return store_type(f"{path}: {message} ({type(error).__name__})")
    raise TypeError(f"not a kazoo error: {error!r}")  # pragma: no cover - callers filter


def _node_stat(stat: Any) -> NodeStat:
    return NodeStat(
        version=stat.version,
        children_version=stat.cversion,
        ephemeral_owner=stat.ephemeralOwner,
        created_ms=stat.ctime,
        modified_ms=stat.mtime,
        children_count=stat.numChildren,
        created_txid=stat.czxid,
        modified_txid=stat.mzxid,
    )


def _child_path(parent: str, name: str) -> str:
    return f"/{name}" if parent == "/" else f"{parent}/{name}"


def _stop_client(client: KazooClient) -> None:
    """Stop kazoo's threads and release its sockets, whatever state it is in."""
    try:
        client.stop()
    finally:
        client.close()


# ZooKeeper digest authentication: "user:password", set for the process by
# `set_digest_auth` (quire's --zk-auth) or taken from this variable (so that
# the processes a command starts inherit it).
ZK_AUTH_ENV = "QUIRE_ZK_AUTH"
_digest_auth: str | None = None


def set_digest_auth(user_password: str | None) -> None:
    """Every ZooKeeper connection of this process authenticates as
    `user:password`, and every node it creates is readable and writable by
    that identity only (a digest ACL): an anonymous client can neither read
    nor change quire's metadata. None: no authentication, open nodes."""
    global _digest_auth
    if user_password is not None:
        check_digest_auth(user_password)
    _digest_auth = user_password


def check_digest_auth(user_password: str) -> str:
    user, colon, password = user_password.partition(":")
    if not colon or not user or not password:
        raise ValueError("ZooKeeper authentication is USER:PASSWORD, both non-empty")
    return user_password


def digest_auth() -> str | None:
    """The process's ZooKeeper identity, if any (set, or from QUIRE_ZK_AUTH)."""
    import os

    return _digest_auth if _digest_auth is not None else (os.environ.get(ZK_AUTH_ENV) or None)


def _start_client(hosts: str, *, session_timeout_ms: int, timeout_s: float, failure_message: str) -> KazooClient:
    """A started kazoo client, or ConnectionLossError(failure_message) with
    every kazoo thread stopped."""
    credentials = digest_auth()
    secured: dict[str, Any] = {}
    if credentials is not None:
        user, _, password = check_digest_auth(credentials).partition(":")
        secured = {"auth_data": [("digest", credentials)], "default_acl": [make_digest_acl(user, password, all=True)]}
    client = KazooClient(
        **secured,
        hosts=hosts,
        timeout=session_timeout_ms / 1000.0,
        connection_retry=KazooRetry(
            max_tries=-1,
            delay=_RECONNECT_DELAY_INITIAL_S,
            backoff=2,
            max_jitter=0.4,
            max_delay=_RECONNECT_DELAY_MAX_S,
        ),
    )
    try:
        client.start_async().wait(timeout=max(timeout_s, 0.001))
    except (KazooTimeoutError, kazoo_errors.KazooException):
        _stop_client(client)
        raise ConnectionLossError(failure_message) from None
    if not client.connected:
        # Not kazoo's start(timeout): on a time-out it stops the client and
        # waits for its connection thread, which a server that accepts but
        # never answers holds in a read for the whole session timeout, so the
        # caller's bound would be doubled. The threads stop in the background.
        threading.Thread(target=_stop_client, args=(client,), name="kazoo-stop", daemon=True).start()
        raise ConnectionLossError(failure_message) from None
    return client


@dataclass(frozen=True, slots=True)
class _KazooWatch:
    """A caller's watcher as kazoo sees it. Equal for the same watcher and
    path, so kazoo's per-path watcher set fires a watcher set twice only once,
    as ZooKeeper does."""

    store: "KazooMetadataStore"
    watcher: Watcher
    path: str

    def __call__(self, event: Any) -> None:
        if self.store._closed:
            return
        event_type = _EVENT_TYPES.get(event.type, EventType.SESSION)
        try:
            self.watcher(WatchEvent(event_type, self.path))
        except Exception:
            _log.exception("metadata watch callback for %s failed", self.path)


class KazooMetadataStore(MetadataStore):
    """A `MetadataStore` over one kazoo client (one ZooKeeper session at a time).

    Like kazoo, it reconnects on its own: after a session expires, listeners
    get LOST and then CONNECTED with a new session. Make it with `connect`.
    """

    def __init__(
        self,
        client: KazooClient,
        *,
        retry: RetryPolicy,
        operation_timeout_ms: int,
    ) -> None:
        self._client = client
        self._retry = retry
        self._operation_timeout_s = operation_timeout_ms / 1000.0
        self._rng = random.Random()
        self._closed = False
        self._listeners: list[SessionListener] = []
        self._listeners_lock = threading.Lock()
        client_id = client.client_id
        self._session_id_last = client_id[0] if client_id else 0
        client.add_listener(self._on_kazoo_state)

    @classmethod
    def connect(
        cls,
        hosts: str,
        root: str = "/quire",
        *,
        session_timeout_ms: int = 10_000,
        connect_timeout_ms: int = 5_000,
        retry: RetryPolicy | None = None,
        operation_timeout_ms: int | None = None,
    ) -> "KazooMetadataStore":
        """Connect to the ZooKeeper ensemble `hosts` ("host:port,host:port"),
        creating the chroot `root` if it is missing. Raises
        ConnectionLossError if no server answers within `connect_timeout_ms`
        (a host that drops packets instead of refusing them can hold kazoo's
        TCP connect, and so this call, for up to the session timeout). Each
        try of a call waits at most `operation_timeout_ms` (default: the
        session timeout) for its answer; kazoo itself would wait forever while
        ZooKeeper is unreachable."""
        if not isinstance(hosts, str) or not hosts.strip():
            raise ValueError(f"hosts must be a non-empty 'host:port[,host:port]' string, got {hosts!r}")
        if "/" in hosts:
            raise ValueError(f"give the chroot as root= (`--root PATH` on the command line), not inside hosts: {hosts!r}")
        validate_path(root)
        for name, value in (("session_timeout_ms", session_timeout_ms), ("connect_timeout_ms", connect_timeout_ms)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if operation_timeout_ms is None:
            operation_timeout_ms = session_timeout_ms
        elif not isinstance(operation_timeout_ms, int) or operation_timeout_ms <= 0:
            raise ValueError(f"operation_timeout_ms must be a positive int, got {operation_timeout_ms!r}")
        retry = retry if retry is not None else RetryPolicy()

        failure_message = f"could not reach ZooKeeper at {hosts} within {connect_timeout_ms / 1000.0:.1f}s"
        deadline = time.monotonic() + connect_timeout_ms / 1000.0
        if root != "/":
            # A chrooted kazoo client cannot create its own root, so make it
            # with a short-lived client that sees the whole tree.
            bootstrap = _start_client(
                hosts,
                session_timeout_ms=session_timeout_ms,
                timeout_s=deadline - time.monotonic(),
                failure_message=failure_message,
            )
            try:
                cls(bootstrap, retry=retry, operation_timeout_ms=operation_timeout_ms).ensure_path(root)
            finally:
                _stop_client(bootstrap)
        client = _start_client(
            hosts + (root if root != "/" else ""),
            session_timeout_ms=session_timeout_ms,
            timeout_s=deadline - time.monotonic(),
            failure_message=failure_message,
        )
        return cls(client, retry=retry, operation_timeout_ms=operation_timeout_ms)

    # -- session -------------------------------------------------------------

    @property
    def kazoo_client(self) -> KazooClient:
        """The underlying kazoo client, for tools and tests (kazoo recipes,
        expiring a session)."""
        return self._client

    @property
    def session_id(self) -> int:
        """The current session's id; the last one while the connection is
        suspended; 0 after the session was lost and before a new one starts."""
        client_id = self._client.client_id
        if client_id is not None:
            return client_id[0]
        return self._session_id_last

    def _on_kazoo_state(self, kazoo_state: str) -> None:
        # Runs on kazoo's connection thread; must not block.
        state = _SESSION_STATES.get(kazoo_state)
        if state is None:
            return
        if state is SessionState.CONNECTED:
            client_id = self._client.client_id
            self._session_id_last = client_id[0] if client_id else 0
        elif state is SessionState.LOST:
            self._session_id_last = 0
        if self._closed:
            return
        with self._listeners_lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(state)
            except Exception:
                _log.exception("metadata session listener failed on %s", state.value)

    def add_session_listener(self, listener: SessionListener) -> None:
        with self._listeners_lock:
            self._listeners.append(listener)

    def close(self) -> None:
        if self._closed:
            return
        # Set first: kazoo tells listeners LOST while it stops, and no
        # callback runs after close.
        self._closed = True
        _stop_client(self._client)

    # -- calls ---------------------------------------------------------------

    def _wait(self, async_result: Any) -> Any:
        return async_result.get(timeout=self._operation_timeout_s)

    def _run(self, path: str, attempt: Callable[[], T]) -> T:
        if self._closed:
            raise StoreClosedError("the metadata store is closed")
        try:
            return call_with_retry(attempt, self._retry, retry_on=_RETRYABLE, rng=self._rng)
        except (kazoo_errors.KazooException, KazooTimeoutError) as error:
            raise _translate(error, path) from error

    def _watch(self, watch: Watcher | None, path: str) -> _KazooWatch | None:
        return _KazooWatch(self, watch, path) if watch is not None else None

    # A call that fails with ConnectionLoss or a time-out is sent again, but
    # the first request may already have been applied; the retry then sees
    # the effect of our own first try. ZooKeeper cannot tell us, so:
    # - create (not sequential): a retry that finds the node existing accepts
    #   it when it is an ephemeral node of our own session holding our data.
    #   For a persistent node there is no owner to compare, so
    #   NodeExistsError is raised: a caller that must know whether the node
    #   is its own should put a unique token in the data and read it back.
    # - create (sequential): each try makes a new node, so a retry can leave
    #   an extra node with our data (for an ephemeral one, owned by our
    #   session). Callers that cannot tolerate that (locks, elections) should
    #   put a unique token in the data and remove their extra nodes.
    # - set: a retry that gets BadVersionError accepts the node when it holds
    #   our data at exactly expected_version + 1.
    # - delete: a retry that gets NoNodeError counts as done for an
    #   unconditional delete; a conditional one raises NoNodeError.
    # A request that timed out may still be queued in kazoo and be sent later.

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
        validate_path(path + "0" if sequential else path)
        tries = 0

        def attempt() -> str:
            nonlocal tries
            tries += 1
            try:
                return self._wait(
                    self._client.create_async(
                        path, data, ephemeral=ephemeral, sequence=sequential, makepath=make_parents
                    )
                )
            except kazoo_errors.NodeExistsError:
                if tries > 1 and ephemeral and not sequential and self._is_own_ephemeral(path, data):
                    return path
                raise

        return self._run(path, attempt)

    def _is_own_ephemeral(self, path: str, data: bytes) -> bool:
        try:
            node_data, stat = self._wait(self._client.get_async(path))
        except kazoo_errors.NoNodeError:
            return False
        return stat.ephemeralOwner == self.session_id and node_data == data

    def get(self, path: str, watch: Watcher | None = None) -> tuple[bytes, NodeStat]:
        validate_path(path)
        kazoo_watch = self._watch(watch, path)
        data, stat = self._run(path, lambda: self._wait(self._client.get_async(path, watch=kazoo_watch)))
        return data, _node_stat(stat)

    def set(self, path: str, data: bytes, expected_version: int = ANY_VERSION) -> NodeStat:
        validate_data(data)
        validate_version(expected_version)
        validate_path(path)
        tries = 0

        def attempt() -> Any:
            nonlocal tries
            tries += 1
            try:
                return self._wait(self._client.set_async(path, data, expected_version))
            except kazoo_errors.BadVersionError:
                if tries > 1 and expected_version != ANY_VERSION:
                    node_data, stat = self._wait(self._client.get_async(path))
                    if node_data == data and stat.version == expected_version + 1:
                        return stat
                raise

        return _node_stat(self._run(path, attempt))

    def delete(self, path: str, expected_version: int = ANY_VERSION, *, recursive: bool = False) -> None:
        validate_version(expected_version)
        validate_path(path)
        if path == "/":
            raise ValueError("cannot delete the root of a metadata store")
        if recursive:
            self._delete_recursive(path, expected_version)
        else:
            self._delete_one(path, expected_version)

    def _delete_one(self, path: str, expected_version: int) -> None:
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            try:
                self._wait(self._client.delete_async(path, expected_version))
            except kazoo_errors.NoNodeError:
                if tries > 1 and expected_version == ANY_VERSION:
                    return
                raise

        self._run(path, attempt)

    def _delete_recursive(self, path: str, expected_version: int) -> None:
        # Not atomic, unlike the in-memory store: the version is checked
        # first and again by the final conditional delete (deleting children
        # does not change it); a child created meanwhile makes it fail with
        # NotEmptyError. kazoo's own recursive delete ignores the version and
        # a missing node, so it is not used.
        stat = self.exists(path)
        if stat is None:
            raise NoNodeError(f"{path}: does not exist")
        if expected_version != ANY_VERSION and stat.version != expected_version:
            raise BadVersionError(f"{path}: is at version {stat.version}, not {expected_version}")
        self._delete_descendants(path)
        self._delete_one(path, expected_version)

    def _delete_descendants(self, path: str) -> None:
        try:
            names = self.children(path)
        except NoNodeError:
            return
        for name in names:
            child = _child_path(path, name)
            self._delete_descendants(child)
            try:
                self._delete_one(child, ANY_VERSION)
            except NoNodeError:
                pass  # deleted by someone else meanwhile: the goal is reached

    def exists(self, path: str, watch: Watcher | None = None) -> NodeStat | None:
        validate_path(path)
        kazoo_watch = self._watch(watch, path)
        stat = self._run(path, lambda: self._wait(self._client.exists_async(path, watch=kazoo_watch)))
        return _node_stat(stat) if stat is not None else None

    def children(self, path: str, watch: Watcher | None = None) -> list[str]:
        validate_path(path)
        kazoo_watch = self._watch(watch, path)
        names = self._run(path, lambda: self._wait(self._client.get_children_async(path, watch=kazoo_watch)))
        return sorted(names)
