"""The auditor's trio driver: stands in the election (ephemeral sequential
nodes; the lowest is the auditor, the next takes over when its session
ends; a lost connection keeps the node), and while elected follows the
bookie registry and marks the ledgers of lost bookies under-replicated, as
an `AuditCore` decides."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING

import trio

from coordination.cluster_layout import ClusterLayout
from coordination.store import MetadataError, NoNodeError
from ledger_client.autorecovery import underreplication
from ledger_client.autorecovery.audit_core import AuditCore, ledgers_to_mark, referenced_bookies
from ledger_client.autorecovery.config import AutoRecoveryConfig
from ledger_client.autorecovery.waits import repeat_after_store_errors, run_while_enabled, wait_any, wall_ms

if TYPE_CHECKING:
    from ledger_client.bookkeeper import BookKeeper

log = logging.getLogger(__name__)


class Auditor:
    def __init__(self, bookkeeper: "BookKeeper", config: AutoRecoveryConfig, name: str, layout: ClusterLayout | None = None) -> None:
        self._bookkeeper = bookkeeper
        self._config = config
        self.name = name
        self._layout = layout or ClusterLayout()
        self.is_auditor = False
        self._node: str | None = None  # our candidate node's name
        self.scans = 0  # completed scans while elected
        self.marked = 0  # markers created or extended

    async def run(self) -> None:
        """Stand for election until cancelled; a metadata store failure
        (ZooKeeper unreachable) means standing again with the same candidate
        node, the end of the session with a new one."""
        try:
            await repeat_after_store_errors("auditor election", self._stand)
        finally:
            self.is_auditor = False
            await self._withdraw()

    async def _stand(self) -> None:
        store, layout = self._bookkeeper.store, self._layout
        await trio.to_thread.run_sync(underreplication.ensure_paths, store.store, layout, abandon_on_cancel=True)
        losses = store.session_losses
        node = await self._candidate()
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

    async def _candidate(self) -> str:
        """Our candidate node's name: the one made before while it is still
        our session's (a lost connection keeps it; only the session's end
        takes it away), else a new one. Other nodes of our session (a create
        whose answer was lost, sent again) are removed: the lower one would
        otherwise stay first while we wait behind it, and nobody would audit."""
        store, election = self._bookkeeper.store, self._layout.auditor_election
        session_id = store.session_id
        if self._node is not None:
            stat = await store.exists(f"{election}/{self._node}")
            if stat is None or stat.ephemeral_owner != session_id:
                self._node = None
        if self._node is None:
            path = await store.create(
                f"{election}/{underreplication.CANDIDATE_PREFIX}", self.name.encode(), ephemeral=True, sequential=True
            )
            self._node = path.rsplit("/", 1)[1]
        for name in await store.children(election):
            if name == self._node or not name.startswith(underreplication.CANDIDATE_PREFIX):
                continue
            stat = await store.exists(f"{election}/{name}")
            if stat is not None and stat.ephemeral_owner == session_id:
                log.info("%s removes its extra candidate node %s", self.name, name)
                with contextlib.suppress(NoNodeError):
                    await store.delete(f"{election}/{name}", stat.version)
        return self._node

    async def _withdraw(self) -> None:
        """Delete our candidate node, even in a cancelled scope, so that the
        next candidate takes over at once."""
        node, self._node = self._node, None
        if node is None:
            return
        with trio.move_on_after(5) as scope:
            scope.shield = True
            try:
                await self._bookkeeper.store.delete(f"{self._layout.auditor_election}/{node}")
            except MetadataError:
                pass  # gone with the session, or ZooKeeper is away: it goes with the session

    async def _audit_while_enabled(self) -> None:
        core = AuditCore(self._config.lost_bookie_delay_ms, self._config.audit_interval_ms)
        await run_while_enabled("auditor", self._bookkeeper.store, self._layout, functools.partial(self._audit, core))

    async def _audit(self, core: AuditCore) -> None:
        registry = self._bookkeeper.registry
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
        store = self._bookkeeper.store.store
        ledgers = self._bookkeeper.ledger_store.ledgers

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
