"""Redelivery counts and dead-letter topics on real brokers (3 bookies,
ZooKeeper): the count a consumer sees grows by one with each negative
acknowledgement, ack timeout or consumer that went away, so that the
official Pulsar client's dead_letter_policy, and quire's own, move a
message to `<topic>-<subscription>-DLQ` after its last allowed delivery."""

from __future__ import annotations

import uuid

import pulsar
import pytest
import trio

from broker.client import Client, DeadLetterPolicy
from tests.integration.broker_processes import shared_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

RECEIVE_TIMEOUT_MS = 20_000


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def test_the_pulsar_clients_dead_letter_policy_moves_a_message_after_its_nacks(shared_cluster):
    topic = f"persistent://public/default/{unique('dlq')}"

    def run() -> tuple[list[int], bytes, dict]:
        client = pulsar.Client(shared_cluster.brokers[0].pulsar_url, operation_timeout_seconds=20, io_threads=1,
                               message_listener_threads=1, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn))
        try:
            dead = client.subscribe(f"{topic}-work-DLQ", "dead", initial_position=pulsar.InitialPosition.Earliest)
            consumer = client.subscribe(topic, "work", consumer_type=pulsar.ConsumerType.Shared,
                                        negative_ack_redelivery_delay_ms=100,
                                        dead_letter_policy=pulsar.ConsumerDeadLetterPolicy(max_redeliver_count=3))
            client.create_producer(topic).send(b"poison", properties={"kind": "bad"})
            counts = []
            for _ in range(4):
                message = consumer.receive(RECEIVE_TIMEOUT_MS)
                counts.append(message.redelivery_count())
                consumer.negative_acknowledge(message)
            moved = dead.receive(RECEIVE_TIMEOUT_MS)
            dead.acknowledge(moved)
            try:
                consumer.receive(1_500)
                raise AssertionError("the message came back after it went to the dead-letter topic")
            except pulsar.Timeout:
                pass
            return counts, moved.data(), moved.properties()
        finally:
            client.close()

    counts, data, properties = await trio.to_thread.run_sync(run)
    assert counts == [0, 1, 2, 3]
    assert data == b"poison" and properties["kind"] == "bad"


async def test_quires_client_sends_to_the_dead_letter_topic_and_counts_survive_a_consumer_going_away(shared_cluster):
    topic = unique("dlq-quire")
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        producer = await client.create_producer(topic)
        await producer.send(b"poison", key="k", properties={"kind": "bad"})

        # A consumer that receives it and goes away without acknowledging counts as a delivery.
        first = await client.subscribe(topic, "work", "shared", initial_position="earliest")
        with trio.fail_after(20):
            assert (await first.receive()).redelivery_count == 0
        await first.close()

        consumer = await client.subscribe(topic, "work", "shared", negative_ack_delay_ms=100, ack_timeout_ms=500,
                                          dead_letter_policy=DeadLetterPolicy(max_redeliver_count=3))
        counts = []
        with trio.fail_after(30):
            for round_ in range(3):
                message = await consumer.receive()
                counts.append(message.redelivery_count)
                if round_ == 1:
                    continue  # not acknowledged: the ack timeout delivers it again
                consumer.negative_acknowledge(message)
        assert counts == [1, 2, 3]  # the count after each nack, ack timeout and consumer gone

        dead = await client.subscribe(f"{topic}-work-DLQ", "dead", initial_position="earliest")
        with trio.fail_after(20):
            moved = await dead.receive()
        assert moved.data == b"poison" and moved.key == "k" and moved.properties["kind"] == "bad"
        assert moved.properties["REAL_TOPIC"] == f"persistent://public/default/{topic}"
        with trio.move_on_after(1.5) as quiet:
            await consumer.receive()
        assert quiet.cancelled_caught, "the message came back after it went to the dead-letter topic"
        stats = await client.topic_stats(topic)
        assert stats["partitions"][topic]["subscriptions"]["work"]["backlog_messages"] == 0
