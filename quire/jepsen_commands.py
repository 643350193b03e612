"""`quire jepsen`: a Jepsen-style run against real processes (see
sim/jepsen/runner.py); prints the checker's summary and where the history,
the summary and the plot are. Exit status 0 only when the checker's verdict
is VALID: 1 when it finds anomalies (INVALID) or could not check every
acknowledged add against a final read (INCOMPLETE)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from quire import cli_ranges as ranges


def add_jepsen(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=ranges.seconds, default=60, metavar="SECONDS", help="nemesis time (default %(default)s)")
    parser.add_argument("--writers", type=ranges.processes, default=2, help="writer client processes")
    parser.add_argument("--readers", type=ranges.processes_or_none, default=1, help="reader client processes (they also recover open ledgers)")
    parser.add_argument("--bookies", type=ranges.jepsen_bookies, default=5,
                        help="bookie processes: at least 4, as ledgers use 3 and one may be down")
    parser.add_argument("--seed", type=ranges.seed, default=0, help="seeds the nemesis and the workload")
    parser.add_argument(
        "--work-dir", type=Path, default=None, metavar="DIR",
        help="where processes keep data and logs, and the history, summary and plot go (default jepsen-runs/<time>)",
    )


def jepsen(arguments: argparse.Namespace) -> int:
    from quire.cli import UsageError
    from quire.extras import require
    from sim.jepsen.runner import run_jepsen

    require("jepsen", "quire jepsen (its plots)")

    work_dir = arguments.work_dir or Path("jepsen-runs") / time.strftime("%Y%m%d-%H%M%S")
    if work_dir.exists() and any(work_dir.iterdir()):
        raise UsageError(f"{work_dir} is not empty: choose a new --work-dir")
    report = run_jepsen(
        work_dir.resolve(), duration_s=arguments.duration, writers=arguments.writers, readers=arguments.readers,
        bookies=arguments.bookies, seed=arguments.seed,
    )
    print(report.summary())
    print(f"history: {report.history_path}\nsummary: {report.summary_path}\nplot: {report.plot_path}")
    return 0 if report.result.verdict == "VALID" else 1
