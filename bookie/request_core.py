"""The bookie's request handling as a pure state machine.

It decides what every request does (fencing, master keys, last-add-confirmed,
in-flight bounds, which response to send once the journal says a record is
durable) and returns actions for a driver to carry out: the trio server in
production, the simulator in `sim/`. No I/O, no clock, no randomness: time
enters as `now_ms`, storage results come back as events.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from bookie.protocol.entry_format import EntryFormatError, header_fields
from bookie.protocol.wire import (
    LAST_ADD_CONFIRMED,
    PROTOCOL_VERSION,
    AddBatchRequest,
    AddFlag,
    AddRequest,
    AddResponse,
    BatchReadRequest,
    BatchReadResponse,
    GetInfoRequest,
    GetInfoResponse,
    ListEntriesRequest,
    ListEntriesResponse,
    ReadFlag,
    ReadLacRequest,
    ReadLacResponse,
    ReadRequest,
    ReadResponse,
    Request,
    Response,
    Status,
)
from bookie.core_actions import (
    Action,
    AppendJournal,
    BatchAnswer,
    CoreLimits,
    DurableAdd,
    ListEntries,
    ReadEntries,
    Respond,
    StoreEntry,
)
from bookie.storage_interfaces import JournalRecord, LedgerStateRecord, ReadOutcome, RecordKind

# Ledger and entry ids are signed 64-bit values, as in BookKeeper: the header
# has room for more, but the journal and index store them signed.
ID_MAX = 2**63 - 1

# --- pending operations -------------------------------------------------------


@dataclass(slots=True)
class _WaitingAdd:
    """An add admitted while the write cache has no room; it waits for room."""

    deadline_ms: float
    connection_id: int
    request: AddRequest  # of an ADD_BATCH's add: its own fields, with the batch's request id
    ledger_id: int
    entry_id: int
    last_add_confirmed: int
    batch: BatchAnswer | None
    index: int


@dataclass(slots=True)
class _PendingFence:
    connection_id: int
    request: ReadRequest


@dataclass(slots=True)
class _PendingRead:
    connection_id: int
    request: Request
    ledger_id: int
    entry_id: int


@dataclass(slots=True)
class _Waiter:
    """A long-poll READ waiting for the ledger's LAC to pass `previous_lac`."""

    deadline_ms: float
    connection_id: int
    request: ReadRequest
    done: bool = False


class BookieCore:
    """Request handling for one bookie. Every method returns a list of actions."""

    def __init__(
        self,
        *,
        bookie_id: str,
        limits: CoreLimits = CoreLimits(),
        ledger_states: dict[int, LedgerStateRecord] | None = None,
        read_only: bool = False,
    ) -> None:
        self.bookie_id = bookie_id
        self.limits = limits
        self.ledgers: dict[int, LedgerStateRecord] = dict(ledger_states or {})
        self.read_only = read_only
        self.adds_paused = False
        self.adds_in_flight = 0
        self.reads_in_flight = 0
        self.info: dict[str, object] = {}
        self._dirty: set[int] = set()
        self._next_token = 1
        self._pending: dict[int, DurableAdd | _PendingFence] = {}
        self._waiting_adds: deque[_WaitingAdd] = deque()
        self._pending_reads: dict[int, _PendingRead] = {}
        self._waiters: dict[int, list[_Waiter]] = {}
        self._waiter_deadlines: list[tuple[float, int, _Waiter]] = []
        self._waiters_by_connection: dict[int, list[_Waiter]] = {}
        self.waiter_count = 0
        self._waiter_sequence = 0

    # --- events -------------------------------------------------------------

    def receive(self, connection_id: int, request: Request, now_ms: float) -> list[Action]:
        if type(request) is AddBatchRequest:
            return self._receive_add_batch(connection_id, request, now_ms)
        if type(request) is AddRequest:
            return self._receive_add(connection_id, request.request_id, request.flags, request.master_key, request.entry, now_ms)
        if isinstance(request, ReadRequest):
            return self._receive_read(connection_id, request, now_ms)
        if isinstance(request, BatchReadRequest):
            return self._receive_batch_read(connection_id, request)
        if isinstance(request, ReadLacRequest):
            state = self.ledgers.get(request.ledger_id)
            if state is None:
                return [Respond(connection_id, ReadLacResponse(request.request_id, Status.NO_LEDGER, request.ledger_id, -1))]
            response = ReadLacResponse(request.request_id, Status.OK, request.ledger_id, state.last_add_confirmed)
            return [Respond(connection_id, response)]
        if isinstance(request, GetInfoRequest):
            return [Respond(connection_id, GetInfoResponse(request.request_id, Status.OK, self.describe()))]
        if isinstance(request, ListEntriesRequest):
            return self._receive_list(connection_id, request)
        raise TypeError(f"not a bookie request: {request!r}")

    def journal_synced(self, tokens: list[int], now_ms: float) -> list[Action]:
        """Records with these tokens (in journal order) are durable."""
        actions: list[Action] = []
        advanced: list[int] = []
        for token in tokens:
            pending = self._pending.pop(token, None)
            if pending is None:
                continue
            if type(pending) is DurableAdd:
                self.adds_in_flight -= 1
                state = self.ledgers[pending.ledger_id]
                if pending.last_add_confirmed > state.last_add_confirmed:
                    state.last_add_confirmed = pending.last_add_confirmed
                    self._dirty.add(pending.ledger_id)
                    advanced.append(pending.ledger_id)
                actions.append(pending)  # store the entry, then answer OK
                if pending.batch is not None:
                    actions += pending.batch.settled()
            else:
                # The fence is durable: only now may the fencing read answer.
                request = pending.request
                actions.extend(self._start_read(pending.connection_id, request, request.ledger_id, request.entry_id))
        for ledger_id in advanced:
            actions.extend(self._wake_waiters(ledger_id))
        return actions

    def journal_failed(self, tokens: list[int]) -> list[Action]:
        """Records with these tokens could not be made durable."""
        actions: list[Action] = []
        for token in tokens:
            pending = self._pending.pop(token, None)
            if isinstance(pending, DurableAdd):
                self.adds_in_flight -= 1
                actions += self._refuse_add(
                    pending.connection_id, pending.request_id, Status.IO_ERROR, pending.ledger_id, pending.entry_id, pending.batch, pending.index
                )
            elif isinstance(pending, _PendingFence):
                self.reads_in_flight -= 1
                request = pending.request
                actions.append(Respond(pending.connection_id, self._read_response(request, Status.IO_ERROR)))
        return actions

    def read_completed(self, token: int, outcome: ReadOutcome) -> list[Action]:
        pending = self._pending_reads.pop(token)
        self.reads_in_flight -= 1
        request = pending.request
        if outcome.entries:
            status = Status.OK
        elif outcome.failed:
            # Stored but unreadable: never NO_ENTRY, or recovery could
            # truncate a ledger because of one corrupt replica.
            status = Status.IO_ERROR
        else:
            status = Status.NO_ENTRY
        if isinstance(request, BatchReadRequest):
            response: Response = BatchReadResponse(
                request.request_id, status, request.ledger_id, request.first_entry_id, outcome.entries
            )
        else:
            state = self.ledgers[pending.ledger_id]
            entry = outcome.entries[0] if outcome.entries else None
            response = ReadResponse(
                request.request_id, status, pending.ledger_id, pending.entry_id, state.last_add_confirmed, entry
            )
        return [Respond(pending.connection_id, response)]

    def list_completed(self, token: int, entry_ids: list[int], failed: bool) -> list[Action]:
        pending = self._pending_reads.pop(token)
        self.reads_in_flight -= 1
        request = pending.request
        status = Status.IO_ERROR if failed else Status.OK
        return [Respond(pending.connection_id, ListEntriesResponse(request.request_id, status, request.ledger_id, _runs(entry_ids)))]

    def tick(self, now_ms: float) -> list[Action]:
        """Expire long polls and adds that waited too long for write-cache room."""
        actions: list[Action] = []
        while self._waiting_adds and self._waiting_adds[0].deadline_ms <= now_ms:
            waiting = self._waiting_adds.popleft()
            self.adds_in_flight -= 1
            actions += self._refuse_waiting(waiting, Status.TOO_MANY_REQUESTS)
        deadlines = self._waiter_deadlines
        while deadlines and deadlines[0][0] <= now_ms:
            _, _, waiter = heapq.heappop(deadlines)
            if waiter.done:
                continue
            self._finish_waiter(waiter)
            self.reads_in_flight += 1
            request = waiter.request
            actions.extend(self._start_read(waiter.connection_id, request, request.ledger_id, request.entry_id))
        return actions

    def next_deadline_ms(self) -> float | None:
        candidates = []
        if self._waiting_adds:
            candidates.append(self._waiting_adds[0].deadline_ms)
        while self._waiter_deadlines and self._waiter_deadlines[0][2].done:
            heapq.heappop(self._waiter_deadlines)
        if self._waiter_deadlines:
            candidates.append(self._waiter_deadlines[0][0])
        return min(candidates) if candidates else None

    def connection_closed(self, connection_id: int) -> list[Action]:
        for waiter in self._waiters_by_connection.pop(connection_id, []):
            if not waiter.done:
                self._finish_waiter(waiter, by_connection=False)
        kept = deque()
        for waiting in self._waiting_adds:
            if waiting.connection_id == connection_id:
                self.adds_in_flight -= 1
            else:
                kept.append(waiting)
        self._waiting_adds = kept
        return []

    def set_read_only(self, read_only: bool) -> list[Action]:
        self.read_only = read_only
        if not read_only:
            return []
        # Adds still waiting for room must not be written by a read-only bookie.
        actions: list[Action] = []
        while self._waiting_adds:
            waiting = self._waiting_adds.popleft()
            self.adds_in_flight -= 1
            actions += self._refuse_waiting(waiting, Status.READ_ONLY)
        return actions

    def set_adds_paused(self, paused: bool, now_ms: float) -> list[Action]:
        """The write cache is full (paused) or has room again (resumed)."""
        self.adds_paused = paused
        actions: list[Action] = []
        while not self.adds_paused and self._waiting_adds:
            waiting = self._waiting_adds.popleft()
            self.adds_in_flight -= 1
            request = waiting.request
            actions += self._receive_add(
                waiting.connection_id, request.request_id, request.flags, request.master_key, request.entry, now_ms,
                waiting.batch, waiting.index,
            )
        return actions

    # --- journal replay and checkpoints --------------------------------------

    def replay(self, record: JournalRecord) -> list[Action]:
        """Apply a journal record found on restart; entries come back as StoreEntry."""
        if record.kind is RecordKind.MASTER_KEY:
            if record.ledger_id not in self.ledgers:
                self.ledgers[record.ledger_id] = LedgerStateRecord(master_key=record.data)
                self._dirty.add(record.ledger_id)
            return []
        state = self.ledgers.get(record.ledger_id)
        # A ledger's MASTER_KEY record always precedes its other records, and
        # the mark only passes it once a checkpoint stored the ledger's state.
        assert state is not None, f"journal record for unknown ledger {record.ledger_id}"
        if record.kind is RecordKind.FENCE:
            if not state.fenced:
                state.fenced = True
                self._dirty.add(record.ledger_id)
            return []
        last_add_confirmed = header_fields(record.data)[2]
        if last_add_confirmed > state.last_add_confirmed:
            state.last_add_confirmed = last_add_confirmed
            self._dirty.add(record.ledger_id)
        return [StoreEntry(record.ledger_id, record.entry_id, record.data)]

    @property
    def has_dirty_ledger_states(self) -> bool:
        return bool(self._dirty)

    def take_dirty_ledger_states(self) -> dict[int, LedgerStateRecord]:
        """Copies of the ledger states changed since the last call, for a checkpoint."""
        dirty = {
            ledger_id: LedgerStateRecord(state.master_key, state.fenced, state.last_add_confirmed)
            for ledger_id in self._dirty
            if (state := self.ledgers.get(ledger_id)) is not None
        }
        self._dirty.clear()
        return dirty

    def drop_ledgers(self, ledger_ids: Iterable[int]) -> list[int]:
        """Garbage collection: forget ledgers whose metadata is gone; returns
        those forgotten. From now on requests find them absent (reads answer
        NO_LEDGER), and an add or a fence starts one afresh, journalling its
        master key first like any new ledger's.

        A ledger with a request in flight (an add or a fence waiting for the
        journal or for write-cache room, a read, a long poll) is kept this
        time, for the next round. So every journal record of a forgotten
        ledger is already synced: the driver checkpoints past them before
        it removes the ledger from the index, and a restart never replays
        one of them."""
        wanted = {ledger_id for ledger_id in ledger_ids if ledger_id in self.ledgers}
        if not wanted:
            return []
        busy = {pending.ledger_id if type(pending) is DurableAdd else pending.request.ledger_id for pending in self._pending.values()}
        busy.update(waiting.ledger_id for waiting in self._waiting_adds)
        busy.update(pending.ledger_id for pending in self._pending_reads.values())
        busy.update(self._waiters)
        dropped = sorted(wanted - busy)
        for ledger_id in dropped:
            del self.ledgers[ledger_id]
            self._dirty.discard(ledger_id)
        return dropped

    def describe(self) -> dict[str, object]:
        info = dict(self.info)
        info.update(
            bookie_id=self.bookie_id,
            protocol_version=PROTOCOL_VERSION,
            read_only=self.read_only,
            ledgers=len(self.ledgers),
            adds_in_flight=self.adds_in_flight,
            reads_in_flight=self.reads_in_flight,
            long_poll_waiters=self.waiter_count,
        )
        return info

    # --- adds -----------------------------------------------------------------

    def _receive_add_batch(self, connection_id: int, request: AddBatchRequest, now_ms: float) -> list[Action]:
        """Each add of the batch as if it came alone, in order; the batch is
        answered once, when the last of them is settled."""
        adds = iter(request.adds)
        request_id = request.request_id
        batch = BatchAnswer(connection_id, request_id, len(request.adds) // 3)
        receive_add = self._receive_add
        actions: list[Action] = []
        for index, (flags, master_key, entry) in enumerate(zip(adds, adds, adds)):
            actions += receive_add(connection_id, request_id, flags, master_key, entry, now_ms, batch, index)
        return actions

    def _receive_add(
        self, connection_id: int, request_id: int, flags: int, master_key: bytes, entry: bytes, now_ms: float,
        batch: BatchAnswer | None = None, index: int = 0,
    ) -> list[Action]:
        try:
            ledger_id, entry_id, last_add_confirmed, _ = header_fields(entry)
        except EntryFormatError:
            return self._refuse_add(connection_id, request_id, Status.BAD_REQUEST, 0, 0, batch, index)
        status = None
        state = self.ledgers.get(ledger_id)
        if not master_key or ledger_id > ID_MAX or entry_id > ID_MAX:
            status = Status.BAD_REQUEST
        elif self.read_only:
            status = Status.READ_ONLY
        elif self.adds_in_flight >= self.limits.adds_in_flight_max:
            status = Status.TOO_MANY_REQUESTS
        elif state is not None:
            if state.master_key != master_key:
                status = Status.UNAUTHORIZED
            elif state.fenced and not flags & AddFlag.RECOVERY_ADD:
                status = Status.FENCED
        if status is not None:
            return self._refuse_add(connection_id, request_id, status, ledger_id, entry_id, batch, index)
        actions: list[Action] = [] if state is not None else self._create_ledger(ledger_id, master_key)
        self.adds_in_flight += 1
        if self.adds_paused:
            deadline_ms = now_ms + self.limits.write_cache_wait_ms_max
            request = AddRequest(request_id, flags, master_key, entry)
            self._waiting_adds.append(
                _WaitingAdd(deadline_ms, connection_id, request, ledger_id, entry_id, last_add_confirmed, batch, index)
            )
            return actions
        token = self._next_token
        self._next_token = token + 1
        add = self._pending[token] = DurableAdd(
            connection_id, request_id, ledger_id, entry_id, last_add_confirmed, entry, batch, index
        )
        actions.append(AppendJournal(add, token))
        return actions

    @staticmethod
    def _refuse_add(
        connection_id: int, request_id: int, status: Status, ledger_id: int, entry_id: int, batch: BatchAnswer | None, index: int
    ) -> list[Action]:
        """An add settled with an error: its own answer, or its status in its batch's."""
        if batch is None:
            return [Respond(connection_id, AddResponse(request_id, status, ledger_id, entry_id))]
        batch.statuses[index] = status
        return batch.settled()

    def _refuse_waiting(self, waiting: _WaitingAdd, status: Status) -> list[Action]:
        return self._refuse_add(
            waiting.connection_id, waiting.request.request_id, status, waiting.ledger_id, waiting.entry_id, waiting.batch, waiting.index
        )

    def _create_ledger(self, ledger_id: int, master_key: bytes) -> list[Action]:
        self.ledgers[ledger_id] = LedgerStateRecord(master_key=master_key)
        self._dirty.add(ledger_id)
        # Journalled ahead of the ledger's first add or fence, so that replay
        # always knows the key before anything else about the ledger.
        return [AppendJournal(JournalRecord(RecordKind.MASTER_KEY, ledger_id, -1, master_key), 0)]

    # --- reads ----------------------------------------------------------------

    def _receive_read(self, connection_id: int, request: ReadRequest, now_ms: float) -> list[Action]:
        if request.flags & ReadFlag.FENCE:
            return self._receive_fence(connection_id, request)
        state = self.ledgers.get(request.ledger_id)
        if state is None:
            return [Respond(connection_id, self._read_response(request, Status.NO_LEDGER))]
        if request.previous_lac is not None:
            if request.timeout_ms is None:
                return [Respond(connection_id, self._read_response(request, Status.BAD_REQUEST))]
            if state.last_add_confirmed <= request.previous_lac:
                return self._add_waiter(connection_id, request, now_ms)
        if self.reads_in_flight >= self.limits.reads_in_flight_max:
            return [Respond(connection_id, self._read_response(request, Status.TOO_MANY_REQUESTS))]
        self.reads_in_flight += 1
        return self._start_read(connection_id, request, request.ledger_id, request.entry_id)

    def _receive_fence(self, connection_id: int, request: ReadRequest) -> list[Action]:
        if not request.master_key or request.previous_lac is not None or request.ledger_id > ID_MAX:
            return [Respond(connection_id, self._read_response(request, Status.BAD_REQUEST))]
        if self.reads_in_flight >= self.limits.reads_in_flight_max:
            return [Respond(connection_id, self._read_response(request, Status.TOO_MANY_REQUESTS))]
        actions: list[Action] = []
        state = self.ledgers.get(request.ledger_id)
        if state is None:
            # Fencing a ledger this bookie never saw still creates and fences
            # it, so that a slow writer's first add here is refused too.
            actions.extend(self._create_ledger(request.ledger_id, request.master_key))
            state = self.ledgers[request.ledger_id]
        elif state.master_key != request.master_key:
            return [Respond(connection_id, self._read_response(request, Status.UNAUTHORIZED))]
        if not state.fenced:
            state.fenced = True
            self._dirty.add(request.ledger_id)
        # Journalled every time: an earlier fence record may not be durable yet.
        self.reads_in_flight += 1
        token = self._token()
        self._pending[token] = _PendingFence(connection_id, request)
        actions.append(AppendJournal(JournalRecord(RecordKind.FENCE, request.ledger_id, -1, b""), token))
        return actions

    def _receive_batch_read(self, connection_id: int, request: BatchReadRequest) -> list[Action]:
        def reply(status: Status) -> list[Action]:
            response = BatchReadResponse(request.request_id, status, request.ledger_id, request.first_entry_id, [])
            return [Respond(connection_id, response)]

        if request.ledger_id not in self.ledgers:
            return reply(Status.NO_LEDGER)
        if self.reads_in_flight >= self.limits.reads_in_flight_max:
            return reply(Status.TOO_MANY_REQUESTS)
        self.reads_in_flight += 1
        token = self._token()
        self._pending_reads[token] = _PendingRead(connection_id, request, request.ledger_id, request.first_entry_id)
        entries_max = min(request.entries_max, self.limits.batch_read_entries_max)
        bytes_max = min(request.bytes_max, self.limits.batch_read_bytes_max)
        return [ReadEntries(token, request.ledger_id, request.first_entry_id, entries_max, bytes_max)]

    def _receive_list(self, connection_id: int, request: ListEntriesRequest) -> list[Action]:
        def reply(status: Status) -> list[Action]:
            return [Respond(connection_id, ListEntriesResponse(request.request_id, status, request.ledger_id, []))]

        if request.ledger_id not in self.ledgers:
            return reply(Status.NO_LEDGER)
        if request.last_entry_id < request.first_entry_id:
            return reply(Status.BAD_REQUEST)
        if self.reads_in_flight >= self.limits.reads_in_flight_max:
            return reply(Status.TOO_MANY_REQUESTS)
        self.reads_in_flight += 1
        token = self._token()
        self._pending_reads[token] = _PendingRead(connection_id, request, request.ledger_id, request.first_entry_id)
        return [
            ListEntries(
                token, request.ledger_id, request.first_entry_id, request.last_entry_id, self.limits.list_entries_ids_max
            )
        ]

    def _start_read(self, connection_id: int, request: ReadRequest, ledger_id: int, entry_id: int) -> list[Action]:
        """Issue the storage read for a READ that the caller already counted
        in `reads_in_flight`."""
        if entry_id == LAST_ADD_CONFIRMED:
            entry_id = self.ledgers[ledger_id].last_add_confirmed
            if entry_id < 0:
                self.reads_in_flight -= 1
                return [Respond(connection_id, self._read_response(request, Status.NO_ENTRY))]
        token = self._token()
        self._pending_reads[token] = _PendingRead(connection_id, request, ledger_id, entry_id)
        return [ReadEntries(token, ledger_id, entry_id, 1, self.limits.read_bytes_max)]

    def _read_response(self, request: ReadRequest, status: Status) -> ReadResponse:
        state = self.ledgers.get(request.ledger_id)
        lac = state.last_add_confirmed if state is not None else -1
        return ReadResponse(request.request_id, status, request.ledger_id, request.entry_id, lac, None)

    # --- long polls -----------------------------------------------------------

    def _add_waiter(self, connection_id: int, request: ReadRequest, now_ms: float) -> list[Action]:
        if self.waiter_count >= self.limits.long_poll_waiters_max:
            return [Respond(connection_id, self._read_response(request, Status.TOO_MANY_REQUESTS))]
        timeout_ms = min(request.timeout_ms or 0, self.limits.long_poll_timeout_ms_max)
        waiter = _Waiter(now_ms + timeout_ms, connection_id, request)
        self._waiters.setdefault(request.ledger_id, []).append(waiter)
        self._waiters_by_connection.setdefault(connection_id, []).append(waiter)
        self._waiter_sequence += 1
        heapq.heappush(self._waiter_deadlines, (waiter.deadline_ms, self._waiter_sequence, waiter))
        self.waiter_count += 1
        return []

    def _finish_waiter(self, waiter: _Waiter, *, by_connection: bool = True) -> None:
        waiter.done = True
        self.waiter_count -= 1
        ledger_waiters = self._waiters.get(waiter.request.ledger_id)
        if ledger_waiters is not None:
            ledger_waiters.remove(waiter)
            if not ledger_waiters:
                del self._waiters[waiter.request.ledger_id]
        if by_connection:
            connection_waiters = self._waiters_by_connection.get(waiter.connection_id)
            if connection_waiters is not None:
                connection_waiters.remove(waiter)
                if not connection_waiters:
                    del self._waiters_by_connection[waiter.connection_id]

    def _wake_waiters(self, ledger_id: int) -> list[Action]:
        waiters = self._waiters.get(ledger_id)
        if not waiters:
            return []
        lac = self.ledgers[ledger_id].last_add_confirmed
        actions: list[Action] = []
        woken = []  # (a loop, not a comprehension: `lac` would be a cell, made on every call)
        for waiter in waiters:
            if waiter.request.previous_lac < lac:
                woken.append(waiter)
        for waiter in woken:
            self._finish_waiter(waiter)
            self.reads_in_flight += 1
            request = waiter.request
            actions.extend(self._start_read(waiter.connection_id, request, ledger_id, request.entry_id))
        return actions

    def _token(self) -> int:
        token = self._next_token
        self._next_token += 1
        return token


def _runs(entry_ids: list[int]) -> list[tuple[int, int]]:
    """Compress ascending ids into inclusive [first, last] runs."""
    runs: list[tuple[int, int]] = []
    for entry_id in entry_ids:
        if runs and runs[-1][1] + 1 == entry_id:
            runs[-1] = (runs[-1][0], entry_id)
        else:
            runs.append((entry_id, entry_id))
    return runs
