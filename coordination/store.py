"""The metadata store interface shared by the ZooKeeper (kazoo) and in-memory stores.

It follows ZooKeeper's model: a tree of nodes holding bytes, each with a
version that every conditional write names; ephemeral nodes that belong to a
session and vanish when it ends; sequential nodes; one-shot watches.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Callable


class MetadataError(Exception):
    """Base of every error a metadata store raises."""


class NoNodeError(MetadataError):
    """The node (or, for a create, its parent) does not exist."""


class NodeExistsError(MetadataError):
    """A create named a node that already exists."""


class BadVersionError(MetadataError):
    """A conditional set or delete named a version that is no longer current."""


class NotEmptyError(MetadataError):
    """A non-recursive delete named a node that has children."""


class NoChildrenForEphemeralsError(MetadataError):
    """A create named a parent that is an ephemeral node; ephemeral nodes
    cannot have children (ZooKeeper's rule)."""


class SessionExpiredError(MetadataError):
    """The session ended: its ephemeral nodes are gone and a new session begins."""


class ConnectionLossError(MetadataError):
    """The store could not be reached within the bounded retries; the outcome of
    the last call is unknown (a create or set may or may not have happened)."""


class NotAllowedError(MetadataError):
    """The node's ACL refuses this client (ZooKeeper's NoAuth): a setting
    to fix (--zk-auth), not a state that passes."""


class StoreClosedError(MetadataError):
    """The store was closed by its owner."""


ANY_VERSION = -1


@dataclass(frozen=True, slots=True)
class NodeStat:
    """What the store knows about a node besides its data."""

    version: int  # data version, 0 at creation, +1 on every set
    children_version: int  # +1 on every child create or delete
    ephemeral_owner: int  # session id owning the node, 0 for persistent nodes
    created_ms: int
    modified_ms: int
    children_count: int
    created_txid: int  # ZooKeeper's czxid: orders creations store-wide
    modified_txid: int  # mzxid


class EventType(enum.Enum):
    CREATED = "CREATED"
    DELETED = "DELETED"
    CHANGED = "CHANGED"
    CHILD = "CHILD"
    # The watch was dropped without the node necessarily changing: the
    # connection was lost (kazoo drops every watch on disconnect and does not
    # re-register it) or the session ended. ZooKeeper calls this event type
    # "None". Read the node again and set a new watch.
    SESSION = "SESSION"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: EventType
    path: str


class SessionState(enum.Enum):
    CONNECTED = "CONNECTED"
    SUSPENDED = "SUSPENDED"  # connection lost, session may still be alive
    LOST = "LOST"  # session expired: ephemeral nodes are gone


Watcher = Callable[[WatchEvent], None]
SessionListener = Callable[[SessionState], None]


class MetadataStore(abc.ABC):
    """A connection to a metadata store, bound to one session at a time.

    Paths are absolute inside the store's root (chroot). Watches are one-shot,
    as in ZooKeeper: a watch set by `get`/`exists` fires once on the next
    change of that node's data or existence, one set by `children` fires once
    on the next child create/delete or on deletion of the node. A watch that
    the store drops because the connection was lost or the session ended fires
    once with `EventType.SESSION` instead, so a waiter is never left hanging.
    Watch callbacks and session listeners run on the store's own thread (kazoo)
    or after the mutation that fired them returns (in-memory); they must not
    block. After `close()` no callback runs.
    """

    @property
    @abc.abstractmethod
    def session_id(self) -> int: ...

    @abc.abstractmethod
    def create(
        self,
        path: str,
        data: bytes = b"",
        *,
        ephemeral: bool = False,
        sequential: bool = False,
        make_parents: bool = False,
    ) -> str:
        """Create a node; return its actual path (with the sequence suffix,
        ten zero-padded digits, when `sequential`). Parents made by
        `make_parents` are persistent and empty."""

    @abc.abstractmethod
    def get(self, path: str, watch: Watcher | None = None) -> tuple[bytes, NodeStat]: ...

    @abc.abstractmethod
    def set(self, path: str, data: bytes, expected_version: int = ANY_VERSION) -> NodeStat: ...

    @abc.abstractmethod
    def delete(self, path: str, expected_version: int = ANY_VERSION, *, recursive: bool = False) -> None: ...

    @abc.abstractmethod
    def exists(self, path: str, watch: Watcher | None = None) -> NodeStat | None: ...

    @abc.abstractmethod
    def children(self, path: str, watch: Watcher | None = None) -> list[str]:
        """Names (not paths) of the node's children, sorted."""

    @abc.abstractmethod
    def add_session_listener(self, listener: SessionListener) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """End the session (ephemeral nodes go at once) and release resources."""

    def ensure_path(self, path: str) -> None:
        """Create `path` and its missing parents as empty persistent nodes."""
        if self.exists(path) is not None:
            return
        try:
            self.create(path, b"", make_parents=True)
        except NodeExistsError:
            pass

    def __enter__(self) -> "MetadataStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def validate_path(path: str) -> None:
    """Raise ValueError for a path ZooKeeper would reject."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"metadata path must be absolute, got {path!r}")
    if path != "/" and path.endswith("/"):
        raise ValueError(f"metadata path must not end with '/', got {path!r}")
    if "//" in path or "\x00" in path:
        raise ValueError(f"malformed metadata path {path!r}")
    for part in path.split("/")[1:]:
        if part in (".", ".."):
            raise ValueError(f"metadata path must not contain '.' or '..', got {path!r}")


def validate_data(data: object) -> None:
    """Raise TypeError unless `data` is bytes."""
    if not isinstance(data, bytes):
        raise TypeError(f"node data must be bytes, got {type(data).__name__}")


def validate_version(expected_version: object) -> None:
    """Raise TypeError/ValueError unless `expected_version` is a version or ANY_VERSION."""
    if not isinstance(expected_version, int) or isinstance(expected_version, bool):
        raise TypeError(f"expected_version must be an int, got {expected_version!r}")
    if expected_version < ANY_VERSION:
        raise ValueError(f"expected_version must be >= {ANY_VERSION}, got {expected_version}")


def parent_of(path: str) -> str:
    head = path.rsplit("/", 1)[0]
    return head or "/"
