"""A partition's chain of ledgers (Pulsar's managed ledger) as a pure state
machine: opening (the record read or created, the previous owner's last
ledger recovered, a new ledger started and recorded by compare-and-set),
offsets handed to appends in order, rollover, trimming by retention, the
graceful close, and fencing on any failure; and where an offset or a
position lives in the chain.

The trio driver (broker/managed_ledger.py) and the simulator carry out its
commands (read and write the record, create, recover, close and delete
ledgers) and tell it how each went; appends go to the open ledger through
the driver, which reports each entry persisted or failed. It does no I/O
and reads no clock: `now_ms` (wall-clock milliseconds) comes in with the
events that need it.

Rules:
- the record changes only by compare-and-set, so that two owners can never
  both extend the chain;
- opening recovers (fences) the last ledger if it is open, so that a
  previous owner can never append again; a ledger created but not recorded
  (a lost compare-and-set) is nobody's and is deleted;
- appends take offsets in order and never wait inside the core: while the
  chain is changing (rollover, trimming, closing) the core refuses them
  with `busy` and the driver waits for the next `Writable`;
- any failure to write (a ledger fenced by another owner, a lost
  compare-and-set, bookies gone) fences the managed ledger: it takes no more
  appends, and the partition is loaded afresh (by this broker or another).
  Nothing is ever guessed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from broker.entry_cache import Position
from broker.errors import TopicFencedError
from broker.ledger_list import OPEN_LEDGER_INDEX_POINTS_MAX, OpenLedgerIndex, OpenLedgerState, ledger_index_of, rollover_reason, stored_bytes, trimmable_count
from broker.topic_records import LedgerInfo, ManagedLedgerRecord, TopicPolicies


class State(enum.Enum):
    NEW = "new"
    READING_RECORD = "reading the record"
    CREATING_RECORD = "creating the record"
    RECOVERING = "recovering the last ledger"
    CREATING_LEDGER = "creating a ledger"
    RECORDING_LEDGER = "recording a new ledger"
    WRITABLE = "writable"
    CLOSING_LEDGER = "closing a full ledger"
    TRIMMING = "trimming"
    CLOSING = "closing"
    RECORDING_CLOSE = "recording the close"
    CLOSED = "closed"
    FENCED = "fenced"


# Which event each state takes (anything else is a driver bug: it raises).
_TRANSITIONS: dict[tuple[State, str], tuple[State, ...]] = {
    (State.NEW, "open"): (State.READING_RECORD,),
    (State.READING_RECORD, "record_read"): (State.CREATING_RECORD, State.RECOVERING, State.CREATING_LEDGER),
    (State.CREATING_RECORD, "record_read"): (State.RECOVERING, State.CREATING_LEDGER),
    (State.RECOVERING, "ledger_recovered"): (State.CREATING_LEDGER,),
    (State.CREATING_LEDGER, "ledger_created"): (State.RECORDING_LEDGER,),
    (State.RECORDING_LEDGER, "record_written"): (State.WRITABLE, State.CLOSING),
    (State.WRITABLE, "rollover"): (State.CLOSING_LEDGER,),
    (State.WRITABLE, "trim"): (State.TRIMMING,),
    (State.WRITABLE, "close"): (State.CLOSING,),
    (State.CLOSING_LEDGER, "ledger_closed"): (State.CREATING_LEDGER,),
    (State.TRIMMING, "record_written"): (State.WRITABLE, State.CLOSING),
    (State.CLOSING, "ledger_closed"): (State.RECORDING_CLOSE,),
    (State.RECORDING_CLOSE, "record_written"): (State.CLOSED,),
}


# --- commands --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadRecord:
    """Read the record (None if there is none): answer `record_read`."""


@dataclass(frozen=True, slots=True)
class CreateRecord:
    """Create an empty record: answer `record_read` with it and its version."""


@dataclass(frozen=True, slots=True)
class RecoverLedger:
    """Open the ledger with recovery (fencing its writer) and read its last
    entry's header: answer `ledger_recovered`."""

    ledger_id: int


@dataclass(frozen=True, slots=True)
class CreateLedger:
    """Create a ledger with the policies' ensemble and quorums: answer `ledger_created`."""

    policies: TopicPolicies


@dataclass(frozen=True, slots=True)
class WriteRecord:
    """Compare-and-set the record: answer `record_written` or `record_write_failed`."""

    record: ManagedLedgerRecord
    expected_version: int


@dataclass(frozen=True, slots=True)
class CloseLedger:
    """Close the open ledger once its pending adds are done: answer
    `ledger_closed` (its last entry is the last one persisted)."""

    ledger_id: int


@dataclass(frozen=True, slots=True)
class DeleteLedgers:
    """Delete these ledgers, best effort: `orphans` were never recorded
    (nobody needs them); the others left the chain by retention."""

    ledger_ids: tuple[int, ...]
    orphans: bool = False


@dataclass(frozen=True, slots=True)
class Writable:
    """Appends go to `ledger_id` now: after opening, a rollover
    (`new_ledger`) or a trim."""

    ledger_id: int
    new_ledger: bool = True


@dataclass(frozen=True, slots=True)
class Fenced:
    """The managed ledger takes no more appends: unload the partition."""

    error: TopicFencedError


@dataclass(frozen=True, slots=True)
class ClosedDone:
    """The graceful close is over (recorded, or given up: the next owner recovers)."""

    recorded: bool


Command = Union[ReadRecord, CreateRecord, RecoverLedger, CreateLedger, WriteRecord, CloseLedger, DeleteLedgers, Writable,
                Fenced, ClosedDone]


@dataclass(frozen=True, slots=True)
class AppendSlot:
    """Where the next entry goes: its ledger, its first offset, and the
    append time to put in it (it never goes back, so that seeking by time
    can bisect)."""

    ledger_id: int
    first_offset: int
    publish_ms: int


class ManagedLedgerCore:
    def __init__(self, partition: str, policies: TopicPolicies, *, open_index_points_max: int = OPEN_LEDGER_INDEX_POINTS_MAX) -> None:
        self.partition = partition
        self.policies = policies  # the driver replaces it when the topic's policies change
        self.state = State.NEW
        self.record = ManagedLedgerRecord()
        self.version = -1
        self.next_offset = 0  # offset of the next message appended
        self.confirmed_offset = -1  # last offset of the last entry persisted
        self.fenced: TopicFencedError | None = None
        self.open_state = OpenLedgerState(0, 0, 0, 0.0, None)
        self.open_index_points_max = open_index_points_max
        self.open_index = OpenLedgerIndex(open_index_points_max)  # where the open ledger's persisted messages are
        self._last_publish_ms = 0
        self._pending_record: ManagedLedgerRecord | None = None
        self._close_requested = False
        self._trimmed: tuple[int, ...] = ()

    # --- the state table --------------------------------------------------------------------

    def _step(self, event: str, to: State) -> None:
        allowed = _TRANSITIONS.get((self.state, event))
        if allowed is None or to not in allowed:
            raise AssertionError(f"managed ledger {self.partition}: {event} in state {self.state.value} (to {to.value})")
        self.state = to

    # FENCED (any failure) and CLOSED (a close given up, or nothing to close)
    # are reachable from every state, outside the table: `_fence`, `fail`
    # and `close` set them.

    def _fence(self, reason: str) -> list[Command]:
        if self.state is State.FENCED:
            return []
        self.state = State.FENCED
        self.fenced = TopicFencedError(f"partition {self.partition}: {reason}")
        return [Fenced(self.fenced)]

    def _over(self) -> bool:
        """Fenced or closed: a late answer to a command changes nothing."""
        return self.state in (State.FENCED, State.CLOSED)

    def fail(self, reason: str) -> list[Command]:
        """A command failed in a way that only a fresh load can settle
        (recovery, creating a ledger, an add): fence. During a graceful
        close, the close is given up instead (the next owner recovers)."""
        if self.state in (State.CLOSING, State.RECORDING_CLOSE):
            self.state = State.CLOSED
            return [ClosedDone(False)]
        if self.state is State.CLOSED:
            return []
        return self._fence(reason)

    # --- opening ------------------------------------------------------------------------------

    def open(self) -> list[Command]:
        self._step("open", State.READING_RECORD)
        return [ReadRecord()]

    def record_read(self, found: tuple[ManagedLedgerRecord, int] | None) -> list[Command]:
        if self._over():
            return []
        if found is None:
            self._step("record_read", State.CREATING_RECORD)
            return [CreateRecord()]
        self.record, self.version = found
        ledgers = self.record.ledgers
        if ledgers and not ledgers[-1].is_closed:
            self._step("record_read", State.RECOVERING)
            return [RecoverLedger(ledgers[-1].ledger_id)]
        self.next_offset = ledgers[-1].last_offset + 1 if ledgers else 0
        self.confirmed_offset = self.next_offset - 1
        self._step("record_read", State.CREATING_LEDGER)
        return [CreateLedger(self.policies)]

    def ledger_recovered(self, ledger_id: int, entries: int, length: int, last_offset: int | None,
                         last_publish_ms: int | None, now_ms: int) -> list[Command]:
        """The previous owner's open ledger is fenced and closed with
        `entries` entries of `length` bytes; `last_offset` and
        `last_publish_ms` are its last entry's (None when it is empty)."""
        if self._over():
            return []
        info = self.record.ledgers[-1]
        assert info.ledger_id == ledger_id, f"recovered ledger {ledger_id}, the chain ends with {info.ledger_id}"
        messages = 0 if last_offset is None else last_offset + 1 - info.first_offset
        if last_publish_ms is not None:
            # Append times keep growing across owners (seeking by time bisects).
            self._last_publish_ms = max(self._last_publish_ms, last_publish_ms)
        self.record = ManagedLedgerRecord(self.record.ledgers[:-1] + (info.closed(entries, messages, length, now_ms),))
        self.next_offset = info.first_offset + messages
        self.confirmed_offset = self.next_offset - 1
        self._step("ledger_recovered", State.CREATING_LEDGER)
        return [CreateLedger(self.policies)]

    def ledger_created(self, ledger_id: int, now_ms: int) -> list[Command]:
        """A new ledger exists: record it at the end of the chain."""
        if self._over():
            return [DeleteLedgers((ledger_id,), orphans=True)]  # nobody will record it
        self._pending_record = ManagedLedgerRecord(self.record.ledgers + (LedgerInfo(ledger_id, self.next_offset, now_ms),))
        self._step("ledger_created", State.RECORDING_LEDGER)
        return [WriteRecord(self._pending_record, self.version)]

    def record_written(self, version: int, now_ms: int) -> list[Command]:
        if self._over():
            return []
        assert self._pending_record is not None, "a record written that was not being written"
        self.record, self._pending_record, self.version = self._pending_record, None, version
        if self.state is State.RECORDING_LEDGER:
            self.open_state = OpenLedgerState(0, 0, 0, float(now_ms), None)
            self.open_index = OpenLedgerIndex(self.open_index_points_max)
            return self._writable("record_written")
        if self.state is State.TRIMMING:
            # Appends go on first; the ledgers left out are deleted after.
            trimmed, self._trimmed = self._trimmed, ()
            return self._writable("record_written", new_ledger=False) + [DeleteLedgers(trimmed)]
        self._step("record_written", State.CLOSED)
        return [ClosedDone(True)]

    def record_write_failed(self, conflict: bool, reason: str) -> list[Command]:
        """A compare-and-set failed; `conflict`: certainly not written (the
        version moved: another broker changed the record)."""
        if self._over():
            return []
        pending, self._pending_record = self._pending_record, None
        assert pending is not None, "a record write failed that was not being written"
        commands: list[Command] = []
        if self.state is State.RECORDING_LEDGER and conflict:
            # The new ledger is nobody's. After any other failure the write
            # may have landed, and the ledger is kept.
            commands.append(DeleteLedgers((pending.ledgers[-1].ledger_id,), orphans=True))
        return commands + self.fail(f"writing its ledgers failed: {reason}")

    def _writable(self, event: str, *, new_ledger: bool = True) -> list[Command]:
        if self._close_requested:
            self._step(event, State.CLOSING)
            return [CloseLedger(self.current_ledger_id)]
        self._step(event, State.WRITABLE)
        return [Writable(self.current_ledger_id, new_ledger)]

    # --- appending ----------------------------------------------------------------------------

    @property
    def current_ledger_id(self) -> int:
        return self.record.ledgers[-1].ledger_id

    @property
    def busy(self) -> bool:
        """Appends wait (the chain is opening or changing)."""
        return self.fenced is None and self.state not in (State.WRITABLE, State.CLOSED) and not self._closing

    @property
    def closed_requested(self) -> bool:
        """A graceful close was asked for (it may be under way or done)."""
        return self._closing

    @property
    def _closing(self) -> bool:
        return self._close_requested or self.state in (State.CLOSING, State.RECORDING_CLOSE, State.CLOSED)

    def check_writable(self) -> None:
        """Raises TopicFencedError when the managed ledger takes no more appends."""
        if self.fenced is not None:
            raise self.fenced
        if self._closing:
            raise TopicFencedError(f"partition {self.partition} is closed")

    def next_append(self, now_ms: int) -> AppendSlot | None:
        """Where an entry appended now would go (None: busy, wait for
        `Writable`); nothing changes until `appended`. Raises
        TopicFencedError when it takes no more appends."""
        self.check_writable()
        if self.state is not State.WRITABLE:
            return None
        return AppendSlot(self.current_ledger_id, self.next_offset, max(self._last_publish_ms, now_ms))

    def appended(self, slot: AppendSlot, message_count: int) -> None:
        """The entry of `slot` went to the ledger (with no event in between)."""
        assert self.state is State.WRITABLE and slot.first_offset == self.next_offset, "an append out of order"
        self.next_offset += message_count
        self._last_publish_ms = slot.publish_ms

    def add_persisted(self, ledger_id: int, first_offset: int, message_count: int, entry_bytes: int, now_ms: int) -> bool:
        """An entry is durable (in append order). True when the open ledger
        is full and should roll over now."""
        if self._over():
            return False
        assert ledger_id == self.current_ledger_id, f"entry of ledger {ledger_id} persisted, the open one is {self.current_ledger_id}"
        state = self.open_state
        self.open_state = OpenLedgerState(state.entries + 1, state.messages + message_count, state.bytes + entry_bytes,
                                          state.created_ms, float(now_ms))
        self.open_index.append(first_offset)
        self.confirmed_offset = first_offset + message_count - 1
        return self.state is State.WRITABLE and rollover_reason(self.open_state, self.policies, now_ms) is not None

    def add_failed(self, ledger_id: int, reason: str) -> list[Command]:
        return self.fail(f"ledger {ledger_id} failed: {reason}")

    # --- rolling over, trimming, closing ------------------------------------------------------

    def rollover_reason(self, now_ms: int) -> str | None:
        if self.state is not State.WRITABLE or self._close_requested:
            return None
        return rollover_reason(self.open_state, self.policies, now_ms)

    def rollover(self, now_ms: int) -> list[Command]:
        """Close the open ledger and start another, if it is due."""
        if self.rollover_reason(now_ms) is None:
            return []
        self._step("rollover", State.CLOSING_LEDGER)
        return [CloseLedger(self.current_ledger_id)]

    def ledger_closed(self, now_ms: int) -> list[Command]:
        """The open ledger is closed (every pending add done)."""
        if self._over():
            return []
        state = self.open_state
        info = self.record.ledgers[-1]
        closed = info.closed(state.entries, state.messages, state.bytes, now_ms)
        if self.state is State.CLOSING_LEDGER:
            self.record = ManagedLedgerRecord(self.record.ledgers[:-1] + (closed,))
            # Its bytes are the closed ledger's now: counted once.
            self.open_state = OpenLedgerState(0, 0, 0, float(now_ms), None)
            self._step("ledger_closed", State.CREATING_LEDGER)
            return [CreateLedger(self.policies)]
        self._pending_record = ManagedLedgerRecord(self.record.ledgers[:-1] + (closed,))
        self._step("ledger_closed", State.RECORDING_CLOSE)
        return [WriteRecord(self._pending_record, self.version)]

    def trim(self, held_from_offset: int | None, now_ms: int) -> list[Command]:
        """Drop the ledgers at the head of the chain that retention and
        important subscriptions let go (the record first, then the ledgers)."""
        if self.state is not State.WRITABLE or self._close_requested:
            return []
        ledgers = self.record.ledgers
        count = trimmable_count(ledgers, self.policies, now_ms, held_from_offset, self.open_state.bytes)
        if count == 0:
            return []
        self._trimmed = tuple(info.ledger_id for info in ledgers[:count])
        self._pending_record = ManagedLedgerRecord(ledgers[count:])
        self._step("trim", State.TRIMMING)
        return [WriteRecord(self._pending_record, self.version)]

    def close(self) -> list[Command]:
        """Unload gracefully: close the open ledger and record it closed, so
        that the next owner has nothing to recover (after whatever change
        of the chain is under way)."""
        if self._closing or self.fenced is not None:
            if self.state is State.FENCED:
                return [ClosedDone(False)]
            return []
        if self.state is State.WRITABLE:
            self._step("close", State.CLOSING)
            return [CloseLedger(self.current_ledger_id)]
        if self.state in (State.NEW, State.READING_RECORD, State.CREATING_RECORD, State.RECOVERING):
            self.state = State.CLOSED  # nothing of ours to close
            return [ClosedDone(False)]
        self._close_requested = True  # at the next Writable
        return []

    # --- what it holds ------------------------------------------------------------------------

    @property
    def first_offset(self) -> int:
        """The lowest offset still stored."""
        return self.record.ledgers[0].first_offset if self.record.ledgers else self.next_offset

    @property
    def stored_bytes(self) -> int:
        return stored_bytes(self.record.ledgers, self.open_state.bytes)

    def bytes_from(self, offset: int) -> int:
        """The bytes of the ledgers that hold `offset` or anything after it
        (whole ledgers: a closed one's size is all the record knows); 0 when
        nothing is stored at or after it."""
        if offset >= self.next_offset:
            return 0
        return sum(info.bytes or 0 for info in self.record.ledgers if info.is_closed and info.last_offset >= offset) \
            + self.open_state.bytes

    def bytes_after(self, offset: int) -> int:
        """About the bytes of the messages from `offset` on: whole ledgers
        after it, and of the ledger holding it the share of its messages
        from `offset` on (the compaction threshold's measure)."""
        if offset >= self.next_offset:
            return 0
        total = 0
        for info in self.record.ledgers:
            if info.is_closed:
                messages, size, last = info.messages or 0, info.bytes or 0, info.last_offset
            else:
                messages, size = self.open_state.messages, self.open_state.bytes
                last = info.first_offset + messages - 1
            if messages == 0 or last < offset:
                continue
            share = min(messages, last - offset + 1)
            total += size if share == messages else size * share // messages
        return total

    @property
    def has_open_ledger(self) -> bool:
        return bool(self.record.ledgers) and not self.record.ledgers[-1].is_closed

    def first_position(self) -> Position | None:
        for info in self.record.ledgers:
            if not info.is_closed or info.entries:
                return Position(info.ledger_id, 0)
        return None

    def end_position(self) -> Position:
        """Where the next entry appended will be."""
        return Position(self.current_ledger_id, self.open_state.entries if self.has_open_ledger else self.record.ledgers[-1].entries)

    def readable_position(self, position: Position) -> Position:
        """Where a reader at `position` should read: past the end of a
        closed ledger is the start of the next one; a ledger no longer in
        the chain (retention deleted it) gives the first entry stored."""
        ledgers = self.record.ledgers
        for index, info in enumerate(ledgers):
            if info.ledger_id != position.ledger_id:
                continue
            if not info.is_closed or position.entry_id < info.entries:
                return position
            for later in ledgers[index + 1:]:
                if not later.is_closed or later.entries:
                    return Position(later.ledger_id, 0)
            return position  # the end of the last, closed ledger (the partition is closing)
        first = self.first_position()
        return first if first is not None else self.end_position()

    def ledger_info(self, ledger_id: int) -> LedgerInfo | None:
        for info in self.record.ledgers:
            if info.ledger_id == ledger_id:
                return info
        return None

    def last_entry_id(self, info: LedgerInfo) -> int:
        if info.is_closed:
            return info.entries - 1
        assert info.ledger_id == self.current_ledger_id, f"ledger {info.ledger_id} is open but not the last of the chain"
        return self.open_state.entries - 1

    def has_entry(self, position: Position) -> bool:
        info = self.ledger_info(position.ledger_id)
        return info is not None and 0 <= position.entry_id <= self.last_entry_id(info)

    def mean_entry_bytes(self, info: LedgerInfo) -> int | None:
        if info.is_closed:
            entries, stored = info.entries, info.bytes
        elif info.ledger_id == self.current_ledger_id:
            entries, stored = self.open_state.entries, self.open_state.bytes
        else:
            return None
        return stored // entries if entries and stored else None

    def entries_holding(self, offset: int) -> tuple[int, int, int] | Position | None:
        """Where message `offset` is: None when it is not written yet; the
        first position stored when it was trimmed away; else (ledger id,
        first entry id, last entry id), the entries one of which holds it
        (to bisect by reading their headers)."""
        if offset > self.confirmed_offset:
            return None
        ledgers = self.record.ledgers
        index = ledger_index_of(ledgers, offset)
        if index is None:
            return self.first_position()
        info = ledgers[index]
        if info.is_closed:
            return info.ledger_id, 0, info.entries - 1
        first_entry_id, last_entry_id = self.open_index.entry_range(offset)
        return info.ledger_id, first_entry_id, last_entry_id


__all__ = [
    "AppendSlot", "ClosedDone", "CloseLedger", "Command", "CreateLedger", "CreateRecord", "DeleteLedgers", "Fenced",
    "ManagedLedgerCore", "ReadRecord", "RecoverLedger", "State", "Writable", "WriteRecord",
]
