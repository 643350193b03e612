"""What a bookie does on start before it serves: rebuild ledger states from the
index, replay the journal from the checkpoint mark, checkpoint the result and
continue in a fresh journal file. Used by the trio server and the simulator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from bookie.ledger_storage import LedgerStorage
from bookie.core_actions import CoreLimits, StoreEntry
from bookie.request_core import BookieCore
from bookie.storage_interfaces import JOURNAL_START, Journal, JournalCorruptError, JournalPosition

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    mark_before: JournalPosition
    mark_after: JournalPosition
    records_replayed: int
    entries_replayed: int
    ledgers: int
    journal_files_deleted: list[int]


def recover(
    *, bookie_id: str, limits: CoreLimits, journal: Journal, storage: LedgerStorage, read_only: bool = False
) -> tuple[BookieCore, RecoveryReport]:
    mark = storage.entry_index.load_mark()
    if mark != JOURNAL_START and mark.file_id not in journal.file_ids():
        # The journal file the mark names is created before the mark is
        # written and never deleted while named: it was removed by hand.
        raise JournalCorruptError(
            f"the journal file {mark.file_id} named by the checkpoint mark is missing: the journal directory was "
            "wiped, and entries written since the last checkpoint are lost; refusing to start"
        )
    states = dict(storage.entry_index.load_ledger_states())
    core = BookieCore(bookie_id=bookie_id, limits=limits, ledger_states=states, read_only=read_only)
    records = entries = 0
    last = mark
    for record, position in journal.replay(mark):
        for action in core.replay(record):
            assert isinstance(action, StoreEntry)
            storage.put(action.ledger_id, action.entry_id, action.data)
            entries += 1
        records += 1
        last = position
        if storage.write_cache.wants_flush():
            _checkpoint(core, storage, last)
    # Never append behind what was replayed: a torn tail may follow it.
    start = journal.start_new_file(after=last)
    _checkpoint(core, storage, start)
    deleted = journal.delete_before(start)
    report = RecoveryReport(mark, start, records, entries, len(core.ledgers), deleted)
    log.info(
        "recovered storage: mark %s -> %s, replayed %d journal records (%d entries), %d ledgers",
        tuple(mark), tuple(start), records, entries, len(core.ledgers),
    )
    return core, report


def _checkpoint(core: BookieCore, storage: LedgerStorage, mark: JournalPosition) -> None:
    checkpoint = storage.begin_checkpoint(core.take_dirty_ledger_states(), mark)
    storage.run_checkpoint(checkpoint)
    storage.end_checkpoint()
