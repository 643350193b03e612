"""The broker's housekeeping clock: one timer for every partition served,
each partition's tick called once per interval, members joining and leaving
at any time (even during a tick), and one member's failure kept from the
others; the rates sampled on its ticks. The namespace policies that every partition's check reads are read
from ZooKeeper once for all of a namespace's topics checking at once."""

from __future__ import annotations

import trio

from broker.housekeeping import TICKS_BETWEEN_CHECKPOINTS, HousekeepingClock
from broker.metrics import RATE_SAMPLES_MAX, CounterRates
from broker.tenant_store import TenantStore
from broker.topic_records import TopicPolicies, TopicRecord
from broker.topic_store import TopicStore
from coordination.async_store import AsyncMetadataStore
from coordination.memory_store import InMemoryMetadataServer
from coordination.store import ConnectionLossError


async def test_every_member_ticks_once_per_interval(autojump_clock):
    clock = HousekeepingClock(interval_s=1.0)
    seen: dict[str, list[float]] = {"a": [], "b": []}
    ticks = {name: seen[name].append for name in seen}
    for tick in ticks.values():
        clock.join(tick)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(clock.run)
        await trio.sleep(3.5)
        clock.leave(ticks["a"])
        await trio.sleep(2.0)
        nursery.cancel_scope.cancel()
    assert len(seen["a"]) == 3
    assert len(seen["b"]) == 5
    assert len(clock) == 1


async def test_a_member_that_leaves_during_a_tick_is_not_ticked_again():
    clock = HousekeepingClock()
    ticked: list[int] = []
    members = []

    def member(index: int):
        def tick(now: float) -> None:
            ticked.append(index)
            if index == 0:
                clock.leave(members[-1])  # the last one, not reached yet
        return tick

    members.extend(member(index) for index in range(TICKS_BETWEEN_CHECKPOINTS * 2 + 1))
    for tick in members:
        clock.join(tick)
    await clock.tick_all(0.0)
    assert ticked == list(range(len(members) - 1))


async def test_one_members_failure_does_not_stop_the_others():
    clock = HousekeepingClock()
    ticked: list[str] = []

    def broken(now: float) -> None:
        raise RuntimeError("a bug in one partition")

    clock.join(broken)
    clock.join(lambda now: ticked.append("after"))
    await clock.tick_all(0.0)
    await clock.tick_all(1.0)
    assert ticked == ["after", "after"]
    assert clock.ticks_failed == 2


class _CountingStore(AsyncMetadataStore):
    def __init__(self, store) -> None:
        super().__init__(store)
        self.gets = 0

    async def get(self, path: str):
        self.gets += 1
        await trio.sleep(0.01)
        return await super().get(path)


async def counting_tenants() -> tuple[_CountingStore, TenantStore, TopicRecord]:
    """A tenant store over an in-memory ZooKeeper that counts its reads, and a topic's record."""
    store = _CountingStore(InMemoryMetadataServer().connect(30_000))
    tenants = TenantStore(TopicStore(store))
    await TopicStore(store).ensure_layout()
    await tenants.ensure_defaults()
    return store, tenants, TopicRecord(0, TopicPolicies())


async def test_a_namespace_checked_by_many_topics_at_once_is_read_once(autojump_clock):
    store, tenants, record = await counting_tenants()
    async with trio.open_nursery() as nursery:
        for index in range(100):
            nursery.start_soon(tenants.policies_in_effect, f"public/default/t-{index}", record)
    assert store.gets == 1
    await tenants.policies_in_effect("public/default/t-0", record)
    assert store.gets == 1  # still fresh
    await tenants.policies_in_effect("public/default/t-0", record, max_age_s=0)
    assert store.gets == 2  # asked for a read of now


def test_rates_are_over_the_samples_of_the_last_window():
    rates = CounterRates("out_per_s", "expired_per_s")
    assert rates.rates(0.0, (0, 0)) == {"out_per_s": 0.0, "expired_per_s": 0.0}  # nothing sampled yet
    for second in range(5):
        rates.sample(float(second), (second * 10, second))
    assert rates.rates(5.0, (50, 5)) == {"out_per_s": 10.0, "expired_per_s": 1.0}
    # From the oldest sample in the window (second 2) to now.
    assert rates.rates(12.0, (50, 5)) == {"out_per_s": 3.0, "expired_per_s": 0.3}
    assert rates.rates(30.0, (50, 5)) == {"out_per_s": 0.0, "expired_per_s": 0.0}  # every sample too old
    for second in range(100):
        rates.sample(float(second), (second, 0))
    assert len(rates.samples) == RATE_SAMPLES_MAX


async def test_a_failed_namespace_read_leaves_its_waiters_to_read_again(autojump_clock):
    store, tenants, record = await counting_tenants()
    failing = store.get

    async def fail_once(path: str):
        store.get = failing
        await trio.sleep(0.01)
        raise ConnectionLossError("ZooKeeper went away")

    store.get = fail_once
    outcomes: list[str] = []

    async def check(delay: float) -> None:
        await trio.sleep(delay)
        try:
            await tenants.policies_in_effect("t", record)
            outcomes.append("read")
        except ConnectionLossError:
            outcomes.append("failed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(check, 0.0)
        nursery.start_soon(check, 0.001)  # waits for the first one's read, which fails
    assert sorted(outcomes) == ["failed", "read"]
    assert store.gets == 1 and not tenants.topic_store.namespace_reads_in_flight


async def test_a_loads_read_of_its_topic_is_the_copy_the_policy_checks_start_from(autojump_clock):
    # The load reads the topic's record fresh, with a watch: the first
    # policy check then reads nothing, and a second load of the same topic
    # reads fresh again but keeps the watch set (kazoo would keep one per call).
    server = InMemoryMetadataServer()
    store = _CountingStore(server.connect(30_000))
    topics = TopicStore(store)
    await topics.ensure_layout()
    record = TopicRecord(0, TopicPolicies())
    await topics.create_topic("t", record)

    def watches() -> int:
        return sum(len(watches) for watches in server._data_watches.values())

    before = watches()
    assert (await topics.read_topic("t", watch=True))[0] == record
    gets = store.gets
    assert await topics.read_topic_watched("t") == record
    assert store.gets == gets
    assert (await topics.read_topic("t", watch=True))[0] == record
    assert store.gets == gets + 1 and watches() == before + 1
