"""Soak: the processes stay up and bounded under hostile input and faults.

- `fuzz`: hostile frames (sim/frame_fuzz.py) against a real bookie and a
  real broker, `--frames` per process type, from several connections at
  once; reports exits (must be 0) and the process's RSS before and after
  (after must be within 10% of before; "before" is taken after a warm-up).
- `kill`: kill -9 cycles under a deduplicating producer (sim/kill_cycles.py):
  `--cycles` kills of a random bookie or broker; everything acknowledged
  must be consumed, nothing stored twice.
- `broker-memory`: the broker's RSS while `--messages` small messages pass
  (bench/broker_memory.py), which must level off below 2x its entry cache.

Each prints one JSON object per result.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import tempfile
import time
from pathlib import Path

import trio

from bench.cluster import bench_cluster, rss_mb
from quire import cli_ranges as ranges
from quire.cli_parsing import Parser
from quire.progress import Progress
from sim.frame_fuzz import BOOKIE, BROKER, fuzz_case, send_case

WARMUP_FRAMES = 10_000
SENDERS = 8  # connections sending at once
RSS_GROWTH_MAX = 0.10


def _send_many(address: str, protocol: str, count: int, seed: int, on_sent) -> dict[str, int]:
    """`count` cases from `SENDERS` threads; returns the outcomes by kind."""
    host, port = address.rsplit(":", 1)
    outcomes: dict[str, int] = {}

    def sender(index: int) -> None:
        rng = random.Random(seed * 1_000 + index)
        for _ in range(count // SENDERS):
            case = fuzz_case(rng, protocol)
            try:
                send_case(host, int(port), protocol, case)
                outcome = "closed"
            except TimeoutError:
                outcome = "left open"
            except ConnectionRefusedError:
                outcome = "refused"
            except OSError:
                outcome = "reset"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            on_sent()

    with concurrent.futures.ThreadPoolExecutor(SENDERS) as pool:
        for future in [pool.submit(sender, index) for index in range(SENDERS)]:
            future.result()
    return outcomes


def fuzz(frames: int, seed: int) -> list[dict]:
    results = []
    with bench_cluster(3, broker_count=1) as cluster:
        targets = [(BOOKIE, *cluster.bookies[0]), (BROKER, *cluster.brokers[0])]
        for protocol, address, process in targets:
            sent = [0]
            with Progress(f"fuzz {protocol}", total=frames + WARMUP_FRAMES, unit="frames") as progress:
                def tick() -> None:
                    sent[0] += 1
                    if sent[0] % 500 == 0:
                        progress.update(sent[0])

                _send_many(address, protocol, WARMUP_FRAMES, seed, tick)
                before = rss_mb(process.pid)
                started = time.monotonic()
                outcomes = _send_many(address, protocol, frames, seed + 1, tick)
                elapsed = time.monotonic() - started
            alive = process.poll() is None
            after = rss_mb(process.pid) if alive else None
            results.append({
                "name": "soak_fuzz",
                "parameters": {"process": protocol, "frames": frames, "senders": SENDERS, "seed": seed},
                "frames_per_s": round(frames / elapsed, 1),
                "exits": 0 if alive else 1,
                "outcomes": outcomes,
                "rss_mb_before": round(before, 1),
                "rss_mb_after": None if after is None else round(after, 1),
                "rss_growth": None if after is None else round(after / before - 1, 3),
                "target": {"exits": 0, "rss_growth_max": RSS_GROWTH_MAX},
                "met": alive and after / before - 1 <= RSS_GROWTH_MAX,
            })
    return results


def kill_cycles(cycles: int, seed: int) -> dict:
    from coordination.zk_launcher import ZooKeeperServer
    from sim.jepsen.processes import free_port
    from sim.kill_cycles import KillCycles

    base = Path(".bench")
    base.mkdir(exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="kill-cycles-", dir=base))
    zk = ZooKeeperServer(free_port(), directory / "zookeeper", die_with_parent=True)
    zk.start()
    try:
        run = KillCycles(directory, zk.address, cycles=cycles, seed=seed)
        with Progress("kill -9 cycles", total=cycles, unit="cycles") as progress:
            run.on_cycle = progress.update
            report = trio.run(run.run)
    finally:
        zk.stop()
    return {
        "name": "soak_kill_cycles",
        "parameters": {"cycles": cycles, "seed": seed, "bookies": len(run.bookies), "brokers": len(run.brokers)},
        "kills": report.kills,
        "sent": report.sent,
        "acknowledged": report.acknowledged,
        "consumed": report.consumed,
        "lost": len(report.lost),
        "duplicated": len(report.duplicated),
        "elapsed_s": round(report.elapsed_s, 1),
        "target": {"lost": 0, "duplicated": 0},
        "met": report.ok,
    }


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/soak.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="fuzz,kill,broker-memory", help="which parts, comma-separated")
    parser.add_argument("--frames", type=ranges.count, default=1_000_000, help="hostile frames per process type")
    parser.add_argument("--cycles", type=ranges.count, default=100, help="kill -9 cycles")
    parser.add_argument("--messages", type=ranges.bench_messages, default=5_000_000, help="small messages through the broker")
    parser.add_argument("--seed", type=ranges.seed, default=0, help="seed of the fuzzed frames and of the kills")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    arguments = parser.parse_args(argv)
    parts = {part.strip() for part in arguments.parts.split(",") if part.strip()}
    unknown = parts - {"fuzz", "kill", "broker-memory"}
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    if "fuzz" in parts:
        for result in fuzz(arguments.frames, arguments.seed):
            print(json.dumps(result), flush=True)
    if "kill" in parts:
        print(json.dumps(kill_cycles(arguments.cycles, arguments.seed)), flush=True)
    if "broker-memory" in parts:
        from bench import broker_memory

        broker_memory.main(["--messages", str(arguments.messages)])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
