"""Administrative requests a broker answers (`quire topic ...` and the
client's admin calls): topics and their policies, partition stats,
deletion, unloading, retention on demand.

Requests about a partition's live state (stats, delete, unload, retention)
go to its owner (the client looks it up first); the others any broker
answers from ZooKeeper.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from framing.codec import describe
from broker.authorization import Action, NamespacePolicies, TenantInfo, check_role, parse_actions
from broker.errors import (
    BadRequestError,
    NotFoundError,
    PreconditionFailedError,
    SubscriptionNotFoundError,
    TopicExistsError,
    TopicNotFoundError,
)
from broker.tenant_store import split_namespace
from broker.topic_names import NAMESPACE, namespace_of_topic
from broker.topic_records import PARTITIONS_MAX, TopicPolicies, TopicRecord, check_name
from broker.ownership import BrokerInfo, Ownership
from broker.topic_store import TopicStore
from coordination.store import BadVersionError, NodeExistsError

POLICY_UPDATE_TRIES_MAX = 5


def _argument(arguments: dict, name: str, kind: type, default: Any = ...) -> Any:
    value = arguments.get(name, default)
    if value is ...:
        raise BadRequestError(f"missing argument {name!r}")
    if value is not None and type(value) is not kind:
        raise BadRequestError(f"argument {name!r} must be {kind.__name__}")
    return value


class AdminBackend(Protocol):
    """What the admin actions need of their broker (BrokerServer is one)."""

    config: Any
    topic_store: TopicStore
    tenant_store: Any
    schemas: Any  # broker.schema_registry.SchemaRegistry
    access: Any
    ownership: Ownership
    info: BrokerInfo
    stopping: bool
    partitions: dict

    @property
    def default_policies(self) -> TopicPolicies: ...

    async def topic_record(self, topic: str, *, create: bool) -> TopicRecord: ...

    async def serving(self, partition: str) -> Any: ...

    async def delete_partition(self, partition: str, *, force: bool) -> None: ...

    async def unload_partition(self, partition: str) -> bool: ...


# The actions a client may ask for; each is the method `_<action>` (the
# handler's other methods are its helpers, never reachable by a client).
ACTIONS = frozenset({
    "topic_metadata", "create_topic", "set_policies", "topic_policies", "remove_policies", "list_topics", "brokers",
    "health", "partition_stats", "delete_partition", "delete_topic_record", "unload", "apply_retention", "compact",
    "compaction_status",
    "create_subscription", "delete_subscription", "skip_messages", "expire_messages", "reset_cursor",
    "schema", "schemas", "add_schema", "schema_compatibility", "delete_schema",
    "list_tenants", "create_tenant", "update_tenant", "tenant", "delete_tenant", "list_namespaces", "create_namespace",
    "delete_namespace", "permissions", "namespace_policies", "set_namespace_policies", "grant_permission",
    "revoke_permission",
})


class AdminHandler:
    def __init__(self, server: AdminBackend) -> None:
        self.server = server

    async def handle(self, action: str, arguments: dict, role: str | None = None) -> dict:
        """Answer `action` for a client of `role` (None: not authenticated,
        which is allowed everything only while authentication is off)."""
        if not isinstance(action, str) or action not in ACTIONS:
            raise BadRequestError(f"unknown admin action {describe(action)}")
        return await getattr(self, f"_{action}")(arguments, role)

    async def _topic_metadata(self, arguments: dict, role: str | None) -> dict:
        topic = check_name(_argument(arguments, "topic", str))
        await self.server.access.check_topic(role, topic, None, "look up")
        record = await self.server.topic_record(topic, create=bool(_argument(arguments, "create", bool, False)))
        return {"partitions": record.partitions, "policies": record.policies.to_dict()}

    async def _create_topic(self, arguments: dict, role: str | None) -> dict:
        topic = check_name(_argument(arguments, "topic", str))
        partitions = _argument(arguments, "partitions", int, 0)
        if not 0 <= partitions <= PARTITIONS_MAX:
            raise BadRequestError(f"partitions must be in 0..{PARTITIONS_MAX}, got {partitions}")
        given = _argument(arguments, "policies", dict, {})
        policies = TopicPolicies.from_dict(given, self.server.default_policies)
        await self.server.access.check_topic_admin(role, topic, "create topic")
        record = TopicRecord(partitions, policies, int(time.time() * 1000), frozenset(given))
        try:
            await self.server.topic_store.create_topic(topic, record)
        except NodeExistsError:
            raise TopicExistsError(f"topic {topic!r} exists") from None
        return {"topic": topic, "partitions": partitions, "policies": policies.to_dict()}

    async def _set_policies(self, arguments: dict, role: str | None) -> dict:
        topic = check_name(_argument(arguments, "topic", str))
        changes = _argument(arguments, "policies", dict)
        await self.server.access.check_topic_admin(role, topic, "change the policies of")
        return await self._change_policies(topic, lambda record: (changes, record.own_policy_names() | frozenset(changes)))

    async def _change_policies(self, topic: str, change) -> dict:
        """Write the topic's record with `change(record)` -> (policy values,
        the names it sets itself), compare-and-set, retried a few times."""
        store = self.server.topic_store
        for _ in range(POLICY_UPDATE_TRIES_MAX):
            found = await store.read_topic(topic)
            if found is None:
                raise TopicNotFoundError(f"topic {topic!r} does not exist")
            record, version = found
            values, own = change(record)
            policies = TopicPolicies.from_dict(values, record.policies)
            try:
                await store.write_topic(topic, TopicRecord(record.partitions, policies, record.created_ms, own), version)
            except BadVersionError:
                continue
            return {"topic": topic, "policies": policies.to_dict()}
        raise BadRequestError(f"topic {topic!r} changed {POLICY_UPDATE_TRIES_MAX} times while its policies were set; retry")

    async def _topic_policies(self, arguments: dict, role: str | None) -> dict:
        """The policies set on the topic itself (`own`), and those it works by
        (`applied`: its own, then its namespace's, then the broker's defaults)."""
        topic = check_name(_argument(arguments, "topic", str))
        await self.server.access.check_topic_admin(role, topic, "read the policies of")  # as Pulsar: tenant admins
        found = await self.server.topic_store.read_topic(topic)
        if found is None:
            raise TopicNotFoundError(f"topic {topic!r} does not exist")
        record = found[0]
        own = {name: getattr(record.policies, name) for name in sorted(record.own_policy_names())}
        applied = await self.server.tenant_store.policies_in_effect(topic, record)
        return {"topic": topic, "own": own, "applied": applied.to_dict()}

    async def _remove_policies(self, arguments: dict, role: str | None) -> dict:
        """The topic stops setting `names` itself: they come from its
        namespace, or the broker's defaults, again."""
        topic = check_name(_argument(arguments, "topic", str))
        names = _argument(arguments, "names", list)
        defaults = self.server.default_policies
        unknown = [describe(name) for name in names if not isinstance(name, str) or name not in TopicPolicies.__dataclass_fields__]
        if unknown:
            raise BadRequestError(f"unknown topic policies {', '.join(unknown[:5])}")
        await self.server.access.check_topic_admin(role, topic, "change the policies of")
        return await self._change_policies(topic, lambda record: ({name: getattr(defaults, name) for name in names},
                                                                  record.own_policy_names() - frozenset(names)))

    async def _list_topics(self, arguments: dict, role: str | None) -> dict:
        topics = []
        namespace = _argument(arguments, "namespace", str, None)
        for topic in await self.server.topic_store.list_topics():
            if namespace is not None and namespace_of_topic(topic) != namespace:
                continue
            if not await self.server.access.may_look_up(role, topic):
                continue
            found = await self.server.topic_store.read_topic(topic)
            if found is not None:
                topics.append({"topic": topic, "partitions": found[0].partitions})
        return {"topics": topics}

    async def _brokers(self, arguments: dict, role: str | None) -> dict:
        brokers = await self.server.ownership.live_brokers()
        return {"brokers": [{"broker_id": info.broker_id, "address": info.address, "listeners": info.listeners,
                             "tls_listeners": info.tls_listeners}
                            for info in brokers.values()]}

    async def _health(self, arguments: dict, role: str | None) -> dict:
        """For `quire broker health`: registered in ZooKeeper by this
        broker's session (so lookups find it and its claims hold), and not
        stopping."""
        server = self.server
        return {"broker_id": server.info.broker_id, "registered": await server.ownership.registered(),
                "stopping": server.stopping, "partitions": len(server.partitions)}

    async def _partition_stats(self, arguments: dict, role: str | None) -> dict:
        partition = check_name(_argument(arguments, "partition", str))
        await self.server.access.check_topic(role, partition, None, "read the stats of")
        service = await self.server.serving(partition)
        return service.describe()

    async def _delete_partition(self, arguments: dict, role: str | None) -> dict:
        partition = check_name(_argument(arguments, "partition", str))
        await self.server.access.check_topic_admin(role, partition, "delete")
        await self.server.delete_partition(partition, force=bool(_argument(arguments, "force", bool, False)))
        return {}

    async def _delete_topic_record(self, arguments: dict, role: str | None) -> dict:
        topic = check_name(_argument(arguments, "topic", str))
        await self.server.access.check_topic_admin(role, topic, "delete")
        found = await self.server.topic_store.read_topic(topic)
        if found is None:
            raise TopicNotFoundError(f"topic {topic!r} does not exist")
        for partition in found[0].partition_names(topic):
            if await self.server.topic_store.read_managed_ledger(partition) is not None:
                raise BadRequestError(f"partition {partition} still exists: delete the partitions first")
        await self.server.schemas.forget(topic)  # a topic made again under the name starts without one
        await self.server.topic_store.delete_topic_record(topic)
        return {}

    async def _unload(self, arguments: dict, role: str | None) -> dict:
        partition = check_name(_argument(arguments, "partition", str))
        await self.server.access.check_topic_admin(role, partition, "unload")
        return {"unloaded": await self.server.unload_partition(partition)}

    async def _apply_retention(self, arguments: dict, role: str | None) -> dict:
        partition = check_name(_argument(arguments, "partition", str))
        await self.server.access.check_topic_admin(role, partition, "apply the retention of")
        service = await self.server.serving(partition)
        deleted = await service.apply_retention()
        return {"deleted_ledgers": deleted, "first_offset": service.managed_ledger.first_offset}

    async def _compact(self, arguments: dict, role: str | None) -> dict:
        """Start compacting a partition (ConflictError while it is); the
        status tells how it went."""
        partition = check_name(_argument(arguments, "partition", str))
        await self.server.access.check_topic_admin(role, partition, "compact")
        service = await self.server.serving(partition)
        service.compact()
        return service.compaction_stats()

    async def _compaction_status(self, arguments: dict, role: str | None) -> dict:
        partition = check_name(_argument(arguments, "partition", str))
        await self.server.access.check_topic(role, partition, None, "read the compaction status of")
        service = await self.server.serving(partition)
        return service.compaction_stats()

    # --- subscriptions of a partition (Pulsar's `pulsar-admin topics ...-subscription`) -----------
    # Asked of the partition's owner, as the stats are.

    async def _serving_for_subscription(self, arguments: dict, role: str | None, what: str):
        partition = check_name(_argument(arguments, "partition", str))
        await self.server.access.check_topic(role, partition, Action.CONSUME, what)
        return await self.server.serving(partition)

    def _subscription(self, service, arguments: dict):
        name = _argument(arguments, "subscription", str)
        subscription = service.subscriptions.get(name)
        if subscription is None:
            raise SubscriptionNotFoundError(f"no subscription {describe(name)} on {service.name}")
        return subscription

    async def _create_subscription(self, arguments: dict, role: str | None) -> dict:
        """`position`: "latest" (the default), "earliest", or a message id
        [ledger id, entry id, batch index] the subscription starts at."""
        service = await self._serving_for_subscription(arguments, role, "subscribe to")
        name = check_name(_argument(arguments, "subscription", str), "subscription")
        position = arguments.get("position", "latest")
        if position in ("latest", "earliest"):
            subscription = await service.create_subscription(name, initial_position=position)
        elif isinstance(position, list) and len(position) == 3 and all(type(value) is int for value in position):
            subscription = await service.create_subscription(name, start_offset=await service.offset_of_message(*position))
        else:
            raise BadRequestError("position is latest, earliest or [ledger id, entry id, batch index]")
        return {"subscription": name, "next_offset": subscription.cursor.mark_delete + 1}

    async def _delete_subscription(self, arguments: dict, role: str | None) -> dict:
        """Refused while consumers are connected, unless `force` (they are disconnected)."""
        service = await self._serving_for_subscription(arguments, role, "unsubscribe from")
        subscription = self._subscription(service, arguments)
        if _argument(arguments, "force", bool, False):
            self.server.close_consumers(service, subscription.name)
        await service.unsubscribe(subscription.name, None)
        return {}

    async def _skip_messages(self, arguments: dict, role: str | None) -> dict:
        """Acknowledge the next `count` unacknowledged messages (all of them without `count`)."""
        service = await self._serving_for_subscription(arguments, role, "skip messages on")
        subscription = self._subscription(service, arguments)
        count = _argument(arguments, "count", int, None)
        if count is not None and count < 0:
            raise BadRequestError(f"count must be 0 or more, got {count}")
        confirmed = service.managed_ledger.confirmed_offset
        offset = confirmed + 1 if count is None else subscription.cursor.offset_past_unacknowledged(count, confirmed)
        return {"skipped": await subscription.acknowledge_before(offset)}

    async def _expire_messages(self, arguments: dict, role: str | None) -> dict:
        """Acknowledge the messages published more than `seconds` ago, on
        one subscription or (without `subscription`) on every durable one."""
        partition = check_name(_argument(arguments, "partition", str))
        await self.server.access.check_topic_admin(role, partition, "expire messages on")
        service = await self.server.serving(partition)
        seconds = _argument(arguments, "seconds", int)
        if seconds < 0:
            raise BadRequestError(f"seconds must be 0 or more, got {seconds}")
        if "subscription" in arguments:
            subscriptions = [self._subscription(service, arguments)]
        else:
            subscriptions = [subscription for subscription in service.subscriptions.values() if subscription.durable]
        return {"expired": await service.expire_messages(seconds, subscriptions)}

    async def _reset_cursor(self, arguments: dict, role: str | None) -> dict:
        """Move the subscription to the first message published at or after
        `publish_time_ms`, or to `message_id` [ledger id, entry id, batch
        index] (after it with `excluded`); its consumers subscribe again."""
        service = await self._serving_for_subscription(arguments, role, "reset a cursor on")
        subscription = self._subscription(service, arguments)
        publish_time_ms = _argument(arguments, "publish_time_ms", int, None)
        message_id = _argument(arguments, "message_id", list, None)
        if (publish_time_ms is None) == (message_id is None):
            raise BadRequestError("a cursor is reset to a publish time or a message id")
        if message_id is not None and not (len(message_id) == 3 and all(type(value) is int for value in message_id)):
            raise BadRequestError("a message id is [ledger id, entry id, batch index]")
        if message_id is not None and _argument(arguments, "excluded", bool, False):
            # Pulsar's isExcluded: from the message after it.
            offset = await service.offset_of_message(*message_id) + 1
            return {"next_offset": await self.server.seek(service, subscription.name, offset=offset)}
        offset = await self.server.seek(service, subscription.name, publish_time_ms=publish_time_ms, message_id=message_id)
        return {"next_offset": offset}

    # --- schemas (Pulsar's `pulsar-admin schemas`): any broker answers from ZooKeeper -------------

    async def _topic_of_schema(self, arguments: dict, role: str | None, *, admin: bool, what: str) -> str:
        name = check_name(_argument(arguments, "topic", str))
        if admin:
            await self.server.access.check_topic_admin(role, name, what)
        else:
            await self.server.access.check_topic(role, name, None, what)
        return await self.server.schemas.topic_of(name)

    @staticmethod
    def _schema_answer(stored) -> dict:
        schema = stored.schema
        return {"version": stored.version, "type": stored.type_name, "name": schema.name,
                "definition": schema.schema_data.decode("utf-8", "replace"),
                "properties": {pair.key: pair.value for pair in schema.properties}}

    async def _schema(self, arguments: dict, role: str | None) -> dict:
        """The topic's schema: its latest version, or `version`."""
        topic = await self._topic_of_schema(arguments, role, admin=False, what="read the schema of")
        return self._schema_answer(await self.server.schemas.get(topic, _argument(arguments, "version", int, None)))

    async def _schemas(self, arguments: dict, role: str | None) -> dict:
        topic = await self._topic_of_schema(arguments, role, admin=False, what="read the schemas of")
        return {"schemas": [self._schema_answer(stored) for stored in await self.server.schemas.versions(topic)]}

    def _schema_argument(self, topic: str, arguments: dict):
        from broker.schema_registry import make_schema

        properties = _argument(arguments, "properties", dict, {})
        if not all(isinstance(key, str) and isinstance(value, str) for key, value in properties.items()):
            raise BadRequestError("a schema's properties map strings to strings")
        return make_schema(topic, _argument(arguments, "type", str), _argument(arguments, "definition", str).encode(),
                           properties)

    async def _add_schema(self, arguments: dict, role: str | None) -> dict:
        """Add a version (`type`, `definition`, `properties`), if the topic's
        compatibility strategy takes it; the same schema again gets its version."""
        topic = await self._topic_of_schema(arguments, role, admin=True, what="change the schema of")
        return {"version": await self.server.schemas.add(topic, self._schema_argument(topic, arguments))}

    async def _schema_compatibility(self, arguments: dict, role: str | None) -> dict:
        topic = await self._topic_of_schema(arguments, role, admin=False, what="check a schema against")
        compatible, strategy, reason = await self.server.schemas.check_compatible(topic, self._schema_argument(topic, arguments))
        return {"compatible": compatible, "strategy": strategy.value, "reason": reason}

    async def _delete_schema(self, arguments: dict, role: str | None) -> dict:
        topic = await self._topic_of_schema(arguments, role, admin=True, what="delete the schema of")
        return {"version": await self.server.schemas.delete(topic)}

    # --- tenants and namespaces (Pulsar's `pulsar-admin tenants|namespaces`) ---------------------

    async def _list_tenants(self, arguments: dict, role: str | None) -> dict:
        self.server.access.check_superuser(role, "list the tenants")
        return {"tenants": await self.server.tenant_store.tenants()}

    async def _create_tenant(self, arguments: dict, role: str | None) -> dict:
        tenant = check_name(_argument(arguments, "tenant", str), "tenant")
        info = self._tenant_info(arguments)
        self.server.access.check_superuser(role, f"create tenant {tenant}")
        await self.server.tenant_store.create_tenant(tenant, info)
        return {"tenant": tenant, **info.to_dict()}

    async def _update_tenant(self, arguments: dict, role: str | None) -> dict:
        tenant = check_name(_argument(arguments, "tenant", str), "tenant")
        info = self._tenant_info(arguments)
        self.server.access.check_superuser(role, f"change tenant {tenant}")
        await self.server.tenant_store.update_tenant(tenant, info)
        return {"tenant": tenant, **info.to_dict()}

    async def _tenant(self, arguments: dict, role: str | None) -> dict:
        tenant = check_name(_argument(arguments, "tenant", str), "tenant")
        await self.server.access.check_tenant_admin(role, tenant, f"read tenant {tenant}")
        info = await self.server.tenant_store.tenant(tenant)
        if info is None:
            raise NotFoundError(f"tenant {tenant} does not exist")
        return {"tenant": tenant, **info.to_dict()}

    async def _delete_tenant(self, arguments: dict, role: str | None) -> dict:
        tenant = check_name(_argument(arguments, "tenant", str), "tenant")
        self.server.access.check_superuser(role, f"delete tenant {tenant}")
        await self.server.tenant_store.delete_tenant(tenant)
        return {}

    def _tenant_info(self, arguments: dict) -> TenantInfo:
        """The tenant's record the arguments give; its allowed clusters must
        exist (quire's brokers form one cluster, named by --cluster-name)."""
        try:
            info = TenantInfo.from_dict({"admin_roles": _argument(arguments, "admin_roles", list, []),
                                         "allowed_clusters": _argument(arguments, "allowed_clusters", list, [])})
        except ValueError as error:
            raise BadRequestError(str(error)) from None
        cluster = self.server.config.cluster_name
        unknown = [name for name in info.allowed_clusters if name != cluster]
        if unknown:
            raise PreconditionFailedError(f"clusters {', '.join(unknown[:10])} do not exist (this is cluster {cluster})")
        return info

    async def _list_namespaces(self, arguments: dict, role: str | None) -> dict:
        tenant = check_name(_argument(arguments, "tenant", str), "tenant")
        await self.server.access.check_tenant_admin(role, tenant, f"list the namespaces of tenant {tenant}")
        return {"namespaces": await self.server.tenant_store.namespaces(tenant)}

    async def _create_namespace(self, arguments: dict, role: str | None) -> dict:
        namespace = _namespace(arguments)
        await self.server.access.check_tenant_admin(role, split_namespace(namespace)[0], f"create namespace {namespace}")
        await self.server.tenant_store.create_namespace(namespace)
        return {"namespace": namespace}

    async def _delete_namespace(self, arguments: dict, role: str | None) -> dict:
        namespace = _namespace(arguments)
        if namespace == NAMESPACE:
            raise BadRequestError(f"the namespace {NAMESPACE} is always there: it cannot be deleted")
        await self.server.access.check_tenant_admin(role, split_namespace(namespace)[0], f"delete namespace {namespace}")
        await self.server.tenant_store.delete_namespace(namespace)
        return {}

    async def _permissions(self, arguments: dict, role: str | None) -> dict:
        return await self._namespace_policies(arguments, role)

    async def _namespace_policies(self, arguments: dict, role: str | None) -> dict:
        """The namespace's grants, the policies it sets for its topics, and
        the broker's defaults (what its topics have where neither sets one)."""
        namespace = _namespace(arguments)
        await self.server.access.check_tenant_admin(role, split_namespace(namespace)[0], f"read the policies of {namespace}")
        policies = await self.server.tenant_store.namespace(namespace)
        if policies is None:
            raise NotFoundError(f"namespace {namespace} does not exist")
        return {"namespace": namespace, **policies.to_dict(), "defaults": self.server.default_policies.to_dict()}

    async def _set_namespace_policies(self, arguments: dict, role: str | None) -> dict:
        """Set policies for the namespace's topics (`policies`: name -> value)
        and stop setting others (`remove`: names); a topic's own setting of a
        policy still wins. Loaded partitions take them at their next check."""
        namespace = _namespace(arguments)
        changes = _argument(arguments, "policies", dict, {})
        removed = _argument(arguments, "remove", list, [])
        await self.server.access.check_tenant_admin(role, split_namespace(namespace)[0], f"change the policies of {namespace}")
        try:
            NamespacePolicies().with_policies(changes, removed)  # checked before anything is read
        except ValueError as error:
            raise BadRequestError(str(error)) from None
        policies = await self.server.tenant_store.update_namespace(namespace, lambda policies: policies.with_policies(changes, removed))
        return {"namespace": namespace, **policies.to_dict()}

    async def _grant_permission(self, arguments: dict, role: str | None) -> dict:
        namespace = _namespace(arguments)
        try:
            grantee = check_role(_argument(arguments, "role", str))
            actions = parse_actions(_argument(arguments, "actions", list))
        except ValueError as error:
            raise BadRequestError(str(error)) from None
        await self.server.access.check_tenant_admin(role, split_namespace(namespace)[0], f"grant permissions on {namespace}")
        policies = await self.server.tenant_store.update_namespace(namespace, lambda policies: policies.granted(grantee, actions))
        return {"namespace": namespace, **policies.to_dict()}

    async def _revoke_permission(self, arguments: dict, role: str | None) -> dict:
        namespace = _namespace(arguments)
        grantee = _argument(arguments, "role", str)
        await self.server.access.check_tenant_admin(role, split_namespace(namespace)[0], f"revoke permissions on {namespace}")
        policies = await self.server.tenant_store.update_namespace(namespace, lambda policies: policies.revoked(grantee))
        return {"namespace": namespace, **policies.to_dict()}


def _namespace(arguments: dict) -> str:
    try:
        return "/".join(split_namespace(_argument(arguments, "namespace", str)))
    except ValueError as error:
        raise BadRequestError(str(error)) from None




__all__ = ["AdminBackend", "AdminHandler"]
