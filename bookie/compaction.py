"""Compaction of one entry log: copy the entries the index still points at
into the log being written, a stretch at a time, point the index at the
copies (synced), and only then remove the old log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet

from bookie.ledger_storage import LedgerStorage


class CompactionAborted(Exception):
    """The log cannot be compacted safely (a damaged record hides part of
    it); it stays as it is, every read of it answering as before."""


@dataclass
class EntryLogCompaction:
    """Each call runs on a worker thread while no checkpoint runs (the
    driver holds the checkpoint lock for one call and lets checkpoints in
    between). What the index points at is all that is copied: entries of
    dropped ledgers and copies that a rewrite superseded stay behind. A
    crash at any point leaves a consistent state: before a stretch's commit
    the index points at the old copies, after it at the new ones, and the
    old log goes last; compacting it again copies nothing and removes it."""

    storage: LedgerStorage
    log_id: int
    stretch_bytes: int
    offset: int = 0
    scanned_to_end: bool = False
    entries_moved: int = 0
    bytes_moved: int = 0
    scanned_bytes: dict[int, int] = field(default_factory=dict)  # intact record bytes seen, per ledger

    def __post_init__(self) -> None:
        assert self.log_id != self.storage.entry_log.writing_log_id(), "the log being written is never compacted"
        assert self.log_id in self.storage.log_usage, f"entry log {self.log_id} has no recorded usage"

    def step(self) -> bool:
        """Copy the live entries of the next stretch; True once the whole
        log has been read."""
        self.move(self.scan_next())
        return self.scanned_to_end

    def scan_next(self) -> dict[int, dict[int, bytes]]:
        """Read the next stretch; return its live entries, {ledger: {entry:
        data}}, for `move` (the driver checks the disk has room for them in
        between). Dropping the compaction after this is safe: a later one
        starts over and copies only what the index still points at here."""
        assert not self.scanned_to_end
        scan = self.storage.entry_log.scan(self.log_id, self.offset, self.stretch_bytes)
        index = self.storage.entry_index
        live: dict[int, dict[int, bytes]] = {}
        for ledger_id, entry_id, location, data in scan.records:
            self.scanned_bytes[ledger_id] = self.scanned_bytes.get(ledger_id, 0) + location.size
            if index.get(ledger_id, entry_id) == location:
                live.setdefault(ledger_id, {})[entry_id] = data
        self.offset = scan.next_offset
        self.scanned_to_end = scan.end
        return live

    def move(self, live: dict[int, dict[int, bytes]]) -> None:
        """Copy what `scan_next` found live into the log being written."""
        if live:
            moved = self.storage.move_entries(live)
            self.entries_moved += len(moved)
            self.bytes_moved += sum(location[4] for location in moved)

    def finish(self, live_ledgers: AbstractSet[int]) -> int:
        """Remove the old log once every live ledger's records in it were
        read (so every entry of it that the index pointed at was copied);
        return the bytes its file held. The log's usage counts each ledger's
        committed bytes, and committed records precede anything a failed
        write left behind, so a scan that stopped at damage before the end
        of a live ledger's records shows up here as too few bytes."""
        assert self.scanned_to_end, "finish() before the whole log was read"
        usage = self.storage.log_usage[self.log_id]
        unread = {
            ledger_id: (self.scanned_bytes.get(ledger_id, 0), size)
            for ledger_id, size in usage.ledger_bytes.items()
            if ledger_id in live_ledgers and self.scanned_bytes.get(ledger_id, 0) < size
        }
        if unread:
            raise CompactionAborted(
                f"entry log {self.log_id} is damaged: of live ledgers' bytes, only (read, recorded) {unread} could be read; "
                "it is kept as it is"
            )
        return self.storage.delete_entry_log(self.log_id)
