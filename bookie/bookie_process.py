"""One bookie process from start to stop: check directories, bind its ports,
connect to ZooKeeper, check cookies, recover storage, serve, register, follow
disk usage, and on SIGTERM/SIGINT unregister, drain the journal, checkpoint
and exit."""

from __future__ import annotations

import functools
import logging
import signal
import sys
from pathlib import Path

import trio
from prometheus_client import CollectorRegistry

from bookie.config import BookieConfig
from bookie.cookie import CookieError
from bookie.disk_usage import ReadOnlyPolicy, measure
from bookie.durable_files import directory_problem
from bookie.entry_index import RocksEntryIndex
from bookie.entry_log import FileEntryLog
from bookie.journal import FileJournal
from bookie.storage_interfaces import JournalCorruptError
from bookie.ledger_storage import LedgerStorage
from bookie.metrics import BookieMetrics, MetricsEndpoint, UnderReplicatedCount, open_bookie_metrics, serve_bookie_metrics
from bookie.registration import CookieCheck, Registration
from bookie.flush_room import check_flush
from bookie.ledger_storage import Checkpoint
from bookie.server import BookieServer, flush_reserve, measure_ledger_room, pending_flush_bytes
from bookie.startup_recovery import RecoveryReport, ReplayHeldError, recover
from coordination.async_store import AsyncMetadataStore
from coordination.cluster_layout import BookieRegistrationInfo, ClusterLayout
from coordination.startup import Startup, StartupFailedError
from coordination.store import MetadataError

log = logging.getLogger(__name__)

INDEX_DIRECTORY = "index"
ENTRY_LOG_DIRECTORY = "entrylogs"
JOURNAL_DIRECTORY = "journal"
SWITCH_INTERVAL_S = 0.001


class StartupError(Exception):
    """The bookie cannot start; the message is one clear line for the operator."""


def check_directory(path: Path, what: str) -> None:
    problem = directory_problem(path, what)
    if problem is not None:
        raise StartupError(problem)


def open_storage(config: BookieConfig) -> tuple[FileJournal, LedgerStorage]:
    journal_dir = Path(config.journal_dir) / JOURNAL_DIRECTORY
    entry_log_dir = Path(config.ledger_dir) / ENTRY_LOG_DIRECTORY
    index_dir = Path(config.ledger_dir) / INDEX_DIRECTORY
    for directory in (journal_dir, entry_log_dir, index_dir):
        directory.mkdir(exist_ok=True)
    journal = FileJournal(
        journal_dir, file_bytes_max=config.journal_file_bytes_max, preallocate_bytes=config.journal_preallocate_bytes
    )
    storage = LedgerStorage(
        FileEntryLog(entry_log_dir, log_bytes_max=config.entry_log_bytes_max),
        RocksEntryIndex(index_dir),
        write_cache_bytes=config.write_cache_bytes,
        read_cache_bytes=config.read_cache_bytes,
        read_ahead_bytes=config.read_ahead_bytes,
    )
    return journal, storage


def check_storage_identity(storage: LedgerStorage, cookie, new: bool) -> None:
    """The cookies sit at the top of each directory; the index below them
    can be wiped on its own, and a bookie with an empty index would answer
    NO_LEDGER for what it stored and forget its fences. So the index keeps
    the cookie too, and a known bookie whose index lost it refuses to start."""
    index = storage.entry_index
    identity = cookie.to_bytes()
    stored = index.identity()
    if new and stored is None:
        index.set_identity(identity)
    elif stored != identity:
        where = index.directory
        state = "is empty: it was wiped" if stored is None else "belongs to another bookie or cluster"
        raise StartupError(
            f"the index {where} {state}; a bookie that lost its index lost its fence bits too, so it refuses to "
            f"start. Re-replicate its ledgers, then `quire bookie format --bookie-id {cookie.bookie_id} ... --force`."
        )


async def run_bookie(
    config: BookieConfig, *, handle_signals: bool = True, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Run one bookie until SIGTERM/SIGINT (or cancellation). Raises
    StartupError, with a message for the operator, when it cannot start."""
    # The journal and checkpoint threads hand the GIL back and forth with the
    # event loop; CPython's default 5 ms slice would let one stall the other.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    check_directory(Path(config.journal_dir), "journal directory")
    check_directory(Path(config.ledger_dir), "ledger directory")
    # Bind both ports before the cookies are written: a bookie that cannot
    # serve must leave its directories as it found them.
    listeners, endpoint, registry = await _bind_ports(config)
    # Every start-up step that talks to ZooKeeper is tried again after a
    # lost connection or session, until this deadline (local work such as
    # the journal replay does not count against it).
    startup = Startup("bookie", config.startup_timeout_ms)
    try:
        with startup.deadline():
            await _start(config, startup, listeners, registry, task_status, handle_signals)
    except StartupFailedError as error:
        raise StartupError(str(error)) from None
    except MetadataError as error:
        if startup.finished:
            raise
        # A ZooKeeper call of start-up outside its steps: still one line.
        raise StartupError(startup.refused_message(error)) from None
    finally:
        for listener in listeners:
            listener.socket.close()  # idempotent: the server may have closed them already
        if endpoint is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(endpoint.close)


async def _bind_ports(config: BookieConfig) -> tuple[list[trio.SocketListener], MetricsEndpoint | None, CollectorRegistry | None]:
    try:
        listeners = await trio.open_tcp_listeners(config.port, host=config.host)
    except OSError as error:
        raise StartupError(f"cannot listen on {config.host}:{config.port}: {error.strerror or error}") from None
    if not config.metrics_port:
        return listeners, None, None
    try:
        endpoint, registry = open_bookie_metrics(config.host, config.metrics_port)
    except OSError as error:
        for listener in listeners:
            listener.socket.close()
        raise StartupError(f"cannot serve metrics on {config.host}:{config.metrics_port}: {error.strerror or error}") from None
    return listeners, endpoint, registry


async def _start(config: BookieConfig, startup: Startup, listeners, registry, task_status, handle_signals: bool) -> None:
    bookie_id = config.identity
    try:
        store = await startup.connect(config.zk_hosts, config.root, session_timeout_ms=config.session_timeout_ms)
    except MetadataError as error:
        raise StartupError(str(error)) from None
    except ValueError as error:
        raise StartupError(f"bad ZooKeeper address {config.zk_hosts!r}: {error}") from None
    async with AsyncMetadataStore(store) as metadata:
        layout = ClusterLayout()
        cookies = CookieCheck(metadata, layout, bookie_id, Path(config.journal_dir), Path(config.ledger_dir))
        try:
            cookie, new = await startup.step("check the bookie's cookies (/cookies)", cookies.run)
        except CookieError as error:
            raise StartupError(str(error)) from None
        with startup.paused():
            try:
                journal, storage = await trio.to_thread.run_sync(open_storage, config)
            except Exception as error:  # RocksDB reports a held lock or corruption this way
                raise StartupError(f"cannot open the bookie's storage: {error}") from None
        try:
            check_storage_identity(storage, cookie, new)
        except StartupError:
            storage.close()
            journal.close()
            raise
        try:
            await _serve(config, startup, metadata, layout, journal, storage, listeners, registry, handle_signals, task_status)
        finally:
            storage.close()
            journal.close()


async def _serve(config, startup, metadata, layout, journal, storage, listeners, registry, handle_signals, task_status) -> None:
    directories = [Path(config.journal_dir), Path(config.ledger_dir)]
    policy = ReadOnlyPolicy(
        threshold=config.disk_usage_threshold, low_water_mark=config.disk_usage_lwm, quota_bytes=config.disk_quota_bytes
    )
    try:
        with startup.paused():
            usage = await trio.to_thread.run_sync(lambda: measure(directories, count_own_bytes=config.disk_quota_bytes is not None))
            starts_read_only = policy.update(usage)
            if starts_read_only:
                log.warning("starting read-only: %s", policy.reason)
            # On a full ledger disk a checkpoint that does not fit is held:
            # the bookie starts read-only and tries it again as it serves.
            core, report = await trio.to_thread.run_sync(
                lambda: recover(
                    bookie_id=config.identity, limits=config.limits, journal=journal, storage=storage, read_only=starts_read_only,
                    flush_room=functools.partial(_startup_flush_room, config, storage),
                    held_bytes_max=config.write_cache_bytes + config.journal_queue_bytes_max,
                )
            )
    except JournalCorruptError as error:
        raise StartupError(f"the journal cannot be replayed: {error}") from None
    except ReplayHeldError as error:
        raise StartupError(
            f"{error}: free space on the ledger disk (or start with the earlier --write-cache-bytes) and start again; "
            "nothing was lost"
        ) from None
    except OSError as error:
        raise StartupError(f"cannot replay the journal ({error.strerror or error}); nothing was deleted") from None
    server = BookieServer(
        config, core=core, storage=storage, journal=journal, journal_position=report.mark_after,
        ledger_metadata=metadata.store, metrics=BookieMetrics() if config.metrics_port else None,
        checkpoint_mark=report.mark_durable, held_checkpoint=report.held, journal_no_file=report.journal_no_file,
    )
    server.set_disk_read_only(starts_read_only, policy.reason)
    starts_read_only = server.core.read_only  # a held checkpoint or a failed journal count too
    _record_usage(server, usage, policy)
    info = BookieRegistrationInfo(config.identity, config.advertised_address, config.rack, starts_read_only,
                                  tls=config.tls_context is not None)
    registration = Registration(metadata, layout, info, stale_wait_s=2 * config.session_timeout_ms / 1000 + 10)
    server.on_read_only_change = registration.set_read_only
    await server.listen(listeners)
    if registry is None:
        await _run_server(config, startup, server, registration, report, starts_read_only, directories, policy, handle_signals, task_status)
        return
    under_replicated = UnderReplicatedCount(metadata.store)
    serve_bookie_metrics(registry, server, under_replicated)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(under_replicated.run)
        await _run_server(config, startup, server, registration, report, starts_read_only, directories, policy, handle_signals, task_status)
        nursery.cancel_scope.cancel()


async def _run_server(config, startup, server, registration, report, starts_read_only, directories, policy, handle_signals, task_status) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        async with trio.open_nursery() as helpers:
            if handle_signals:
                helpers.start_soon(_wait_for_signal, stop)
            helpers.start_soon(_follow_disk_usage, server, policy, directories, config)
            await helpers.start(registration.run)
            # Serving starts once the bookie can be found. If the deadline
            # passes first, the server still stops the clean way below
            # (journal drained), and the deadline then reports it.
            registered = await startup.wait_for(
                f"register bookie {config.identity} under /bookies",
                functools.partial(_first_set, registration.registered, registration.refused, stop),
                detail=registration.problem,
            )
            if registration.refusal is not None:
                # ZooKeeper refused it (no permission, the store closed):
                # waiting would not help. Stop the clean way, then say why.
                startup.refuse(registration.refusal)
            elif registered:
                startup.finish()
                if not stop.is_set():
                    _announce(config, report, starts_read_only)
                task_status.started(server)
                await stop.wait()
            helpers.cancel_scope.cancel()
        log.info("stopping bookie %s", config.identity)
        with trio.move_on_after(5):
            try:
                await registration.unregister()
            except MetadataError as error:
                log.warning("could not unregister (%s): the registration goes when the ZooKeeper session ends", error)
        server.stop()


async def _first_set(*events: trio.Event) -> None:
    """Return once any of `events` is set."""
    async with trio.open_nursery() as nursery:
        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(wait, event)


async def _wait_for_signal(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signal_number in signals:
            log.info("received %s", signal.Signals(signal_number).name)
            stop.set()
            return


async def _follow_disk_usage(server: BookieServer, policy: ReadOnlyPolicy, directories: list[Path], config: BookieConfig) -> None:
    count_own_bytes = config.disk_quota_bytes is not None
    while True:
        await trio.sleep(config.disk_check_interval_ms / 1000)
        await server.retry_journal_file()  # a journal whose disk had no room for a file
        try:
            usage = await trio.to_thread.run_sync(lambda: measure(directories, count_own_bytes=count_own_bytes))
        except OSError as error:
            log.error("cannot measure disk usage: %s", error)
            continue
        read_only = policy.update(usage)
        _record_usage(server, usage, policy)
        server.set_disk_read_only(read_only, policy.reason)  # the server logs when the mode changes


def _startup_flush_room(config: BookieConfig, storage: LedgerStorage, checkpoint: Checkpoint) -> str:
    """Worker thread, during start-up recovery: "" if the checkpoint fits on
    the ledger disk, else why it is held (bookie.flush_room)."""
    try:
        room = measure_ledger_room(config, storage)
    except OSError as error:
        log.warning("cannot measure the ledger disk's free space (%s): the checkpoint is written unchecked", error)
        return ""
    return check_flush(pending_flush_bytes(config, storage), room, flush_reserve(config)).reason


def _record_usage(server: BookieServer, usage, policy: ReadOnlyPolicy) -> None:
    server.core.info.update(
        free_bytes=usage.free_bytes,
        total_bytes=usage.total_bytes,
        disk_used_fraction=round(usage.used_fraction, 4),
        own_bytes=usage.own_bytes,
        journal_failed=server.journal_failed is not None,
        journal_batches=server.stats.journal_batches,
        journal_records=server.stats.journal_records,
        journal_batches_fsynced_inline=server.stats.journal_batches_fsynced_inline,
        checkpoints=server.stats.checkpoints,
        connections_accepted=server.stats.connections_accepted,
        protocol_errors=server.stats.protocol_errors,
        connections_refused=server.connection_limits.refused,
        frame_buffer_bytes_reserved=server.frame_budget.reserved,
    )


def _announce(config: BookieConfig, report: RecoveryReport, read_only: bool) -> None:
    mode = "read-only" if read_only else "writable"
    message = (
        f"bookie {config.identity} serving on {config.host}:{config.port} ({mode}); "
        f"replayed {report.records_replayed} journal records, {report.ledgers} ledgers"
    )
    if config.metrics_port:
        message += f"; metrics on http://{config.host}:{config.metrics_port}/metrics"
    else:
        message += "; metrics off (use --metrics-port P)"
    log.info(message)
    print(message, flush=True)
