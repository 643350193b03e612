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
from tests.support import wait_until, wait_until_async
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
            # them (only the delayed messages left) and has made them
            # durable (one taken and not yet written is delivered again
            # after a crash: at-least-once), then kill it.
            stats_url = f"{owner.web_url}/admin/v2/persistent/public/default/delayed/stats"
            internal_url = f"{owner.web_url}/admin/v2/persistent/public/default/delayed/internalStats"
            wait_until(lambda: requests.get(stats_url, timeout=10).json()["subscriptions"]["work"]["msgBacklog"] == 5 and
                       requests.get(internal_url, timeout=10).json()["cursors"]["work"]["unwrittenChanges"] == 0,
                       deadline_s=20, what="the acknowledgements durable at the broker", poll_s=0.05)
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


async def test_delayed_messages_past_the_memory_bound_come_in_time_order_across_a_broker_kill(
        zk_hosts, zk_root, bookies, brokers):
    # Brokers that hold 16 delayed messages per subscription in memory: the
    # other 184 are spilled in runs. 100 come due 3-5 s after sending, the
    # rest 11-13 s; the owner is killed between the two (the next owner
    # builds its index again from the backlog, spilling again).
    for _ in range(3):
        await bookies.started()
    running = [await brokers.started("--delayed-memory-messages", "16") for _ in range(2)]
    count, first_wave = 200, 100
    async with Client.connect(zk_hosts, zk_root) as client:
        consumer = await client.subscribe("delayed-spilled", "work", "shared")
        owner_address = await client.lookup("delayed-spilled")
        owner = next(broker for broker in running if broker.address == owner_address)
        producer = await client.create_producer("delayed-spilled", "p")
        now_ms = int(time.time() * 1000)
        due = {}
        for number in range(count):
            # Sent out of time order: each wave's times are interleaved.
            wave_start = 3_000 if number < first_wave else 11_000
            due[number] = now_ms + wave_start + (number * 7919) % 2_000
            await producer.send_async(str(number).encode(), deliver_at_ms=due[number])
        await producer.flush()

        async def delayed_messages() -> int:
            stats = (await client.topic_stats("delayed-spilled"))["partitions"]["delayed-spilled"]
            return stats["subscriptions"]["work"]["delayed_messages"]

        async def all_held() -> bool:
            return await delayed_messages() == count

        await wait_until_async(all_held, deadline_s=10, what="every message to be held", poll_s=0.05)
        assert time.time() * 1000 < min(due.values()), "the messages were sent too slowly for this test's timing"
        received: dict[int, float] = {}
        order: list[int] = []

        async def receive(how_many: int) -> None:
            with trio.fail_after(60):
                for _ in range(how_many):
                    message = await consumer.receive()
                    number = int(message.data)
                    assert number not in received, f"message {number} delivered twice"
                    received[number] = time.time() * 1000
                    order.append(number)
                    await consumer.acknowledge(message)

        await receive(first_wave)
        assert sorted(received) == list(range(first_wave))
        for number, at_ms in received.items():
            assert at_ms >= due[number] - 200, f"message {number} came {due[number] - at_ms:.0f} ms early"
            assert at_ms - due[number] < 1_500, f"message {number} came {at_ms - due[number]:.0f} ms late"
        # In time order (out of the memory and the runs alike): no message
        # came after one due more than 100 ms later.
        for earlier, later in zip(order, order[1:]):
            assert due[later] >= due[earlier] - 100, f"message {later} (due {due[later]}) came after {earlier} (due {due[earlier]})"

        async def acknowledgements_durable() -> bool:
            stats = (await client.topic_stats("delayed-spilled"))["partitions"]["delayed-spilled"]
            return stats["subscriptions"]["work"]["backlog_messages"] == count - first_wave

        await wait_until_async(acknowledgements_durable, deadline_s=20, what="the acknowledgements to be durable", poll_s=0.1)
        owner.kill()  # with 100 delayed messages held, most of them spilled
        await receive(count - first_wave)
    for number in range(first_wave, count):
        assert received[number] >= due[number] - 200, f"message {number} came {due[number] - received[number]:.0f} ms early"
        # Late by at most the takeover (the killed broker's session expiring, the topic loading again).
        assert received[number] - due[number] < 10_000, f"message {number} came {received[number] - due[number]:.0f} ms late"
