"""The life of one partition on its broker, pure: the order of its load,
its deduplication snapshots while it serves, and the order of its unload.

A load: open the managed ledger (which fences the previous owner's last
ledger), read the deduplication snapshot, replay every entry stored after
the position it covers, write the snapshot of what this owner starts from
(when the partition holds an entry), read the durable cursors and write
each of them once, then serve. Those writes move the versions on, so that
a write the previous owner still has in flight can no longer land; and
nothing is dispatched or taken before them.

While it serves, deduplication snapshots are written one at a time, the
newest due one next.

An unload: graceful, the managed ledger is closed (the appends taken
finish), the subscriptions finish (the acknowledgements taken are made
durable and answered), then the final snapshot is written (after the one in
flight, if any); fenced, nothing more is written: the subscriptions finish
without writing. An unload that takes too long stops waiting.

The trio broker (broker/topic.py) and the simulator (sim/broker_partition.py)
carry out its commands and report how each went. It holds the partition's
`PublishCore` and reads its `ManagedLedgerCore`; it does no I/O.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any, Callable, TypeVar, Union

from broker.dedup import DedupSnapshot
from broker.entry_cache import Position
from broker.managed_ledger_core import ManagedLedgerCore
from broker.publish_core import PublishCore

REPLAY_ENTRIES_PER_READ = 1_000  # entries read at a time while rebuilding the deduplication map
UNLOAD_WRITES_MS = 10_000.0  # an unload's writes (ledger close, cursors, snapshot) are waited for at most this long


class Phase(enum.Enum):
    NEW = "new"
    OPENING = "opening the managed ledger"
    READING_SNAPSHOT = "reading the deduplication snapshot"
    REPLAYING = "replaying the entries after the snapshot"
    WRITING_SNAPSHOT = "writing the snapshot it starts from"
    READING_CURSORS = "reading the cursors"
    WRITING_CURSORS = "writing the cursors"
    SERVING = "serving"
    CLOSING_LEDGER = "closing the managed ledger"
    FINISHING = "finishing the subscriptions"
    FINAL_SNAPSHOT = "writing the final snapshot"
    STOPPED = "stopped"
    FAILED = "failed"


# --- commands --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenLedger:
    """Open the managed ledger; then `ledger_opened` (or `failed`)."""


@dataclass(frozen=True, slots=True)
class ReadSnapshot:
    """Read the stored deduplication snapshot; then `snapshot_read`."""


@dataclass(frozen=True, slots=True)
class ReadEntries:
    """Read up to `count` entries from `position` on (the producer and last
    sequence id of each); then `entries_read`."""

    position: Position
    count: int


@dataclass(frozen=True, slots=True)
class WriteSnapshot:
    """Write `snapshot` (by compare-and-set on the publish core's
    `snapshot_version`); then `snapshot_written` or `snapshot_failed`."""

    snapshot: DedupSnapshot


@dataclass(frozen=True, slots=True)
class ReadCursors:
    """Read the durable cursors and make their subscriptions (an unreadable
    one is left alone); then `cursors_read` with their names."""


@dataclass(frozen=True, slots=True)
class WriteCursor:
    """Write this subscription's cursor once; then `cursor_written`."""

    name: str


@dataclass(frozen=True, slots=True)
class Serve:
    """Loaded: start the subscriptions and take requests."""


@dataclass(frozen=True, slots=True)
class LoadFailed:
    """The load failed: the partition is given up."""

    reason: str


@dataclass(frozen=True, slots=True)
class Fence:
    """Something failed while serving that only a fresh load can settle."""

    reason: str


@dataclass(frozen=True, slots=True)
class CloseLedger:
    """Close the managed ledger gracefully; then `ledger_closed`."""


@dataclass(frozen=True, slots=True)
class FinishSubscriptions:
    """Finish every subscription: with `write`, the acknowledgements taken
    are made durable and answered; without, they are answered with an
    error. Then `subscriptions_finished`."""

    write: bool


@dataclass(frozen=True, slots=True)
class Stopped:
    """The unload is done. `graceful`: the ledger was closed and the
    acknowledgements taken were written (a final snapshot that failed costs
    the next owner only a longer replay)."""

    graceful: bool


Command = Union[OpenLedger, ReadSnapshot, ReadEntries, WriteSnapshot, ReadCursors, WriteCursor, Serve, LoadFailed, Fence,
                CloseLedger, FinishSubscriptions, Stopped]

_LOADING = (Phase.OPENING, Phase.READING_SNAPSHOT, Phase.REPLAYING, Phase.WRITING_SNAPSHOT, Phase.READING_CURSORS,
            Phase.WRITING_CURSORS)
_UNLOADING = (Phase.CLOSING_LEDGER, Phase.FINISHING, Phase.FINAL_SNAPSHOT)
_OVER = (*_UNLOADING, Phase.STOPPED, Phase.FAILED)  # a load's late answers change nothing here

P = Phase
# Which phases each event may leave the partition in, from each phase it is
# taken in (anything else is a driver bug: it raises). A pair in `_LATE`
# is a step of a load that was stopped meanwhile: ignored.
_TRANSITIONS: dict[tuple[Phase, str], tuple[Phase, ...]] = {
    (P.NEW, "load"): (P.OPENING,),
    (P.OPENING, "ledger_opened"): (P.READING_SNAPSHOT,),
    (P.READING_SNAPSHOT, "snapshot_read"): (P.REPLAYING, P.WRITING_SNAPSHOT, P.READING_CURSORS),
    (P.REPLAYING, "entries_read"): (P.REPLAYING, P.WRITING_SNAPSHOT, P.READING_CURSORS, P.FAILED),
    (P.WRITING_SNAPSHOT, "snapshot_written"): (P.WRITING_SNAPSHOT, P.READING_CURSORS),
    (P.WRITING_SNAPSHOT, "snapshot_failed"): (P.FAILED,),
    (P.READING_CURSORS, "cursors_read"): (P.WRITING_CURSORS, P.SERVING),
    (P.WRITING_CURSORS, "cursor_written"): (P.WRITING_CURSORS, P.SERVING),
    **{(phase, "failed"): (P.FAILED,) for phase in (P.NEW, *_LOADING)},
    **{(phase, "unload"): (P.FINISHING,) for phase in (P.NEW, *_LOADING)},
    (P.SERVING, "unload"): (P.CLOSING_LEDGER, P.FINISHING),
    **{(phase, event): (phase,) for phase in (P.SERVING, *_OVER)
       for event in ("failed", "snapshot_written", "snapshot_failed")},
    **{(phase, "unload"): (phase,) for phase in _OVER},
    **{(phase, "persisted"): (phase,) for phase in Phase},
    (P.CLOSING_LEDGER, "ledger_closed"): (P.FINISHING,),
    (P.FINISHING, "subscriptions_finished"): (P.FINAL_SNAPSHOT, P.STOPPED),
    (P.FINAL_SNAPSHOT, "snapshot_written"): (P.FINAL_SNAPSHOT, P.STOPPED),
    (P.FINAL_SNAPSHOT, "snapshot_failed"): (P.STOPPED,),
    **{(phase, "timed_out"): (P.STOPPED,) for phase in Phase},
    **{(phase, "fence"): (phase,) for phase in Phase},
}
_LATE = {
    *((phase, event) for phase in _OVER
      for event in ("ledger_opened", "snapshot_read", "entries_read", "cursors_read", "cursor_written")),
    (P.STOPPED, "ledger_closed"), (P.STOPPED, "subscriptions_finished"),
}


Event = TypeVar("Event", bound=Callable[..., Any])


def _event(method: Event) -> Event:
    """An event of the core, checked against `_TRANSITIONS`."""
    name = method.__name__

    @functools.wraps(method)
    def take(self: "PartitionCore", *args: Any, **kwargs: Any) -> Any:
        before = self.phase
        if (before, name) in _LATE:
            return []
        allowed = _TRANSITIONS.get((before, name))
        if allowed is None:
            raise AssertionError(f"partition {self.name}: {name} while {before.value}")
        commands = method(self, *args, **kwargs)
        assert self.phase in allowed, f"partition {self.name}: {name} took it from {before.value} to {self.phase.value}"
        return commands

    return take  # type: ignore[return-value]


class PartitionCore:
    def __init__(self, name: str, publishing: PublishCore, ledger: ManagedLedgerCore, *,
                 replay_entries_per_read: int = REPLAY_ENTRIES_PER_READ) -> None:
        self.name = name
        self.publishing = publishing
        self.ledger = ledger
        self.replay_entries_per_read = replay_entries_per_read
        self.phase = Phase.NEW
        self.graceful = True
        self.fenced: str | None = None  # why it fenced itself
        self.snapshot_covered: tuple[int, int] | None = None  # (ledger id, entry id) the stored snapshot covers
        self._last_replayed: Position | None = None  # the last entry the deduplication map knows of
        self._cursors_to_write: list[str] = []
        self._snapshot_in_flight: DedupSnapshot | None = None

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVING

    @property
    def loading(self) -> bool:
        return self.phase in _LOADING

    @property
    def unloading(self) -> bool:
        return self.phase in _UNLOADING

    # --- loading ----------------------------------------------------------------------------

    @_event
    def load(self) -> list[Command]:
        self.phase = Phase.OPENING
        return [OpenLedger()]

    @_event
    def ledger_opened(self) -> list[Command]:
        self.phase = Phase.READING_SNAPSHOT
        return [ReadSnapshot()]

    @_event
    def snapshot_read(self, stored: tuple[dict, int] | None) -> list[Command]:
        """The stored snapshot (record, version) or None. Replay starts right
        after the entry it covers, or at the first entry stored when that
        entry is no longer in the chain (or there is no snapshot)."""
        covered = self.snapshot_covered = self.publishing.restore(stored)
        ledger = self.ledger
        if covered is not None and ledger.has_entry(Position(*covered)):
            self._last_replayed = Position(*covered)
            start = ledger.readable_position(Position(covered[0], covered[1] + 1))
        else:
            start = ledger.first_position() or ledger.end_position()
        self.phase = Phase.REPLAYING
        return self._replay_from(start)

    def _replay_from(self, position: Position) -> list[Command]:
        if self.ledger.has_entry(position):
            return [ReadEntries(position, self.replay_entries_per_read)]
        last = self._last_replayed
        snapshot = self.publishing.loaded(None if last is None else (last.ledger_id, last.entry_id))
        self.phase = Phase.WRITING_SNAPSHOT
        if snapshot is None:
            return self._read_cursors()
        self._snapshot_in_flight = snapshot
        return [WriteSnapshot(snapshot)]

    @_event
    def entries_read(self, entries: list[tuple[Position, str, int | None]]) -> list[Command]:
        """Entries read in order from the position asked for: (position,
        producer id, last sequence id) of each; the sequence id is None for
        a chunk other than its message's last, which deduplication does not
        count (the message is persisted with its last chunk)."""
        if not entries:
            return self.failed("the replay read no entry where the managed ledger has one")
        for position, producer_id, last_sequence_id in entries:
            if last_sequence_id is not None:
                self.publishing.replayed(producer_id, last_sequence_id)
            self._last_replayed = position
        last = self._last_replayed
        assert last is not None
        return self._replay_from(self.ledger.readable_position(Position(last.ledger_id, last.entry_id + 1)))

    def _read_cursors(self) -> list[Command]:
        self.phase = Phase.READING_CURSORS
        return [ReadCursors()]

    @_event
    def cursors_read(self, names: list[str]) -> list[Command]:
        self.phase = Phase.WRITING_CURSORS
        self._cursors_to_write = sorted(names)
        return self._next_cursor()

    def _next_cursor(self) -> list[Command]:
        if self._cursors_to_write:
            return [WriteCursor(self._cursors_to_write[0])]
        self.phase = Phase.SERVING
        return [Serve()]

    @_event
    def cursor_written(self, name: str) -> list[Command]:
        assert self._cursors_to_write and self._cursors_to_write[0] == name, f"cursor {name} written out of turn"
        self._cursors_to_write.pop(0)
        return self._next_cursor()

    @_event
    def failed(self, reason: str) -> list[Command]:
        """A step of the load failed (or a write while serving): the load
        fails; a partition serving is fenced; an unload goes on."""
        if self.loading or self.phase is Phase.NEW:
            self.phase = Phase.FAILED
            return [LoadFailed(reason)]
        if self.phase is Phase.SERVING:
            return [Fence(reason)]
        return []

    # --- deduplication snapshots ------------------------------------------------------------

    @_event
    def persisted(self) -> list[Command]:
        """An entry was persisted and the publish core says a snapshot is
        due: the next one to write, unless one is in flight (it is written
        when that one is done)."""
        if self.phase is not Phase.SERVING or self._snapshot_in_flight is not None:
            return []
        return self._write(self.publishing.next_snapshot())

    def _write(self, snapshot: DedupSnapshot | None) -> list[Command]:
        if snapshot is None:
            return []
        self._snapshot_in_flight = snapshot
        return [WriteSnapshot(snapshot)]

    @_event
    def snapshot_written(self, snapshot: DedupSnapshot, version: int) -> list[Command]:
        assert self._snapshot_in_flight is snapshot, "a snapshot written that was not being written"
        self._snapshot_in_flight = None
        following = self.publishing.snapshot_written(snapshot, version)
        if following is not None:
            if self.phase is Phase.STOPPED or (self.unloading and not self.graceful):
                self.publishing.snapshot_failed(following)  # not written: nothing more is, after a fence
                return []
            self._snapshot_in_flight = following
            return [WriteSnapshot(following)]
        if self.phase is Phase.WRITING_SNAPSHOT:
            return self._read_cursors()
        if self.phase is Phase.FINAL_SNAPSHOT:
            return self._final_snapshot()
        return []

    @_event
    def snapshot_failed(self, snapshot: DedupSnapshot, reason: str) -> list[Command]:
        """A snapshot write failed: its version may have moved under another
        owner. Loading fails, serving is fenced; the final one only costs
        the next owner a longer replay."""
        assert self._snapshot_in_flight is snapshot, "a snapshot failed that was not being written"
        self._snapshot_in_flight = None
        self.publishing.snapshot_failed(snapshot)
        if self.phase is Phase.FINAL_SNAPSHOT:
            return self._stop()
        return self.failed(f"deduplication snapshot write failed: {reason}")

    # --- unloading --------------------------------------------------------------------------

    @_event
    def fence(self, reason: str) -> bool:
        """A failure only a fresh load can settle (a write failed, a
        compare-and-set was lost): the publish core takes nothing more.
        True when it is news and the partition is not unloading already:
        the driver asks its broker to unload it, fenced; such an unload
        writes nothing more."""
        if self.fenced is not None or self.unloading or self.phase in (Phase.STOPPED, Phase.FAILED):
            return False
        self.fenced = reason
        self.publishing.stop(reason)
        return True

    @_event
    def unload(self, *, graceful: bool) -> list[Command]:
        """Stop serving (or stop a load). The publish core takes no more batches."""
        self.publishing.stop("unloading" if graceful else "fenced")
        if self.phase in (Phase.STOPPED, Phase.FAILED) or self.unloading:
            return []
        graceful = graceful and self.phase is Phase.SERVING and self.fenced is None
        self.graceful = graceful
        if graceful:
            self.phase = Phase.CLOSING_LEDGER
            return [CloseLedger()]
        self.phase = Phase.FINISHING
        return [FinishSubscriptions(write=False)]

    @_event
    def ledger_closed(self) -> list[Command]:
        self.phase = Phase.FINISHING
        return [FinishSubscriptions(write=True)]

    @_event
    def subscriptions_finished(self) -> list[Command]:
        if not self.graceful:
            return self._stop()
        self.phase = Phase.FINAL_SNAPSHOT
        return self._final_snapshot()

    def _final_snapshot(self) -> list[Command]:
        if self._snapshot_in_flight is not None:
            return []  # after that one
        commands = self._write(self.publishing.final_snapshot())
        return commands or self._stop()

    @_event
    def timed_out(self) -> list[Command]:
        """The unload's writes took too long: stop waiting for them."""
        if self.phase is Phase.STOPPED:
            return []
        self.graceful = False
        return [FinishSubscriptions(write=False), *self._stop()]

    def _stop(self) -> list[Command]:
        self.phase = Phase.STOPPED
        return [Stopped(self.graceful)]


__all__ = [
    "REPLAY_ENTRIES_PER_READ", "CloseLedger", "Command", "Fence", "FinishSubscriptions", "LoadFailed", "OpenLedger",
    "PartitionCore", "Phase", "ReadCursors", "ReadEntries", "ReadSnapshot", "Serve", "Stopped", "WriteCursor",
    "WriteSnapshot",
]
