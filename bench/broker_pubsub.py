"""Benchmark: publishing and consuming through a broker, against the
reference a user would otherwise pick (NATS JetStream).

3 bookies and 1 broker on loopback, E=3 WQ=3 AQ=2, 1 KiB messages,
deduplication on (every producer has a producer id), one client:
- publish throughput and publish latency (send to receipt), batching off
  and on, `--window` messages in flight;
- end-to-end latency (publish to a subscribed consumer's receive, each
  message acknowledged) at a steady `--e2e-rate` messages/s and at a light
  `--e2e-light-rate`, with the CPU each process used per message;
- consumption of a backlog of `--backlog` messages (1M by default), acknowledged;
then the same publish and backlog workloads against a 3-node JetStream
cluster (file storage, 3 replicas) through nats-py, in the same run.

    .venv/bin/python -m bench.broker_pubsub

Prints one JSON object per result, then a summary with the targets:
publish >= 30,000 msg/s with batching and >= 1.5x JetStream; backlog
consumption >= 250,000 msg/s; end-to-end p50 <= 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import sys
import time

import trio

from bench.cluster import BenchCluster, bench_cluster, cpu_percent_between, latency_summary, role_cpu_seconds
from bench.ledger_write import jetstream_cluster
from broker.client import Client
from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, Parser
from quire.progress import Progress

TOPIC_POLICIES = {"ensemble_size": 3, "write_quorum": 3, "ack_quorum": 2, "deduplication": True}


def result(name: str, parameters: dict, count: int, elapsed_s: float, message_bytes: int, latencies_ms: list[float]) -> dict:
    return {
        "name": name,
        "parameters": parameters,
        "messages": count,
        "messages_per_s": round(count / elapsed_s, 1) if elapsed_s > 0 else None,
        "mb_per_s": round(count * message_bytes / elapsed_s / 1e6, 2) if elapsed_s > 0 else None,
        **latency_summary(latencies_ms),
    }


# --- quire -------------------------------------------------------------------------


async def publish(client: Client, topic: str, *, batching: bool, window: int, message_bytes: int, seconds: float,
                  warmup_s: float, label: str) -> dict:
    producer = await client.create_producer(topic, f"bench-{topic}", batching=batching, batch_delay_ms=1.0,
                                            pending_messages_max=window)
    payload = os.urandom(message_bytes)
    latencies: list[float] = []
    measured = 0
    began = time.perf_counter()
    measure_from = began + warmup_s
    deadline = measure_from + seconds
    errors: dict[str, int] = {}

    def settled(started: float, future) -> None:
        nonlocal measured
        try:
            future.result()
        except Exception as error:
            errors[type(error).__name__] = errors.get(type(error).__name__, 0) + 1
            return
        if started >= measure_from:
            latencies.append((time.perf_counter() - started) * 1000)
            measured += 1

    with Progress(label, total=warmup_s + seconds, unit="s") as progress:
        last_progress = began
        while (now := time.perf_counter()) < deadline:
            if now - last_progress > 0.25:
                progress.update(now - began)
                last_progress = now
            future = await producer.send_async(payload)
            future.add_done_callback(functools.partial(settled, now))
        ended = time.perf_counter()
        await producer.flush()
    await producer.close()
    assert not errors, errors
    return result("broker_publish", {"batching": batching, "window": window, "message_bytes": message_bytes,
                                     "seconds": seconds, **TOPIC_POLICIES},
                  measured, ended - measure_from, message_bytes, latencies)


async def end_to_end(client: Client, topic: str, *, rate: int, message_bytes: int, seconds: float,
                     cluster: BenchCluster | None = None) -> dict:
    consumer = await client.subscribe(topic, "e2e", initial_position="latest")
    producer = await client.create_producer(topic, f"bench-{topic}")
    latencies: list[float] = []
    sent_at: dict[int, float] = {}
    total = int(rate * seconds)

    async def receive_all() -> None:
        async with trio.open_nursery() as acks:
            while len(latencies) < total:
                message = await consumer.receive()
                number = int.from_bytes(message.data[:8], "big")
                latencies.append((time.perf_counter() - sent_at.pop(number)) * 1000)
                acks.start_soon(consumer.acknowledge, message)

    filler = os.urandom(message_bytes - 8)
    publish_latencies: list[float] = []

    def published(started: float, future) -> None:
        publish_latencies.append((time.perf_counter() - started) * 1000)

    cpu_before, began_s = role_cpu_seconds(cluster), time.perf_counter()
    with Progress(f"end-to-end at {rate} msg/s", total=total, unit="msg") as progress:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive_all)
            began = time.perf_counter()
            for number in range(total):
                target = began + number / rate
                delay = target - time.perf_counter()
                if delay > 0:
                    await trio.sleep(delay)
                sent_at[number] = now = time.perf_counter()
                future = await producer.send_async(number.to_bytes(8, "big") + filler)
                future.add_done_callback(functools.partial(published, now))
                if number % 200 == 0:
                    progress.update(number)
    elapsed_s, cpu_after = time.perf_counter() - began_s, role_cpu_seconds(cluster)
    await producer.close()
    await consumer.close()
    outcome = result("broker_end_to_end", {"rate": rate, "message_bytes": message_bytes, "seconds": seconds, "ack": "each message"},
                     total, seconds, message_bytes, latencies)
    # The publish half of it: send to receipt.
    outcome.update({f"publish_{name}": value for name, value in latency_summary(publish_latencies).items()})
    # What each message cost, and how busy the machine's cores were:
    # latency at a steady rate is also a measure of queueing for them.
    used_s = sum(cpu_after.values()) - sum(cpu_before.values())
    outcome["cpu_percent"] = cpu_percent_between(cpu_before, cpu_after, elapsed_s)
    outcome["cpu_percent_total"] = round(used_s / elapsed_s * 100, 1)
    outcome["cpu_ms_per_message"] = round(used_s / total * 1000, 3) if total else None
    return outcome


async def fill(client: Client, topic: str, count: int, message_bytes: int) -> None:
    producer = await client.create_producer(topic, f"filler-{topic}", batching=True, batch_delay_ms=2.0,
                                            pending_messages_max=20_000)
    payload = os.urandom(message_bytes)
    with Progress(f"writing a backlog of {count} messages", total=count, unit="msg") as progress:
        futures = []
        for number in range(count):
            futures.append(await producer.send_async(payload))
            if len(futures) >= 10_000:
                for future in futures:
                    await future.wait()
                futures.clear()
                progress.update(number + 1)
        for future in futures:
            await future.wait()
    await producer.close()


async def consume_backlog(client: Client, topic: str, count: int, message_bytes: int, receiver_queue: int) -> dict:
    consumer = await client.subscribe(topic, "backlog", initial_position="earliest", receiver_queue_size=receiver_queue)
    received = 0
    began = time.perf_counter()
    with Progress(f"consuming a backlog of {count} messages", total=count, unit="msg") as progress:
        async with trio.open_nursery() as acks:
            while received < count:
                message = await consumer.receive()
                received += 1
                if received % 1000 == 0:
                    # Cumulative acknowledgement of every thousand (one
                    # partition: offsets are in order).
                    acks.start_soon(consumer.acknowledge_cumulative, message)
                    progress.update(received)
            await consumer.acknowledge_cumulative(message)
    elapsed = time.perf_counter() - began
    await consumer.close()
    return result("broker_backlog_consume", {"messages": count, "message_bytes": message_bytes, "ack": "cumulative every 1,000",
                                             "receiver_queue": receiver_queue},
                  received, elapsed, message_bytes, [])


async def run_quire(zk_hosts: str, root: str, arguments: argparse.Namespace, cluster: BenchCluster | None = None) -> dict[str, dict]:
    results = {}
    async with Client.connect(zk_hosts, root) as client:
        for topic in ("publish-plain", "publish-batched", "e2e", "e2e-light", "backlog"):
            await client.create_topic(topic, **TOPIC_POLICIES)
        for batching in (False, True):
            name = "batched" if batching else "plain"
            window = arguments.batch_window if batching else arguments.window
            results[f"publish_{name}"] = await publish(
                client, f"publish-{name}", batching=batching, window=window, message_bytes=arguments.message_bytes,
                seconds=arguments.seconds, warmup_s=arguments.warmup_seconds, label=f"quire publish, batching {'on' if batching else 'off'}",
            )
            print(json.dumps(results[f"publish_{name}"]), flush=True)
        results["end_to_end"] = await end_to_end(client, "e2e", rate=arguments.e2e_rate, message_bytes=arguments.message_bytes,
                                                 seconds=arguments.seconds, cluster=cluster)
        print(json.dumps(results["end_to_end"]), flush=True)
        if arguments.e2e_light_rate:
            results["end_to_end_light"] = await end_to_end(client, "e2e-light", rate=arguments.e2e_light_rate,
                                                           message_bytes=arguments.message_bytes, seconds=arguments.seconds,
                                                           cluster=cluster)
            print(json.dumps(results["end_to_end_light"]), flush=True)
        await fill(client, "backlog", arguments.backlog, arguments.message_bytes)
        results["backlog"] = await consume_backlog(client, "backlog", arguments.backlog, arguments.message_bytes,
                                                   arguments.receiver_queue)
        print(json.dumps(results["backlog"]), flush=True)
    return results


# --- NATS JetStream ---------------------------------------------------------------------


async def jetstream_run(servers: list[str], arguments: argparse.Namespace) -> dict[str, dict]:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, StorageType

    nc = await nats.connect(servers=servers)
    results = {}
    try:
        js = nc.jetstream(publish_async_max_pending=arguments.batch_window)
        deadline = time.monotonic() + 60
        for stream in ("PUBLISH", "BACKLOG"):
            while True:  # the cluster elects its JetStream leader first
                try:
                    await js.add_stream(name=stream, subjects=[stream.lower()], num_replicas=3, storage=StorageType.FILE)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        payload = os.urandom(arguments.message_bytes)
        # Publishing: nats-py's pipelined publish, `window` in flight, a
        # message id per message (JetStream's deduplication, as ours is on).
        room = asyncio.Semaphore(arguments.batch_window)
        latencies: list[float] = []
        measured = 0
        began = time.perf_counter()
        measure_from = began + arguments.warmup_seconds
        end = measure_from + arguments.seconds

        def done(started: float, future: asyncio.Future) -> None:
            nonlocal measured
            room.release()
            if future.exception() is None and started >= measure_from:
                latencies.append((time.perf_counter() - started) * 1000)
                measured += 1

        number = 0
        while time.perf_counter() < end:
            await room.acquire()
            started = time.perf_counter()
            future = await js.publish_async("publish", payload, headers={"Nats-Msg-Id": f"bench-{number}"})
            number += 1
            future.add_done_callback(lambda f, started=started: done(started, f))
        ended = time.perf_counter()
        for _ in range(arguments.batch_window):
            await room.acquire()
        results["publish"] = result("jetstream_publish", {"window": arguments.batch_window, "message_bytes": arguments.message_bytes,
                                                          "replicas": 3, "storage": "file", "deduplication": "Nats-Msg-Id",
                                                          "note": "JetStream acknowledges before fsync"},
                                    measured, ended - measure_from, arguments.message_bytes, latencies)
        print(json.dumps(results["publish"]), flush=True)
        # The backlog: written pipelined, then read by a pull consumer in
        # batches of 1,000, acknowledging the last of each (AckPolicy.ALL:
        # cumulative, as our benchmark consumer does).
        futures = []
        for index in range(arguments.backlog):
            futures.append(await js.publish_async("backlog", payload))
            if len(futures) >= arguments.batch_window:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
        subscription = await js.pull_subscribe("backlog", "reader", config=ConsumerConfig(ack_policy=AckPolicy.ALL, max_ack_pending=-1))
        received = 0
        began = time.perf_counter()
        while received < arguments.backlog:
            messages = await subscription.fetch(1000, timeout=10)
            received += len(messages)
            await messages[-1].ack()
        elapsed = time.perf_counter() - began
        results["backlog"] = result("jetstream_backlog_consume", {"messages": arguments.backlog, "fetch": 1000,
                                                                  "ack": "AckPolicy.ALL, last of each fetch"},
                                    received, elapsed, arguments.message_bytes, [])
        print(json.dumps(results["backlog"]), flush=True)
    finally:
        await nc.close()
    return results


def run_jetstream(arguments: argparse.Namespace) -> dict[str, dict]:
    with jetstream_cluster() as servers, Progress("jetstream publish and backlog", total=None, unit="s"):
        return asyncio.run(jetstream_run(servers, arguments))


# --- main ----------------------------------------------------------------------------------


# Each message carries its send time (8 bytes) for the end-to-end latency.
MESSAGE_BYTES_MIN = 8


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/broker_pubsub.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=ranges.bench_seconds, default=10.0, help="measured seconds of each publish run")
    parser.add_argument("--warmup-seconds", type=ranges.warmup_seconds, default=2.0, help="seconds of publishing before measuring")
    parser.add_argument("--window", type=ranges.in_flight, default=1000, help="messages in flight when publishing without batching")
    parser.add_argument("--batch-window", type=ranges.in_flight, default=10_000,
                        help="messages in flight when publishing with batching (and JetStream's publish_async window)")
    parser.add_argument("--message-bytes", type=Bounded("size", MESSAGE_BYTES_MIN, ranges.MESSAGE_BYTES_MAX,
                                                        why="the largest message a producer sends"),
                        default=1024, help="size of each message")
    parser.add_argument("--e2e-rate", type=ranges.count, default=1000, help="messages/s of the end-to-end latency run")
    parser.add_argument("--e2e-light-rate", type=Bounded("integer", 0, 1_000_000), default=100,
                        help="messages/s of a second end-to-end run, at light load (0: none)")
    parser.add_argument("--backlog", type=ranges.bench_backlog, default=1_000_000, help="messages of the backlog read")
    parser.add_argument("--receiver-queue", type=ranges.window, default=20_000,
                        help="the backlog consumer's receiver queue (messages it may hold; batches hold ~1,000)")
    parser.add_argument("--skip-jetstream", action="store_true")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    with bench_cluster(3, broker_count=1) as cluster:
        quire = trio.run(run_quire, cluster.zk_hosts, cluster.root, arguments, cluster)
    summary: dict = {
        "name": "broker_pubsub_summary",
        "publish_batched_messages_per_s": quire["publish_batched"]["messages_per_s"],
        "publish_plain_messages_per_s": quire["publish_plain"]["messages_per_s"],
        "end_to_end_latency_ms_p50": quire["end_to_end"]["latency_ms_p50"],
        "end_to_end_latency_ms_p99": quire["end_to_end"]["latency_ms_p99"],
        "backlog_messages_per_s": quire["backlog"]["messages_per_s"],
    }
    light = quire.get("end_to_end_light")
    targets = {"publish_batched_messages_per_s_min": 30_000, "backlog_messages_per_s_min": 250_000,
               "end_to_end_latency_ms_p50_max": 2.0}
    met = {
        "publish_batched": summary["publish_batched_messages_per_s"] >= 30_000,
        "backlog": summary["backlog_messages_per_s"] >= 250_000,
        "end_to_end": (summary["end_to_end_latency_ms_p50"] or math.inf) <= 2.0,
    }
    if light is not None:
        summary["end_to_end_light_latency_ms_p50"] = light["latency_ms_p50"]
        met["end_to_end_light"] = (light["latency_ms_p50"] or math.inf) <= 2.0
    if not arguments.skip_jetstream:
        jetstream = run_jetstream(arguments)
        summary["jetstream_publish_messages_per_s"] = jetstream["publish"]["messages_per_s"]
        summary["jetstream_backlog_messages_per_s"] = jetstream["backlog"]["messages_per_s"]
        summary["publish_ratio_to_jetstream"] = round(summary["publish_batched_messages_per_s"] / jetstream["publish"]["messages_per_s"], 3)
        summary["backlog_ratio_to_jetstream"] = round(summary["backlog_messages_per_s"] / jetstream["backlog"]["messages_per_s"], 3)
        targets["publish_ratio_to_jetstream_min"] = 1.5
        met["publish_ratio_to_jetstream"] = summary["publish_ratio_to_jetstream"] >= 1.5
    summary["targets"] = targets
    summary["met"] = met
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
