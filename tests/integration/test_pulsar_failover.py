"""The official Pulsar client against two quire brokers: lookups that
answer Connect or Redirect to the broker serving a topic, and a
deduplicated producer that goes on, exactly once, across kill -9 of the
broker that owned its topic (its client resends what was not confirmed to
the broker that takes over)."""

from __future__ import annotations

import threading

import pulsar
import pytest
import trio

from broker.client import Client
from tests.integration.bookie_processes import bookies  # noqa: F401 (fixtures)
from tests.integration.broker_processes import brokers  # noqa: F401

pytestmark = pytest.mark.integration


async def start_cluster(bookies, brokers, broker_count: int = 2):
    for _ in range(3):
        await bookies.started()
    return [await brokers.started() for _ in range(broker_count)]


def pulsar_client(url: str) -> pulsar.Client:
    return pulsar.Client(url, operation_timeout_seconds=30, io_threads=1, message_listener_threads=1,
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))


async def test_lookups_lead_the_client_to_the_broker_that_serves_each_topic(zk_hosts, zk_root, bookies, brokers):
    running = await start_cluster(bookies, brokers)
    topics = [f"spread-{index}" for index in range(12)]

    def run() -> None:
        # Only the first broker is given: every lookup starts there, and
        # those of the topics it does not take are redirected.
        client = pulsar_client(running[0].pulsar_url)
        try:
            for topic in topics:
                producer = client.create_producer(f"persistent://public/default/{topic}", batching_enabled=False)
                producer.send(topic.encode())
                producer.close()
        finally:
            client.close()

    await trio.to_thread.run_sync(run)
    async with Client.connect(zk_hosts, zk_root) as client:
        owners = {topic: await client.lookup(topic) for topic in topics}
        assert set(owners.values()) == {broker.address for broker in running}, "both brokers took topics"
        for topic in topics:
            reader = await client.create_reader(topic)
            assert (await reader.receive()).data == topic.encode()


async def test_a_deduplicated_producer_is_exactly_once_across_kill_9_of_the_owner(zk_hosts, zk_root, bookies, brokers):
    running = await start_cluster(bookies, brokers)
    topic, total = "pulsar-payments", 3_000
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic(topic)
        owner_address = await client.lookup(topic)
    owner = next(broker for broker in running if broker.address == owner_address)
    service_url = "pulsar://" + ",".join(broker.pulsar_url.removeprefix("pulsar://") for broker in running)
    failures: list = []

    def produce() -> None:
        client = pulsar_client(service_url)
        try:
            # No send timeout: a message not confirmed is resent, after a
            # reconnection, until it is; the broker drops the copies it stored.
            producer = client.create_producer(f"persistent://public/default/{topic}", producer_name="billing-1",
                                              batching_enabled=True, batching_max_publish_delay_ms=2,
                                              send_timeout_millis=0, block_if_queue_full=True)
            done = threading.Semaphore(0)

            def sent(result, message_id) -> None:
                if result != pulsar.Result.Ok:
                    failures.append(result)
                done.release()

            for number in range(total):
                producer.send_async(b"%d" % number, sent)
                if number == total // 3:
                    owner.kill()
            for _ in range(total):
                assert done.acquire(timeout=120), "a send was never confirmed"
            producer.close()
        finally:
            client.close()

    await trio.to_thread.run_sync(produce)
    assert failures == []
    async with Client.connect(zk_hosts, zk_root) as client:
        reader = await client.create_reader(topic)
        received = []
        with trio.fail_after(60):
            while len(received) < total:
                received.append(int((await reader.receive()).data))
        assert received == list(range(total)), "every message once, in order"
        stats = (await client.topic_stats(topic))["partitions"][topic]
        assert stats["next_offset"] == total
