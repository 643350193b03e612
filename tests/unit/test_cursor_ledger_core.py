"""Where a durable cursor's record goes: its ledger for acknowledgements,
its ZooKeeper node for the forced writes and when a ledger is made or
retired, and retired ledgers deleted only once the node no longer names
them."""

import pytest

from broker.cursor_ledger import CursorWritePacer
from broker.cursor_ledger_core import (
    Append,
    CreateLedger,
    CursorPlacement,
    DeleteLedgers,
    WriteNode,
    Written,
    stored_placement,
)

RECORD = {"mark_delete": 4, "acked": [[6, 7]], "type": "shared", "important": False, "created_ms": 0}


def test_the_first_acknowledgement_makes_a_ledger_and_names_it_in_the_node_which_holds_the_record():
    placement = CursorPlacement(3)
    assert placement.start(RECORD, inline=False) == CreateLedger()
    step = placement.ledger_created(17)
    assert step == WriteNode({**RECORD, "ledger": 17}, 3)
    assert placement.node_written(4) == Written(4)
    assert placement.ledger_id == 17 and placement.entries == 0 and not placement.writing


def test_later_acknowledgements_append_to_the_ledger_and_leave_the_node_alone():
    placement = CursorPlacement(3)
    placement.start(RECORD, inline=False)
    placement.ledger_created(17)
    placement.node_written(4)
    for mark_delete in range(5, 8):
        record = {**RECORD, "mark_delete": mark_delete}
        assert placement.start(record, inline=False) == Append(17, record)
        assert placement.appended() == Written(4)
    assert placement.entries == 3 and placement.version == 4


def test_a_full_ledger_is_replaced_and_retired_then_deleted():
    placement = CursorPlacement(0, ledger_entries_max=2)
    placement.start(RECORD, inline=False)
    placement.ledger_created(10)
    placement.node_written(1)
    for _ in range(2):
        placement.start(RECORD, inline=False)
        placement.appended()
    assert placement.start(RECORD, inline=False) == CreateLedger()
    # The node names the new ledger and lists the old one as retired,
    # before the old one is deleted: a crash in between leaks nothing.
    assert placement.ledger_created(11) == WriteNode({**RECORD, "ledger": 11, "retired": [10]}, 1)
    assert placement.node_written(2) == DeleteLedgers((10,))
    assert placement.owned_ledgers() == (11, 10)
    assert placement.deleted((10,)) == Written(2)
    assert placement.ledger_id == 11 and placement.entries == 0 and placement.owned_ledgers() == (11,)


def test_an_inline_write_puts_the_record_in_the_node_and_retires_the_ledger():
    placement = CursorPlacement(0)
    placement.start(RECORD, inline=False)
    placement.ledger_created(10)
    placement.node_written(1)
    assert placement.start(RECORD, inline=True) == WriteNode({**RECORD, "retired": [10]}, 1)
    assert placement.node_written(2) == DeleteLedgers((10,))
    assert placement.deleted((10,)) == Written(2)
    assert placement.ledger_id is None and placement.owned_ledgers() == ()
    # The next acknowledgement makes a new ledger.
    assert placement.start(RECORD, inline=False) == CreateLedger()


def test_a_ledger_that_failed_to_go_stays_listed_and_goes_with_the_next_node_write():
    placement = CursorPlacement(5, retired=(8, 9))  # at load: listed, and the one named (recovered)
    assert placement.start(RECORD, inline=True) == WriteNode({**RECORD, "retired": [8, 9]}, 5)
    assert placement.node_written(6) == DeleteLedgers((8, 9))
    assert placement.deleted((8,)) == Written(6)
    assert placement.retired == [9]
    assert placement.start(RECORD, inline=True) == WriteNode({**RECORD, "retired": [9]}, 6)
    assert placement.node_written(7) == DeleteLedgers((9,))
    assert placement.deleted((9,)) == Written(7) and placement.retired == []


def test_a_creation_is_an_inline_write_without_a_version():
    placement = CursorPlacement(None)
    assert placement.start(RECORD, inline=True) == WriteNode(RECORD, None)
    assert placement.node_written(0) == Written(0)


def test_a_failed_write_hands_back_the_ledger_made_for_it_and_keeps_the_old_one():
    placement = CursorPlacement(0)
    placement.start(RECORD, inline=False)
    placement.ledger_created(10)
    placement.node_written(1)
    placement.start(RECORD, inline=True)
    assert placement.failed() is None
    # (A failed inline write retired the ledger in memory only; the driver
    # fences the partition, and the next owner recovers what the node names.)
    placement = CursorPlacement(1)
    placement.start(RECORD, inline=False)
    placement.ledger_created(12)
    assert placement.failed() == 12
    assert placement.ledger_id is None and not placement.writing


def test_one_write_at_a_time():
    placement = CursorPlacement(0)
    placement.start(RECORD, inline=True)
    with pytest.raises(AssertionError):
        placement.start(RECORD, inline=True)


def test_a_stored_node_says_which_ledger_and_which_are_retired():
    assert stored_placement(RECORD) == (None, ())
    assert stored_placement({**RECORD, "ledger": 3, "retired": [1, 2]}) == (3, (1, 2))
    for malformed in ({"ledger": "3"}, {"ledger": -1}, {"retired": 1}, {"retired": [1, "2"]}, {"ledger": True}):
        with pytest.raises(ValueError):
            stored_placement({**RECORD, **malformed})


def test_the_pacer_lets_a_burst_through_then_spaces_writes_at_its_rate():
    pacer = CursorWritePacer(100)  # bursts of 10
    delays = [pacer.reserve(0.0) for _ in range(12)]
    assert delays[:10] == [0.0] * 10
    assert delays[10] == pytest.approx(0.01) and delays[11] == pytest.approx(0.02)
    # A second later the bucket is full again (and no fuller).
    assert [pacer.reserve(1.0) for _ in range(10)] == [0.0] * 10
    assert pacer.reserve(1.0) == pytest.approx(0.01)


def test_the_pacer_refuses_a_rate_that_is_not_positive():
    with pytest.raises(ValueError, match="positive"):
        CursorWritePacer(0)
