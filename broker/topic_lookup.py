"""What a client asks before it opens a producer or consumer, answered the
same for Pulsar's binary protocol and for HTTP (`/lookup/v2`,
`/admin/v2/.../partitions`): how many partitions a topic has, which broker
serves a partition, and the topics of a namespace.
"""

from __future__ import annotations

from typing import Any, Protocol

from broker.ownership import BrokerInfo
from broker.topic_names import namespace_of_topic, pulsar_name
from broker.topic_records import TopicRecord, split_partition
from broker.topic_store import TopicStore


class LookupBackend(Protocol):
    """What the lookups need of their broker (BrokerServer is one)."""

    topic_store: TopicStore
    access: Any

    async def topic_record(self, topic: str, *, create: bool) -> TopicRecord: ...

    async def lookup(self, partition: str, authoritative: bool) -> tuple[BrokerInfo, bool]: ...


async def partition_count(broker: LookupBackend, name: str, role: str | None, *, create: bool) -> int:
    """The partitions of topic `name` (0: not partitioned), for a client of
    `role`; with `create`, a topic named for the first time is made (when
    the broker creates topics on first use). A partition of a partitioned
    topic is a topic of its own to a client: 0."""
    await broker.access.check_topic(role, name, None, "look up")
    topic, index = split_partition(name)
    if index >= 0 and (await broker.topic_store.read_topic(name)) is None:
        return 0
    return (await broker.topic_record(name, create=create)).partitions


async def lookup_partition(broker: LookupBackend, name: str, role: str | None, *, authoritative: bool) -> tuple[BrokerInfo, bool]:
    """(the broker serving partition `name`, whether the client is to ask
    that broker again with authority), for a client of `role`. A topic
    named for the first time is created (see ensure_topic)."""
    await broker.access.check_topic(role, name, None, "look up")
    await ensure_topic(broker, name)
    return await broker.lookup(name, authoritative)


async def ensure_topic(broker: LookupBackend, name: str) -> None:
    """A topic named for the first time is created, not partitioned (as
    Pulsar does by default); a partition's topic must exist."""
    topic, index = split_partition(name)
    if index >= 0 and (await broker.topic_store.read_topic(topic)) is not None:
        return
    await broker.topic_record(name, create=True)


async def topics_of_namespace(broker: LookupBackend, namespace: str, role: str | None) -> list[str]:
    """The Pulsar names of the namespace's topics and partitions (each
    partition of a partitioned topic, not the topic), sorted."""
    await broker.access.check_in_namespace(role, namespace, None, f"list the topics of namespace {namespace}")
    names = []
    for topic in await broker.topic_store.list_topics():
        if namespace_of_topic(topic) != namespace:
            continue
        found = await broker.topic_store.read_topic(topic)
        if found is not None:
            names.extend(pulsar_name(partition) for partition in found[0].partition_names(topic))
    return sorted(names)


__all__ = ["LookupBackend", "ensure_topic", "lookup_partition", "partition_count", "topics_of_namespace"]
