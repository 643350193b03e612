"""`quire autorecovery run|disable|enable|status`, and the options with which
`quire bookie run` embeds the same daemon (BookKeeper's
autoRecoveryDaemonEnabled)."""

from __future__ import annotations

import argparse
import json
from typing import Any, Awaitable, Callable

import trio

from quire import cli_ranges as ranges
from quire.cli_parsing import UsageError
from quire.logging_setup import configure_logging


def add_daemon_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by `autorecovery run` and `bookie run`."""
    parser.add_argument(
        "--lost-bookie-delay", type=ranges.delay, default=30_000, metavar="DURATION",
        help="a bookie gone from the registry this long is lost: its ledgers are re-replicated (default 30s)",
    )
    parser.add_argument(
        "--open-ledger-grace", type=ranges.delay, default=30_000, metavar="DURATION",
        help="leave an open ledger's last fragment to its writer this long, then fence it (default 30s)",
    )
    parser.add_argument(
        "--audit-interval", type=ranges.interval, default=600_000, metavar="DURATION",
        help="the auditor checks every ledger this often besides on bookie changes (default 10m)",
    )
    parser.add_argument(
        "--recovery-password", action="append", metavar="PASSWORD",
        help="a ledger password re-replication may use (repeatable; default: the empty password)",
    )
    parser.add_argument("--replication-ledgers-max", type=ranges.replication_ledgers, default=2, help="ledgers re-replicated at once")


def config_from(arguments: argparse.Namespace, **overrides: Any):
    from ledger_client.autorecovery import AutoRecoveryConfig

    passwords = tuple(password.encode() for password in (arguments.recovery_password or [""]))
    try:
        return AutoRecoveryConfig(
            lost_bookie_delay_ms=arguments.lost_bookie_delay,
            open_ledger_grace_ms=arguments.open_ledger_grace,
            audit_interval_ms=arguments.audit_interval,
            passwords=passwords,
            ledgers_in_flight_max=arguments.replication_ledgers_max,
            **overrides,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


def add_run(parser: argparse.ArgumentParser) -> None:
    add_daemon_options(parser)
    parser.add_argument("--no-auditor", action="store_true", help="run only a replication worker")
    parser.add_argument("--name", help="how this daemon shows in `autorecovery status` (default HOST:PID)")
    parser.add_argument(
        "--startup-timeout", type=ranges.interval, default=60_000, metavar="DURATION",
        help="reaching ZooKeeper is tried again (a fresh session each time) until this long has passed; then exit 2",
    )
    parser.add_argument("--session-timeout-ms", type=ranges.session_timeout_ms, default=10_000,
                        help="the daemon's ZooKeeper session timeout")
    from quire.security_options import add_credentials

    add_credentials(parser)


def run(arguments: argparse.Namespace) -> int:
    from ledger_client.autorecovery import run_autorecovery
    from ledger_client.autorecovery.daemon import default_name

    from quire.security_options import client_credentials_from

    config = config_from(arguments, auditor=not arguments.no_auditor)
    credentials = client_credentials_from(arguments)
    name = arguments.name or default_name()
    configure_logging(arguments.log_level, "autorecovery", name, arguments.log_format)

    async def main() -> None:
        from coordination.startup import Startup, StartupFailedError

        # ZooKeeper away or slow at start: tried again until the deadline,
        # then one line and exit 2; ZooKeeper refusing us (no permission to
        # make the chroot, say): one line and exit 2 at once. Once running,
        # the daemon retries for ever.
        startup = Startup("auto-recovery", arguments.startup_timeout)
        try:
            with startup.deadline():
                store = await startup.connect(arguments.zk, arguments.root, session_timeout_ms=arguments.session_timeout_ms)
                store.close()
                startup.finish()
        except StartupFailedError as error:
            raise UsageError(str(error)) from None
        except ValueError as error:  # a malformed --zk
            raise UsageError(str(error)) from None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            await nursery.start(lambda task_status: run_autorecovery(
                arguments.zk, arguments.root, config, name=name, session_timeout_ms=arguments.session_timeout_ms,
                credentials=credentials, task_status=task_status,
            ))
            print(f"auto-recovery {name} running", flush=True)

    trio.run(main)
    return 0


async def run_with_bookie(run_bookie: Callable[..., Awaitable[None]], bookie_config, arguments: argparse.Namespace) -> None:
    """Run the bookie, and unless `--no-autorecovery` the auto-recovery
    daemon beside it in the same process (separate tasks and its own
    ZooKeeper session; it never stops the bookie), started once the bookie
    serves. Ends when the bookie does."""
    from ledger_client.autorecovery import run_autorecovery
    from ledger_client.exception_groups import unwrap_single_exception

    if arguments.no_autorecovery:
        await run_bookie(bookie_config)
        return
    from quire.security_options import bookie_credentials_from

    config = config_from(arguments)
    credentials = bookie_credentials_from(arguments)
    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            async def bookie_then_stop(task_status=trio.TASK_STATUS_IGNORED) -> None:
                await run_bookie(bookie_config, task_status=task_status)
                nursery.cancel_scope.cancel()

            await nursery.start(bookie_then_stop)
            nursery.start_soon(lambda: run_autorecovery(
                bookie_config.zk_hosts, bookie_config.root, config, name=bookie_config.identity,
                session_timeout_ms=bookie_config.session_timeout_ms, credentials=credentials,
            ))


def add_bookie_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-autorecovery", action="store_true",
        help="do not run the auto-recovery daemon (auditor candidate and replication worker) in this bookie",
    )
    add_daemon_options(parser)


async def _stop_on_signal(scope: trio.CancelScope) -> None:
    import signal

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


# --- the switch and the status -------------------------------------------------------


def _with_store(arguments: argparse.Namespace, call: Callable[..., Any]) -> Any:
    from coordination.cluster_layout import ClusterLayout
    from quire.metadata_access import open_metadata

    async def go() -> Any:
        async with open_metadata(arguments.zk, arguments.root) as metadata:
            return await trio.to_thread.run_sync(call, metadata.store, ClusterLayout())

    return trio.run(go)


def disable(arguments: argparse.Namespace) -> int:
    from ledger_client.autorecovery.underreplication import set_enabled

    _with_store(arguments, lambda store, layout: set_enabled(store, layout, False))
    print("auto-recovery disabled: the auditor and the replication workers pause")
    return 0


def enable(arguments: argparse.Namespace) -> int:
    from ledger_client.autorecovery.underreplication import set_enabled

    _with_store(arguments, lambda store, layout: set_enabled(store, layout, True))
    print("auto-recovery enabled")
    return 0


def add_status(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def status(arguments: argparse.Namespace) -> int:
    from ledger_client.autorecovery import underreplication

    def read(store, layout) -> dict:
        candidates = underreplication.auditor_candidates(store, layout)
        locks = underreplication.locks(store, layout)
        ledgers = []
        for ledger_id in underreplication.marked_ledgers(store, layout):
            found = underreplication.read_marker(store, layout, ledger_id)
            if found is None:
                continue
            marker, _ = found
            ledgers.append({
                "ledger_id": ledger_id, "lost_bookies": sorted(marker.lost_bookies),
                "marked_ms": marker.marked_ms, "lost_since_ms": dict(sorted(marker.lost_since_ms.items())),
                "locked_by": locks.get(ledger_id),
            })
        return {
            "enabled": underreplication.is_enabled(store, layout),
            "auditor": candidates[0][1] if candidates else None,
            "candidates": [name for _, name in candidates],
            "under_replicated": ledgers,
        }

    report = _with_store(arguments, read)
    if arguments.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    print(f"enabled: {'yes' if report['enabled'] else 'no'}")
    print(f"auditor: {report['auditor'] or '(none)'}")
    print(f"under-replicated ledgers: {len(report['under_replicated'])}")
    for ledger in report["under_replicated"]:
        lock = f"  (being replicated by {ledger['locked_by']})" if ledger["locked_by"] else ""
        print(f"  {ledger['ledger_id']}\tlost: {', '.join(ledger['lost_bookies']) or '?'}{lock}")
    return 0


__all__ = [
    "add_bookie_options", "add_daemon_options", "add_run", "add_status", "disable", "enable", "run",
    "run_with_bookie", "status",
]
