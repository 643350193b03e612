"""What a user of topics sees, against real processes (one module-wide
cluster of 3 bookies and a broker; every test has topics of its own):
messages with keys, properties and codecs, partitions, subscription types,
redelivery, seeking, readers, flow control, quotas, retention."""

from __future__ import annotations

import collections
import time

import pytest
import trio

from broker.client import Client, Codec, PartitionOverflowError, ConsumerBusyError, partition_for_key
from broker.client.messages import MessageId
from tests.integration.broker_processes import shared_cluster  # noqa: F401 (a fixture)
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


def client_of(cluster):
    return Client.connect(cluster.zk_hosts, cluster.root)


async def receive(consumer, count: int, *, deadline_s: float = 20.0, ack: bool = True) -> list:
    messages = []
    with trio.fail_after(deadline_s):
        async with trio.open_nursery() as nursery:
            while len(messages) < count:
                message = await consumer.receive()
                messages.append(message)
                if ack:
                    nursery.start_soon(consumer.acknowledge, message)
    return messages


async def nothing_more(consumer, wait_s: float = 1.0) -> None:
    with trio.move_on_after(wait_s):
        message = await consumer.receive()
        pytest.fail(f"unexpected message {message.message_id}: {message.data[:40]!r}")


async def test_keys_properties_codecs_and_batches_reach_the_consumer_intact(shared_cluster):
    # Each codec, batched and not: what the consumer gets is what was sent,
    # with the producer's id, sequence ids, publish times and contiguous offsets.
    async with client_of(shared_cluster) as client:
        consumer = await client.subscribe("intact", "check", initial_position="earliest")
        sent = []
        for codec in Codec:
            for batching in (False, True):
                producer = await client.create_producer("intact", f"p-{codec.value}-{batching}", batching=batching, codec=codec)
                futures = []
                for number in range(50):
                    payload = f"{codec.value}:{batching}:{number}:".encode() + bytes(range(256)) * (number % 5)
                    key = None if number % 7 == 0 else f"k{number % 3}"
                    properties = {"n": str(number), "codec": codec.value} if number % 2 else None
                    futures.append(await producer.send_async(payload, key=key, properties=properties))
                    sent.append((producer.producer_id, number, payload, key, properties or {}))
                results = [await future.wait() for future in futures]
                assert [result.sequence_id for result in results] == list(range(50))
                await producer.close()
        messages = await receive(consumer, len(sent))
        assert [(m.producer_id, m.sequence_id, m.data, m.key, m.properties) for m in messages] == sent
        assert [m.offset for m in messages] == list(range(len(sent)))
        assert {m.codec for m in messages} == {codec.value for codec in Codec}
        assert all(abs(m.publish_time_ms - time.time() * 1000) < 60_000 for m in messages)


async def test_a_restarted_batching_producer_resends_its_last_message_and_it_is_stored_once(shared_cluster):
    # The broker told the new producer that sequence id 0 is persisted; the
    # application resends it anyway (its answer was lost) and sends a new
    # one: the resend goes in a batch of its own, answered as a duplicate,
    # and the subscription sees each message once.
    async with client_of(shared_cluster) as client:
        consumer = await client.subscribe("resend-batched", "check", initial_position="earliest")
        first = await client.create_producer("resend-batched", "p", batching=True, batch_delay_ms=50)
        await first.send(b"zero", sequence_id=0)
        await first.close()
        again = await client.create_producer("resend-batched", "p", batching=True, batch_delay_ms=50)
        resent = await again.send_async(b"zero", sequence_id=0)
        new = await again.send_async(b"one", sequence_id=1)
        await resent.wait()
        await new.wait()
        messages = await receive(consumer, 2)
        assert [(message.sequence_id, message.data) for message in messages] == [(0, b"zero"), (1, b"one")]
        await nothing_more(consumer)


async def test_a_partitioned_topic_sends_one_key_to_one_partition_always(shared_cluster):
    async with client_of(shared_cluster) as client:
        await client.create_topic("routed", partitions=4)
        partitions_seen = collections.defaultdict(set)
        for round_ in range(2):
            # A new producer (as after a restart) routes each key the same way.
            producer = await client.create_producer("routed", f"router-{round_}")
            for number in range(40):
                key = f"customer-{number % 10}"
                message_id = await producer.send(f"{round_}:{number}".encode(), key=key)
                partitions_seen[key].add(message_id.partition)
            await producer.close()
        assert all(len(partitions) == 1 for partitions in partitions_seen.values())
        assert all(partitions_seen[f"customer-{n}"] == {partition_for_key(f"customer-{n}", 4)} for n in range(10))
        consumer = await client.subscribe("routed", "all", initial_position="earliest")
        messages = await receive(consumer, 80)
        by_partition = collections.defaultdict(list)
        for message in messages:
            by_partition[message.message_id.partition].append(message.offset)
        for offsets in by_partition.values():
            assert offsets == list(range(len(offsets))), "offsets are contiguous within each partition"


async def test_key_shared_gives_each_key_to_one_consumer_in_order(shared_cluster):
    async with client_of(shared_cluster) as client:
        first = await client.subscribe("keyed", "workers", "key_shared", consumer_name="a", initial_position="earliest")
        second = await client.subscribe("keyed", "workers", "key_shared", consumer_name="b")
        producer = await client.create_producer("keyed", batching=True)
        futures = [await producer.send_async(f"{n}".encode(), key=f"key-{n % 16}") for n in range(800)]
        for future in futures:
            await future.wait()
        got = {"a": [], "b": []}

        async def drain(name, consumer):
            async for message in consumer:
                got[name].append(message)
                await consumer.acknowledge(message)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, "a", first)
            nursery.start_soon(drain, "b", second)
            await wait_until_async(lambda: len(got["a"]) + len(got["b"]) >= 800, deadline_s=20, what="800 messages")
            nursery.cancel_scope.cancel()
        assert len(got["a"]) + len(got["b"]) == 800
        assert got["a"] and got["b"], "both consumers got keys"
        keys_a = {m.key for m in got["a"]}
        keys_b = {m.key for m in got["b"]}
        assert not keys_a & keys_b, "a key goes to one consumer"
        for messages in got.values():
            per_key = collections.defaultdict(list)
            for message in messages:
                per_key[message.key].append(int(message.data))
            assert all(values == sorted(values) for values in per_key.values())


async def test_failover_delivers_to_one_active_consumer_and_hands_over_on_close(shared_cluster):
    async with client_of(shared_cluster) as client:
        standby = await client.subscribe("failing-over", "ha", "failover", consumer_name="b-standby", initial_position="earliest")
        active = await client.subscribe("failing-over", "ha", "failover", consumer_name="a-active")
        producer = await client.create_producer("failing-over")
        for number in range(20):
            await producer.send(f"{number}".encode())
        taken = await receive(active, 10)
        await nothing_more(standby, 1.0)
        await active.close()
        rest = await receive(standby, 10)
        assert [int(m.data) for m in taken + rest] == list(range(20))


async def test_exclusive_refuses_a_second_consumer_and_shared_spreads(shared_cluster):
    async with client_of(shared_cluster) as client:
        await client.subscribe("exclusive-topic", "only")
        with pytest.raises(ConsumerBusyError):
            with trio.fail_after(10):
                await client.subscribe("exclusive-topic", "only")
        one = await client.subscribe("spread", "pool", "shared", receiver_queue_size=10, initial_position="earliest")
        two = await client.subscribe("spread", "pool", "shared", receiver_queue_size=10)
        producer = await client.create_producer("spread")
        for number in range(100):
            await producer.send(f"{number}".encode())
        got = {1: [], 2: []}

        async def drain(index, consumer):
            async for message in consumer:
                got[index].append(int(message.data))
                await consumer.acknowledge(message)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, 1, one)
            nursery.start_soon(drain, 2, two)
            await wait_until_async(lambda: len(got[1]) + len(got[2]) >= 100, deadline_s=15, what="100 messages")
            nursery.cancel_scope.cancel()
        assert sorted(got[1] + got[2]) == list(range(100))
        assert got[1] and got[2], "both shared consumers got messages"


async def test_negative_acknowledgement_and_ack_timeout_deliver_again(shared_cluster):
    async with client_of(shared_cluster) as client:
        consumer = await client.subscribe("redelivered", "retry", "shared", negative_ack_delay_ms=200,
                                          ack_timeout_ms=1_000, initial_position="earliest")
        producer = await client.create_producer("redelivered")
        for number in range(3):
            await producer.send(f"{number}".encode())
        first = await receive(consumer, 3, ack=False)
        consumer.negative_acknowledge(first[0])
        await consumer.acknowledge(first[1])
        # first[0] comes back after the negative-ack delay, first[2] after the ack timeout.
        again = await receive(consumer, 2, deadline_s=10)
        assert sorted(int(m.data) for m in again) == [0, 2]
        assert all(m.redelivery_count >= 1 for m in again)
        await nothing_more(consumer, 2.0)


async def test_seek_by_offset_message_id_and_publish_time_and_a_reader(shared_cluster):
    async with client_of(shared_cluster) as client:
        consumer = await client.subscribe("seekable", "rewind", initial_position="earliest")
        producer = await client.create_producer("seekable")
        ids = []
        for number in range(30):
            ids.append(await producer.send(f"{number}".encode()))
            if number == 19:
                # Pacing, not synchronisation: a publish time with a clear
                # gap to messages 19 and 20 on either side.
                await trio.sleep(0.05)
                middle_ms = int(time.time() * 1000)
                await trio.sleep(0.05)
        await receive(consumer, 30)
        await consumer.seek(offset=5)
        assert [int(m.data) for m in await receive(consumer, 25)] == list(range(5, 30))
        await consumer.seek(message_id=ids[12])
        assert [int(m.data) for m in await receive(consumer, 18)] == list(range(12, 30))
        await consumer.seek(publish_time_ms=middle_ms)
        assert [int(m.data) for m in await receive(consumer, 10)] == list(range(20, 30))
        await nothing_more(consumer, 0.5)
        # A reader stores nothing and starts where it is told.
        reader = await client.create_reader("seekable", start=25)
        assert [int(m.data) for m in await receive(reader, 5, ack=False)] == list(range(25, 30))
        await reader.close()
        stats = (await client.topic_stats("seekable"))["partitions"]["seekable"]
        assert set(stats["subscriptions"]) == {"rewind"}, "the reader left no subscription behind"


async def test_a_slow_consumer_gets_only_its_permits(shared_cluster):
    # Flow control: a consumer that does not receive holds at most its
    # receiver queue; the broker keeps the rest in the ledger, not in memory.
    async with client_of(shared_cluster) as client:
        consumer = await client.subscribe("flow", "slow", receiver_queue_size=10, initial_position="earliest")
        producer = await client.create_producer("flow")
        futures = [await producer.send_async(f"{n}".encode()) for n in range(500)]
        for future in futures:
            await future.wait()

        async def dispatched() -> dict | None:
            stats = (await client.topic_stats("flow"))["partitions"]["flow"]["subscriptions"]["slow"]
            return stats if stats["messages_out"] >= 10 else None

        # Once the broker has sent what the consumer has room for, it sends no more.
        stats = await wait_until_async(dispatched, deadline_s=10, what="the first deliveries")
        assert stats["consumers"][0]["unacknowledged"] <= 10
        assert stats["backlog_messages"] == 500
        assert [int(m.data) for m in await receive(consumer, 500)] == list(range(500))


async def test_the_backlog_quota_refuses_producers_until_space_is_freed(shared_cluster):
    async with client_of(shared_cluster) as client:
        await client.create_topic("quota", backlog_quota_bytes=20_000, rollover_entries=10, rollover_min_time_ms=0, retention_time_ms=0,
                                  retention_model="ydb")
        consumer = await client.subscribe("quota", "important-one", important=True, initial_position="earliest")
        producer = await client.create_producer("quota")
        sent = 0
        with pytest.raises(PartitionOverflowError, match="partition overflow"):
            with trio.fail_after(30):
                while True:
                    await producer.send(b"x" * 1000)
                    sent += 1
        assert 15 <= sent <= 40
        # The important subscription holds everything until it acknowledges.
        await receive(consumer, sent)
        async def accepted_again() -> bool:
            await client.apply_retention("quota")
            try:
                await producer.send(b"accepted again")
            except PartitionOverflowError:
                return False
            return True

        await wait_until_async(accepted_again, deadline_s=20, what="the producer accepted once the backlog was read", poll_s=0.2)


async def retention_freed(client, topic: str) -> bool:
    """Retention applied now has deleted ledgers of `topic`'s head: by this
    call, or by the partition's own check if that came first."""
    await client.apply_retention(topic)
    return (await client.topic_stats(topic))["partitions"][topic]["first_offset"] > 0


async def test_by_pulsar_s_model_every_subscription_s_backlog_is_kept_and_retention_takes_only_what_all_acknowledged(shared_cluster):
    async with client_of(shared_cluster) as client:
        # The default model; no retention time: acknowledged data goes at once.
        await client.create_topic("pulsar-retained", rollover_entries=5, rollover_min_time_ms=0, retention_time_ms=0,
                                  backlog_quota_bytes=4_000)
        fast = await client.subscribe("pulsar-retained", "fast", initial_position="earliest")
        await (await client.subscribe("pulsar-retained", "slow", initial_position="earliest")).close()
        producer = await client.create_producer("pulsar-retained")
        for number in range(30):
            await producer.send(b"%03d" % number)

        async def rolled_over() -> bool:
            return len((await client.topic_stats("pulsar-retained"))["partitions"]["pulsar-retained"]["ledgers"]) >= 4

        await wait_until_async(rolled_over, deadline_s=15, what="4 ledgers or more")
        await receive(fast, 30)
        # The slow subscription has acknowledged nothing: nothing goes.
        assert (await client.apply_retention("pulsar-retained"))["pulsar-retained"]["deleted_ledgers"] == []
        # Its backlog counts against the quota (30 messages of some 60 bytes each stored).
        with pytest.raises(PartitionOverflowError):
            with trio.fail_after(30):
                while True:
                    await producer.send(b"x" * 100)
        slow = await client.subscribe("pulsar-retained", "slow")
        got = await receive(slow, 30)
        assert [int(message.data) for message in got] == list(range(30))

        await wait_until_async(lambda: retention_freed(client, "pulsar-retained"), deadline_s=10,
                               what="ledgers deleted once every subscription acknowledged", poll_s=0.2)
        await producer.send(b"accepted again")


async def test_retention_deletes_old_ledgers_and_their_entries_except_what_an_important_subscription_holds(shared_cluster):
    from coordination.async_store import AsyncMetadataStore, connect_zookeeper
    from coordination.cluster_layout import ledger_path

    async with client_of(shared_cluster) as client:
        await client.create_topic("retained", rollover_entries=5, rollover_min_time_ms=0, retention_time_ms=0, retention_model="ydb")
        important = await client.subscribe("retained", "ledger-keeper", important=True, initial_position="earliest")
        # A subscription without the important mark, whose consumer is away.
        await (await client.subscribe("retained", "casual", initial_position="earliest")).close()
        producer = await client.create_producer("retained")
        for number in range(40):
            await producer.send(f"{number}".encode())

        async def rolled_over() -> list | None:
            # Rollovers happen in the broker's housekeeping, once a second.
            ledgers = (await client.topic_stats("retained"))["partitions"]["retained"]["ledgers"]
            return [ledger["ledger_id"] for ledger in ledgers] if len(ledgers) >= 4 else None

        ledgers_before = await wait_until_async(rolled_over, deadline_s=15, what="4 ledgers or more")
        # Nothing goes while the important subscription has acknowledged nothing.
        assert (await client.apply_retention("retained"))["retained"]["deleted_ledgers"] == []
        # It acknowledges the first 20: ledgers wholly below go, the rest stay.
        await receive(important, 20)

        await wait_until_async(lambda: retention_freed(client, "retained"), deadline_s=10, what="ledgers deleted by retention",
                               poll_s=0.2)
        stats = (await client.topic_stats("retained"))["partitions"]["retained"]
        assert 0 < stats["first_offset"] <= 20
        deleted = [ledger_id for ledger_id in ledgers_before if ledger_id not in [l["ledger_id"] for l in stats["ledgers"]]]
        assert deleted
        # The casual subscription lost what retention removed; it resumes at the first offset kept.
        casual = await client.subscribe("retained", "casual")
        first = (await receive(casual, 1))[0]
        assert first.offset == stats["first_offset"]
        # The deleted ledgers' metadata is gone, and the bookies collect their entries.
        async with AsyncMetadataStore(await connect_zookeeper(shared_cluster.zk_hosts, shared_cluster.root)) as store:
            for ledger_id in deleted:
                assert await store.exists(ledger_path(ledger_id)) is None
        from ledger_client.bookie_client import BookieClient
        from bookie.protocol.wire import Status

        for bookie in shared_cluster.bookies:
            async with BookieClient.connect(bookie.address) as bookie_client:
                for ledger_id in deleted:
                    async def collected() -> bool:
                        return (await bookie_client.read(ledger_id, 0)).status is Status.NO_LEDGER

                    await wait_until_async(collected, deadline_s=30, what=f"ledger {ledger_id} collected by {bookie.address}",
                                           poll_s=0.5)
        # What the important subscription did not acknowledge is all there.
        rest = await receive(important, 20)
        assert [int(m.data) for m in rest] == list(range(20, 40))


async def test_a_producer_id_learns_its_last_sequence_id_and_duplicates_are_dropped(shared_cluster):
    async with client_of(shared_cluster) as client:
        producer = await client.create_producer("exactly-once", "orders-service")
        for number in range(10):
            await producer.send(f"{number}".encode())
        assert producer.last_sequence_id == 9
        await producer.close()
        again = await client.create_producer("exactly-once", "orders-service")
        assert again.last_sequence_id == 9
        duplicate = await again.send(b"resent 5", sequence_id=5)
        assert duplicate.is_duplicate and duplicate == MessageId(-1, -1, -1, -1)
        fresh = await again.send(b"10")
        assert not fresh.is_duplicate
        reader = await client.create_reader("exactly-once")
        messages = await receive(reader, 11, ack=False)
        assert [m.data for m in messages] == [f"{n}".encode() for n in range(11)]
        await nothing_more(reader, 0.5)


async def test_an_idle_ledger_is_closed_so_that_its_messages_become_exportable(shared_cluster):
    # Rollover by idleness: a ledger nobody wrote to for rollover_idle_ms is
    # closed and a new one started; a partition never rolls an empty ledger.
    async with client_of(shared_cluster) as client:
        await client.create_topic("idle", rollover_idle_ms=500)
        producer = await client.create_producer("idle")
        for number in range(3):
            await producer.send(f"{number}".encode())

        async def first_closed() -> list | None:
            ledgers = (await client.topic_stats("idle"))["partitions"]["idle"]["ledgers"]
            return ledgers if ledgers[0]["state"] == "closed" else None

        ledgers = await wait_until_async(first_closed, deadline_s=15, what="the idle ledger closed", poll_s=0.2)
        assert ledgers[0]["entries"] == 3 and ledgers[0]["messages"] == 3
        assert len(ledgers) == 2 and ledgers[1]["state"] == "open" and ledgers[1]["first_offset"] == 3
        await trio.sleep(1.5)
        assert len((await client.topic_stats("idle"))["partitions"]["idle"]["ledgers"]) == 2, "no empty rollovers"
