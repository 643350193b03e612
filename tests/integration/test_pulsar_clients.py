"""The official Pulsar client (`pulsar-client`, its C++ core) against real
quire brokers (3 bookies, ZooKeeper): it connects, produces and consumes
through the brokers' Pulsar listeners, with quire's rules (one entry format,
deduplication, subscriptions) shared with quire's own protocol and client.
Each test runs the (blocking) Pulsar client in a worker thread."""

from __future__ import annotations

import collections
import threading
import time

import pulsar
import pytest
import trio

from broker.client import Client
from tests.integration.broker_processes import shared_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

RECEIVE_TIMEOUT_MS = 20_000
CODECS = {
    "none": pulsar.CompressionType.NONE,
    "lz4": pulsar.CompressionType.LZ4,
    "zlib": pulsar.CompressionType.ZLib,
    "zstd": pulsar.CompressionType.ZSTD,
    "snappy": pulsar.CompressionType.SNAPPY,
}


def pulsar_client(url: str) -> pulsar.Client:
    return pulsar.Client(url, operation_timeout_seconds=20, io_threads=1, message_listener_threads=1,
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn))


def full(topic: str) -> str:
    return f"persistent://public/default/{topic}"


async def in_thread(function, *args):
    return await trio.to_thread.run_sync(function, *args)


def receive_all(consumer, count: int, *, acknowledge: bool = True) -> list:
    messages = []
    for _ in range(count):
        message = consumer.receive(RECEIVE_TIMEOUT_MS)
        messages.append(message)
        if acknowledge:
            consumer.acknowledge(message)
    return messages


def nothing_more(consumer, wait_ms: int = 500) -> bool:
    try:
        consumer.receive(wait_ms)
    except pulsar.Timeout:
        return True
    return False


def receive_from_each(consumers: list, count: int, deadline_s: float) -> list[list]:
    """Receives (and acknowledges) from several consumers until `count`
    messages have come in all told or the deadline passes; each pass drains
    every consumer, since one of them may hold most of what is left.
    Returns each consumer's messages."""
    received: list[list] = [[] for _ in consumers]
    deadline = time.monotonic() + deadline_s
    while sum(map(len, received)) < count and time.monotonic() < deadline:
        for messages, consumer in zip(received, consumers):
            while True:
                try:
                    message = consumer.receive(50)
                except pulsar.Timeout:
                    break
                messages.append(message)
                consumer.acknowledge(message)
    return received


@pytest.mark.parametrize("codec", list(CODECS))
async def test_batches_of_each_codec_reach_shared_consumers_exactly_once(shared_cluster, codec):
    topic = full(f"pulsar-batches-{codec}")
    count = 2_000

    def run() -> list[bytes]:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            consumers = [client.subscribe(topic, "shared", consumer_type=pulsar.ConsumerType.Shared,
                                          initial_position=pulsar.InitialPosition.Earliest) for _ in range(2)]
            producer = client.create_producer(topic, batching_enabled=True, batching_max_messages=100,
                                              batching_max_publish_delay_ms=5, compression_type=CODECS[codec],
                                              block_if_queue_full=True)
            for index in range(count):
                producer.send_async(f"{codec}-{index}".encode() * 10, None, partition_key=f"k{index % 7}")
            producer.flush()
            received = [message.data() for messages in receive_from_each(consumers, count, 60) for message in messages]
            assert all(nothing_more(consumer, 300) for consumer in consumers)
            return received
        finally:
            client.close()

    received = await in_thread(run)
    assert sorted(received) == sorted(f"{codec}-{index}".encode() * 10 for index in range(count))


async def test_a_reader_from_earliest_reads_everything_in_order(shared_cluster):
    topic = full("pulsar-reader")

    def run() -> list[bytes]:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            producer = client.create_producer(topic, batching_enabled=True, batching_max_publish_delay_ms=2, block_if_queue_full=True)
            for index in range(500):
                producer.send_async(b"%d" % index, None)
            producer.flush()
            reader = client.create_reader(topic, pulsar.MessageId.earliest)
            data = [reader.read_next(RECEIVE_TIMEOUT_MS).data() for _ in range(500)]
            assert not reader.has_message_available()
            return data
        finally:
            client.close()

    assert await in_thread(run) == [b"%d" % index for index in range(500)]


async def test_keys_properties_event_times_and_sequence_ids_cross_between_protocols(shared_cluster):
    topic = "pulsar-cross"
    cluster = shared_cluster
    # Pulsar's client produces; quire's client consumes.
    def produce_with_pulsar() -> None:
        client = pulsar_client(cluster.brokers[0].pulsar_url)
        try:
            producer = client.create_producer(full(topic), producer_name="pulsar-side", batching_enabled=True,
                                              batching_max_publish_delay_ms=2, compression_type=pulsar.CompressionType.LZ4)
            for index in range(20):
                producer.send_async(b"from-pulsar-%d" % index, None, partition_key=f"key-{index % 3}",
                                    properties={"index": str(index)}, event_timestamp=1_700_000_000_000 + index,
                                    sequence_id=100 + index)
            producer.flush()
        finally:
            client.close()

    await in_thread(produce_with_pulsar)
    async with Client.connect(cluster.zk_hosts, cluster.root) as client:
        consumer = await client.subscribe(full(topic), "quire-side", initial_position="earliest")
        messages = [await consumer.receive() for _ in range(20)]
        assert [message.data for message in messages] == [b"from-pulsar-%d" % index for index in range(20)]
        assert [message.key for message in messages] == [f"key-{index % 3}" for index in range(20)]
        assert [message.properties for message in messages] == [{"index": str(index)} for index in range(20)]
        assert [message.event_time_ms for message in messages] == [1_700_000_000_000 + index for index in range(20)]
        assert [message.sequence_id for message in messages] == [100 + index for index in range(20)]
        assert {message.producer_id for message in messages} == {"pulsar-side"}
        for message in messages:
            await consumer.acknowledge(message)

        # quire's client produces, as the same producer (one deduplication
        # state): it learns the last sequence id the Pulsar client stored.
        producer = await client.create_producer(topic, "pulsar-side", batching=True, codec="zstd")
        assert producer.last_sequence_id == 119
        for index in range(10):
            await producer.send_async(b"from-quire-%d" % index, key="quire-key", properties={"side": "quire"},
                                      event_time_ms=1_800_000_000_000 + index)
        await producer.flush()

    def consume_with_pulsar() -> list:
        client = pulsar_client(cluster.brokers[0].pulsar_url)
        try:
            consumer = client.subscribe(full(topic), "quire-side")
            messages = receive_all(consumer, 10)
            return [(message.data(), message.partition_key(), message.properties(), message.event_timestamp())
                    for message in messages]
        finally:
            client.close()

    assert await in_thread(consume_with_pulsar) == [
        (b"from-quire-%d" % index, "quire-key", {"side": "quire"}, 1_800_000_000_000 + index) for index in range(10)]


async def test_nacked_and_timed_out_messages_come_back(shared_cluster):
    topic = full("pulsar-redelivery")

    def run() -> None:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            consumer = client.subscribe(topic, "redelivery", consumer_type=pulsar.ConsumerType.Shared,
                                        negative_ack_redelivery_delay_ms=100, unacked_messages_timeout_ms=10_000)
            producer = client.create_producer(topic, batching_enabled=False)
            for index in range(4):
                producer.send(b"%d" % index)
            first = receive_all(consumer, 4, acknowledge=False)
            consumer.negative_acknowledge(first[0])  # back after 100 ms
            consumer.acknowledge(first[1])
            # first[2] and first[3]: neither acknowledged nor nacked: back
            # after the ack timeout (10 s, the least this client takes)
            again = receive_all(consumer, 3)
            assert sorted(message.data() for message in again) == [b"0", b"2", b"3"]
            assert all(message.redelivery_count() >= 1 for message in again)
            assert nothing_more(consumer, 2_000)
        finally:
            client.close()

    await in_thread(run)


async def test_seek_by_message_id_and_by_publish_time(shared_cluster):
    topic = full("pulsar-seek")

    def run() -> None:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            consumer = client.subscribe(topic, "seeker", initial_position=pulsar.InitialPosition.Earliest)
            producer = client.create_producer(topic, batching_enabled=False)
            ids = [producer.send(b"%d" % index) for index in range(10)]
            # A time strictly between the two halves' (millisecond) publish times.
            time.sleep(0.01)
            middle_ms = int(time.time() * 1000)
            time.sleep(0.01)
            ids += [producer.send(b"%d" % index) for index in range(10, 20)]
            assert [message.data() for message in receive_all(consumer, 20)] == [b"%d" % index for index in range(20)]
            # The broker moves the subscription to the message itself, as
            # Pulsar's does; this client (not inclusive by default) skips it.
            consumer.seek(ids[5])
            assert receive_all(consumer, 1)[0].data() == b"6"
            consumer.seek(middle_ms)
            assert receive_all(consumer, 1)[0].data() == b"10"
        finally:
            client.close()

    await in_thread(run)


async def test_failover_moves_to_the_next_consumer_when_the_active_one_leaves(shared_cluster):
    topic = full("pulsar-failover")

    def run() -> None:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            first = client.subscribe(topic, "failover", consumer_type=pulsar.ConsumerType.Failover, consumer_name="a")
            second = client.subscribe(topic, "failover", consumer_type=pulsar.ConsumerType.Failover, consumer_name="b")
            producer = client.create_producer(topic, batching_enabled=False)
            for index in range(5):
                producer.send(b"%d" % index)
            # Every message goes to one consumer, the active one, in order.
            received = {consumer: [message.data() for message in messages]
                        for consumer, messages in zip((first, second), receive_from_each([first, second], 5, 30))}
            active, standby = (first, second) if received[first] else (second, first)
            assert received[active] == [b"%d" % index for index in range(5)] and received[standby] == []
            assert nothing_more(standby, 500)
            active.close()
            for index in range(5, 8):
                producer.send(b"%d" % index)
            assert [message.data() for message in receive_all(standby, 3)] == [b"5", b"6", b"7"]
        finally:
            client.close()

    await in_thread(run)


async def test_non_persistent_topics_and_transactions_are_refused_clearly(shared_cluster):
    def run() -> None:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            with pytest.raises(Exception, match="NotAllowed|not supported|Failed"):
                client.create_producer("non-persistent://public/default/np", send_timeout_millis=5_000)
        finally:
            client.close()

    with trio.fail_after(60):
        await in_thread(run)


async def test_keyed_messages_of_both_clients_land_on_the_same_partitions(shared_cluster):
    topic = "pulsar-routing"
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, partitions=4)
        producer = await client.create_producer(topic, "quire-router")
        quire_partitions = {}
        for index in range(40):
            key = f"customer-{index}"
            message_id = await producer.send(b"q", key=key)
            quire_partitions[key] = message_id.partition

    from broker.client.routing import java_string_hash

    def run() -> dict:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            # The C++ client's default hash is Boost's; Pulsar's Java clients
            # hash keys with Java's String.hashCode, as quire's client does.
            producer = client.create_producer(full(topic), message_routing_mode=pulsar.PartitionsRoutingMode.CustomPartition,
                                              message_router=lambda message, partitions: (java_string_hash(message.partition_key()) & 0x7FFFFFFF) % partitions)
            return {f"customer-{index}": producer.send(b"p", partition_key=f"customer-{index}").partition()
                    for index in range(40)}
        finally:
            client.close()

    assert await in_thread(run) == quire_partitions
    assert len(set(quire_partitions.values())) == 4


async def test_key_shared_on_a_partitioned_topic_keeps_each_key_at_one_consumer_in_order(shared_cluster):
    topic = "pulsar-key-shared"
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, partitions=3)
    keys = [f"key-{index}" for index in range(30)]

    def run() -> dict:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            consumers = [client.subscribe(full(topic), "key-shared", consumer_type=pulsar.ConsumerType.KeyShared,
                                          consumer_name=f"c{index}", initial_position=pulsar.InitialPosition.Earliest)
                         for index in range(3)]
            # Default batching: a batch holds messages of many keys, which
            # the broker splits among the consumers by key.
            producer = client.create_producer(full(topic), batching_enabled=True, batching_max_publish_delay_ms=5,
                                              block_if_queue_full=True)
            for index in range(1_500):
                producer.send_async(b"%d" % index, None, partition_key=keys[index % len(keys)])
            producer.flush()
            return {number: [(message.partition_key(), int(message.data())) for message in messages]
                    for number, messages in enumerate(receive_from_each(consumers, 1_500, 60)) if messages}
        finally:
            client.close()

    by_consumer = await in_thread(run)
    assert sum(map(len, by_consumer.values())) == 1_500
    consumers_of_key = collections.defaultdict(set)
    for number, messages in by_consumer.items():
        for key in {key for key, _ in messages}:
            consumers_of_key[key].add(number)
            numbers = [value for other, value in messages if other == key]
            assert numbers == sorted(numbers), f"key {key} out of order at consumer {number}"
    assert all(len(numbers) == 1 for numbers in consumers_of_key.values()), "a key went to two consumers"
    assert len(by_consumer) == 3, "every consumer takes some keys"


async def test_sticky_key_shared_consumers_take_the_hash_ranges_they_name(shared_cluster):
    from broker.dispatcher import key_hash

    topic = full("pulsar-sticky")

    def run() -> tuple[list, list]:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            low, high = (client.subscribe(topic, "sticky", consumer_type=pulsar.ConsumerType.KeyShared,
                                          key_shared_policy=pulsar.ConsumerKeySharedPolicy(
                                              pulsar.KeySharedMode.Sticky, sticky_ranges=[ranges]))
                         for ranges in ((0, 32_767), (32_768, 65_535)))
            with pytest.raises(Exception):  # overlapping ranges are refused
                client.subscribe(topic, "sticky", consumer_type=pulsar.ConsumerType.KeyShared,
                                 key_shared_policy=pulsar.ConsumerKeySharedPolicy(pulsar.KeySharedMode.Sticky,
                                                                                  sticky_ranges=[(30_000, 40_000)]))
            producer = client.create_producer(topic, batching_enabled=False)
            for index in range(40):
                producer.send(b"%d" % index, partition_key=f"user-{index}")
            return ([message.partition_key() for message in receive_all(low, sum(
                        key_hash(f"user-{index}") <= 32_767 for index in range(40)))],
                    [message.partition_key() for message in receive_all(high, sum(
                        key_hash(f"user-{index}") > 32_767 for index in range(40)))])
        finally:
            client.close()

    low_keys, high_keys = await in_thread(run)
    assert low_keys and high_keys
    assert all(key_hash(key) <= 32_767 for key in low_keys) and all(key_hash(key) > 32_767 for key in high_keys)


async def test_producer_access_modes(shared_cluster):
    topic = full("pulsar-access")

    def run() -> None:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            shared = client.create_producer(topic, producer_name="shared-1")
            with pytest.raises(Exception, match="ProducerBusy|Busy"):
                client.create_producer(topic, producer_name="exclusive-1", access_mode=pulsar.ProducerAccessMode.Exclusive)
            # WaitForExclusive waits for the shared producer to go.
            got: list = []
            waiter = threading.Thread(target=lambda: got.append(client.create_producer(
                topic, producer_name="waiting-1", access_mode=pulsar.ProducerAccessMode.WaitForExclusive)))
            waiter.start()
            time.sleep(1.0)  # the waiting producer has not been given the topic while the shared one is there
            assert not got
            shared.close()
            waiter.join(30)
            assert got, "the waiting producer got exclusive access once the shared one left"
            got[0].send(b"from the waiting producer")
            # ExclusiveWithFencing takes the topic from it: its sends fail from then on.
            fencer = client.create_producer(topic, producer_name="fencer-1",
                                            access_mode=pulsar.ProducerAccessMode.ExclusiveWithFencing)
            fencer.send(b"from the fencer")
            with pytest.raises(Exception):
                got[0].send(b"fenced out", )
            with pytest.raises(Exception, match="ProducerFenced|Fenced|Busy"):
                client.create_producer(topic, producer_name="shared-2")
        finally:
            client.close()

    with trio.fail_after(120):
        await in_thread(run)


async def test_a_regex_subscription_finds_the_namespace_s_topics(shared_cluster):
    import re

    def run() -> set:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            for name in ("regex-a", "regex-b"):
                client.create_producer(full(name)).send(name.encode())
            consumer = client.subscribe(re.compile(r"persistent://public/default/regex-.*"), "regex",
                                        initial_position=pulsar.InitialPosition.Earliest)
            return {message.data() for message in receive_all(consumer, 2)}
        finally:
            client.close()

    assert await in_thread(run) == {b"regex-a", b"regex-b"}


async def test_a_string_schema_is_stored_and_given_back(shared_cluster):
    from pulsar.schema import StringSchema

    topic = full("pulsar-schema")

    def run() -> list[str]:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            producer = client.create_producer(topic, schema=StringSchema())
            consumer = client.subscribe(topic, "strings", schema=StringSchema(), initial_position=pulsar.InitialPosition.Earliest)
            producer.send("héllo")
            producer.send("wörld")
            return [message.value() for message in receive_all(consumer, 2)]
        finally:
            client.close()

    assert await in_thread(run) == ["héllo", "wörld"]


async def test_a_topic_unloaded_while_a_pulsar_producer_sends_loses_and_duplicates_nothing(shared_cluster):
    topic = "pulsar-unload"
    total = 2_000

    def produce(unload) -> None:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            producer = client.create_producer(full(topic), producer_name="unload-producer", batching_enabled=True,
                                              batching_max_publish_delay_ms=2, send_timeout_millis=0, block_if_queue_full=True)
            for number in range(total):
                producer.send_async(b"%d" % number, None)
                if number == total // 2:
                    unload()  # the broker closes the producer; its client looks the topic up again and resends
            producer.flush()
        finally:
            client.close()

    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic)
        token = trio.lowlevel.current_trio_token()
        await in_thread(produce, lambda: trio.from_thread.run(client.unload, topic, trio_token=token))
        reader = await client.create_reader(topic)
        with trio.fail_after(60):
            received = [int((await reader.receive()).data) for _ in range(total)]
        assert received == list(range(total))
        assert (await client.topic_stats(topic))["partitions"][topic]["next_offset"] == total


async def test_hostile_commands_after_a_subscription_are_refused_and_the_broker_serves_on(shared_cluster):
    # Commands no official client sends, from a connection with a producer
    # and a shared consumer: each is refused (or dropped) and the broker
    # keeps serving.
    import socket
    import struct

    from broker.pulsar.pulsar_api_pb2 import MessageIdData
    from broker.pulsar.wire import PulsarFrameDecoder, Type, command, encode
    from broker.pulsar_message import OutMessage, build_batch
    from broker.codecs import Codec

    broker = shared_cluster.brokers[0]
    topic = full("pulsar-hostile")

    def run() -> list[str]:
        seen = []
        with socket.create_connection(("127.0.0.1", broker.pulsar_port), timeout=20) as sock:
            decoder = PulsarFrameDecoder()

            def send(frame: bytes) -> None:
                sock.sendall(frame)

            def until(kind) -> object:
                while True:
                    for frame in decoder.frames():
                        seen.append(Type.Name(frame.type))
                        if frame.type == kind:
                            return frame
                        assert frame.type != Type.ERROR, (Type.Name(kind), frame.body)
                    data = sock.recv(65536)
                    assert data, "the broker closed the connection"
                    decoder.feed(data)

            send(encode(command(Type.CONNECT, client_version="hostile", protocol_version=21)))
            until(Type.CONNECTED)
            send(encode(command(Type.LOOKUP, topic=topic, request_id=0)))  # one broker: it takes the topic
            until(Type.LOOKUP_RESPONSE)
            send(encode(command(Type.SUBSCRIBE, topic=topic, subscription="shared", subType=1, consumer_id=1, request_id=1,
                                initialPosition=1)))
            until(Type.SUCCESS)
            # The same consumer id again, while open: refused.
            send(encode(command(Type.SUBSCRIBE, topic=topic, subscription="shared", subType=1, consumer_id=1, request_id=2)))
            until(Type.ERROR)
            send(encode(command(Type.PRODUCER, topic=topic, producer_id=1, request_id=3, producer_name="hostile")))
            until(Type.PRODUCER_SUCCESS)
            send(encode(command(Type.SEND, producer_id=1, sequence_id=0, num_messages=-5),
                        build_batch("hostile", 0, [OutMessage(0, b"x")], Codec.NONE, batched=False)))
            until(Type.SEND_ERROR)
            send(encode(command(Type.SEND, producer_id=1, sequence_id=0),
                        build_batch("hostile", 0, [OutMessage(0, b"x")], Codec.NONE, batched=False)))
            until(Type.SEND_RECEIPT)
            send(encode(command(Type.FLOW, consumer_id=1, messagePermits=2**32 - 1)))
            delivered = until(Type.MESSAGE).body.message_id
            # A cumulative acknowledgement on a shared subscription, past the
            # batch, and an ack set of a million words.
            send(encode(command(Type.ACK, consumer_id=1, ack_type=1, request_id=4, message_id=[
                MessageIdData(ledgerId=delivered.ledgerId, entryId=delivered.entryId, batch_index=2**31 - 1)])))
            until(Type.ACK_RESPONSE)
            send(encode(command(Type.ACK, consumer_id=1, ack_type=0, request_id=5, message_id=[
                MessageIdData(ledgerId=delivered.ledgerId, entryId=delivered.entryId, ack_set=[-1] * 1_000_000)])))
            until(Type.ACK_RESPONSE)
            send(encode(command(Type.GET_TOPICS_OF_NAMESPACE, request_id=6, namespace="public/default",
                                topics_pattern="persistent://public/default/(.*.*)*x")))
            until(Type.ERROR)
        return seen

    with trio.fail_after(60):
        seen = await in_thread(run)
    assert "MESSAGE" in seen and broker.running, broker.log_tail()

    def still_serves() -> bytes:
        client = pulsar_client(broker.pulsar_url)
        try:
            producer = client.create_producer(full("pulsar-after-hostile"))
            consumer = client.subscribe(full("pulsar-after-hostile"), "s", initial_position=pulsar.InitialPosition.Earliest)
            producer.send(b"still here")
            return receive_all(consumer, 1)[0].data()
        finally:
            client.close()

    assert await in_thread(still_serves) == b"still here"
