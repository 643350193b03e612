"""Benchmark: time to restore full replication of N ledgers after a bookie loss.

5 bookies on loopback, each running the embedded auto-recovery daemon
(auditor candidate and replication worker). Writes `--ledgers` closed
ledgers of `--entries` entries (E=3 WQ=3 AQ=2, 1 KiB), kills one bookie -9
for good, and measures until no ledger is marked under-replicated and no
ensemble names the lost bookie:

- `registry_s`: until the bookie's registration is gone (its ZooKeeper
  session expires: `--session-timeout-ms`);
- `marked_s`: until the auditor marked its ledgers (+ `--lost-bookie-delay`);
- `restored_s`: until every ledger is back to full write quorum;
  `replication_s` = restored − marked is the replication workers' own time.

    .venv/bin/python -m bench.autorecovery [--ledgers 100] [--entries 1000]

Prints one JSON object per result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import trio

from bench.cluster import bench_cluster
from coordination.cluster_layout import ClusterLayout
from ledger_client.bookkeeper import BookKeeper
from quire import cli_ranges as ranges
from quire.cli_parsing import Parser, human_duration
from quire.progress import Progress

PASSWORD = b""  # the embedded daemon's default recovery password
WRITE_WINDOW = 1000
POLL_S = 0.1


async def write_ledgers(bk: BookKeeper, ledgers: int, entries: int, entry_bytes: int) -> list[int]:
    payload = os.urandom(entry_bytes)
    room = trio.Semaphore(WRITE_WINDOW)
    ledger_ids = []
    with Progress("writing the ledgers", total=ledgers, unit="ledgers") as progress:
        # A few ledgers written at once keep the window full.
        for first in range(0, ledgers, 10):
            handles = [await bk.create_ledger(3, 3, 2, password=PASSWORD) for _ in range(min(10, ledgers - first))]
            for _ in range(entries):
                for handle in handles:
                    await room.acquire()
                    await handle.submit_add(payload, lambda pending: room.release())
            for handle in handles:
                await handle.close()
                ledger_ids.append(handle.ledger_id)
            progress.update(len(ledger_ids))
    return ledger_ids


async def under_replicated(bk: BookKeeper) -> int:
    return len(await bk.store.children(ClusterLayout().underreplicated_ledgers))


async def measure(bk: BookKeeper, ledger_ids: list[int], victim: str, kill, deadline_s: float) -> dict:
    held = [ledger_id for ledger_id in ledger_ids if victim in (await bk.ledger_metadata(ledger_id)).all_bookies()]
    entries_held = 0
    for ledger_id in held:
        metadata = await bk.ledger_metadata(ledger_id)
        entries_held += sum(victim in metadata.write_set(entry_id) for entry_id in range(metadata.last_entry_id + 1))
    killed = time.perf_counter()
    kill()
    registry_s = marked_s = None
    remaining = set(held)
    with trio.fail_after(deadline_s), Progress("restoring replication", total=len(held), unit="ledgers") as progress:
        while True:
            now_s = time.perf_counter() - killed
            if registry_s is None and victim not in bk.registry.writable_bookies:
                registry_s = now_s
            marked = await under_replicated(bk)
            if marked_s is None and marked:
                marked_s = now_s
            for ledger_id in sorted(remaining):
                if victim not in (await bk.ledger_metadata(ledger_id)).all_bookies():
                    remaining.discard(ledger_id)
            progress.update(len(held) - len(remaining))
            if not remaining and marked == 0 and marked_s is not None:
                restored_s = time.perf_counter() - killed
                break
            await trio.sleep(POLL_S)
    return {
        "ledgers_on_lost_bookie": len(held),
        "entries_copied": entries_held,
        "registry_s": round(registry_s, 2),
        "marked_s": round(marked_s, 2),
        "restored_s": round(restored_s, 2),
        "replication_s": round(restored_s - marked_s, 2),
        "entries_copied_per_s": round(entries_held / max(restored_s - marked_s, 1e-9), 1),
    }


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog or "bench/autorecovery.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ledgers", type=ranges.bench_ledgers, default=100, help="closed ledgers written before the loss")
    parser.add_argument("--entries", type=ranges.entry_count, default=1000, help="entries per ledger")
    parser.add_argument("--entry-bytes", type=ranges.entry_bytes, default=1024, help="size of each entry")
    parser.add_argument("--bookies", type=ranges.bench_bookies, default=5,
                        help="bookies started; one is lost, the ensembles of 3 need a fourth to move to")
    parser.add_argument("--lost-bookie-delay", type=ranges.delay, default=0, metavar="DURATION",
                        help="the daemons' --lost-bookie-delay")
    parser.add_argument("--session-timeout-ms", type=ranges.session_timeout_ms, default=4000,
                        help="the bookies' ZooKeeper session timeout")
    parser.add_argument("--deadline-s", type=ranges.bench_seconds, default=600.0, help="give up waiting for the recovery after this long")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    arguments = build_parser(prog).parse_args(argv)
    lost_bookie_delay = human_duration(arguments.lost_bookie_delay)
    options = ["--lost-bookie-delay", lost_bookie_delay, "--session-timeout-ms", str(arguments.session_timeout_ms)]
    with bench_cluster(arguments.bookies, bookie_options=options) as cluster:
        victim, process = cluster.bookies[0]

        async def run() -> dict:
            async with BookKeeper.connect(cluster.zk_hosts, cluster.root, pending_adds_max=WRITE_WINDOW) as bk:
                ledger_ids = await write_ledgers(bk, arguments.ledgers, arguments.entries, arguments.entry_bytes)
                return await measure(bk, ledger_ids, victim, process.kill, arguments.deadline_s)

        result = trio.run(run)
    print(json.dumps({
        "name": "autorecovery",
        "parameters": {
            "ledgers": arguments.ledgers, "entries_per_ledger": arguments.entries, "entry_bytes": arguments.entry_bytes,
            "bookies": arguments.bookies, "ensemble": 3, "write_quorum": 3, "ack_quorum": 2,
            "lost_bookie_delay": lost_bookie_delay, "session_timeout_ms": arguments.session_timeout_ms,
        },
        **result,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
