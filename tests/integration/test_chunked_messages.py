"""Chunked messages on real brokers (3 bookies, ZooKeeper): the official
Pulsar client's producer with chunking on cuts a large message into chunks
that the brokers store as they come; its consumers (and quire's) put them
together again, and acknowledging the message acknowledges every chunk."""

from __future__ import annotations

import random

import pulsar
import pytest
import trio

from broker.client import Client
from tests.integration.broker_processes import shared_cluster  # noqa: F401 (a fixture)
from tests.integration.test_pulsar_clients import full, in_thread, nothing_more, pulsar_client

pytestmark = pytest.mark.integration

MAX_MESSAGE_BYTES = 5 * 1024 * 1024  # the brokers' (Pulsar's default): a larger message goes in chunks of this


async def test_a_pulsar_producer_chunks_and_a_pulsar_consumer_puts_the_chunks_together(shared_cluster):
    topic = full("chunked-pulsar")

    def run() -> list[bytes]:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            consumer = client.subscribe(topic, "whole", initial_position=pulsar.InitialPosition.Earliest)
            producer = client.create_producer(topic, chunking_enabled=True, batching_enabled=False)
            payloads = [bytes([index]) * (MAX_MESSAGE_BYTES * 2 + index) for index in range(1, 3)] + [b"small"]
            for payload in payloads:
                producer.send(payload, partition_key="k")
            received = []
            for _ in payloads:
                message = consumer.receive(20_000)
                received.append(message.data())
                consumer.acknowledge(message)
            assert nothing_more(consumer)
            return received, payloads
        finally:
            client.close()

    received, payloads = await in_thread(run)
    assert received == payloads


async def test_quires_consumer_puts_a_pulsar_producers_chunks_together_and_acknowledges_them_all(shared_cluster):
    topic = "chunked-quire"

    def produce() -> list[bytes]:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            producer = client.create_producer(full(topic), chunking_enabled=True, batching_enabled=False,
                                              compression_type=pulsar.CompressionType.LZ4)
            # Chunks cut the compressed payload: random bytes stay large.
            payloads = [b"small-1", random.Random(7).randbytes(MAX_MESSAGE_BYTES * 2 + 100), b"small-2"]
            for payload in payloads:
                producer.send(payload, partition_key="k")
            return payloads
        finally:
            client.close()

    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        consumer = await client.subscribe(topic, "whole", initial_position="earliest")
        payloads = await in_thread(produce)
        received = []
        with trio.fail_after(30):
            for _ in payloads:
                message = await consumer.receive()
                received.append(message)
                await consumer.acknowledge(message)
        assert [message.data for message in received] == payloads
        assert received[1].key == "k" and len(received[1].chunk_offsets) >= 2
        stats = (await client.topic_stats(topic))["partitions"][topic]
        assert stats["next_offset"] == 2 + len(received[1].chunk_offsets) + 1
        assert stats["subscriptions"]["whole"]["backlog_messages"] == 0  # every chunk acknowledged


async def test_a_chunked_message_is_a_compacted_views_latest_value_whole(shared_cluster):
    topic = "chunked-compacted"
    from tests.integration.test_compaction import wait_for_compaction

    def run() -> list:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            producer = client.create_producer(full(topic), chunking_enabled=True, batching_enabled=False)
            large = random.Random(3).randbytes(MAX_MESSAGE_BYTES + 1_000)
            producer.send(b"old", partition_key="big")
            producer.send(large, partition_key="big")
            producer.send(b"small", partition_key="small")
            broker = shared_cluster.brokers[0]
            import requests
            assert requests.put(f"{broker.web_url}/admin/v2/persistent/public/default/{topic}/compaction",
                                timeout=30).status_code == 204
            wait_for_compaction(broker.web_url, topic)
            reader = client.create_reader(full(topic), pulsar.MessageId.earliest, is_read_compacted=True)
            view = []
            while True:
                try:
                    message = reader.read_next(2_000)
                except pulsar.Timeout:
                    break
                view.append((message.partition_key(), message.data()))
            return view, large
        finally:
            client.close()

    view, large = await in_thread(run)
    assert view == [("big", large), ("small", b"small")]


async def test_quires_producer_chunks_for_both_clients_and_resends_without_duplicates(shared_cluster):
    topic = "chunked-both"
    large = random.Random(5).randbytes(MAX_MESSAGE_BYTES * 2 + 12_345)
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        with pytest.raises(ValueError, match="chunking=True"):
            await (await client.create_producer(topic, "plain")).send(large)
        consumer = await client.subscribe(topic, "whole", initial_position="earliest")
        producer = await client.create_producer(topic, "chunker", chunking=True, codec="zstd")
        sent = await (await producer.send_async(large, key="big", properties={"kind": "blob"})).wait()
        assert sent.offset >= 2  # the last of its chunks
        # Sent again: its first chunks are stored again, its last is a duplicate.
        again = await producer.send(large, key="big", sequence_id=sent.sequence_id)
        assert again.is_duplicate
        await producer.send(b"after", key="small")
        with trio.fail_after(30):
            first, second = await consumer.receive(), await consumer.receive()
        assert (first.data, first.key, first.properties, first.offset) == (large, "big", {"kind": "blob"}, sent.offset)
        assert second.data == b"after"
        for message in (first, second):
            await consumer.acknowledge(message)

    def read_with_pulsar() -> list[bytes]:
        pulsar_side = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            reader = pulsar_side.create_reader(full(topic), pulsar.MessageId.earliest)
            return [reader.read_next(20_000).data() for _ in range(2)]
        finally:
            pulsar_side.close()

    assert await in_thread(read_with_pulsar) == [large, b"after"]
