"""What a Spark export reads: closed ledgers only (never the open one, never
an empty one), large ledgers cut into entry ranges by bytes that cover every
entry exactly once, the selection options, and what an incremental run
leaves out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.export_plan import (
    PartitionLedgers,
    Selection,
    closed_ledgers,
    entry_ranges,
    parse_ledger_ids,
    parse_time_ms,
    plan_splits,
)
from broker.topic_records import LedgerInfo


def chain() -> tuple[LedgerInfo, ...]:
    """Ledgers 3 (10 entries, 1 MB), 5 (empty, closed), 8 (4 entries), 9 (open)."""
    return (
        LedgerInfo(3, first_offset=0, created_ms=1_000, entries=10, messages=100, bytes=1_000_000, closed_ms=2_000),
        LedgerInfo(5, first_offset=100, created_ms=2_000, entries=0, messages=0, bytes=0, closed_ms=2_500),
        LedgerInfo(8, first_offset=100, created_ms=2_500, entries=4, messages=4, bytes=400, closed_ms=3_000),
        LedgerInfo(9, first_offset=104, created_ms=3_000),
    )


def ids(ledgers) -> list[int]:
    return [info.ledger_id for info in ledgers]


def test_only_closed_ledgers_with_entries_are_read():
    assert ids(closed_ledgers(chain())) == [3, 8]


@pytest.mark.parametrize(
    "selection, expected",
    [
        (Selection(from_ledger=4), [8]),
        (Selection(exclude_ledger_ids=frozenset({3})), [8]),
        (Selection(ledger_ids=frozenset({8, 9})), [8]),  # the open ledger even when asked for
        (Selection(start_time_ms=2_001), [8]),  # ledger 3 closed before
        (Selection(start_time_ms=2_000), [3, 8]),
        (Selection(end_time_ms=2_500), [3]),  # ledger 8 created at the end (exclusive)
        (Selection(start_time_ms=1_500, end_time_ms=2_600), [3, 8]),
    ],
)
def test_the_selection_options(selection, expected):
    assert ids(closed_ledgers(chain(), selection)) == expected


def test_an_empty_time_range_is_refused():
    with pytest.raises(ValueError, match="end_time"):
        Selection(start_time_ms=5, end_time_ms=5)


def test_entries_are_filtered_by_append_time_half_open():
    selection = Selection(start_time_ms=10, end_time_ms=20)
    assert [selection.keeps_entry(time) for time in (9, 10, 19, 20)] == [False, True, True, False]


def test_a_large_ledger_is_cut_into_ranges_of_about_split_bytes():
    assert entry_ranges(10, 1_000_000, 300_000) == [(0, 2), (3, 5), (6, 7), (8, 9)]
    assert entry_ranges(10, 100, 300_000) == [(0, 9)]
    assert entry_ranges(3, 1_000_000, 1) == [(0, 0), (1, 1), (2, 2)]  # never an empty range
    assert entry_ranges(0, 0, 10) == []


@given(entries=st.integers(1, 5_000), bytes_=st.integers(0, 10**9), split_bytes=st.integers(1, 10**8))
def test_ranges_cover_every_entry_once_in_order(entries, bytes_, split_bytes):
    ranges = entry_ranges(entries, bytes_, split_bytes)
    covered = [entry for first, last in ranges for entry in range(first, last + 1)]
    assert covered == list(range(entries))
    sizes = [last - first + 1 for first, last in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_splits_carry_the_partition_and_the_ledger_s_first_offset():
    partitions = [PartitionLedgers("orders", "orders-partition-0", 0, chain()),
                  PartitionLedgers("orders", "orders-partition-1", 1, chain()[2:])]
    splits = plan_splits(partitions, split_bytes=400_000)
    assert [(split.partition_index, split.ledger_id, split.first_entry_id, split.last_entry_id) for split in splits] == [
        (0, 3, 0, 3), (0, 3, 4, 6), (0, 3, 7, 9), (0, 8, 0, 3), (1, 8, 0, 3)]
    assert [split.ledger_first_offset for split in splits] == [0, 0, 0, 100, 100]
    assert sum(split.bytes for split in splits if split.ledger_id == 3 and split.partition_index == 0) <= 1_000_000


def test_times_and_ledger_lists_parse():
    assert parse_time_ms("1700000000000", "t") == 1_700_000_000_000
    assert parse_time_ms("2023-11-14T22:13:20", "t") == 1_700_000_000_000  # UTC unless a zone is named
    assert parse_time_ms("2023-11-14T23:13:20+01:00", "t") == 1_700_000_000_000
    assert parse_time_ms(None, "t") is None
    with pytest.raises(ValueError, match="start_time"):
        parse_time_ms("yesterday", "start_time")
    assert parse_ledger_ids("3, 8,") == frozenset({3, 8})
    assert parse_ledger_ids("") is None
    with pytest.raises(ValueError):
        parse_ledger_ids("3,x")
