"""Topic compaction on real brokers (3 bookies, ZooKeeper): compacted over
REST or by its threshold, the official Pulsar client's read-compacted readers
and consumers see the latest message of each key (a tombstone deletes its
key; keyless messages are left out), then every message after the
compaction, also once the partition has moved to another broker."""

from __future__ import annotations

import json

import pulsar
import pytest
import requests
import trio

from broker.client import Client
from ledger_client import BookKeeper
from tests.integration.bookie_processes import bookies  # noqa: F401 (fixtures)
from tests.integration.broker_processes import brokers, shared_cluster  # noqa: F401
from tests.integration.test_pulsar_clients import full, in_thread, pulsar_client
from tests.integration.test_web_admin import quire
from tests.support import wait_until, wait_until_async

pytestmark = pytest.mark.integration

COMPACTION_WAIT_S = 60


def wait_for_compaction(web_url: str, topic: str, *, since_ms: int = 0) -> dict:
    """Until the topic's compaction succeeded (after `since_ms`), over REST; its status."""
    path = f"{web_url}/admin/v2/persistent/public/default/{topic}"

    def succeeded() -> dict | None:
        status = requests.get(f"{path}/compaction", timeout=30).json()
        assert status["status"] != "ERROR", status
        if status["status"] != "SUCCESS":
            return None
        stats = requests.get(f"{path}/stats", timeout=30).json()
        return status if stats["compaction"]["lastCompactionSucceedTimestamp"] > since_ms else None

    return wait_until(succeeded, deadline_s=COMPACTION_WAIT_S, what=f"compaction of {topic} to succeed", poll_s=0.1)


async def compaction_ended(client: Client, topic: str) -> dict:
    """Until no partition of the topic is compacting; each one's status."""
    async def ended() -> dict | None:
        statuses = await client.compaction_status(topic)
        return None if any(status["running"] for status in statuses.values()) else statuses

    return await wait_until_async(ended, deadline_s=COMPACTION_WAIT_S, what=f"compaction of {topic} to end", poll_s=0.1)


def read_all(reader_or_consumer, *, acknowledge: bool = False) -> list[tuple[str | None, bytes]]:
    """What arrives until nothing more comes for a second."""
    received = []
    while True:
        try:
            message = reader_or_consumer.read_next(1_000) if hasattr(reader_or_consumer, "read_next") \
                else reader_or_consumer.receive(1_000)
        except pulsar.Timeout:
            return received
        received.append((message.partition_key() or None, message.data()))
        if acknowledge:
            reader_or_consumer.acknowledge(message)


async def test_read_compacted_sees_the_latest_value_of_each_key_then_the_tail(shared_cluster):
    topic = "compacted-prices"
    broker = shared_cluster.brokers[0]
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic)

    def produce_and_compact() -> dict[str, bytes]:
        client = pulsar_client(broker.pulsar_url)
        try:
            producer = client.create_producer(full(topic), batching_enabled=True, batching_max_publish_delay_ms=5,
                                              block_if_queue_full=True)
            latest = {}
            for round_ in range(20):
                for index in range(10):
                    key, value = f"item-{index}", f"{round_}-{index}".encode()
                    producer.send_async(value, None, partition_key=key)
                    latest[key] = value
                producer.send_async(b"no key", None)
            producer.flush()
            producer.send(b"", partition_key="item-3")  # a tombstone: item-3 goes
            del latest["item-3"]
            producer.send(b"gone", partition_key="item-11")
            producer.send(b"", partition_key="item-11")  # written and deleted
            response = requests.put(f"{broker.web_url}/admin/v2/persistent/public/default/{topic}/compaction", timeout=30)
            assert response.status_code == 204, response.text
            wait_for_compaction(broker.web_url, topic)
            return latest
        finally:
            client.close()

    latest = await in_thread(produce_and_compact)

    def read_views() -> tuple[list, list, list, list]:
        client = pulsar_client(broker.pulsar_url)
        try:
            compacted = client.create_reader(full(topic), pulsar.MessageId.earliest, is_read_compacted=True)
            view = read_all(compacted)
            everything = read_all(client.create_reader(full(topic), pulsar.MessageId.earliest))
            consumer = client.subscribe(full(topic), "compacted-sub", initial_position=pulsar.InitialPosition.Earliest,
                                        is_read_compacted=True)
            consumed = read_all(consumer, acknowledge=True)
            # After the compaction: every message, as published.
            producer = client.create_producer(full(topic), batching_enabled=False)
            producer.send(b"new-1", partition_key="item-1")
            producer.send(b"new-1-again", partition_key="item-1")
            tail = read_all(compacted)
            assert read_all(consumer, acknowledge=True) == tail
            return view, everything, consumed, tail
        finally:
            client.close()

    view, everything, consumed, tail = await in_thread(read_views)
    assert sorted(view) == sorted(latest.items())
    assert len(view) == 9 and consumed == view
    assert len(everything) == 20 * 11 + 3
    assert tail == [("item-1", b"new-1"), ("item-1", b"new-1-again")]


async def test_the_compaction_threshold_compacts_and_the_view_moves_with_its_partition(shared_cluster):
    topic = "compacted-threshold"
    broker = shared_cluster.brokers[0]
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic)
        response = await trio.to_thread.run_sync(lambda: requests.post(
            f"{broker.web_url}/admin/v2/persistent/public/default/{topic}/compactionThreshold", json=1, timeout=30))
        assert response.status_code == 204, response.text
        producer = await client.create_producer(topic)
        for round_ in range(5):
            for index in range(4):
                await producer.send(f"{round_}".encode(), key=f"key-{index}")
        await trio.to_thread.run_sync(wait_for_compaction, broker.web_url, topic)
        # The partition moves: its next owner reads the same view.
        await client.unload(topic)
        reader = await client.create_reader(topic, read_compacted=True)
        received = []
        with trio.move_on_after(2):
            while True:
                message = await reader.receive()
                received.append((message.key, message.data))
        assert sorted(received) == [(f"key-{index}", b"4") for index in range(4)]
        status = await client.compaction_status(topic)
        assert status[topic]["messages"] == 4 and status[topic]["horizon"] >= 19


async def test_read_compacted_is_refused_on_shared_subscriptions(shared_cluster):
    topic = full("compacted-shared")

    def run() -> None:
        client = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            with pytest.raises(pulsar.PulsarException):
                client.subscribe(topic, "shared", consumer_type=pulsar.ConsumerType.Shared, is_read_compacted=True)
            # An exclusive one of the same topic is taken.
            client.subscribe(topic, "exclusive", is_read_compacted=True).close()
        finally:
            client.close()

    await in_thread(run)


async def test_the_command_line_compacts_a_partitioned_topic_and_consumes_its_view(shared_cluster):
    topic = "compacted-cli"
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, partitions=2)
        producer = await client.create_producer(topic)
        for round_ in range(3):
            for index in range(6):
                await producer.send(f"{round_}".encode(), key=f"key-{index}")
    statuses = await trio.to_thread.run_sync(quire, shared_cluster, "topic", "compact", topic, "--wait")
    assert {name: status["status"] for name, status in statuses.items()} == {
        f"{topic}-partition-0": "SUCCESS", f"{topic}-partition-1": "SUCCESS"}
    assert sum(status["messages"] for status in statuses.values()) == 6
    output = await trio.to_thread.run_sync(
        quire, shared_cluster, "consume", topic, "--subscription", "view", "--read-compacted", "--format", "json",
        "--idle-timeout", "2s")
    lines = [json.loads(line) for line in output.splitlines()]
    assert sorted((line["key"], line["data"]) for line in lines) == [(f"key-{index}", "2") for index in range(6)]


async def test_a_broker_killed_while_compacting_leaves_a_whole_view_and_nothing_behind(zk_hosts, zk_root, bookies, brokers):
    """The owner is killed right after it starts compacting: the next owner
    serves the previous view (or the new one, if the switch was written),
    compacts again, and the ledgers the stopped compaction wrote are gone."""
    for _ in range(3):
        await bookies.started()
    first = await brokers.started()
    second = await brokers.started()
    topic = "compacted-kill"
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic(topic)
        producer = await client.create_producer(topic, batching=True)

        async def publish(rounds: int, keys: int) -> None:
            futures = [await producer.send_async(f"{round_}".encode(), key=f"key-{index}")
                       for round_ in range(rounds) for index in range(keys)]
            for future in futures:
                await future.wait()

        await publish(2, 100)
        await client.compact(topic)  # a first view, at once
        assert (await compaction_ended(client, topic))[topic]["status"] == "SUCCESS"
        await publish(200, 500)  # 100,000 more: the next compaction takes a while
        owner_address = await client.lookup(topic)
        owner = first if first.address == owner_address else second
        await client.compact(topic)
        owner.kill()
        await producer.close()
    latest = {f"key-{index}": b"199" for index in range(500)}
    async with Client.connect(zk_hosts, zk_root) as client:
        # The first view and every message after it, or the second view
        # alone (100,000 messages through a reader: it acknowledges as it
        # goes, or the broker would stop at its unacknowledged bound).
        read, view = await _read_compacted(client, topic)
        assert view == latest and read in (100 + 100_000, 500), f"{read} messages read compacted"
        await client.compact(topic)
        status = (await compaction_ended(client, topic))[topic]
        assert status["status"] == "SUCCESS", status
        assert await _read_compacted(client, topic) == (500, latest)
    async with BookKeeper.connect(zk_hosts, zk_root) as bookkeeper:
        compaction_ledgers = []
        for ledger_id in await bookkeeper.list_ledgers():
            metadata = await bookkeeper.ledger_metadata(ledger_id)
            if metadata.custom_metadata.get("compaction") == b"1":
                compaction_ledgers.append(metadata)
    in_use = [metadata for metadata in compaction_ledgers if metadata.ledger_id == status["ledger_id"]]
    left = [metadata for metadata in compaction_ledgers if metadata.ledger_id != status["ledger_id"]]
    assert len(in_use) == 1
    # Only a ledger created by the killed broker before it could record it
    # may be left (nothing was written to it).
    assert len(left) <= 1 and all(metadata.last_entry_id == -1 for metadata in left), left


async def _read_compacted(client: Client, topic: str) -> tuple[int, dict[str, bytes]]:
    """How many messages a read-compacted reader gets, and the latest value of each key."""
    reader = await client.create_reader(topic, read_compacted=True)
    latest: dict[str, bytes] = {}
    read = 0
    while True:
        with trio.move_on_after(5):
            message = await reader.receive()
            latest[message.key] = message.data
            read += 1
            continue
        break
    await reader.close()
    return read, latest


async def test_the_view_outlives_the_ledgers_retention_deletes(shared_cluster):
    """Retention deletes the ledgers before the last compaction: a reader
    that reads compacted from the earliest still gets every key."""
    topic = "compacted-retained"
    async with Client.connect(shared_cluster.zk_hosts, shared_cluster.root) as client:
        await client.create_topic(topic, rollover_entries=2, rollover_min_time_ms=0, retention_time_ms=0)
        producer = await client.create_producer(topic)
        for round_ in range(3):
            for index in range(4):
                await producer.send(f"{round_}".encode(), key=f"key-{index}")
        await client.compact(topic)
        assert (await compaction_ended(client, topic))[topic]["status"] == "SUCCESS"
        await producer.send(b"after", key="key-0")
        await client.unload(topic)  # the open ledger closes; retention may delete every ledger before the horizon
        await client.apply_retention(topic)
        stats = (await client.topic_stats(topic))["partitions"][topic]
        assert stats["first_offset"] == 12, "retention kept ledgers of the view: the test shows nothing"
        read, latest = await _read_compacted(client, topic)
        assert latest == {"key-0": b"after", "key-1": b"2", "key-2": b"2", "key-3": b"2"}
        assert read == 5  # the view's 4, then the one after it

    def read_with_pulsar() -> list:
        pulsar_side = pulsar_client(shared_cluster.brokers[0].pulsar_url)
        try:
            reader = pulsar_side.create_reader(full(topic), pulsar.MessageId.earliest, is_read_compacted=True)
            return read_all(reader)
        finally:
            pulsar_side.close()

    assert sorted(await in_thread(read_with_pulsar)) == sorted(
        [("key-0", b"2"), ("key-1", b"2"), ("key-2", b"2"), ("key-3", b"2"), ("key-0", b"after")])
