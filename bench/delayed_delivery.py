"""Benchmark: delayed delivery of many messages spread over minutes.

3 bookies and 1 broker on loopback, E=3 WQ=3 AQ=2. A producer (quire's
client) sends `--messages` messages of 100 bytes as fast as it can, each
due at a time drawn evenly over `--spread` seconds that start once they
are all sent (at 4,000 messages/s or more); a Shared
consumer receives and acknowledges them. Measured: how late each message
came after its time (none may come early), and the broker's RSS, sampled
every second, against the delayed index's memory bound (100,000 messages
per subscription; past it they are spilled to disk in runs sorted by time).

    .venv/bin/python -m bench.delayed_delivery                 # 1,000,000 over 10 minutes
    .venv/bin/python -m bench.delayed_delivery --messages 100000 --spread 120s

Prints one JSON object per result, then a summary: the target is on-time
delivery p99 at most 100 ms late, and no message early.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import time

import trio

from bench.cluster import bench_cluster, latency_summary, rss_mb
from broker.client import Client
from broker.errors import BrokerError
from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, Parser
from quire.progress import Progress

LATE_P99_MS_MAX = 100.0
MESSAGE_BYTES = 100
TOPIC = "delayed-bench"
DUE = struct.Struct(">q")  # the message's delivery time, in front of its payload
RSS_SAMPLE_S = 1.0
PUBLISH_RATE_MIN = 4_000  # messages per second the producer is assumed to reach at least


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/delayed_delivery.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=Bounded("integer", 1, 10_000_000, why="a bench's patience"), default=1_000_000,
                        help="delayed messages sent")
    parser.add_argument("--spread", type=ranges.interval, default=600_000, metavar="DURATION",
                        help="their delivery times are spread evenly over this (default 10m)")
    parser.add_argument("--seed", type=ranges.seed, default=1, help="the delivery times' random seed")
    return parser


async def run(zk_hosts: str, root: str, broker_pid: int, arguments: argparse.Namespace) -> list[dict]:
    count, spread_ms = arguments.messages, arguments.spread
    rng = random.Random(arguments.seed)
    lateness_ms: list[float] = []
    early = 0
    refused = 0  # acknowledgements the broker refused
    rss_samples: list[float] = []
    published = trio.Event()
    publish_s = 0.0

    async with Client.connect(zk_hosts, root) as client:
        await client.create_topic(TOPIC, ensemble_size=3, write_quorum=3, ack_quorum=2)
        consumer = await client.subscribe(TOPIC, "work", "shared", receiver_queue_size=5_000)
        producer = await client.create_producer(TOPIC, "bench", pending_messages_max=10_000)
        # Every message is due after the publishing ends (at an assumed
        # PUBLISH_RATE_MIN): lateness measures the holding back, not the
        # queue of messages still being sent.
        start_ms = int(time.time() * 1000) + int(count / PUBLISH_RATE_MIN * 1000)
        rss_before = rss_mb(broker_pid)

        async def produce() -> None:
            nonlocal publish_s
            began = time.perf_counter()
            futures = []
            for _ in range(count):
                due_ms = start_ms + rng.randrange(spread_ms)
                futures.append(await producer.send_async(DUE.pack(due_ms) + b"x" * (MESSAGE_BYTES - DUE.size),
                                                         deliver_at_ms=due_ms))
                if len(futures) >= 10_000:
                    for future in futures:
                        await future.wait()
                    futures.clear()
            for future in futures:
                await future.wait()
            publish_s = time.perf_counter() - began
            published.set()

        async def acknowledge(message) -> None:
            nonlocal refused
            try:
                await consumer.acknowledge(message)
            except BrokerError:
                refused += 1

        async def sample_rss() -> None:
            while True:
                rss_samples.append(rss_mb(broker_pid))
                await trio.sleep(RSS_SAMPLE_S)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            nursery.start_soon(sample_rss)
            with Progress("delayed messages received", total=count, unit="messages") as progress:
                received = 0
                while received < count:
                    message = await consumer.receive()
                    now_ms = time.time() * 1000
                    due_ms = DUE.unpack_from(message.data)[0]
                    if now_ms < due_ms:
                        early += 1
                    lateness_ms.append(max(0.0, now_ms - due_ms))
                    nursery.start_soon(acknowledge, message)
                    received += 1
                    if received % 1000 == 0:
                        progress.update(received)
            await published.wait()
            nursery.cancel_scope.cancel()
    if publish_s > count / PUBLISH_RATE_MIN:
        raise RuntimeError(f"publishing took {publish_s:.0f} s: messages were due before they were sent "
                           f"(the producer reached {count / publish_s:.0f} messages/s, below {PUBLISH_RATE_MIN})")
    parameters = {"messages": count, "spread_s": spread_ms / 1000, "message_bytes": MESSAGE_BYTES,
                  "delayed_index_max": 100_000, "due_from_s": round(count / PUBLISH_RATE_MIN, 1)}
    return [
        {"name": "delayed_delivery_lateness", "parameters": parameters, "early_messages": early, "acks_refused": refused,
         "published_per_s": round(count / publish_s, 1) if publish_s else None, "lateness": "ms after the delivery time",
         **latency_summary(lateness_ms), "latency_ms_max": round(max(lateness_ms), 1)},
        {"name": "delayed_delivery_broker_rss", "parameters": parameters, "rss_mb_before": round(rss_before, 1),
         "rss_mb_max": round(max(rss_samples), 1), "rss_mb_last": round(rss_samples[-1], 1)},
    ]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    with bench_cluster(3, broker_count=1) as cluster:
        broker_pid = cluster.brokers[0][1].pid
        results = trio.run(run, cluster.zk_hosts, cluster.root, broker_pid, arguments)
    for value in results:
        print(json.dumps(value), flush=True)
    lateness = results[0]
    print(json.dumps({"name": "delayed_delivery_summary", "late_ms_p99_max": LATE_P99_MS_MAX,
                      "late_ms_p99": lateness["latency_ms_p99"], "early_messages": lateness["early_messages"],
                      "rss_mb_max": results[1]["rss_mb_max"],
                      "met": {"on_time_p99": lateness["latency_ms_p99"] <= LATE_P99_MS_MAX,
                              "never_early": lateness["early_messages"] == 0}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
