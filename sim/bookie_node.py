"""A bookie in the simulator: the real request core (`BookieCore`) and the
real ledger storage logic over the in-memory journal, entry log and index,
driven the way the trio server drives them: group commit with an fsync
delay, responses once durable, checkpoints that move the journal mark,
start-up recovery from the journal after a crash that lost unsynced data."""

from __future__ import annotations

from typing import Any

from bookie.ledger_storage import Checkpoint, LedgerStorage
from bookie.protocol.entry_format import parse_header
from bookie.protocol.wire import AddBatchRequest, AddFlag, AddResponse, Request, Status
from bookie.core_actions import AppendJournal, CoreLimits, DurableAdd, ListEntries, ReadEntries, Respond, StoreEntry
from bookie.sim_storage import SimEntryIndex, SimEntryLog, SimJournal
from bookie.startup_recovery import recover
from bookie.storage_interfaces import JOURNAL_START, JournalPosition, RecordKind
from coordination.cluster_layout import BookieRegistrationInfo, ClusterLayout
from coordination.store import NodeExistsError, SessionState
from sim.checker import SimChecker
from sim.metadata_node import MetadataLink, MetadataReply, ZkNode
from sim.network import Network
from sim.node import SimNode
from sim.world import World

LAYOUT = ClusterLayout()
CHECKPOINT_INTERVAL_MS = 200.0
CHECKPOINT_WRITE_MS_MAX = 5.0
READ_MS_MAX = 1.0
REGISTRATION_RETRY_MS = 300.0
ENTRY_LOG_ENTRIES_MAX = 200
SLOW_FSYNC_MS = 100.0


class SimBookie(SimNode):
    def __init__(self, name: str, world: World, network: Network, zk: ZkNode, checker: SimChecker, *,
                 fsync_ms_max: float, slow_fsync_probability: float = 0.0, write_cache_bytes: int,
                 session_timeout_ms: int) -> None:
        super().__init__(name, world, network)
        self.checker = checker
        self.fsync_ms_max = fsync_ms_max
        self.slow_fsync_probability = slow_fsync_probability
        self.write_cache_bytes = write_cache_bytes
        # The disk: survives crashes, minus what was not synced.
        self.journal = SimJournal()
        self.entry_log = SimEntryLog(log_entries_max=ENTRY_LOG_ENTRIES_MAX)
        self.entry_index = SimEntryIndex()
        self.metadata = MetadataLink(self, zk, session_timeout_ms=session_timeout_ms, call_timeout_ms=session_timeout_ms)
        self.registered = False
        self.restarts = 0
        self.start()

    # --- life ------------------------------------------------------------------------

    def start(self) -> None:
        super().start()
        self.storage = LedgerStorage(
            self.entry_log, self.entry_index,
            write_cache_bytes=self.write_cache_bytes, read_cache_bytes=self.write_cache_bytes, read_ahead_bytes=4096,
        )
        self.core, report = recover(bookie_id=self.name, limits=CoreLimits(), journal=self.journal, storage=self.storage)
        self.world.log(f"{self.name} started: mark {tuple(report.mark_after)}, replayed {report.entries_replayed} entries")
        self._appended_position: JournalPosition = report.mark_after
        self._synced_position: JournalPosition = report.mark_after
        self._checkpoint_mark: JournalPosition = report.mark_after
        self._unsynced_tokens: list[int] = []
        self._sync_scheduled = False
        self._checkpoint: Checkpoint | None = None
        self._tick_at_ms: float | None = None
        self._connections: dict[str, int] = {}
        self._connection_names: dict[int, str] = {}
        self._recovery_adds: set[tuple[int, int, int]] = set()  # (connection, ledger, entry) of a broker's recovery adds
        self._next_connection_id = 1
        store = self.metadata.start()
        incarnation = self.incarnation
        store.add_session_listener(lambda state: self._session_changed(state, incarnation))
        self.registered = False
        self._register()
        self.after(CHECKPOINT_INTERVAL_MS, self._checkpoint_timer)

    def crash(self) -> None:
        """kill -9 (or a power cut): unsynced journal records and entry-log
        writes are lost, memory is gone."""
        super().crash()
        self.journal.crash()
        self.entry_log.crash()
        self.core = None
        self.storage = None
        self.registered = False
        self.world.log(f"{self.name} crashed")

    def restart(self) -> None:
        self.restarts += 1
        self.start()

    # --- registration ---------------------------------------------------------------------

    def _register(self) -> None:
        info = BookieRegistrationInfo(bookie_id=self.name, address=self.name).to_bytes()
        path = LAYOUT.bookie_registration(self.name, read_only=False)
        self.metadata.call(
            lambda store: store.create(path, info, ephemeral=True, make_parents=True),
            self._registered, f"register {self.name}",
        )

    def _registered(self, result: Any, error: Exception | None) -> None:
        if error is None:
            self.registered = True
            return
        # NodeExistsError: the session of a previous run still holds the
        # node until it expires; anything else: ZooKeeper is unreachable.
        self.registered = False
        self.after(REGISTRATION_RETRY_MS, self._register)
        if not isinstance(error, NodeExistsError):
            self.world.log(f"{self.name} registration failed: {type(error).__name__}")

    def _session_changed(self, state: SessionState, incarnation: int) -> None:
        if state is SessionState.LOST and incarnation == self.incarnation and self.up:
            self.registered = False
            self.after(0, self._register)

    # --- requests -------------------------------------------------------------------------

    def deliver(self, source: str, message: Any) -> None:
        if isinstance(message, MetadataReply):
            self.metadata.reply(message)
            return
        connection_id = self._connections.get(source)
        if connection_id is None:
            connection_id = self._connections[source] = self._next_connection_id
            self._connection_names[connection_id] = source
            self._next_connection_id += 1
        request: Request = message
        if type(request) is AddBatchRequest and source.startswith("broker"):
            # A broker both writes its ledgers and recovers them: its
            # recovery adds are not a writer's (see add_accepted).
            adds = request.adds
            for index in range(0, len(adds), 3):
                if adds[index] & AddFlag.RECOVERY_ADD:
                    header = parse_header(adds[index + 2])
                    self._recovery_adds.add((connection_id, header.ledger_id, header.entry_id))
        self._execute(self.core.receive(connection_id, request, self.world.now_ms))

    def connection_lost(self, peer: str) -> None:
        connection_id = self._connections.pop(peer, None)
        if connection_id is not None:
            del self._connection_names[connection_id]
            self._execute(self.core.connection_closed(connection_id))

    def _respond(self, connection_id: int, response: Any) -> None:
        peer = self._connection_names.get(connection_id)
        if peer is not None:
            self.send(peer, response)

    def _execute(self, actions: list) -> None:
        for action in actions:
            kind = type(action)
            if kind is Respond:
                self._respond(action.connection_id, action.response)
            elif kind is AppendJournal:
                self._appended_position = self.journal.append([action.record])
                self._unsynced_tokens.append(action.token)
                if not self._sync_scheduled:
                    self._sync_scheduled = True
                    fsync_ms = self.world.uniform(0.01, self.fsync_ms_max)
                    if self.world.chance(self.slow_fsync_probability):
                        fsync_ms = self.world.uniform(fsync_ms, SLOW_FSYNC_MS)
                    self.after(fsync_ms, self._sync)
            elif kind is DurableAdd:
                self._store(action.ledger_id, action.entry_id, action.data)
                name = self._connection_names.get(action.connection_id, "")
                if name.startswith("writer"):
                    self.checker.add_accepted(self.name, action.ledger_id, action.entry_id)
                elif name.startswith("broker"):
                    key = (action.connection_id, action.ledger_id, action.entry_id)
                    if key in self._recovery_adds:
                        self._recovery_adds.discard(key)
                    else:
                        self.checker.add_accepted(self.name, action.ledger_id, action.entry_id)
                if action.batch is None:  # an ADD_BATCH is answered by a Respond after its last add
                    self._respond(action.connection_id, AddResponse(action.request_id, Status.OK, action.ledger_id, action.entry_id))
            elif kind is StoreEntry:
                self._store(action.ledger_id, action.entry_id, action.data)
            elif kind is ReadEntries:
                self.after(self.world.uniform(0.0, READ_MS_MAX), self._read, action)
            elif kind is ListEntries:
                self.after(self.world.uniform(0.0, READ_MS_MAX), self._list, action)
            else:
                raise AssertionError(f"unknown action {action!r}")
        self._schedule_tick()

    def _store(self, ledger_id: int, entry_id: int, data: bytes) -> None:
        self.storage.put(ledger_id, entry_id, data)
        write_cache = self.storage.write_cache
        if write_cache.wants_flush():
            self.after(0, self._begin_checkpoint)
            if write_cache.is_full() and not self.core.adds_paused:
                self._execute(self.core.set_adds_paused(True, self.world.now_ms))

    def _read(self, action: ReadEntries) -> None:
        outcome = self.storage.read(action.ledger_id, action.first_entry_id, action.entries_max, action.bytes_max)
        self._execute(self.core.read_completed(action.token, outcome))

    def _list(self, action: ListEntries) -> None:
        entry_ids = self.storage.entry_ids(action.ledger_id, action.first_entry_id, action.last_entry_id, action.ids_max)
        self._execute(self.core.list_completed(action.token, entry_ids, False))

    def _schedule_tick(self) -> None:
        deadline_ms = self.core.next_deadline_ms()
        if deadline_ms is None or (self._tick_at_ms is not None and self._tick_at_ms <= deadline_ms):
            return
        self._tick_at_ms = deadline_ms
        self.after(deadline_ms - self.world.now_ms, self._tick, deadline_ms)

    def _tick(self, deadline_ms: float) -> None:
        if self._tick_at_ms != deadline_ms:
            return  # a sooner tick was set since
        self._tick_at_ms = None
        self._execute(self.core.tick(self.world.now_ms))

    # --- the journal ------------------------------------------------------------------------

    def _sync(self) -> None:
        """Group commit: one fsync covers every record appended so far."""
        self._sync_scheduled = False
        self.journal.sync()
        self._synced_position = self._appended_position
        tokens, self._unsynced_tokens = self._unsynced_tokens, []
        self._execute(self.core.journal_synced([token for token in tokens if token], self.world.now_ms))

    # --- checkpoints -------------------------------------------------------------------------

    def _checkpoint_timer(self) -> None:
        self._begin_checkpoint()
        self.after(CHECKPOINT_INTERVAL_MS, self._checkpoint_timer)

    def _begin_checkpoint(self) -> None:
        if self._checkpoint is not None:
            return
        mark = self._synced_position
        write_cache = self.storage.write_cache
        if write_cache.active_entries == 0 and mark == self._checkpoint_mark and not self.core.has_dirty_ledger_states:
            return
        checkpoint = self._checkpoint = self.storage.begin_checkpoint(self.core.take_dirty_ledger_states(), mark)
        for _ in self.storage.stage_checkpoint(checkpoint, 1 << 62):
            pass
        # The write takes time: a crash meanwhile loses the staged records
        # and leaves the index and the mark where they were.
        self.after(self.world.uniform(0.1, CHECKPOINT_WRITE_MS_MAX), self._end_checkpoint)

    def _end_checkpoint(self) -> None:
        checkpoint = self._checkpoint
        assert checkpoint is not None
        self.storage.write_checkpoint(checkpoint)
        self.storage.end_checkpoint()
        self._checkpoint = None
        self._checkpoint_mark = checkpoint.mark
        self.journal.delete_before(checkpoint.mark)
        if self.core.adds_paused and not self.storage.write_cache.is_full():
            self._execute(self.core.set_adds_paused(False, self.world.now_ms))

    # --- what the checkers and the nemesis look at ------------------------------------------

    def durable_entries(self) -> dict[tuple[int, int], bytes | None]:
        """What this bookie would serve after a crash and restart now:
        (ledger, entry) -> the entry's bytes, or None for a copy that is
        stored but no longer intact. Journal records after the checkpoint
        mark are replayed over the index, so they win."""
        found: dict[tuple[int, int], bytes | None] = {}
        for (ledger_id, entry_id), location in self.entry_index.locations():
            found[(ledger_id, entry_id)] = self.entry_log.intact_copy(location, ledger_id, entry_id)
        mark = self.entry_index.load_mark()
        for record in self.journal.synced_records(mark if mark != JOURNAL_START else JOURNAL_START):
            if record.kind is RecordKind.ADD:
                found[(record.ledger_id, record.entry_id)] = record.data
        return found

    def corrupt(self, ledger_id: int, entry_id: int, *, served: bool = False) -> int:
        """Flip a byte of the entry's copies in the entry logs (a bad disk).
        With `served`, the entry log's checksum is rewritten over the bad
        bytes: the bookie serves them as intact, only the client's digest
        can tell; else the entry log's checksum catches them (IO_ERROR)."""
        self.read_cache_discard(ledger_id, entry_id)
        byte_index = self.world.rng.randrange(1 << 16)
        if served:
            return self.entry_log.corrupt_served(ledger_id, entry_id, byte_index=byte_index)
        return self.entry_log.corrupt(ledger_id, entry_id, byte_index=byte_index)

    def read_cache_discard(self, ledger_id: int, entry_id: int) -> None:
        if self.storage is not None:
            self.storage.read_cache.discard(ledger_id, entry_id)

    def indexed_entries(self) -> list[tuple[int, int]]:
        return [key for key, _ in self.entry_index.locations()]
