"""The metadata store: ZooKeeper through kazoo, an in-memory store with the
same semantics for unit tests and the simulator, a trio adapter, and a
launcher for a local ZooKeeper.

`KazooMetadataStore` and `AsyncMetadataStore` are imported on first use, so
code that needs only the in-memory store does not pay for kazoo and trio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    NotEmptyError,
    SessionExpiredError,
    SessionListener,
    SessionState,
    StoreClosedError,
    Watcher,
    WatchEvent,
)
from coordination.zk_launcher import ZooKeeperNotInstalledError, ZooKeeperServer, ZooKeeperStartError

if TYPE_CHECKING:
    from coordination.async_store import AsyncMetadataStore
    from coordination.zk_store import KazooMetadataStore

_LAZY = {
    "KazooMetadataStore": "coordination.zk_store",
    "AsyncMetadataStore": "coordination.async_store",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


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
    "NotEmptyError",
    "RetryPolicy",
    "SessionExpiredError",
    "SessionListener",
    "SessionState",
    "StoreClosedError",
    "WatchEvent",
    "Watcher",
    "ZooKeeperNotInstalledError",
    "ZooKeeperServer",
    "ZooKeeperStartError",
    "call_with_retry",
]
