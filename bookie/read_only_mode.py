"""Why a bookie takes no adds: each cause with its reason, and which changes
are worth a log line. Pure: the trio driver feeds causes in, then logs,
re-registers and publishes what comes out.
"""

# A bookie is read-only while any cause holds. Some clear by themselves (the
# journal had no room for a new file or to grow, the disk is past its
# threshold, a checkpoint is held for room); others hold until the bookie is
# restarted (the journal, the index or the entry log files failed with a real
# I/O error).

from __future__ import annotations

import enum
from dataclasses import dataclass


class Cause(enum.Enum):
    # In the order reasons are shown: what needs an operator first.
    JOURNAL_FAILED = "journal_failed"
    INDEX_FAILED = "index_failed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    # The journal's disk had no room for a new file (at start-up) or to
    # grow one (preallocation, a roll): nothing was written and nothing
    # failed, so a new file made later clears it.
    JOURNAL_NO_FILE = "journal_no_file"
    CHECKPOINT_HELD = "checkpoint_held"
    DISK_FULL = "disk_full"  # past the usage threshold or the byte quota (bookie.disk_usage)


# Causes that only a restart clears: after a failed fsync the page cache no
# longer says what is on disk, and RocksDB takes no write after a failed one.
UNTIL_RESTARTED = frozenset({Cause.JOURNAL_FAILED, Cause.INDEX_FAILED, Cause.CHECKPOINT_FAILED})


@dataclass(frozen=True, slots=True)
class ModeChange:
    """The set of causes changed. A new reason text for a cause that already
    held is no change: it is published (`bookie info`), not logged, so that
    a disk that fills by the percent does not log at every check."""

    was_read_only: bool
    read_only: bool
    added: frozenset[Cause]
    removed: frozenset[Cause]
    reason: str  # every reason now ("" when writable)

    @property
    def turned(self) -> bool:
        """The bookie turned read-only or writable (registration follows)."""
        return self.was_read_only != self.read_only

    def describe(self) -> str:
        """One log line."""
        if not self.read_only:
            return f"bookie turns writable ({_names(self.removed)} cleared)"
        if not self.was_read_only:
            return f"bookie turns read-only: {self.reason}"
        if self.removed:
            return f"bookie stays read-only ({_names(self.removed)} cleared): {self.reason}"
        return f"bookie stays read-only, now also for {_names(self.added)}: {self.reason}"


def _names(causes: frozenset[Cause]) -> str:
    return ", ".join(cause.value for cause in Cause if cause in causes)


class ReadOnlyMode:
    def __init__(self) -> None:
        self._reasons: dict[Cause, str] = {}

    @property
    def read_only(self) -> bool:
        return bool(self._reasons)

    @property
    def causes(self) -> frozenset[Cause]:
        return frozenset(self._reasons)

    @property
    def reason(self) -> str:
        """Every reason, most serious first, for `bookie info`."""
        return "; ".join(self._reasons[cause] for cause in Cause if cause in self._reasons)

    def reason_of(self, cause: Cause) -> str:
        return self._reasons.get(cause, "")

    def set(self, cause: Cause, reason: str) -> ModeChange | None:
        """`cause` holds, for `reason` (a non-empty text)."""
        if not reason:
            raise ValueError(f"a read-only cause needs a reason: {cause.name}")
        added = cause not in self._reasons
        if cause in UNTIL_RESTARTED and not added:
            return None  # the first failure is the one worth reporting
        was_read_only = self.read_only
        self._reasons[cause] = reason
        if not added:
            return None
        return ModeChange(was_read_only, True, frozenset({cause}), frozenset(), self.reason)

    def clear(self, cause: Cause) -> ModeChange | None:
        """`cause` no longer holds. A cause that only a restart clears stays."""
        if cause in UNTIL_RESTARTED or cause not in self._reasons:
            return None
        del self._reasons[cause]
        return ModeChange(True, self.read_only, frozenset(), frozenset({cause}), self.reason)
