"""Benchmark: cost curves as the work grows. Each curve changes one thing
over a few points and measures throughput, latency, memory and ZooKeeper's
load at each, to show where quire bends.

3 bookies on loopback unless the curve varies them, E=3 WQ=3 AQ=2, fsync
on, 1 KiB entries unless the curve varies the size:

- `entry_size`: 100 B to 64 KiB, one ledger, `--window` adds in flight:
  adds/s and MB/s, against this disk's sequential 64 KiB write + fdatasync
  bandwidth, measured in the same run;
- `open_ledgers`: 1 to 10,000 ledgers open in one client, adds spread
  over them round-robin, `--in-flight` in all: adds/s, the client's RSS
  and the bookies';
- `topics`: 1 to 10,000 topics on one broker, publishing spread over them:
  msg/s and the broker's RSS; then the broker is restarted (SIGTERM, a new
  process with the same arguments) and every topic loaded again by a first
  send: how long until every one is answered;
- `subscriptions`: 1 to 10,000 durable subscriptions over at most 10
  topics, each consumer taking a backlog and acknowledging every message,
  one by one, at full speed: durable acks/s, ZooKeeper's transactions/s
  and CPU (each acknowledgement batch of a subscription is a cursor write);
- `bookies`: 3 to 6 bookies, 6 ledgers written at once: adds/s;
- `catchup_reads`: a closed ledger of `--catchup-bytes` per entry size
  (100 B to 16 KiB) read back from the start: entries/s and MB/s.

    .venv/bin/python -m bench.scaling [--curves topics,bookies] [--quick]

Prints one JSON object per point (`scaling_<curve>`), then one summary per
curve (`scaling_<curve>_summary`) listing its points and the bend: the
first point whose throughput fell below 90% of the first point's. Writes
one PNG per curve to `--out-dir` (with matplotlib, if installed). A point
gets a fresh cluster wherever state would carry over (ledgers, topics,
subscriptions, RSS); `entry_size` and `catchup_reads` share one.

(Longer than our ~600 lines: six curves, each a few short phases, kept in
one module so that they share one measuring loop and one summary.)
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import trio

from bench.cluster import (
    BenchCluster,
    bench_cluster,
    cpu_seconds,
    latency_summary,
    rss_mb,
    start_process,
    wait_broker_serving,
)
from broker.client import BrokerError, Client
from coordination.zk_launcher import ZooKeeperServer, four_letter_word, stop_children
from ledger_client.bookkeeper import BookKeeper
from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, Parser, human_size
from quire.progress import Progress

PASSWORD = b"bench"
KIB, MIB = 1024, 1024 * 1024
ENSEMBLE_SIZE, WRITE_QUORUM, ACK_QUORUM = 3, 3, 2
TOPIC_POLICIES = {"ensemble_size": ENSEMBLE_SIZE, "write_quorum": WRITE_QUORUM, "ack_quorum": ACK_QUORUM}
ENTRY_BYTES = KIB  # every curve but the two that vary the size

CURVES = ("entry_size", "open_ledgers", "topics", "subscriptions", "bookies", "catchup_reads")
POINTS = {
    "entry_size": (100, KIB, 4 * KIB, 16 * KIB, 64 * KIB),
    "open_ledgers": (1, 10, 100, 1_000, 10_000),
    "topics": (1, 10, 100, 1_000, 10_000),
    "subscriptions": (1, 10, 100, 1_000, 10_000),
    "bookies": (3, 4, 5, 6),
    "catchup_reads": (100, KIB, 4 * KIB, 16 * KIB),
}
QUICK_POINTS = {
    "entry_size": (100, 4 * KIB, 64 * KIB),
    "open_ledgers": (1, 100),
    "topics": (1, 100),
    "subscriptions": (1, 100),
    "bookies": (3, 4),
    "catchup_reads": (100, 16 * KIB),
}
# What each curve varies (a key of each point's parameters) and the
# throughput its bend is judged by.
X_FIELD = {"entry_size": "entry_bytes", "open_ledgers": "ledgers", "topics": "topics", "subscriptions": "subscriptions",
           "bookies": "bookies", "catchup_reads": "entry_bytes"}
RATE_FIELD = {"entry_size": "entries_per_s", "open_ledgers": "entries_per_s", "topics": "messages_per_s",
              "subscriptions": "acks_per_s", "bookies": "entries_per_s", "catchup_reads": "entries_per_s"}
# The panels of each curve's plot: (y axis, [(field, label)]); the summary lists the same fields.
PANELS = {
    "entry_size": [("MB/s", [("mb_per_s", "quire (entries' bytes)"), ("disk_mb_per_s", "quire's journals (WQ copies, one disk)"),
                             ("reference_mb_per_s", "sequential 64 KiB write + fdatasync")]),
                   ("adds/s", [("entries_per_s", "quire")])],
    "open_ledgers": [("adds/s", [("entries_per_s", "all ledgers")]),
                     ("RSS MiB", [("client_rss_mb", "client"), ("bookie_rss_mb_total", "bookies (sum)")])],
    "topics": [("msg/s", [("messages_per_s", "publish, all topics")]), ("RSS MiB", [("broker_rss_mb", "broker")]),
               ("seconds", [("reload_s", "every topic loaded after a restart"), ("load_s", "every topic loaded first")])],
    "subscriptions": [("per second", [("acks_per_s", "acks (durable)"), ("acks_taken_per_s", "acks taken (the consumers' calls)")]),
                      ("ZooKeeper transactions/s", [("zk_transactions_per_s", "all (cursor writes, mostly)")]),
                      ("CPU %", [("zk_cpu_percent", "ZooKeeper"), ("broker_cpu_percent", "broker"),
                                 ("client_cpu_percent", "client")])],
    "bookies": [("adds/s", [("entries_per_s", "6 ledgers")]),
                ("CPU %", [("bookie_cpu_percent", "bookies (sum)"), ("client_cpu_percent", "client")])],
    "catchup_reads": [("MB/s", [("mb_per_s", "read")]), ("entries/s", [("entries_per_s", "read")])],
}
BEND_FRACTION = 0.9

# --- bounds -------------------------------------------------------------------------------

# Ledgers, topics, producers or subscriptions being made at once: each is a
# few ZooKeeper writes, and ZooKeeper takes them one after the other anyway.
CREATE_CONCURRENCY = 64
SPREAD_LEDGERS = 6  # ledgers of the bookies curve, written at once so that they spread over the bookies
SUBSCRIPTION_TOPICS_MAX = 10  # the subscriptions are spread over this many topics
# Messages all consumers together hold ahead of the application (1 KiB
# each): each consumer's receiver queue is its share, within 2..1,000.
RECEIVER_QUEUE_MESSAGES_TOTAL = 100_000
RECEIVER_QUEUE_MIN, RECEIVER_QUEUE_MAX = 2, 1_000
# Acknowledgements taken and not yet known durable, all consumers together
# (each its share, at least ACKS_PENDING_MIN): a consumer past its share
# waits for its oldest to be durable.
ACKS_PENDING_TOTAL = 200_000
ACKS_PENDING_MIN = 10
# Messages per batch of the subscriptions' backlog, as a fraction of a
# consumer's receiver queue: a batch is delivered whole, so a batch as
# large as the queue would leave one entry in flight per consumer at a time.
BATCHES_PER_RECEIVER_QUEUE = 4
# The subscriptions' backlog holds this many acknowledgements per second of
# the span (warm-up included), more than one client process makes (one
# consumer made 100,000 a second here): the consumers should not run dry; a
# result says how many did. A backlog, not producers running alongside: a
# producer at full speed starved the consumers of its topic (5,000 acks/s).
ACKS_PER_S_CEILING = 150_000
BACKLOG_MESSAGES_MIN = 100  # per topic
FILL_WINDOW = 10_000  # backlog messages in flight per producer while writing it
CATCHUP_WRITE_WINDOW = 1_000
CATCHUP_BYTES_DEFAULT, CATCHUP_BYTES_QUICK = 64 * MIB, 16 * MIB
REFERENCE_SECONDS = 2.0
REFERENCE_BLOCK_BYTES = 64 * KIB
REFERENCE_FILE_BYTES_MAX = 1024 * MIB  # the probe file stops there, even on a disk faster than 500 MB/s
SETTLE_S_MAX = 120  # what is in flight when a span ends settles within this (the client's add timeout is shorter)
ACKS_SETTLE_S_MAX = 30  # acknowledgements taken within the span become durable within this after it
BROKER_STOP_S_MAX = 300  # a broker unloading 10,000 topics on SIGTERM
BROKER_SERVING_S_MAX = 120
ZOOKEEPER_PROBE_S = 5.0
PROGRESS_EVERY_S = 0.25
TOPICS_MAX = 100_000  # topics or subscriptions one point makes: ZooKeeper nodes, open ledgers, consumers in one process

POINT_TYPES = {
    "entry_size": ranges.entry_bytes,
    "open_ledgers": ranges.bench_ledgers,
    "topics": Bounded("integer", 1, TOPICS_MAX, why="topics one point creates and loads on one broker"),
    "subscriptions": Bounded("integer", 1, TOPICS_MAX, why="consumers one client process holds"),
    "bookies": Bounded("integer", ENSEMBLE_SIZE, ranges.LOCAL_PROCESSES_MAX, why="processes on one machine"),
    "catchup_reads": ranges.entry_bytes,
}


# --- arguments ------------------------------------------------------------------------------


def curve_names(text: str) -> list[str]:
    """'topics,bookies': curves to run, each once, in the order given."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CURVES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown curve {','.join(unknown) or repr(text)}; the curves: {','.join(CURVES)}")
    return list(dict.fromkeys(names))


def curve_points(text: str) -> tuple[str, list[int]]:
    """'topics=1,100,1000': the points of one curve, each in that curve's range."""
    curve, separator, values = text.partition("=")
    curve = curve.strip()
    if not separator or curve not in CURVES:
        raise argparse.ArgumentTypeError(f"expected CURVE=V,V... with CURVE one of {','.join(CURVES)}, got {text[:40]!r}")
    try:
        return curve, [POINT_TYPES[curve](value) for value in values.split(",")]
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"each point of {curve} {error}") from None


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/scaling.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--curves", type=curve_names, default=",".join(CURVES), metavar="NAME,NAME...",
                        help="comma-separated curves to run")
    parser.add_argument("--quick", action="store_true",
                        help="a few small points per curve and smaller catch-up ledgers: a smoke run of a few minutes")
    parser.add_argument("--points", type=curve_points, action="append", default=[], metavar="CURVE=V,V...",
                        help="the points of one curve instead of its own (repeatable), e.g. topics=1,1000 or entry_size=1KiB,1MiB")
    parser.add_argument("--seconds", type=ranges.bench_seconds, default=5.0, help="measured seconds of each point")
    parser.add_argument("--warmup-seconds", type=ranges.warmup_seconds, default=1.0, help="seconds of load before measuring")
    parser.add_argument("--window", type=ranges.in_flight, default=256, help="adds in flight on the one ledger of entry_size")
    parser.add_argument("--in-flight", type=ranges.in_flight, default=1000,
                        help="adds or messages in flight in all, spread over the ledgers or topics (open_ledgers, topics, bookies)")
    parser.add_argument("--catchup-bytes", type=ranges.positive_storage_bytes, default=None,
                        help=f"size of each catch-up ledger (default {human_size(CATCHUP_BYTES_DEFAULT)}, "
                             f"{human_size(CATCHUP_BYTES_QUICK)} with --quick)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the PNGs go, scaling_CURVE.png (default: bench/, next to RESULTS.md)")
    return parser


# --- measuring ------------------------------------------------------------------------------


def emit(result: dict) -> None:
    print(json.dumps(result), flush=True)


def zookeeper_zxid(zk: ZooKeeperServer) -> int:
    """ZooKeeper's last transaction id (`srvr`): one more per write, session and close."""
    answer = four_letter_word(zk.host, zk.port, "srvr", ZOOKEEPER_PROBE_S)
    match = re.search(r"^Zxid: (0x[0-9a-fA-F]+)", answer, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"ZooKeeper's srvr gave no Zxid: {answer[:200]!r}")
    return int(match.group(1), 16)


def usage_sample(cluster: BenchCluster) -> dict:
    return {
        "at": time.perf_counter(),
        "zxid": zookeeper_zxid(cluster.zk),
        "zookeeper": cpu_seconds(cluster.zk.pid),
        "bookies": [cpu_seconds(process.pid) for _, process in cluster.bookies],
        "brokers": [cpu_seconds(process.pid) for _, process in cluster.brokers],
        "client": time.process_time(),
    }


def usage_between(first: dict, last: dict) -> dict:
    """ZooKeeper's transactions, and each process's CPU (100% = one core), between two samples."""
    span_s = last["at"] - first["at"]

    def percent(before: float | None, after: float | None) -> float | None:
        return None if before is None or after is None else round((after - before) / span_s * 100, 1)

    def summed(values: list[float | None]) -> float | None:
        return None if None in values else sum(values)

    usage = {
        "zk_transactions": last["zxid"] - first["zxid"],
        "zk_transactions_per_s": round((last["zxid"] - first["zxid"]) / span_s, 1),
        "zk_cpu_percent": percent(first["zookeeper"], last["zookeeper"]),
        "bookie_cpu_percent": percent(summed(first["bookies"]), summed(last["bookies"])),
        "client_cpu_percent": percent(first["client"], last["client"]),
    }
    if first["brokers"]:
        usage["broker_cpu_percent"] = percent(summed(first["brokers"]), summed(last["brokers"]))
    return usage


async def measure_usage(cluster: BenchCluster, measure_from: float, deadline: float, into: dict) -> None:
    await trio.sleep(max(0.0, measure_from - time.perf_counter()))
    first = await trio.to_thread.run_sync(usage_sample, cluster)
    await trio.sleep(max(0.0, deadline - time.perf_counter()))
    last = await trio.to_thread.run_sync(usage_sample, cluster)
    into.update(usage_between(first, last))


async def measured(cluster: BenchCluster, arguments: argparse.Namespace,
                   load: Callable[[float, float], Awaitable[dict]]) -> dict:
    """`load(measure_from, deadline)` (perf_counter times) after a warm-up,
    with the cluster's CPU and ZooKeeper's transactions over the measured span."""
    began = time.perf_counter()
    measure_from = began + arguments.warmup_seconds
    deadline = measure_from + arguments.seconds
    usage: dict = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(measure_usage, cluster, measure_from, deadline, usage)
        result = await load(measure_from, deadline)
    result.update(usage)
    return result


def process_rss(process: subprocess.Popen) -> float | None:
    try:
        return round(rss_mb(process.pid), 1)
    except (FileNotFoundError, ProcessLookupError, RuntimeError):
        return None  # the process is gone


def cluster_rss(cluster: BenchCluster) -> dict:
    bookies = [process_rss(process) for _, process in cluster.bookies]
    rss = {"bookie_rss_mb": bookies, "bookie_rss_mb_total": round(sum(value for value in bookies if value is not None), 1)}
    if cluster.brokers:
        rss["broker_rss_mb"] = process_rss(cluster.brokers[0][1])
    return rss


def client_rss() -> float:
    return round(rss_mb(os.getpid()), 1)


async def run_concurrently(items: Sequence, make_one: Callable[[Any], Awaitable[Any]], label: str, unit: str) -> tuple[list, float]:
    """`make_one(item)` for every item, CREATE_CONCURRENCY at a time: the
    results, in the items' order, and the seconds it all took."""
    results: list = [None] * len(items)
    work = iter(enumerate(items))  # shared by the workers: each item taken once
    finished = 0
    began = time.perf_counter()
    with Progress(label, total=len(items), unit=unit) as progress:
        async def worker() -> None:
            nonlocal finished
            for index, item in work:
                results[index] = await make_one(item)
                finished += 1
                progress.update(finished)

        async with trio.open_nursery() as nursery:
            for _ in range(min(CREATE_CONCURRENCY, len(items))):
                nursery.start_soon(worker)
    return results, time.perf_counter() - began


class Tally:
    """Operations started within the measured span, their latencies, and errors by type."""

    def __init__(self, measure_from: float) -> None:
        self.measure_from = measure_from
        self.latencies_ms: list[float] = []
        self.errors: dict[str, int] = {}

    def done(self, started: float, error: BaseException | None) -> None:
        if error is not None:
            self.errors[type(error).__name__] = self.errors.get(type(error).__name__, 0) + 1
        elif started >= self.measure_from:
            self.latencies_ms.append((time.perf_counter() - started) * 1000)

    def result(self, unit: str, elapsed_s: float, item_bytes: int) -> dict:
        count = len(self.latencies_ms)
        return {unit: count, f"{unit}_per_s": round(count / elapsed_s, 1),
                "mb_per_s": round(count * item_bytes / elapsed_s / 1e6, 2),
                **latency_summary(self.latencies_ms), "errors": self.errors}


async def spread_load(targets: list, submit: Callable[[Any, Callable[[float], Callable]], Awaitable[None]], *, in_flight: int,
                      measure_from: float, deadline: float, label: str, unit: str, item_bytes: int) -> dict:
    """Round-robin over `targets` until `deadline`, `in_flight` at most in
    all: `submit(target, on_done_for(started))` hands one over; the
    completion callback frees its room (bench/ledger_write.py's way)."""
    room = trio.Semaphore(in_flight)
    tally = Tally(measure_from)

    def on_done_for(started: float) -> Callable:
        def on_done(error: BaseException | None) -> None:
            room.release()
            tally.done(started, error)
        return on_done

    began = last_progress = time.perf_counter()
    index = 0
    with Progress(label, total=deadline - began, unit="s") as progress:
        while (now := time.perf_counter()) < deadline:
            if now - last_progress > PROGRESS_EVERY_S:
                progress.update(now - began)
                last_progress = now
            try:
                room.acquire_nowait()  # no scheduling point while there is room
            except trio.WouldBlock:
                await room.acquire()
            await submit(targets[index % len(targets)], on_done_for(time.perf_counter()))
            index += 1
        ended = time.perf_counter()
        with trio.fail_after(SETTLE_S_MAX):
            for _ in range(in_flight):  # every one settled
                await room.acquire()
    return tally.result(unit, ended - measure_from, item_bytes)


def add_load(handles: list, payload: bytes, in_flight: int, measure_from: float, deadline: float, label: str) -> Awaitable[dict]:
    async def submit(handle, on_done: Callable) -> None:
        await handle.submit_add(payload, lambda pending: on_done(pending.error))

    return spread_load(handles, submit, in_flight=in_flight, measure_from=measure_from, deadline=deadline,
                       label=label, unit="entries", item_bytes=len(payload))


def publish_load(producers: list, payload: bytes, in_flight: int, measure_from: float, deadline: float, label: str) -> Awaitable[dict]:
    def settled(on_done: Callable, future) -> None:
        try:
            future.result()
        except BrokerError as error:
            on_done(error)
            return
        on_done(None)

    async def submit(producer, on_done: Callable) -> None:
        future = await producer.send_async(payload)
        future.add_done_callback(functools.partial(settled, on_done))

    return spread_load(producers, submit, in_flight=in_flight, measure_from=measure_from, deadline=deadline,
                       label=label, unit="messages", item_bytes=len(payload))


def point(curve: str, arguments: argparse.Namespace, parameters: dict, result: dict) -> dict:
    return {"name": f"scaling_{curve}",
            "parameters": {**parameters, "ensemble": ENSEMBLE_SIZE, "write_quorum": WRITE_QUORUM, "ack_quorum": ACK_QUORUM,
                           "seconds": arguments.seconds, "warmup_seconds": arguments.warmup_seconds},
            **result}


async def create_ledgers(bk: BookKeeper, count: int, label: str) -> tuple[list, float]:
    return await run_concurrently(range(count), lambda _: bk.create_ledger(ENSEMBLE_SIZE, WRITE_QUORUM, ACK_QUORUM, password=PASSWORD),
                                  label, "ledgers")


# --- entry_size ---------------------------------------------------------------------------


def sequential_write_reference(directory: Path) -> dict:
    """The disk's bandwidth for what a journal does: append 64 KiB and
    fdatasync, again and again, for REFERENCE_SECONDS."""
    path = directory / "sequential-write-probe"
    block = os.urandom(REFERENCE_BLOCK_BYTES)
    written = 0
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        began = time.perf_counter()
        while time.perf_counter() - began < REFERENCE_SECONDS and written < REFERENCE_FILE_BYTES_MAX:
            written += os.write(fd, block)
            os.fdatasync(fd)
        elapsed = time.perf_counter() - began
    finally:
        os.close(fd)
        path.unlink()
    return {"name": "scaling_entry_size_reference",
            "parameters": {"block_bytes": REFERENCE_BLOCK_BYTES, "pattern": "append, fdatasync after each block"},
            "mb_per_s": round(written / elapsed / 1e6, 2), "bytes": written, "seconds": round(elapsed, 2)}


async def entry_size_point(cluster: BenchCluster, arguments: argparse.Namespace, entry_bytes: int) -> dict:
    async with BookKeeper.connect(cluster.zk_hosts, cluster.root, pending_adds_max=arguments.window) as bk:
        handle = await bk.create_ledger(ENSEMBLE_SIZE, WRITE_QUORUM, ACK_QUORUM, password=PASSWORD)
        result = await measured(cluster, arguments, lambda measure_from, deadline: add_load(
            [handle], os.urandom(entry_bytes), arguments.window, measure_from, deadline, f"entry_size {size_label(entry_bytes)}"))
        await handle.close()
    return point("entry_size", arguments, {"entry_bytes": entry_bytes, "window": arguments.window, "ledgers": 1}, result)


def run_entry_size(arguments: argparse.Namespace, points: Sequence[int], results: list[dict]) -> None:
    with bench_cluster(3) as cluster:
        reference = sequential_write_reference(cluster.directory)
        emit(reference)
        for entry_bytes in points:
            result = trio.run(entry_size_point, cluster, arguments, entry_bytes)
            result["reference_mb_per_s"] = reference["mb_per_s"]
            # Every bookie of the write quorum journals the entry, here all on one disk.
            result["disk_mb_per_s"] = round(result["mb_per_s"] * WRITE_QUORUM, 2)
            result["fraction_of_reference"] = round(result["disk_mb_per_s"] / reference["mb_per_s"], 3) if reference["mb_per_s"] else None
            emit(result)
            results.append(result)


# --- open_ledgers -----------------------------------------------------------------------------


async def open_ledgers_point(cluster: BenchCluster, arguments: argparse.Namespace, count: int) -> dict:
    rss_before = client_rss()
    async with BookKeeper.connect(cluster.zk_hosts, cluster.root, pending_adds_max=arguments.in_flight) as bk:
        handles, create_s = await create_ledgers(bk, count, f"open_ledgers: creating {count} ledgers")
        rss_open = client_rss()
        result = await measured(cluster, arguments, lambda measure_from, deadline: add_load(
            handles, os.urandom(ENTRY_BYTES), arguments.in_flight, measure_from, deadline, f"open_ledgers {count}"))
        result.update(client_rss_mb=client_rss(), client_rss_mb_open=rss_open, client_rss_mb_before=rss_before,
                      client_rss_mb_growth=round(client_rss() - rss_before, 1), **cluster_rss(cluster),
                      create_seconds=round(create_s, 2), ledgers_created_per_s=round(count / create_s, 1))
        # The ledgers are left open: the cluster goes with the point, and
        # closing 10,000 would cost as many ZooKeeper writes as creating them.
    return point("open_ledgers", arguments, {"ledgers": count, "in_flight": arguments.in_flight, "entry_bytes": ENTRY_BYTES,
                                             "create_concurrency": CREATE_CONCURRENCY}, result)


def run_open_ledgers(arguments: argparse.Namespace, points: Sequence[int], results: list[dict]) -> None:
    for count in points:
        with bench_cluster(3) as cluster:
            result = trio.run(open_ledgers_point, cluster, arguments, count)
        emit(result)
        results.append(result)


# --- topics ---------------------------------------------------------------------------------


async def topics_load(cluster: BenchCluster, arguments: argparse.Namespace, names: list[str]) -> dict:
    async with Client.connect(cluster.zk_hosts, cluster.root) as client:
        _, create_s = await run_concurrently(names, lambda name: client.create_topic(name, **TOPIC_POLICIES),
                                             f"topics: creating {len(names)} topics", "topics")
        # A producer's arrival loads its topic on the broker (a new ledger each).
        producers, load_s = await run_concurrently(
            names, lambda name: client.create_producer(name, batching=False, pending_messages_max=arguments.in_flight),
            f"topics: loading {len(names)} topics", "topics")
        rss_loaded = cluster_rss(cluster)["broker_rss_mb"]
        result = await measured(cluster, arguments, lambda measure_from, deadline: publish_load(
            producers, os.urandom(ENTRY_BYTES), arguments.in_flight, measure_from, deadline, f"topics {len(names)}"))
        result.update(create_seconds=round(create_s, 2), load_s=round(load_s, 2), broker_rss_mb_loaded=rss_loaded,
                      **cluster_rss(cluster))
    return result


def restart_broker(cluster: BenchCluster) -> dict:
    """SIGTERM to the broker (it unloads every topic), then a new `quire
    broker run` with the arguments bench_cluster gave it, serving."""
    address, process = cluster.brokers[0]
    began = time.perf_counter()
    stop_children([process], deadline_s=BROKER_STOP_S_MAX)
    stop_s = time.perf_counter() - began
    port = address.rpartition(":")[2]
    replacement = start_process("broker", cluster.directory / "broker-1",
                                ["--zk", cluster.zk_hosts, "--root", cluster.root, "--port", port])
    cluster.brokers[0] = (address, replacement)  # bench_cluster stops this one
    trio.run(wait_broker_serving, address, replacement, BROKER_SERVING_S_MAX)
    return {"broker_stop_s": round(stop_s, 2), "broker_stop_status": process.returncode}


async def topics_reload(cluster: BenchCluster, names: list[str]) -> dict:
    payload = os.urandom(ENTRY_BYTES)
    async with Client.connect(cluster.zk_hosts, cluster.root) as client:
        # Serving is not registered yet: wait until a client finds the broker.
        with trio.fail_after(BROKER_SERVING_S_MAX):
            while True:
                try:
                    if await client.brokers():
                        break
                except BrokerError:
                    pass
                await trio.sleep(0.1)
        latencies_ms: list[float] = []

        async def first_send(name: str) -> None:
            started = time.perf_counter()
            producer = await client.create_producer(name, batching=False)
            await producer.send(payload)
            latencies_ms.append((time.perf_counter() - started) * 1000)

        _, reload_s = await run_concurrently(names, first_send, f"topics: loading {len(names)} topics after the restart", "topics")
    return {"reload_s": round(reload_s, 2), "reload_topics_per_s": round(len(names) / reload_s, 1),
            **{f"reload_{name}": value for name, value in latency_summary(latencies_ms).items()},
            "broker_rss_mb_reloaded": cluster_rss(cluster)["broker_rss_mb"]}


def run_topics(arguments: argparse.Namespace, points: Sequence[int], results: list[dict]) -> None:
    for count in points:
        names = [f"scaling-{index}" for index in range(count)]
        with bench_cluster(3, broker_count=1) as cluster:
            result = trio.run(topics_load, cluster, arguments, names)
            result.update(restart_broker(cluster))
            result.update(trio.run(topics_reload, cluster, names))
        result = point("topics", arguments, {"topics": count, "in_flight": arguments.in_flight, "message_bytes": ENTRY_BYTES,
                                             "batching": False, "create_concurrency": CREATE_CONCURRENCY}, result)
        emit(result)
        results.append(result)


# --- subscriptions ---------------------------------------------------------------------------


async def fill_topic(client: Client, topic: str, messages: int, batch_messages: int, payload: bytes,
                     filled: Callable[[int], None]) -> None:
    producer = await client.create_producer(topic, batching=True, batch_messages_max=batch_messages, batch_delay_ms=2.0,
                                            pending_messages_max=FILL_WINDOW)
    futures: list = []
    for _ in range(messages):
        futures.append(await producer.send_async(payload))
        if len(futures) >= FILL_WINDOW:
            for future in futures:
                await future.wait()
            filled(len(futures))
            futures.clear()
    for future in futures:
        await future.wait()
    filled(len(futures))
    await producer.close()


class AckTally:
    """The acknowledgements of every consumer of a subscriptions point:
    taken within the measured span (the consumer's call, which only queues
    it) and, of those, durable (the broker wrote the cursor) once settled,
    as the other benchmarks count an add started within the span."""

    def __init__(self, messages_per_consumer: int) -> None:
        self.messages_per_consumer = messages_per_consumer
        self.start = trio.Event()
        self.measure_from = self.deadline = math.inf
        self.taken = 0
        self.durable = 0
        self.latencies_ms: list[float] = []  # taking to durable, of the newest of each batch settled
        self.drained = 0  # consumers that took the whole backlog before the deadline
        self.errors = 0

    def trio_time(self, at: float) -> float:
        return trio.current_time() + at - time.perf_counter()

    async def consume(self, consumer, acks_pending_max: int) -> None:
        """Receive and acknowledge every message, one by one, from `start`
        to the deadline, at most `acks_pending_max` not yet durable."""
        send_channel, receive_channel = trio.open_memory_channel(acks_pending_max)
        received = 0
        async with trio.open_nursery() as nursery:
            await self.start.wait()
            nursery.start_soon(self.settle, receive_channel)
            with send_channel, trio.move_on_at(self.trio_time(self.deadline)):
                # receive() is no scheduling point while messages are queued: the clock is checked too.
                while time.perf_counter() < self.deadline:
                    message = await consumer.receive()
                    acknowledgement = consumer.acknowledge(message)
                    taken_at = time.perf_counter()
                    received += 1
                    self.taken += taken_at >= self.measure_from
                    if received == self.messages_per_consumer:
                        self.drained += 1
                    if not await self.hand_over(send_channel, (taken_at, acknowledgement)):
                        break

    @staticmethod
    async def hand_over(send_channel, item: tuple[float, Awaitable[None]]) -> bool:
        """(taken_at, acknowledgement) to the settling task; False once
        that has stopped (past the deadline and the settling time)."""
        try:
            try:
                send_channel.send_nowait(item)
            except trio.WouldBlock:
                await send_channel.send(item)
            return True
        except trio.BrokenResourceError:
            item[1].close()  # never to be awaited: the cluster goes with the point
            return False
        except trio.Cancelled:
            item[1].close()
            raise

    async def settle(self, receive_channel) -> None:
        """Await the newest acknowledgement handed over and count it durable
        with every one before it: a subscription's cursor writes are made
        one at a time, in order, each with every acknowledgement that came
        before (and awaiting each one would cost a scheduling round per
        acknowledgement). Goes on after the deadline until every one is
        settled, for at most ACKS_SETTLE_S_MAX."""
        with receive_channel:
            with trio.move_on_at(self.trio_time(self.deadline + ACKS_SETTLE_S_MAX)):
                async for taken_at, newest in receive_channel:
                    batch, counted = 1, int(self.measure_from <= taken_at < self.deadline)
                    while True:
                        try:
                            taken_at, following = receive_channel.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        newest.close()  # durable once the one following it is
                        newest = following
                        batch += 1
                        counted += self.measure_from <= taken_at < self.deadline
                    try:
                        await newest
                    except BrokerError:
                        self.errors += batch
                        continue
                    self.durable += counted
                    if counted:
                        self.latencies_ms.append((time.perf_counter() - taken_at) * 1000)
            while True:
                try:
                    receive_channel.receive_nowait()[1].close()  # the cluster goes with the point
                except (trio.WouldBlock, trio.EndOfChannel):
                    break


async def subscriptions_point(cluster: BenchCluster, arguments: argparse.Namespace, count: int) -> dict:
    topic_count = min(SUBSCRIPTION_TOPICS_MAX, count)
    topics = [f"subscribed-{index}" for index in range(topic_count)]
    # Every consumer reads every message of its topic: count * messages
    # acknowledgements are there to be made.
    span_s = arguments.warmup_seconds + arguments.seconds
    messages_per_topic = max(BACKLOG_MESSAGES_MIN, math.ceil(ACKS_PER_S_CEILING * span_s / count))
    receiver_queue = max(RECEIVER_QUEUE_MIN, min(RECEIVER_QUEUE_MAX, RECEIVER_QUEUE_MESSAGES_TOTAL // count))
    batch_messages = max(1, receiver_queue // BATCHES_PER_RECEIVER_QUEUE)
    acks_pending_max = max(ACKS_PENDING_MIN, ACKS_PENDING_TOTAL // count)
    payload = os.urandom(ENTRY_BYTES)
    tally = AckTally(messages_per_topic)
    async with Client.connect(cluster.zk_hosts, cluster.root) as client:
        _, create_s = await run_concurrently(topics, lambda topic: client.create_topic(topic, **TOPIC_POLICIES),
                                             f"subscriptions: creating {topic_count} topics", "topics")
        # Subscribed before the backlog is written, so that every message is
        # kept for them; each consumer holds at most its receiver queue ahead.
        consumers, subscribe_s = await run_concurrently(
            range(count), lambda index: client.subscribe(topics[index % topic_count], f"sub-{index}", initial_position="earliest",
                                                         receiver_queue_size=receiver_queue),
            f"subscriptions: subscribing {count}", "subscriptions")
        fill_began = time.perf_counter()
        with Progress(f"subscriptions: writing a backlog of {messages_per_topic * topic_count} messages",
                      total=messages_per_topic * topic_count, unit="msg") as progress:
            filled = 0

            def count_filled(messages: int) -> None:
                nonlocal filled
                filled += messages
                progress.update(filled)

            async with trio.open_nursery() as fills:
                for topic in topics:
                    fills.start_soon(fill_topic, client, topic, messages_per_topic, batch_messages, payload, count_filled)
        fill_s = time.perf_counter() - fill_began
        async with trio.open_nursery() as nursery:
            for consumer in consumers:
                nursery.start_soon(tally.consume, consumer, acks_pending_max)

            async def load(measure_from: float, deadline: float) -> dict:
                tally.measure_from, tally.deadline = measure_from, deadline
                tally.start.set()
                with Progress(f"subscriptions {count}", total=deadline - time.perf_counter(), unit="s"):
                    await trio.sleep(max(0.0, deadline - time.perf_counter()))
                return {}

            usage = await measured(cluster, arguments, load)
        result = {"acks": tally.durable, "acks_per_s": round(tally.durable / arguments.seconds, 1),
                  "acks_taken_per_s": round(tally.taken / arguments.seconds, 1),
                  **{f"ack_{name}": value for name, value in latency_summary(tally.latencies_ms).items()},
                  "zk_transactions_per_ack": round(usage["zk_transactions"] / tally.durable, 4) if tally.durable else None,
                  # Consumers that ran out of messages before the deadline: with any, acks_per_s is a lower bound.
                  "consumers_drained": tally.drained, "ack_errors": tally.errors, **usage,
                  "create_seconds": round(create_s, 2), "subscribe_seconds": round(subscribe_s, 2),
                  "fill_seconds": round(fill_s, 2), "client_rss_mb": client_rss(), **cluster_rss(cluster)}
    return point("subscriptions", arguments, {
        "subscriptions": count, "topics": topic_count, "backlog_messages_per_topic": messages_per_topic,
        "message_bytes": ENTRY_BYTES, "receiver_queue": receiver_queue, "batch_messages_max": batch_messages,
        "acks_pending_max": acks_pending_max, "subscription_type": "exclusive",
        "ack": "individual, every message; acks_per_s counts those taken within the span, once durable"}, result)


def run_subscriptions(arguments: argparse.Namespace, points: Sequence[int], results: list[dict]) -> None:
    for count in points:
        with bench_cluster(3, broker_count=1) as cluster:
            result = trio.run(subscriptions_point, cluster, arguments, count)
        emit(result)
        results.append(result)


# --- bookies --------------------------------------------------------------------------------


async def bookies_point(cluster: BenchCluster, arguments: argparse.Namespace) -> dict:
    bookie_count = len(cluster.bookies)
    async with BookKeeper.connect(cluster.zk_hosts, cluster.root, pending_adds_max=arguments.in_flight) as bk:
        handles, _ = await create_ledgers(bk, SPREAD_LEDGERS, f"bookies {bookie_count}: creating {SPREAD_LEDGERS} ledgers")
        spread = collections.Counter(str(bookie) for handle in handles for bookie in handle.metadata.ensembles[0][1])
        result = await measured(cluster, arguments, lambda measure_from, deadline: add_load(
            handles, os.urandom(ENTRY_BYTES), arguments.in_flight, measure_from, deadline, f"bookies {bookie_count}"))
        async with trio.open_nursery() as nursery:
            for handle in handles:
                nursery.start_soon(handle.close)
    result.update(ledgers_per_bookie=dict(sorted(spread.items())), **cluster_rss(cluster))
    return point("bookies", arguments, {"bookies": bookie_count, "ledgers": SPREAD_LEDGERS, "in_flight": arguments.in_flight,
                                        "entry_bytes": ENTRY_BYTES}, result)


def run_bookies(arguments: argparse.Namespace, points: Sequence[int], results: list[dict]) -> None:
    for bookie_count in points:
        with bench_cluster(bookie_count) as cluster:
            result = trio.run(bookies_point, cluster, arguments)
        emit(result)
        results.append(result)


# --- catchup_reads --------------------------------------------------------------------------


async def catchup_point(cluster: BenchCluster, arguments: argparse.Namespace, entry_bytes: int, ledger_bytes: int) -> dict:
    entries = max(1, ledger_bytes // entry_bytes)
    payload = os.urandom(entry_bytes)
    label = f"catchup_reads {size_label(entry_bytes)}"
    async with BookKeeper.connect(cluster.zk_hosts, cluster.root, pending_adds_max=CATCHUP_WRITE_WINDOW) as bk:
        handle = await bk.create_ledger(ENSEMBLE_SIZE, WRITE_QUORUM, ACK_QUORUM, password=PASSWORD)
        write_began = time.perf_counter()
        async with handle.writer(window=CATCHUP_WRITE_WINDOW) as writer:
            with Progress(f"{label}: writing", total=entries, unit="entries") as progress:
                for index in range(entries):
                    await writer.add(payload)
                    if index % 10_000 == 0:
                        progress.update(index)
        write_s = time.perf_counter() - write_began
        await handle.close()
        reader = await bk.open_ledger(handle.ledger_id, PASSWORD)
        last = reader.last_add_confirmed
        count = read_bytes = 0
        began = time.perf_counter()
        with Progress(f"{label}: reading", total=last + 1, unit="entries") as progress:
            async for entry in reader.read(0, last):
                assert entry.entry_id == count, (entry.entry_id, count)
                count += 1
                read_bytes += len(entry.data)
                if count % 10_000 == 0:
                    progress.update(count)
        elapsed = time.perf_counter() - began
    return point("catchup_reads", arguments, {"entry_bytes": entry_bytes, "entries": last + 1, "ledger_bytes": entries * entry_bytes,
                                              "digest": "CRC32C", "verified": True}, {
        "entries_per_s": round(count / elapsed, 1), "mb_per_s": round(read_bytes / elapsed / 1e6, 2), "read_seconds": round(elapsed, 2),
        "write_entries_per_s": round(entries / write_s, 1), "write_mb_per_s": round(entries * entry_bytes / write_s / 1e6, 2),
        "note": "read just after writing: the bookies may serve it from their caches"})


def run_catchup_reads(arguments: argparse.Namespace, points: Sequence[int], results: list[dict]) -> None:
    ledger_bytes = arguments.catchup_bytes or (CATCHUP_BYTES_QUICK if arguments.quick else CATCHUP_BYTES_DEFAULT)
    with bench_cluster(3) as cluster:
        for entry_bytes in points:
            result = trio.run(catchup_point, cluster, arguments, entry_bytes, ledger_bytes)
            emit(result)
            results.append(result)


RUNNERS: dict[str, Callable[[argparse.Namespace, Sequence[int], list[dict]], None]] = {
    "entry_size": run_entry_size, "open_ledgers": run_open_ledgers, "topics": run_topics,
    "subscriptions": run_subscriptions, "bookies": run_bookies, "catchup_reads": run_catchup_reads,
}


# --- summary and plots ---------------------------------------------------------------------------


def summarize(curve: str, results: list[dict], plot: Path | None) -> dict:
    x_field, rate_field = X_FIELD[curve], RATE_FIELD[curve]
    fields = list(dict.fromkeys(field for _, series in PANELS[curve] for field, _ in series))
    points = [{x_field: result["parameters"][x_field], **{field: result.get(field) for field in fields}} for result in results]
    bend = None
    first = points[0][rate_field] if points else None
    if first:
        for each in points[1:]:
            if each[rate_field] is not None and each[rate_field] < BEND_FRACTION * first:
                bend = {x_field: each[x_field], rate_field: each[rate_field], "fraction_of_first": round(each[rate_field] / first, 3)}
                break
    summary = {"name": f"scaling_{curve}_summary", "x": x_field, "rate": rate_field, "points": points,
               "bend_below_fraction_of_first": BEND_FRACTION, "bend": bend, "plot": str(plot) if plot else None}
    if curve == "bookies":
        summary["note"] = (f"this machine has {os.cpu_count()} cores and one disk, shared by ZooKeeper, every bookie and the "
                           "client: more bookies add contention for them, not capacity, so this curve says little about "
                           "bookies on machines of their own")
    if curve in ("entry_size", "catchup_reads"):
        summary["note"] = "the bend is judged by entries/s: where an entry's bytes start to cost more than the entry itself"
    return summary


def size_label(value: int) -> str:
    """100 as '100 B', 4096 as '4KiB'."""
    shown = human_size(value)
    return shown if shown.endswith("B") else f"{shown} B"


def plotting_available() -> bool:
    if importlib.util.find_spec("matplotlib") is None:
        print("bench.scaling: matplotlib is not installed (.venv/bin/pip install matplotlib): no plots", file=sys.stderr)
        return False
    return True


def plot_curve(curve: str, results: list[dict], arguments: argparse.Namespace, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    from matplotlib import pyplot
    from matplotlib.ticker import NullLocator

    x_field = X_FIELD[curve]
    xs = [result["parameters"][x_field] for result in results]
    labels = [size_label(x) if x_field == "entry_bytes" else f"{x:,}" for x in xs]
    panels = PANELS[curve]
    figure, axes = pyplot.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for axis, (unit, series) in zip(axes[0], panels):
        for field, label in series:
            shown = [(x, result.get(field)) for x, result in zip(xs, results) if result.get(field) is not None]
            if shown:
                axis.plot([x for x, _ in shown], [y for _, y in shown], marker="o", label=label,
                          linestyle="--" if field.startswith("reference") else "-")
        if min(xs) > 0 and max(xs) >= 10 * min(xs):
            axis.set_xscale("log")
        axis.set_xticks(xs)
        axis.set_xticklabels(labels, rotation=30)
        axis.xaxis.set_minor_locator(NullLocator())
        axis.set_xlabel(x_field.replace("_", " "))
        axis.set_ylabel(unit)
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        if axis.get_lines():
            axis.legend(fontsize="small")
    figure.suptitle(f"quire scaling: {curve} ({os.cpu_count()} cores, {arguments.seconds:g} s per point)")
    figure.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"scaling_{curve}.png"
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    arguments = parser.parse_args(argv)
    overrides = dict(arguments.points)
    left_out = [curve for curve in overrides if curve not in arguments.curves]
    if left_out:
        parser.error(f"--points names {','.join(left_out)}, which --curves leaves out")
    out_dir = arguments.out_dir or Path(__file__).resolve().parent
    plotting = plotting_available()
    failed = False
    for curve in arguments.curves:
        points = overrides.get(curve) or (QUICK_POINTS if arguments.quick else POINTS)[curve]
        results: list[dict] = []
        error = None
        try:
            RUNNERS[curve](arguments, points, results)
        except Exception as exception:  # the next curves still run; the larger points of this one would fail too
            traceback.print_exc()
            error = f"{type(exception).__name__}: {exception}"
            emit({"name": f"scaling_{curve}", "error": error, "points_done": len(results)})
            failed = True
        plot = plot_curve(curve, results, arguments, out_dir) if plotting and results else None
        summary = summarize(curve, results, plot)
        if error is not None:
            summary["error"] = error
        emit(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
