"""The managed ledger core, driven directly with hand-written event
sequences: opening (an empty chain, a chain whose last ledger the previous
owner left open), appends in offset order, rollover, trimming, the graceful
close (also when asked during a rollover), and fencing on every kind of
failure, with late answers changing nothing."""

from __future__ import annotations

import pytest

from broker.entry_cache import Position
from broker.errors import TopicFencedError
from broker.managed_ledger_core import (
    ClosedDone,
    CloseLedger,
    CreateLedger,
    CreateRecord,
    DeleteLedgers,
    Fenced,
    ManagedLedgerCore,
    ReadRecord,
    RecoverLedger,
    State,
    Writable,
    WriteRecord,
)
from broker.topic_records import LedgerInfo, ManagedLedgerRecord, TopicPolicies

POLICIES = TopicPolicies(rollover_entries=3, rollover_min_time_ms=0)


def opened(first_ledger_id: int = 10) -> ManagedLedgerCore:
    """A core that opened an empty chain and writes `first_ledger_id`."""
    core = ManagedLedgerCore("p", POLICIES)
    assert core.open() == [ReadRecord()]
    assert core.record_read(None) == [CreateRecord()]
    assert core.record_read((ManagedLedgerRecord(), 0)) == [CreateLedger(POLICIES)]
    (write,) = core.ledger_created(first_ledger_id, 1_000)
    assert isinstance(write, WriteRecord) and write.expected_version == 0
    assert write.record.ledgers == (LedgerInfo(first_ledger_id, 0, 1_000),)
    assert core.record_written(1, 1_000) == [Writable(first_ledger_id)]
    return core


def append(core: ManagedLedgerCore, messages: int, now_ms: int = 2_000) -> bool:
    slot = core.next_append(now_ms)
    core.appended(slot, messages)
    return core.add_persisted(slot.ledger_id, slot.first_offset, messages, 100, now_ms)


def test_appends_take_offsets_in_order_and_the_full_ledger_rolls_over():
    core = opened()
    assert [append(core, 2), append(core, 1)] == [False, False]
    assert core.next_offset == 3 and core.confirmed_offset == 2
    assert append(core, 4) is True  # three entries: full
    assert core.rollover(2_500) == [CloseLedger(10)]
    assert core.next_append(2_500) is None  # appends wait while the chain changes
    assert core.stored_bytes == 300
    assert core.ledger_closed(2_600) == [CreateLedger(POLICIES)]
    assert core.stored_bytes == 300  # the closed ledger's bytes, counted once
    (write,) = core.ledger_created(11, 2_700)
    assert write.record.ledgers[0] == LedgerInfo(10, 0, 1_000, 3, 7, 300, 2_600)
    assert write.record.ledgers[1] == LedgerInfo(11, 7, 2_700)
    assert core.record_written(2, 2_700) == [Writable(11)]
    slot = core.next_append(3_000)
    assert (slot.ledger_id, slot.first_offset) == (11, 7)


def test_a_new_owner_recovers_the_open_ledger_and_continues_after_it():
    core = ManagedLedgerCore("p", POLICIES)
    core.open()
    record = ManagedLedgerRecord((LedgerInfo(4, 0, 0, 2, 5, 50, 10), LedgerInfo(5, 5, 20)))
    assert core.record_read((record, 7)) == [RecoverLedger(5)]
    assert core.ledger_recovered(5, 3, 90, 11, 5_000, 6_000) == [CreateLedger(POLICIES)]
    assert core.next_offset == 12 and core.confirmed_offset == 11
    (write,) = core.ledger_created(6, 6_000)
    assert write.record.ledgers[1] == LedgerInfo(5, 5, 20, 3, 7, 90, 6_000)
    core.record_written(8, 6_000)
    # Append times never go back, whatever the clock says.
    assert core.next_append(4_000).publish_ms == 5_000


def test_a_lost_compare_and_set_fences_and_the_unrecorded_ledger_is_deleted():
    core = ManagedLedgerCore("p", POLICIES)
    core.open()
    core.record_read((ManagedLedgerRecord(), 3))
    core.ledger_created(20, 0)
    commands = core.record_write_failed(True, "bad version")
    assert commands[0] == DeleteLedgers((20,), orphans=True)
    assert isinstance(commands[1], Fenced) and core.state is State.FENCED
    with pytest.raises(TopicFencedError):
        core.next_append(0)
    # An uncertain failure keeps the ledger (the write may have landed).
    other = ManagedLedgerCore("q", POLICIES)
    other.open()
    other.record_read((ManagedLedgerRecord(), 3))
    other.ledger_created(21, 0)
    assert [type(command) for command in other.record_write_failed(False, "connection lost")] == [Fenced]


def test_a_failed_add_fences_once_and_late_answers_change_nothing():
    core = opened()
    append(core, 1)
    append(core, 1)
    append(core, 1)
    core.rollover(3_000)
    (fenced,) = core.add_failed(10, "bookies gone")
    assert isinstance(fenced, Fenced)
    assert core.add_failed(10, "again") == []
    assert core.ledger_closed(3_100) == []  # the rollover's close, answered late
    assert core.ledger_created(12, 3_200) == [DeleteLedgers((12,), orphans=True)]


def test_trimming_writes_the_record_then_deletes_the_ledgers():
    core = ManagedLedgerCore("p", TopicPolicies(retention_time_ms=100, rollover_entries=1, rollover_min_time_ms=0))
    core.open()
    record = ManagedLedgerRecord((LedgerInfo(1, 0, 0, 1, 1, 10, 50), LedgerInfo(2, 1, 60, 1, 1, 10, 70)))
    core.record_read((record, 4))
    core.ledger_created(3, 80)
    core.record_written(5, 80)
    (write,) = core.trim(held_from_offset=None, now_ms=500)
    assert [info.ledger_id for info in write.record.ledgers] == [3]
    assert core.next_append(500) is None
    assert core.record_written(6, 500) == [Writable(3, new_ledger=False), DeleteLedgers((1, 2))]
    assert core.first_offset == 2


def test_a_close_asked_during_a_rollover_happens_once_the_new_ledger_is_recorded():
    core = opened()
    for _ in range(3):
        append(core, 1)
    core.rollover(3_000)
    assert core.close() == []
    with pytest.raises(TopicFencedError, match="closed"):
        core.next_append(3_000)
    core.ledger_closed(3_000)
    core.ledger_created(11, 3_000)
    assert core.record_written(2, 3_000) == [CloseLedger(11)]
    (write,) = core.ledger_closed(3_100)
    assert write.record.ledgers[-1].is_closed
    assert core.record_written(3, 3_100) == [ClosedDone(True)]
    assert core.state is State.CLOSED


def test_positions_of_the_chain():
    core = opened()
    for _ in range(2):
        append(core, 2)
    assert core.end_position() == Position(10, 2)
    assert core.has_entry(Position(10, 1)) and not core.has_entry(Position(10, 2))
    assert core.entries_holding(3) == (10, 1, 1)
    assert core.entries_holding(4) is None  # not written yet
    assert core.readable_position(Position(99, 0)) == Position(10, 0)  # a ledger no longer in the chain


def test_an_add_failing_during_the_close_gives_the_close_up():
    # The previous owner fences the ledger while this one unloads: the
    # close is given up (the next owner recovers the ledger), and appends
    # are refused as closed.
    core = opened()
    append(core, 1)
    assert core.close() == [CloseLedger(10)]
    assert core.add_failed(10, "fenced") == [ClosedDone(False)]
    assert core.state is State.CLOSED
    with pytest.raises(TopicFencedError, match="closed"):
        core.next_append(3_000)
