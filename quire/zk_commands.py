"""`quire zk run`: a local ZooKeeper from Debian's package, in the foreground."""

from __future__ import annotations

import argparse
from pathlib import Path

from quire.cli_parsing import UsageError, port_number
from quire.logging_setup import configure_logging


def add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=port_number, default=2181, help="client port")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--data-dir", type=Path, required=True, metavar="DIR", help="snapshots and transaction logs")


def run(arguments: argparse.Namespace) -> int:
    from coordination.zk_launcher import ZooKeeperNotInstalledError, ZooKeeperStartError, run_foreground

    configure_logging(arguments.log_level, "zookeeper", f"{arguments.host}:{arguments.port}", arguments.log_format)
    from bookie.durable_files import directory_problem

    problem = directory_problem(arguments.data_dir, "data directory")
    if problem is not None:
        raise UsageError(problem)
    try:
        return run_foreground(arguments.port, arguments.data_dir, host=arguments.host)
    except (ZooKeeperNotInstalledError, ZooKeeperStartError) as error:
        raise UsageError(str(error).splitlines()[0]) from None
