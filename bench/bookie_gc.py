"""Benchmark: disk space reclaimed by the bookies' garbage collection, and
how long it takes.

3 bookies on loopback (64 MiB entry logs, a checkpoint and a GC round
every second), E=3
WQ=3 AQ=2, `--ledgers` ledgers of `--entries` 1 KiB entries written a few
at a time, so that every entry log holds many ledgers. Then two rounds:

- every other ledger is deleted: the entry logs keep about half their
  data, under the compaction threshold (`--threshold`, 0.6 here), so
  compaction copies what is live and removes the old logs;
- the remaining ledgers but `--keep` are deleted: whole logs go.

Each round measures the ledger directories' disk use (allocated blocks,
RocksDB index included) before the deletion and once garbage collection
has settled, the time from the deletion to that point, and the bookies' own
counters (`quire bookie info`). Every live ledger is then read back and
compared byte for byte: no live entry may be lost.

    .venv/bin/python -m bench.bookie_gc

Prints one JSON object per round and a summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import struct
import sys
import time
from pathlib import Path

import trio

from bench.cluster import bench_cluster
from bookie.disk_usage import tree_bytes
from ledger_client import BookKeeper
from ledger_client.bookie_client import BookieClient
from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, Parser, nonnegative_int
from quire.progress import Progress

PASSWORD = b"bench-gc"
FILLER = os.urandom(1024)
WRITERS = 8  # ledgers written at once
WINDOW = 200  # adds in flight per ledger
SETTLED_S = 3.0  # disk use unchanged this long: garbage collection is done


def payload(ledger_id: int, entry_id: int, entry_bytes: int) -> bytes:
    head = struct.pack(">qq", ledger_id, entry_id)
    return head + filler(entry_bytes - len(head))


@functools.lru_cache(maxsize=4)
def filler(size: int) -> bytes:
    """`size` bytes of FILLER, repeated as often as it takes."""
    return (FILLER * (size // len(FILLER) + 1))[:size]


async def write_ledgers(bk: BookKeeper, count: int, entries: int, entry_bytes: int) -> list[int]:
    ledger_ids: list[int] = []
    with Progress(f"writing {count} ledgers of {entries} entries", total=count * entries, unit="entries") as progress:
        written = 0

        async def write_one() -> None:
            nonlocal written
            lh = await bk.create_ledger(3, 3, 2, password=PASSWORD)
            ledger_ids.append(lh.ledger_id)
            room = trio.Semaphore(WINDOW)
            failures: list[BaseException] = []

            def done(pending) -> None:
                room.release()
                if pending.error is not None:
                    failures.append(pending.error)

            for entry_id in range(entries):
                await room.acquire()
                await lh.submit_add(payload(lh.ledger_id, entry_id, entry_bytes), done)
            for _ in range(WINDOW):
                await room.acquire()
            if failures:
                raise failures[0]
            await lh.close()
            written += entries
            progress.update(written)

        for first in range(0, count, WRITERS):
            async with trio.open_nursery() as nursery:
                for _ in range(min(WRITERS, count - first)):
                    nursery.start_soon(write_one)
    return sorted(ledger_ids)


async def gc_info(addresses: list[str]) -> list[dict]:
    infos = []
    for address in addresses:
        async with BookieClient.connect(address) as client:
            infos.append((await client.get_info()).info)
    return infos


async def settle(directories: list[Path], deadline_s: float) -> tuple[int, float]:
    """Wait until the directories' disk use has not changed for SETTLED_S;
    return it and when it last changed (perf_counter)."""
    last = sum(tree_bytes(directory) for directory in directories)
    changed_at = time.perf_counter()
    ends = changed_at + deadline_s
    while time.perf_counter() < ends:
        await trio.sleep(0.25)
        now = sum(tree_bytes(directory) for directory in directories)
        if now != last:
            last, changed_at = now, time.perf_counter()
        elif time.perf_counter() - changed_at >= SETTLED_S:
            break
    return last, changed_at


async def verify(bk: BookKeeper, ledger_ids: list[int], entries: int, entry_bytes: int) -> int:
    checked = 0
    with Progress("reading the live ledgers back", total=len(ledger_ids) * entries, unit="entries") as progress:
        for ledger_id in ledger_ids:
            rh = await bk.open_ledger(ledger_id, PASSWORD)
            expected = 0
            async for entry in rh.read(0, rh.last_add_confirmed):
                if entry.entry_id != expected or bytes(entry.data) != payload(ledger_id, expected, entry_bytes):
                    raise AssertionError(f"ledger {ledger_id} entry {expected} read back wrong")
                expected += 1
            if expected != entries:
                raise AssertionError(f"ledger {ledger_id}: {expected} entries read back, {entries} written")
            checked += expected
            progress.update(checked)
    return checked


async def run(cluster, arguments: argparse.Namespace) -> list[dict]:
    directories = [cluster.directory / f"bookie-{index + 1}" / "ledgers" for index in range(len(cluster.bookies))]
    results = []
    async with BookKeeper.connect(cluster.zk_hosts, root=cluster.root) as bk:
        ledger_ids = await write_ledgers(bk, arguments.ledgers, arguments.entries, arguments.entry_bytes)
        live = list(ledger_ids)
        rounds = [
            ("gc_compaction", "every other ledger deleted", live[1::2]),
            ("gc_whole_logs", f"all but {arguments.keep} of the rest deleted", live[0::2][arguments.keep:]),
        ]
        # Everything written reaches the entry logs (a checkpoint) first.
        await settle(directories, deadline_s=120)
        for name, what, doomed in rounds:
            before = sum(tree_bytes(directory) for directory in directories)
            info_before = await gc_info(cluster.bookie_addresses)
            began = time.perf_counter()
            for ledger_id in doomed:
                await bk.delete_ledger(ledger_id)
            deleted_at = time.perf_counter()
            after, changed_at = await settle(directories, deadline_s=arguments.deadline)
            info_after = await gc_info(cluster.bookie_addresses)
            live = [ledger_id for ledger_id in live if ledger_id not in set(doomed)]

            def counter(key: str) -> int:
                return sum(after_info.get(key, 0) - before_info.get(key, 0)
                           for before_info, after_info in zip(info_before, info_after))

            result = {
                "name": name,
                "parameters": {"what": what, "bookies": len(directories), "ledgers_deleted": len(doomed),
                               "ledgers_live": len(live), "entries_per_ledger": arguments.entries,
                               "entry_bytes": arguments.entry_bytes, "entry_log_bytes_max": arguments.entry_log_bytes,
                               "gc_interval_s": arguments.gc_interval, "compaction_threshold": arguments.threshold},
                "disk_bytes_before": before,
                "disk_bytes_after": after,
                "reclaimed_bytes": before - after,
                "reclaimed_fraction": round((before - after) / before, 3) if before else None,
                "seconds_to_reclaim": round(changed_at - deleted_at, 2),
                "delete_seconds": round(deleted_at - began, 2),
                "reclaimed_mb_per_s": round((before - after) / 1e6 / max(changed_at - deleted_at, 1e-3), 1),
                "gc_ledgers_dropped": counter("gc_ledgers_dropped"),
                "gc_entry_logs_deleted": counter("gc_entry_logs_deleted"),
                "gc_entry_logs_compacted": counter("gc_entry_logs_compacted"),
                "gc_entries_moved": counter("gc_entries_moved"),
                "gc_bytes_reclaimed": counter("gc_bytes_reclaimed"),
            }
            result["live_entries_verified"] = await verify(bk, live, arguments.entries, arguments.entry_bytes)
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


# Each entry starts with the 16 bytes (ledger id, entry id) the check of live entries reads back.
ENTRY_BYTES_MIN = 16


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/bookie_gc.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ledgers", type=ranges.bench_ledgers, default=96, help="ledgers written (more than 2 x --keep + 1)")
    parser.add_argument("--entries", type=ranges.entries_per_ledger, default=2000, help="entries per ledger")
    parser.add_argument("--entry-bytes", type=Bounded("size", ENTRY_BYTES_MIN, ranges.ENTRY_BYTES_MAX,
                                                      why="the largest entry a ledger takes"),
                        default=1024, help="size of each entry")
    parser.add_argument("--keep", type=nonnegative_int, default=4, help="ledgers left alive at the end")
    parser.add_argument("--entry-log-bytes", type=ranges.entry_log_bytes, default=64 * 1024 * 1024,
                        help="the bookies' --entry-log-bytes-max")
    parser.add_argument("--gc-interval", type=ranges.bench_seconds, default=1.0, help="the bookies' --gc-interval-s")
    parser.add_argument("--threshold", type=ranges.compaction_threshold, default=0.6,
                        help="compaction threshold (a log whose live fraction is below it is compacted)")
    parser.add_argument("--deadline", type=ranges.bench_seconds, default=300.0, help="seconds to wait for each round to settle")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    arguments = parser.parse_args(argv)
    if arguments.ledgers < 2 * arguments.keep + 2:
        parser.error(f"--ledgers {arguments.ledgers} leaves nothing to delete beyond 2 x --keep {arguments.keep}: "
                     f"need at least {2 * arguments.keep + 2}")
    options = ["--entry-log-bytes-max", str(arguments.entry_log_bytes), "--gc-interval-s", str(arguments.gc_interval),
               "--checkpoint-interval-ms", "1000",
               "--gc-compaction-threshold", str(arguments.threshold), "--no-autorecovery"]
    with bench_cluster(3, bookie_options=options) as cluster:
        results = trio.run(run, cluster, arguments)
    print(json.dumps({
        "name": "bookie_gc_summary",
        "reclaimed_bytes": sum(result["reclaimed_bytes"] for result in results),
        "seconds_to_reclaim": [result["seconds_to_reclaim"] for result in results],
        "live_entries_verified": results[-1]["live_entries_verified"],
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
