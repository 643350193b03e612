"""What brokers keep in ZooKeeper, read and written with trio: the records
of `broker.topic_records`, at the paths it names.
"""

from __future__ import annotations

import json
import time

import trio

from broker.compaction_core import CompactionRecord
from broker.topic_records import (
    BROKERS,
    MANAGED_LEDGERS,
    OWNERS,
    PARTITIONS_MAX,
    SCHEMAS,
    TOPICS,
    ManagedLedgerRecord,
    TopicRecord,
    check_name,
    cursor_path,
    name_of_node,
    cursors_path,
    compaction_path,
    dedup_path,
    managed_ledger_path,
    schema_path,
    topic_path,
)
from coordination.async_store import AsyncMetadataStore
from coordination.store import NodeExistsError, NoNodeError

# A topic's record read through a watch is read again at least this often
# (a safety net: the watch says when it changed).
WATCHED_RECORD_AGE_MAX_S = 60.0
WATCHED_TOPICS_MAX = 100_000  # records kept by read_topic_watched; past it they are all read again


# --- the store -------------------------------------------------------------------------


def record_bytes(record: dict) -> bytes:
    """A record as stored: compact JSON (in a node, or a cursor ledger's entry)."""
    return json.dumps(record, separators=(",", ":")).encode()


class TopicStore:
    """The broker's records in the metadata store (trio)."""

    def __init__(self, store: AsyncMetadataStore) -> None:
        self.store = store
        # Namespaces' records as their topics' policy checks read them
        # (broker.tenant_store): path -> (read at, monotonic s; its policies, {} without a record).
        self.namespace_reads: dict[str, tuple[float, dict]] = {}
        self.namespace_reads_in_flight: dict[str, trio.Event] = {}  # path: set once its read ends
        # Topics' records as loaded partitions' policy checks read them:
        # topic -> (record, read at (monotonic s), set when the node changes).
        self._watched_topics: dict[str, tuple[TopicRecord, float, trio.Event]] = {}

    async def ensure_layout(self) -> None:
        for path in (BROKERS, TOPICS, OWNERS, MANAGED_LEDGERS, SCHEMAS):
            await self.store.ensure_path(path)

    # topics

    async def create_topic(self, topic: str, record: TopicRecord) -> None:
        check_name(topic)
        if not 0 <= record.partitions <= PARTITIONS_MAX:
            raise ValueError(f"partitions must be in 0..{PARTITIONS_MAX}, got {record.partitions}")
        await self.store.create(topic_path(topic), record.to_bytes(), make_parents=True)

    async def read_topic(self, topic: str, *, watch: bool = False) -> tuple[TopicRecord, int] | None:
        """The topic's record and version, read now. With `watch`, the read
        also sets a watch and becomes the copy `read_topic_watched` answers
        from: a partition's load reads its record fresh, and its policy
        checks then start from that read instead of one of their own."""
        cached = self._watched_topics.get(topic) if watch else None
        if cached is not None and not cached[2].is_set():
            # Its watch is still set (ZooKeeper keeps one per path and
            # client, kazoo one per call): a fresh read keeps it.
            changed = cached[2]
            watch_again = False
        else:
            watch_again = watch
        try:
            if watch_again:
                data, stat, changed = await self.store.get_watch(topic_path(topic))
            else:
                data, stat = await self.store.get(topic_path(topic))
        except NoNodeError:
            if watch:
                self._watched_topics.pop(topic, None)
            return None
        record = TopicRecord.from_bytes(data)
        if watch:
            if len(self._watched_topics) >= WATCHED_TOPICS_MAX:
                self._watched_topics.clear()
            self._watched_topics[topic] = (record, time.monotonic(), changed)
        return record, stat.version

    async def read_topic_watched(self, topic: str) -> TopicRecord | None:
        """The topic's record as of its last change: read again only once
        the node changed (a ZooKeeper watch says so) or after
        WATCHED_RECORD_AGE_MAX_S. Every loaded partition checks its
        policies every few seconds: a broker with thousands of partitions
        would otherwise read thousands of records a second, most unchanged.
        None when the topic does not exist."""
        cached = self._watched_topics.get(topic)
        if cached is not None and not cached[2].is_set() and time.monotonic() - cached[1] < WATCHED_RECORD_AGE_MAX_S:
            return cached[0]
        found = await self.read_topic(topic, watch=True)
        return None if found is None else found[0]

    async def write_topic(self, topic: str, record: TopicRecord, expected_version: int) -> None:
        await self.store.set(topic_path(topic), record.to_bytes(), expected_version)

    async def delete_topic_record(self, topic: str) -> None:
        try:
            await self.store.delete(topic_path(topic))
        except NoNodeError:
            pass

    async def list_topics(self) -> list[str]:
        try:
            return sorted(name_of_node(node) for node in await self.store.children(TOPICS))
        except NoNodeError:
            return []

    # schemas: the bytes a Pulsar client gave (a Schema message), one per
    # version. /schemas/<topic> holds version 0, and its children
    # /schemas/<topic>/<version> (ten digits) the later ones.

    async def schema_versions(self, topic: str) -> list[tuple[int, bytes]]:
        """Every version of the topic's schema, oldest first: (version, data)."""
        path = schema_path(topic)
        try:
            first, _ = await self.store.get(path)
            names = await self.store.children(path)
        except NoNodeError:
            return []
        versions = [(0, first)]
        for name in sorted(name for name in names if name.isdigit()):
            try:
                data, _ = await self.store.get(f"{path}/{name}")
            except NoNodeError:
                continue  # deleted meanwhile
            versions.append((int(name), data))
        return versions

    async def read_schema(self, topic: str, version: int) -> tuple[bytes, int] | None:
        """Version `version` of the topic's schema (data, version); None if there is none."""
        path = schema_path(topic) if version == 0 else f"{schema_path(topic)}/{version:010d}"
        try:
            data, _ = await self.store.get(path)
        except NoNodeError:
            return None
        return data, version

    async def add_schema(self, topic: str, data: bytes, after: int | None) -> int | None:
        """Store `data` as the version after `after` (None: the first);
        returns its version, or None when another broker stored that
        version first (read them again and decide again)."""
        path = schema_path(topic)
        try:
            if after is None:
                await self.store.create(path, data, make_parents=True)
                return 0
            await self.store.create(f"{path}/{after + 1:010d}", data)
            return after + 1
        except NodeExistsError:
            return None

    async def delete_schema(self, topic: str) -> None:
        """Every version of the topic's schema."""
        try:
            await self.store.delete(schema_path(topic), recursive=True)
        except NoNodeError:
            pass

    # managed ledgers

    async def read_managed_ledger(self, partition: str) -> tuple[ManagedLedgerRecord, int] | None:
        try:
            data, stat = await self.store.get(managed_ledger_path(partition))
        except NoNodeError:
            return None
        return ManagedLedgerRecord.from_bytes(data), stat.version

    async def create_managed_ledger(self, partition: str) -> tuple[ManagedLedgerRecord, int]:
        """An empty record, or the existing one if another broker made it first."""
        record = ManagedLedgerRecord()
        try:
            await self.store.create(managed_ledger_path(partition), record.to_bytes(), make_parents=True)
            return record, 0
        except NodeExistsError:
            existing = await self.read_managed_ledger(partition)
            assert existing is not None, "a managed ledger record vanished while being created"
            return existing

    async def write_managed_ledger(self, partition: str, record: ManagedLedgerRecord, expected_version: int) -> int:
        """Compare-and-set; BadVersionError when another broker changed it."""
        stat = await self.store.set(managed_ledger_path(partition), record.to_bytes(), expected_version)
        return stat.version

    async def delete_partition_records(self, partition: str) -> None:
        try:
            await self.store.delete(managed_ledger_path(partition), recursive=True)
        except NoNodeError:
            pass

    # cursors and deduplication snapshots

    async def read_cursors(self, partition: str) -> dict[str, tuple[dict, int]]:
        """Every durable cursor of a partition: name -> (record, version)."""
        try:
            names = await self.store.children(cursors_path(partition))
        except NoNodeError:
            return {}
        cursors = {}
        for name in names:
            try:
                data, stat = await self.store.get(cursor_path(partition, name))
            except NoNodeError:
                continue
            cursors[name] = (json.loads(data), stat.version)
        return cursors

    async def write_cursor(self, partition: str, subscription: str, record: dict, expected_version: int | None) -> int:
        """Compare-and-set (create when `expected_version` is None); a
        BadVersionError or NodeExistsError means another broker took the
        partition over. Returns the new version."""
        return await self._write_versioned(cursor_path(partition, subscription), record, expected_version)

    async def delete_cursor(self, partition: str, subscription: str, *, expected_version: int | None = None) -> None:
        """Delete a cursor (gone already is no error); with
        `expected_version`, only at that version (BadVersionError)."""
        try:
            if expected_version is None:
                await self.store.delete(cursor_path(partition, subscription))
            else:
                await self.store.delete(cursor_path(partition, subscription), expected_version)
        except NoNodeError:
            pass

    async def read_dedup(self, partition: str) -> tuple[dict, int] | None:
        try:
            data, stat = await self.store.get(dedup_path(partition))
        except NoNodeError:
            return None
        return json.loads(data), stat.version

    async def write_dedup(self, partition: str, record: dict, expected_version: int | None) -> int:
        return await self._write_versioned(dedup_path(partition), record, expected_version)

    async def read_compaction(self, partition: str) -> tuple[CompactionRecord, int] | None:
        try:
            data, stat = await self.store.get(compaction_path(partition))
        except NoNodeError:
            return None
        return CompactionRecord.from_dict(json.loads(data)), stat.version

    async def write_compaction(self, partition: str, record: CompactionRecord, expected_version: int | None) -> int:
        """Compare-and-set (create when `expected_version` is None)."""
        return await self._write_versioned(compaction_path(partition), record.to_dict(), expected_version)

    async def _write_versioned(self, path: str, record: dict, expected_version: int | None) -> int:
        data = record_bytes(record)
        if expected_version is None:
            await self.store.create(path, data, make_parents=True)
            return 0
        stat = await self.store.set(path, data, expected_version)
        return stat.version


__all__ = ["TopicStore", "record_bytes"]
