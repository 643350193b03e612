"""Benchmark: one bookie on loopback, one client pipelining adds, fsync on.

Starts a real ZooKeeper and a real bookie process in a scratch directory,
measures the raw fdatasync latency of the same disk as the physical
reference (4 KiB overwrites of a preallocated file, as the journal writes),
next to each run, then pipelines 1 KiB adds at each window, `--repeat`
times (default 3: this VM's speed changes with its neighbours). Prints one
JSON object per result, and per window a `bookie_add_summary` with the
medians of its runs, checked against the target:

    .venv/bin/python -m bench.bookie_add            # or: quire bench bookie_add

Targets: >= 40,000 entries/s at window 1000; p50 add latency at
window 1 within 3x the measured fdatasync p50 plus 0.2 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import trio

from quire import cli_ranges as ranges
from quire.cli_parsing import Parser
from quire.progress import Progress
from bookie.protocol import AddFlag, DigestManager, DigestType, Status, master_key
from bench.cluster import bench_cluster, latency_summary, percentile
from ledger_client.bookie_client import BookieClient


def measure_fdatasync(directory: Path, count: int, block_bytes: int = 4096) -> dict:
    path = directory / "fdatasync-probe"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
    try:
        os.write(fd, bytes(block_bytes * count))
        os.fsync(fd)
        block = os.urandom(block_bytes)
        latencies = []
        for index in range(count):
            started = time.perf_counter()
            os.pwrite(fd, block, index * block_bytes)
            os.fdatasync(fd)
            latencies.append((time.perf_counter() - started) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    latencies.sort()
    return {
        "name": "fdatasync",
        "parameters": {"block_bytes": block_bytes, "count": count, "pattern": "overwrite of a preallocated file"},
        "latency_ms_p50": round(percentile(latencies, 0.5), 4),
        "latency_ms_p99": round(percentile(latencies, 0.99), 4),
        "latency_ms_mean": round(statistics.fmean(latencies), 4),
    }


async def pipeline_adds(address: str, *, window: int, entry_bytes: int, seconds: float, warmup_s: float, ledger_id: int, progress: Progress) -> dict:
    password = b"bench"
    key = master_key(password)
    digest = DigestManager(ledger_id, DigestType.CRC32C, password)
    payload = os.urandom(entry_bytes)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    measuring = False
    measured_entries = 0
    all_done = trio.Event()
    outstanding = 0

    sent_at: dict[int, float] = {}
    # The window is held here, so that a request's clock starts once it has
    # room and before it is handed to the client (which may write it at once).
    room = trio.Semaphore(window)

    def on_response(response) -> None:
        nonlocal outstanding, measured_entries
        outstanding -= 1
        room.release()
        status = getattr(response, "status", None)
        started = sent_at.pop(response.request_id, 0.0) if status is not None else 0.0
        if status is not Status.OK:
            name = status.name if status is not None else type(response).__name__
            errors[name] = errors.get(name, 0) + 1
        elif measuring and started >= measure_start:
            latencies.append((time.perf_counter() - started) * 1000)
            measured_entries += 1
        if outstanding == 0 and stop:
            all_done.set()

    stop = False
    measure_start = float("inf")
    async with BookieClient.connect(address, requests_in_flight_max=window) as client:
        entry_id = 0
        began = time.perf_counter()
        measure_start = began + warmup_s
        deadline = measure_start + seconds
        last_progress = began
        while True:
            now = time.perf_counter()
            if now >= deadline:
                break
            if not measuring and now >= measure_start:
                measuring = True
            entry = digest.encode(entry_id, entry_id - 1, 0, payload)
            entry_id += 1
            try:
                # No scheduling point while the window has room, so that
                # adds queued back to back leave in one write.
                room.acquire_nowait()
            except trio.WouldBlock:
                await room.acquire()
            outstanding += 1
            started = time.perf_counter()
            request_id = await client.submit_add(AddFlag.NONE, key, entry, on_response)
            sent_at[request_id] = started
            if now - last_progress > 0.25:
                progress.update(now - began)
                last_progress = now
        ended = time.perf_counter()
        stop = True
        if outstanding:
            await all_done.wait()
    progress.update(warmup_s + seconds)
    elapsed = ended - measure_start
    return {
        "name": "bookie_add",
        "parameters": {"window": window, "entry_bytes": entry_bytes, "seconds": seconds, "fsync": True},
        "entries": measured_entries,
        "entries_per_s": round(measured_entries / elapsed, 1),
        "mb_per_s": round(measured_entries * entry_bytes / elapsed / 1e6, 2),
        **latency_summary(latencies),
        "errors": errors,
    }


def target(window: int, result: dict, fdatasync_ms_p50: float) -> dict | None:
    """The issue's targets: entries/s at window 1000, p50 latency at window 1."""
    if window >= 1000:
        return {"entries_per_s_min": 40_000, "met": result["entries_per_s"] >= 40_000}
    if window == 1:
        limit = round(3 * fdatasync_ms_p50 + 0.2, 4)
        return {"latency_ms_p50_max": limit, "met": result["latency_ms_p50"] <= limit}
    return None


def summary(window: int, runs: list[dict]) -> dict:
    """Medians over the runs of one window, checked against the target."""
    def median(key: str) -> float:
        return round(statistics.median(run[key] for run in runs), 4)

    fdatasync_ms_p50 = round(statistics.median(run["reference"]["fdatasync_latency_ms_p50"] for run in runs), 4)
    result = {
        "name": "bookie_add_summary",
        "parameters": {**{key: value for key, value in runs[0]["parameters"].items() if key != "run"}, "runs": len(runs)},
        "entries_per_s": median("entries_per_s"),
        "mb_per_s": median("mb_per_s"),
        "latency_ms_p50": median("latency_ms_p50"),
        "latency_ms_p99": median("latency_ms_p99"),
        "entries_per_s_runs": [run["entries_per_s"] for run in runs],
        "latency_ms_p50_runs": [run["latency_ms_p50"] for run in runs],
        "reference": {"fdatasync_latency_ms_p50": fdatasync_ms_p50},
    }
    result["target"] = target(window, result, fdatasync_ms_p50)
    return result


def pipeline_windows(text: str) -> list[int]:
    """'1,1000': windows of adds in flight, each in the range a bookie takes."""
    try:
        return [ranges.in_flight(window) for window in text.split(",")]
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"each window {error}") from None


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/bookie_add.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=pipeline_windows, default="1,1000", metavar="N,N...",
                        help=f"comma-separated pipeline windows, each {ranges.in_flight.range_text()}")
    parser.add_argument("--seconds", type=ranges.bench_seconds, default=10.0, help="measured seconds per window")
    parser.add_argument("--warmup-seconds", type=ranges.warmup_seconds, default=2.0, help="seconds of adds before measuring")
    parser.add_argument("--entry-bytes", type=ranges.entry_bytes, default=1024, help="size of each entry")
    parser.add_argument("--fdatasync-count", type=ranges.count, default=2000, help="fdatasyncs of the physical reference")
    parser.add_argument("--repeat", type=ranges.count, default=3, help="runs per window; a summary gives the medians")
    parser.add_argument("--data-dir", type=Path, help="scratch directory (default: a new one under ./.bench)")
    parser.add_argument("--bookie-option", action="append", default=[], help="extra `quire bookie run` option (repeatable)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    windows = arguments.windows
    bookie_options = [option for extra in arguments.bookie_option for option in extra.split()]
    with bench_cluster(1, base=arguments.data_dir, bookie_options=bookie_options) as cluster:
        address = cluster.bookie_addresses[0]
        ledger_id = 0
        for window in windows:
            runs = []
            for run in range(1, arguments.repeat + 1):
                # The physical reference is measured next to each run: this
                # VM's disk and CPU change with its neighbours.
                reference = measure_fdatasync(cluster.directory, arguments.fdatasync_count)
                reference["parameters"]["run"] = run
                print(json.dumps(reference), flush=True)
                ledger_id += 1
                with Progress(f"window {window} run {run}/{arguments.repeat}", total=arguments.warmup_seconds + arguments.seconds, unit="s") as progress:
                    result = trio.run(
                        lambda: pipeline_adds(
                            address, window=window, entry_bytes=arguments.entry_bytes, seconds=arguments.seconds,
                            warmup_s=arguments.warmup_seconds, ledger_id=ledger_id, progress=progress,
                        )
                    )
                result["parameters"]["run"] = run
                result["reference"] = {"fdatasync_latency_ms_p50": reference["latency_ms_p50"]}
                result["target"] = target(window, result, reference["latency_ms_p50"])
                runs.append(result)
                print(json.dumps(result), flush=True)
            print(json.dumps(summary(window, runs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
