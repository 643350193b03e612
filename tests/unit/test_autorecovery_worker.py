"""The replication worker's loop over the in-memory metadata store, with the
work on one ledger (`_replicate`) replaced by a stand-in: a ledger waiting
out its grace period is tried again when it ends, not at the next relist;
the loop sleeps while a ledger is being copied; a lock whose release failed
while ZooKeeper was away is released once it is back; markers found while
auto-recovery is switched off are left alone until it is switched on."""

from __future__ import annotations

import contextlib
import random

import trio

from coordination.cluster_layout import ClusterLayout, ensure_cluster_layout
from coordination.memory_store import InMemoryMetadataServer
from ledger_client.autorecovery import underreplication
from ledger_client.autorecovery.config import AutoRecoveryConfig
from ledger_client.autorecovery.replication_worker import MARKERS_RELIST_MS, ReplicationWorker
from ledger_client.autorecovery.waits import wall_ms
from ledger_client.bookkeeper import BookKeeper
from tests.support import wait_until_async

LAYOUT = ClusterLayout()
SESSION_MS = 10_000
LEDGER_ID = 7


@contextlib.asynccontextmanager
async def marked_cluster():
    """(server, an admin session, a client, its worker, not yet running)
    over a store where ledger LEDGER_ID is marked under-replicated."""
    server = InMemoryMetadataServer()
    admin = server.connect(session_timeout_ms=SESSION_MS)
    try:
        ensure_cluster_layout(admin, LAYOUT)
        underreplication.ensure_paths(admin, LAYOUT)
        underreplication.mark(admin, LAYOUT, LEDGER_ID, frozenset({"gone:1"}), wall_ms(), "auditor")
        async with BookKeeper.open(server.connect(session_timeout_ms=SESSION_MS)) as bk:
            yield server, admin, bk, ReplicationWorker(bk, AutoRecoveryConfig(), "worker", rng=random.Random(1))
    finally:
        admin.close()


async def wait_for(condition, deadline_s: float = 10.0) -> None:
    await wait_until_async(condition, deadline_s=deadline_s, what="the condition")


async def test_a_ledger_in_its_grace_period_is_tried_again_when_it_ends():
    async with marked_cluster() as (server, admin, bk, worker):
        starts: list[float] = []

        async def replicate(ledger_id: int) -> float:
            starts.append(trio.current_time())
            return wall_ms() + 100  # WAIT: the grace period ends in 0.1 s

        worker._replicate = replicate
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run)
            # Relisting comes every MARKERS_RELIST_MS (30 s): only the end
            # of each attempt and its retry time can bring these.
            assert MARKERS_RELIST_MS >= 10_000
            await wait_for(lambda: len(starts) >= 4, deadline_s=3)
            nursery.cancel_scope.cancel()


async def test_the_loop_sleeps_while_a_ledger_is_being_copied():
    async with marked_cluster() as (server, admin, bk, worker):
        # As after a busy lock or a failure: a retry time that has come.
        worker._backoff.wait_until(LEDGER_ID, wall_ms() - 1)
        copying = trio.Event()

        async def replicate(ledger_id: int) -> None:
            copying.set()
            await trio.sleep_forever()  # a long copy

        worker._replicate = replicate
        lists = 0
        store = bk.store
        children, children_watch = store.children, store.children_watch

        async def counted(call, *args):
            nonlocal lists
            lists += 1
            return await call(*args)

        store.children = lambda path: counted(children, path)
        store.children_watch = lambda path: counted(children_watch, path)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run)
            await copying.wait()
            with trio.move_on_after(1.0):
                await wait_for(lambda: lists > 2)
            assert lists <= 2, f"the loop listed the markers {lists} times in 1 s while one ledger was copied"
            nursery.cancel_scope.cancel()


async def test_a_lock_whose_release_failed_is_released_once_the_store_is_back():
    async with marked_cluster() as (server, admin, bk, worker):
        sync_store = bk.store.store
        done = trio.Event()

        async def replicate(ledger_id: int) -> None:
            # The work is done (marker gone), then ZooKeeper is unreachable
            # for a moment, shorter than the session: the unlock fails.
            _, version = underreplication.read_marker(admin, LAYOUT, ledger_id)
            assert underreplication.unmark(admin, LAYOUT, ledger_id, version)
            sync_store.suspend()
            done.set()

        worker._replicate = replicate
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run)
            await done.wait()
            await wait_for(lambda: LEDGER_ID in worker._unlocks_pending)
            assert underreplication.locks(admin, LAYOUT) == {LEDGER_ID: "worker"}
            sync_store.resume(server.now_ms)  # the same session goes on
            # The lock goes in the worker's thread, the pending entry after
            # that thread returns: wait for both.
            await wait_for(lambda: underreplication.locks(admin, LAYOUT) == {} and worker._unlocks_pending == set())
            nursery.cancel_scope.cancel()


async def test_markers_found_while_switched_off_wait_until_switched_on():
    async with marked_cluster() as (server, admin, bk, worker):
        underreplication.set_enabled(admin, LAYOUT, False)  # after the auditor marked
        attempts = []

        async def replicate(ledger_id: int) -> float:
            attempts.append(ledger_id)
            return wall_ms() + 50

        worker._replicate = replicate
        async with trio.open_nursery() as nursery:
            nursery.start_soon(worker.run)
            with trio.move_on_after(0.5):  # ten retry periods
                await wait_for(lambda: attempts)
            assert attempts == [] and underreplication.locks(admin, LAYOUT) == {}
            underreplication.set_enabled(admin, LAYOUT, True)
            await wait_for(lambda: len(attempts) >= 2)
            # Switched off again, mid-work: it stops again.
            underreplication.set_enabled(admin, LAYOUT, False)
            await wait_for(lambda: worker._in_progress == set())
            count = len(attempts)
            with trio.move_on_after(0.5):
                await wait_for(lambda: len(attempts) > count)
            assert len(attempts) == count
            nursery.cancel_scope.cancel()
