"""What a bookie does on start before it serves: rebuild ledger states from the
index, replay the journal from the checkpoint mark, checkpoint the result and
continue in a fresh journal file. Used by the trio server and the simulator.
"""

# On a full ledger disk a checkpoint that does not fit is held, not written:
# replay goes on into the write cache, the mark stays behind every entry not
# yet flushed, and the server tries the held checkpoint again once it serves
# (read-only meanwhile). Nothing replayed is lost, and no journal file is
# deleted before a checkpoint covers it.

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from bookie.flush_room import FailureKind, classify_failure, describe_failure
from bookie.ledger_storage import Checkpoint, LedgerStorage
from bookie.core_actions import CoreLimits, StoreEntry
from bookie.request_core import BookieCore
from bookie.storage_interfaces import JOURNAL_START, IndexWriteError, Journal, JournalCorruptError, JournalPosition

log = logging.getLogger(__name__)

# Whether a begun checkpoint may be written now: "" if so, else why not.
FlushRoomCheck = Callable[[Checkpoint], str]


class ReplayHeldError(Exception):
    """Replay found more entries not yet in the entry logs than memory may
    hold while the ledger disk has no room to flush them."""


@dataclass(frozen=True, slots=True)
class HeldCheckpoint:
    """A checkpoint begun during recovery that could not be written: the
    server tries it again before any other."""

    checkpoint: Checkpoint
    kind: FailureKind
    reason: str


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    mark_before: JournalPosition
    mark_after: JournalPosition  # every replayed record is before it: the server's synced position
    records_replayed: int
    entries_replayed: int
    ledgers: int
    journal_files_deleted: list[int]
    mark_durable: JournalPosition | None = None  # the index's mark; behind mark_after while a checkpoint is held
    held: HeldCheckpoint | None = None
    journal_no_file: str | None = None  # why the journal could not start a new file (its disk is full)


def recover(
    *, bookie_id: str, limits: CoreLimits, journal: Journal, storage: LedgerStorage, read_only: bool = False,
    flush_room: FlushRoomCheck | None = None, held_bytes_max: int | None = None,
) -> tuple[BookieCore, RecoveryReport]:
    """`flush_room` says whether a checkpoint fits on the ledger disk (None:
    always). While one is held, replayed entries wait in the write cache, up
    to `held_bytes_max` bytes (None: no bound); past it ReplayHeldError."""
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
    held: HeldCheckpoint | None = None
    write_cache = storage.write_cache
    for record, position in journal.replay(mark):
        for action in core.replay(record):
            assert isinstance(action, StoreEntry)
            storage.put(action.ledger_id, action.entry_id, action.data)
            entries += 1
        records += 1
        last = position
        if held is None:
            if write_cache.wants_flush():
                held = _checkpoint(core, storage, last, flush_room)
        elif held_bytes_max is not None and write_cache.active_bytes + write_cache.flushing_bytes > held_bytes_max:
            raise ReplayHeldError(
                f"the journal holds more than {held_bytes_max} bytes of entries not yet in the entry logs, and "
                f"{held.reason}"
            )
    # Never append behind what was replayed: a torn tail may follow it.
    journal_no_file = None
    try:
        start = journal.start_new_file(after=last)
    except OSError as error:
        # A journal disk too full for a new file: the bookie serves reads,
        # takes no adds and no fences, and the server tries again (a failed
        # try leaves no file behind) until one is made.
        journal_no_file = f"journal has no file: cannot start a new journal file: {error.strerror or error}"
        log.error("%s; the bookie is read-only until one can be made", journal_no_file)
        start = last
    if held is None:
        held = _checkpoint(core, storage, start, flush_room)
    durable = storage.entry_index.load_mark()
    # Files before the durable mark hold nothing unflushed (before `start`
    # when nothing is held).
    deleted = journal.delete_before(durable)
    report = RecoveryReport(mark, start, records, entries, len(core.ledgers), deleted, durable, held, journal_no_file)
    log.info(
        "recovered storage: mark %s -> %s, replayed %d journal records (%d entries), %d ledgers",
        tuple(mark), tuple(durable), records, entries, len(core.ledgers),
    )
    if held is not None:
        log.warning(
            "%s: %d bytes of replayed entries wait in the write cache, and the journal keeps them",
            held.reason, write_cache.active_bytes + write_cache.flushing_bytes,
        )
    return core, report


def _checkpoint(
    core: BookieCore, storage: LedgerStorage, mark: JournalPosition, flush_room: FlushRoomCheck | None
) -> HeldCheckpoint | None:
    """Write a checkpoint up to `mark` if it fits; otherwise keep it, begun
    and unwritten (its entries stay readable in the write cache)."""
    checkpoint = storage.begin_checkpoint(core.take_dirty_ledger_states(), mark)
    reason = flush_room(checkpoint) if flush_room is not None else ""
    if reason:
        return HeldCheckpoint(checkpoint, FailureKind.NO_SPACE, reason)
    try:
        storage.run_checkpoint(checkpoint)
    except (OSError, IndexWriteError) as error:
        kind = classify_failure(error, index_error=isinstance(error, IndexWriteError))
        log.error("start-up checkpoint failed (%s): %s", kind.value, error)
        return HeldCheckpoint(checkpoint, kind, describe_failure(kind, error))
    storage.end_checkpoint()
    return None

