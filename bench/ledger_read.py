"""Benchmark: catch-up reads of a closed ledger through the ledger client.

3 bookies on loopback, E=3 WQ=3 AQ=2, 1 KiB entries: writes a ledger of
`--entries` entries (default 1,000,000), closes it, then reads it back from
the start, verifying every digest, as a consumer catching up would.

    .venv/bin/python -m bench.ledger_read

Prints one JSON object per result, with the CPU the client and the
bookies used while reading. Target: >= 250,000 entries/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import trio

from bench.cluster import BenchCluster, bench_cluster, cpu_percent_between, role_cpu_seconds
from ledger_client.bookkeeper import BookKeeper
from quire import cli_ranges as ranges
from quire.cli_parsing import Parser
from quire.progress import Progress

PASSWORD = b"bench"
WRITE_WINDOW = 1000


async def write_ledger(bk: BookKeeper, entries: int, entry_bytes: int) -> int:
    lh = await bk.create_ledger(3, 3, 2, password=PASSWORD)
    payload = os.urandom(entry_bytes)
    room = trio.Semaphore(WRITE_WINDOW)
    with Progress("writing the ledger", total=entries, unit="entries") as progress:
        for index in range(entries):
            try:
                room.acquire_nowait()
            except trio.WouldBlock:
                await room.acquire()
            await lh.submit_add(payload, lambda pending: room.release())
            if index % 10_000 == 0:
                progress.update(index)
        for _ in range(WRITE_WINDOW):
            await room.acquire()
    await lh.close()
    return lh.ledger_id


READ_TARGET_ENTRIES_PER_S = 250_000


async def read_ledger(bk: BookKeeper, ledger_id: int, entry_bytes: int, cluster: BenchCluster | None = None) -> dict:
    rh = await bk.open_ledger(ledger_id, PASSWORD)
    last = rh.last_add_confirmed
    count = 0
    cpu_before = role_cpu_seconds(cluster)
    started = time.perf_counter()
    with Progress("reading it back", total=last + 1, unit="entries") as progress:
        async for entry in rh.read(0, last):
            assert entry.entry_id == count
            count += 1
            if count % 10_000 == 0:
                progress.update(count)
    elapsed = time.perf_counter() - started
    cpu_after = role_cpu_seconds(cluster)
    return {
        "name": "ledger_read",
        "parameters": {"entries": last + 1, "entry_bytes": entry_bytes, "ensemble": 3, "write_quorum": 3, "ack_quorum": 2,
                       "digest": "CRC32C", "verified": True},
        "entries_per_s": round(count / elapsed, 1),
        "mb_per_s": round(count * entry_bytes / elapsed / 1e6, 2),
        "seconds": round(elapsed, 2),
        # Which side bounds the rate: a share near 100% is one core's worth.
        "cpu_percent": cpu_percent_between(cpu_before, cpu_after, elapsed),
        "target": {"entries_per_s_min": READ_TARGET_ENTRIES_PER_S, "met": count / elapsed >= READ_TARGET_ENTRIES_PER_S},
    }


async def run(zk_hosts: str, root: str, entries: int, entry_bytes: int, cluster: BenchCluster | None = None) -> dict:
    async with BookKeeper.connect(zk_hosts, root, pending_adds_max=WRITE_WINDOW) as bk:
        ledger_id = await write_ledger(bk, entries, entry_bytes)
        return await read_ledger(bk, ledger_id, entry_bytes, cluster)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/ledger_read.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=ranges.entries_per_ledger, default=1_000_000, help="entries of the ledger read")
    parser.add_argument("--entry-bytes", type=ranges.entry_bytes, default=1024, help="size of each entry")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    with bench_cluster(3) as cluster:
        result = trio.run(run, cluster.zk_hosts, cluster.root, arguments.entries, arguments.entry_bytes, cluster)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
