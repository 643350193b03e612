"""Benchmark: topic compaction of many messages over fewer keys.

3 bookies and 1 broker on loopback, E=3 WQ=3 AQ=2. A producer (quire's
client, batching) sends `--messages` messages of 100 bytes over `--keys`
keys, round robin; then the topic is compacted (`quire topic compact`'s
admin action) and a read-compacted reader reads the view. Measured: the
compaction's time, the bytes and messages it read per second, the view's
size, and, as the reference measured in the same run, one reader reading
the whole topic (what a consumer that does not read compacted must do to
learn the latest value of each key).

    .venv/bin/python -m bench.compaction                            # 1,000,000 messages, 10,000 keys
    .venv/bin/python -m bench.compaction --messages 100000 --keys 1000

Prints one JSON object per result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import trio

from bench.cluster import bench_cluster
from broker.client import Client
from quire.cli_parsing import Bounded, Parser
from quire.progress import Progress

MESSAGE_BYTES = 100
TOPIC = "compaction-bench"
STATUS_POLL_S = 0.2
READ_IDLE_S = 2.0  # a reader has read everything once nothing came for this long


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/compaction.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=Bounded("integer", 1, 10_000_000, why="a bench's patience"), default=1_000_000,
                        help="messages published before the compaction")
    parser.add_argument("--keys", type=Bounded("integer", 1, 1_000_000, why="compaction's key bound"), default=10_000,
                        help="distinct keys, round robin")
    return parser


async def _read_all(client: Client, count: int, *, read_compacted: bool, label: str) -> tuple[float, dict]:
    """Seconds to read what a reader gets (until `count` messages, or
    nothing more came for READ_IDLE_S), and the latest value of each key."""
    reader = await client.create_reader(TOPIC, receiver_queue_size=5_000, read_compacted=read_compacted)
    latest: dict[str, bytes] = {}
    began = time.perf_counter()
    received = 0
    with Progress(label, total=count, unit="messages") as progress:
        while received < count:
            with trio.move_on_after(READ_IDLE_S):
                message = await reader.receive()
                latest[message.key] = message.data
                received += 1
                if received % 1000 == 0:
                    progress.update(received)
                continue
            break
    await reader.close()
    return time.perf_counter() - began, latest


async def run(zk_hosts: str, root: str, arguments: argparse.Namespace) -> list[dict]:
    count, keys = arguments.messages, arguments.keys
    async with Client.connect(zk_hosts, root) as client:
        await client.create_topic(TOPIC, ensemble_size=3, write_quorum=3, ack_quorum=2)
        producer = await client.create_producer(TOPIC, "bench", batching=True, pending_messages_max=10_000)
        began = time.perf_counter()
        futures = []
        with Progress("messages published", total=count, unit="messages") as progress:
            for index in range(count):
                payload = b"%d:" % index
                futures.append(await producer.send_async(payload + b"x" * (MESSAGE_BYTES - len(payload)),
                                                         key=f"key-{index % keys}"))
                if len(futures) >= 10_000:
                    for future in futures:
                        await future.wait()
                    futures.clear()
                    progress.update(index + 1)
            for future in futures:
                await future.wait()
        publish_s = time.perf_counter() - began

        began = time.perf_counter()
        await client.compact(TOPIC)
        while True:
            status = (await client.compaction_status(TOPIC))[TOPIC]
            if not status["running"]:
                break
            await trio.sleep(STATUS_POLL_S)
        compaction_s = time.perf_counter() - began
        if status["status"] != "SUCCESS":
            raise RuntimeError(f"the compaction failed: {status['last_error']}")

        view_s, view = await _read_all(client, keys, read_compacted=True, label="compacted view read")
        full_s, everything = await _read_all(client, count, read_compacted=False, label="whole topic read")
    if view != everything or len(view) != keys:
        raise RuntimeError(f"the compacted view ({len(view)} keys) differs from the latest values read from the topic "
                           f"({len(everything)} keys)")
    parameters = {"messages": count, "keys": keys, "message_bytes": MESSAGE_BYTES, "batching": True}
    megabytes = status["bytes_read"] / 1e6
    return [
        {"name": "compaction", "parameters": parameters, "seconds": round(compaction_s, 2),
         "duration_ms_broker": status["duration_ms"], "megabytes_read": round(megabytes, 1),
         "throughput_mb_per_s": round(megabytes / compaction_s, 1),
         "throughput_messages_per_s": round(status["messages_read"] / compaction_s),
         "view_messages": status["messages"], "view_entries": status["entries"], "view_bytes": status["bytes"],
         "published_per_s": round(count / publish_s)},
        {"name": "compaction_view_read", "parameters": parameters, "seconds": round(view_s, 2),
         "throughput_messages_per_s": round(len(view) / view_s)},
        {"name": "compaction_reference_whole_topic_read", "parameters": parameters, "seconds": round(full_s, 2),
         "throughput_messages_per_s": round(count / full_s),
         "reference": "a reader that does not read compacted: every message, to learn the latest of each key"},
    ]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    with bench_cluster(3, broker_count=1) as cluster:
        results = trio.run(run, cluster.zk_hosts, cluster.root, arguments)
    for value in results:
        print(json.dumps(value), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
