"""Durable cursors kept in ledgers of their own, as Pulsar's managed cursor
keeps them (real ZooKeeper, bookies and brokers): acknowledgements append
to the cursor's ledger and leave its ZooKeeper node alone; a broker killed
-9 hands over every acknowledged position, read back from the ledger; an
unload puts the position back into the node; deleting a subscription or a
topic deletes its cursor ledgers."""

from __future__ import annotations

import json

import pytest
import trio

from broker.client import Client
from broker.topic_records import cursor_path
from coordination.zk_store import KazooMetadataStore
from ledger_client import BookKeeper
from tests.integration.bookie_processes import bookies  # noqa: F401 (fixtures)
from tests.integration.broker_processes import brokers  # noqa: F401
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


def cursor_node(zk_hosts: str, zk_root: str, partition: str, subscription: str) -> tuple[dict, int] | None:
    with KazooMetadataStore.connect(zk_hosts, zk_root, session_timeout_ms=4_000) as store:
        path = cursor_path(partition, subscription)
        if store.exists(path) is None:
            return None
        data, stat = store.get(path)
        return json.loads(data), stat.version


async def cursor_ledgers(zk_hosts: str, zk_root: str) -> dict[int, dict]:
    """Every cursor ledger in the cluster: id -> custom metadata."""
    async with BookKeeper.connect(zk_hosts, zk_root) as bookkeeper:
        found = {}
        for ledger_id in await bookkeeper.list_ledgers():
            metadata = await bookkeeper.ledger_metadata(ledger_id)
            if "cursor" in metadata.custom_metadata:
                found[ledger_id] = metadata.custom_metadata
        return found


async def start_cluster(bookies, brokers):
    """Three bookies and a broker (returned)."""
    for _ in range(3):
        await bookies.started()
    return await brokers.started()


async def publish(client: Client, topic: str, count: int) -> None:
    producer = await client.create_producer(topic, batching=False)
    for receipt in [await producer.send_async(f"{number}".encode()) for number in range(count)]:
        await receipt.wait()
    await producer.close()


async def consume(consumer, count: int, *, acknowledge: bool = True) -> list[int]:
    """Receive `count` messages, acknowledging each once received (many at
    once: an acknowledgement returns once durable)."""
    numbers = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            while len(numbers) < count:
                message = await consumer.receive()
                numbers.append(int(message.data))
                if acknowledge:
                    nursery.start_soon(consumer.acknowledge, message)
    return numbers


async def test_acknowledgements_go_to_the_cursor_ledger_and_survive_a_killed_broker(zk_hosts, zk_root, bookies, brokers):
    first = await start_cluster(bookies, brokers)
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("orders")
        [(partition, _)] = await client.partition_names("orders", create=False)
        consumer = await client.subscribe("orders", "billing", initial_position="earliest", subscription_type="shared")
        _, created_version = cursor_node(zk_hosts, zk_root, partition, "billing")
        await publish(client, "orders", 2_000)
        assert sorted(await consume(consumer, 1_000)) == list(range(1_000))
        # Written to a ledger: the node names it, and moved a few versions
        # at most (making the ledger), not one per acknowledgement batch.
        node, version = cursor_node(zk_hosts, zk_root, partition, "billing")
        assert isinstance(node.get("ledger"), int) and version - created_version <= 2, (node, version)
        [ledger] = (await cursor_ledgers(zk_hosts, zk_root)).items()
        assert ledger == (node["ledger"], {"partition": partition.encode(), "cursor": b"billing"})
        stats = (await client.topic_stats("orders"))["partitions"][partition]
        assert stats["subscriptions"]["billing"]["backlog_messages"] == 1_000
        assert stats["subscriptions"]["billing"]["cursor_ledger"] == node["ledger"]
        await consumer.close()
    first.kill()  # -9: the position is only in the ledger
    await brokers.started()
    async with Client.connect(zk_hosts, zk_root) as client:
        consumer = await client.subscribe("orders", "billing", subscription_type="shared")
        assert sorted(await consume(consumer, 1_000)) == list(range(1_000, 2_000))
        with trio.move_on_after(1):
            extra = await consumer.receive()
            pytest.fail(f"message {extra.data!r} delivered again after it was acknowledged")
        # The killed broker's ledger was recovered, then retired and deleted.
        assert node["ledger"] not in await cursor_ledgers(zk_hosts, zk_root)
        await consumer.close()


async def test_an_unload_puts_the_position_into_the_node_and_deletes_the_ledger(zk_hosts, zk_root, bookies, brokers):
    await start_cluster(bookies, brokers)
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("audit")
        [(partition, _)] = await client.partition_names("audit", create=False)
        consumer = await client.subscribe("audit", "reader", initial_position="earliest")
        await publish(client, "audit", 300)
        await consume(consumer, 200)
        assert cursor_node(zk_hosts, zk_root, partition, "reader")[0].get("ledger") is not None
        await client.unload("audit")

        async def unloaded() -> bool:
            node, _ = cursor_node(zk_hosts, zk_root, partition, "reader")
            return "ledger" not in node and not await cursor_ledgers(zk_hosts, zk_root)

        await wait_until_async(unloaded, deadline_s=30, what="the position back in the node, the ledger deleted")
        assert cursor_node(zk_hosts, zk_root, partition, "reader")[0]["mark_delete"] == 199
        # The consumer goes on through the next load from message 200.
        assert await consume(consumer, 100) == list(range(200, 300))
        await consumer.close()


async def test_deleting_a_subscription_or_a_topic_deletes_its_cursor_ledgers(zk_hosts, zk_root, bookies, brokers):
    await start_cluster(bookies, brokers)
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("events", partitions=2)
        consumers = [await client.subscribe("events", name, initial_position="earliest") for name in ("a", "b")]
        await publish(client, "events", 100)
        for consumer in consumers:
            await consume(consumer, 100)
        assert len(await cursor_ledgers(zk_hosts, zk_root)) == 4  # two subscriptions on two partitions
        await consumers[0].close()
        await client.delete_subscription("events", "a")
        assert {metadata["cursor"] for metadata in (await cursor_ledgers(zk_hosts, zk_root)).values()} == {b"b"}
        await consumers[1].close()
        await client.delete_topic("events")
        assert await cursor_ledgers(zk_hosts, zk_root) == {}
