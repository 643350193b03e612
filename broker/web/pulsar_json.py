"""quire's admin answers in the JSON shapes of Pulsar's REST API, and
Pulsar's request bodies as quire's arguments: tenants (TenantInfo),
retention and backlog quota policies, topic stats (TopicStats) and
internal stats (PersistentTopicInternalStats). Pure: dictionaries in,
dictionaries out.

Where quire counts something differently from Pulsar, the Pulsar field is
left out rather than filled with a guess: quire's subscriptions keep an
offset, not a ledger:entry position, so the internal stats give
`markDeleteOffset` and no `markDeletePosition`.
"""

from __future__ import annotations

import datetime
from typing import Any

from broker.errors import BadRequestError, NotAllowedError
from broker.topic_names import pulsar_name

MB = 1024 * 1024
MINUTE_MS = 60_000

SUBSCRIPTION_TYPES = {"exclusive": "Exclusive", "failover": "Failover", "shared": "Shared", "key_shared": "Key_Shared"}
# Pulsar's backlog quota policies; quire refuses producers past the quota,
# which is Pulsar's producer_exception.
BACKLOG_POLICY = "producer_exception"
BACKLOG_POLICIES = ("producer_request_hold", "producer_exception", "consumer_backlog_eviction")
DESTINATION_STORAGE = "destination_storage"


def _names(value: Any, field: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise BadRequestError(f"{field} must be a list of strings")
    return value


def tenant_arguments(body: Any) -> dict:
    """A TenantInfo body ({"adminRoles": [...], "allowedClusters": [...]})
    as the admin handler's arguments."""
    if not isinstance(body, dict):
        raise BadRequestError("a tenant's body is a JSON object with adminRoles and allowedClusters")
    return {"admin_roles": _names(body.get("adminRoles"), "adminRoles"),
            "allowed_clusters": _names(body.get("allowedClusters"), "allowedClusters")}


def tenant_json(answer: dict) -> dict:
    return {"adminRoles": list(answer["admin_roles"]), "allowedClusters": list(answer["allowed_clusters"])}


def _int_field(body: dict, name: str) -> int:
    value = body.get(name)
    if type(value) is not int:
        raise BadRequestError(f"{name} must be an integer")
    return value


def retention_policies(body: Any) -> dict:
    """Pulsar's RetentionPolicies as quire's policies: -1 is no limit."""
    if not isinstance(body, dict):
        raise BadRequestError("retention is {\"retentionTimeInMinutes\": N, \"retentionSizeInMB\": N}")
    minutes, size_mb = _int_field(body, "retentionTimeInMinutes"), _int_field(body, "retentionSizeInMB")
    if minutes < -1 or size_mb < -1:
        raise BadRequestError("retention time and size are -1 (no limit), 0 or more")
    return {"retention_time_ms": None if minutes == -1 else minutes * MINUTE_MS,
            "retention_bytes": None if size_mb == -1 else size_mb * MB}


def retention_json(policies: dict) -> dict:
    time_ms, size = policies.get("retention_time_ms"), policies.get("retention_bytes")
    return {"retentionTimeInMinutes": -1 if time_ms is None else time_ms // MINUTE_MS,
            "retentionSizeInMB": -1 if size is None else size // MB}


def backlog_quota_policies(body: Any, quota_type: str | None) -> dict:
    """Pulsar's BacklogQuota (destination_storage: a size) as quire's policies."""
    if quota_type not in (None, DESTINATION_STORAGE):
        if quota_type == "message_age":
            raise NotAllowedError(f"quire keeps a backlog quota by size ({DESTINATION_STORAGE}), not by message age")
        raise BadRequestError(f"backlogQuotaType must be {DESTINATION_STORAGE} or message_age, got {quota_type[:50]!r}")
    if not isinstance(body, dict):
        raise BadRequestError("a backlog quota is {\"limitSize\": BYTES, \"policy\": \"producer_exception\"}")
    size = body.get("limitSize", body.get("limit"))
    if type(size) is not int or size < -1:
        raise BadRequestError("limitSize must be an integer: bytes, or -1 for no limit")
    policy = body.get("policy", BACKLOG_POLICY)
    if policy not in BACKLOG_POLICIES:
        raise BadRequestError(f"policy must be one of {', '.join(BACKLOG_POLICIES)}")
    if policy != BACKLOG_POLICY:
        raise NotAllowedError(f"quire refuses producers past the quota ({BACKLOG_POLICY}); it does not do {policy}")
    limit_time = body.get("limitTime", -1)
    if limit_time not in (-1, 0, None):
        raise NotAllowedError("quire keeps a backlog quota by size; limitTime must be -1")
    return {"backlog_quota_bytes": None if size == -1 else size}


def backlog_quota_json(policies: dict) -> dict:
    size = policies.get("backlog_quota_bytes")
    if size is None:
        return {}
    return {DESTINATION_STORAGE: {"limitSize": size, "limit": size, "limitTime": -1, "policy": BACKLOG_POLICY}}


def deduplication_policies(body: Any) -> dict:
    if type(body) is not bool:
        raise BadRequestError("deduplication is true or false")
    return {"deduplication": body}


def deduplication_json(policies: dict) -> bool:
    return policies["deduplication"]


def message_ttl_policies(body: Any) -> dict:
    if type(body) is not int or body < 0:
        raise BadRequestError("a message TTL is a number of seconds, 0 or more (0: none)")
    return {"message_ttl_s": body or None}


def message_ttl_json(policies: dict) -> int:
    return policies["message_ttl_s"] or 0


def namespace_json(answer: dict, cluster: str) -> dict:
    """A namespace (the admin handler's `namespace_policies`) as Pulsar's
    Policies: grants, and what it sets for its topics (null: not set)."""
    policies = answer["policies"]
    has_retention = "retention_time_ms" in policies or "retention_bytes" in policies
    retention = {**{name: answer["defaults"][name] for name in ("retention_time_ms", "retention_bytes")}, **policies}
    return {
        "auth_policies": {"namespace_auth": answer["permissions"], "destination_auth": {}, "subscription_auth_roles": {}},
        "replication_clusters": [cluster],
        "backlog_quota_map": backlog_quota_json(policies),
        "retention_policies": retention_json(retention) if has_retention else None,
        "deduplicationEnabled": policies.get("deduplication"),
        "message_ttl_in_seconds": policies.get("message_ttl_s"),
        "compaction_threshold": policies.get("compaction_threshold_bytes"),
        "schema_compatibility_strategy": policies.get("schema_compatibility_strategy", "UNDEFINED"),
        "deleted": False,
    }


def topic_stats(partition: dict) -> dict:
    """A partition's description (PartitionService.describe) as Pulsar's TopicStats."""
    subscriptions = {}
    for name, subscription in partition["subscriptions"].items():
        subscriptions[name] = {
            "msgRateOut": subscription["messages_out_per_s"],
            "msgOutCounter": subscription["messages_out"],
            "msgBacklog": subscription["backlog_messages"],
            "unackedMessages": subscription["unacknowledged_messages"],
            "type": SUBSCRIPTION_TYPES.get(subscription["type"], subscription["type"]),
            "isDurable": subscription["durable"],
            "msgRateExpired": subscription["expired_per_s"],
            "totalMsgExpired": subscription.get("expired_messages", 0),
            "msgDelayed": subscription.get("delayed_messages", 0),
            "consumers": [{"consumerName": consumer["name"], "availablePermits": consumer["permits"],
                           "unackedMessages": consumer["unacknowledged"], "msgOutCounter": consumer["messages_out"]}
                          for consumer in subscription["consumers"]],
        }
    policies = partition["policies"]
    return {
        "msgRateIn": partition["messages_in_per_s"],
        "msgThroughputIn": partition["bytes_in_per_s"],
        "msgRateOut": partition["messages_out_per_s"],
        "msgInCounter": partition["messages_in"],
        "bytesInCounter": partition["bytes_in"],
        "msgOutCounter": partition["messages_out"],
        "storageSize": partition["stored_bytes"],
        "backlogSize": partition.get("backlog_bytes", 0),
        "publishers": [{"producerName": producer["producer_id"], "msgInCounter": producer["messages_in"]}
                       for producer in partition["producers"]],
        "subscriptions": subscriptions,
        "replication": {},
        "deduplicationStatus": "Enabled" if policies.get("deduplication") else "Disabled",
        "earliestMsgPublishTimeInBacklogs": 0,
        **({"compaction": compaction_json(partition["compaction"])} if "compaction" in partition else {}),
    }


def _sum(values: list[Any]) -> Any:
    return round(sum(values), 1) if any(isinstance(value, float) for value in values) else sum(values)


def partitioned_stats(partitions: dict[str, dict], *, per_partition: bool) -> dict:
    """Pulsar's PartitionedTopicStats: the partitions' TopicStats summed,
    each partition's with `perPartition`. `partitions` maps each
    partition's quire name to its TopicStats."""
    stats_list = list(partitions.values())
    summed: dict[str, Any] = {
        field: _sum([stats[field] for stats in stats_list])
        for field in ("msgRateIn", "msgThroughputIn", "msgRateOut", "msgInCounter", "bytesInCounter", "msgOutCounter",
                      "storageSize", "backlogSize")
    }
    subscriptions: dict[str, dict] = {}
    for stats in stats_list:
        for name, subscription in stats["subscriptions"].items():
            total = subscriptions.get(name)
            if total is None:
                subscriptions[name] = {**subscription, "consumers": list(subscription["consumers"])}
                continue
            for field in ("msgRateOut", "msgOutCounter", "msgBacklog", "unackedMessages", "msgRateExpired", "totalMsgExpired",
                          "msgDelayed"):
                total[field] = _sum([total[field], subscription[field]])
            total["consumers"].extend(subscription["consumers"])
    summed.update(
        publishers=[publisher for stats in stats_list for publisher in stats["publishers"]],
        subscriptions=subscriptions,
        replication={},
        metadata={"partitions": len(partitions)},
        partitions={pulsar_name(name): stats for name, stats in partitions.items()} if per_partition else {},
    )
    return summed


def internal_stats(partition: dict) -> dict:
    """A partition's description as Pulsar's PersistentTopicInternalStats:
    its ledgers (the open one last) and its cursors."""
    ledgers = partition["ledgers"]
    open_ledger = ledgers[-1] if ledgers and ledgers[-1]["state"] == "open" else None
    return {
        "entriesAddedCounter": partition["messages_in"],
        "numberOfEntries": sum(ledger["entries"] or 0 for ledger in ledgers),
        "totalSize": partition["stored_bytes"],
        "currentLedgerEntries": open_ledger["entries"] if open_ledger else 0,
        "currentLedgerSize": open_ledger["bytes"] if open_ledger else 0,
        "lastLedgerCreatedTimestamp": _timestamp(ledgers[-1]["created_ms"]) if ledgers else "",
        "state": "LedgerOpened" if open_ledger else "ClosedLedger",
        "firstOffset": partition["first_offset"],
        "nextOffset": partition["next_offset"],
        "ledgers": [{"ledgerId": ledger["ledger_id"], "entries": ledger["entries"] or 0, "size": ledger["bytes"] or 0,
                     "offloaded": False, "underReplicated": False, "firstOffset": ledger["first_offset"],
                     "messages": ledger["messages"] or 0}
                    for ledger in ledgers],
        "cursors": {name: {"markDeleteOffset": subscription["mark_delete_offset"],
                           "individuallyDeletedRanges": subscription["individually_acknowledged_ranges"],
                           "messagesConsumedCounter": subscription["messages_out"],
                           "cursorLedger": -1 if subscription["cursor_ledger"] is None else subscription["cursor_ledger"],
                           "cursorLedgerLastEntry": subscription["cursor_ledger_entries"] - 1,
                           "unwrittenChanges": subscription["cursor_unwritten_changes"],
                           "state": "Open", "active": bool(subscription["consumers"]),
                           "properties": {}}
                    for name, subscription in partition["subscriptions"].items() if subscription["durable"]},
        "compactedLedger": _compacted_ledger(partition.get("compaction", {})),
    }


def _compacted_ledger(compaction: dict) -> dict:
    if compaction.get("ledger_id") is None:
        return {"ledgerId": -1, "entries": -1, "size": -1, "offloaded": False, "underReplicated": False}
    return {"ledgerId": compaction["ledger_id"], "entries": compaction["entries"], "size": compaction["bytes"],
            "offloaded": False, "underReplicated": False}


def compaction_json(compaction: dict) -> dict:
    """A partition's compaction (PartitionService.compaction_stats) as the
    `compaction` of Pulsar's TopicStats."""
    return {"lastCompactionRemovedEventCount": compaction["removed_messages"],
            "lastCompactionSucceedTimestamp": compaction["last_succeeded_ms"],
            "lastCompactionFailedTimestamp": compaction["last_failed_ms"],
            "lastCompactionDurationTimeInMills": compaction["duration_ms"]}


def compaction_status_json(statuses: list[dict]) -> dict:
    """Pulsar's LongRunningProcessStatus of a topic's compaction, from each
    partition's: running while one runs, failed if one failed (its
    error), succeeded when every one did."""
    for status in ("RUNNING", "ERROR"):
        found = [item for item in statuses if item["status"] == status]
        if found:
            return {"status": status, "lastError": found[0]["last_error"]}
    if statuses and all(item["status"] == "SUCCESS" for item in statuses):
        return {"status": "SUCCESS", "lastError": ""}
    return {"status": "NOT_RUN", "lastError": ""}


def compaction_threshold_policies(body: Any) -> dict:
    if type(body) is not int or body < 0:
        raise BadRequestError("a compaction threshold is a number of bytes, 0 or more (0: only when asked)")
    return {"compaction_threshold_bytes": body or None}


def compaction_threshold_json(policies: dict) -> int:
    return policies["compaction_threshold_bytes"] or 0


def _timestamp(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).isoformat(timespec="milliseconds")


__all__ = ["backlog_quota_json", "backlog_quota_policies", "deduplication_json", "deduplication_policies", "message_ttl_json",
           "message_ttl_policies", "namespace_json", "internal_stats", "partitioned_stats", "retention_json",
           "retention_policies", "tenant_arguments", "tenant_json", "topic_stats"]
