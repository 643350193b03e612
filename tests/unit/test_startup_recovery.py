"""Crash recovery of the real core and ledger storage over simulated disks.

A hypothesis state machine drives a bookie the way the trio server does
(journal batches, checkpoints whose mark is the last synced position) and
crashes it at any point, including half-way through a journal write or a
checkpoint. After every restart, every acknowledged add reads back byte for
byte and every acknowledged fence still holds.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from bookie.ledger_storage import LedgerStorage
from bookie.protocol import LAST_ADD_CONFIRMED, AddFlag, AddRequest, AddResponse, ReadFlag, ReadRequest, ReadResponse, Status
from bookie.core_actions import AppendJournal, CoreLimits, DurableAdd, ReadEntries, Respond, StoreEntry
from bookie.request_core import BookieCore
from bookie.sim_storage import SimEntryIndex, SimEntryLog, SimJournal
from bookie.startup_recovery import recover

KEY = master_key(b"pw")
LEDGERS = (1, 2, 3)


class CrashingBookie(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.journal = SimJournal()
        self.entry_log = SimEntryLog(log_entries_max=7)
        self.entry_index = SimEntryIndex()
        self.next_entry = {ledger_id: 0 for ledger_id in LEDGERS}
        self.sent: dict[tuple[int, int], bytes] = {}
        self.acknowledged: dict[tuple[int, int], bytes] = {}
        self.fenced: set[int] = set()
        self.pending_fences: dict[int, int] = {}  # request id -> ledger
        self.request_id = 0
        self.checkpoint = None
        self.restart()

    # --- the driver, as bookie.server does it ---------------------------------

    def restart(self) -> None:
        self.storage = LedgerStorage(self.entry_log, self.entry_index, write_cache_bytes=4000, read_cache_bytes=1000)
        self.core, report = recover(bookie_id="b", limits=CoreLimits(), journal=self.journal, storage=self.storage)
        self.synced_position = report.mark_after
        self.queue: list[AppendJournal] = []
        self.appended_unsynced: list[AppendJournal] = []
        self.checkpoint = None

    def execute(self, actions) -> None:
        for action in actions:
            if isinstance(action, AppendJournal):
                self.queue.append(action)
            elif isinstance(action, StoreEntry):
                self.storage.put(action.ledger_id, action.entry_id, action.data)
            elif isinstance(action, DurableAdd):
                self.storage.put(action.ledger_id, action.entry_id, action.data)
                self.on_response(AddResponse(action.request_id, Status.OK, action.ledger_id, action.entry_id))
            elif isinstance(action, ReadEntries):
                self.execute(self.core.read_completed(action.token, self.storage.read(action.ledger_id, action.first_entry_id, action.entries_max, action.bytes_max)))
            elif isinstance(action, Respond):
                self.on_response(action.response)

    def on_response(self, response) -> None:
        if isinstance(response, ReadResponse) and response.status in (Status.OK, Status.NO_ENTRY):
            self.fenced.add(self.pending_fences.pop(response.request_id))
        elif isinstance(response, AddResponse) and response.status is Status.OK:
            key = (response.ledger_id, response.entry_id)
            self.acknowledged[key] = self.sent[key]

    # --- rules -------------------------------------------------------------------

    @rule(ledger_id=st.sampled_from(LEDGERS), size=st.integers(1, 300))
    def add(self, ledger_id: int, size: int) -> None:
        entry_id = self.next_entry[ledger_id]
        self.next_entry[ledger_id] += 1
        digest = DigestManager(ledger_id, DigestType.CRC32C, b"pw")
        data = digest.encode(entry_id, entry_id - 1, 0, bytes([entry_id % 256]) * size)
        self.sent[(ledger_id, entry_id)] = data
        self.request_id += 1
        flags = AddFlag.RECOVERY_ADD if ledger_id in self.fenced else AddFlag.NONE
        self.execute(self.core.receive(1, AddRequest(self.request_id, flags, KEY, data), 0))

    @rule(ledger_id=st.sampled_from(LEDGERS))
    def fence(self, ledger_id: int) -> None:
        self.request_id += 1
        self.pending_fences[self.request_id] = ledger_id
        self.execute(self.core.receive(1, ReadRequest(self.request_id, ReadFlag.FENCE, ledger_id, LAST_ADD_CONFIRMED, KEY), 0))

    @precondition(lambda self: self.queue)
    @rule(split=st.floats(0, 1))
    def write_without_sync(self, split: float) -> None:
        """Part of the queue reaches the journal file, not yet synced."""
        count = max(1, int(len(self.queue) * split))
        batch, self.queue = self.queue[:count], self.queue[count:]
        self.journal.append([action.record for action in batch])
        self.appended_unsynced.extend(batch)

    @precondition(lambda self: self.queue or self.appended_unsynced)
    @rule()
    def sync(self) -> None:
        batch = self.appended_unsynced + self.queue
        if self.queue:
            self.journal.append([action.record for action in self.queue])
        position = self.journal.append([])
        self.journal.sync()
        self.queue, self.appended_unsynced = [], []
        self.synced_position = position
        self.execute(self.core.journal_synced([action.token for action in batch if action.token], 0))

    @precondition(lambda self: self.checkpoint is None)
    @rule()
    def begin_checkpoint(self) -> None:
        self.checkpoint = self.storage.begin_checkpoint(self.core.take_dirty_ledger_states(), self.synced_position)

    @precondition(lambda self: self.checkpoint is not None)
    @rule()
    def finish_checkpoint(self) -> None:
        self.storage.run_checkpoint(self.checkpoint)
        self.storage.end_checkpoint()
        self.journal.delete_before(self.checkpoint.mark)
        self.checkpoint = None

    @rule(mid_checkpoint=st.booleans())
    def crash(self, mid_checkpoint: bool) -> None:
        if mid_checkpoint and self.checkpoint is not None:
            # The entry log got the records but not the sync or the index commit.
            for _ in self.storage.stage_checkpoint(self.checkpoint, 1 << 30):
                pass
        self.journal.crash()
        self.entry_log.crash()
        self.pending_fences.clear()
        self.restart()

    # --- what must always hold --------------------------------------------------

    @invariant()
    def acknowledged_adds_read_back(self) -> None:
        for (ledger_id, entry_id), data in self.acknowledged.items():
            outcome = self.storage.read(ledger_id, entry_id, 1, 1 << 20)
            assert outcome.entries == [data], f"lost acknowledged entry {ledger_id}:{entry_id}"

    @invariant()
    def acknowledged_fences_hold(self) -> None:
        for ledger_id in self.fenced:
            assert self.core.ledgers[ledger_id].fenced, f"ledger {ledger_id} forgot its fence"


CrashingBookie.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestCrashingBookie = CrashingBookie.TestCase
