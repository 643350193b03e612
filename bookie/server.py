"""The bookie's trio driver: carries out what the request core decides.

It moves bytes (one reader and one writer task per connection, responses
coalesced into one send), group-commits the journal in a worker thread and
reports durability back to the core, runs checkpoints and garbage
collection, serves reads from memory or from a worker thread, and expires
long polls. Every queue has a
bound: a client whose responses pile up, or a journal queue past its bound,
stops the reading of requests until there is room.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from bookie.config import BookieConfig
from bookie.disk_usage import ledger_disk_room
from bookie.flush_room import (
    DiskRoom,
    FailureKind,
    Reserve,
    RetryBackoff,
    check_flush,
    classify_failure,
    describe_failure,
    flush_bytes,
    flush_trigger_bytes,
    journal_reserve_bytes,
)
from bookie.garbage_collector import GarbageCollector
from bookie.journal import JournalNoRoomError
from bookie.journal_thread import JournalThread
from bookie.ledger_storage import Checkpoint, LedgerStorage
from bookie.metrics import BookieMetrics
from bookie.client_connections import ClientConnections, ClientConnection, now_ms
from bookie.protocol.wire import (
    AddBatchResponse,
    AddResponse,
    BatchReadResponse,
    ReadResponse,
    Status,
    encode_add_ok,
    encode_response,
)
from bookie.core_actions import AppendJournal, DurableAdd, ListEntries, ReadEntries, Respond, StoreEntry
from bookie.read_only_mode import Cause, ReadOnlyMode
from bookie.request_core import BookieCore
from bookie.startup_recovery import HeldCheckpoint
from bookie.storage_interfaces import IndexWriteError, Journal, JournalPosition, JournalRecord, ReadOutcome
from coordination.store import MetadataStore
from framing.peer_limits import ConnectionLimits, FrameBudget
from security.authentication import RefusalLog
from framing.stream import FrameOutput

log = logging.getLogger(__name__)

INLINE_FSYNC_BACKOFF_S_MIN = 1.0
INLINE_FSYNC_BACKOFF_S_MAX = 60.0
CHECKPOINT_STEP_ENTRIES = 1000  # entries framed per slice on the event loop (about 2 ms)


class InlineFsyncBackoff:
    """After a slow inline fsync (one on the event loop), fsyncs go to the
    journal thread for a backoff that starts short (one slow fsync on a
    shared disk is common and says little) and doubles while slow ones keep
    coming soon after a backoff ends, up to the maximum; a quiet spell
    resets it. Time comes in as seconds."""

    def __init__(self, backoff_s_min: float = INLINE_FSYNC_BACKOFF_S_MIN, backoff_s_max: float = INLINE_FSYNC_BACKOFF_S_MAX) -> None:
        self.backoff_s_min = backoff_s_min
        self.backoff_s_max = backoff_s_max
        self.backoff_s = backoff_s_min
        self.backoff_until = float("-inf")

    def allows(self, now: float) -> bool:
        """Whether an inline fsync may run at `now` (no backoff in force)."""
        return now >= self.backoff_until

    def slow_fsync(self, now: float) -> float:
        """Note a slow inline fsync; returns the backoff it starts."""
        if now < self.backoff_until + 4 * self.backoff_s:
            self.backoff_s = min(2 * self.backoff_s, self.backoff_s_max)
        else:
            self.backoff_s = self.backoff_s_min
        self.backoff_until = now + self.backoff_s
        return self.backoff_s


def measure_ledger_room(config: BookieConfig, storage: LedgerStorage) -> DiskRoom:
    """Worker thread: the ledger disk's free space and the index's memtables."""
    free_bytes, shares = ledger_disk_room(Path(config.ledger_dir), Path(config.journal_dir))
    return DiskRoom(free_bytes, storage.entry_index.memtable_bytes(), shares)


def pending_flush_bytes(config: BookieConfig, storage: LedgerStorage) -> int:
    """What the write cache's flushing buffer takes on the ledger disk."""
    write_cache = storage.write_cache
    return flush_bytes(write_cache.flushing_entries, write_cache.flushing_bytes, config.entry_log_bytes_max)


def flush_reserve(config: BookieConfig) -> Reserve:
    return Reserve(journal_reserve_bytes(config.journal_preallocate_bytes, config.group_bytes))


# The read-only cause a failed checkpoint write sets (bookie.flush_room).
_FAILURE_CAUSES = {
    FailureKind.NO_SPACE: Cause.CHECKPOINT_HELD,
    FailureKind.IO_ERROR: Cause.CHECKPOINT_FAILED,
    FailureKind.INDEX: Cause.INDEX_FAILED,
}


class Wakeup:
    """Wakes every task waiting at the time of `set()`. Edge-triggered: a
    task checks its condition first and waits only if it does not hold (in
    trio nothing runs between the check and the wait)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass
class ServerStats:
    connections_accepted: int = 0
    protocol_errors: int = 0
    authentication_refusals: int = 0  # ledger clients whose credentials or role were refused
    tls_handshakes_refused: int = 0  # TLS handshakes that failed or stalled
    journal_batches: int = 0
    journal_batches_fsynced_inline: int = 0
    journal_records: int = 0
    checkpoints: int = 0
    journal_files_deleted: int = 0


class BookieServer(ClientConnections):
    def __init__(
        self,
        config: BookieConfig,
        *,
        core: BookieCore,
        storage: LedgerStorage,
        journal: Journal,
        journal_position: JournalPosition,
        ledger_metadata: MetadataStore | None = None,
        metrics: BookieMetrics | None = None,
        checkpoint_mark: JournalPosition | None = None,
        held_checkpoint: HeldCheckpoint | None = None,
        journal_no_file: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """`ledger_metadata`: where garbage collection looks for ledger
        metadata (None: it deletes no ledger). `metrics`: where to count
        requests and journal batches (None: nothing is measured).
        From start-up recovery: `checkpoint_mark`, the durable mark (default
        `journal_position`); `held_checkpoint`, one it could not write,
        tried again first; `journal_no_file`, why the journal could not
        start a new file (tried again by `retry_journal_file`). `rng`:
        jitter of checkpoint retries."""
        self.config = config
        self.core = core
        self.storage = storage
        self.journal = journal
        self.stats = ServerStats()
        self.metrics = metrics
        self.port: int | None = None
        self.on_read_only_change = None  # callable(bool), set by the owner
        # Why the journal takes no records: it has no file it may write to
        # (its disk had no room for one at start-up, or to grow while
        # serving; cleared once a new file is made), or a write or fsync
        # failed (until restarted: the page cache no longer says what is on
        # disk).
        self.journal_failed: str | None = None
        self._journal_no_file = False
        self._connections: dict[int, ClientConnection] = {}
        self.connection_limits = ConnectionLimits(config.connections_max, config.connections_per_address_max)
        self.frame_budget = FrameBudget(config.frame_buffer_bytes_max)
        # Connections with responses queued since the last flush.
        self._unflushed: list[FrameOutput] = []
        self._next_connection_id = 1
        self._refusal_log = RefusalLog()  # refused ledger clients, logged at most once a second
        self._journal_thread: JournalThread | None = None
        self._journal_records: list[JournalRecord] = []  # decided, not yet handed to the thread
        self._journal_tokens: list[int] = []
        self._journal_record_bytes = 0
        self._journal_bytes = 0  # handed to the thread and not yet reported durable
        self._journal_results = Wakeup()
        self._journal_room = Wakeup()
        self._inline_fsync_backoff = InlineFsyncBackoff()
        self._journal_bug: BaseException | None = None
        self._synced_position = journal_position
        self._checkpoint_mark = journal_position if checkpoint_mark is None else checkpoint_mark
        self._checkpoint_wakeup = Wakeup()
        self._checkpoint_lock = trio.Lock()
        self._tick_wakeup = Wakeup()
        self._read_limiter = trio.CapacityLimiter(config.read_threads_max)
        self._service_nursery: trio.Nursery | None = None
        self._network_scope: trio.CancelScope | None = None
        # Why the bookie takes no adds (bookie.read_only_mode).
        self._mode = ReadOnlyMode()
        # A checkpoint begun and not yet durable, between tries: held for
        # room on the ledger disk, or failed. Its entries stay readable in
        # the write cache and its records in the journal.
        self._checkpoint_pending: Checkpoint | None = None
        self._checkpoint_failure: FailureKind | None = None
        self._checkpoint_retry = RetryBackoff(rng or random.Random())
        self._flush_reserve = flush_reserve(config)
        self.checkpoint_held_bytes = 0  # what the pending checkpoint needs on the disk (also in GET_INFO)
        self._listeners: list[trio.SocketListener] = []
        # The collector works on the core and the storage, and on the rest
        # of the server only through `StorageOwner`.
        self.garbage_collector = (
            GarbageCollector(config, core=core, storage=storage, owner=self, ledger_metadata=ledger_metadata)
            if config.gc_interval_s > 0 else None
        )
        self.core.info.update(read_only_reason="", checkpoint_held_bytes=0)
        if journal_no_file is not None:
            self.journal_failed = journal_no_file
            self._journal_no_file = True
            self._set_cause(Cause.JOURNAL_NO_FILE, journal_no_file)
        if held_checkpoint is not None:
            self._checkpoint_pending = held_checkpoint.checkpoint
            self._checkpoint_failure = held_checkpoint.kind
            self._note_held(self._pending_flush_bytes())
            self._set_cause(_FAILURE_CAUSES[held_checkpoint.kind], held_checkpoint.reason)

    # --- lifetime -----------------------------------------------------------

    async def listen(self, listeners: list[trio.SocketListener] | None = None) -> int:
        """Open the listening socket (or take `listeners` opened earlier);
        raises OSError (port in use, bad address) before anything else
        starts. Returns the port."""
        self._listeners = listeners or await trio.open_tcp_listeners(self.config.port, host=self.config.host)
        self.port = self._listeners[0].socket.getsockname()[1]
        return self.port

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve (after `listen()`) until `stop()`; then drain the journal,
        checkpoint and close."""
        assert self._listeners, "listen() must come before run()"
        self._journal_thread = JournalThread(
            self.journal,
            group_wait_ms=self.config.group_wait_ms,
            group_bytes=self.config.group_bytes,
            on_synced=self._journal_synced,
        )
        async with trio.open_nursery() as service_nursery:
            self._service_nursery = service_nursery
            service_nursery.start_soon(self._journal_results_loop)
            service_nursery.start_soon(self._checkpoint_loop)
            service_nursery.start_soon(self._tick_loop)
            if self.garbage_collector is not None:
                service_nursery.start_soon(self.garbage_collector.run)
            with trio.CancelScope() as network_scope:
                self._network_scope = network_scope
                async with trio.open_nursery() as network_nursery:
                    await network_nursery.start(trio.serve_listeners, self._handle_connection, self._listeners)
                    task_status.started(self.port)
            log.info("stopping: draining the journal and checkpointing")
            with trio.move_on_after(30):
                while not self._journal_thread.idle or self._journal_bytes:
                    await trio.sleep(0.005)
            await self._checkpoint()
            service_nursery.cancel_scope.cancel()
        await trio.to_thread.run_sync(self._journal_thread.stop)

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def stop(self) -> None:
        if self._network_scope is not None:
            self._network_scope.cancel()

    # --- actions ------------------------------------------------------------

    def _execute(self, actions: list) -> None:
        self._carry_out(actions)
        if self._journal_records:
            self._hand_records_to_journal()
        if self._unflushed:
            # Responses go out now, one write per connection for everything
            # this step answered (see bookie.protocol.frame_output).
            unflushed, self._unflushed = self._unflushed, []
            for output in unflushed:
                output.flush()

    def _respond(self, connection_id: int, frame: bytes) -> None:
        connection = self._connections.get(connection_id)
        if connection is not None:
            output = connection.output
            if not output:
                self._unflushed.append(output)
            output.queue(frame)
            connection.unanswered -= 1
            if connection.answered is not None:
                connection.answered.set()

    def _carry_out(self, actions: list) -> None:
        measured = self.metrics is not None
        finished_ms = now_ms() if measured else 0.0  # one clock read for every answer of this step
        for action in actions:
            kind = type(action)
            if kind is Respond:
                if measured:
                    self._measure(action.connection_id, action.response, finished_ms)
                self._respond(action.connection_id, encode_response(action.response))
            elif kind is AppendJournal:
                self._journal_records.append(action.record)
                self._journal_tokens.append(action.token)
                self._journal_record_bytes += len(action.record.data)
            elif kind is DurableAdd:
                batch = action.batch
                if measured:
                    self._measure_add(action.connection_id, action.request_id, finished_ms, batch is None)
                self._store(action.ledger_id, action.entry_id, action.data)
                if batch is None:  # (an ADD_BATCH's answer is a Respond of its own, after its last add)
                    self._respond(action.connection_id, encode_add_ok(action.request_id, action.ledger_id, action.entry_id))
            elif kind is StoreEntry:
                self._store(action.ledger_id, action.entry_id, action.data)
            elif kind is ReadEntries:
                self._read(action)
            elif kind is ListEntries:
                self._service_nursery.start_soon(self._list, action)
            else:
                raise AssertionError(f"unknown action {action!r}")

    def _measure_add(self, connection_id: int, request_id: int, finished_ms: float, alone: bool) -> None:
        # The hot path of measuring: no more than a dict look-up and a bucket.
        # An ADD_BATCH's start is forgotten with its answer (`_measure`).
        metrics = self.metrics
        metrics.adds_ok += 1
        connection = self._connections.get(connection_id)
        if connection is not None:
            started = connection.started_ms
            started_ms = started.pop(request_id, None) if alone else started.get(request_id)
            if started_ms is not None:
                metrics.add_latency_s.observe((finished_ms - started_ms) / 1000)

    def _measure(self, connection_id: int, response, finished_ms: float) -> None:
        kind = type(response)
        if kind is AddBatchResponse:
            # Its OK adds were counted as they were stored; count the others.
            connection = self._connections.get(connection_id)
            if connection is not None:
                connection.started_ms.pop(response.request_id, None)
            for status in response.statuses:
                if status is not Status.OK:
                    self.metrics.answered(True, status, None)
        elif kind is AddResponse or kind is ReadResponse or kind is BatchReadResponse:
            connection = self._connections.get(connection_id)
            started_ms = None if connection is None else connection.started_ms.pop(response.request_id, None)
            latency_s = None if started_ms is None else (finished_ms - started_ms) / 1000
            self.metrics.answered(kind is AddResponse, response.status, latency_s)

    def _store(self, ledger_id: int, entry_id: int, data: bytes) -> None:
        self.storage.put(ledger_id, entry_id, data)
        write_cache = self.storage.write_cache
        if write_cache.wants_flush():
            self._checkpoint_wakeup.set()
            if write_cache.is_full() and not self.core.adds_paused:
                log.warning("write cache full: adds wait for the checkpoint")
                self._carry_out(self.core.set_adds_paused(True, now_ms()))
                self._tick_wakeup.set()

    def _read(self, action: ReadEntries) -> None:
        entries, missed = self.storage.read_memory(
            action.ledger_id, action.first_entry_id, action.entries_max, action.bytes_max
        )
        if not missed:
            self._execute(self.core.read_completed(action.token, ReadOutcome(entries, False)))
        else:
            self._service_nursery.start_soon(self._read_from_disk, action, entries)

    async def _read_from_disk(self, action: ReadEntries, from_memory: list[bytes]) -> None:
        outcome = await trio.to_thread.run_sync(
            self.storage.read,
            action.ledger_id,
            action.first_entry_id + len(from_memory),
            action.entries_max - len(from_memory),
            action.bytes_max - sum(map(len, from_memory)),
            limiter=self._read_limiter,
        )
        if from_memory:
            outcome = ReadOutcome(from_memory + outcome.entries, outcome.failed)
        self._execute(self.core.read_completed(action.token, outcome))

    async def _list(self, action: ListEntries) -> None:
        try:
            entry_ids = await trio.to_thread.run_sync(
                self.storage.entry_ids,
                action.ledger_id,
                action.first_entry_id,
                action.last_entry_id,
                action.ids_max,
                limiter=self._read_limiter,
            )
            failed = False
        except OSError:
            log.exception("listing entries of ledger %d failed", action.ledger_id)
            entry_ids, failed = [], True
        self._execute(self.core.list_completed(action.token, entry_ids, failed))

    # --- read-only mode -------------------------------------------------------

    def set_disk_read_only(self, read_only: bool, reason: str = "") -> None:
        """The disk usage policy's verdict (bookie.disk_usage.ReadOnlyPolicy)."""
        self._set_cause(Cause.DISK_FULL, (reason or "disk full") if read_only else "")

    async def retry_journal_file(self) -> None:
        """If the journal has no file it may write to (its disk had no room
        for one at start-up, or to grow while serving), try to start one
        now; once made, the journal takes records again and that cause
        clears. Called at every disk check. A try that fails leaves no file
        behind (`Journal.start_new_file`)."""
        if not self._journal_no_file:
            return
        if self._journal_bytes or (self._journal_thread is not None and not self._journal_thread.idle):
            return  # batches the journal refuses are still coming back: the next check tries
        # Under the storage lock: a checkpoint deletes journal files on a
        # worker thread, and the new file's id is chosen from those there.
        async with self._checkpoint_lock:
            try:
                position = await trio.to_thread.run_sync(self.journal.start_new_file, self._synced_position)
            except OSError as error:
                log.debug("still no room for a new journal file: %s", error)
                return
        self._journal_no_file = False
        self.journal_failed = None
        # Every batch handed to the journal came back, synced or refused with
        # nothing written, and none was handed over since: every record
        # before the new file's start is durable.
        self._synced_position = position
        log.info("journal: started a new file at %s", tuple(position))
        self._set_cause(Cause.JOURNAL_NO_FILE, "")

    @property
    def read_only_causes(self) -> frozenset[Cause]:
        return self._mode.causes

    def _set_cause(self, cause: Cause, reason: str) -> None:
        """`cause` holds for `reason`, or no longer holds (""). The log says
        when the set of causes changes, not when a reason's numbers do."""
        change = self._mode.set(cause, reason) if reason else self._mode.clear(cause)
        self.core.info["read_only_reason"] = self._mode.reason
        if change is not None:
            log.warning("%s", change.describe())
        read_only = self._mode.read_only
        if read_only != self.core.read_only:
            self._execute(self.core.set_read_only(read_only))
            if self.on_read_only_change is not None:
                self.on_read_only_change(read_only)

    # --- journal: hand-over and results ---------------------------------------------

    def _hand_records_to_journal(self) -> None:
        records, tokens, data_bytes = self._journal_records, self._journal_tokens, self._journal_record_bytes
        self._journal_records, self._journal_tokens, self._journal_record_bytes = [], [], 0
        if self.journal_failed is not None:
            self._execute(self.core.journal_failed([token for token in tokens if token]))
            return
        self._journal_bytes += data_bytes
        if self._may_fsync_inline(data_bytes):
            started = time.perf_counter()
            batch = self._journal_thread.write_inline(records, tokens, data_bytes)
            if batch is not None:
                if batch.bug is not None:
                    raise batch.bug
                self.stats.journal_batches_fsynced_inline += 1
                elapsed_ms = (time.perf_counter() - started) * 1000
                if elapsed_ms > self.config.journal_inline_fsync_ms_max:
                    backoff_s = self._inline_fsync_backoff.slow_fsync(trio.current_time())
                    log.info("journal fsync took %.1f ms on the event loop: fsyncs go to the journal thread for %.0fs", elapsed_ms, backoff_s)
                self._journal_batch_done(batch)
                return
        self._journal_thread.submit(records, tokens, data_bytes)

    def _may_fsync_inline(self, data_bytes: int) -> bool:
        """Whether to fsync on the event loop instead of the journal thread.

        Fsyncs normally stay off the event loop so that a slow disk never
        stalls reads and other clients. When nothing else is runnable there
        is nobody to stall, and handing a small batch to the journal thread
        and back costs two thread wake-ups with GIL handoffs, about 0.2 ms
        here: more than the fsync itself. So a small batch is fsynced inline
        when the loop is otherwise idle, the journal thread has nothing in
        flight, and no recent inline fsync was slow (`InlineFsyncBackoff`);
        everything else goes to the journal thread."""
        return (
            self.config.journal_inline_fsync
            and data_bytes <= self.config.journal_inline_fsync_bytes_max
            and self._inline_fsync_backoff.allows(trio.current_time())
            and self._journal_thread.idle
            # Last: it counts every registered descriptor (O(connections)).
            and trio.lowlevel.current_statistics().tasks_runnable == 0
        )

    def _journal_synced(self) -> None:
        """Runs on the event loop (the journal thread's `run_sync_soon`)
        once batches are synced. Completing them right here, instead of
        waking a task to do it, saves a pass of the scheduler (~40 µs here)
        on every add that went through the journal thread. A batch that
        carries a bug of ours stops here and goes to the results task,
        which raises it (raising in this callback would kill trio itself)."""
        if self._journal_bug is not None:
            return
        for batch in self._journal_thread.take_synced():
            if batch.bug is not None:
                self._journal_bug = batch.bug
                self._journal_results.set()
                return
            self._journal_batch_done(batch)

    async def _journal_results_loop(self) -> None:
        while self._journal_bug is None:
            await self._journal_results.wait()
        raise self._journal_bug

    def _journal_batch_done(self, batch) -> None:
        assert batch.bug is None
        self._journal_bytes -= batch.bytes
        self._journal_room.set()
        tokens = [token for token in batch.tokens if token]
        if batch.error is not None:
            self._journal_refused(batch.error)
            self._execute(self.core.journal_failed(tokens))
            return
        self.stats.journal_batches += 1
        self.stats.journal_records += batch.records
        if self.metrics is not None:
            self.metrics.journal_batch(batch.records, batch.bytes, batch.write_s)
        self._synced_position = batch.position
        self._execute(self.core.journal_synced(tokens, now_ms()))

    def _journal_refused(self, error: Exception) -> None:
        """The journal refused a batch (its adds are answered IO_ERROR)."""
        if isinstance(error, JournalNoRoomError):
            # No byte of the batch was written (bookie.journal): as at a
            # start-up with no room for a file, the journal goes on in a new
            # file once a disk check finds room for one.
            if self.journal_failed is None:
                self.journal_failed = str(error)
                self._journal_no_file = True
                log.error("journal has no room (%s): the bookie is read-only until a new journal file fits", error)
                self._set_cause(Cause.JOURNAL_NO_FILE, f"journal has no room: {error}")
            return
        if self.journal_failed is None or self._journal_no_file:
            self.journal_failed = str(error)
            self._journal_no_file = False
            log.error("journal failed, the bookie turns read-only until restarted: %s", error)
            self._set_cause(Cause.JOURNAL_FAILED, f"journal failed: {error}; read-only until restarted")
            self._set_cause(Cause.JOURNAL_NO_FILE, "")  # (after: the bookie stays read-only between the two)

    # --- checkpoints -------------------------------------------------------------

    async def _checkpoint_loop(self) -> None:
        interval_s = self.config.checkpoint_interval_ms / 1000.0
        while True:
            if self._checkpoint_pending is not None:
                # Held for room or failed: tried again after a backoff, with
                # no bound on the tries (its entries wait in the journal).
                if self._checkpoint_failure is FailureKind.INDEX:
                    await trio.sleep_forever()  # RocksDB takes no write until the bookie restarts
                await trio.sleep(self._checkpoint_retry.next_delay_s(self._checkpoint_failure or FailureKind.NO_SPACE))
            elif not self.storage.write_cache.wants_flush():
                with trio.move_on_after(interval_s):
                    await self._checkpoint_wakeup.wait()
                if self._checkpoint_pending is not None:
                    continue  # held by another's checkpoint (garbage collection's) meanwhile: back off first
            await self._checkpoint()

    async def _checkpoint(self) -> None:
        # One at a time: the loop's and the final one at shutdown share the
        # write cache's single flushing buffer.
        async with self._checkpoint_lock:
            await self._checkpoint_once()

    @property
    def storage_lock(self) -> trio.Lock:
        """Held by every checkpoint and by each step of garbage collection:
        both write the entry logs and the index."""
        return self._checkpoint_lock

    @property
    def synced_position(self) -> JournalPosition:
        """Every journal record before it is durable."""
        return self._synced_position

    async def checkpoint_locked(self) -> JournalPosition:
        """With `storage_lock` held: checkpoint everything synced so far;
        return the durable checkpoint mark (behind the synced position while
        a checkpoint is held for room or failed)."""
        await self._checkpoint_once()
        if self._checkpoint_pending is None and self._checkpoint_mark < self._synced_position:
            await self._checkpoint_once()  # that one was held from before: now the rest
        return self._checkpoint_mark

    async def _checkpoint_once(self) -> None:
        if self._checkpoint_failure is FailureKind.INDEX:
            return  # the journal keeps every entry until a restart
        write_cache = self.storage.write_cache
        checkpoint = self._checkpoint_pending
        if checkpoint is None:
            mark = self._synced_position
            if write_cache.active_entries == 0 and mark == self._checkpoint_mark and not self.core.has_dirty_ledger_states:
                return
            checkpoint = self._checkpoint_pending = self.storage.begin_checkpoint(self.core.take_dirty_ledger_states(), mark)
        if not await self._flush_fits():
            return
        try:
            for _ in self.storage.stage_checkpoint(checkpoint, CHECKPOINT_STEP_ENTRIES):
                await trio.sleep(0)  # requests get served between slices
            await trio.to_thread.run_sync(self.storage.write_checkpoint, checkpoint)
        except (OSError, IndexWriteError) as error:
            self._checkpoint_failed(checkpoint, error)
            return
        self.storage.end_checkpoint()
        self._checkpoint_pending = None
        self._checkpoint_failure = None
        self._checkpoint_retry.reset()
        self._note_held(0)
        self._checkpoint_mark = checkpoint.mark
        self.stats.checkpoints += 1
        self._set_cause(Cause.CHECKPOINT_HELD, "")  # a failure with a real I/O error stays until restarted
        try:
            deleted = await trio.to_thread.run_sync(self.journal.delete_before, checkpoint.mark)
        except OSError as error:
            log.error("cannot delete journal files before the checkpoint mark (the next checkpoint tries again): %s", error)
        else:
            self.stats.journal_files_deleted += len(deleted)
        if self.core.adds_paused and not write_cache.is_full():
            self._execute(self.core.set_adds_paused(False, now_ms()))

    def _pending_flush_bytes(self) -> int:
        return pending_flush_bytes(self.config, self.storage)

    def _note_held(self, needed_bytes: int) -> None:
        self.checkpoint_held_bytes = needed_bytes
        self.core.info["checkpoint_held_bytes"] = needed_bytes

    async def _flush_fits(self) -> bool:
        """Whether the pending checkpoint fits on the ledger disk above the
        reserve (bookie.flush_room); if not, it is held and the bookie is
        read-only until it is written. Also sets the write cache's flush
        trigger from the room left."""
        write_cache = self.storage.write_cache
        needed = self._pending_flush_bytes()
        queued_bytes = self._journal_bytes + self._journal_record_bytes
        try:
            room = await trio.to_thread.run_sync(measure_ledger_room, self.config, self.storage)
        except OSError as error:
            log.warning("cannot measure the ledger disk's free space (%s): the checkpoint is written unchecked", error)
            return True
        verdict = check_flush(needed, dataclasses.replace(room, journal_queued_bytes=queued_bytes), self._flush_reserve)
        write_cache.flush_bytes = flush_trigger_bytes(write_cache.half_bytes, verdict.room_after_bytes)
        if verdict.fits:
            return True
        self._note_held(needed)
        self._checkpoint_failure = self._checkpoint_failure or FailureKind.NO_SPACE
        self._set_cause(Cause.CHECKPOINT_HELD, verdict.reason)
        self._checkpoint_wakeup.set()  # the loop retries it
        return False

    async def has_room_for(self, entries: int, data_bytes: int) -> bool:
        """Whether writing `entries` more entries of `data_bytes` in all
        (compaction's copies) leaves the ledger disk's reserve free, with
        room for a pending checkpoint too. Raises OSError when the disk
        cannot be measured."""
        room = await trio.to_thread.run_sync(measure_ledger_room, self.config, self.storage)
        needed = flush_bytes(entries, data_bytes, self.config.entry_log_bytes_max)
        if self._checkpoint_pending is not None:
            needed += self._pending_flush_bytes()
        queued_bytes = self._journal_bytes + self._journal_record_bytes
        return check_flush(needed, dataclasses.replace(room, journal_queued_bytes=queued_bytes), self._flush_reserve).fits

    def _checkpoint_failed(self, checkpoint: Checkpoint, error: OSError | IndexWriteError) -> None:
        """The entries are safe in the journal and readable in the write
        cache; the mark does not move. A refusal for room is a state that
        clears when a try succeeds; any other I/O error keeps the bookie
        read-only until restarted (the journal's rule); a failed index write
        stops the tries (RocksDB takes none until reopened)."""
        kind = classify_failure(error, index_error=isinstance(error, IndexWriteError))
        first = self._checkpoint_failure is not kind
        self._checkpoint_failure = kind
        self._note_held(self._pending_flush_bytes())
        if first:
            log.error("checkpoint failed (attempt %d, %s): %s", checkpoint.attempts, kind.value, error)
        else:
            log.debug("checkpoint failed again (attempt %d): %s", checkpoint.attempts, error)
        self._set_cause(_FAILURE_CAUSES[kind], describe_failure(kind, error))
        self._checkpoint_wakeup.set()  # the loop retries it

    # --- long polls and waiting adds --------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            deadline_ms = self.core.next_deadline_ms()
            if deadline_ms is None:
                await self._tick_wakeup.wait()
                continue
            with trio.move_on_at(deadline_ms / 1000.0):
                await self._tick_wakeup.wait()
            self._execute(self.core.tick(now_ms()))
