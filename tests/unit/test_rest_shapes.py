"""The pure parts behind the REST admin API: Pulsar's request bodies and
answer shapes (broker/web/pulsar_json.py), namespace policies and which
of them a topic takes (its own first), and the cursor arithmetic of an
admin's skip."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.authorization import NamespacePolicies
from broker.cursor import Cursor, RangeSet
from broker.errors import BadRequestError, NotAllowedError
from broker.topic_records import TopicPolicies, TopicRecord
from broker.web.pulsar_json import (
    backlog_quota_json,
    backlog_quota_policies,
    internal_stats,
    namespace_json,
    partitioned_stats,
    retention_json,
    retention_policies,
    tenant_arguments,
    topic_stats,
)


def test_retention_round_trips_and_minus_one_is_no_limit():
    body = {"retentionTimeInMinutes": 90, "retentionSizeInMB": 512}
    policies = retention_policies(body)
    assert policies == {"retention_time_ms": 90 * 60_000, "retention_bytes": 512 << 20}
    assert retention_json(policies) == body
    assert retention_policies({"retentionTimeInMinutes": -1, "retentionSizeInMB": -1}) == {
        "retention_time_ms": None, "retention_bytes": None}
    for bad in ({"retentionTimeInMinutes": -2, "retentionSizeInMB": 1}, {"retentionTimeInMinutes": "1"}, [], None):
        with pytest.raises(BadRequestError):
            retention_policies(bad)


def test_backlog_quota_takes_what_quire_does_and_refuses_the_rest():
    assert backlog_quota_policies({"limitSize": 1000, "policy": "producer_exception"}, None) == {"backlog_quota_bytes": 1000}
    assert backlog_quota_policies({"limitSize": -1}, "destination_storage") == {"backlog_quota_bytes": None}
    assert backlog_quota_json({"backlog_quota_bytes": 1000})["destination_storage"]["limitSize"] == 1000
    assert backlog_quota_json({}) == {}
    # Pulsar's, that quire does not do (501), and nobody's (400).
    for body, quota_type in (({"limitSize": 1, "policy": "producer_request_hold"}, None),
                             ({"limitSize": 1, "limitTime": 60}, None),
                             ({"limitSize": 1}, "message_age")):
        with pytest.raises(NotAllowedError):
            backlog_quota_policies(body, quota_type)
    for body, quota_type in (({"limitSize": 1, "policy": "nonsense"}, None),
                             ({"limitSize": 1}, "elsewhere"),
                             ({"limitSize": "big"}, None)):
        with pytest.raises(BadRequestError):
            backlog_quota_policies(body, quota_type)


def test_tenant_bodies_are_checked():
    assert tenant_arguments({"adminRoles": ["a"], "allowedClusters": ["standalone"]}) == {
        "admin_roles": ["a"], "allowed_clusters": ["standalone"]}
    assert tenant_arguments({}) == {"admin_roles": [], "allowed_clusters": []}
    for bad in ([], {"adminRoles": "a"}, {"allowedClusters": [1]}):
        with pytest.raises(BadRequestError):
            tenant_arguments(bad)


def describe(messages_in: int, backlog: int) -> dict:
    """A partition's description as PartitionService.describe gives it."""
    return {
        "partition": "t", "first_offset": 0, "next_offset": messages_in, "stored_bytes": 10 * messages_in,
        "backlog_quota_bytes": None, "messages_in": messages_in, "bytes_in": 10 * messages_in, "messages_out": 0,
        "messages_in_per_s": 1.5, "bytes_in_per_s": 15.0, "messages_out_per_s": 0.0,
        "producers": [{"producer_id": "p", "messages_in": messages_in, "last_sequence_id": messages_in - 1}],
        "subscriptions": {"s": {"type": "key_shared", "durable": True, "important": False, "mark_delete_offset": -1,
                                "individually_acknowledged_ranges": 0, "cursor_ledger": 9, "cursor_ledger_entries": 4, "cursor_unwritten_changes": 0,
                                "backlog_messages": backlog, "messages_out": 0,
                                "messages_out_per_s": 2.5, "expired_per_s": 0.5,
                                "held_for_redelivery": 0, "unacknowledged_messages": 0,
                                "consumers": [{"name": "c", "permits": 10, "unacknowledged": 0, "messages_out": 0,
                                               "active": True}]}},
        "ledgers": [{"ledger_id": 3, "first_offset": 0, "created_ms": 1_700_000_000_000, "entries": 2, "messages": messages_in,
                     "bytes": 20, "state": "open"}],
        "policies": TopicPolicies().to_dict(),
    }


def test_topic_stats_and_their_sum_over_partitions():
    stats = topic_stats(describe(7, 5))
    assert stats["msgInCounter"] == 7 and stats["storageSize"] == 70 and stats["deduplicationStatus"] == "Enabled"
    assert stats["subscriptions"]["s"]["type"] == "Key_Shared" and stats["subscriptions"]["s"]["msgBacklog"] == 5
    assert stats["subscriptions"]["s"]["msgRateOut"] == 2.5 and stats["subscriptions"]["s"]["msgRateExpired"] == 0.5
    assert stats["publishers"] == [{"producerName": "p", "msgInCounter": 7}]
    total = partitioned_stats({"t-partition-0": stats, "t-partition-1": topic_stats(describe(3, 2))}, per_partition=True)
    assert total["msgInCounter"] == 10 and total["msgRateIn"] == 3.0
    assert total["subscriptions"]["s"]["msgBacklog"] == 7 and len(total["subscriptions"]["s"]["consumers"]) == 2
    assert total["subscriptions"]["s"]["msgRateOut"] == 5.0 and total["subscriptions"]["s"]["msgRateExpired"] == 1.0
    assert set(total["partitions"]) == {"persistent://public/default/t-partition-0", "persistent://public/default/t-partition-1"}
    assert stats["subscriptions"]["s"]["msgBacklog"] == 5  # the partition's own stats are not changed by the sum
    assert partitioned_stats({"t-partition-0": stats}, per_partition=False)["partitions"] == {}


def test_internal_stats_list_the_ledgers_and_the_durable_cursors():
    internal = internal_stats(describe(7, 5))
    assert internal["ledgers"] == [{"ledgerId": 3, "entries": 2, "size": 20, "offloaded": False, "underReplicated": False,
                                    "firstOffset": 0, "messages": 7}]
    assert internal["state"] == "LedgerOpened" and internal["currentLedgerEntries"] == 2
    assert internal["cursors"]["s"]["markDeleteOffset"] == -1
    assert internal["cursors"]["s"]["cursorLedger"] == 9 and internal["cursors"]["s"]["cursorLedgerLastEntry"] == 3


def test_a_namespace_answer_has_pulsars_policy_names():
    answer = {"namespace": "a/b", "permissions": {"app": ["produce"]}, "policies": {"retention_bytes": 1 << 20},
              "defaults": TopicPolicies(retention_time_ms=60_000).to_dict()}
    shape = namespace_json(answer, "standalone")
    assert shape["auth_policies"]["namespace_auth"] == {"app": ["produce"]}
    assert shape["retention_policies"] == {"retentionTimeInMinutes": 1, "retentionSizeInMB": 1}
    assert shape["deduplicationEnabled"] is None and shape["replication_clusters"] == ["standalone"]


def test_namespace_policies_reach_topics_except_those_a_topic_sets_itself():
    namespace = NamespacePolicies().with_policies({"deduplication": False, "retention_bytes": 100})
    made_on_first_use = TopicRecord(0, TopicPolicies(retention_time_ms=5), own_policies=frozenset())
    assert made_on_first_use.policies_under(namespace.policies) == TopicPolicies(
        retention_time_ms=5, retention_bytes=100, deduplication=False)
    with_its_own = TopicRecord(0, TopicPolicies(deduplication=True), own_policies=frozenset({"deduplication"}))
    assert with_its_own.policies_under(namespace.policies).deduplication is True
    # A record written before own policies were kept: those that differ from the defaults are its own.
    older = TopicRecord(0, TopicPolicies(retention_bytes=7))
    assert older.policies_under(namespace.policies).retention_bytes == 7
    assert older.policies_under(namespace.policies).deduplication is False
    # Removing a namespace policy gives the topic back what it was made with.
    cleared = namespace.with_policies({}, ["retention_bytes"])
    assert made_on_first_use.policies_under(cleared.policies).retention_bytes is None
    assert NamespacePolicies.from_bytes(namespace.to_bytes()) == namespace
    for bad in ({"rollover_entries": 5}, {"deduplication": "yes"}, {"retention_bytes": -1}):
        with pytest.raises(ValueError):
            NamespacePolicies().with_policies(bad)
    with pytest.raises(ValueError):
        NamespacePolicies().with_policies({}, ["ensemble_size"])


def unacknowledged(cursor: Cursor, last_offset: int) -> list[int]:
    return [offset for offset in range(cursor.mark_delete + 1, last_offset + 1) if not cursor.is_acked(offset)]


@given(st.integers(-1, 30), st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4)), max_size=6), st.integers(0, 50))
def test_skipping_n_acknowledges_exactly_the_next_n_unacknowledged(mark_delete, ranges, count):
    last_offset = 45
    cursor = Cursor(mark_delete, RangeSet())
    for first, length in ranges:
        if first > mark_delete:
            cursor.acknowledge(range(first, min(first + length, last_offset) + 1))
    before = unacknowledged(cursor, last_offset)
    offset = cursor.offset_past_unacknowledged(count, last_offset)
    assert offset <= last_offset + 1
    skipped = [value for value in before if value < offset]
    assert skipped == before[:count]


async def test_only_the_listed_admin_actions_are_reachable():
    from broker.admin import ACTIONS, AdminHandler

    handler = AdminHandler(None)  # refused before the broker is touched
    for action in ("change_policies", "tenant_info", "serving_for_subscription", "__init__", "", 7, "handle"):
        with pytest.raises(BadRequestError, match="unknown admin action"):
            await handler.handle(action, {}, None)
    assert all(callable(getattr(AdminHandler, f"_{action}")) for action in ACTIONS)
