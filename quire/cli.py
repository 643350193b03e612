"""The `quire` command line: one parser, one handler per command.

A bad argument prints what is wrong and exits 2; a process that cannot start
prints one clear line and exits 2; nothing prints a traceback for an error an
operator can fix. Every number the command line takes has a range (the
`Bounded` types of quire.cli_parsing, the bounds of each flag in
quire.cli_ranges), checked while parsing, before any command does anything.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from quire import (
    autorecovery_commands,
    bench_commands,
    bookie_commands,
    broker_commands,
    cluster_commands,
    export_commands,
    health_commands,
    jepsen_commands,
    ledger_commands,
    logging_setup,
    sim_commands,
    subscription_commands,
    tenant_commands,
    token_commands,
    topic_commands,
    zk_commands,
)
from quire.cli_parsing import EXIT_USAGE, HostPorts, Parser, UsageError
from quire.security_options import add_credentials


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zk", default="127.0.0.1:2181", metavar="HOSTS", type=HostPorts("ZooKeeper"),
                        help="ZooKeeper hosts (default %(default)s)")
    parser.add_argument("--root", default="/quire", metavar="PATH", help="ZooKeeper chroot of the cluster (default %(default)s)")
    zk_auth = parser.add_mutually_exclusive_group()
    zk_auth.add_argument("--zk-auth", metavar="USER:PASSWORD", type=_zk_auth,
                         help="authenticate to ZooKeeper with this digest identity, and make every node only it may "
                              "read and change (default: $QUIRE_ZK_AUTH; none: open nodes)")
    zk_auth.add_argument("--zk-auth-file", metavar="FILE", help="a file holding USER:PASSWORD for --zk-auth")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="least severe log records shown (one-shot commands show warnings and errors at info)")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="log lines as text (time level role id logger: message) or as JSON objects")


def _zk_auth(text: str) -> str:
    from coordination.zk_store import check_digest_auth

    try:
        return check_digest_auth(text.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _use_zk_auth(arguments: argparse.Namespace) -> None:
    """--zk-auth (or its file) for every ZooKeeper connection of this
    process, and of the processes it starts (through QUIRE_ZK_AUTH)."""
    import os

    from coordination.zk_store import ZK_AUTH_ENV, set_digest_auth

    value = getattr(arguments, "zk_auth", None)
    path = getattr(arguments, "zk_auth_file", None)
    if path is not None:
        try:
            with open(path) as file:
                value = _zk_auth(file.read())
        except OSError as error:
            raise UsageError(f"--zk-auth-file: cannot read {path}: {error.strerror}") from None
        except argparse.ArgumentTypeError as error:
            raise UsageError(f"--zk-auth-file {path}: {error}") from None
    if value is None:
        value = os.environ.get(ZK_AUTH_ENV) or None
        if value is not None:
            try:
                _zk_auth(value)
            except argparse.ArgumentTypeError as error:
                raise UsageError(f"${ZK_AUTH_ENV}: {error}") from None
    if value is not None:
        os.environ[ZK_AUTH_ENV] = value
        set_digest_auth(value)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="quire", description="quire: a replicated ledger cluster")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)

    def group(name: str, help_text: str) -> argparse._SubParsersAction:
        sub = commands.add_parser(name, help=help_text)
        return sub.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=Parser)

    def command(subparsers, name: str, help_text: str, handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        _common(sub)
        sub.set_defaults(handler=handler)
        return sub

    zk = group("zk", "run a local ZooKeeper")
    zk_commands.add_run(command(zk, "run", "run ZooKeeper in the foreground until SIGTERM/SIGINT", zk_commands.run))
    health_commands.add_health(command(zk, "health", "whether a ZooKeeper server serves (exit 0) or not (exit 1)",
                                       health_commands.zk_health), "ZooKeeper")

    bookie = group("bookie", "storage nodes")
    bookie_commands.add_run(command(bookie, "run", "run a bookie in the foreground until SIGTERM/SIGINT", bookie_commands.run))
    bookie_commands.add_format(
        command(bookie, "format", "forget a bookie: delete its cookie and empty its directories", bookie_commands.format_)
    )
    command(bookie, "ls", "list registered bookies", bookie_commands.list_)
    bookie_commands.add_info(command(bookie, "info", "ask a bookie for its state", bookie_commands.info))
    health_commands.add_health(command(bookie, "health", "whether a bookie serves, writable and registered (exit 0), or not (exit 1)",
                                       health_commands.bookie_health), "bookie")
    bookie_commands.add_simpletest(
        command(
            bookie, "simpletest", "write entries to every bookie through the bookie protocol and read them back",
            bookie_commands.simpletest,
        )
    )

    ledger = group("ledger", "ledgers: create, list, show, read, recover, delete")
    ledger_commands.add_create(command(ledger, "create", "create a ledger (and add entries to it)", ledger_commands.create))
    command(ledger, "ls", "list ledger ids", ledger_commands.list_)
    ledger_commands.add_ledger_id(command(ledger, "show", "print a ledger's metadata", ledger_commands.show))
    ledger_commands.add_read(command(ledger, "read", "print a ledger's entries", ledger_commands.read))
    ledger_commands.add_recover(
        command(ledger, "recover", "fence and close a ledger that its writer left open", ledger_commands.recover)
    )
    ledger_commands.add_ledger_id(command(ledger, "delete", "delete a ledger", ledger_commands.delete))
    for ledger_command in ledger.choices.values():  # each reaches bookies: a token and TLS for those that ask
        add_credentials(ledger_command)

    broker = group("broker", "brokers: topics, producers, subscriptions")
    broker_commands.add_run(command(broker, "run", "run a broker in the foreground until SIGTERM/SIGINT", broker_commands.run))
    health_commands.add_health(command(broker, "health", "whether a broker serves and is registered (exit 0), or not (exit 1)",
                                       health_commands.broker_health), "broker")

    topic = group("topic", "topics: create, list, stats, set policies, unload, delete")
    topic_commands.add_create(command(topic, "create", "create a topic (partitioned with --partitions N)", topic_commands.create))
    topic_commands.add_ls(command(topic, "ls", "list topics", topic_commands.list_))
    topic_commands.add_stats(command(topic, "stats", "a topic's partitions: rates, backlog per subscription, ledgers", topic_commands.stats))
    topic_commands.add_set_policies(
        command(topic, "set-policies", "change a topic's retention, quota, rollover or deduplication", topic_commands.set_policies)
    )
    topic_commands.add_topic(command(topic, "unload", "have the owners give a topic up (another broker takes it)", topic_commands.unload))
    topic_commands.add_delete(command(topic, "delete", "delete a topic, its ledgers and subscriptions", topic_commands.delete))
    subscription_commands.register_topic(topic, command)
    subscription_commands.register_namespace(tenant_commands.register(group, command), command)

    produce = commands.add_parser("produce", help="send messages to a topic", description="send standard input's lines (or --count generated messages) to a topic")
    _common(produce)
    produce.set_defaults(handler=topic_commands.produce, action=None)
    topic_commands.add_produce(produce)

    consume = commands.add_parser("consume", help="print a subscription's messages", description="receive, print and acknowledge a subscription's messages")
    _common(consume)
    consume.set_defaults(handler=topic_commands.consume, action=None)
    topic_commands.add_consume(consume)

    export = commands.add_parser(
        "export", help="write a topic's closed ledgers with Spark",
        description="a Spark job that writes a topic's closed ledgers, read straight from the bookies, as Parquet or JSON",
    )
    _common(export)
    export.set_defaults(handler=export_commands.export, action=None)
    export_commands.add_export(export)

    simulator = commands.add_parser(
        "sim", help="run the deterministic simulator", description="run the deterministic simulator (sim/)"
    )
    _common(simulator)
    simulator.set_defaults(handler=sim_commands.sim, action=None)
    sim_commands.add_sim(simulator)

    jepsen = commands.add_parser(
        "jepsen", help="fault-test real processes", description="a Jepsen-style run against real processes (sim/jepsen/)"
    )
    _common(jepsen)
    jepsen.set_defaults(handler=jepsen_commands.jepsen, action=None)
    jepsen_commands.add_jepsen(jepsen)

    benchmark = commands.add_parser(
        "bench", help="run a benchmark", description="run one of the benchmarks in bench/; each prints one JSON object per result",
    )
    _common(benchmark)
    benchmark.set_defaults(handler=bench_commands.bench, action=None)
    bench_commands.add_bench(benchmark)

    autorecovery = group("autorecovery", "auto-recovery of lost bookies' replicas: run, switch off and on, status")
    autorecovery_commands.add_run(
        command(autorecovery, "run", "run an auditor candidate and a replication worker until SIGTERM/SIGINT", autorecovery_commands.run)
    )
    command(autorecovery, "disable", "switch auto-recovery off for the whole cluster", autorecovery_commands.disable)
    command(autorecovery, "enable", "switch auto-recovery back on", autorecovery_commands.enable)
    autorecovery_commands.add_status(
        command(autorecovery, "status", "the auditor, under-replicated ledgers, and whether auto-recovery is on", autorecovery_commands.status)
    )

    cluster = group("cluster", "a local cluster of background processes")
    cluster_commands.add_up(command(cluster, "up", "start ZooKeeper, bookies and brokers in the background", cluster_commands.up))
    cluster_commands.add_data_dir(command(cluster, "status", "show the processes of a local cluster", cluster_commands.status))
    cluster_commands.add_data_dir(command(cluster, "down", "stop a local cluster", cluster_commands.down))

    token = group("token", "token authentication: keys, tokens, and checking a token (as `pulsar tokens`)")
    token_commands.add_create_secret_key(
        command(token, "create-secret-key", "make an HS256 secret key", token_commands.create_secret_key_command)
    )
    token_commands.add_create_key_pair(
        command(token, "create-key-pair", "make an RSA key pair for RS256 tokens", token_commands.create_key_pair_command)
    )
    token_commands.add_create(command(token, "create", "print a new token for a role, signed with a key", token_commands.create_command))
    token_commands.add_show(command(token, "show", "print a token's header and claims, not verified", token_commands.show_command))
    token_commands.add_validate(
        command(token, "validate", "check a token against a key: its role (exit 0), or why it is refused (exit 1)",
                token_commands.validate_command)
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = parser.parse_args(argv)
    # Every command logs from here on, quietly: a one-shot command shows
    # warnings and errors only (kazoo's reconnect warnings not even those
    # until it first connects: the command's own error line says it). The
    # process commands (zk, bookie, broker, autorecovery run) set up their
    # own role, id and level again when they start.
    level = getattr(arguments, "log_level", "info")
    logging_setup.configure_logging("warning" if level == "info" else level,
                      " ".join(part for part in (arguments.command, getattr(arguments, "action", None)) if part),
                      log_format=getattr(arguments, "log_format", "text"))
    try:
        _use_zk_auth(arguments)
        return arguments.handler(arguments)
    except UsageError as error:
        name = " ".join(part for part in (arguments.command, arguments.action) if part)
        print(f"quire {name}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` that stopped reading: not an error.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())

