"""Where a durable cursor's record goes: its ledger for acknowledgements,
its ZooKeeper node for the forced writes and when a ledger is made or
retired, and retired ledgers deleted only once the node no longer names
them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    for not_an_object in ([], 1, None, "x"):
        with pytest.raises(ValueError, match="object"):
            stored_placement(not_an_object)


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


class World:
    """ZooKeeper's node and the bookies' ledgers, as a broker crashing
    anywhere leaves them."""

    def __init__(self) -> None:
        self.node: dict | None = None
        self.version: int | None = None
        self.ledgers: dict[int, list[dict]] = {}
        self.next_ledger_id = 1

    def carry_out(self, placement: CursorPlacement, record: dict, inline: bool, crash_at: int | None) -> bool:
        """One write, crashing (the broker gone) before its step number
        `crash_at` takes effect; True when it finished."""
        step, number = placement.start(record, inline=inline), 0
        while not isinstance(step, Written):
            if number == crash_at:
                return False
            number += 1
            if isinstance(step, Append):
                self.ledgers[step.ledger_id].append(step.record)
                step = placement.appended()
            elif isinstance(step, CreateLedger):
                ledger_id, self.next_ledger_id = self.next_ledger_id, self.next_ledger_id + 1
                self.ledgers[ledger_id] = []
                step = placement.ledger_created(ledger_id)
            elif isinstance(step, WriteNode):
                assert step.expected_version == self.version, "a compare-and-set against a stale version"
                self.node, self.version = step.record, (0 if self.version is None else self.version + 1)
                step = placement.node_written(self.version)
            else:
                for ledger_id in step.ledger_ids:
                    self.ledgers.pop(ledger_id, None)
                step = placement.deleted(step.ledger_ids)
        return True

    def load(self) -> tuple[dict, CursorPlacement]:
        """What the next owner reads (broker/cursor_ledger.read_stored_cursor)."""
        named, retired = stored_placement(self.node)
        record = self.node
        if named is not None and self.ledgers.get(named):
            record = self.ledgers[named][-1]
        record = {key: value for key, value in record.items() if key not in ("ledger", "retired")}
        return record, CursorPlacement(self.version, retired=retired + (() if named is None else (named,)),
                                       ledger_entries_max=3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.one_of(st.none(), st.integers(0, 4))), min_size=1, max_size=40))
def test_a_broker_crashing_at_any_step_loses_no_durable_position_and_leaks_only_empty_ledgers(writes):
    # Each write's record is one mark-delete further; after a crash the
    # next owner loads (its forced inline write may crash too, and the load
    # is tried again). The position loaded is never behind the last write
    # that finished, and every ledger left is named or retired by the node,
    # or empty (made by a write that crashed before the node named it).
    world = World()
    placement = CursorPlacement(None, ledger_entries_max=3)
    assert world.carry_out(placement, {"mark_delete": 0, "acked": []}, True, None)  # the creation
    durable = leaked_by_crashes = 0
    for number, (inline, crash_at) in enumerate(writes, start=1):
        if world.carry_out(placement, {"mark_delete": number, "acked": []}, inline, crash_at):
            durable = number
            continue
        leaked_by_crashes += 1
        for attempt in range(2):  # every third crash, the first load crashes too
            record, placement = world.load()
            assert record["mark_delete"] >= durable
            if world.carry_out(placement, record, True, 1 if attempt == 0 and number % 3 == 0 else None):
                break
        durable = max(durable, record["mark_delete"])
    named, retired = stored_placement(world.node)
    for ledger_id, entries in world.ledgers.items():
        assert ledger_id == named or ledger_id in retired or ledger_id in placement.retired or not entries, (ledger_id, world.node)
    unnamed = [ledger_id for ledger_id in world.ledgers if ledger_id != named and ledger_id not in retired]
    assert len(unnamed) <= leaked_by_crashes
