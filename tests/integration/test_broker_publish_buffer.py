"""The broker's publish buffer against real bookies and a real broker: with
every bookie paused (SIGSTOP) its ledgers persist nothing, and producers
that keep sending are held back at the buffer's bound (the broker stops
reading their connection) instead of filling the broker's memory; once the
bookies come back, everything is persisted, exactly once."""

from __future__ import annotations

import collections

import pytest
import trio

from broker.client import Client
from tests.integration.bookie_processes import bookies  # noqa: F401 (a fixture)
from tests.integration.broker_processes import brokers  # noqa: F401 (a fixture)
from tests.integration.test_metrics import scrape_async, value
from tests.support import free_port, wait_until_async

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
PUBLISH_BUFFER_BYTES = 4 * MIB
MESSAGE_BYTES = 32 * 1024
BATCH_BYTES_MAX = 1 * MIB  # the client's default: a frame of one batch is about this
PRODUCERS = 2
WARM_UP_MESSAGES = 100  # per producer, persisted before the bookies stop
HELD_MESSAGES = 2_500  # per producer, sent while they are stopped: 80 MiB each, 20 times the buffer
# Bookies stay stopped for less than the ledger client's add timeout (10 s):
# the adds in flight wait, nothing fails over.
PAUSED_S = 6.0
# What the broker may grow by while its bookies are stopped: the buffer,
# what one read of its producers' connection brings past it, the entries
# being written (each batch is in memory as its frame's body and as the
# entry sent to the bookies), and the allocator's slack. Without the bound
# it took everything the producers sent: some 160 MiB.
RSS_GROWTH_MAX = 48 * MIB


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def payload(producer: int, number: int) -> bytes:
    label = f"{producer}:{number}:".encode()
    return label + b"x" * (MESSAGE_BYTES - len(label))


async def test_producers_are_held_back_while_the_bookies_are_stopped_and_nothing_is_lost_or_doubled(
        zk_hosts, zk_root, bookies, brokers):
    stopped = [await bookies.started() for _ in range(3)]
    metrics_port = free_port()
    broker = await brokers.started("--publish-buffer-bytes", str(PUBLISH_BUFFER_BYTES), "--metrics-port", str(metrics_port),
                                   "--entry-cache-bytes", str(8 * MIB))
    total = PRODUCERS * (WARM_UP_MESSAGES + HELD_MESSAGES)
    async with Client.connect(zk_hosts, zk_root) as client:
        await client.create_topic("held-back", partitions=2)
        consumer = await client.subscribe("held-back", "audit", initial_position="earliest", receiver_queue_size=200)
        producers = [await client.create_producer("held-back", producer_id=f"held-{index}", batching=True,
                                                  batch_bytes_max=BATCH_BYTES_MAX, pending_messages_max=HELD_MESSAGES + 1)
                     for index in range(PRODUCERS)]
        for index, producer in enumerate(producers):
            for number in range(WARM_UP_MESSAGES):
                await producer.send_async(payload(index, number), key=f"k{number % 8}")
            await producer.flush()
        baseline_rss = resident_bytes(broker.process.pid)

        # Every bookie stops; the producers send 20 times the buffer's bound.
        for bookie in stopped:
            bookie.pause()
        futures = []
        try:
            for index, producer in enumerate(producers):
                for number in range(WARM_UP_MESSAGES, WARM_UP_MESSAGES + HELD_MESSAGES):
                    futures.append(await producer.send_async(payload(index, number), key=f"k{number % 8}"))

            async def paused() -> bool:
                return value(await scrape_async(metrics_port), "quire_broker_publish_buffer_pauses_total") >= 1

            await wait_until_async(paused, deadline_s=PAUSED_S / 2, what="the publish buffer passing its bound", poll_s=0.1)
            highest_buffer, highest_rss = 0.0, 0
            with trio.move_on_after(PAUSED_S / 2):
                while True:
                    samples = await scrape_async(metrics_port)
                    highest_buffer = max(highest_buffer, value(samples, "quire_broker_publish_buffer_bytes"))
                    highest_rss = max(highest_rss, resident_bytes(broker.process.pid))
                    await trio.sleep(0.1)
        finally:
            for bookie in stopped:
                bookie.resume()
        # Held back: the broker took no more than its bound and one read of
        # the producers' connection past it; the rest waits in the producers.
        assert PUBLISH_BUFFER_BYTES / 2 < highest_buffer <= PUBLISH_BUFFER_BYTES + 2 * BATCH_BYTES_MAX, highest_buffer
        assert highest_rss - baseline_rss <= RSS_GROWTH_MAX, \
            f"the broker grew by {(highest_rss - baseline_rss) / MIB:.0f} MiB while its bookies were stopped"

        # The bookies are back: every message is persisted, the buffer drains.
        with trio.fail_after(120):
            for future in futures:
                await future.wait()

        async def drained() -> bool:
            return value(await scrape_async(metrics_port), "quire_broker_publish_buffer_bytes") == 0

        await wait_until_async(drained, deadline_s=10, what="the publish buffer drained", poll_s=0.1)

        # Exactly once: each message once, in order per producer and key.
        seen = collections.Counter()
        order = collections.defaultdict(list)
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                while sum(seen.values()) < total:
                    message = await consumer.receive()
                    producer_index, number, _ = message.data.split(b":", 2)
                    seen[(int(producer_index), int(number))] += 1
                    order[(int(producer_index), message.key)].append(int(number))
                    nursery.start_soon(consumer.acknowledge, message)
        assert set(seen) == {(index, number) for index in range(PRODUCERS)
                             for number in range(WARM_UP_MESSAGES + HELD_MESSAGES)}
        assert max(seen.values()) == 1, "a message was persisted twice"
        for key, numbers in order.items():
            assert numbers == sorted(numbers), f"messages of {key} out of order"
        with trio.move_on_after(2):
            extra = await consumer.receive()
            pytest.fail(f"a message came twice: {extra.data[:20]!r}")
