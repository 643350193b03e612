"""Where a durable cursor's record is written, as Pulsar's managed cursor
keeps it: the acknowledgements' writes are entries of a ledger of the
cursor's own, and ZooKeeper's node for the cursor only says which ledger
(and holds the record as it was when the node was last written).

A ZooKeeper compare-and-set per acknowledgement batch made ZooKeeper's
write rate (a few thousand a second for the whole cluster) the cap on
subscriptions × acknowledgement rate; a ledger entry costs the bookies
instead, which take tens of thousands a second each, and ZooKeeper is
written only when a cursor ledger is made or retired.

Pure: the driver (broker/cursor_ledger.py) carries out each step and
reports back. The rules:

- An acknowledgements' write appends the record to the cursor's ledger.
  With no ledger yet, or a full one (`ledger_entries_max`), it makes a new
  ledger and writes the node (compare-and-set) naming it, with the record
  in the node itself: that write makes the record durable, and the new
  ledger starts empty.
- A write "inline" (at load, at creation, at a graceful unload, when the
  subscription turns important) writes the record into the node and names
  no ledger: a broker that loads the partition next reads the node alone.
- A ledger the node no longer names is listed in the node as retired, and
  deleted once that node is written; a later load deletes the retired ones
  again (a delete of a ledger gone is no error), so a crash between the two
  leaks nothing.
- At load the driver opens the named ledger with recovery: that fences the
  previous owner's appends, as the node's new version fences its
  compare-and-sets; the ledger's last entry, if any, is the record.
"""

from __future__ import annotations

from dataclasses import dataclass

CURSOR_LEDGER_ENTRIES_MAX = 50_000  # Pulsar's metadataMaxEntriesPerLedger; then a new ledger

LEDGER_FIELD = "ledger"
RETIRED_FIELD = "retired"


@dataclass(frozen=True, slots=True)
class Append:
    """Append `record` to the cursor's ledger `ledger_id`; then `appended()`."""

    ledger_id: int
    record: dict


@dataclass(frozen=True, slots=True)
class CreateLedger:
    """Make a new cursor ledger; then `ledger_created(ledger_id)`."""


@dataclass(frozen=True, slots=True)
class WriteNode:
    """Compare-and-set the cursor's node to `record` at `expected_version`
    (None: create it); then `node_written(version)`."""

    record: dict
    expected_version: int | None


@dataclass(frozen=True, slots=True)
class DeleteLedgers:
    """Delete these ledgers (one already gone is no error); then `deleted(ledger_ids)`."""

    ledger_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Written:
    """The record is durable; the node is at `version`."""

    version: int | None


Step = Append | CreateLedger | WriteNode | DeleteLedgers | Written


def stored_placement(node_record: dict) -> tuple[int | None, tuple[int, ...]]:
    """The ledger a stored node names (None: the node holds the record) and
    the ledgers it lists as retired. Raises ValueError when malformed."""
    if type(node_record) is not dict:
        raise ValueError(f"a cursor record is an object, not {node_record!r:.50}")
    ledger_id = node_record.get(LEDGER_FIELD)
    retired = node_record.get(RETIRED_FIELD, [])
    if ledger_id is not None and (type(ledger_id) is not int or ledger_id < 0):
        raise ValueError(f"malformed cursor ledger id {ledger_id!r:.50}")
    if type(retired) is not list or not all(type(value) is int and value >= 0 for value in retired):
        raise ValueError(f"malformed retired cursor ledgers {retired!r:.100}")
    return ledger_id, tuple(retired)


class CursorPlacement:
    """One cursor's ledger, node version and retired ledgers; one write at a
    time (the subscription's write lock makes sure of it)."""

    def __init__(self, version: int | None, *, retired: tuple[int, ...] = (),
                 ledger_entries_max: int = CURSOR_LEDGER_ENTRIES_MAX) -> None:
        """`version`: the node's (None: not created yet); `retired`: ledgers
        to delete once the node stops naming them (at load: those it listed,
        and the one it named, recovered by then)."""
        assert ledger_entries_max >= 1
        self.version = version
        self.ledger_id: int | None = None  # the ledger this owner appends to
        self.entries = 0  # ... and the entries it holds
        self.retired: list[int] = list(retired)
        self.ledger_entries_max = ledger_entries_max
        self._record: dict | None = None  # the write in flight
        self._new_ledger: int | None = None

    @property
    def writing(self) -> bool:
        return self._record is not None

    def start(self, record: dict, *, inline: bool) -> Step:
        assert self._record is None, "a cursor write started while another is in flight"
        self._record = record
        if inline:
            if self.ledger_id is not None:
                self.retired.append(self.ledger_id)
                self.ledger_id, self.entries = None, 0
            return WriteNode(self._node_record(record, None), self.version)
        if self.ledger_id is not None and self.entries < self.ledger_entries_max:
            return Append(self.ledger_id, record)
        return CreateLedger()

    def ledger_created(self, ledger_id: int) -> Step:
        assert self._record is not None and self._new_ledger is None
        self._new_ledger = ledger_id
        return WriteNode(self._node_record(self._record, ledger_id), self.version)

    def appended(self) -> Step:
        assert self._record is not None and self.ledger_id is not None
        self.entries += 1
        self._record = None
        return Written(self.version)

    def node_written(self, version: int) -> Step:
        assert self._record is not None
        self.version = version
        if self._new_ledger is not None:
            if self.ledger_id is not None:
                self.retired.append(self.ledger_id)
            self.ledger_id, self.entries, self._new_ledger = self._new_ledger, 0, None
        self._record = None
        if self.retired:
            return DeleteLedgers(tuple(self.retired))
        return Written(self.version)

    def deleted(self, ledger_ids: tuple[int, ...]) -> Step:
        """Those are gone (or failed to go and are kept for the next try)."""
        self.retired = [ledger_id for ledger_id in self.retired if ledger_id not in ledger_ids]
        return Written(self.version)

    def failed(self) -> int | None:
        """The write in flight failed (the driver fences the partition).
        Returns a ledger made for it that nothing names, to delete."""
        self._record = None
        orphan, self._new_ledger = self._new_ledger, None
        return orphan

    def owned_ledgers(self) -> tuple[int, ...]:
        """Every ledger of this cursor's (deleting the subscription deletes them)."""
        current = () if self.ledger_id is None else (self.ledger_id,)
        return current + tuple(self.retired)

    def _node_record(self, record: dict, ledger_id: int | None) -> dict:
        node = dict(record)
        if ledger_id is not None:
            node[LEDGER_FIELD] = ledger_id
        pending = self.retired + ([self.ledger_id] if ledger_id is not None and self.ledger_id is not None else [])
        if pending:
            node[RETIRED_FIELD] = pending
        return node


__all__ = [
    "Append",
    "CURSOR_LEDGER_ENTRIES_MAX",
    "CreateLedger",
    "CursorPlacement",
    "DeleteLedgers",
    "LEDGER_FIELD",
    "RETIRED_FIELD",
    "Step",
    "WriteNode",
    "Written",
    "stored_placement",
]
