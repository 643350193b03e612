"""Delayed delivery on real brokers (3 bookies, ZooKeeper), through the
official Pulsar client's deliver_after: a Shared subscription gets each
message at its time, not before, the messages behind it at once, and every
message once, across the owning broker's kill -9 (another broker takes the
topic and finds the delayed messages again from the ledger)."""

from __future__ import annotations

import datetime
import time

import pulsar
import pytest
import requests
import trio

from broker.client import Client
from tests.integration.bookie_processes import bookies  # noqa: F401 (fixtures)
from tests.integration.broker_processes import brokers  # noqa: F401

pytestmark = pytest.mark.integration

DELAY_S = 6.0


async def test_delayed_messages_wait_for_their_time_across_a_broker_kill(zk_hosts, zk_root, bookies, brokers):
    for _ in range(3):
        await bookies.started()
    running = [await brokers.started(), await brokers.started()]
    topic = "persistent://public/default/delayed"
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("delayed")
        owner_address = await client.lookup("delayed")
    owner = next(broker for broker in running if broker.address == owner_address)
    service_url = ",".join(broker.pulsar_url.removeprefix("pulsar://") for broker in running)

    def run(kill) -> tuple[dict[str, float], float]:
        client = pulsar.Client(f"pulsar://{service_url}", operation_timeout_seconds=30, io_threads=1,
                               message_listener_threads=1, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        try:
            consumer = client.subscribe(topic, "work", consumer_type=pulsar.ConsumerType.Shared)
            producer = client.create_producer(topic, batching_enabled=False)
            sent_at = time.time()
            for number in range(5):
                producer.send(f"later-{number}".encode(), deliver_after=datetime.timedelta(seconds=DELAY_S))
            for number in range(5):
                producer.send(f"now-{number}".encode())
            received: dict[str, float] = {}
            while len(received) < 5:  # the messages behind the delayed ones, at once
                message = consumer.receive(20_000)
                received[message.data().decode()] = time.time()
                consumer.acknowledge(message)
            # The client groups acknowledgements: wait until the owner has
            # them (only the delayed messages left), then kill it.
            stats_url = f"{owner.web_url}/admin/v2/persistent/public/default/delayed/stats"
            deadline = time.monotonic() + 20
            while requests.get(stats_url, timeout=10).json()["subscriptions"]["work"]["msgBacklog"] != 5:
                assert time.monotonic() < deadline, "the acknowledgements never reached the broker"
                time.sleep(0.05)
            kill()  # the owner dies with the delayed messages held
            while len(received) < 10:
                message = consumer.receive(60_000)
                name = message.data().decode()
                assert name not in received, f"{name} delivered twice"
                received[name] = time.time()
                consumer.acknowledge(message)
            try:
                consumer.receive(2_000)
                raise AssertionError("a message came a second time")
            except pulsar.Timeout:
                pass
            return received, sent_at
        finally:
            client.close()

    received, sent_at = await trio.to_thread.run_sync(run, owner.kill)
    assert sorted(received) == sorted([f"later-{number}" for number in range(5)] + [f"now-{number}" for number in range(5)])
    for number in range(5):
        assert received[f"now-{number}"] - sent_at < DELAY_S, "a message behind the delayed ones waited for them"
        assert received[f"later-{number}"] - sent_at >= DELAY_S - 0.2, "a delayed message came early"


async def test_quires_client_sends_delayed_messages_and_an_exclusive_subscription_ignores_the_delay(
        zk_hosts, zk_root, bookies, brokers):
    for _ in range(3):
        await bookies.started()
    await brokers.started()
    async with Client.connect(zk_hosts, zk_root) as client:
        shared = await client.subscribe("delayed-quire", "work", "shared")
        exclusive = await client.subscribe("delayed-quire", "audit", "exclusive")
        producer = await client.create_producer("delayed-quire", "p", batching=True)
        sent_at = time.time()
        await producer.send(b"later", deliver_after_ms=3_000)
        await producer.send(b"now")
        with trio.fail_after(20):
            first, second = await shared.receive(), await shared.receive()
        assert (first.data, second.data) == (b"now", b"later")
        assert time.time() - sent_at >= 3.0 - 0.2
        with trio.fail_after(2):  # exclusive: in the order sent, at once
            assert [(await exclusive.receive()).data for _ in range(2)] == [b"later", b"now"]
