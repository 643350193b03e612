"""The broker's partition hosting follows its ZooKeeper session in order:
an expiry is reported as a loss and then as a new session, and the hosting
ends up in the new session whatever order trio wakes its tasks in (it once
took the loss after the new session, and was left with none for good)."""

from __future__ import annotations

from types import SimpleNamespace

import trio

from broker.lease import Lease
from broker.ownership import BrokerInfo, Ownership
from broker.hosting import PartitionHosting
from broker.housekeeping import HousekeepingClock
from coordination.async_store import AsyncMetadataStore
from coordination.memory_store import InMemoryMetadataServer
from tests.support import wait_until_async

RUNS = 20  # trio shuffles the tasks it wakes together: each run is a new draw


async def hosting_after_one_expiry() -> tuple[int | None, int]:
    server = InMemoryMetadataServer()
    raw = server.connect(session_timeout_ms=10_000)
    store = AsyncMetadataStore(raw)
    ownership = Ownership(store, BrokerInfo("b1", "127.0.0.1:1"))
    context = SimpleNamespace(lease=Lease(10_000), housekeeping=HousekeepingClock())
    hosting = PartitionHosting(context, store, ownership, partition_policies=None, close_clients=lambda service: None,
                               session_timeout_ms=10_000)
    generation = store.session_generation
    await ownership.register()
    async with trio.open_nursery() as nursery:
        await nursery.start(hosting.run, generation)
        first = store.session_id
        server.expire_session(first)

        async def on_the_new_session() -> bool:
            return (store.session_id not in (0, first) and hosting.core.session_id == store.session_id
                    and await ownership.registered())

        await wait_until_async(on_the_new_session, deadline_s=5, what="hosting registered on the new session")
        result = hosting.core.session_id, store.session_id
        nursery.cancel_scope.cancel()
    return result


def test_an_expiry_leaves_the_hosting_in_the_new_session_registered_again():
    for _ in range(RUNS):
        core_session, store_session = trio.run(hosting_after_one_expiry)
        assert core_session == store_session != 0


async def test_a_claim_names_the_session_it_was_made_in():
    # The claim's node is made in one session, which expires and is
    # replaced before the claim returns: the claim must name the first
    # session (its node went with it), so that the ownership core, now in
    # the new session, refuses to load the partition on it.
    server = InMemoryMetadataServer()
    store = AsyncMetadataStore(server.connect(session_timeout_ms=10_000))
    ownership = Ownership(store, BrokerInfo("b1", "127.0.0.1:1"))
    first = store.session_id
    create = store.create

    async def create_then_expire(*args, **kwargs):
        made = await create(*args, **kwargs)
        server.expire_session(first)
        await wait_until_async(lambda: store.session_id not in (0, first), deadline_s=5, what="a new session")
        return made

    store.create = create_then_expire
    owner = await ownership.claim("tenant/ns/t")
    assert owner.session_id == first != store.session_id
    assert not ownership.is_mine(owner)
