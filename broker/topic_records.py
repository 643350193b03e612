"""The broker's records and names, pure (no I/O): topic, partition,
subscription and producer names and their bounds, where each record lives in
ZooKeeper (inside the cluster's chroot), and the records themselves:

    /brokers/<broker id>                    ephemeral: a live broker and its address
    /topics/<topic>                         a topic: partitions, policies
    /owners/<partition>                     ephemeral: the broker serving a partition
    /managed-ledgers/<partition>            its ledgers (versioned; compare-and-set)
    /managed-ledgers/<partition>/dedup      the producers' deduplication snapshot
    /managed-ledgers/<partition>/cursors/<subscription>   a durable cursor
    /schemas/<topic>                        the schema Pulsar clients gave
    /tenants/<tenant>[/<namespace>]         tenants and namespaces: admin roles, grants

Topics of a namespace other than public/default are named
TENANT/NAMESPACE/TOPIC; in a node's name their slashes are `%2F`.

A partition is a topic itself when the topic is not partitioned, else
`<topic>-partition-<i>` (Pulsar's naming). Records are JSON.
"""


from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from broker.schema_compatibility import Strategy
from framing.codec import describe

# A topic, partition, subscription or producer name: a ZooKeeper node name,
# a metric label and a word in log lines and error messages, so short. Its
# length is checked before anything else is done with it (a peer may send a
# name of megabytes).
NAME_CHARS_MAX = 200
# Matched with fullmatch: `$` would also match before a final newline.
NAME_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:=-]{{0,{NAME_CHARS_MAX - 1}}}")
# Unknown policy names shown in an error message; the rest are counted.
UNKNOWN_POLICIES_SHOWN_MAX = 5
TOPIC_CHARS_MAX = 3 * NAME_CHARS_MAX + 2  # TENANT/NAMESPACE/TOPIC
PARTITION_SUFFIX = re.compile(r"(?P<topic>.+)-partition-(?P<index>0|[1-9][0-9]{0,5})")
PARTITIONS_MAX = 10_000
RETENTION_MODELS = ("pulsar", "ydb")  # see TopicPolicies
SCHEMA_STRATEGIES = tuple(strategy.value for strategy in Strategy)

BROKERS = "/brokers"
TOPICS = "/topics"
OWNERS = "/owners"
MANAGED_LEDGERS = "/managed-ledgers"
SCHEMAS = "/schemas"  # a topic's schema, as Pulsar's clients give it (one per topic)
TENANTS = "/tenants"  # /tenants/<tenant> (TenantInfo), /tenants/<tenant>/<namespace> (NamespacePolicies)


def check_name(name: str, what: str = "topic") -> str:
    """`name` if it is a good name; else ValueError, whose message shows
    the name bounded (`describe`), whatever its size and type. A topic (or
    partition) of a namespace other than public/default is named
    TENANT/NAMESPACE/TOPIC, each part a good name."""
    if what == "topic" and isinstance(name, str) and "/" in name and len(name) <= TOPIC_CHARS_MAX:
        parts = name.split("/")
        if parts[:2] == ["public", "default"]:
            # One name per topic: public/default's keep their short names.
            raise ValueError(f"a topic of public/default is named without its namespace: {describe(parts[2])}")
        if len(parts) == 3 and all(NAME_PATTERN.fullmatch(part) for part in parts):
            return name
        raise ValueError(f"bad topic name {describe(name)}: TENANT/NAMESPACE/TOPIC, each 1-{NAME_CHARS_MAX} "
                         f"characters of letters, digits and _ . : = -, starting with a letter or digit")
    if not isinstance(name, str) or len(name) > NAME_CHARS_MAX or not NAME_PATTERN.fullmatch(name):
        shown = f"of {len(name)} characters" if isinstance(name, str) and len(name) > NAME_CHARS_MAX else describe(name)
        raise ValueError(
            f"bad {what} name {shown}: 1-{NAME_CHARS_MAX} characters of letters, digits and _ . : = -, "
            f"starting with a letter or digit"
        )
    return name


def partition_name(topic: str, index: int) -> str:
    """The name of partition `index` of a partitioned topic (-1: the topic itself)."""
    return topic if index < 0 else f"{topic}-partition-{index}"


def split_partition(name: str) -> tuple[str, int]:
    """(topic, partition index) of a partition's name; index -1 when the
    name does not look like a partition of a partitioned topic."""
    match = PARTITION_SUFFIX.fullmatch(name)
    if match is None:
        return name, -1
    return match.group("topic"), int(match.group("index"))


def broker_path(broker_id: str) -> str:
    return f"{BROKERS}/{broker_id}"


def node_name(name: str) -> str:
    """A topic or partition name as one ZooKeeper node name: the slashes of
    TENANT/NAMESPACE/TOPIC become `%2F` (no good name holds a `%`)."""
    return name.replace("/", "%2F")


def name_of_node(node: str) -> str:
    return node.replace("%2F", "/")


def topic_path(topic: str) -> str:
    return f"{TOPICS}/{node_name(topic)}"


def owner_path(partition: str) -> str:
    return f"{OWNERS}/{node_name(partition)}"


def managed_ledger_path(partition: str) -> str:
    return f"{MANAGED_LEDGERS}/{node_name(partition)}"


def schema_path(topic: str) -> str:
    return f"{SCHEMAS}/{node_name(topic)}"


def dedup_path(partition: str) -> str:
    return f"{managed_ledger_path(partition)}/dedup"


def compaction_path(partition: str) -> str:
    return f"{managed_ledger_path(partition)}/compaction"


def cursors_path(partition: str) -> str:
    return f"{managed_ledger_path(partition)}/cursors"


def cursor_path(partition: str, subscription: str) -> str:
    return f"{managed_ledger_path(partition)}/cursors/{subscription}"


def tenant_path(tenant: str) -> str:
    return f"{TENANTS}/{tenant}"


def namespace_path(tenant: str, namespace: str) -> str:
    return f"{TENANTS}/{tenant}/{namespace}"


# --- records -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TopicPolicies:
    """A topic's limits. None means no limit.

    Retention, by `retention_model`:
    - "pulsar" (the default, Pulsar's): every durable subscription's
      unacknowledged backlog is kept until acknowledged; retention time and
      size apply to what every subscription has acknowledged; the backlog
      quota bounds the bytes from the oldest unacknowledged message on.
    - "ydb" (YDB's topics): retention deletes whatever it reaches except what
      an important subscription has not acknowledged; the backlog quota
      bounds everything the partition stores.
    """

    retention_time_ms: int | None = None  # closed ledgers older than this may go
    retention_bytes: int | None = None  # beyond the newest this many bytes, ledgers may go
    backlog_quota_bytes: int | None = None  # a partition whose backlog (see above) holds more refuses producers
    retention_model: str = "pulsar"
    rollover_entries: int = 50_000
    rollover_bytes: int = 256 * 1024 * 1024
    rollover_time_ms: int = 4 * 3600 * 1000  # a ledger older than this is closed and a new one started
    rollover_idle_ms: int = 10 * 60 * 1000  # ... and one nobody wrote to for this long
    # A ledger younger than this does not roll over for its entries or bytes
    # (Pulsar's managedLedgerMinLedgerRolloverTimeMinutes): it bounds how
    # fast the ledger list, one ZooKeeper node, grows on a busy topic.
    rollover_min_time_ms: int = 10 * 60 * 1000
    deduplication: bool = True
    # Pulsar's message TTL: messages published longer ago than this are
    # acknowledged on behalf of every subscription (None: never).
    message_ttl_s: int | None = None
    # Pulsar's compaction threshold: once the messages after the last
    # compaction hold this many bytes, the partition is compacted (None: only
    # when asked).
    compaction_threshold_bytes: int | None = None
    # Which new schemas a topic takes (Pulsar's schemaCompatibilityStrategy;
    # broker.schema_compatibility.Strategy).
    schema_compatibility_strategy: str = "FULL"
    ensemble_size: int = 3
    write_quorum: int = 3
    ack_quorum: int = 2

    def __post_init__(self) -> None:
        for name in ("retention_time_ms", "retention_bytes", "backlog_quota_bytes", "message_ttl_s", "compaction_threshold_bytes"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {describe(value)}")
        for name in ("rollover_entries", "rollover_bytes", "rollover_time_ms", "rollover_idle_ms"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {describe(value)}")
        if type(self.rollover_min_time_ms) is not int or self.rollover_min_time_ms < 0:
            raise ValueError(f"rollover_min_time_ms must be a non-negative integer, got {describe(self.rollover_min_time_ms)}")
        if type(self.deduplication) is not bool:
            raise ValueError("deduplication must be true or false")
        if self.schema_compatibility_strategy not in SCHEMA_STRATEGIES:
            raise ValueError(f"schema_compatibility_strategy must be one of {', '.join(SCHEMA_STRATEGIES)}, "
                             f"got {describe(self.schema_compatibility_strategy)}")
        if self.retention_model not in RETENTION_MODELS:
            raise ValueError(f"retention_model must be one of {', '.join(RETENTION_MODELS)}, got {describe(self.retention_model)}")
        for name in ("ensemble_size", "write_quorum", "ack_quorum"):
            value = getattr(self, name)
            if type(value) is not int:
                raise ValueError(f"{name} must be an integer, got {describe(value)}")
        if not (self.ensemble_size >= self.write_quorum >= self.ack_quorum >= 1):
            raise ValueError(
                f"need ensemble_size >= write_quorum >= ack_quorum >= 1, got "
                f"{self.ensemble_size}/{self.write_quorum}/{self.ack_quorum}"
            )

    def to_dict(self) -> dict[str, Any]:
        # Every field is a plain value: no need for asdict's deep copy (every
        # stats answer carries a partition's policies).
        return {name: getattr(self, name) for name in _POLICY_NAMES}

    @classmethod
    def from_dict(cls, values: dict[str, Any], base: "TopicPolicies | None" = None) -> "TopicPolicies":
        """Policies from a map, unknown names refused; names not given keep
        `base`'s values."""
        known = {item.name for item in fields(cls)}
        unknown = [name for name in values if name not in known]
        if unknown:
            # The names are a peer's: each shown bounded, and only the first few.
            shown = [describe(name) for name in unknown[:UNKNOWN_POLICIES_SHOWN_MAX]]
            more = len(unknown) - len(shown)
            raise ValueError(f"unknown topic policies [{', '.join(shown)}]{f' and {more} more' if more else ''}; "
                             f"known: {sorted(known)}")
        return replace(base or cls(), **values)


_POLICY_NAMES = tuple(item.name for item in fields(TopicPolicies))

# The policies a namespace may set for its topics (Pulsar's namespace
# policies); a topic's own setting of one wins over its namespace's.
NAMESPACE_POLICY_NAMES = ("retention_time_ms", "retention_bytes", "backlog_quota_bytes", "deduplication", "message_ttl_s",
                          "schema_compatibility_strategy", "compaction_threshold_bytes")


def check_namespace_policies(values: dict[str, Any]) -> dict[str, Any]:
    """`values` if they are policies a namespace may set, each valid; else ValueError."""
    unknown = [describe(name) for name in values if name not in NAMESPACE_POLICY_NAMES]
    if unknown:
        raise ValueError(f"a namespace sets only {', '.join(NAMESPACE_POLICY_NAMES)}; not {', '.join(unknown[:5])}")
    TopicPolicies.from_dict(values)
    return dict(values)


@dataclass(frozen=True)
class TopicRecord:
    partitions: int  # 0: not partitioned
    policies: TopicPolicies = field(default_factory=TopicPolicies)
    created_ms: int = 0
    # The policies set on the topic itself (at its creation or since), which
    # its namespace's do not override; the others in `policies` are the
    # broker's defaults at its creation. None for a record written before
    # this was kept: then the policies that differ from the defaults.
    own_policies: frozenset[str] | None = None

    def own_policy_names(self) -> frozenset[str]:
        if self.own_policies is not None:
            return self.own_policies
        defaults = TopicPolicies()
        return frozenset(item.name for item in fields(TopicPolicies) if getattr(self.policies, item.name) != getattr(defaults, item.name))

    def policies_under(self, namespace_policies: dict[str, Any]) -> TopicPolicies:
        """The topic's policies in effect: its own, then its namespace's, then the defaults it was made with."""
        own = self.own_policy_names()
        inherited = {name: value for name, value in namespace_policies.items() if name not in own}
        return TopicPolicies.from_dict(inherited, self.policies) if inherited else self.policies

    def partition_names(self, topic: str) -> list[str]:
        if self.partitions == 0:
            return [topic]
        return [partition_name(topic, index) for index in range(self.partitions)]

    def to_bytes(self) -> bytes:
        record = {"partitions": self.partitions, "policies": self.policies.to_dict(), "created_ms": self.created_ms}
        if self.own_policies is not None:
            record["own_policies"] = sorted(self.own_policies)
        return json.dumps(record, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "TopicRecord":
        record = json.loads(data)
        own = record.get("own_policies")
        return cls(record["partitions"], TopicPolicies.from_dict(record.get("policies", {})), record.get("created_ms", 0),
                   None if own is None else frozenset(own))


@dataclass(frozen=True)
class LedgerInfo:
    """One ledger of a partition. `entries`, `messages` and `bytes` are None
    while it is open (the owner knows them; the record learns them at its close)."""

    ledger_id: int
    first_offset: int
    created_ms: int
    entries: int | None = None
    messages: int | None = None
    bytes: int | None = None
    closed_ms: int | None = None

    @property
    def is_closed(self) -> bool:
        return self.entries is not None

    @property
    def last_offset(self) -> int:
        assert self.messages is not None, "an open ledger's last offset is not in the record"
        return self.first_offset + self.messages - 1

    def closed(self, entries: int, messages: int, bytes_: int, closed_ms: int) -> "LedgerInfo":
        return replace(self, entries=entries, messages=messages, bytes=bytes_, closed_ms=closed_ms)


@dataclass(frozen=True)
class ManagedLedgerRecord:
    ledgers: tuple[LedgerInfo, ...] = ()

    # One array per ledger, in this order: the record is one ZooKeeper node
    # (1 MB at most), so each ledger takes some 60 bytes, not 150.
    _FIELDS = ("ledger_id", "first_offset", "created_ms", "entries", "messages", "bytes", "closed_ms")

    def to_bytes(self) -> bytes:
        rows = [[getattr(info, name) for name in self._FIELDS] for info in self.ledgers]
        return json.dumps({"fields": list(self._FIELDS), "ledgers": rows}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "ManagedLedgerRecord":
        record = json.loads(data)
        names = record.get("fields")
        if names is None:  # one object per ledger
            return cls(tuple(LedgerInfo(**info) for info in record["ledgers"]))
        return cls(tuple(LedgerInfo(**dict(zip(names, row))) for row in record["ledgers"]))


__all__ = [
    "BROKERS", "MANAGED_LEDGERS", "NAME_CHARS_MAX", "OWNERS", "PARTITIONS_MAX", "TENANTS", "TOPICS", "TOPIC_CHARS_MAX",
    "NAMESPACE_POLICY_NAMES", "LedgerInfo", "ManagedLedgerRecord", "TopicPolicies", "check_namespace_policies", "TopicRecord", "broker_path", "check_name", "compaction_path", "cursor_path",
    "cursors_path", "dedup_path", "managed_ledger_path", "name_of_node", "namespace_path", "node_name", "owner_path",
    "partition_name", "split_partition", "tenant_path", "topic_path",
]
