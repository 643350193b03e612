"""The docker-compose cluster as users run it: the image built offline,
every service healthy, clients inside the compose network and on the host,
a bookie and a broker container killed under load, and the whole cluster
restarted, with nothing acknowledged lost or stored twice.

The tests share one compose cluster (tests/integration/compose_cluster.py)
and run in file order; each uses topics of its own."""

from __future__ import annotations

import collections
import json

import pytest
import trio

from broker.client import Client
from tests.integration.compose_cluster import compose, docker_engine, quire_image  # noqa: F401 (fixtures)
from tests.support import wait_until

pytestmark = pytest.mark.integration

INSIDE = ("--zk", "zookeeper:2181", "--root", "/quire")


def test_every_service_is_healthy_and_the_image_is_lean(compose):
    compose.wait_healthy()
    # Runs as a user, and carries neither build tools nor test dependencies nor Spark.
    probe = compose.compose("exec", "-T", "broker-1", "sh", "-c",
                            "id -u; command -v gcc pip pytest || true; python3 -c 'import pyspark' 2>&1 | tail -1")
    lines = probe.stdout.split("\n")
    assert lines[0] != "0", probe.stdout
    assert "gcc" not in probe.stdout and "pytest" not in probe.stdout and "/pip" not in probe.stdout, probe.stdout
    assert "No module named 'pyspark'" in probe.stdout, probe.stdout


def test_produce_and_consume_inside_the_network_and_from_the_host(compose):
    produced = compose.quire_inside("broker-1", "produce", "inside-out", "--service-url", "broker-1:6700", "--count", "200",
                                    "--size", "64", *INSIDE)
    assert json.loads(produced.stdout)["sent"] == 200
    consumed = compose.quire_on_host("consume", "inside-out", "--service-url", compose.broker_url(2), "--subscription", "host",
                                     "--initial-position", "earliest", "--count", "200")
    assert consumed.returncode == 0 and "received 200 messages" in consumed.stderr, consumed.stderr

    produced = compose.quire_on_host("produce", "outside-in", "--service-url", compose.broker_url(1), "--count", "150",
                                     "--size", "64")
    assert produced.returncode == 0, produced.stderr
    consumed = compose.quire_inside("broker-2", "consume", "outside-in", "--service-url", "broker-2:6701", "--subscription", "inside",
                                    "--initial-position", "earliest", "--count", "150", *INSIDE)
    assert "received 150 messages" in consumed.stderr, consumed.stderr
    # ZooKeeper published on the host, and the external listener named.
    listed = compose.quire_on_host("topic", "ls", "--zk", f"localhost:{compose.ports['QUIRE_ZK_PORT']}",
                                   "--listener-name", "external")
    assert listed.returncode == 0 and "outside-in" in listed.stdout and "inside-out" in listed.stdout, listed


def test_a_pulsar_client_on_the_host_names_the_external_listener(compose):
    import pulsar

    client = pulsar.Client(compose.pulsar_url(), listener_name="external", operation_timeout_seconds=60,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        topic = "persistent://public/default/from-pulsar"
        consumer = client.subscribe(topic, "host", initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(topic, compression_type=pulsar.CompressionType.ZSTD)
        for number in range(100):
            producer.send_async(b"%d" % number, None, partition_key=f"k{number % 4}")
        producer.flush()
        received = []
        for _ in range(100):
            message = consumer.receive(60_000)
            received.append(int(message.data()))
            consumer.acknowledge(message)
        assert received == list(range(100))
    finally:
        client.close()
    consumed = compose.quire_inside("broker-2", "consume", "from-pulsar", "--service-url", "broker-2:6701", "--subscription",
                                    "inside", "--initial-position", "earliest", "--count", "100", *INSIDE)
    assert "received 100 messages" in consumed.stderr, consumed.stderr


def test_the_rest_admin_api_answers_from_the_host(compose):
    import requests

    web = f"http://localhost:{compose.ports['QUIRE_BROKER_1_WEB_PORT']}"
    assert requests.get(f"{web}/admin/v2/clusters", timeout=60).json() == ["standalone"]
    assert sorted(requests.get(f"{web}/admin/v2/brokers/standalone", timeout=60).json()) == ["broker-1:8080", "broker-2:8081"]
    created = requests.put(f"{web}/admin/v2/persistent/public/default/over-rest/partitions", json=2, timeout=60)
    assert created.status_code == 204, created.text
    # A lookup names the listener a client on the host dials.
    lookup = requests.get(f"{web}/lookup/v2/topic/persistent/public/default/over-rest-partition-0",
                          params={"listenerName": "external"}, timeout=60).json()
    published = {compose.ports[f"QUIRE_BROKER_{number}_PULSAR_PORT"] for number in (1, 2)}
    assert lookup["brokerUrl"] in {f"pulsar://localhost:{port}" for port in published}, lookup


async def produce_while(compose, topic: str, producer_id: str, fault, *, before: int, after: int) -> dict[bytes, int]:
    """A deduplicating producer on the host sends `before` messages, then
    `fault()` runs (in a thread) while it sends `after` more; returns every
    acknowledged message with the number of times a subscription from the
    earliest offset received it."""
    acknowledged: list[bytes] = []
    async with Client.connect(service_url=compose.broker_url()) as client:
        await client.create_topic(topic, partitions=2)
        producer = await client.create_producer(topic, producer_id=producer_id, batching=True)

        async def send(first: int, count: int) -> None:
            futures = []
            for number in range(first, first + count):
                data = f"{producer_id}-{number}".encode()
                futures.append((data, await producer.send_async(data, key=f"k{number % 16}")))
                if number % 50 == 0:
                    await trio.sleep(0.01)  # a steady stream, not one burst
            for data, future in futures:
                await future.wait()
                acknowledged.append(data)

        await send(0, before)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, before, after)
            await trio.to_thread.run_sync(fault)
        await producer.close()

        seen: collections.Counter[bytes] = collections.Counter()
        consumer = await client.subscribe(topic, "audit", initial_position="earliest")
        with trio.fail_after(180):
            while len(seen) < len(acknowledged):
                message = await consumer.receive()
                seen[message.data] += 1
                await consumer.acknowledge(message)
        with trio.move_on_after(2):
            while True:
                message = await consumer.receive()
                seen[message.data] += 1
    return {data: seen[data] for data in set(acknowledged) | set(seen)}


async def test_a_bookie_killed_while_producing_loses_nothing_and_replication_is_restored(compose):
    def kill_bookie() -> None:
        compose.compose("kill", "bookie-3")
        wait_until(lambda: compose.health("bookie-3") != "healthy", deadline_s=30, what="bookie-3 down")

    received = await produce_while(compose, "bookie-lost", "bookie-lost", kill_bookie, before=500, after=3_000)
    assert len(received) == 3_500 and set(received.values()) == {1}, collections.Counter(received.values())
    assert compose.health("bookie-3") != "healthy"  # every write after the kill went to the two others

    compose.compose("start", "bookie-3")
    compose.wait_healthy(["bookie-3"])
    wait_until(lambda: compose.under_replicated() == [], deadline_s=180, what="no under-replicated ledgers", poll_s=2)
    # Every ledger of the topic is whole, read through the ledger client inside the network.
    stats = json.loads(compose.quire_inside("broker-1", "topic", "stats", "bookie-lost", *INSIDE).stdout)
    ledgers = [ledger for partition in stats["partitions"].values() for ledger in partition["ledgers"] if ledger["entries"]]
    assert ledgers
    for ledger in ledgers:
        read = compose.quire_inside("bookie-1", "ledger", "read", str(ledger["ledger_id"]), *INSIDE)
        assert read.stdout.count("\n") >= ledger["entries"], (ledger, read.stdout[-500:])


async def test_a_broker_killed_while_producing_hands_its_topics_over_without_duplicates(compose):
    def kill_broker() -> None:
        compose.compose("kill", "broker-1")

    try:
        received = await produce_while(compose, "broker-lost", "broker-lost", kill_broker, before=500, after=3_000)
    finally:
        compose.compose("start", "broker-1")
    assert len(received) == 3_500 and set(received.values()) == {1}, collections.Counter(received.values())
    compose.wait_healthy(["broker-1"])


def test_the_whole_cluster_restarted_keeps_every_message(compose):
    produced = compose.quire_on_host("produce", "kept", "--service-url", compose.broker_url(), "--count", "400", "--size", "100")
    assert produced.returncode == 0, produced.stderr
    compose.compose("restart", "--timeout", "20")
    compose.wait_healthy()
    for topic, count in (("kept", 400), ("inside-out", 200), ("bookie-lost", 3_500)):
        consumed = compose.quire_on_host("consume", topic, "--service-url", compose.broker_url(), "--subscription", "after-restart",
                                         "--initial-position", "earliest", "--count", str(count), timeout_s=300)
        assert consumed.returncode == 0 and f"received {count} messages" in consumed.stderr, (topic, consumed.stderr[-2000:])
