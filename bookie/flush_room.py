"""Whether a checkpoint's flush fits on the ledger disk above the reserve it
must leave, what a failed flush means, and how long to wait before the next
try. Pure: the trio driver and start-up recovery measure and act.
"""

# A flush writes entry log records and grows the RocksDB index. It may use the
# ledger disk's free space down to a reserve, never below: the reserve keeps
# room for the index (its memtables become SST files at RocksDB's next flush;
# RocksDB refuses every write after one that found the disk full, until it is
# reopened) and, when the journal shares the file system, for the journal,
# which must always be able to record fences and the adds it already took. A
# flush that does not fit is held whole (the journal mark does not move) and
# tried again with backoff, for as long as it takes.

from __future__ import annotations

import enum
import errno
import random
from dataclasses import dataclass

from bookie.entry_log import RECORD_OVERHEAD

MIB = 1024 * 1024
# Index growth per entry flushed: its RocksDB WAL record (about 40 bytes,
# measured), the SST record its memtable later becomes, and a compaction's
# copy of that while the old one still exists.
INDEX_BYTES_PER_ENTRY = 128
# Each entry log a flush writes to: its header and a partly used last block.
LOG_FILE_SLACK_BYTES = 8 * 1024
# Kept free on the ledger disk whatever the flush: RocksDB's MANIFEST, LOG and
# OPTIONS files roll over, and the file system needs blocks of its own.
LEDGER_DISK_MARGIN_BYTES = 2 * MIB
# The write cache's flush trigger is never shrunk below this.
FLUSH_TRIGGER_BYTES_MIN = 64 * 1024
RETRY_DELAY_S_MIN = 0.1
RETRY_DELAY_S_MAX = 5.0  # a flush held for room, or refused for it by the disk
IO_ERROR_RETRY_DELAY_S_MAX = 60.0  # after any other I/O error: the disk may be failing
RETRY_JITTER_RATIO = 0.2
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def journal_reserve_bytes(preallocate_bytes: int, group_bytes: int) -> int:
    """What the journal keeps free on a disk it shares with the ledger
    directory: two preallocation chunks (it writes zeros a chunk ahead, and
    a new file after a roll or a restart starts with one) and a group-commit
    batch of records (fences, and adds taken before the bookie turned
    read-only). Adds still queued for the journal are counted on top, as
    they are when the flush is checked."""
    return 2 * preallocate_bytes + group_bytes


@dataclass(frozen=True, slots=True)
class DiskRoom:
    """The ledger disk just before a flush."""

    free_bytes: int  # for an unprivileged writer (statvfs f_bavail)
    memtable_bytes: int  # index data in RocksDB memtables, not yet in SST files
    journal_shares_disk: bool
    journal_queued_bytes: int = 0  # records the journal took and has not yet synced


@dataclass(frozen=True, slots=True)
class Reserve:
    """What a flush leaves free on the ledger disk (see the module docstring)."""

    journal_bytes: int
    ledger_bytes: int = LEDGER_DISK_MARGIN_BYTES

    def kept_bytes(self, room: DiskRoom) -> int:
        kept = self.ledger_bytes + room.memtable_bytes
        if room.journal_shares_disk:
            kept += self.journal_bytes + room.journal_queued_bytes
        return kept


def flush_bytes(entries: int, data_bytes: int, log_bytes_max: int) -> int:
    """Disk space a flush of `entries` entries holding `data_bytes` bytes
    takes at most: their entry log records, the slack of every log file
    they may go to, and the index's growth."""
    record_bytes = data_bytes + entries * RECORD_OVERHEAD
    log_files = record_bytes // log_bytes_max + 2  # the one being written, and each started
    return record_bytes + log_files * LOG_FILE_SLACK_BYTES + entries * INDEX_BYTES_PER_ENTRY


@dataclass(frozen=True, slots=True)
class FlushVerdict:
    fits: bool
    needed_bytes: int
    free_bytes: int
    kept_bytes: int  # the reserve the flush must leave free
    reason: str  # why the flush is held; "" when it fits

    @property
    def room_after_bytes(self) -> int:
        """Free space above the reserve once the flush is written (negative: it does not fit)."""
        return self.free_bytes - self.kept_bytes - self.needed_bytes


def check_flush(needed_bytes: int, room: DiskRoom, reserve: Reserve) -> FlushVerdict:
    """Whether a flush of `needed_bytes` (see `flush_bytes`) fits above the reserve."""
    kept = reserve.kept_bytes(room)
    fits = needed_bytes <= room.free_bytes - kept
    reason = "" if fits else (
        f"checkpoint held: {_mib(needed_bytes)} to flush, {_mib(room.free_bytes)} free on the ledger disk, "
        f"{_mib(kept)} of it kept for the " + ("journal and the index" if room.journal_shares_disk else "index")
    )
    return FlushVerdict(fits, needed_bytes, room.free_bytes, kept, reason)


def flush_trigger_bytes(half_bytes: int, room_after_bytes: int) -> int:
    """The write cache's active half is flushed once it holds this much: half
    the cache, shrunk on a nearly full disk to half the room a flush may still
    use, so that the next flush fits in it. (A bookie turns read-only before
    its disk is full; the entries it holds then must still fit.)"""
    return max(FLUSH_TRIGGER_BYTES_MIN, min(half_bytes, room_after_bytes // 2))


class FailureKind(enum.Enum):
    NO_SPACE = "no_space"  # the disk refused for room: held, retried, cleared once it succeeds
    IO_ERROR = "io_error"  # any other I/O error: read-only until restarted, still retried
    INDEX = "index"  # the index refused a write: RocksDB takes none until reopened


def classify_failure(error: BaseException, *, index_error: bool) -> FailureKind:
    """What a failed checkpoint write means. `index_error`: the error came
    from the index (RocksDB), not from the entry log files."""
    if index_error:
        return FailureKind.INDEX
    if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:
        return FailureKind.NO_SPACE
    return FailureKind.IO_ERROR


def describe_failure(kind: FailureKind, error: BaseException) -> str:
    """The read-only reason a failed checkpoint write gives."""
    text = getattr(error, "strerror", None) or str(error)
    if kind is FailureKind.NO_SPACE:
        return f"checkpoint held: the ledger disk refused the flush ({text}); retrying"
    if kind is FailureKind.INDEX:
        return f"index failed: {text}; read-only until restarted"
    return f"checkpoint failed: {text}; read-only until restarted"


class RetryBackoff:
    """Delays between tries of a held or failed checkpoint: doubling from
    `RETRY_DELAY_S_MIN` up to a maximum (longer after an I/O error than when
    only room is short), with jitter; no bound on the number of tries, since
    the entries wait in the journal for as long as it takes. `reset()` after
    a success. Randomness comes in as a `random.Random`."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._delay_s = RETRY_DELAY_S_MIN

    def next_delay_s(self, kind: FailureKind = FailureKind.NO_SPACE) -> float:
        delay_max_s = IO_ERROR_RETRY_DELAY_S_MAX if kind is FailureKind.IO_ERROR else RETRY_DELAY_S_MAX
        delay_s = min(self._delay_s, delay_max_s)
        self._delay_s = min(2 * delay_s, delay_max_s)
        jitter = self._rng.uniform(1 - RETRY_JITTER_RATIO, 1 + RETRY_JITTER_RATIO)
        return min(delay_s * jitter, delay_max_s)

    def reset(self) -> None:
        self._delay_s = RETRY_DELAY_S_MIN


def _mib(size_bytes: int) -> str:
    return f"{size_bytes / MIB:.1f} MiB"
