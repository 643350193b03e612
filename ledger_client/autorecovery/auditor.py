"""The auditor's trio driver: stands in the election (ephemeral sequential
nodes; the lowest is the auditor, the next takes over when its session
ends), and while elected follows the bookie registry and marks the ledgers
of lost bookies under-replicated, as an `AuditCore` decides."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import trio

from coordination.cluster_layout import ClusterLayout
from coordination.store import MetadataError
from ledger_client.autorecovery import underreplication
from ledger_client.autorecovery.audit_core import AuditCore, ledgers_to_mark, referenced_bookies
from ledger_client.autorecovery.config import AutoRecoveryConfig
from ledger_client.autorecovery.waits import repeat_after_store_errors, run_while_enabled, wait_any, wall_ms

if TYPE_CHECKING:
    from ledger_client.bookkeeper import BookKeeper

log = logging.getLogger(__name__)


class Auditor:
    def __init__(self, bk: "BookKeeper", config: AutoRecoveryConfig, name: str, layout: ClusterLayout | None = None) -> None:
        self._bk = bk
        self._config = config
        self.name = name
        self._layout = layout or ClusterLayout()
        self.is_auditor = False
        self.scans = 0  # completed scans while elected
        self.marked = 0  # markers created or extended

    async def run(self) -> None:
        """Stand for election until cancelled; a metadata store failure
        (session lost, ZooKeeper unreachable) means standing again."""
        await repeat_after_store_errors("auditor election", self._stand)

    async def _stand(self) -> None:
        store, layout = self._bk.store, self._layout
        await trio.to_thread.run_sync(underreplication.ensure_paths, store.store, layout, abandon_on_cancel=True)
        losses = store.session_losses
        path = await store.create(
            f"{layout.auditor_election}/{underreplication.CANDIDATE_PREFIX}", self.name.encode(),
            ephemeral=True, sequential=True,
        )
        node = path.rsplit("/", 1)[1]
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    names, changed = await store.children_watch(layout.auditor_election)
                    candidates = sorted(name for name in names if name.startswith(underreplication.CANDIDATE_PREFIX))
                    if node not in candidates or store.session_losses != losses:
                        break  # our session ended: stand again with a new node
                    if not self.is_auditor and candidates[0] == node:
                        # Lower nodes only go away, so the lowest stays the
                        # auditor until its own node goes.
                        self.is_auditor = True
                        log.info("%s is the auditor", self.name)
                        nursery.start_soon(self._audit_while_enabled)
                    await wait_any(changed.wait, functools.partial(store.wait_session_lost, losses))
                nursery.cancel_scope.cancel()
        finally:
            self.is_auditor = False
            with trio.move_on_after(5) as scope:
                scope.shield = True
                try:
                    await store.delete(path)
                except MetadataError:
                    pass  # gone with the session, or ZooKeeper is away: it goes with the session

    async def _audit_while_enabled(self) -> None:
        core = AuditCore(self._config.lost_bookie_delay_ms, self._config.audit_interval_ms)
        await run_while_enabled("auditor", self._bk.store, self._layout, functools.partial(self._audit, core))

    async def _audit(self, core: AuditCore) -> None:
        registry = self._bk.registry
        while True:
            generation = registry.generation
            now_ms = wall_ms()
            core.registry_changed(set(registry.writable_bookies) | set(registry.readonly_bookies), now_ms)
            if core.scan_due(now_ms):
                await self._scan(core, now_ms)
            await wait_any(functools.partial(registry.wait_changed, generation), deadline_ms=core.next_deadline_ms())

    async def _scan(self, core: AuditCore, now_ms: float) -> None:
        """Read every ledger's ensembles and mark those on lost bookies
        (in one worker thread: the scan is a sequence of ZooKeeper reads)."""
        lost = core.lost(now_ms)
        store = self._bk.store.store
        ledgers = self._bk.ledger_store.ledgers

        def scan_and_mark() -> tuple[set[str], int]:
            index = underreplication.ensemble_bookies(ledgers)
            marks = ledgers_to_mark(index, lost)
            changed = sum(
                underreplication.mark(store, self._layout, ledger_id, bookies, now_ms, self.name)
                for ledger_id, bookies in sorted(marks.items())
            )
            return referenced_bookies(index), changed

        referenced, changed = await trio.to_thread.run_sync(scan_and_mark, abandon_on_cancel=True)
        core.scan_done(referenced, lost, wall_ms())
        self.scans += 1
        self.marked += changed
        if lost:
            log.info("audit: bookies %s lost; %d ledgers newly marked under-replicated", sorted(lost), changed)


__all__ = ["Auditor"]
