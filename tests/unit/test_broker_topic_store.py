"""What brokers keep in ZooKeeper: topic policies (validated, unknown names
refused), topic and partition names, and the JSON records of topics and
managed ledgers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.topic_records import (
    LedgerInfo,
    ManagedLedgerRecord,
    TopicPolicies,
    TopicRecord,
    check_name,
    partition_name,
    split_partition,
)

# --- policies ---------------------------------------------------------------------------


def test_policies_from_a_map_keep_the_base_for_names_not_given():
    # An operator changes the retention; everything else stays as the
    # topic had it.
    base = TopicPolicies(retention_time_ms=1000, rollover_entries=7, deduplication=False)
    changed = TopicPolicies.from_dict({"retention_time_ms": 5000, "backlog_quota_bytes": None}, base)
    assert changed == TopicPolicies(retention_time_ms=5000, rollover_entries=7, deduplication=False)
    assert TopicPolicies.from_dict({}) == TopicPolicies()
    assert TopicPolicies.from_dict(changed.to_dict()) == changed


def test_unknown_policy_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown topic policies \['retention_days'\]"):
        TopicPolicies.from_dict({"retention_days": 7, "retention_time_ms": 1})
    with pytest.raises(ValueError, match="unknown topic policies"):
        TopicPolicies.from_dict({"retention": 7, b"retention": 7})  # names of mixed types


@pytest.mark.parametrize(
    "values",
    [
        {"retention_time_ms": -1},
        {"retention_bytes": 1.5},
        {"backlog_quota_bytes": "10"},
        {"retention_time_ms": True},
        {"rollover_entries": 0},
        {"rollover_bytes": None},
        {"rollover_time_ms": 2.0},
        {"rollover_idle_ms": False},
        {"deduplication": 1},
        {"ensemble_size": 2, "write_quorum": 3},
        {"write_quorum": 1, "ack_quorum": 2},
        {"ack_quorum": 0},
        {"ensemble_size": "3"},
        {"ensemble_size": 3.5},
        {"ack_quorum": True},
        {"write_quorum": None},
    ],
)
def test_invalid_policies_are_refused_with_value_error(values):
    with pytest.raises(ValueError):
        TopicPolicies.from_dict(values)


def test_zero_retention_and_quota_are_valid():
    policies = TopicPolicies(retention_time_ms=0, retention_bytes=0, backlog_quota_bytes=0, ensemble_size=1,
                             write_quorum=1, ack_quorum=1)
    assert TopicPolicies.from_dict(policies.to_dict()) == policies


# --- names --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["orders", "a", "Orders.v2:eu=1_x-y", "7", "x" * 200])
def test_good_names_pass(name):
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "-orders", "_orders", "orders/eu", "orders eu", "x" * 201, "orders\n", "\norders", "ordérs", None, 5, b"orders"],
)
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError, match="bad subscription name"):
        check_name(name, "subscription")


def test_partition_names_follow_pulsar():
    assert partition_name("orders", -1) == "orders"
    assert partition_name("orders", 3) == "orders-partition-3"
    assert split_partition("orders-partition-3") == ("orders", 3)
    assert split_partition("orders") == ("orders", -1)
    assert split_partition("a-partition-1-partition-2") == ("a-partition-1", 2)
    for odd in ("orders-partition-03", "orders-partition-", "orders-partition-1234567", "orders-partition-3\n"):
        assert split_partition(odd) == (odd, -1)


topic_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:=-]{0,30}", fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(topic_names, st.integers(0, 9_999))
def test_a_partition_name_splits_back_into_its_topic_and_index(topic, index):
    name = partition_name(topic, index)
    assert check_name(name) == name
    assert split_partition(name) == (topic, index)


# --- records --------------------------------------------------------------------------------


def test_topic_records_round_trip_through_json():
    record = TopicRecord(4, TopicPolicies(retention_bytes=10**9, deduplication=False), created_ms=1_700_000_000_000)
    data = record.to_bytes()
    assert json.loads(data)["policies"]["retention_bytes"] == 10**9
    assert TopicRecord.from_bytes(data) == record
    assert record.partition_names("orders") == [f"orders-partition-{index}" for index in range(4)]
    assert TopicRecord(0).partition_names("orders") == ["orders"]


def test_a_topic_record_without_policies_takes_the_defaults():
    assert TopicRecord.from_bytes(b'{"partitions": 0}') == TopicRecord(0, TopicPolicies(), 0)


def test_a_topic_record_with_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown topic policies"):
        TopicRecord.from_bytes(b'{"partitions": 0, "policies": {"ttl": 5}}')


def test_managed_ledger_records_round_trip_with_closed_and_open_ledgers():
    # Two closed ledgers (one empty) and the open one, whose counts the
    # record learns only at its close.
    closed = LedgerInfo(11, 0, 100).closed(entries=5, messages=12, bytes_=4096, closed_ms=200)
    empty = LedgerInfo(12, 12, 200).closed(entries=0, messages=0, bytes_=0, closed_ms=300)
    open_ledger = LedgerInfo(13, 12, 300)
    record = ManagedLedgerRecord((closed, empty, open_ledger))
    assert ManagedLedgerRecord.from_bytes(record.to_bytes()) == record
    assert closed.is_closed and closed.last_offset == 11 and empty.last_offset == 11
    assert not open_ledger.is_closed
    with pytest.raises(AssertionError):
        open_ledger.last_offset
    assert ManagedLedgerRecord.from_bytes(ManagedLedgerRecord().to_bytes()) == ManagedLedgerRecord()


ledger_infos = st.builds(
    LedgerInfo,
    st.integers(0, 2**63 - 1),
    st.integers(0, 2**40),
    st.integers(0, 2**45),
    st.none() | st.integers(0, 10**6),
    st.none() | st.integers(0, 10**9),
    st.none() | st.integers(0, 2**40),
    st.none() | st.integers(0, 2**45),
)
policies = st.builds(
    TopicPolicies,
    retention_time_ms=st.none() | st.integers(0, 2**40),
    retention_bytes=st.none() | st.integers(0, 2**50),
    backlog_quota_bytes=st.none() | st.integers(0, 2**50),
    rollover_entries=st.integers(1, 10**6),
    deduplication=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(ledger_infos, max_size=5), st.integers(0, 10_000), policies, st.integers(0, 2**45))
def test_records_round_trip(ledgers, partitions, topic_policies, created_ms):
    ledger_record = ManagedLedgerRecord(tuple(ledgers))
    assert ManagedLedgerRecord.from_bytes(ledger_record.to_bytes()) == ledger_record
    topic_record = TopicRecord(partitions, topic_policies, created_ms)
    assert TopicRecord.from_bytes(topic_record.to_bytes()) == topic_record


# --- bounded error messages --------------------------------------------------------------------

# A peer's values reach these messages (admin requests, a client's names):
# whatever their size, the message stays short and says what is wrong.
MESSAGE_CHARS_MAX = 500


@pytest.mark.parametrize(
    "values, names",
    [
        ({"retention_bytes": b"x" * 1_000_000}, ["retention_bytes", "binary of 1000000 bytes"]),
        ({"rollover_entries": "7" * 1_000_000}, ["rollover_entries", "..."]),
        ({"ensemble_size": [0] * 100_000}, ["ensemble_size", "an array of 100000"]),
        ({"rollover_min_time_ms": {str(index): index for index in range(10_000)}}, ["rollover_min_time_ms", "a map of 10000"]),
        ({"x" * 1_000_000: 1}, ["unknown topic policies", "'xxx"]),
        ({b"x" * 1_000_000: 1, **{f"name{index}": 1 for index in range(100)}}, ["binary of 1000000 bytes", "and 96 more"]),
    ],
)
def test_a_huge_policy_value_or_name_gives_a_short_message(values, names):
    with pytest.raises(ValueError) as raised:
        TopicPolicies.from_dict(values)
    message = str(raised.value)
    assert len(message) < MESSAGE_CHARS_MAX, message
    for name in names:
        assert name in message


@pytest.mark.parametrize(
    "name, shown",
    [
        ("x" * 1_000_000, "of 1000000 characters"),
        ("x" * 201, "of 201 characters"),
        ("\U0001f600" * 250, "of 250 characters"),
        ("-" + "\x00" * 150, "..."),  # short enough to show, cut to its first characters
        (b"x" * 1_000_000, "binary of 1000000 bytes"),
        (["orders"] * 100_000, "an array of 100000"),
    ],
)
def test_a_huge_or_odd_name_gives_a_short_message(name, shown):
    with pytest.raises(ValueError) as raised:
        check_name(name)
    message = str(raised.value)
    assert len(message) < MESSAGE_CHARS_MAX, message
    assert message.startswith("bad topic name ") and shown in message and "1-200 characters" in message
