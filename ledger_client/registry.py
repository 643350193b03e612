"""The client's view of the bookie registry: which bookies are writable
(placement picks from them) and where every registered bookie listens, kept
current by ZooKeeper watches on the writable and read-only lists."""

from __future__ import annotations

import logging
from typing import Mapping

import trio

from coordination.async_store import AsyncMetadataStore
from coordination.cluster_layout import BookieRegistrationInfo, ClusterLayout, list_bookies
from coordination.store import MetadataError, NoNodeError, NotAllowedError

log = logging.getLogger(__name__)
REFRESH_DELAY_S_MAX = 5.0  # back-off ceiling when ZooKeeper fails us


class BookieRegistry:
    def __init__(
        self, store: AsyncMetadataStore, layout: ClusterLayout | None = None, *, address_map: Mapping[str, str] | None = None
    ) -> None:
        self.store = store
        self.layout = layout or ClusterLayout()
        # Registered address -> the address to dial instead (a NAT, a proxy):
        # BookKeeper's BookieAddressResolver plays this part.
        self.address_map = dict(address_map or {})
        self.writable_bookies: dict[str, BookieRegistrationInfo] = {}
        self.readonly_bookies: dict[str, BookieRegistrationInfo] = {}
        self._changed = trio.Event()
        self.generation = 0  # increases on every refresh that changed something

    async def refresh(self) -> None:
        """Read both lists now (also what `run` repeats on every change)."""
        def read_both() -> tuple[dict[str, BookieRegistrationInfo], dict[str, BookieRegistrationInfo]]:
            sync_store = self.store.store
            return (
                list_bookies(sync_store, self.layout, read_only=False),
                list_bookies(sync_store, self.layout, read_only=True),
            )

        writable, readonly = await trio.to_thread.run_sync(read_both, abandon_on_cancel=True)
        self._update(writable, readonly)

    def _update(self, writable: dict[str, BookieRegistrationInfo], readonly: dict[str, BookieRegistrationInfo]) -> None:
        if writable != self.writable_bookies or readonly != self.readonly_bookies:
            self.writable_bookies, self.readonly_bookies = writable, readonly
            self.generation += 1
            self._changed.set()
            self._changed = trio.Event()

    async def wait_changed(self, generation: int) -> int:
        while self.generation == generation:
            await self._changed.wait()
        return self.generation

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Follow the registry until cancelled: re-read a list whenever its
        watch fires (a one-shot ZooKeeper watch, set again by each read)."""
        delay_s = 0.1
        started = False
        while True:
            try:
                writable_event = await self._watch_list(self.layout.writable_bookies)
                readonly_event = await self._watch_list(self.layout.readonly_bookies)
                await self.refresh()
            except MetadataError as error:
                if isinstance(error, NotAllowedError) and not started:
                    raise  # ZooKeeper's ACLs refuse this client: waiting will not change that
                log.warning("reading the bookie registry failed (%s); retrying in %.1fs", error, delay_s)
                await trio.sleep(delay_s)
                delay_s = min(delay_s * 2, REFRESH_DELAY_S_MAX)
                continue
            delay_s = 0.1
            if not started:
                task_status.started()
                started = True
            async with trio.open_nursery() as nursery:
                # Whichever list changes first ends the wait; both watches are
                # set again by the next round.
                async def wait_then_cancel(event: trio.Event) -> None:
                    await event.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(wait_then_cancel, writable_event)
                nursery.start_soon(wait_then_cancel, readonly_event)

    async def _watch_list(self, path: str) -> trio.Event:
        """An event set when the list at `path` next changes. Before any
        bookie has started in this cluster the list's node does not exist:
        the list is empty (a client, or a broker, may start before the
        bookies), and the event is set when the node appears."""
        while True:
            try:
                _, event = await self.store.children_watch(path)
                return event
            except NoNodeError:
                stat, event = await self.store.exists_watch(path)
                if stat is None:
                    return event
                # Made between the two calls: watch its children after all.

    # --- lookups ----------------------------------------------------------------------

    def writable_racks(self) -> dict[str, str | None]:
        """Writable bookie ids and their racks: what placement picks from."""
        return {bookie_id: info.rack for bookie_id, info in self.writable_bookies.items()}

    def address(self, bookie_id: str) -> str:
        """Where a bookie listens. A bookie missing from the registry (its
        session ended, or it is down) is tried at its id, which is its
        host:port unless it was started with --bookie-id."""
        info = self.writable_bookies.get(bookie_id) or self.readonly_bookies.get(bookie_id)
        address = info.address if info is not None else bookie_id
        return self.address_map.get(address, address)

    def serves_tls(self, bookie_id: str) -> bool:
        """Whether a bookie's registration says its port serves TLS only."""
        info = self.writable_bookies.get(bookie_id) or self.readonly_bookies.get(bookie_id)
        return info is not None and info.tls


__all__ = ["BookieRegistry"]
