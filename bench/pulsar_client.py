"""Benchmark: the official Pulsar client (`pulsar-client`, its C++ core)
against a quire cluster through the broker's Pulsar listener, in the same
run as NATS JetStream (3 nodes, R3, file storage, through nats-py) and
quire's own client through quire's protocol.

3 bookies and 1 broker on loopback, E=3 WQ=3 AQ=2, 1 KiB messages,
deduplication on (quire's default):
- Pulsar client: asynchronous publishing with batching (`--window` in
  flight), sequential `send()` latency, and consumption of a backlog of
  `--backlog` messages (acknowledged cumulatively every 1,000);
- quire's client: publishing with batching, and the same backlog read;
- JetStream: pipelined publishing and the backlog read (bench/broker_pubsub.py's).

    .venv/bin/python -m bench.pulsar_client

Prints one JSON object per result, then a summary with the targets: Pulsar
client publishing >= 40,000 msg/s and >= 2x JetStream; sequential send
p50 <= 1.5 ms; backlog consumption >= 100,000 msg/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import trio

from bench.broker_pubsub import TOPIC_POLICIES, consume_backlog, fill, publish, result, run_jetstream
from bench.cluster import bench_cluster, free_port
from broker.client import Client
from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, Parser
from quire.progress import Progress

SEQUENTIAL_SENDS = 3_000  # sends of the sequential latency run
BACKLOG_ACK_EVERY = 1_000  # messages between two cumulative acknowledgements
LATENCY_SAMPLE_EVERY = 64  # messages between two whose publish latency is measured


def _client(url: str, client_options: dict | None = None):
    import pulsar

    return pulsar.Client(url, operation_timeout_seconds=60, io_threads=2, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
                         **(client_options or {}))


def pulsar_publish(url: str, topic: str, arguments: argparse.Namespace, client_options: dict | None = None) -> dict:
    """send_async with batching: `window` messages in flight, callbacks timing each.
    `client_options`: more of pulsar.Client's (authentication, TLS)."""
    import pulsar

    client = _client(url, client_options)
    try:
        producer = client.create_producer(topic, producer_name="bench-pulsar", batching_enabled=True,
                                          batching_max_messages=1_000, batching_max_publish_delay_ms=1,
                                          max_pending_messages=arguments.window, block_if_queue_full=True,
                                          compression_type=pulsar.CompressionType.NONE)
        payload = os.urandom(arguments.message_bytes)
        latencies: list[float] = []
        failures = []
        lock = threading.Lock()
        began = time.perf_counter()
        measure_from = began + arguments.warmup_seconds
        deadline = measure_from + arguments.seconds

        def sent(started: float, outcome, message_id) -> None:
            if outcome != pulsar.Result.Ok:
                failures.append(outcome)
            elif started >= measure_from:
                elapsed_ms = (time.perf_counter() - started) * 1000
                with lock:
                    latencies.append(elapsed_ms)

        counted = 0
        with Progress("Pulsar client publish, batching on", total=arguments.warmup_seconds + arguments.seconds, unit="s") as progress:
            last = began
            number = 0
            while (now := time.perf_counter()) < deadline:
                # A callback into Python for every message would make this
                # client, not the broker, the bottleneck (each takes the
                # GIL from the loop): latency is sampled, one message in
                # LATENCY_SAMPLE_EVERY, and failures surface in flush().
                if number % LATENCY_SAMPLE_EVERY == 0:
                    producer.send_async(payload, lambda outcome, message_id, started=now: sent(started, outcome, message_id))
                else:
                    producer.send_async(payload, None)
                number += 1
                if now >= measure_from:
                    counted += 1
                if now - last > 0.25:
                    progress.update(now - began)
                    last = now
            producer.flush()  # every message persisted
            ended = time.perf_counter()
        producer.close()
        assert not failures, failures[:5]
        # Throughput: the messages handed over while measuring, all
        # persisted by the end of the flush that follows.
        return result("pulsar_client_publish", {"batching": True, "window": arguments.window,
                                                "message_bytes": arguments.message_bytes, "seconds": arguments.seconds,
                                                "latency_sampled_every": LATENCY_SAMPLE_EVERY, **TOPIC_POLICIES},
                      counted, ended - measure_from, arguments.message_bytes, latencies)
    finally:
        client.close()


def pulsar_sequential(url: str, topic: str, arguments: argparse.Namespace, client_options: dict | None = None) -> dict:
    """One send() at a time, each waiting for its receipt (no batching)."""
    client = _client(url, client_options)
    try:
        producer = client.create_producer(topic, producer_name="bench-pulsar-sequential", batching_enabled=False)
        payload = os.urandom(arguments.message_bytes)
        for _ in range(200):  # warm the connection and the ledger
            producer.send(payload)
        latencies = []
        began = time.perf_counter()
        with Progress("Pulsar client sequential send()", total=SEQUENTIAL_SENDS, unit="msg") as progress:
            for number in range(SEQUENTIAL_SENDS):
                started = time.perf_counter()
                producer.send(payload)
                latencies.append((time.perf_counter() - started) * 1000)
                if number % 200 == 0:
                    progress.update(number)
        elapsed = time.perf_counter() - began
        producer.close()
        return result("pulsar_client_sequential_send", {"batching": False, "message_bytes": arguments.message_bytes},
                      SEQUENTIAL_SENDS, elapsed, arguments.message_bytes, latencies)
    finally:
        client.close()


def pulsar_backlog(url: str, topic: str, arguments: argparse.Namespace) -> dict:
    """Write a backlog with the Pulsar client, then read it from the earliest
    message with a receiver queue of `--receiver-queue`, acknowledging
    cumulatively every 1,000."""
    import pulsar

    client = _client(url)
    try:
        consumer = client.subscribe(topic, "backlog", initial_position=pulsar.InitialPosition.Earliest,
                                    receiver_queue_size=arguments.receiver_queue)
        producer = client.create_producer(topic, producer_name="bench-pulsar-filler", batching_enabled=True,
                                          batching_max_messages=1_000, batching_max_publish_delay_ms=2,
                                          max_pending_messages=20_000, block_if_queue_full=True)
        payload = os.urandom(arguments.message_bytes)
        with Progress(f"writing a backlog of {arguments.backlog} messages (Pulsar client)", total=arguments.backlog, unit="msg") as progress:
            for number in range(arguments.backlog):
                producer.send_async(payload, None)
                if number % 10_000 == 0:
                    progress.update(number)
            producer.flush()
        producer.close()
        received = 0
        began = time.perf_counter()
        with Progress(f"consuming a backlog of {arguments.backlog} messages (Pulsar client)", total=arguments.backlog, unit="msg") as progress:
            while received < arguments.backlog:
                message = consumer.receive(60_000)
                received += 1
                if received % BACKLOG_ACK_EVERY == 0:
                    consumer.acknowledge_cumulative(message)
                    progress.update(received)
            consumer.acknowledge_cumulative(message)
        elapsed = time.perf_counter() - began
        consumer.close()
        return result("pulsar_client_backlog_consume", {"messages": arguments.backlog, "message_bytes": arguments.message_bytes,
                                                        "ack": "cumulative every 1,000", "receiver_queue": arguments.receiver_queue},
                      received, elapsed, arguments.message_bytes, [])
    finally:
        client.close()


async def quire_client_runs(zk_hosts: str, root: str, arguments: argparse.Namespace) -> dict[str, dict]:
    """quire's own client through its protocol: batched publishing and the backlog read."""
    results = {}
    async with Client.connect(zk_hosts, root) as client:
        for topic in ("quire-publish", "quire-backlog"):
            await client.create_topic(topic, **TOPIC_POLICIES)
        results["publish"] = await publish(client, "quire-publish", batching=True, window=arguments.window,
                                           message_bytes=arguments.message_bytes, seconds=arguments.seconds,
                                           warmup_s=arguments.warmup_seconds, label="quire client publish, batching on")
        print(json.dumps(results["publish"]), flush=True)
        await fill(client, "quire-backlog", arguments.backlog, arguments.message_bytes)
        results["backlog"] = await consume_backlog(client, "quire-backlog", arguments.backlog, arguments.message_bytes,
                                                   arguments.receiver_queue)
        print(json.dumps(results["backlog"]), flush=True)
    return results


async def create_topics(zk_hosts: str, root: str, names: list[str]) -> None:
    async with Client.connect(zk_hosts, root) as client:
        for name in names:
            await client.create_topic(name, **TOPIC_POLICIES)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/pulsar_client.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=ranges.bench_seconds, default=10.0, help="measured seconds of each publish run")
    parser.add_argument("--warmup-seconds", type=ranges.warmup_seconds, default=2.0, help="seconds of publishing before measuring")
    parser.add_argument("--window", type=ranges.in_flight, default=10_000,
                        help="messages in flight when publishing (and JetStream's publish_async window)")
    parser.add_argument("--message-bytes", type=Bounded("size", 1, ranges.MESSAGE_BYTES_MAX,
                                                        why="the largest message a producer sends"),
                        default=1024, help="size of each message")
    parser.add_argument("--backlog", type=ranges.bench_backlog, default=500_000, help="messages of each backlog read")
    parser.add_argument("--receiver-queue", type=ranges.window, default=20_000, help="the backlog consumers' receiver queue")
    parser.add_argument("--skip-jetstream", action="store_true")
    parser.add_argument("--skip-quire-client", action="store_true")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    pulsar_port = free_port()
    url = f"pulsar://127.0.0.1:{pulsar_port}"
    results: dict[str, dict] = {}
    with bench_cluster(3, broker_count=1, broker_options=["--pulsar-port", str(pulsar_port)]) as cluster:
        trio.run(create_topics, cluster.zk_hosts, cluster.root, ["pulsar-publish", "pulsar-sequential", "pulsar-backlog"])
        for name, run in (("publish", pulsar_publish), ("sequential", pulsar_sequential), ("backlog", pulsar_backlog)):
            results[name] = run(url, f"persistent://public/default/pulsar-{name}", arguments)
            print(json.dumps(results[name]), flush=True)
        quire = None if arguments.skip_quire_client else trio.run(quire_client_runs, cluster.zk_hosts, cluster.root, arguments)
    summary: dict = {
        "name": "pulsar_client_summary",
        "pulsar_publish_messages_per_s": results["publish"]["messages_per_s"],
        "pulsar_publish_latency_ms_p50": results["publish"]["latency_ms_p50"],
        "pulsar_sequential_send_latency_ms_p50": results["sequential"]["latency_ms_p50"],
        "pulsar_sequential_send_latency_ms_p99": results["sequential"]["latency_ms_p99"],
        "pulsar_backlog_messages_per_s": results["backlog"]["messages_per_s"],
    }
    targets = {"pulsar_publish_messages_per_s_min": 40_000, "pulsar_sequential_send_latency_ms_p50_max": 1.5,
               "pulsar_backlog_messages_per_s_min": 100_000}
    met = {
        "pulsar_publish": summary["pulsar_publish_messages_per_s"] >= 40_000,
        "pulsar_sequential_send": summary["pulsar_sequential_send_latency_ms_p50"] <= 1.5,
        "pulsar_backlog": summary["pulsar_backlog_messages_per_s"] >= 100_000,
    }
    if quire is not None:
        summary["quire_client_publish_messages_per_s"] = quire["publish"]["messages_per_s"]
        summary["quire_client_backlog_messages_per_s"] = quire["backlog"]["messages_per_s"]
    if not arguments.skip_jetstream:
        jetstream_arguments = argparse.Namespace(batch_window=arguments.window, message_bytes=arguments.message_bytes,
                                                 warmup_seconds=arguments.warmup_seconds, seconds=arguments.seconds,
                                                 backlog=arguments.backlog)
        jetstream = run_jetstream(jetstream_arguments)
        summary["jetstream_publish_messages_per_s"] = jetstream["publish"]["messages_per_s"]
        summary["jetstream_backlog_messages_per_s"] = jetstream["backlog"]["messages_per_s"]
        summary["pulsar_publish_ratio_to_jetstream"] = round(
            summary["pulsar_publish_messages_per_s"] / jetstream["publish"]["messages_per_s"], 3)
        targets["pulsar_publish_ratio_to_jetstream_min"] = 2.0
        met["pulsar_publish_ratio_to_jetstream"] = summary["pulsar_publish_ratio_to_jetstream"] >= 2.0
    summary["targets"] = targets
    summary["met"] = met
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
