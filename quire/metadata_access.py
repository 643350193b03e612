"""Opening the cluster's metadata store from a command, with one clear error
line (and exit 2) when ZooKeeper cannot be reached."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator


from coordination.async_store import AsyncMetadataStore, connect_zookeeper
from coordination.store import MetadataError
from quire.cli_parsing import UsageError


@contextlib.asynccontextmanager
async def open_metadata(zk_hosts: str, root: str, *, connect_timeout_ms: int = 5_000) -> AsyncIterator[AsyncMetadataStore]:
    try:
        store = await connect_zookeeper(zk_hosts, root, connect_timeout_ms=connect_timeout_ms)
    except (MetadataError, ValueError) as error:
        raise UsageError(str(error)) from None
    async with AsyncMetadataStore(store) as metadata:
        yield metadata
