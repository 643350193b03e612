"""`quire bookie run|format|ls|info|simpletest`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import trio

from quire import cli_ranges as ranges
from quire.cli_parsing import Bounded, HostPorts, UsageError, fraction, metrics_port, port_number
from quire.gc_tuning import tune_gc
from quire.logging_setup import configure_logging
from quire.metadata_access import open_metadata


def add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=port_number, default=3181, help="port of the bookie protocol (BookKeeper's bookiePort)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--advertised-host", help="address clients use (default: --host, or the host name for 0.0.0.0)")
    parser.add_argument("--bookie-id", help="stable identity (default: ADVERTISED_HOST:PORT)")
    parser.add_argument("--journal-dir", type=Path, required=True, metavar="DIR", help="journal files, one directory (put it on its own disk)")
    parser.add_argument("--ledger-dir", type=Path, required=True, metavar="DIR", help="entry logs and the RocksDB index")
    parser.add_argument("--rack", help="rack label used by placement")
    parser.add_argument(
        "--metrics-port", type=metrics_port, default=0, metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default 0: no endpoint, nothing measured)",
    )
    parser.add_argument("--session-timeout-ms", type=ranges.session_timeout_ms, default=10_000, help="ZooKeeper session timeout; the registration goes this long after the bookie does")
    parser.add_argument(
        "--startup-timeout", type=ranges.interval, default=60_000, metavar="DURATION",
        help="retry the ZooKeeper steps of start-up (connect, cookies, registration) this long, then exit 2 naming the step",
    )
    parser.add_argument("--frame-bytes-max", type=ranges.frame_bytes, default=16 * 1024**2, help="largest frame a peer may send; a longer one closes its connection")
    parser.add_argument("--journal-file-bytes-max", type=ranges.journal_file_bytes, default=256 * 1024**2, help="start a new journal file past this size")
    parser.add_argument("--group-wait-ms", type=ranges.group_wait_ms, default=0.0, help="group commit wait (0: flush once the previous fsync ends)")
    parser.add_argument("--group-bytes", type=ranges.group_bytes, default=1024**2, help="with --group-wait-ms: flush once this many bytes wait")
    parser.add_argument(
        "--inline-fsync", choices=["on", "off"], default="on",
        help="fsync small journal batches on the idle event loop instead of the journal thread (lower latency at low load)",
    )
    parser.add_argument("--write-cache-bytes", type=ranges.write_cache_bytes, default=64 * 1024**2, help="entries held in memory until a checkpoint writes them to the entry logs (both halves)")
    parser.add_argument("--read-cache-bytes", type=ranges.memory_bytes, default=32 * 1024**2, help="entries read ahead from the entry logs")
    parser.add_argument("--entry-log-bytes-max", type=ranges.entry_log_bytes, default=1024**3, help="start a new entry log past this size")
    parser.add_argument("--checkpoint-interval-ms", type=ranges.interval_ms, default=10_000, help="flush the write cache and move the journal mark at least this often")
    parser.add_argument(
        "--gc-interval-s", type=ranges.interval_seconds, default=60.0,
        help="garbage collection runs this often: deleted ledgers dropped, entry logs deleted or compacted (0: off)",
    )
    parser.add_argument(
        "--gc-compaction-threshold", type=Bounded("number", 0, 1), default=0.5,
        help="compact an entry log whose live fraction is below this (0: never; default %(default)s)",
    )
    parser.add_argument("--disk-usage-threshold", type=fraction, default=0.95, help="turn read-only once a directory's disk is this full")
    parser.add_argument("--disk-usage-lwm", type=fraction, default=0.90, help="turn writable again once every disk is below this")
    parser.add_argument("--disk-quota-bytes", type=ranges.positive_storage_bytes, help="turn read-only once the bookie's own files reach this size")
    parser.add_argument("--disk-check-interval-ms", type=ranges.interval_ms, default=1_000, help="how often disk usage is checked")
    parser.add_argument("--adds-in-flight-max", type=ranges.in_flight, default=20_000, help="adds taken and not yet answered; more are refused with TOO_MANY_REQUESTS")
    parser.add_argument("--reads-in-flight-max", type=ranges.in_flight, default=10_000, help="reads taken and not yet answered; more are refused with TOO_MANY_REQUESTS")
    from quire.autorecovery_commands import add_bookie_options

    add_bookie_options(parser)
    from bookie.config import BookieConfig
    from quire.peer_limit_options import add_peer_limits

    add_peer_limits(parser, keepalive=False, requests_per_connection=BookieConfig.requests_per_connection_max)
    from quire.security_options import add_authentication, add_bookie_client, add_tls_server

    add_authentication(parser, bookie=True)
    add_tls_server(parser)
    parser.add_argument("--tls-handshake-timeout", type=ranges.interval, default=10_000, metavar="DURATION",
                        help="close a TLS connection whose handshake has not finished by then (default 10s)")
    add_bookie_client(parser)


def run(arguments: argparse.Namespace) -> int:
    from bookie.bookie_process import StartupError, run_bookie
    from bookie.config import BookieConfig
    from bookie.core_actions import CoreLimits
    from quire.peer_limit_options import peer_limits_from
    from quire.security_options import authenticator_from, tls_server_context_from

    tls_context = tls_server_context_from(arguments)
    authenticator = authenticator_from(arguments, tls_certificates=arguments.tls_trust_certs_file is not None)
    try:
        config = BookieConfig(
            journal_dir=arguments.journal_dir,
            ledger_dir=arguments.ledger_dir,
            zk_hosts=arguments.zk,
            root=arguments.root,
            host=arguments.host,
            port=arguments.port,
            advertised_host=arguments.advertised_host,
            bookie_id=arguments.bookie_id,
            rack=arguments.rack,
            session_timeout_ms=arguments.session_timeout_ms,
            startup_timeout_ms=arguments.startup_timeout,
            metrics_port=arguments.metrics_port,
            frame_bytes_max=arguments.frame_bytes_max,
            journal_file_bytes_max=arguments.journal_file_bytes_max,
            group_wait_ms=arguments.group_wait_ms,
            group_bytes=arguments.group_bytes,
            journal_inline_fsync=arguments.inline_fsync == "on",
            write_cache_bytes=arguments.write_cache_bytes,
            read_cache_bytes=arguments.read_cache_bytes,
            entry_log_bytes_max=arguments.entry_log_bytes_max,
            checkpoint_interval_ms=arguments.checkpoint_interval_ms,
            gc_interval_s=arguments.gc_interval_s,
            gc_compaction_threshold=arguments.gc_compaction_threshold,
            disk_usage_threshold=arguments.disk_usage_threshold,
            disk_usage_lwm=arguments.disk_usage_lwm,
            disk_quota_bytes=arguments.disk_quota_bytes,
            disk_check_interval_ms=arguments.disk_check_interval_ms,
            **peer_limits_from(arguments),
            authenticator=authenticator,
            client_roles=arguments.client_roles,
            tls_context=tls_context,
            tls_handshake_deadline_s=arguments.tls_handshake_timeout / 1000,
            limits=CoreLimits(
                adds_in_flight_max=arguments.adds_in_flight_max, reads_in_flight_max=arguments.reads_in_flight_max
            ),
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    configure_logging(arguments.log_level, "bookie", config.identity, arguments.log_format)
    try:
        from quire.autorecovery_commands import run_with_bookie

        tune_gc()
        trio.run(run_with_bookie, run_bookie, config, arguments)
    except StartupError as error:
        raise UsageError(str(error)) from None
    return 0


def add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bookie-id", required=True, help="the bookie to forget (as listed by `quire bookie ls`)")
    parser.add_argument("--journal-dir", type=Path, required=True, metavar="DIR", help="the bookie's journal directory, emptied")
    parser.add_argument("--ledger-dir", type=Path, required=True, metavar="DIR", help="the bookie's ledger directory, emptied")
    parser.add_argument("--force", action="store_true", help="really delete: the bookie's data is lost for good")


def format_(arguments: argparse.Namespace) -> int:
    from bookie.registration import format_bookie

    if not arguments.force:
        raise UsageError("formatting deletes the bookie's data and identity; add --force to do it")
    # Check the directories before the cookie in ZooKeeper goes: a format
    # that fails half-way must not leave a bookie with data but no cookie.
    for directory in (arguments.journal_dir, arguments.ledger_dir):
        if directory.exists() and not directory.is_dir():
            raise UsageError(f"{directory} is not a directory")

    async def go() -> None:
        async with open_metadata(arguments.zk, arguments.root) as metadata:
            from coordination.cluster_layout import ClusterLayout

            await format_bookie(metadata, ClusterLayout(), arguments.bookie_id, [arguments.journal_dir, arguments.ledger_dir])

    try:
        trio.run(go)
    except OSError as error:
        raise UsageError(f"cannot empty the bookie's directories: {error}") from None
    print(f"bookie {arguments.bookie_id} formatted: it starts as a new bookie next time")
    return 0


def list_(arguments: argparse.Namespace) -> int:
    from coordination.cluster_layout import ClusterLayout, list_bookies

    async def go() -> None:
        async with open_metadata(arguments.zk, arguments.root) as metadata:
            layout = ClusterLayout()
            for read_only in (False, True):
                bookies = await trio.to_thread.run_sync(lambda: list_bookies(metadata.store, layout, read_only=read_only))
                for bookie_id, info in sorted(bookies.items()):
                    mode = "read-only" if read_only else "writable"
                    print(f"{bookie_id}\t{info.address}\t{mode}\t{info.rack or '-'}")

    trio.run(go)
    return 0


def add_info(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", type=HostPorts("bookie"), help="HOST:PORT of the bookie")
    from quire.security_options import add_credentials

    add_credentials(parser)


def info(arguments: argparse.Namespace) -> int:
    from ledger_client.bookie_client import BookieClient, BookieConnectionError, parse_address

    try:
        parse_address(arguments.address)
    except ValueError as error:
        raise UsageError(str(error)) from None

    from quire.security_options import client_credentials_from

    credentials = client_credentials_from(arguments)

    async def go() -> dict:
        async with BookieClient.connect(arguments.address, credentials=credentials) as client:
            return (await client.get_info()).info

    try:
        print(json.dumps(trio.run(go), indent=2, sort_keys=True))
    except BookieConnectionError as error:
        raise UsageError(str(error)) from None
    return 0


def add_simpletest(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=ranges.simpletest_entries, default=1000, help="entries per bookie (default %(default)s)")
    parser.add_argument("--entry-bytes", type=ranges.simpletest_entry_bytes, default=1024, help="size of each entry written")
    from quire.security_options import add_credentials

    add_credentials(parser)


def simpletest(arguments: argparse.Namespace) -> int:
    from quire.simpletest import run_simpletest

    total_bytes = arguments.count * arguments.entry_bytes
    if total_bytes > ranges.SIMPLETEST_BYTES_MAX:
        raise UsageError(f"--count {arguments.count} entries of --entry-bytes {arguments.entry_bytes} make {total_bytes} bytes, "
                         f"more than the {ranges.SIMPLETEST_BYTES_MAX} simpletest holds in memory to compare what it reads back")
    configure_logging("warning", "simpletest")
    try:
        from quire.security_options import client_credentials_from

        ok = trio.run(run_simpletest, arguments.zk, arguments.root, arguments.count, arguments.entry_bytes,
                      client_credentials_from(arguments))
    except RuntimeError as error:
        raise UsageError(str(error)) from None
    return 0 if ok else 1
