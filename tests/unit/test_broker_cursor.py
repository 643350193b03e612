"""A subscription's cursor: the ranges of individually acknowledged offsets,
the mark-delete position they fold into, and the bounded persisted form.
Scenario tests first, then random operations checked against a plain set."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cursor import Cursor, RangeSet

# --- scenarios: RangeSet ------------------------------------------------------------


def test_touching_and_overlapping_ranges_merge_into_one():
    # Ranges that touch (3 follows 2) or overlap become one range, and
    # add_range counts only the integers it added.
    ranges = RangeSet()
    assert ranges.add_range(0, 2) == 3
    assert ranges.add_range(5, 6) == 2
    assert ranges.ranges() == [[0, 2], [5, 6]]
    assert ranges.add_range(3, 4) == 2  # fills the gap exactly
    assert ranges.ranges() == [[0, 6]]
    assert ranges.add_range(4, 9) == 3  # overlaps: 7, 8, 9 are new
    assert ranges.ranges() == [[0, 9]] and ranges.count == 10 and len(ranges) == 1


def test_add_says_whether_an_integer_was_new():
    ranges = RangeSet([(10, 12)])
    assert ranges.add(13) is True
    assert ranges.add(11) is False
    assert ranges.add_range(20, 19) == 0  # an empty range adds nothing
    assert ranges.ranges() == [[10, 13]]


def test_remove_through_cuts_a_range_in_the_middle():
    ranges = RangeSet([(0, 4), (8, 12), (20, 20)])
    ranges.remove_through(10)
    assert ranges.ranges() == [[11, 12], [20, 20]]
    assert ranges.count == 3 and ranges.first == 11
    ranges.remove_through(100)
    assert not ranges and ranges.count == 0 and ranges.first is None


def test_count_between_counts_only_inside_the_window():
    ranges = RangeSet([(0, 4), (8, 12), (20, 25)])
    assert ranges.count_between(3, 21) == 2 + 5 + 2
    assert ranges.count_between(5, 7) == 0
    assert ranges.count_between(30, 40) == 0
    assert ranges.count_between(-10, -1) == 0


def test_ranges_max_keeps_the_lowest_ranges():
    ranges = RangeSet([(0, 0), (2, 2), (4, 4)])
    assert ranges.ranges(2) == [[0, 0], [2, 2]]
    assert ranges.ranges(0) == []


# --- scenarios: Cursor --------------------------------------------------------------


def test_individual_acks_fold_into_the_mark_delete_once_the_gap_fills():
    # Acks of 1 and 2 wait beyond the mark-delete while 0 is out; acking 0
    # moves the mark-delete over all three at once.
    cursor = Cursor.at(0)
    assert cursor.acknowledge([2, 1]) == 2
    assert cursor.mark_delete == -1 and cursor.acked.ranges() == [[1, 2]]
    assert cursor.acknowledge([0]) == 1
    assert cursor.mark_delete == 2 and not cursor.acked


def test_acks_at_or_below_the_mark_delete_are_not_new():
    cursor = Cursor.at(10)
    assert cursor.acknowledge([3, 9, 12, 12]) == 1
    assert cursor.acknowledge_cumulative(5) == 0
    assert cursor.is_acked(9) and cursor.is_acked(12) and not cursor.is_acked(10)


def test_cumulative_ack_counts_only_what_was_not_acknowledged():
    # 3 and 5 were acknowledged one by one; a cumulative ack through 6 adds
    # the other five of 0..6 and leaves 8 as an individual range.
    cursor = Cursor.at(0)
    cursor.acknowledge([3, 5, 8])
    assert cursor.acknowledge_cumulative(6) == 5
    assert cursor.mark_delete == 6 and cursor.acked.ranges() == [[8, 8]]


def test_cumulative_ack_folds_a_range_that_follows_it():
    cursor = Cursor.at(0)
    cursor.acknowledge([4, 5, 6])
    assert cursor.acknowledge_cumulative(3) == 4
    assert cursor.mark_delete == 6 and not cursor.acked


def test_backlog_counts_unacknowledged_messages_up_to_the_last():
    cursor = Cursor.at(0)
    cursor.acknowledge([1, 2, 7])
    assert cursor.backlog(9) == 10 - 3  # every ack below the last: the running count
    assert cursor.backlog(5) == 6 - 2  # an ack above the last: counted by ranges
    assert cursor.backlog(-1) == 0
    cursor.acknowledge_cumulative(9)
    assert cursor.backlog(9) == 0


def test_skip_to_acknowledges_what_retention_deleted():
    # Retention removed offsets below 5: they count as acknowledged, and an
    # individual ack at 5 that was waiting folds in.
    cursor = Cursor.at(0)
    cursor.acknowledge([2, 5])
    cursor.skip_to(5)
    assert cursor.mark_delete == 5 and not cursor.acked
    cursor.skip_to(3)  # never backwards
    assert cursor.mark_delete == 5


def test_reset_makes_later_messages_unacknowledged_again():
    # A seek back to 2 forgets the acks from 2 on; a seek forward to 20
    # acknowledges everything before it.
    cursor = Cursor.at(0)
    cursor.acknowledge([0, 1, 2, 3, 7])
    cursor.reset(2)
    assert cursor.mark_delete == 1 and not cursor.acked and not cursor.is_acked(7)
    cursor.reset(20)
    assert cursor.mark_delete == 19 and cursor.backlog(19) == 0


def test_restart_with_bounded_ranges_redelivers_the_highest_ranges_only():
    # Five separate acknowledged ranges, but only two persisted: after the
    # restart the three highest ranges are unacknowledged again (delivered
    # again), the mark-delete and the lowest two ranges survive.
    cursor = Cursor.at(0)
    cursor.acknowledge([0, 2, 4, 6, 8, 10])
    record = json.loads(json.dumps(cursor.to_record(ranges_max=2)))
    restored = Cursor.from_record(record)
    assert restored.mark_delete == 0
    assert [offset for offset in range(12) if restored.is_acked(offset)] == [0, 2, 4]
    assert Cursor.from_record(cursor.to_record()) == cursor


def test_from_record_folds_a_range_that_touches_the_mark_delete():
    cursor = Cursor.from_record({"mark_delete": 4, "acked": [[5, 7], [9, 9]]})
    assert cursor.mark_delete == 7 and cursor.acked.ranges() == [[9, 9]]


def test_ranges_after_counts_new_merged_and_folded_ranges_without_changing_the_cursor():
    # Acked beyond the mark-delete (-1): [2], [5, 6], [9].
    cursor = Cursor.from_record({"mark_delete": -1, "acked": [[2, 2], [5, 6], [9, 9]]})
    assert cursor.ranges_after([]) == 3
    assert cursor.ranges_after([12]) == 4  # a new range
    assert cursor.ranges_after([12, 14, 16]) == 6  # three
    assert cursor.ranges_after([12, 13, 14]) == 4  # one run, one range
    assert cursor.ranges_after([7]) == 3  # extends [5, 6]
    assert cursor.ranges_after([3, 4]) == 2  # closes the gap between [2] and [5, 6]
    assert cursor.ranges_after([3, 4, 7, 8]) == 1  # two runs close two gaps: [2..9]
    assert cursor.ranges_after([0]) == 3  # folds into the mark-delete, a range of its own gone with it
    assert cursor.ranges_after([0, 1]) == 2  # folds, taking [2] with it
    assert cursor.ranges_after([0, 1, 3, 4, 7, 8]) == 0  # everything through 9
    assert cursor.ranges_after([5, 6, -4]) == 3  # already acknowledged
    assert cursor.acked.ranges() == [[2, 2], [5, 6], [9, 9]] and cursor.mark_delete == -1


def cursor_at_bound(ranges: int) -> Cursor:
    """A cursor whose mark-delete is -1 and which holds `ranges` ranges of
    one offset each: 1, 3, 5, ... (0, 2, 4, ... are the gaps)."""
    return Cursor.from_record({"mark_delete": -1, "acked": [[offset, offset] for offset in range(1, 2 * ranges, 2)]})


def test_at_the_bound_only_acknowledgements_that_start_a_new_range_are_refused():
    # The cursor holds 3 ranges, its bound: a new range past the end is
    # refused; filling a gap between two ranges, extending one, and
    # acknowledging the oldest unacknowledged offset (0) are all taken.
    cursor = cursor_at_bound(3)  # [1], [3], [5]
    assert cursor.acknowledge_within([9], ranges_max=3) == [9]
    assert cursor.acked.ranges() == [[1, 1], [3, 3], [5, 5]]
    assert cursor.acknowledge_within([4], ranges_max=3) == []  # closes the gap between [3] and [5]
    assert cursor.acked.ranges() == [[1, 1], [3, 5]]
    assert cursor.acknowledge_within([6], ranges_max=3) == []  # extends [3, 5]
    assert cursor.acknowledge_within([9], ranges_max=3) == []  # room for one again
    assert cursor.acknowledge_within([11], ranges_max=3) == [11]
    # The oldest unacknowledged offset is always taken, and moves the mark-delete.
    assert cursor.acknowledge_within([0], ranges_max=3) == []
    assert cursor.mark_delete == 1 and cursor.acked.ranges() == [[3, 6], [9, 9]]


def test_a_request_at_the_bound_is_taken_in_part_oldest_first():
    # One request holds the oldest offset (0: folds with [1] into the
    # mark-delete, a range fewer), a gap-filler (4: [3] and [5] become one)
    # and three new ranges: those two, taken first, make room for two new
    # ranges, the lowest (11, 13); the highest (15) is refused.
    cursor = cursor_at_bound(3)  # [1], [3], [5]
    refused = cursor.acknowledge_within([15, 13, 11, 4, 0], ranges_max=3)
    assert refused == [15]
    assert cursor.mark_delete == 1 and cursor.acked.ranges() == [[3, 5], [11, 11], [13, 13]]
    assert not cursor.is_acked(15)


def test_a_request_that_ends_within_the_bound_is_taken_whole_whatever_its_order():
    # At the bound of 3 ([5], [7], [9]): 2 would start a range, but 8 in the
    # same request joins [7] and [9]; together they leave 3 ranges, so both
    # are taken, though the new range comes first.
    cursor = Cursor.from_record({"mark_delete": -1, "acked": [[5, 5], [7, 7], [9, 9]]})
    assert cursor.ranges_after([2, 8]) == 3
    assert cursor.acknowledge_within([2, 8], ranges_max=3) == []
    assert cursor.acked.ranges() == [[2, 2], [5, 5], [7, 9]]


def test_a_subscription_at_its_bound_always_makes_progress():
    # Whatever it holds, acknowledging the oldest unacknowledged offset
    # never adds a range and always moves the mark-delete: a consumer that
    # acknowledges in order drains a cursor held at its bound.
    cursor = cursor_at_bound(50)
    for _ in range(50):
        oldest = cursor.mark_delete + 1
        assert cursor.ranges_after([oldest]) <= len(cursor.acked)
        assert cursor.acknowledge_within([oldest], ranges_max=50) == []
        assert cursor.mark_delete > oldest  # past it and the range it joined
    assert not cursor.acked and cursor.mark_delete == 99


@pytest.mark.parametrize(
    "record",
    [
        {"mark_delete": "4", "acked": []},
        {"mark_delete": True, "acked": []},
        {"mark_delete": 4, "acked": [[3, 6]]},  # a range at or below the mark-delete
        {"mark_delete": 4, "acked": [[8, 6]]},  # a range backwards
        {"mark_delete": 4, "acked": [[6]]},
        {"mark_delete": 4, "acked": [[6, 7.0]]},
        {"mark_delete": 4, "acked": [(6, 7)]},
        {"mark_delete": 4, "acked": ["ab"]},
    ],
)
def test_from_record_refuses_malformed_records(record):
    with pytest.raises(ValueError):
        Cursor.from_record(record)


# --- properties ---------------------------------------------------------------------

VALUES = st.integers(-5, 60)
range_set_operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), VALUES),
        st.tuples(st.just("add_range"), VALUES, st.integers(-2, 12)),
        st.tuples(st.just("remove_through"), VALUES),
    ),
    max_size=40,
)


def assert_well_formed(ranges: RangeSet, model: set[int]) -> None:
    pairs = ranges.ranges()
    for first, last in pairs:
        assert first <= last
    for (_, last), (first, _) in zip(pairs, pairs[1:]):
        assert first > last + 1, f"ranges overlap or touch: {pairs}"
    assert {value for first, last in pairs for value in range(first, last + 1)} == model
    assert ranges.count == len(model) and len(ranges) == len(pairs)
    assert ranges.first == (min(model) if model else None)


@settings(max_examples=300, deadline=None)
@given(range_set_operations, st.integers(-8, 70), st.integers(-8, 70))
def test_range_set_behaves_as_a_set(operations, low, high):
    ranges, model = RangeSet(), set()
    for operation in operations:
        if operation[0] == "add":
            value = operation[1]
            assert ranges.add(value) == (value not in model)
            model.add(value)
        elif operation[0] == "add_range":
            first, last = operation[1], operation[1] + operation[2]
            new = set(range(first, last + 1)) - model
            assert ranges.add_range(first, last) == len(new)
            model |= new
        else:
            ranges.remove_through(operation[1])
            model = {value for value in model if value > operation[1]}
        assert_well_formed(ranges, model)
    for value in range(-8, 71):
        assert (value in ranges) == (value in model)
    assert ranges.count_between(low, high) == len({value for value in model if low <= value <= high})


OFFSETS_TOP = 40  # the model's offsets are 0..OFFSETS_TOP; everything below 0 is acknowledged
OFFSETS = st.integers(0, OFFSETS_TOP)
cursor_operations = st.lists(
    st.one_of(
        st.tuples(st.just("acknowledge"), st.lists(OFFSETS, max_size=6)),
        st.tuples(st.just("acknowledge_cumulative"), st.integers(-1, OFFSETS_TOP)),
        st.tuples(st.just("skip_to"), OFFSETS),
        st.tuples(st.just("reset"), OFFSETS),
    ),
    max_size=30,
)


def model_mark_delete(acked: set[int]) -> int:
    mark_delete = -1
    while mark_delete + 1 in acked:
        mark_delete += 1
    return mark_delete


def apply_to_cursor(cursor: Cursor, acked: set[int], operation) -> set[int]:
    """Applies one operation to the cursor and returns the model's new set,
    checking the counts the cursor returns on the way."""
    name, argument = operation
    if name == "acknowledge":
        assert cursor.acknowledge(argument) == len(set(argument) - acked)
        return acked | set(argument)
    if name == "acknowledge_cumulative":
        through = set(range(0, argument + 1))
        assert cursor.acknowledge_cumulative(argument) == len(through - acked)
        return acked | through
    if name == "skip_to":
        cursor.skip_to(argument)
        return acked | set(range(0, argument))
    cursor.reset(argument)
    return set(range(0, argument))


def assert_cursor_matches(cursor: Cursor, acked: set[int]) -> None:
    assert cursor.mark_delete == model_mark_delete(acked)
    for offset in range(-3, OFFSETS_TOP + 3):
        assert cursor.is_acked(offset) == (offset < 0 or offset in acked), offset
    for last in (-1, 0, OFFSETS_TOP // 2, OFFSETS_TOP + 2):
        assert cursor.backlog(last) == sum(1 for offset in range(0, last + 1) if offset not in acked)
    # Nothing at or below the mark-delete is kept as a range.
    assert cursor.acked.first is None or cursor.acked.first > cursor.mark_delete + 1


@settings(max_examples=300, deadline=None)
@given(cursor_operations)
def test_cursor_matches_a_set_of_acknowledged_offsets(operations):
    cursor, acked = Cursor.at(0), set()
    for operation in operations:
        acked = apply_to_cursor(cursor, acked, operation)
        assert_cursor_matches(cursor, acked)


@settings(max_examples=300, deadline=None)
@given(cursor_operations, st.integers(0, 6))
def test_a_restored_cursor_acknowledges_a_subset_never_more(operations, ranges_max):
    cursor, acked = Cursor.at(0), set()
    for operation in operations:
        acked = apply_to_cursor(cursor, acked, operation)
    # The whole record restores exactly, through JSON as it is stored.
    full = Cursor.from_record(json.loads(json.dumps(cursor.to_record())))
    assert full == cursor
    assert_cursor_matches(full, acked)
    # A bounded record loses only the highest ranges: a subset, with the
    # same mark-delete and the lowest ranges intact.
    bounded = Cursor.from_record(json.loads(json.dumps(cursor.to_record(ranges_max))))
    restored = {offset for offset in range(0, OFFSETS_TOP + 1) if bounded.is_acked(offset)}
    assert restored <= acked
    assert bounded.mark_delete == cursor.mark_delete
    assert bounded.acked.ranges() == cursor.acked.ranges()[:ranges_max]


@settings(max_examples=500, deadline=None)
@given(cursor_operations, st.lists(st.integers(-2, OFFSETS_TOP + 2), max_size=12), st.integers(0, 8))
def test_acknowledging_within_a_bound_takes_all_but_what_would_start_a_range_past_it(operations, offsets, ranges_max):
    cursor, acked = Cursor.at(0), set()
    for operation in operations:
        acked = apply_to_cursor(cursor, acked, operation)
    before = len(cursor.acked)
    predicted = cursor.ranges_after(offsets)
    plain = Cursor.from_record(cursor.to_record())
    plain.acknowledge(offsets)
    assert predicted == len(plain.acked), "ranges_after says what acknowledge leaves"

    refused = cursor.acknowledge_within(offsets, ranges_max)
    taken = set(offsets) - set(refused)
    assert set(refused) <= set(offsets) and refused == sorted(set(refused))
    assert_cursor_matches(cursor, acked | taken)
    assert len(cursor.acked) <= max(ranges_max, before), "never more ranges than the bound (or than before)"
    if predicted <= ranges_max:
        assert not refused, "nothing is refused when everything fits"
    if refused:
        assert len(cursor.acked) >= ranges_max, "refused only when full"
    else:
        assert cursor == plain
    for offset in refused:
        # Refused only because it would have stood alone: nothing next to
        # it is acknowledged (it would have merged), the mark-delete included.
        assert not cursor.is_acked(offset - 1) and not cursor.is_acked(offset + 1), offset
    oldest = model_mark_delete(acked) + 1
    if oldest in offsets:
        assert cursor.mark_delete >= oldest, "the oldest unacknowledged offset is always taken"
