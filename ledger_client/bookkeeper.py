"""`BookKeeper`: the ledger client's entry point. Connects to the metadata
store, follows the bookie registry, keeps one connection per bookie, and
creates, opens (with or without recovery), lists and deletes ledgers.

    async with BookKeeper.connect("127.0.0.1:2181", root="/quire") as bk:
        lh = await bk.create_ledger(ensemble_size=3, write_quorum=3, ack_quorum=2, password=b"pw")
        entry_id = await lh.add(b"payload")
        await lh.close()
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import AsyncIterator, Mapping

import trio

from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from coordination.async_store import AsyncMetadataStore, connect_zookeeper
from coordination.store import MetadataStore
from ledger_client.add_timeouts import AddTimeoutMonitor
from ledger_client.errors import UnauthorizedError
from ledger_client.exception_groups import unwrap_single_exception
from ledger_client.bookie_pool import BookiePool
from ledger_client.client_services import ClientServices
from ledger_client.ledger_handle import PENDING_ADDS_MAX_DEFAULT, LedgerHandle
from ledger_client.ledger_store import AsyncLedgerStore
from security.credentials import NO_CREDENTIALS, ClientCredentials
from ledger_client.metadata import LedgerMetadata, password_hash
from ledger_client.placement import choose_ensemble
from ledger_client.read_handle import ReadHandle
from ledger_client.recovery import recover_ledger
from ledger_client.registry import BookieRegistry
from ledger_client.write_core import ADD_TIMEOUT_MS_DEFAULT, ENSEMBLE_CHANGES_MAX_DEFAULT, WriteCore


class BookKeeper:
    def __init__(
        self,
        store: AsyncMetadataStore,
        registry: BookieRegistry,
        pool: BookiePool,
        nursery: trio.Nursery,
        *,
        rng: random.Random,
        pending_adds_max: int,
        add_timeout_ms: float,
        ensemble_changes_max: int,
    ) -> None:
        self.store = store
        self.ledger_store = AsyncLedgerStore(store)
        self.registry = registry
        self.pool = pool
        self.nursery = nursery
        self.rng = rng
        self.pending_adds_max = pending_adds_max
        self.add_timeout_ms = add_timeout_ms
        self.ensemble_changes_max = ensemble_changes_max
        self.add_timeouts = AddTimeoutMonitor(add_timeout_ms)
        nursery.start_soon(self.add_timeouts.run)
        # What the handles and recoveries of this client use of it.
        self.services = ClientServices(
            connections=pool,
            bookies=registry,
            ledger_store=self.ledger_store,
            spawn=nursery.start_soon,
            add_timeouts=self.add_timeouts,
            rng=rng,
        )

    # --- lifetime ---------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        zk_hosts: str = "127.0.0.1:2181",
        root: str = "/quire",
        *,
        session_timeout_ms: int = 10_000,
        connect_timeout_ms: int = 5_000,
        **options,
    ) -> AsyncIterator["BookKeeper"]:
        """Connect to the cluster whose metadata is at `zk_hosts` under the
        chroot `root`. Options: `rng`, `pending_adds_max` (per ledger handle),
        `add_timeout_ms`, `ensemble_changes_max`, `address_map`, `credentials`."""
        sync_store = await connect_zookeeper(
            zk_hosts, root, session_timeout_ms=session_timeout_ms, connect_timeout_ms=connect_timeout_ms
        )
        async with cls.open(sync_store, **options) as bk:
            yield bk

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        sync_store: MetadataStore,
        *,
        rng: random.Random | None = None,
        pending_adds_max: int = PENDING_ADDS_MAX_DEFAULT,
        add_timeout_ms: float = ADD_TIMEOUT_MS_DEFAULT,
        ensemble_changes_max: int = ENSEMBLE_CHANGES_MAX_DEFAULT,
        address_map: Mapping[str, str] | None = None,
        credentials: ClientCredentials = NO_CREDENTIALS,
    ) -> AsyncIterator["BookKeeper"]:
        """A client over a metadata store already connected (closed on exit).
        `address_map` maps bookies' registered addresses to the ones to
        dial (behind a NAT or a proxy); `credentials` are shown to bookies
        that authenticate their clients or serve TLS."""
        async with AsyncMetadataStore(sync_store) as store:
            with unwrap_single_exception():
                async with trio.open_nursery() as nursery:
                    registry = BookieRegistry(store, address_map=address_map)
                    await nursery.start(registry.run)
                    pool = BookiePool(registry, nursery, credentials=credentials)
                    bk = cls(
                        store, registry, pool, nursery,
                        rng=rng or random.Random(),
                        pending_adds_max=pending_adds_max,
                        add_timeout_ms=add_timeout_ms,
                        ensemble_changes_max=ensemble_changes_max,
                    )
                    try:
                        yield bk
                        # A clean exit: the copies of the last adds still
                        # going to slower bookies land before the
                        # connections close.
                        await pool.drain_adds()
                    finally:
                        pool.close()
                        nursery.cancel_scope.cancel()

    # --- ledgers ------------------------------------------------------------------------

    async def create_ledger(
        self,
        ensemble_size: int = 3,
        write_quorum: int | None = None,
        ack_quorum: int | None = None,
        *,
        digest_type: DigestType = DigestType.CRC32C,
        password: bytes = b"",
        custom_metadata: Mapping[str, bytes] | None = None,
    ) -> LedgerHandle:
        """A new ledger on `ensemble_size` writable bookies, open for adds.
        Defaults: write quorum = ensemble size, ack quorum = write quorum
        - 1 (at least 1)."""
        write_quorum = ensemble_size if write_quorum is None else write_quorum
        ack_quorum = max(1, write_quorum - 1) if ack_quorum is None else ack_quorum
        if not (ensemble_size >= write_quorum >= ack_quorum >= 1):
            raise ValueError(
                f"need ensemble_size >= write_quorum >= ack_quorum >= 1, got {ensemble_size}/{write_quorum}/{ack_quorum}"
            )
        if not isinstance(digest_type, DigestType):
            raise TypeError(f"digest_type must be a DigestType, got {digest_type!r}")
        if not isinstance(password, bytes):
            raise TypeError("password must be bytes")
        await self.registry.refresh()
        ensemble = choose_ensemble(self.registry.writable_racks(), ensemble_size, write_quorum, rng=self.rng)
        creation_time_ms = int(time.time() * 1000)

        def build(ledger_id: int) -> LedgerMetadata:
            return LedgerMetadata(
                ledger_id=ledger_id,
                ensemble_size=ensemble_size,
                write_quorum=write_quorum,
                ack_quorum=ack_quorum,
                ensembles=((0, tuple(ensemble)),),
                digest_type=digest_type,
                password_hash=password_hash(password),
                creation_time_ms=creation_time_ms,
                custom_metadata=dict(custom_metadata or {}),
            )

        metadata, version = await self.ledger_store.create(build)
        digest = DigestManager(metadata.ledger_id, digest_type, password)
        core = WriteCore(
            metadata, version, digest,
            bookies=self.registry.writable_racks(),
            rng=self.rng,
            ensemble_changes_max=self.ensemble_changes_max,
            add_timeout_ms=self.add_timeout_ms,
        )
        return LedgerHandle(self.services, core, master_key(password), pending_adds_max=self.pending_adds_max)

    async def open_ledger(self, ledger_id: int, password: bytes = b"", *, recovery: bool = True) -> ReadHandle:
        """Open a ledger for reading. With `recovery` (the default, as in
        BookKeeper's openLedger) a ledger that is not closed is fenced and
        closed first, so that its last entry is final; without it nothing is
        fenced and reads stop at the LAC the bookies report."""
        metadata, version = await self.ledger_store.read(ledger_id)
        if not metadata.check_password(password):
            raise UnauthorizedError(f"wrong password for ledger {ledger_id}")
        digest = DigestManager(ledger_id, metadata.digest_type, password)
        key = master_key(password)
        if recovery and not metadata.is_closed:
            await self.registry.refresh()
            metadata, version = await recover_ledger(self.services, ledger_id, digest, key)
        handle = ReadHandle(self.services, metadata, version, digest, key)
        if not metadata.is_closed:
            await handle.read_lac()
        return handle

    async def ledger_metadata(self, ledger_id: int) -> LedgerMetadata:
        metadata, _ = await self.ledger_store.read(ledger_id)
        return metadata

    async def list_ledgers(self) -> list[int]:
        return await self.ledger_store.list_ledger_ids()

    async def delete_ledger(self, ledger_id: int) -> None:
        """Delete the ledger's metadata; bookies drop its entries when their
        garbage collection finds the metadata gone."""
        await self.ledger_store.delete(ledger_id)


__all__ = ["BookKeeper"]
