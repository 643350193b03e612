"""Tenants and namespaces in ZooKeeper, read and written with trio:
`/tenants/<tenant>` holds a TenantInfo and `/tenants/<tenant>/<namespace>`
a namespace's NamespacePolicies. public/default always exists.
"""

from __future__ import annotations

import time

import trio

from broker.authorization import NamespacePolicies, TenantInfo
from broker.errors import ConflictError, NotFoundError
from broker.topic_names import DEFAULT_NAMESPACE, DEFAULT_TENANT, namespace_of_topic
from broker.topic_records import TENANTS, TopicPolicies, TopicRecord, check_name, namespace_path, tenant_path
from broker.topic_store import TopicStore
from coordination.store import BadVersionError, NodeExistsError, NoNodeError

POLICY_UPDATE_TRIES_MAX = 5
NAMESPACE_READ_S = 1.0  # how stale the namespace policies a topic checks may be
NAMESPACE_READS_MAX = 10_000  # namespaces remembered; past it, all are read again


class TenantStore:
    def __init__(self, topic_store: TopicStore) -> None:
        self.topic_store = topic_store
        self.store = topic_store.store

    async def ensure_defaults(self) -> None:
        """The tenant `public` and its namespace `default`, as every Pulsar cluster has them."""
        await self.store.ensure_path(TENANTS)
        for path, data in ((tenant_path(DEFAULT_TENANT), TenantInfo().to_bytes()),
                           (namespace_path(DEFAULT_TENANT, DEFAULT_NAMESPACE), NamespacePolicies().to_bytes())):
            try:
                await self.store.create(path, data)
            except NodeExistsError:
                pass

    # tenants

    async def tenants(self) -> list[str]:
        try:
            return sorted(await self.store.children(TENANTS))
        except NoNodeError:
            return []

    async def tenant(self, tenant: str) -> TenantInfo | None:
        try:
            data, _ = await self.store.get(tenant_path(check_name(tenant, "tenant")))
        except NoNodeError:
            return None
        return TenantInfo.from_bytes(data)

    async def create_tenant(self, tenant: str, info: TenantInfo) -> None:
        try:
            await self.store.create(tenant_path(check_name(tenant, "tenant")), info.to_bytes(), make_parents=True)
        except NodeExistsError:
            raise ConflictError(f"tenant {tenant} exists") from None

    async def update_tenant(self, tenant: str, info: TenantInfo) -> None:
        try:
            await self.store.set(tenant_path(check_name(tenant, "tenant")), info.to_bytes())
        except NoNodeError:
            raise NotFoundError(f"tenant {tenant} does not exist") from None

    async def delete_tenant(self, tenant: str) -> None:
        namespaces = await self.namespaces(tenant)
        if namespaces:
            raise ConflictError(f"tenant {tenant} still has namespaces ({', '.join(namespaces[:10])}): delete them first")
        try:
            await self.store.delete(tenant_path(tenant))
        except NoNodeError:
            raise NotFoundError(f"tenant {tenant} does not exist") from None

    # namespaces

    async def namespaces(self, tenant: str) -> list[str]:
        try:
            return sorted(f"{tenant}/{name}" for name in await self.store.children(tenant_path(check_name(tenant, "tenant"))))
        except NoNodeError:
            raise NotFoundError(f"tenant {tenant} does not exist") from None

    async def namespace(self, namespace: str) -> NamespacePolicies | None:
        tenant, name = split_namespace(namespace)
        try:
            data, _ = await self.store.get(namespace_path(tenant, name))
        except NoNodeError:
            return None
        return NamespacePolicies.from_bytes(data)

    async def create_namespace(self, namespace: str, policies: NamespacePolicies | None = None) -> None:
        tenant, name = split_namespace(namespace)
        if await self.tenant(tenant) is None:
            raise NotFoundError(f"tenant {tenant} does not exist: create it first (quire tenant create {tenant})")
        try:
            await self.store.create(namespace_path(tenant, name), (policies or NamespacePolicies()).to_bytes())
        except NodeExistsError:
            raise ConflictError(f"namespace {namespace} exists") from None
        except NoNodeError:
            raise NotFoundError(f"tenant {tenant} does not exist") from None

    async def delete_namespace(self, namespace: str) -> None:
        tenant, name = split_namespace(namespace)
        topics = [topic for topic in await self.topic_store.list_topics() if namespace_of_topic(topic) == namespace]
        if topics:
            raise ConflictError(f"namespace {namespace} still has topics ({', '.join(topics[:10])}): delete them first")
        try:
            await self.store.delete(namespace_path(tenant, name))
        except NoNodeError:
            raise NotFoundError(f"namespace {namespace} does not exist") from None

    async def policies_in_effect(self, topic: str, record: TopicRecord, *, max_age_s: float = NAMESPACE_READ_S) -> TopicPolicies:
        """The policies topic `topic` (of `record`) works by: its own, then
        its namespace's, then the broker's defaults it was made with. The
        namespace's record is read at most once a NAMESPACE_READ_S for all
        of its topics: every loaded partition checks its policies every few
        seconds, and a namespace may have thousands (`max_age_s` 0: read it now)."""
        tenant, name = split_namespace(namespace_of_topic(topic))
        path = namespace_path(tenant, name)
        reads, in_flight = self.topic_store.namespace_reads, self.topic_store.namespace_reads_in_flight
        while True:
            found = reads.get(path)
            if found is not None and time.monotonic() - found[0] < max_age_s:
                return record.policies_under(found[1])
            reading = in_flight.get(path)
            if reading is None or max_age_s <= 0:
                break
            # Another topic of the namespace is reading it: its answer serves both
            # (not a caller that asks for a read begun after its call). If that
            # read failed, look again: read, or wait for another's.
            await reading.wait()
        reading = in_flight[path] = trio.Event()
        try:
            now = time.monotonic()
            try:
                data, _ = await self.store.get(path)
            except NoNodeError:
                data = None
            if len(reads) >= NAMESPACE_READS_MAX:
                reads.clear()
            found = reads[path] = (now, {} if data is None else NamespacePolicies.from_bytes(data).policies)
        finally:
            if in_flight.get(path) is reading:
                del in_flight[path]
            reading.set()
        return record.policies_under(found[1])

    async def update_namespace(self, namespace: str, change) -> NamespacePolicies:
        """Apply `change` (policies -> policies) with compare-and-set, retried
        a few times against concurrent changes."""
        tenant, name = split_namespace(namespace)
        path = namespace_path(tenant, name)
        for _ in range(POLICY_UPDATE_TRIES_MAX):
            try:
                data, stat = await self.store.get(path)
            except NoNodeError:
                raise NotFoundError(f"namespace {namespace} does not exist") from None
            policies = change(NamespacePolicies.from_bytes(data))
            try:
                await self.store.set(path, policies.to_bytes(), stat.version)
                return policies
            except BadVersionError:
                continue
        raise ConflictError(f"namespace {namespace} kept changing under {POLICY_UPDATE_TRIES_MAX} tries: try again")


def split_namespace(namespace: str) -> tuple[str, str]:
    """(tenant, namespace) of TENANT/NAMESPACE, checked; ValueError otherwise."""
    parts = namespace.split("/") if isinstance(namespace, str) else []
    if len(parts) != 2:
        raise ValueError(f"a namespace is TENANT/NAMESPACE, got {str(namespace)[:200]!r}")
    return check_name(parts[0], "tenant"), check_name(parts[1], "namespace")


__all__ = ["TenantStore", "split_namespace"]
