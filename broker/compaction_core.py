"""Topic compaction's rules (Pulsar's two-phase compactor), without I/O:
which messages a compacted view keeps, how a compacted ledger's entries are
laid out, and the order of the steps that write a new compacted ledger and
switch it in with one compare-and-set, so that a compaction stopped at any
step leaves the previous view or the new one, never a mix, and the next
compaction deletes whatever ledger the stopped one left behind.

A compaction claims the record (names its new ledger as being written)
before it deletes what earlier compactions left: once its claim is written,
no compaction that read the record before can switch its own ledger in (its
compare-and-set fails), so what the claim names as garbage is nobody's.

A partition's compacted view holds, of the messages up to its horizon, the
latest of each key; a key whose latest message is a null value (Pulsar's
`null_value`, or an empty payload) is left out, and so are messages without
a key. Each compacted entry is an original entry with the batch indexes it
keeps, so a consumer reading the view receives the original message ids and
offsets. A compaction reads the previous view and the messages after its
horizon (phase one: the latest offset of each key), then copies the entries
holding those offsets into a new ledger (phase two).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from framing.codec import describe

COMPACTION_KEYS_MAX = 1_000_000  # distinct keys a compaction holds in memory (phase one's map)
CHUNKED_PENDING_MAX = 1_000  # chunked messages whose chunks a scan is gathering at once (the oldest is left out past it)
# A chunked message still being written when a compaction starts, begun at
# most this many offsets before its end, moves the horizon back before it
# (its last chunk comes after); one begun longer ago is taken as abandoned.
STRADDLING_CHUNKS_OFFSETS_MAX = 10_000
COMPACTED_ENTRY_FORMAT = 1


class CompactionError(Exception):
    """A compaction cannot go on (too many keys, an entry that does not decode)."""


@dataclass(frozen=True)
class CompactionRecord:
    """What the metadata store holds of a partition's compaction (one node,
    written by compare-and-set)."""

    ledger_id: int | None = None  # the compacted ledger in use (None: never compacted)
    horizon: int = -1  # the view covers every offset up to this one
    entries: int = 0  # in the compacted ledger
    messages: int = 0  # messages the view keeps (one per key)
    bytes: int = 0  # of the compacted ledger's entries
    compacted_ms: int = 0
    # The ledger a compaction is writing (not in use yet), and ledgers no
    # longer in use (views switched out, writes abandoned): the next
    # compaction deletes them, whatever stopped this one.
    writing: int | None = None
    garbage: tuple[int, ...] = ()

    @property
    def leftovers(self) -> tuple[int, ...]:
        return self.garbage + (() if self.writing is None else (self.writing,))

    @property
    def ledger_ids(self) -> list[int]:
        """Every ledger the record names (a partition's deletion deletes them)."""
        return ([] if self.ledger_id is None else [self.ledger_id]) + list(self.leftovers)

    def to_dict(self) -> dict[str, Any]:
        return {"ledger_id": self.ledger_id, "horizon": self.horizon, "entries": self.entries, "messages": self.messages,
                "bytes": self.bytes, "compacted_ms": self.compacted_ms, "writing": self.writing, "garbage": list(self.garbage)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "CompactionRecord":
        garbage = values.get("garbage", [])
        if not isinstance(garbage, list) or not all(type(ledger_id) is int for ledger_id in garbage):
            raise ValueError(f"compaction record: garbage must be a list of ledger ids, got {describe(garbage)}")
        record = cls(**{name: values[name] for name in cls().to_dict() if name in values and name != "garbage"},
                     garbage=tuple(garbage))
        for name, value in record.to_dict().items():
            if name != "garbage" and value is not None and type(value) is not int:
                raise ValueError(f"compaction record: {name} must be an integer, got {describe(value)}")
        return record


@dataclass(frozen=True, slots=True)
class CompactedEntry:
    """One entry of a compacted ledger: an original entry, and the batch
    indexes of the messages the view keeps of it."""

    ledger_id: int
    entry_id: int
    first_offset: int
    message_count: int
    retained: tuple[int, ...]  # batch indexes, rising
    data: bytes  # the original entry, as stored

    @property
    def last_offset(self) -> int:
        return self.first_offset + self.message_count - 1

    @property
    def retained_offsets(self) -> list[int]:
        return [self.first_offset + index for index in self.retained]

    def to_bytes(self) -> bytes:
        return msgpack.packb([COMPACTED_ENTRY_FORMAT, self.ledger_id, self.entry_id, self.first_offset, self.message_count,
                              list(self.retained), self.data], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "CompactedEntry":
        try:
            version, ledger_id, entry_id, first_offset, message_count, retained, original = msgpack.unpackb(data, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as error:
            raise CompactionError(f"a compacted entry does not decode: {error}") from None
        if version != COMPACTED_ENTRY_FORMAT or type(original) is not bytes or not all(
                type(value) is int for value in (ledger_id, entry_id, first_offset, message_count)):
            raise CompactionError(f"a compacted entry of an unknown format ({describe(version)})")
        if not retained or not all(type(index) is int and 0 <= index < message_count for index in retained):
            raise CompactionError("a compacted entry names batch indexes outside its entry")
        return cls(ledger_id, entry_id, first_offset, message_count, tuple(retained), original)


class KeyScan:
    """Phase one: the latest offset of each key, messages given in offset
    order. A null value deletes its key. A chunked message is its chunks'
    offsets together, kept or left out whole."""

    def __init__(self, keys_max: int = COMPACTION_KEYS_MAX, chunked_pending_max: int = CHUNKED_PENDING_MAX) -> None:
        self.keys_max = keys_max
        self.chunked_pending_max = chunked_pending_max
        self.latest: dict[str, int | tuple[int, ...]] = {}
        self.messages_read = 0
        self.last_offset = -1
        self._chunks: dict[str, list[int]] = {}  # chunked message -> the offsets of its chunks so far (in arrival order)

    def message(self, offset: int, key: str | None, null_value: bool) -> None:
        self._advance(offset)
        self._latest(key, null_value, offset)

    def _advance(self, offset: int) -> None:
        assert offset > self.last_offset, f"messages scanned out of order: {offset} after {self.last_offset}"
        self.last_offset = offset
        self.messages_read += 1

    def _latest(self, key: str | None, null_value: bool, offsets: int | tuple[int, ...]) -> None:
        if key is None:
            return
        if null_value:
            self.latest.pop(key, None)
            return
        if key not in self.latest and len(self.latest) >= self.keys_max:
            raise CompactionError(f"more than {self.keys_max} distinct keys: compaction holds the latest offset of each in memory")
        self.latest[key] = offsets

    def chunk(self, offset: int, uuid: str, chunk_id: int, chunks: int, key: str | None) -> None:
        """A chunk of chunked message `uuid`; with its last, the message
        counts as its key's latest (a message whose chunks do not all come,
        in order, is left out)."""
        self._advance(offset)
        held = self._chunks.get(uuid)
        if chunk_id == 0:
            held = self._chunks[uuid] = [offset]  # from its start (again, if its producer sent it again)
            while len(self._chunks) > self.chunked_pending_max:
                del self._chunks[next(iter(self._chunks))]
        elif held is None or chunk_id > len(held):
            self._chunks.pop(uuid, None)  # a chunk is missing: the message is left out
            return
        elif chunk_id < len(held):
            return  # a copy of a chunk held
        else:
            held.append(offset)
        if chunk_id == chunks - 1:
            del self._chunks[uuid]
            self._latest(key, False, tuple(held))

    def incomplete_from(self) -> int | None:
        """The first offset of the chunked messages whose chunks did not all come (None: none)."""
        return min((held[0] for held in self._chunks.values()), default=None)

    def retained(self) -> frozenset[int]:
        offsets: set[int] = set()
        for value in self.latest.values():
            if type(value) is int:
                offsets.add(value)
            else:
                offsets.update(value)
        return frozenset(offsets)


def retained_indexes(first_offset: int, message_count: int, retained: frozenset[int]) -> tuple[int, ...]:
    """The batch indexes of an entry that the view keeps."""
    return tuple(index for index in range(message_count) if first_offset + index in retained)


# --- the steps ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeleteLedgers:
    ledger_ids: tuple[int, ...]


@dataclass(frozen=True)
class Scan:
    """Phase one over the previous view (its ledger, None: none) and the
    partition's messages from `from_offset` through `through_offset`."""

    view_ledger_id: int | None
    from_offset: int
    through_offset: int


@dataclass(frozen=True)
class CreateLedger:
    pass


@dataclass(frozen=True)
class WriteRecord:
    record: CompactionRecord
    expected_version: int | None  # None: create it


@dataclass(frozen=True)
class Copy:
    """Phase two: the entries holding retained offsets, from the previous
    view then the partition, appended to the new ledger."""

    view_ledger_id: int | None
    from_offset: int
    through_offset: int
    ledger_id: int


@dataclass(frozen=True)
class CloseLedger:
    ledger_id: int


@dataclass(frozen=True)
class Switched:
    """The new view is in use: readers read it from now on."""

    record: CompactionRecord


@dataclass(frozen=True)
class Finished:
    error: str | None  # None: compacted


Command = DeleteLedgers | Scan | CreateLedger | WriteRecord | Copy | CloseLedger | Switched | Finished


class Phase(enum.Enum):
    IDLE = "idle"
    SCANNING = "scanning"
    CREATING = "creating"
    CLAIMING = "claiming"  # recording the new ledger as being written
    CLEANING = "cleaning"  # deleting what earlier compactions left
    COPYING = "copying"
    CLOSING = "closing"
    SWITCHING = "switching"
    RETIRING = "retiring"  # deleting the ledger switched out
    DONE = "done"


# (phase, event) -> the phase it leads to; anything else is a bug.
TRANSITIONS: dict[tuple[Phase, str], Phase] = {
    (Phase.IDLE, "start"): Phase.SCANNING,
    (Phase.SCANNING, "scanned"): Phase.CREATING,
    (Phase.SCANNING, "rescan"): Phase.SCANNING,
    (Phase.CREATING, "created"): Phase.CLAIMING,
    (Phase.CLAIMING, "record_written"): Phase.CLEANING,
    (Phase.CLEANING, "deleted"): Phase.COPYING,
    (Phase.COPYING, "copied"): Phase.CLOSING,
    (Phase.CLOSING, "closed"): Phase.SWITCHING,
    (Phase.SWITCHING, "record_written"): Phase.RETIRING,
    (Phase.RETIRING, "deleted"): Phase.DONE,
}


@dataclass
class CompactionCore:
    """One compaction of one partition, from the record read at its start
    (`record`, None when the partition was never compacted, and its
    version) through `through_offset` (the partition's last confirmed
    offset when it starts)."""

    partition: str
    record: CompactionRecord | None
    version: int | None
    through_offset: int
    now_ms: int
    phase: Phase = Phase.IDLE
    new_ledger_id: int | None = None
    scan: KeyScan = field(default_factory=KeyScan)
    retained: frozenset[int] = frozenset()
    copied_entries: int = 0
    copied_messages: int = 0
    copied_bytes: int = 0
    # Whether the new ledger may be in use: the switch's write was sent
    # (its outcome not known), or it took effect. Then it is never deleted
    # here.
    _switch_sent: bool = False
    _switched: bool = False

    def _step(self, event: str) -> None:
        try:
            self.phase = TRANSITIONS[(self.phase, event)]
        except KeyError:
            raise AssertionError(f"compaction of {self.partition}: {event} while {self.phase.value}") from None

    @property
    def previous(self) -> CompactionRecord:
        return self.record or CompactionRecord()

    def start(self) -> list[Command]:
        self._step("start")
        return [Scan(self.previous.ledger_id, self.previous.horizon + 1, self.through_offset)]

    def deleted(self) -> list[Command]:
        self._step("deleted")
        if self.phase is Phase.DONE:
            return [Finished(None)]
        assert self.new_ledger_id is not None
        return [Copy(self.previous.ledger_id, self.previous.horizon + 1, self.through_offset, self.new_ledger_id)]

    def scanned(self) -> list[Command]:
        incomplete = self.scan.incomplete_from()
        if (incomplete is not None and self.through_offset - incomplete < STRADDLING_CHUNKS_OFFSETS_MAX
                and incomplete > self.previous.horizon + 1):
            # A chunked message is being written across the horizon: the
            # horizon moves back before it, and the scan starts again (its
            # keys must not count what comes after the new horizon).
            self._step("rescan")
            self.through_offset = incomplete - 1
            self.scan = KeyScan(self.scan.keys_max, self.scan.chunked_pending_max)
            return [Scan(self.previous.ledger_id, self.previous.horizon + 1, self.through_offset)]
        self._step("scanned")
        self.retained = self.scan.retained()
        return [CreateLedger()]

    def created(self, ledger_id: int) -> list[Command]:
        self._step("created")
        self.new_ledger_id = ledger_id
        # What earlier compactions left becomes garbage, deleted once this
        # claim is written (and by the next compaction if this one stops).
        claim = replace(self.previous, writing=ledger_id, garbage=self.previous.leftovers)
        return [WriteRecord(claim, self.version)]

    def record_written(self, version: int) -> list[Command]:
        self._step("record_written")
        self.version = version
        assert self.new_ledger_id is not None
        if self.phase is Phase.CLEANING:
            return [DeleteLedgers(self.previous.leftovers)]
        switched = self.switched_record()
        self.record = switched
        self._switched = True
        commands: list[Command] = [Switched(switched)]
        if switched.garbage:
            return commands + [DeleteLedgers(switched.garbage)]
        self._step("deleted")
        return commands + [Finished(None)]

    def keep(self, first_offset: int, message_count: int) -> tuple[int, ...]:
        """Phase two: the batch indexes of an entry the new view keeps."""
        return retained_indexes(first_offset, message_count, self.retained)

    def copied_entry(self, entry: CompactedEntry, size_bytes: int) -> None:
        assert self.phase is Phase.COPYING
        self.copied_entries += 1
        self.copied_messages += len(entry.retained)
        self.copied_bytes += size_bytes

    def copied(self) -> list[Command]:
        if self.copied_messages != len(self.retained):
            # Entries went missing between the phases: never switch in a view
            # that lost a key.
            return self.failed(f"found {self.copied_messages} of the {len(self.retained)} messages phase one kept")
        self._step("copied")
        assert self.new_ledger_id is not None
        return [CloseLedger(self.new_ledger_id)]

    def closed(self) -> list[Command]:
        self._step("closed")
        self._switch_sent = True
        return [WriteRecord(self.switched_record(), self.version)]

    def switched_record(self) -> CompactionRecord:
        return CompactionRecord(
            ledger_id=self.new_ledger_id, horizon=self.through_offset, entries=self.copied_entries,
            messages=self.copied_messages, bytes=self.copied_bytes, compacted_ms=self.now_ms,
            writing=None, garbage=() if self.previous.ledger_id is None else (self.previous.ledger_id,),
        )

    def failed(self, reason: str, *, record_refused: bool = False) -> list[Command]:
        """A step failed. `record_refused`: a record write was refused for
        certain (another writer's version): then the new ledger is surely not
        in use. The new ledger is deleted unless the switch's write may have
        taken effect (the next compaction finds it either in use or
        recorded as written, and deletes it in the second case)."""
        self.phase = Phase.DONE
        if self._switched:
            # Only deleting the ledger switched out failed: the record names
            # it, and the next compaction deletes it.
            return [Finished(None)]
        commands: list[Command] = []
        may_be_in_use = self._switch_sent and not record_refused
        if self.new_ledger_id is not None and not may_be_in_use:
            commands.append(DeleteLedgers((self.new_ledger_id,)))
        return commands + [Finished(f"compaction of {self.partition} failed: {reason}")]


__all__ = [
    "COMPACTION_KEYS_MAX", "CloseLedger", "CompactedEntry", "CompactionCore", "CompactionError", "CompactionRecord", "Copy",
    "CreateLedger", "DeleteLedgers", "Finished", "KeyScan", "Phase", "Scan", "Switched", "WriteRecord", "retained_indexes",
]
