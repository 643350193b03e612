"""Benchmark: a broker's memory while millions of small messages pass, against
its entry cache (`--entry-cache-bytes`), which must bound it.

3 bookies and 1 broker process on loopback, E=3 WQ=3 AQ=2, deduplication on.
`quire produce` sends `--messages` messages of `--message-bytes` bytes
without batching (one entry each: the case where the objects around an
entry cost ten times its bytes), and `quire consume` receives and
acknowledges each one, individually, at the same time. The broker's RSS is
read from /proc every `--sample-interval` seconds.

    .venv/bin/python -m bench.broker_memory [--messages 5000000] [--entry-cache-bytes 64MiB 16MiB]

Prints one JSON object per cache size: RSS before (the broker serving,
nothing sent), peak, and plateau (the highest RSS over the second half of
the messages), RSS at each tenth of the messages, and whether it levelled
off below 2x the cache. Then a summary with the target. Sizes in MiB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from bench.cluster import bench_cluster, rss_mb
from broker.client import Client
from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, Parser
from quire.progress import Progress

TOPIC = "memory"
PLATEAU_CACHE_RATIO_MAX = 2.0  # the target: RSS levels off below this many times the cache
LEVELLED_GROWTH_FRACTION = 0.02  # the last quarter's peak may pass the third quarter's by this much of the plateau
STATS_INTERVAL_S = 2.0
MIB = 1024 * 1024


@dataclass
class Sample:
    elapsed_s: float
    rss_mb: float
    messages_in: int
    messages_out: int


def quire_command(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "quire", *arguments, "--log-level", "warning"]


async def pass_messages(cluster, arguments: argparse.Namespace, entry_cache_bytes: int) -> tuple[float, list[Sample]]:
    """Produce and consume the messages; the broker's RSS before, and samples while they pass."""
    address, broker = cluster.brokers[0]
    count = arguments.messages
    logs = cluster.directory
    async with Client.connect(cluster.zk_hosts, cluster.root) as client:
        await client.create_topic(TOPIC, ensemble_size=3, write_quorum=3, ack_quorum=2, deduplication=True)
        before = rss_mb(broker.pid)
        with open(logs / "produce.log", "wb") as produce_log, open(logs / "consume.log", "wb") as consume_log:
            producer = subprocess.Popen(
                quire_command("produce", TOPIC, "--service-url", address, "--count", str(count),
                              "--size", str(arguments.message_bytes), "--producer-id", "memory"),
                stdout=produce_log, stderr=subprocess.STDOUT)
            consumer = subprocess.Popen(
                quire_command("consume", TOPIC, "--service-url", address, "--subscription", "memory", "--count", str(count)),
                stdout=subprocess.DEVNULL, stderr=consume_log)
            try:
                samples = await sample_until_done(client, broker, producer, consumer, arguments, entry_cache_bytes)
            finally:
                for process in (producer, consumer):
                    if process.poll() is None:
                        process.kill()
                        process.wait()
        for name, process in (("produce", producer), ("consume", consumer)):
            if process.returncode != 0:
                tail = (logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"quire {name} exited with {process.returncode}: {tail}")
    return before, samples


async def sample_until_done(client: Client, broker: subprocess.Popen, producer: subprocess.Popen, consumer: subprocess.Popen,
                            arguments: argparse.Namespace, entry_cache_bytes: int) -> list[Sample]:
    samples: list[Sample] = []
    messages_in = messages_out = 0
    began = time.monotonic()
    next_stats = began
    with Progress(f"{arguments.messages} messages through a broker with a {entry_cache_bytes / MIB:g} MiB cache",
                  total=arguments.messages, unit="msg") as progress:
        while producer.poll() is None or consumer.poll() is None:
            if broker.poll() is not None:
                raise RuntimeError(f"the broker exited with {broker.returncode}")
            now = time.monotonic()
            if now >= next_stats:
                next_stats = now + STATS_INTERVAL_S
                stats = (await client.topic_stats(TOPIC))["partitions"][TOPIC]
                messages_in, messages_out = stats["messages_in"], stats["messages_out"]
                progress.update(messages_out)
            samples.append(Sample(round(now - began, 1), rss_mb(broker.pid), messages_in, messages_out))
            await trio.sleep(arguments.sample_interval)
    samples.append(Sample(round(time.monotonic() - began, 1), rss_mb(broker.pid), arguments.messages, arguments.messages))
    return samples


def summarize(before: float, samples: list[Sample], arguments: argparse.Namespace, entry_cache_bytes: int) -> dict:
    count = arguments.messages

    def peak_between(low: float, high: float) -> float:
        """The highest RSS while the messages consumed were in [low, high) of all."""
        inside = [sample.rss_mb for sample in samples if low * count <= sample.messages_out < high * count]
        return max(inside, default=samples[-1].rss_mb)

    plateau = max(peak_between(0.5, 0.75), peak_between(0.75, 1.01))
    late_growth = peak_between(0.75, 1.01) - peak_between(0.5, 0.75)
    levelled = late_growth <= LEVELLED_GROWTH_FRACTION * plateau
    cache_mb = entry_cache_bytes / MIB
    elapsed_s = samples[-1].elapsed_s
    return {
        "name": "broker_memory",
        "parameters": {
            "messages": count, "message_bytes": arguments.message_bytes, "entry_cache_bytes": entry_cache_bytes,
            "batching": False, "acknowledgement": "individual", "ensemble": "3/3/2", "deduplication": True,
        },
        "messages": count,
        "elapsed_s": elapsed_s,
        "messages_per_s": round(count / elapsed_s, 1) if elapsed_s > 0 else None,
        "rss_mb": {
            "before": round(before, 1),
            "peak": round(max(sample.rss_mb for sample in samples), 1),
            "plateau": round(plateau, 1),
            "samples": len(samples),
            "by_tenth_of_messages": [round(peak_between(tenth / 10, (tenth + 1) / 10), 1) for tenth in range(10)],
        },
        "entry_cache_mb": round(cache_mb, 1),
        "plateau_over_before_mb": round(plateau - before, 1),
        "plateau_to_cache": round(plateau / cache_mb, 2),
        # What the messages added, for caches small next to the idle process (~40 MB).
        "plateau_over_before_to_cache": round((plateau - before) / cache_mb, 2),
        "late_growth_mb": round(late_growth, 1),
        "levelled_off": levelled,
        "met": levelled and plateau < PLATEAU_CACHE_RATIO_MAX * cache_mb,
    }


# Small messages are what this measures: what each costs besides its payload.
MESSAGE_BYTES_MAX = MIB


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/broker_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=ranges.bench_messages, default=5_000_000, help="messages sent through the broker")
    parser.add_argument("--message-bytes", type=Bounded("size", 1, MESSAGE_BYTES_MAX, why="small messages are what this measures"),
                        default=8, help="size of each message")
    parser.add_argument("--entry-cache-bytes", type=ranges.memory_bytes, nargs="+", default=[64 * MIB], metavar="BYTES",
                        help="the broker's --entry-cache-bytes; one run each (default 64MiB)")
    parser.add_argument("--sample-interval", type=ranges.bench_seconds, default=1.0, help="seconds between two readings of the broker's RSS")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    results = []
    for entry_cache_bytes in arguments.entry_cache_bytes:
        with bench_cluster(3, broker_count=1, broker_options=["--entry-cache-bytes", str(entry_cache_bytes)],
                           base=Path(".bench")) as cluster:
            before, samples = trio.run(pass_messages, cluster, arguments, entry_cache_bytes)
        results.append(summarize(before, samples, arguments, entry_cache_bytes))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({
        "name": "broker_memory_summary",
        "plateau_mb": {str(result["parameters"]["entry_cache_bytes"]): result["rss_mb"]["plateau"] for result in results},
        "targets": {"plateau_to_cache_max": PLATEAU_CACHE_RATIO_MAX, "levelled_off": True},
        "met": all(result["met"] for result in results),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
