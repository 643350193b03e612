"""Brokers under what goes wrong in practice: connections cut mid-publish,
unloads under acknowledgements, messages too large, readers across a
partition moving, and the deduplication map rebuilt from its snapshot
(real ZooKeeper, bookies and brokers)."""

from __future__ import annotations

import json
import re

import pytest
import trio

from broker.client import Client
from broker.errors import BrokerError
from broker.codecs import Codec
from broker.pulsar_message import OutMessage, build_batch
from broker.protocol import PROTOCOL_VERSION, Connect, ProducerOpen, Send, SendReceipt, decode, encode
from broker.topic_records import dedup_path
from coordination.store import NoNodeError
from coordination.zk_store import KazooMetadataStore
from framing.codec import FrameDecoder
from framing.stream import receive_first_frames
from tests.integration.bookie_processes import bookies  # noqa: F401 (fixtures)
from tests.integration.broker_processes import brokers, shared_cluster  # noqa: F401
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


def client_of(cluster):
    return Client.connect(cluster.zk_hosts, cluster.root)


async def read_all(client: Client, topic: str, count: int, deadline_s: float = 30) -> list:
    reader = await client.create_reader(topic, start="earliest")
    messages = []
    with trio.fail_after(deadline_s):
        while len(messages) < count:
            messages.append(await reader.receive())
    with trio.move_on_after(1):
        extra = await reader.receive()
        pytest.fail(f"more messages than expected: {extra.data!r}")
    await reader.close()
    return messages


async def test_cutting_a_producers_connection_mid_publish_loses_nothing(shared_cluster):
    # The producer's connection is cut again and again while hundreds of
    # batches are in flight. Every message the producer was told is stored
    # (or "a duplicate of one stored") is in the partition exactly once.
    async with client_of(shared_cluster) as client:
        producer = await client.create_producer("cut", "cut-producer", batching=True, batch_delay_ms=0.5)
        futures = []
        for round_ in range(4):
            for number in range(round_ * 500, (round_ + 1) * 500):
                futures.append(await producer.send_async(f"{number}".encode(), sequence_id=number))
            connection = await client.connection(await client.lookup("cut"))
            await connection.aclose()  # cut under the producer's feet
        settled = []
        with trio.fail_after(60):
            for future in futures:
                settled.append(await future.wait())
        stored = [int(message.data) for message in await read_all(client, "cut", 2000)]
        assert sorted(stored) == list(range(2000))
        assert stored == sorted(stored), "in order"


async def test_acknowledgements_under_an_unload_are_all_answered_and_none_comes_back(shared_cluster):
    async with client_of(shared_cluster) as client:
        producer = await client.create_producer("unloaded", batching=True)
        for future in [await producer.send_async(f"{n}".encode()) for n in range(3000)]:
            await future.wait()
        consumer = await client.subscribe("unloaded", "acks", "shared", receiver_queue_size=3000, initial_position="earliest")
        answered, failed = [], []

        async def acknowledge(message) -> None:
            try:
                await consumer.acknowledge(message)
                answered.append(int(message.data))
            except BrokerError:
                failed.append(int(message.data))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for index in range(3000):
                    message = await consumer.receive()
                    nursery.start_soon(acknowledge, message)
                    if index == 1500:
                        nursery.start_soon(client.unload, "unloaded")
        # Every acknowledgement was answered (none hangs); an answered one
        # never comes back, and what was not acknowledged does.
        assert len(answered) + len(failed) == 3000
        await consumer.close()
        again = await client.subscribe("unloaded", "acks", "shared")
        back = set()
        with trio.move_on_after(3):
            while True:
                back.add(int((await again.receive()).data))
        assert not back & set(answered), "an acknowledged message came back"
        assert back == set(range(3000)) - set(answered)


async def test_a_message_too_large_is_refused_and_breaks_nothing(shared_cluster):
    async with client_of(shared_cluster) as client:
        producer = await client.create_producer("large", "large-producer")
        with pytest.raises(ValueError, match="at most"):
            await producer.send_async(b"x" * (6 * 1024 * 1024))
        assert not (await producer.send(b"small")).is_duplicate
        # A client of its own sends a batch larger than an entry holds: the
        # broker refuses that batch and goes on.
        address = await client.lookup("large")
        host, _, port = address.rpartition(":")
        stream = await trio.open_tcp_stream(host, int(port))
        decoder = FrameDecoder(32 * 1024 * 1024)
        await stream.send_all(encode(Connect(PROTOCOL_VERSION, "raw", "", b"")))
        await receive_first_frames(stream, decoder)
        await stream.send_all(encode(ProducerOpen(1, 7, "large", "raw-producer")))
        body = build_batch("raw-producer", 0, [OutMessage(0, b"y" * (16 * 1024 * 1024 - 2000))], Codec.NONE, batched=False)
        await stream.send_all(encode(Send(7, 0, 0, 1, body)))
        receipt = None
        with trio.fail_after(30):
            while receipt is None:
                decoder.feed(await stream.receive_some(65536))
                for fields in decoder.frames():
                    message = decode(fields)
                    if isinstance(message, SendReceipt):
                        receipt = message
        assert receipt.status != 0 and "more than an entry holds" in receipt.message
        await stream.aclose()
        assert shared_cluster.brokers[0].running
        assert not (await producer.send(b"still fine")).is_duplicate
        assert [m.data for m in await read_all(client, "large", 2)] == [b"small", b"still fine"]


async def test_a_reader_keeps_its_place_when_its_partition_moves(shared_cluster):
    async with client_of(shared_cluster) as client:
        producer = await client.create_producer("moving")
        for number in range(100):
            await producer.send(f"{number}".encode())
        reader = await client.create_reader("moving", start="earliest")
        got = []
        with trio.fail_after(30):
            while len(got) < 50:
                got.append(int((await reader.receive()).data))
            await client.unload("moving")
            for number in range(100, 150):
                await producer.send(f"{number}".encode())
            while len(got) < 150:
                got.append(int((await reader.receive()).data))
        assert got == list(range(150)), "no message twice, none skipped"


async def test_a_new_owner_rebuilds_deduplication_from_the_snapshot_and_the_entries_after_it(zk_hosts, zk_root, bookies, brokers):
    for _ in range(3):
        await bookies.started()
    first = await brokers.started()
    second = await brokers.started()
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("snapshotted")
        producer = await client.create_producer("snapshotted", "snapshot-producer")
        futures = [await producer.send_async(f"{n}".encode(), sequence_id=n) for n in range(2600)]
        for future in futures:
            await future.wait()
        owner = first if await client.lookup("snapshotted") == first.address else second
        survivor = second if owner is first else first
        # The snapshot at 2,000 entries is written while publishing goes on:
        # kill the owner once it is durable (on a loaded machine it can still
        # be in flight when the last send is answered).
        with KazooMetadataStore.connect(zk_hosts, zk_root, session_timeout_ms=4_000) as store:
            def snapshot_covers_2000() -> bool:
                try:
                    data, _ = store.get(dedup_path("snapshotted"))
                except NoNodeError:
                    return False
                return json.loads(data)["sequences"].get("snapshot-producer", -1) >= 1999

            await wait_until_async(lambda: trio.to_thread.run_sync(snapshot_covers_2000), deadline_s=30,
                                   what="the deduplication snapshot at 2,000 entries")
        owner.kill()
        # Resending what was stored: every message is a duplicate, whichever
        # side of the last snapshot (written at 2,000 entries) it was on.
        with trio.fail_after(60):
            for number in (5, 1999, 2000, 2599):
                assert (await producer.send(b"again", sequence_id=number)).is_duplicate
            assert not (await producer.send(b"new", sequence_id=2600)).is_duplicate
        log = survivor.log_path.read_text()
        replayed = [int(count) for count in re.findall(r"\((\d+) entries replayed after the snapshot at ", log)]
        assert replayed and 0 < replayed[-1] <= 600, f"the new owner replayed {replayed} entries: it should start from the snapshot"
        assert len(await read_all(client, "snapshotted", 2601)) == 2601
