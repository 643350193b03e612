"""The official Pulsar client (`pulsar-client`, its C++ core) against real
quire brokers (3 bookies, ZooKeeper): it connects, produces and consumes
through the broker's Pulsar listener, with the rules quire's own protocol
has."""

from __future__ import annotations

import pulsar
import pytest
import trio

from tests.integration.broker_processes import shared_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

TIMEOUT_MS = 20_000


def client_of(cluster) -> pulsar.Client:
    return pulsar.Client(cluster.brokers[0].pulsar_url, operation_timeout_seconds=20, io_threads=1,
                         message_listener_threads=1, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn))


async def test_a_pulsar_client_produces_and_consumes(shared_cluster):
    def run() -> list[bytes]:
        client = client_of(shared_cluster)
        try:
            consumer = client.subscribe("persistent://public/default/pulsar-smoke", "s", initial_position=pulsar.InitialPosition.Earliest)
            producer = client.create_producer("persistent://public/default/pulsar-smoke", batching_enabled=False)
            for index in range(10):
                producer.send(f"message-{index}".encode(), partition_key=f"k{index % 3}", properties={"n": str(index)})
            received = []
            for _ in range(10):
                message = consumer.receive(TIMEOUT_MS)
                received.append(message.data())
                consumer.acknowledge(message)
            return received
        finally:
            client.close()

    received = await trio.to_thread.run_sync(run)
    assert received == [f"message-{index}".encode() for index in range(10)]
