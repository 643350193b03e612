"""The metadata store: ZooKeeper through kazoo, an in-memory store with the
same semantics for unit tests and the simulator, a trio adapter, and a
launcher for a local ZooKeeper.

`KazooMetadataStore`, `AsyncMetadataStore` and the launcher are imported on
first use, so code that needs only the in-memory store does not pay for
kazoo, trio and sockets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coordination.lazy_exports import lazy_exports
from coordination.memory_store import InMemoryMetadataServer, InMemoryMetadataStore
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
)

if TYPE_CHECKING:
    from coordination.async_store import AsyncMetadataStore
    from coordination.startup import Startup, StartupFailedError, StartupTimeoutError
    from coordination.zk_launcher import ZooKeeperNotInstalledError, ZooKeeperServer, ZooKeeperStartError
    from coordination.zk_store import KazooMetadataStore

_LAZY = {
    "KazooMetadataStore": "coordination.zk_store",
    "AsyncMetadataStore": "coordination.async_store",
    "Startup": "coordination.startup",
    "StartupFailedError": "coordination.startup",
    "StartupTimeoutError": "coordination.startup",
    "ZooKeeperNotInstalledError": "coordination.zk_launcher",
    "ZooKeeperServer": "coordination.zk_launcher",
    "ZooKeeperStartError": "coordination.zk_launcher",
}

__getattr__ = lazy_exports(globals(), _LAZY)

__all__ = [
    "ANY_VERSION",
    "AsyncMetadataStore",
    "BadVersionError",
    "ConnectionLossError",
    "EventType",
    "InMemoryMetadataServer",
    "InMemoryMetadataStore",
    "KazooMetadataStore",
    "MetadataError",
    "MetadataStore",
    "NoChildrenForEphemeralsError",
    "NodeExistsError",
    "NodeStat",
    "NoNodeError",
    "NotAllowedError",
    "NotEmptyError",
    "RetryPolicy",
    "SessionExpiredError",
    "SessionListener",
    "SessionState",
    "Startup",
    "StartupFailedError",
    "StartupTimeoutError",
    "StoreClosedError",
    "WatchEvent",
    "Watcher",
    "ZooKeeperNotInstalledError",
    "ZooKeeperServer",
    "ZooKeeperStartError",
    "call_with_retry",
]
