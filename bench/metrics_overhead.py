"""Benchmark: what Prometheus metrics cost the bookies, on the workload of
bench/ledger_write.py (3 bookies, E=3 WQ=3 AQ=2, 1 KiB entries, fsync on).

Each round starts three fresh bookies with metrics off (`--metrics-port 0`:
no endpoint, nothing measured) and three with metrics on (an endpoint each,
every add and journal batch measured), in alternating order, and runs
window 1 and window 1000 on one ledger (or `--ledgers N` in turn). Besides entries/s and latency, which move with whatever else
the machine runs, it reports the bookies' CPU time per entry (user +
system, read from /proc over the phase), the steadier figure on a shared
VM. Prints one JSON object per phase, then the medians and ratios.

    .venv/bin/python -m bench.metrics_overhead [--rounds 3] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import trio

from bench.cluster import bench_cluster, cpu_seconds
from bench.ledger_write import write_ledgers
from ledger_client.bookkeeper import BookKeeper
from quire import cli_ranges as ranges
from quire.cli_parsing import Parser

def cpu_seconds_of(pids: list[int]) -> float:
    """User + system time of the processes so far."""
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


async def measure(zk_hosts: str, root: str, pids: list[int], metrics: str, seconds: float, ledgers: int) -> list[dict]:
    results = []
    async with BookKeeper.connect(zk_hosts, root, pending_adds_max=1000) as bk:
        for window in (1, 1000):
            # No warm-up: every add of the phase counts, so that the CPU time
            # it took divides by all of them.
            cpu_before = cpu_seconds_of(pids)
            result = await write_ledgers(bk, window=window, ledgers=ledgers, entry_bytes=1024, seconds=seconds, warmup_s=0,
                                         label=f"metrics {metrics}, window {window}")
            cpu_s = cpu_seconds_of(pids) - cpu_before
            results.append({
                "name": "metrics_overhead", "bookie_metrics": metrics, "window": window, "ledgers": ledgers,
                "entries_per_s": result["entries_per_s"], "latency_ms_p50": result["latency_ms_p50"],
                "latency_ms_p99": result["latency_ms_p99"],
                "bookie_cpu_us_per_entry": round(cpu_s / max(result["entries"], 1) * 1e6, 1),
            })
            print(json.dumps(results[-1]), flush=True)
    return results


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/metrics_overhead.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=ranges.count, default=3, help="rounds of a run with metrics off and one with them on")
    parser.add_argument("--seconds", type=ranges.bench_seconds, default=10.0, help="measured seconds of each run")
    parser.add_argument("--ledgers", type=ranges.bench_ledgers, default=1, help="ledgers written in turn (ledger_write's many-ledgers run: 1000)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    results = []
    for round_index in range(arguments.rounds):
        # Off-on, then on-off: a machine that slows down (or speeds up) during
        # the run does not favour one side.
        for metrics in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
            with bench_cluster(3, metrics=metrics == "on") as cluster:
                pids = [process.pid for _, process in cluster.bookies]
                results += trio.run(measure, cluster.zk_hosts, cluster.root, pids, metrics, arguments.seconds, arguments.ledgers)
    summary: dict = {"name": "metrics_overhead_summary", "rounds": arguments.rounds, "ledgers": arguments.ledgers}
    for window in (1, 1000):
        for key in ("entries_per_s", "latency_ms_p50", "bookie_cpu_us_per_entry"):
            medians = {
                metrics: statistics.median(result[key] for result in results
                                           if result["window"] == window and result["bookie_metrics"] == metrics)
                for metrics in ("off", "on")
            }
            summary[f"window_{window}_{key}"] = medians
            summary[f"window_{window}_{key}_ratio_on_to_off"] = round(medians["on"] / medians["off"], 3) if medians["off"] else None
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
