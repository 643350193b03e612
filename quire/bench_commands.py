"""`quire bench NAME [ARGS...]`: run one of the benchmarks in bench/."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "bookie_add": "one bookie, one client pipelining 1 KiB adds, fsync on",
    "ledger_write": "the ledger client on 3 bookies, and NATS JetStream as the reference",
    "caller_patterns": "the ledger client's add called eight ways (a task per add, pipelined, a writer, the sync facade, ...), each against NATS JetStream called the same way; quire's and the Pulsar client's send and receive patterns",
    "scaling": "cost curves as the work grows: entry size, open ledgers, topics, durable subscriptions, bookies, catch-up reads by entry size (PNG plots)",
    "ledger_read": "catch-up read of a closed 1M-entry ledger",
    "broker_pubsub": "broker publish, end to end and backlog, and NATS JetStream as the reference",
    "pulsar_client": "the official Pulsar client against quire, with NATS JetStream and quire's own client in the same run",
    "broker_memory": "a broker's RSS while millions of small messages pass, against its entry cache",
    "autorecovery": "time to restore full replication after a bookie is lost",
    "bookie_gc": "disk space the bookies' garbage collection reclaims, and how fast",
    "spark_export": "Spark export of a 1 GiB topic to Parquet, and its two references",
    "metrics_overhead": "ledger_write's workload with the bookies' metrics off and on",
    "security_overhead": "publishing through the Pulsar client and quire's, on an open cluster and on one with tokens and TLS",
    "soak": "hostile frames, kill -9 cycles and a long stream of small messages: processes stay up and bounded",
    "delayed_delivery": "1,000,000 delayed messages spread over 10 minutes: how late they come, and the broker's memory",
    "rest_admin": "the REST admin API's topic stats over 1,000 topics, one by one, concurrently, and as one partitioned topic",
    "compaction": "compaction of 1,000,000 messages over 10,000 keys, and reading the view against reading the whole topic",
}


def add_bench(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS), metavar="NAME",
                        help="; ".join(f"{name}: {what}" for name, what in BENCHMARKS.items()))
    parser.add_argument("arguments", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the benchmark's own flags (quire bench NAME --help lists them)")


# Benchmarks that need one of quire's extras (quire/extras.py).
NEEDS_EXTRA = {"spark_export": "spark"}


def bench(arguments: argparse.Namespace) -> int:
    from quire.extras import require

    if arguments.benchmark in NEEDS_EXTRA:
        require(NEEDS_EXTRA[arguments.benchmark], f"quire bench {arguments.benchmark}")
    module = importlib.import_module(f"bench.{arguments.benchmark}")
    # Its errors name the command typed: `quire bench NAME: error: ...`.
    return module.main(arguments.arguments, prog=f"quire bench {arguments.benchmark}") or 0
