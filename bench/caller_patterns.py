"""Benchmark: the ledger client's add, called the ways users call it,
against NATS JetStream called the same ways, in the same run.

3 bookies on loopback (E=3 WQ=3 AQ=2, fsync on) and a 3-node JetStream
cluster (file storage, 3 replicas); 1 KiB entries; at most `--window` (256)
in flight. The patterns, each for quire's `LedgerHandle` and nats-py's
JetStream context:

- `sequential`: one task, `await lh.add(data)` / `await js.publish(...)`
  one after another (window 1: the latency figure);
- `task_per_add`: a new task for every add, a semaphore of `window`
  (most trio and asyncio code);
- `long_lived_tasks`: `window` tasks, each adding in a loop;
- `pipelined`: one task, `lh.submit_add(data)` / `js.publish_async(...)`,
  awaiting the oldest once `window` are in flight;
- `callback`: one task, `submit_add(data, on_done)` / a done callback on
  `publish_async`'s future (bench/ledger_write.py's way);
- `writer`: one task, `async with lh.writer(window)` / JetStream's
  pipelined loop (nats-py has no writer);
- `add_many`: one task, `await lh.add_many(window entries)` / `window`
  `publish_async` then all awaited (nats-py has no batch publish);
- `sync_writer`: plain code in a thread, the sync facade's
  `with lh.writer(window) as w: w.add(data)` (quire only: nats-py has no
  synchronous API).

At the topic level, on 3 bookies and a broker (same sizes): quire's
`producer.send` from a task per message (a semaphore of `window`) and
pipelined `send_async`; the official Pulsar client's `send` (one at a
time) and `send_async` (`window` pending); and reading a backlog of
`--backlog` messages with `receive` and with `batch_receive`, each message
acknowledged.

    .venv/bin/python -m bench.caller_patterns [--seconds 5] [--rounds 1]

Prints one JSON object per result, a table, then a summary with the
targets: every quire pattern >= 1.5x JetStream's same pattern, the slowest
quire pattern >= 60% of the fastest, and sequential add p50 <= 1.2x
JetStream's sequential publish p50.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import json
import os
import statistics
import sys
import time

import trio

from bench.cluster import bench_cluster, free_port, latency_summary
from bench.ledger_write import add_jetstream_stream, jetstream_cluster
from ledger_client.bookkeeper import BookKeeper
from ledger_client.ledger_handle import LedgerHandle
from quire import cli_ranges as ranges
from quire.cli_parsing import Parser
from quire.progress import Progress

PASSWORD = b"bench"
PATTERNS = ("sequential", "task_per_add", "long_lived_tasks", "pipelined", "callback", "writer", "add_many", "sync_writer")
# nats-py has no synchronous API: these run for quire alone.
QUIRE_ONLY = ("sync_writer",)
COMPARED = tuple(pattern for pattern in PATTERNS if pattern not in QUIRE_ONLY)
RATIO_TO_JETSTREAM_MIN = 1.5
SLOWEST_TO_FASTEST_MIN = 0.6
SEQUENTIAL_P50_RATIO_MAX = 1.2


class Tally:
    """Adds started inside the measured span, their latencies and errors."""

    def __init__(self, measure_from: float, deadline: float) -> None:
        self.measure_from, self.deadline = measure_from, deadline
        self.latencies_ms: list[float] = []
        self.untimed = 0  # counted without a latency (messages received)
        self.errors: dict[str, int] = {}

    def running(self) -> bool:
        return time.perf_counter() < self.deadline

    def done(self, started: float, error: BaseException | None) -> None:
        if error is not None:
            self.errors[type(error).__name__] = self.errors.get(type(error).__name__, 0) + 1
        elif started >= self.measure_from:
            self.latencies_ms.append((time.perf_counter() - started) * 1000)

    def result(self, system: str, pattern: str, window: int, entry_bytes: int, seconds: float) -> dict:
        measured = len(self.latencies_ms) + self.untimed
        return {
            "name": f"caller_patterns_{system}", "system": system, "pattern": pattern,
            "parameters": {"window": 1 if pattern in ("sequential", "pulsar_send") else window, "entry_bytes": entry_bytes,
                           "seconds": seconds, "ensemble": 3, "write_quorum": 3, "ack_quorum": 2},
            "entries": measured,
            "entries_per_s": round(measured / seconds, 1),
            **latency_summary(self.latencies_ms),
            "errors": self.errors,
        }


# --- quire ---------------------------------------------------------------------------


async def task_per_call(call, window: int, tally: Tally) -> None:
    """A new trio task for every `await call()`, at most `window` at a time."""
    room = trio.Semaphore(window)

    async def one() -> None:
        started = time.perf_counter()
        try:
            await call()
            tally.done(started, None)
        finally:
            room.release()

    async with trio.open_nursery() as nursery:
        while tally.running():
            await room.acquire()
            nursery.start_soon(one)


async def pipelined(submit, window: int, tally: Tally) -> None:
    """One task: `await submit()` gives something to `await .wait()` on
    later; the oldest is awaited once `window` are in flight."""
    in_flight: collections.deque = collections.deque()
    while tally.running():
        if len(in_flight) >= window:
            started, pending = in_flight.popleft()
            await pending.wait()
            tally.done(started, None)
        in_flight.append((time.perf_counter(), await submit()))
    for started, pending in in_flight:
        await pending.wait()
        tally.done(started, None)


async def quire_pattern(handle: LedgerHandle, pattern: str, payload: bytes, window: int, tally: Tally) -> None:
    if pattern == "sequential":
        while tally.running():
            started = time.perf_counter()
            await handle.add(payload)
            tally.done(started, None)
    elif pattern == "task_per_add":
        await task_per_call(functools.partial(handle.add, payload), window, tally)
    elif pattern == "long_lived_tasks":
        async def loop() -> None:
            while tally.running():
                started = time.perf_counter()
                await handle.add(payload)
                tally.done(started, None)

        async with trio.open_nursery() as nursery:
            for _ in range(window):
                nursery.start_soon(loop)
    elif pattern == "pipelined":
        await pipelined(functools.partial(handle.submit_add, payload), window, tally)
    elif pattern == "callback":
        room = trio.Semaphore(window)

        def done(started: float, pending) -> None:
            room.release()
            tally.done(started, pending.error)

        while tally.running():
            await room.acquire()
            await handle.submit_add(payload, functools.partial(done, time.perf_counter()))
        for _ in range(window):
            await room.acquire()
    elif pattern == "writer":
        # Each add's latency is taken when the loop sees it done (at most one add late).
        started_at: collections.deque = collections.deque()
        async with handle.writer(window) as writer:
            while tally.running():
                started = time.perf_counter()
                started_at.append((started, await writer.add(payload)))
                while started_at[0][1].done:
                    tally.done(started_at.popleft()[0], None)
        for started, _ in started_at:
            tally.done(started, None)
    elif pattern == "add_many":
        batch = [payload] * window
        while tally.running():
            started = time.perf_counter()
            await handle.add_many(batch)
            for _ in batch:
                tally.done(started, None)
    else:
        raise ValueError(f"unknown pattern {pattern}")


def sync_writer(zk_hosts: str, root: str, payload: bytes, window: int, tally: Tally) -> None:
    """Plain (not async) code in a thread: the sync facade's `lh.writer(window)`.
    Adds are counted, not timed (the writer hands back no handle per add)."""
    from ledger_client.sync import BookKeeper as SyncBookKeeper

    with SyncBookKeeper.connect(zk_hosts, root, pending_adds_max=max(window, 1000)) as bk:
        handle = bk.create_ledger(3, 3, 2, password=PASSWORD)
        with handle.writer(window) as writer:
            while tally.running():
                writer.add(payload)
                if time.perf_counter() >= tally.measure_from:
                    tally.untimed += 1
        handle.close()


async def run_quire(zk_hosts: str, root: str, arguments: argparse.Namespace, label: str) -> dict[str, dict]:
    results = {}
    payload = os.urandom(arguments.entry_bytes)
    async with BookKeeper.connect(zk_hosts, root, pending_adds_max=max(arguments.window, 1000)) as bk:
        for pattern in PATTERNS:
            handle = None if pattern in QUIRE_ONLY else await bk.create_ledger(3, 3, 2, password=PASSWORD)
            with Progress(f"{label}: quire {pattern}", total=None, unit="s"):
                began = time.perf_counter()
                tally = Tally(began + arguments.warmup_seconds, began + arguments.warmup_seconds + arguments.seconds)
                if handle is None:
                    await trio.to_thread.run_sync(sync_writer, zk_hosts, root, payload, arguments.window, tally)
                else:
                    await quire_pattern(handle, pattern, payload, arguments.window, tally)
                    await handle.close()
            results[pattern] = tally.result("quire", pattern, arguments.window, arguments.entry_bytes, arguments.seconds)
            print(json.dumps(results[pattern]), flush=True)
    return results


# --- NATS JetStream --------------------------------------------------------------------


async def jetstream_pattern(js, pattern: str, payload: bytes, window: int, tally: Tally) -> None:
    subject = "bench"
    if pattern == "sequential":
        while tally.running():
            started = time.perf_counter()
            await js.publish(subject, payload)
            tally.done(started, None)
    elif pattern == "task_per_add":
        room = asyncio.Semaphore(window)
        tasks: set[asyncio.Task] = set()

        async def one() -> None:
            started = time.perf_counter()
            try:
                await js.publish(subject, payload)
                tally.done(started, None)
            finally:
                room.release()

        while tally.running():
            await room.acquire()
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    elif pattern == "long_lived_tasks":
        async def loop() -> None:
            while tally.running():
                started = time.perf_counter()
                await js.publish(subject, payload)
                tally.done(started, None)

        await asyncio.gather(*(loop() for _ in range(window)))
    elif pattern in ("pipelined", "writer"):  # (nats-py has no writer: the pipelined loop is its equivalent)
        in_flight: collections.deque = collections.deque()
        while tally.running():
            if len(in_flight) >= window:
                started, future = in_flight.popleft()
                await future
                tally.done(started, None)
            in_flight.append((time.perf_counter(), await js.publish_async(subject, payload)))
        for started, future in in_flight:
            await future
            tally.done(started, None)
    elif pattern == "callback":
        room = asyncio.Semaphore(window)

        def done(started: float, future: asyncio.Future) -> None:
            room.release()
            tally.done(started, future.exception())

        while tally.running():
            await room.acquire()
            future = await js.publish_async(subject, payload)
            future.add_done_callback(functools.partial(done, time.perf_counter()))
        for _ in range(window):
            await room.acquire()
    elif pattern == "add_many":
        # nats-py has no batch publish: `window` publish_async, then all awaited.
        while tally.running():
            started = time.perf_counter()
            futures = [await js.publish_async(subject, payload) for _ in range(window)]
            await asyncio.gather(*futures)
            for _ in futures:
                tally.done(started, None)
    else:
        raise ValueError(f"unknown pattern {pattern}")


async def jetstream_all(servers: list[str], arguments: argparse.Namespace, label: str) -> dict[str, dict]:
    import nats

    results = {}
    payload = os.urandom(arguments.entry_bytes)
    nc = await nats.connect(servers=servers)
    try:
        js = nc.jetstream(publish_async_max_pending=arguments.window)
        for pattern in COMPARED:
            await add_jetstream_stream(js, "PATTERNS", "bench")
            with Progress(f"{label}: jetstream {pattern}", total=None, unit="s"):
                began = time.perf_counter()
                tally = Tally(began + arguments.warmup_seconds, began + arguments.warmup_seconds + arguments.seconds)
                await jetstream_pattern(js, pattern, payload, arguments.window, tally)
            await js.delete_stream("PATTERNS")
            results[pattern] = tally.result("jetstream", pattern, arguments.window, arguments.entry_bytes, arguments.seconds)
            results[pattern]["parameters"].update(replicas=3, storage="file", ensemble=None, write_quorum=None, ack_quorum=None,
                                                  note="JetStream acknowledges before fsync (its default sync interval)")
            print(json.dumps(results[pattern]), flush=True)
    finally:
        await nc.close()
    return results


# --- the topic level ----------------------------------------------------------------------
# The same question one level up: quire's broker client and the official
# Pulsar client, each called the ways their users call them. Both with
# their defaults (batching off), 1 KiB, `window` in flight.

TOPIC_PATTERNS = ("quire_send_task_per_message", "quire_send_pipelined", "pulsar_send", "pulsar_send_async",
                  "pulsar_receive", "pulsar_batch_receive")


async def quire_topic_pattern(zk_hosts: str, root: str, topic: str, pattern: str, payload: bytes, window: int,
                              tally: Tally) -> None:
    from broker.client import Client

    async with Client.connect(zk_hosts, root) as client:
        await client.create_topic(topic, ensemble_size=3, write_quorum=3, ack_quorum=2)
        producer = await client.create_producer(topic, pending_messages_max=window)
        if pattern == "quire_send_task_per_message":
            await task_per_call(functools.partial(producer.send, payload), window, tally)
        elif pattern == "quire_send_pipelined":
            await pipelined(functools.partial(producer.send_async, payload), window, tally)
        else:
            raise ValueError(f"unknown pattern {pattern}")
        await producer.close()


def pulsar_topic_pattern(url: str, topic: str, pattern: str, payload: bytes, window: int, tally: Tally,
                         backlog: int) -> None:
    import pulsar

    client = pulsar.Client(url, operation_timeout_seconds=60, io_threads=2,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        if pattern in ("pulsar_send", "pulsar_send_async"):
            producer = client.create_producer(topic, max_pending_messages=window, block_if_queue_full=True)
            if pattern == "pulsar_send":
                while tally.running():
                    started = time.perf_counter()
                    producer.send(payload)
                    tally.done(started, None)
            else:
                def sent(started: float, outcome, message_id) -> None:
                    tally.done(started, None if outcome == pulsar.Result.Ok else RuntimeError(str(outcome)))

                while tally.running():
                    producer.send_async(payload, functools.partial(sent, time.perf_counter()))
                producer.flush()
            producer.close()
            return
        # receive / batch_receive: a backlog written first (send_async, batching on), then read from the start.
        consumer = client.subscribe(topic, "patterns", initial_position=pulsar.InitialPosition.Earliest,
                                    receiver_queue_size=1000,
                                    batch_receive_policy=pulsar.ConsumerBatchReceivePolicy(1000, 1 << 20, 100))
        producer = client.create_producer(topic, batching_enabled=True, batching_max_publish_delay_ms=1,
                                          max_pending_messages=20_000, block_if_queue_full=True)
        for _ in range(backlog):
            producer.send_async(payload, None)
        producer.flush()
        producer.close()
        received = 0
        tally.measure_from = time.perf_counter()
        while received < backlog:
            if pattern == "pulsar_receive":
                messages = [consumer.receive(60_000)]
            else:
                messages = list(consumer.batch_receive())
            for message in messages:
                consumer.acknowledge(message)
            tally.untimed += len(messages)
            received += len(messages)
        tally.deadline = time.perf_counter()
        consumer.close()
    finally:
        client.close()


def run_topic_level(arguments: argparse.Namespace, label: str) -> dict[str, dict]:
    results = {}
    pulsar_port = free_port()
    url = f"pulsar://127.0.0.1:{pulsar_port}"
    payload = os.urandom(arguments.entry_bytes)
    with bench_cluster(3, broker_count=1, broker_options=["--pulsar-port", str(pulsar_port)]) as cluster:
        for number, pattern in enumerate(TOPIC_PATTERNS):
            topic = f"patterns-{number}"
            with Progress(f"{label}: topic {pattern}", total=None, unit="s"):
                began = time.perf_counter()
                tally = Tally(began + arguments.warmup_seconds, began + arguments.warmup_seconds + arguments.seconds)
                if pattern.startswith("quire_"):
                    trio.run(quire_topic_pattern, cluster.zk_hosts, cluster.root, topic, pattern, payload, arguments.window, tally)
                else:
                    if pattern in ("pulsar_receive", "pulsar_batch_receive"):
                        trio.run(create_topic, cluster.zk_hosts, cluster.root, topic)
                    pulsar_topic_pattern(url, f"persistent://public/default/{topic}", pattern, payload, arguments.window,
                                         tally, arguments.backlog)
            seconds = tally.deadline - tally.measure_from if pattern.endswith("receive") else arguments.seconds
            system = "quire" if pattern.startswith("quire_") else "pulsar-client"
            results[pattern] = tally.result(system, pattern, arguments.window, arguments.entry_bytes, round(seconds, 3))
            results[pattern]["name"] = "caller_patterns_topic"
            if pattern.endswith("receive"):
                results[pattern]["parameters"].update(backlog=arguments.backlog, ack="each message", receiver_queue=1000)
            print(json.dumps(results[pattern]), flush=True)
    return results


async def create_topic(zk_hosts: str, root: str, topic: str) -> None:
    from broker.client import Client

    async with Client.connect(zk_hosts, root) as client:
        await client.create_topic(topic, ensemble_size=3, write_quorum=3, ack_quorum=2)


# --- main ----------------------------------------------------------------------------


def summarize(rounds: list[dict[str, dict[str, dict]]]) -> dict:
    """Medians over the rounds; ratios taken within each round."""
    def median_of(system: str, pattern: str, field: str) -> float:
        return statistics.median(r[system][pattern][field] for r in rounds)

    quire_rates = {pattern: median_of("quire", pattern, "entries_per_s") for pattern in PATTERNS}
    summary: dict = {"name": "caller_patterns_summary", "rounds": len(rounds), "quire_entries_per_s": quire_rates}
    parallel = [pattern for pattern in PATTERNS if pattern != "sequential"]
    compared_parallel = [pattern for pattern in parallel if pattern in COMPARED]
    summary["slowest_to_fastest"] = round(min(quire_rates[p] for p in parallel) / max(quire_rates[p] for p in parallel), 3)
    met = {"slowest_to_fastest": summary["slowest_to_fastest"] >= SLOWEST_TO_FASTEST_MIN}
    if all("jetstream" in r for r in rounds):
        summary["jetstream_entries_per_s"] = {pattern: median_of("jetstream", pattern, "entries_per_s") for pattern in COMPARED}
        ratios = {pattern: round(statistics.median(
            r["quire"][pattern]["entries_per_s"] / r["jetstream"][pattern]["entries_per_s"]
            if r["jetstream"][pattern]["entries_per_s"] else 0.0 for r in rounds), 3) for pattern in COMPARED}
        summary["ratio_to_jetstream"] = ratios
        p50_ratio = round(statistics.median(
            r["quire"]["sequential"]["latency_ms_p50"] / r["jetstream"]["sequential"]["latency_ms_p50"] for r in rounds), 3)
        summary["sequential_p50_ms"] = {"quire": median_of("quire", "sequential", "latency_ms_p50"),
                                        "jetstream": median_of("jetstream", "sequential", "latency_ms_p50"),
                                        "ratio": p50_ratio}
        met.update({f"{pattern}_vs_jetstream": ratios[pattern] >= RATIO_TO_JETSTREAM_MIN for pattern in compared_parallel})
        met["sequential_p50"] = p50_ratio <= SEQUENTIAL_P50_RATIO_MAX
    summary["targets"] = {"ratio_to_jetstream_min": RATIO_TO_JETSTREAM_MIN, "slowest_to_fastest_min": SLOWEST_TO_FASTEST_MIN,
                          "sequential_p50_ratio_max": SEQUENTIAL_P50_RATIO_MAX}
    summary["met"] = met
    return summary


def table(rounds: list[dict[str, dict[str, dict]]]) -> str:
    lines = ["pattern           quire adds/s   p50 ms   jetstream msg/s   p50 ms   ratio"]
    for pattern in PATTERNS:
        quire = statistics.median(r["quire"][pattern]["entries_per_s"] for r in rounds)
        quire_p50 = statistics.median(r["quire"][pattern]["latency_ms_p50"] or 0.0 for r in rounds)
        if all("jetstream" in r for r in rounds) and pattern in COMPARED:
            js = statistics.median(r["jetstream"][pattern]["entries_per_s"] for r in rounds)
            js_p50 = statistics.median(r["jetstream"][pattern]["latency_ms_p50"] for r in rounds)
            lines.append(f"{pattern:17s} {quire:12,.0f} {quire_p50:8.2f} {js:17,.0f} {js_p50:8.2f} {quire / js if js else 0:7.2f}")
        else:
            lines.append(f"{pattern:17s} {quire:12,.0f} {quire_p50:8.2f}")
    return "\n".join(lines)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/caller_patterns.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=ranges.bench_seconds, default=5.0, help="measured seconds of each pattern")
    parser.add_argument("--warmup-seconds", type=ranges.warmup_seconds, default=1.0, help="seconds of adds before measuring")
    parser.add_argument("--window", type=ranges.in_flight, default=256, help="adds in flight in every pattern but sequential")
    parser.add_argument("--entry-bytes", type=ranges.entry_bytes, default=1024, help="size of each entry")
    parser.add_argument("--skip-jetstream", action="store_true")
    parser.add_argument("--rounds", type=ranges.count, default=1,
                        help="each round runs every pattern once, JetStream's too; the summary gives medians")
    parser.add_argument("--skip-topic-level", action="store_true",
                        help="only the ledger client's patterns (not the broker's and the Pulsar client's)")
    parser.add_argument("--backlog", type=ranges.bench_backlog, default=100_000,
                        help="messages of the topic-level receive and batch_receive runs")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    rounds: list[dict[str, dict[str, dict]]] = []
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(bench_cluster(3))
        servers = None if arguments.skip_jetstream else stack.enter_context(jetstream_cluster())
        for round_number in range(1, arguments.rounds + 1):
            label = f"round {round_number}"
            measured = {"quire": trio.run(run_quire, cluster.zk_hosts, cluster.root, arguments, label)}
            if servers is not None:
                measured["jetstream"] = asyncio.run(jetstream_all(servers, arguments, label))
            rounds.append(measured)
    topic = None if arguments.skip_topic_level else run_topic_level(arguments, "topic level")
    print(table(rounds), file=sys.stderr, flush=True)
    summary = summarize(rounds)
    if topic is not None:
        summary["topic_level_per_s"] = {pattern: value["entries_per_s"] for pattern, value in topic.items()}
        print("\n".join(f"{pattern:29s} {value['entries_per_s']:12,.0f} /s   p50 {value['latency_ms_p50'] or 0:7.2f} ms"
                        for pattern, value in topic.items()), file=sys.stderr, flush=True)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
