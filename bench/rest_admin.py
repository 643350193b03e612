"""Benchmark: the REST admin API's topic stats with 1,000 topics.

3 bookies and 1 broker on loopback with its web service; 1,000 topics with
a message each, loaded on the broker. Then:
- `rest_topic_stats_sequential`: GET .../{topic}/stats of every topic, one
  request after the other on one kept-alive connection (a script's loop);
- `rest_topic_stats_concurrent`: the same 1,000 requests, 16 connections at
  a time (a dashboard's scrape);
- `rest_partitioned_stats`: GET .../partitioned-stats of a topic of 1,000
  partitions (one request, put together from every partition);
- `rest_topic_stats_sequential_httpx`: the sequential pass again through
  httpx, for comparison (not a target);
- `broker_idle_cpu`: before the passes, the CPU the broker spends with its
  2,000 partitions loaded and nothing asked of it (their housekeeping).

The passes use the standard library's HTTP client, the lightest there is,
so that they time the broker; each result says how much CPU the client
itself spent per request.

    .venv/bin/python -m bench.rest_admin

Prints one JSON object per result (requests per second, latency
percentiles, the whole pass's seconds), then a summary: the target is every
pass over 1,000 topics within 1 s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import sys
import threading
import time
from urllib.parse import urlsplit

import httpx
import trio

from bench.cluster import bench_cluster, cpu_seconds, free_port, latency_summary
from broker.client import Client
from quire.cli_parsing import Bounded, Parser
from quire.progress import Progress

TARGET_S = 1.0
IDLE_SETTLE_S = 10.0  # after the loads, before the idle broker is measured
IDLE_MEASURED_S = 20.0
TARGETED = ("rest_topic_stats_sequential", "rest_topic_stats_concurrent", "rest_partitioned_stats")
V2 = "/admin/v2/persistent/public/default"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/rest_admin.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--topics", type=Bounded("integer", 1, 10_000, why="the broker's partition limit"), default=1_000,
                        help="topics (and partitions of the partitioned one)")
    parser.add_argument("--concurrency", type=Bounded("integer", 1, 256, why="the HTTP client's pool"), default=16,
                        help="requests in flight in the concurrent pass")
    parser.add_argument("--rounds", type=Bounded("integer", 1, 100, why="a bench's patience"), default=3,
                        help="passes of each kind (the best is the result; all are timed)")
    return parser


async def prepare(zk_hosts: str, root: str, topics: int) -> None:
    """`topics` topics with one message each, and a topic of `topics`
    partitions: made and loaded (their first stats load them)."""
    async with Client.connect(zk_hosts, root) as client:
        with Progress("topics", total=topics, unit="topics") as progress:
            for index in range(topics):
                await client.create_topic(f"t-{index}", ensemble_size=3, write_quorum=3, ack_quorum=2)
                producer = await client.create_producer(f"t-{index}")
                await producer.send(b"x" * 100)
                await producer.close()
                progress.update(index + 1)
        await client.create_topic("wide", partitions=topics, ensemble_size=3, write_quorum=3, ack_quorum=2)


class _Connection:
    """One kept-alive HTTP/1.1 connection of the standard library's client:
    what a script's loop pays the least for, so the pass measures the broker."""

    def __init__(self, web_url: str) -> None:
        parts = urlsplit(web_url)
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)

    def get(self, path: str) -> None:
        self.connection.request("GET", path)
        answer = self.connection.getresponse()
        body = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"GET {path}: {answer.status} {body[:200]!r}")

    def close(self) -> None:
        self.connection.close()


def timed_pass(web_url: str, paths: list[str], concurrency: int) -> tuple[float, list[float], float]:
    """GET every path, `concurrency` connections (threads) at a time:
    (seconds, latencies, the client's CPU seconds)."""
    latencies_ms: list[float] = []
    work = iter(paths)
    lock = threading.Lock()

    def worker() -> None:
        connection = _Connection(web_url)
        try:
            while True:
                with lock:
                    path = next(work, None)
                if path is None:
                    return
                began = time.perf_counter()
                connection.get(path)
                latencies_ms.append((time.perf_counter() - began) * 1000)
        finally:
            connection.close()

    cpu_began, began = time.process_time(), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for finished in [pool.submit(worker) for _ in range(concurrency)]:
            finished.result()
    return time.perf_counter() - began, latencies_ms, time.process_time() - cpu_began


async def timed_pass_httpx(web_url: str, paths: list[str]) -> tuple[float, list[float], float]:
    """The same sequential pass through httpx on trio (for comparison: the
    client's own cost per request is most of it)."""
    latencies_ms: list[float] = []
    async with httpx.AsyncClient(base_url=web_url, timeout=120) as http:
        await http.get(paths[0])  # connected
        cpu_began, began = time.process_time(), time.perf_counter()
        for path in paths:
            sent = time.perf_counter()
            answer = await http.get(path)
            latencies_ms.append((time.perf_counter() - sent) * 1000)
            if answer.status_code != 200:
                raise RuntimeError(f"GET {path}: {answer.status_code} {answer.text[:200]}")
        return time.perf_counter() - began, latencies_ms, time.process_time() - cpu_began


def result(name: str, parameters: dict, passes: list[tuple[float, list[float], float]], requests: int) -> dict:
    elapsed_s, latencies_ms, cpu_s = min(passes, key=lambda run: run[0])
    return {"name": name, "parameters": parameters, "requests_per_s": round(requests / elapsed_s, 1),
            "pass_seconds": round(elapsed_s, 3), "pass_seconds_all": [round(run[0], 3) for run in passes],
            "client_cpu_ms_per_request": round(cpu_s / requests * 1000, 3), **latency_summary(latencies_ms)}


def idle_cpu(broker_pid: int, partitions: int) -> dict:
    """The broker's share of a core while it serves `partitions` and nobody asks anything."""
    time.sleep(IDLE_SETTLE_S)
    began_cpu, began = cpu_seconds(broker_pid), time.perf_counter()
    time.sleep(IDLE_MEASURED_S)
    used = cpu_seconds(broker_pid) - began_cpu
    return {"name": "broker_idle_cpu", "parameters": {"partitions": partitions, "seconds": IDLE_MEASURED_S},
            "cpu_percent": round(used / (time.perf_counter() - began) * 100, 1)}


def measure(web_url: str, arguments: argparse.Namespace, broker_pid: int) -> list[dict]:
    topics, rounds = arguments.topics, arguments.rounds
    paths = [f"{V2}/t-{index}/stats" for index in range(topics)]
    wide = [f"{V2}/wide/partitioned-stats"]
    timed_pass(web_url, paths, arguments.concurrency)  # loads every topic (a cold pass)
    timed_pass(web_url, wide, 1)  # loads every partition
    results = [idle_cpu(broker_pid, 2 * topics)]
    parameters = {"topics": topics, "concurrency": 1, "client": "http.client"}
    results.append(result("rest_topic_stats_sequential", parameters,
                          [timed_pass(web_url, paths, 1) for _ in range(rounds)], topics))
    results.append(result("rest_topic_stats_concurrent", {**parameters, "concurrency": arguments.concurrency},
                          [timed_pass(web_url, paths, arguments.concurrency) for _ in range(rounds)], topics))
    results.append(result("rest_partitioned_stats", {"partitions": topics, "client": "http.client"},
                          [timed_pass(web_url, wide, 1) for _ in range(rounds)], 1))
    results.append(result("rest_topic_stats_sequential_httpx", {**parameters, "client": "httpx"},
                          [trio.run(timed_pass_httpx, web_url, paths) for _ in range(rounds)], topics))
    return results


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    web_port = free_port()
    with bench_cluster(3, broker_count=1, broker_options=["--web-port", str(web_port)]) as cluster:
        trio.run(prepare, cluster.zk_hosts, cluster.root, arguments.topics)
        results = measure(f"http://127.0.0.1:{web_port}", arguments, cluster.brokers[0][1].pid)
    for value in results:
        print(json.dumps(value), flush=True)
    met = {value["name"]: value["pass_seconds"] <= TARGET_S for value in results if value["name"] in TARGETED}
    print(json.dumps({"name": "rest_admin_summary", "target_pass_seconds": TARGET_S,
                      **{f"{value['name']}_pass_seconds": value["pass_seconds"] for value in results if "pass_seconds" in value},
                      "met": met}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
