"""A deterministic world for topic compaction: the real `CompactionCore`
driven as `broker/compaction.py` drives it, over the in-memory metadata
store (its compare-and-set) and simulated ledgers, with a partition of
seeded keyed messages, tombstones and keyless messages. A run can stop dead
at any step (a broker crash: nothing more happens, nothing is cleaned up),
or have any step fail (a bookie error, a record write refused, or one whose
outcome is not known), and two compactions can race (two brokers that both
believe they own the partition). The checks say what must hold whatever
happened: the record names a complete view of the latest value of each key
up to its horizon (the previous one or the new one, never a mix), and once a
compaction finishes, no ledger is left behind but the one in use.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from broker.compaction_core import (
    CloseLedger,
    CompactedEntry,
    CompactionCore,
    CompactionRecord,
    Copy,
    CreateLedger,
    DeleteLedgers,
    Finished,
    Phase,
    Scan,
    Switched,
    WriteRecord,
)
from coordination.memory_store import InMemoryMetadataServer
from coordination.store import BadVersionError, NodeExistsError, NoNodeError

RECORD_PATH = "/managed-ledgers/partition/compaction"
SESSION_TIMEOUT_MS = 10_000


class StepFailed(Exception):
    """A step failed as the world was told to make it fail."""


@dataclass
class SimLedger:
    entries: list[bytes] = field(default_factory=list)
    closed: bool = False
    deleted: bool = False


@dataclass(frozen=True)
class Message:
    offset: int
    key: str | None
    null_value: bool
    value: int


@dataclass(frozen=True)
class Fault:
    """What happens at step `step` of a compaction: "crash" (it stops
    there), "fail" (the step raises), "refuse" (a record write is refused
    for a version) or "unknown" (a record write is applied, or not, and the
    answer lost)."""

    step: int
    kind: str


class CompactionWorld:
    def __init__(self, seed: int, *, keys: int = 6, messages: int = 40) -> None:
        self.rng = random.Random(seed)
        self.server = InMemoryMetadataServer()
        self.store = self.server.connect(SESSION_TIMEOUT_MS)
        self.ledgers: dict[int, SimLedger] = {}
        self._next_ledger_id = 1
        self.keys = keys
        # The partition: entries of one to four messages.
        self.entries: list[list[Message]] = []
        self.publish(messages)
        # Ledgers a crash left between their creation and the record naming
        # them (the one window where a compaction can leave a ledger behind).
        self.unrecorded: set[int] = set()

    # --- the partition ------------------------------------------------------------------

    @property
    def next_offset(self) -> int:
        return self.entries[-1][-1].offset + 1 if self.entries else 0

    def publish(self, count: int) -> None:
        offset = self.next_offset
        while count > 0:
            size = min(count, self.rng.randint(1, 4))
            batch = []
            for _ in range(size):
                roll = self.rng.random()
                key = None if roll < 0.1 else f"k{self.rng.randrange(self.keys)}"
                batch.append(Message(offset, key, key is not None and roll > 0.85, self.rng.randrange(1_000)))
                offset += 1
            self.entries.append(batch)
            count -= size

    def expected_view(self, horizon: int) -> dict[str, int]:
        """Key -> offset of its latest message up to `horizon` (a null value deletes the key)."""
        latest: dict[str, int] = {}
        for batch in self.entries:
            for message in batch:
                if message.offset > horizon or message.key is None:
                    continue
                if message.null_value:
                    latest.pop(message.key, None)
                else:
                    latest[message.key] = message.offset
        return latest

    # --- the record and the ledgers ------------------------------------------------------

    def read_record(self) -> tuple[CompactionRecord, int] | None:
        try:
            data, stat = self.store.get(RECORD_PATH)
        except NoNodeError:
            return None
        return CompactionRecord.from_dict(json.loads(data)), stat.version

    def _write_record(self, record: CompactionRecord, expected_version: int | None) -> int:
        data = json.dumps(record.to_dict()).encode()
        if expected_version is None:
            self.store.create(RECORD_PATH, data, make_parents=True)
            return 0
        return self.store.set(RECORD_PATH, data, expected_version).version

    def view(self) -> dict[str, int] | None:
        """The view the record names, key -> offset (None: no view)."""
        found = self.read_record()
        if found is None or found[0].ledger_id is None:
            return None
        ledger = self.ledgers[found[0].ledger_id]
        assert ledger.closed and not ledger.deleted, f"the record names ledger {found[0].ledger_id}, which is not whole"
        view: dict[str, int] = {}
        for data in ledger.entries:
            entry = CompactedEntry.from_bytes(data)
            messages = json.loads(entry.data)
            for index in entry.retained:
                key, offset = messages[index][0], entry.first_offset + index
                assert key not in view, f"key {key} twice in the view"
                view[key] = offset
        return view

    def live_ledgers(self) -> set[int]:
        return {ledger_id for ledger_id, ledger in self.ledgers.items() if not ledger.deleted}

    # --- a compaction ----------------------------------------------------------------------

    def compaction(self, name: str = "broker") -> "SimCompaction":
        found = self.read_record()
        record, version = found if found is not None else (None, None)
        return SimCompaction(self, name, CompactionCore("partition", record, version, self.next_offset - 1, now_ms=0))


class SimCompaction:
    """One compaction's steps, carried out one at a time."""

    def __init__(self, world: CompactionWorld, name: str, core: CompactionCore) -> None:
        self.world = world
        self.name = name
        self.core = core
        self.pending: list = list(core.start())
        self.steps = 0
        self.error: str | None = None
        self.finished = False
        self.switched: CompactionRecord | None = None
        self._writer: int | None = None
        self._copy: list[CompactedEntry] | None = None  # phase two's entries still to add

    def run(self, fault: Fault | None = None) -> bool:
        """Steps until it finishes (True) or the fault's crash stops it (False)."""
        while not self.finished:
            if not self.step(fault):
                return False
        return True

    def step(self, fault: Fault | None = None) -> bool:
        """One step; False when the fault's crash stops the compaction here."""
        assert not self.finished
        self.steps += 1
        kind = fault.kind if fault is not None and fault.step == self.steps else None
        if kind == "crash":
            if self.core.phase is Phase.CLAIMING and self._writer is not None:
                self.world.unrecorded.add(self._writer)
            self.finished = True
            return False
        if self._copy is not None:
            self._add_one(kind)
            return True
        command = self.pending.pop(0)
        if isinstance(command, Finished):
            self.finished, self.error = True, command.error
            return True
        try:
            self.pending.extend(self._carry_out(command, kind))
        except BadVersionError as error:
            self.pending = list(self.core.failed(str(error), record_refused=True))
        except StepFailed as error:
            self.pending = list(self.core.failed(str(error)))
        return True

    def _carry_out(self, command, kind: str | None) -> list:
        world, core = self.world, self.core
        if isinstance(command, WriteRecord):
            if kind == "refuse":
                raise BadVersionError("another writer's version")
            if kind == "unknown":
                if world.rng.random() < 0.5:
                    world._write_record(command.record, command.expected_version)
                raise StepFailed("the record write's answer was lost")
            try:
                version = world._write_record(command.record, command.expected_version)
            except NodeExistsError as error:
                raise BadVersionError(str(error)) from None
            return core.record_written(version)
        if kind in ("fail", "refuse", "unknown"):
            raise StepFailed(f"{type(command).__name__} failed")
        if isinstance(command, DeleteLedgers):
            for ledger_id in command.ledger_ids:
                if ledger_id in world.ledgers:
                    world.ledgers[ledger_id].deleted = True
            return core.deleted() if core.phase in (Phase.CLEANING, Phase.RETIRING) else []
        if isinstance(command, Scan):
            for first_offset, _, messages, retained in self._sources(command.view_ledger_id, command.from_offset,
                                                                     command.through_offset):
                for index in retained:
                    key, null_value = messages[index][0], messages[index][1]
                    core.scan.message(first_offset + index, key, null_value)
            return core.scanned()
        if isinstance(command, CreateLedger):
            ledger_id = world._next_ledger_id
            world._next_ledger_id += 1
            world.ledgers[ledger_id] = SimLedger()
            self._writer = ledger_id
            return core.created(ledger_id)
        if isinstance(command, Copy):
            self._copy = []
            for first_offset, count, messages, _ in self._sources(command.view_ledger_id, command.from_offset,
                                                                  command.through_offset):
                kept = core.keep(first_offset, count)
                if kept:
                    self._copy.append(CompactedEntry(0, first_offset, first_offset, count, kept,
                                                     json.dumps(messages).encode()))
            return []
        if isinstance(command, CloseLedger):
            world.ledgers[command.ledger_id].closed = True
            return core.closed()
        assert isinstance(command, Switched), f"unknown command {command!r}"
        self.switched = command.record
        return []

    def _add_one(self, kind: str | None) -> None:
        """Phase two, one add at a time (a crash can stop it between two)."""
        assert self._copy is not None and self._writer is not None
        if not self._copy:
            self._copy = None
            self.pending.extend(self.core.copied())
            return
        if kind in ("fail", "refuse", "unknown"):
            self._copy = None
            self.pending = list(self.core.failed("an add failed"))
            return
        entry = self._copy.pop(0)
        packed = entry.to_bytes()
        self.world.ledgers[self._writer].entries.append(packed)
        self.core.copied_entry(entry, len(packed))

    def _sources(self, view_ledger_id: int | None, from_offset: int, through_offset: int):
        """(first offset, message count, [key, null value] per message,
        indexes to look at) of the previous view, then of the partition."""
        world = self.world
        if view_ledger_id is not None:
            ledger = world.ledgers[view_ledger_id]
            if ledger.deleted:  # another compaction switched it out (BookKeeper: no such ledger)
                raise StepFailed(f"{self.name} reads view ledger {view_ledger_id}, deleted")
            for data in ledger.entries:
                entry = CompactedEntry.from_bytes(data)
                yield entry.first_offset, entry.message_count, json.loads(entry.data), entry.retained
        for batch in world.entries:
            first = batch[0].offset
            indexes = tuple(index for index, message in enumerate(batch) if from_offset <= message.offset <= through_offset)
            if indexes:
                yield first, len(batch), [[message.key, message.null_value] for message in batch], indexes


def check_view(world: CompactionWorld) -> None:
    """The record names a whole view, of exactly the latest value of each
    key up to its horizon."""
    found = world.read_record()
    if found is None or found[0].ledger_id is None:
        return
    record = found[0]
    view = world.view()
    assert view == world.expected_view(record.horizon), (
        f"the view at horizon {record.horizon} holds {view}, not {world.expected_view(record.horizon)}")
    assert record.messages == len(view)


def check_nothing_left(world: CompactionWorld) -> None:
    """After a compaction that finished: only the view's ledger is left, and
    the ledgers a crash left unrecorded."""
    found = world.read_record()
    assert found is not None
    record = found[0]
    assert record.writing is None, f"the record still names a ledger being written: {record}"
    assert not set(record.garbage) & world.live_ledgers(), f"garbage not deleted: {record}"
    left = world.live_ledgers() - {record.ledger_id} - world.unrecorded
    assert not left, f"ledgers left behind: {sorted(left)} (record {record})"


__all__ = ["CompactionWorld", "Fault", "SimCompaction", "check_nothing_left", "check_view"]
