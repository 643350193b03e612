"""The trio driver of a cursor's placement (broker/cursor_ledger_core.py):
appends to the cursor's ledger, makes and retires cursor ledgers, writes
the cursor's ZooKeeper node, and reads a stored cursor back at load
(recovering the ledger its node names, which fences the previous owner).
`CursorWritePacer` bounds the cursor-ledger appends of the whole broker."""

from __future__ import annotations

import json
import logging
from typing import Callable

import trio

from broker.cursor import Cursor
from broker.cursor_ledger_core import (
    Append,
    CreateLedger,
    CursorPlacement,
    LEDGER_FIELD,
    RETIRED_FIELD,
    DeleteLedgers,
    WriteNode,
    Written,
    stored_placement,
)
from broker.topic_records import TopicPolicies
from broker.topic_store import TopicStore, record_bytes
from coordination.store import MetadataError
from ledger_client import BookKeeper, LedgerHandle
from ledger_client.errors import BKError, NoSuchLedgerError

log = logging.getLogger(__name__)

# Cursor-ledger appends a broker makes per second, all cursors together
# (Pulsar bounds each cursor's mark-delete persists; here an acknowledgement
# is answered only once durable, so the bound is the broker's: a cursor's
# acknowledgements arriving while it waits go into its next write).
CURSOR_WRITES_PER_S_DEFAULT = 10_000
ORPHAN_DELETE_S = 5.0  # deleting a ledger nothing names, after a failed write
CREATE_LEDGER_S = 10.0  # making a cursor ledger, not cancellable, takes at most this


class CursorWritePacer:
    """A token bucket over the broker's cursor-ledger appends: at most
    `rate` a second, in bursts of up to `rate / 10`. A write that finds no
    token reserves the next one and sleeps until it is due, so the writers
    waiting are served in turn; each subscription has at most one waiting."""

    def __init__(self, rate: float = CURSOR_WRITES_PER_S_DEFAULT, *, clock: Callable[[], float] = trio.current_time) -> None:
        if rate <= 0:
            raise ValueError(f"cursor writes per second must be positive, got {rate}")
        self.rate = rate
        self.burst = max(1.0, rate / 10)
        self._tokens = self.burst
        self._clock = clock
        self._updated: float | None = None

    def reserve(self, now: float) -> float:
        """Take a token; returns how long to wait until it is due (0: now)."""
        if self._updated is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
        self._updated = now
        self._tokens -= 1
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def take(self) -> None:
        delay = self.reserve(self._clock())
        if delay > 0:
            await trio.sleep(delay)


class CursorLedger:
    """Where one durable cursor is written: carries out its placement's steps."""

    def __init__(
        self,
        bookkeeper: BookKeeper,
        topic_store: TopicStore,
        partition: str,
        subscription: str,
        placement: CursorPlacement,
        *,
        password: bytes,
        policies: Callable[[], TopicPolicies],
        pacer: CursorWritePacer,
    ) -> None:
        self.bookkeeper = bookkeeper
        self.topic_store = topic_store
        self.partition = partition
        self.subscription = subscription
        self.placement = placement
        self.password = password
        self.policies = policies
        self.pacer = pacer
        self.handle: LedgerHandle | None = None  # open on placement.ledger_id
        self._new_handle: LedgerHandle | None = None

    @property
    def ledger_id(self) -> int | None:
        return self.placement.ledger_id

    async def write(self, record: dict, *, inline: bool) -> int:
        """Make `record` durable; returns the node's version. Raises
        MetadataError (NodeExistsError, BadVersionError: another broker
        has the cursor) or BKError."""
        placement = self.placement
        step = placement.start(record, inline=inline)
        try:
            while not isinstance(step, Written):
                step = await self._carry_out(step)
        except BaseException:
            placement.failed()
            # A ledger made for this write that the node does not name (or
            # may not: a compare-and-set whose answer was lost falls back to
            # the record the node holds, which covers everything answered).
            orphan, self._new_handle = self._new_handle, None
            if orphan is not None:
                await self._delete_orphan(orphan.ledger_id)
            raise
        assert step.version is not None, "a cursor write left its node uncreated"
        return step.version

    async def _carry_out(self, step):
        placement = self.placement
        if isinstance(step, Append):
            assert self.handle is not None and self.handle.ledger_id == step.ledger_id
            await self.pacer.take()
            await self.handle.add(record_bytes(step.record))
            return placement.appended()
        if isinstance(step, CreateLedger):
            policies = self.policies()
            # Shielded: a creation cancelled half-way would make a ledger in
            # ZooKeeper that nothing here knows of, to delete.
            with trio.CancelScope(shield=True), trio.move_on_after(CREATE_LEDGER_S):
                self._new_handle = await self.bookkeeper.create_ledger(
                    policies.ensemble_size, policies.write_quorum, policies.ack_quorum, password=self.password,
                    custom_metadata={"partition": self.partition.encode(), "cursor": self.subscription.encode()},
                )
            if self._new_handle is None:
                raise MetadataError(f"making a ledger for cursor {self.subscription} of {self.partition} took over "
                                    f"{CREATE_LEDGER_S:g} s")
            await trio.lowlevel.checkpoint_if_cancelled()  # (cancelled meanwhile: the ledger is deleted as an orphan)
            return placement.ledger_created(self._new_handle.ledger_id)
        if isinstance(step, WriteNode):
            version = await self.topic_store.write_cursor(self.partition, self.subscription, step.record, step.expected_version)
            named = step.record.get(LEDGER_FIELD)
            if named is not None:
                assert self._new_handle is not None and self._new_handle.ledger_id == named
                self.handle, self._new_handle = self._new_handle, None
            elif self.handle is not None:
                self.handle = None  # retired: the node holds the record
            return placement.node_written(version)
        if isinstance(step, DeleteLedgers):
            return placement.deleted(await self.delete_ledgers(step.ledger_ids))
        raise AssertionError(f"unknown cursor step {step!r}")

    async def delete_ledgers(self, ledger_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Delete ledgers (one already gone counts as deleted); returns
        those deleted. A failure is logged: the ledger stays listed as
        retired, and goes at the next try."""
        deleted = []
        for ledger_id in ledger_ids:
            try:
                await self.bookkeeper.delete_ledger(ledger_id)
            except NoSuchLedgerError:
                pass
            except (BKError, MetadataError) as error:
                log.warning("cursor %s of %s: retired ledger %d not deleted yet: %s", self.subscription, self.partition, ledger_id, error)
                continue
            deleted.append(ledger_id)
        return tuple(deleted)

    async def _delete_orphan(self, ledger_id: int) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(ORPHAN_DELETE_S):
            try:
                await self.bookkeeper.delete_ledger(ledger_id)
            except (BKError, MetadataError) as error:
                log.warning("cursor %s of %s: ledger %d made for a failed write not deleted: %s",
                            self.subscription, self.partition, ledger_id, error)

    def owned_ledgers(self) -> tuple[int, ...]:
        return self.placement.owned_ledgers()


async def read_stored_cursor(bookkeeper: BookKeeper, password: bytes, partition: str, subscription: str,
                             node_record: dict) -> tuple[dict, tuple[int, ...]]:
    """The cursor's record as last made durable, and the ledgers to retire
    (those its node lists, and the one it names). The named ledger is
    opened with recovery: its previous owner can append no more, and its
    last entry, if any, is the record (the node's otherwise). Raises
    ValueError when the node is malformed, BKError when the ledger cannot
    be recovered now (the load fails and is tried again)."""
    ledger_id, retired = stored_placement(node_record)
    if ledger_id is None:
        return _bare(node_record), retired
    try:
        handle = await bookkeeper.open_ledger(ledger_id, password, recovery=True)
    except NoSuchLedgerError:
        log.error("cursor %s of %s: its ledger %d is gone; its position is the one its node holds (messages "
                  "acknowledged since are delivered again)", subscription, partition, ledger_id)
        return _bare(node_record), retired + (ledger_id,)
    record = node_record
    last_entry_id = handle.last_add_confirmed
    if last_entry_id >= 0:
        data = (await handle.read_entry(last_entry_id)).data
        try:
            record = json.loads(data)
            if type(record) is not dict:
                raise ValueError("not an object")
            Cursor.from_record(record)  # checked here: a bad entry falls back to the node
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            log.error("cursor %s of %s: the last entry of its ledger %d is unreadable (%s); its position is the one "
                      "its node holds", subscription, partition, ledger_id, error)
            record = node_record
    return _bare(record), retired + (ledger_id,)


def _bare(record: dict) -> dict:
    """A cursor's record without what says where it is kept."""
    return {key: value for key, value in record.items() if key not in (LEDGER_FIELD, RETIRED_FIELD)}


__all__ = ["CURSOR_WRITES_PER_S_DEFAULT", "CursorLedger", "CursorWritePacer", "read_stored_cursor"]
