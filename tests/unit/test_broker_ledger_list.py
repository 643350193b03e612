"""Decisions about a partition's chain of ledgers: when the open ledger rolls
over, which ledger holds an offset, and how many old ledgers retention lets
go (an important subscription's unacknowledged messages hold theirs); and
the open ledger's index of offsets, bounded however many entries it has."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.ledger_list import OpenLedgerIndex, OpenLedgerState, ledger_index_of, rollover_reason, stored_bytes, trimmable_count
from broker.topic_records import LedgerInfo, TopicPolicies

# --- rollover -------------------------------------------------------------------------

POLICIES = TopicPolicies(rollover_entries=100, rollover_bytes=1000, rollover_time_ms=60_000, rollover_idle_ms=5_000,
                         rollover_min_time_ms=0)


@pytest.mark.parametrize(
    "state, now_ms, reason",
    [
        (OpenLedgerState(0, 0, 0, created_ms=0, last_add_ms=None), 10**9, None),  # empty: never, however old
        (OpenLedgerState(99, 99, 999, created_ms=0, last_add_ms=100), 1_000, None),
        (OpenLedgerState(100, 400, 10, created_ms=0, last_add_ms=100), 1_000, "100 entries"),
        (OpenLedgerState(5, 5, 1000, created_ms=0, last_add_ms=100), 1_000, "1000 bytes"),
        (OpenLedgerState(5, 5, 10, created_ms=0, last_add_ms=59_000), 60_000, "age"),
        (OpenLedgerState(5, 5, 10, created_ms=0, last_add_ms=1_000), 6_000, "idle"),
        (OpenLedgerState(5, 5, 10, created_ms=0, last_add_ms=1_001), 6_000, None),
    ],
)
def test_the_open_ledger_rolls_over_by_entries_bytes_age_or_idleness(state, now_ms, reason):
    assert rollover_reason(state, POLICIES, now_ms) == reason


# --- chains of ledgers ------------------------------------------------------------------


def chain(*ledgers: tuple[int, int, int], open_ledger: bool = True) -> list[LedgerInfo]:
    """Closed ledgers of (messages, bytes, closed ms), one after the other
    from offset 0, then (unless told otherwise) an open one."""
    infos, first_offset = [], 0
    for ledger_id, (messages, size, closed_ms) in enumerate(ledgers, start=1):
        infos.append(LedgerInfo(ledger_id, first_offset, 0).closed(messages, messages, size, closed_ms))
        first_offset += messages
    if open_ledger:
        infos.append(LedgerInfo(len(infos) + 1, first_offset, 0))
    return infos


def test_an_offset_is_found_in_the_ledger_that_holds_it():
    # Ledgers hold 0..2, nothing (empty), 3..4, then the open one from 5 on.
    ledgers = chain((3, 30, 0), (0, 0, 0), (2, 20, 0))
    assert [ledger_index_of(ledgers, offset) for offset in range(7)] == [0, 0, 0, 2, 2, 3, 3]
    assert ledger_index_of(ledgers, 10**12) == 3  # the last ledger takes every later offset
    assert ledger_index_of(ledgers[2:], 1) is None  # trimmed away
    assert ledger_index_of([], 0) is None


def test_without_retention_nothing_is_trimmed():
    ledgers = chain((10, 100, 0), (10, 100, 0))
    assert trimmable_count(ledgers, TopicPolicies(), now_ms=10**12, held_from_offset=None) == 0


def test_retention_by_time_trims_the_old_closed_ledgers():
    # Ledgers closed at 0, 500 and 900: at 1000 with a retention of 400 ms,
    # the first two are old enough; the open ledger always stays.
    ledgers = chain((10, 100, 0), (10, 100, 500), (10, 100, 900))
    policies = TopicPolicies(retention_time_ms=400)
    assert trimmable_count(ledgers, policies, now_ms=1000, held_from_offset=None) == 2
    assert trimmable_count(ledgers, policies, now_ms=10**9, held_from_offset=None) == 3


def test_the_last_ledger_stays_even_when_closed():
    ledgers = chain((10, 100, 0), (10, 100, 0), open_ledger=False)
    assert trimmable_count(ledgers, TopicPolicies(retention_time_ms=0), now_ms=10, held_from_offset=None) == 1


def test_trimming_stops_at_the_first_ledger_retention_keeps():
    # The second ledger was closed later than the third (its close was
    # delayed): it keeps the third too, as the chain is trimmed from its head.
    ledgers = chain((10, 100, 0), (10, 100, 900), (10, 100, 0))
    assert trimmable_count(ledgers, TopicPolicies(retention_time_ms=400), now_ms=1000, held_from_offset=None) == 1


def test_retention_by_size_keeps_the_newest_bytes():
    # 100-byte ledgers and 50 bytes in the open one, 250 bytes retained: the
    # newest two closed ledgers and the open one fit exactly, older ones go.
    ledgers = chain((10, 100, 0), (10, 100, 0), (10, 100, 0), (10, 100, 0))
    policies = TopicPolicies(retention_bytes=250)
    assert trimmable_count(ledgers, policies, now_ms=0, held_from_offset=None, open_ledger_bytes=50) == 2


def test_retention_by_size_keeps_at_least_the_retained_bytes():
    # 60-byte ledgers, 100 bytes retained: deleting the first would leave 60
    # bytes, less than the retention promises (Pulsar deletes a ledger only
    # while what remains is still at least the retention size).
    ledgers = chain((10, 60, 0), (10, 60, 0))
    assert trimmable_count(ledgers, TopicPolicies(retention_bytes=100), now_ms=0, held_from_offset=None) == 0


def test_an_important_subscription_holds_its_unacknowledged_messages():
    # Every ledger is past retention, but an important subscription has not
    # acknowledged offset 15 (in the second ledger): only the first goes.
    # Once it acknowledged everything, all closed ledgers go.
    ledgers = chain((10, 100, 0), (10, 100, 0), (10, 100, 0))
    policies = TopicPolicies(retention_time_ms=0)
    assert trimmable_count(ledgers, policies, now_ms=1, held_from_offset=15) == 1
    assert trimmable_count(ledgers, policies, now_ms=1, held_from_offset=10) == 1
    assert trimmable_count(ledgers, policies, now_ms=1, held_from_offset=9) == 0
    assert trimmable_count(ledgers, policies, now_ms=1, held_from_offset=30) == 3


def test_an_empty_ledger_below_the_hold_may_go():
    ledgers = chain((0, 0, 0), (10, 100, 0))
    assert trimmable_count(ledgers, TopicPolicies(retention_time_ms=0), now_ms=1, held_from_offset=0) == 1


def test_stored_bytes_counts_closed_ledgers_and_the_open_one():
    assert stored_bytes(chain((10, 100, 0), (0, 0, 0), (5, 7, 0)), open_ledger_bytes=3) == 110


# --- properties -------------------------------------------------------------------------

ledger_chains = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 100), st.integers(0, 1000)), min_size=0, max_size=8
).flatmap(lambda closed: st.booleans().map(lambda open_ledger: chain(*closed, open_ledger=open_ledger)))


@settings(max_examples=300, deadline=None)
@given(ledger_chains, st.integers(-2, 40))
def test_ledger_index_of_agrees_with_a_scan(ledgers, offset):
    expected = None
    for index, info in enumerate(ledgers):
        last = index == len(ledgers) - 1
        if info.first_offset <= offset and (last or offset <= info.last_offset):
            expected = index
    assert ledger_index_of(ledgers, offset) == expected


@settings(max_examples=300, deadline=None)
@given(
    ledger_chains,
    st.none() | st.integers(0, 1500),
    st.none() | st.integers(0, 400),
    st.none() | st.integers(0, 40),
    st.integers(0, 100),
)
def test_trimming_agrees_with_a_per_ledger_rule(ledgers, retention_time_ms, retention_bytes, held_from_offset, open_bytes):
    # A ledger may go when it is closed, not the last, past retention by time
    # or by size, and wholly below an important subscription's first
    # unacknowledged offset; the count is the run of such ledgers at the head.
    now_ms = 1000
    policies = TopicPolicies(retention_time_ms=retention_time_ms, retention_bytes=retention_bytes)
    count = trimmable_count(ledgers, policies, now_ms, held_from_offset, open_ledger_bytes=open_bytes)

    def may_go(index: int) -> bool:
        info = ledgers[index]
        if index == len(ledgers) - 1 or not info.is_closed:
            return False
        after_it = sum(later.bytes or 0 for later in ledgers[index + 1:]) + open_bytes
        expired = (retention_time_ms is not None and now_ms - info.closed_ms >= retention_time_ms) or (
            retention_bytes is not None and after_it >= retention_bytes  # what stays still holds the retained bytes
        )
        held = held_from_offset is not None and info.messages > 0 and info.last_offset >= held_from_offset
        return expired and not held

    expected = 0
    while expected < len(ledgers) and may_go(expected):
        expected += 1
    assert count == expected
    if held_from_offset is not None and count:
        trimmed = [info for info in ledgers[:count] if info.messages]
        assert all(info.last_offset < held_from_offset for info in trimmed), "trimmed a held message"


def test_a_young_ledger_does_not_roll_over_for_its_size():
    # Pulsar's minimum rollover time: a full ledger younger than it waits
    # (the ledger list is one ZooKeeper node: it must not grow too fast),
    # but age and idleness still close it.
    policies = TopicPolicies(rollover_entries=100, rollover_bytes=1000, rollover_min_time_ms=30_000)
    full = OpenLedgerState(entries=500, messages=500, bytes=5000, created_ms=0, last_add_ms=10_000)
    assert rollover_reason(full, policies, 10_000) is None
    assert rollover_reason(full, policies, 30_000) == "500 entries"


# --- the open ledger's index ----------------------------------------------------------------


def test_the_open_ledger_index_stays_bounded_however_many_entries():
    index = OpenLedgerIndex(points_max=8)
    for entry_id in range(1_000):
        index.append(3 * entry_id)  # three messages an entry
    assert len(index) <= 8 and index.stride == 128 and index.entries == 1_000
    # A range of at most `stride` entries, the one holding the offset among them.
    assert index.entry_range(0) == (0, 127)
    assert index.entry_range(3 * 500 + 2) == (384, 511)
    assert index.entry_range(3 * 999 + 2) == (896, 999)  # the last range ends at the last entry


def test_the_open_ledger_index_is_exact_until_it_fills():
    index = OpenLedgerIndex(points_max=4)
    for first_offset in (0, 5, 6, 20):
        index.append(first_offset)
    assert [index.entry_range(offset) for offset in (0, 4, 5, 6, 19, 20, 99)] == [
        (0, 0), (0, 0), (1, 1), (2, 2), (2, 2), (3, 3), (3, 3)]


def test_the_open_ledger_index_takes_an_even_number_of_points():
    for points_max in (0, 1, 3):
        with pytest.raises(ValueError):
            OpenLedgerIndex(points_max=points_max)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=200), st.sampled_from([2, 4, 6, 16]), st.data())
def test_the_open_ledger_index_range_holds_the_offset(message_counts, points_max, data):
    index = OpenLedgerIndex(points_max=points_max)
    firsts = []
    for count in message_counts:
        firsts.append(sum(message_counts[:len(firsts)]))
        index.append(firsts[-1])
    offset = data.draw(st.integers(0, sum(message_counts) - 1))
    holder = max(entry_id for entry_id, first in enumerate(firsts) if first <= offset)
    first, last = index.entry_range(offset)
    assert len(index) <= points_max and last - first + 1 <= index.stride
    assert first <= holder <= last
