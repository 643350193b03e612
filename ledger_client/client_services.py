"""What ledger handles and the recovery driver use of the client that made
them, passed in as one small object (`ClientServices`): connections to the
bookies, the writable bookies, the ledger metadata, a way to start tasks,
the add-timeout timer and the random source. A handle never sees the
`BookKeeper` itself, so the client imports its handles and not the reverse."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from bookie.protocol.wire import Request
from ledger_client.add_timeouts import AddTimeoutMonitor
from ledger_client.bookie_client import Callback
from ledger_client.metadata import LedgerMetadata


class BookieConnections(Protocol):
    """Requests to bookies by id, over the client's one connection to each
    (`ledger_client.bookie_pool.BookiePool`)."""

    async def call(self, bookie_id: str, request_factory: Callable[[int], Request]) -> Any:
        """Send the request `request_factory(request_id)` makes; its response."""

    def send_add_tail(self, bookie_id: str, tail: bytes, callback: Callback, ledger_id: int, entry_id: int) -> None:
        """Send an encoded add; `callback` (or an AddListener) hears its answer."""


class WritableBookies(Protocol):
    """The registry as placement sees it (`ledger_client.registry.BookieRegistry`)."""

    def writable_racks(self) -> dict[str, str | None]:
        """Writable bookie ids and their racks."""


class LedgerMetadataAccess(Protocol):
    """Reading a ledger's metadata and its compare-and-set
    (`ledger_client.ledger_store.AsyncLedgerStore`)."""

    async def read(self, ledger_id: int) -> tuple[LedgerMetadata, int]:
        """The metadata and its version."""

    async def write(self, metadata: LedgerMetadata, expected_version: int) -> int:
        """Compare-and-set; the new version (BadVersionError on a conflict)."""


class TaskSpawner(Protocol):
    """Starts a task in a nursery that outlives the caller (`trio.Nursery.start_soon`)."""

    def __call__(self, async_fn: Callable[..., Awaitable[object]], *args: Any) -> None: ...


@dataclass(frozen=True)
class ClientServices:
    """The client's parts a handle or a recovery works with; `BookKeeper`
    makes one and hands it to each."""

    connections: BookieConnections
    bookies: WritableBookies
    ledger_store: LedgerMetadataAccess
    # Tasks that must outlive one call of the handle (a range read's
    # prefetches, a metadata write) run in the client's nursery.
    spawn: TaskSpawner
    add_timeouts: AddTimeoutMonitor
    rng: random.Random


__all__ = ["BookieConnections", "ClientServices", "LedgerMetadataAccess", "TaskSpawner", "WritableBookies"]
