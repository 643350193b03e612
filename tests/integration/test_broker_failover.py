"""Brokers fail and hand partitions over; nothing acknowledged is lost or
duplicated (real ZooKeeper, bookies and brokers)."""

from __future__ import annotations

import collections

import pytest
import trio

from broker.client import Client
from broker.errors import BrokerError
from tests.integration.broker_processes import brokers  # noqa: F401 (fixtures)
from tests.integration.bookie_processes import bookies  # noqa: F401

pytestmark = pytest.mark.integration


async def start_cluster(bookies, brokers, *, broker_count: int = 2):
    for _ in range(3):
        await bookies.started()
    return [await brokers.started() for _ in range(broker_count)]


def owner_of(running, address: str):
    return next(process for process in running if process.address == address)


async def receive_all(consumer, count: int, *, deadline_s: float, ack: bool = True) -> list:
    """Receive `count` messages, acknowledging each (concurrently: an
    acknowledgement returns once durable, and many share one cursor write)."""
    messages = []
    with trio.fail_after(deadline_s):
        async with trio.open_nursery() as nursery:
            while len(messages) < count:
                message = await consumer.receive()
                messages.append(message)
                if ack:
                    nursery.start_soon(consumer.acknowledge, message)
    return messages


async def test_killing_the_owner_during_deduplicated_publishing_loses_and_duplicates_nothing(zk_hosts, zk_root, bookies, brokers):
    # A producer with a producer id sends 10,000 numbered messages with
    # explicit sequence ids, retrying any send that does not complete; the
    # broker owning the partition is killed -9 a third of the way through.
    # Afterwards a subscription sees every message exactly once, in order per key.
    running = await start_cluster(bookies, brokers)
    total, keys = 10_000, 20
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("payments")
        consumer = await client.subscribe("payments", "audit", initial_position="earliest")
        producer = await client.create_producer("payments", producer_id="billing-1", batching=True, batch_delay_ms=2)
        owner = owner_of(running, await client.lookup("payments"))
        acknowledged: dict[int, object] = {}
        retries = 0

        async def send(number: int) -> None:
            nonlocal retries
            while True:
                try:
                    with trio.fail_after(20):
                        future = await producer.send_async(f"{number}".encode(), key=f"key-{number % keys}", sequence_id=number)
                        acknowledged[number] = (await future.wait()).message_id
                        return
                except (trio.TooSlowError, BrokerError):
                    retries += 1

        async with trio.open_nursery() as nursery:
            window = trio.Semaphore(500)
            for number in range(total):
                if number == total // 3:
                    owner.kill()
                await window.acquire()

                async def one(number=number):
                    try:
                        await send(number)
                    finally:
                        window.release()

                nursery.start_soon(one)
        assert len(acknowledged) == total
        # The producer learned nothing twice: a duplicate answer only for resends.
        messages = await receive_all(consumer, total, deadline_s=60)
        numbers = [int(message.data) for message in messages]
        assert sorted(numbers) == list(range(total)), "every message exactly once"
        with trio.move_on_after(2):
            extra = await consumer.receive()
            pytest.fail(f"a message came twice: {extra}")
        by_key = collections.defaultdict(list)
        for message in messages:
            by_key[message.key].append(int(message.data))
        for key, sequence in by_key.items():
            assert sequence == sorted(sequence), f"messages of {key} out of order"
        offsets = [message.offset for message in messages]
        assert offsets == sorted(offsets) and offsets == list(range(offsets[0], offsets[0] + total)), "offsets contiguous"
        # The partition moved to the surviving broker.
        assert await client.lookup("payments") != owner.address


async def test_a_subscription_resumes_on_another_broker_with_exactly_the_unacknowledged_messages(zk_hosts, zk_root, bookies, brokers):
    # A consumer acknowledges a random half of 2,000 messages one by one;
    # the owning broker is killed; the subscription resumes on the other
    # broker and receives exactly the messages that were not acknowledged.
    running = await start_cluster(bookies, brokers)
    total = 2_000
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("events")
        consumer = await client.subscribe("events", "half", subscription_type="shared", initial_position="earliest")
        producer = await client.create_producer("events", batching=True)
        futures = [await producer.send_async(f"{number}".encode()) for number in range(total)]
        for future in futures:
            await future.wait()
        import random

        rng = random.Random(7)
        messages = await receive_all(consumer, total, deadline_s=30, ack=False)
        acknowledged = {int(message.data) for message in messages if rng.random() < 0.5}
        async with trio.open_nursery() as nursery:
            for message in messages:
                if int(message.data) in acknowledged:
                    nursery.start_soon(consumer.acknowledge, message)
        await consumer.close()
        owner = owner_of(running, await client.lookup("events"))
        owner.kill()
        resumed = await client.subscribe("events", "half", subscription_type="shared")
        expected = set(range(total)) - acknowledged
        again = await receive_all(resumed, len(expected), deadline_s=60)
        assert {int(message.data) for message in again} == expected
        with trio.move_on_after(2):
            extra = await resumed.receive()
            pytest.fail(f"an acknowledged or repeated message came back: {extra.data!r}")


async def test_what_the_application_acknowledged_while_its_broker_was_down_is_not_given_again(zk_hosts, zk_root, bookies, brokers):
    # A consumer holds 600 messages it has received; its broker is killed;
    # while no broker serves the partition the application acknowledges a
    # random half (the acknowledgements wait for the reconnection). The new
    # owner delivers again everything not acknowledged durably: the client
    # gives the application exactly the other half, once.
    running = await start_cluster(bookies, brokers)
    total = 600
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("orders")
        consumer = await client.subscribe("orders", "billing", initial_position="earliest")
        producer = await client.create_producer("orders", batching=True)
        futures = [await producer.send_async(f"{number}".encode()) for number in range(total)]
        for future in futures:
            await future.wait()
        held = await receive_all(consumer, total, deadline_s=30, ack=False)
        owner_of(running, await client.lookup("orders")).kill()
        import random

        rng = random.Random(11)
        acknowledged = [message for message in held if rng.random() < 0.5]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for message in acknowledged:
                    nursery.start_soon(consumer.acknowledge, message)
                again = await receive_all(consumer, total - len(acknowledged), deadline_s=60, ack=False)
        assert sorted(int(message.data) for message in again) == sorted(
            set(range(total)) - {int(message.data) for message in acknowledged})
        with trio.move_on_after(2):
            extra = await consumer.receive()
            pytest.fail(f"a message came twice: {extra.data!r} at offset {extra.offset}")


async def test_two_brokers_claiming_one_partition_only_one_can_append(zk_hosts, zk_root, bookies, brokers):
    # Broker A serves the partition. Its ownership node is removed behind its
    # back (as if its session had expired while it still ran), and broker B
    # is made to take the partition. B fences A's ledger while opening it:
    # A's next append fails, A gives the partition up, and its producer ends
    # up on B. Nothing acknowledged is lost; nothing is stored twice.
    from coordination.async_store import AsyncMetadataStore, connect_zookeeper
    from broker.topic_records import owner_path
    from broker.protocol import Lookup

    first, second = await start_cluster(bookies, brokers)
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("contested")
        producer = await client.create_producer("contested", producer_id="writer")
        owner_address = await client.lookup("contested")
        other = second if owner_address == first.address else first
        sent = [await producer.send(f"before-{number}".encode()) for number in range(50)]
        async with AsyncMetadataStore(await connect_zookeeper(zk_hosts, zk_root)) as store:
            await store.delete(owner_path("contested"))
        # B takes it with authority, as a redirected lookup would.
        connection = await client.connection(other.address)
        body = await connection.request(lambda request_id: Lookup(request_id, "contested", True))
        assert body["address"] == other.address and not body["redirect"]
        after = [await producer.send(f"after-{number}".encode()) for number in range(50)]
        assert await client.lookup("contested") == other.address
        ledgers = {message_id.ledger_id for message_id in sent} | {message_id.ledger_id for message_id in after}
        assert len(ledgers) >= 2, "the new owner writes its own ledger"
        reader = await client.create_reader("contested", start="earliest")
        messages = await receive_all(reader, 100, deadline_s=30, ack=False)
        assert [message.data.decode() for message in messages] == [f"before-{n}" for n in range(50)] + [f"after-{n}" for n in range(50)]
        stats = await client.topic_stats("contested")
        assert stats["partitions"]["contested"]["next_offset"] == 100
