"""The auditor's trio driver over the in-memory metadata store: the lowest
candidate audits; a bookie whose registration goes is lost after the delay
and exactly the ledgers on it are marked; when the auditor's session
expires the next candidate takes over and the old one stands again behind
it; switched off, nothing is marked until switched on."""

from __future__ import annotations

from dataclasses import replace

import trio

from coordination.cluster_layout import BookieRegistrationInfo, ClusterLayout, ensure_cluster_layout
from coordination.memory_store import InMemoryMetadataServer
from ledger_client.autorecovery import underreplication
from ledger_client.autorecovery.auditor import Auditor
from ledger_client.autorecovery.config import AutoRecoveryConfig
from ledger_client.bookkeeper import BookKeeper
from ledger_client.ledger_store import LedgerStore
from tests.support import ledger_metadata_for, wait_until_async

LAYOUT = ClusterLayout()
CONFIG = AutoRecoveryConfig(lost_bookie_delay_ms=100, audit_interval_ms=60_000)
SESSION_MS = 10_000


def register(server: InMemoryMetadataServer, bookie_id: str):
    """A bookie's registration, on a session of its own (closed: it is gone)."""
    session = server.connect(session_timeout_ms=SESSION_MS)
    info = BookieRegistrationInfo(bookie_id, bookie_id)
    session.create(LAYOUT.bookie_registration(bookie_id, read_only=False), info.to_bytes(), ephemeral=True)
    return session


def ledger_on(ledgers: LedgerStore, bookies: tuple[str, ...]) -> int:
    metadata, _ = ledgers.create(lambda ledger_id: replace(ledger_metadata_for(ledger_id), ensembles=((0, bookies),)))
    return metadata.ledger_id


async def wait_for(condition, deadline_s: float = 10.0) -> None:
    await wait_until_async(condition, deadline_s=deadline_s, what="the condition")


def marked(admin) -> dict[int, frozenset[str]]:
    return {
        ledger_id: underreplication.read_marker(admin, LAYOUT, ledger_id)[0].lost_bookies
        for ledger_id in underreplication.marked_ledgers(admin, LAYOUT)
    }


async def test_the_auditor_marks_a_lost_bookies_ledgers_and_hands_over_when_its_session_ends():
    server = InMemoryMetadataServer()
    admin = server.connect(session_timeout_ms=SESSION_MS)
    ensure_cluster_layout(admin, LAYOUT)
    bookies = {bookie_id: register(server, bookie_id) for bookie_id in ("b1", "b2", "b3", "b4")}
    ledgers = LedgerStore(admin)
    first = ledger_on(ledgers, ("b1", "b2", "b3"))
    second = ledger_on(ledgers, ("b2", "b3", "b4"))
    one_store = server.connect(session_timeout_ms=SESSION_MS)
    async with BookKeeper.open(one_store) as bk_one, BookKeeper.open(server.connect(session_timeout_ms=SESSION_MS)) as bk_two:
        one, two = Auditor(bk_one, CONFIG, "one"), Auditor(bk_two, CONFIG, "two")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one.run)
            await wait_for(lambda: one.is_auditor and one.scans == 1)
            nursery.start_soon(two.run)
            await wait_for(lambda: [name for _, name in underreplication.auditor_candidates(admin, LAYOUT)] == ["one", "two"])

            bookies["b1"].close()  # b1 is gone for good
            await wait_for(lambda: marked(admin) == {first: {"b1"}})
            assert not two.is_auditor

            # The auditor's session expires: "two" audits, "one" queues behind it.
            server.expire_session(one_store.session_id)
            await wait_for(lambda: two.is_auditor and two.scans >= 1)
            await wait_for(lambda: [name for _, name in underreplication.auditor_candidates(admin, LAYOUT)] == ["two", "one"])
            assert not one.is_auditor

            # Switched off, a second loss is not acted on; switched on, it is.
            underreplication.set_enabled(admin, LAYOUT, False)
            scans = two.scans
            bookies["b4"].close()
            with trio.move_on_after(0.5):  # five lost-bookie delays
                await wait_for(lambda: two.scans > scans)
            assert two.scans == scans and marked(admin) == {first: {"b1"}}
            underreplication.set_enabled(admin, LAYOUT, True)
            await wait_for(lambda: marked(admin) == {first: {"b1"}, second: {"b4"}})
            nursery.cancel_scope.cancel()
    admin.close()


async def test_a_lost_connection_keeps_the_auditors_candidate_node():
    # ZooKeeper is unreachable for a moment, shorter than the session: the
    # auditor keeps its node (so its place in the election) and audits
    # again once back. A node of its own session left by a create sent
    # twice would stay first for ever: it is removed.
    server = InMemoryMetadataServer()
    admin = server.connect(session_timeout_ms=SESSION_MS)
    ensure_cluster_layout(admin, LAYOUT)
    underreplication.ensure_paths(admin, LAYOUT)
    one_store = server.connect(session_timeout_ms=SESSION_MS)
    one_store.create(f"{LAYOUT.auditor_election}/{underreplication.CANDIDATE_PREFIX}", b"one", ephemeral=True, sequential=True)
    async with BookKeeper.open(one_store) as bk_one, BookKeeper.open(server.connect(session_timeout_ms=SESSION_MS)) as bk_two:
        one, two = Auditor(bk_one, CONFIG, "one"), Auditor(bk_two, CONFIG, "two")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one.run)
            await wait_for(lambda: one.is_auditor)
            nodes = [node for node, _ in underreplication.auditor_candidates(admin, LAYOUT)]
            assert len(nodes) == 1
            nursery.start_soon(two.run)
            await wait_for(lambda: [name for _, name in underreplication.auditor_candidates(admin, LAYOUT)] == ["one", "two"])

            one_store.suspend()
            await wait_for(lambda: not one.is_auditor)
            with trio.move_on_after(0.5):  # a few of its retries fail meanwhile
                await wait_for(lambda: two.is_auditor)
            assert not two.is_auditor
            one_store.resume(server.now_ms)
            await wait_for(lambda: one.is_auditor)
            assert [node for node, _ in underreplication.auditor_candidates(admin, LAYOUT)][0] == nodes[0]
            assert [name for _, name in underreplication.auditor_candidates(admin, LAYOUT)] == ["one", "two"]
            assert not two.is_auditor
            nursery.cancel_scope.cancel()
        # Stopped, it withdraws: nothing of either is left.
        assert underreplication.auditor_candidates(admin, LAYOUT) == []
    admin.close()
