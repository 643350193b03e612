"""`quire jepsen`: a Jepsen-style run against real processes (see
sim/jepsen/runner.py, and sim/jepsen/broker_runner.py for `--broker`);
prints the checker's summary and where the history, the summary and the plot
are. Exit status 0 only when the checker's verdict is VALID: 1 when it finds
anomalies (INVALID) or could not check everything acknowledged against a
final read or drain (INCOMPLETE)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from quire import cli_ranges as ranges

WRITERS_DEFAULT = 2
READERS_DEFAULT = 1
BOOKIES_DEFAULT = 5
BROKER_RUN_BOOKIES_DEFAULT = 4


def nemesis_faults(text: str) -> tuple[str, ...]:
    """An argparse type: the fault kinds a --nemesis list names."""
    from sim.jepsen.runner import parse_nemesis

    try:
        return parse_nemesis(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None



def add_jepsen(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", action="store_true",
                        help="test the broker: ZooKeeper, bookies and 3 brokers, deduplicating producers and consumers "
                             "of every subscription type (sim/jepsen/broker_runner.py)")
    parser.add_argument("--duration", type=ranges.seconds, default=60, metavar="SECONDS", help="nemesis time (default %(default)s)")
    parser.add_argument("--nemesis", type=nemesis_faults, default="kill,pause,partition,expiry", metavar="FAULT,...",
                        help="the faults to inject, some of kill, pause, partition, expiry (ZooKeeper session expiry)")
    parser.add_argument("--writers", type=ranges.processes, help=f"writer client processes (default {WRITERS_DEFAULT}; not with --broker)")
    parser.add_argument("--readers", type=ranges.processes_or_none,
                        help=f"reader client processes, which also recover open ledgers (default {READERS_DEFAULT}; not with --broker)")
    parser.add_argument("--bookies", type=ranges.jepsen_bookies,
                        help=f"bookie processes: at least 4, as ledgers use 3 and one may be down "
                             f"(default {BOOKIES_DEFAULT}; {BROKER_RUN_BOOKIES_DEFAULT} with --broker)")
    parser.add_argument("--seed", type=ranges.seed, default=0, help="seeds the nemesis and the workload")
    parser.add_argument(
        "--work-dir", type=Path, default=None, metavar="DIR",
        help="where processes keep data and logs, and the history, summary and plot go (default jepsen-runs/<time>)",
    )


def jepsen(arguments: argparse.Namespace) -> int:
    from quire.cli_parsing import UsageError
    from quire.extras import require
    from sim.jepsen.runner import FAULTS

    require("jepsen", "quire jepsen (its plots)")

    broker = getattr(arguments, "broker", False)
    faults = getattr(arguments, "nemesis", FAULTS)
    if broker and (arguments.writers is not None or arguments.readers is not None):
        raise UsageError("--writers and --readers are for the ledger run; the broker run has its own producers and consumers")
    work_dir = arguments.work_dir or Path("jepsen-runs") / time.strftime("%Y%m%d-%H%M%S")
    if work_dir.exists() and any(work_dir.iterdir()):
        raise UsageError(f"{work_dir} is not empty: choose a new --work-dir")
    if broker:
        from sim.jepsen.broker_runner import run_broker_jepsen

        report = run_broker_jepsen(
            work_dir.resolve(), duration_s=arguments.duration, bookies=arguments.bookies or BROKER_RUN_BOOKIES_DEFAULT,
            seed=arguments.seed, faults=faults,
        )
    else:
        from sim.jepsen.runner import run_jepsen

        report = run_jepsen(
            work_dir.resolve(), duration_s=arguments.duration,
            writers=WRITERS_DEFAULT if arguments.writers is None else arguments.writers,
            readers=READERS_DEFAULT if arguments.readers is None else arguments.readers,
            bookies=arguments.bookies or BOOKIES_DEFAULT, seed=arguments.seed, faults=faults,
        )
    print(report.summary())
    print(f"history: {report.history_path}\nsummary: {report.summary_path}\nplot: {report.plot_path}")
    return 0 if report.result.verdict == "VALID" else 1
