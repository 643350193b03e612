"""`Client`: the entry point of the broker client. It finds the brokers
(through ZooKeeper, or a fixed list), looks partitions up (following
redirects), keeps one connection per broker, and makes producers,
consumers, readers and admin calls.

    async with Client.connect("127.0.0.1:2181", root="/quire") as client:
        producer = await client.create_producer("orders", producer_id="billing-1")
        message_id = await producer.send(b"payload", key="account-42")
        consumer = await client.subscribe("orders", subscription="audit", subscription_type="shared")
        message = await consumer.receive()
        await consumer.acknowledge(message)
"""

from __future__ import annotations

import contextlib
import itertools
import random
import ssl
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import trio

from broker.client.client_services import ClientServices
from broker.client.connection import BrokerConnection
from broker.client.consumer import Consumer, ConsumerOptions, DeadLetterPolicy, PartitionConsumer
from broker.client.producer import Producer, ProducerOptions, PartitionProducer
from broker.dispatcher import SubscriptionType
from broker.errors import ConnectionClosedError, ServiceUnavailableError
from broker.client.routing import HashingScheme
from broker.codecs import Codec
from broker.ownership import INTERNAL_LISTENER, BrokerInfo
from broker.protocol import FRAME_BYTES_MAX_DEFAULT, Admin, Lookup
from broker.topic_names import quire_name
from broker.topic_records import check_name, partition_name
from ledger_client.exception_groups import unwrap_single_exception

LOOKUP_HOPS_MAX = 8  # redirects followed by one lookup
ANY_BROKER_TRIES_MAX = 4  # connections tried for a request any broker answers


class Client:
    def __init__(
        self,
        nursery: trio.Nursery,
        discover: Callable[[], Awaitable[list[str]]],
        *,
        rng: random.Random,
        client_name: str,
        frame_bytes_max: int,
        listener_name: str | None = None,
        service_addresses: list[str] | None = None,
        auth_token: str | Callable[[], str] | None = None,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self.nursery = nursery
        self._auth_token = auth_token
        self._tls_context = tls_context
        self.listener_name = listener_name
        # The addresses a client was given, from which it tells its
        # listener when it was not named (found once).
        self._service_addresses = service_addresses
        self._listener_found = listener_name is not None or service_addresses is None
        self._discover = discover
        self.rng = rng
        self.client_name = client_name
        self.frame_bytes_max = frame_bytes_max
        self._handles = itertools.count(1)
        self._connections: dict[str, BrokerConnection] = {}
        self._connecting: dict[str, trio.Lock] = {}
        self._brokers: list[str] = []
        self._closables: list[Any] = []
        # What this client's producers and consumers use of it.
        self._services = ClientServices(
            new_handle=self.new_handle, connection_for=self.connection_for, spawn=nursery.start_soon, rng=rng
        )

    # --- lifetime ---------------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        zk_hosts: str = "127.0.0.1:2181",
        root: str = "/quire",
        *,
        service_url: str | None = None,
        listener_name: str | None = None,
        session_timeout_ms: int = 10_000,
        rng: random.Random | None = None,
        client_name: str = "quire-client",
        frame_bytes_max: int = FRAME_BYTES_MAX_DEFAULT,
        auth_token: str | Callable[[], str] | None = None,
        tls_context: ssl.SSLContext | None = None,
    ) -> AsyncIterator["Client"]:
        """A client of the cluster whose metadata is at `zk_hosts` under
        `root` (brokers found through ZooKeeper), or of the brokers listed in
        `service_url` ("host:port,host:port").

        `listener_name` picks which of the brokers' advertised listeners
        to dial (Pulsar's listenerName): "external" from outside a
        container network, say. Without it, a client given `service_url`
        uses the listener those addresses belong to, and one that finds
        the brokers through ZooKeeper the internal one.

        `auth_token`: the token brokers that authenticate are shown (quire
        token create), or a function giving the current one (called for
        each new connection, so a refreshed token is picked up).

        `tls_context` (security.tls.client_context): dial the brokers' TLS
        listeners, verifying their certificates with it (and showing its
        client certificate, if it holds one). `service_url` then names
        TLS addresses."""
        async with contextlib.AsyncExitStack() as stack:
            if service_url is not None:
                addresses = [address.strip() for address in service_url.split(",") if address.strip()]
                if not addresses:
                    raise ValueError(f"service_url names no broker: {service_url!r}")

                async def discover() -> list[str]:
                    return list(addresses)
            else:
                from broker.ownership import list_brokers
                from coordination.async_store import AsyncMetadataStore, connect_zookeeper

                sync_store = await connect_zookeeper(zk_hosts, root, session_timeout_ms=session_timeout_ms)
                store = await stack.enter_async_context(AsyncMetadataStore(sync_store))

                async def discover() -> list[str]:
                    return [info.address_for(listener_name, tls=tls_context is not None)
                            for info in (await list_brokers(store)).values()]

            with unwrap_single_exception():
                async with trio.open_nursery() as nursery:
                    client = cls(nursery, discover, rng=rng or random.Random(), client_name=client_name,
                                 frame_bytes_max=frame_bytes_max, listener_name=listener_name,
                                 service_addresses=addresses if service_url is not None else None,
                                 auth_token=auth_token, tls_context=tls_context)
                    try:
                        yield client
                    finally:
                        await client.aclose()
                        nursery.cancel_scope.cancel()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(5):
                for closable in reversed(self._closables):
                    await closable.close()
            for connection in list(self._connections.values()):
                await connection.aclose()

    def new_handle(self) -> int:
        return next(self._handles)

    # --- connections and lookups -------------------------------------------------------------

    async def connection(self, address: str) -> BrokerConnection:
        """The connection to a broker (made once, shared)."""
        connection = self._connections.get(address)
        if connection is not None and connection.closed is None:
            return connection
        lock = self._connecting.setdefault(address, trio.Lock())
        async with lock:
            connection = self._connections.get(address)
            if connection is not None and connection.closed is None:
                return connection
            token = self._auth_token() if callable(self._auth_token) else self._auth_token
            connection = await BrokerConnection.connect(address, self.client_name, frame_bytes_max=self.frame_bytes_max,
                                                        auth_token=token, tls_context=self._tls_context)
            await self.nursery.start(connection.run)
            self._connections[address] = connection
            return connection

    async def _any_connection(self) -> BrokerConnection:
        """A connection to some live broker."""
        for refresh in (False, True):
            if refresh or not self._brokers:
                self._brokers = await self._discover()
            live = [address for address in self._brokers if address in self._connections and self._connections[address].closed is None]
            candidates = live or self.rng.sample(self._brokers, len(self._brokers))
            for address in candidates:
                try:
                    return await self.connection(address)
                except ConnectionClosedError:
                    continue
        raise ServiceUnavailableError("no broker is reachable")

    async def _ask_any(self, make: Callable[[int], Any]) -> dict:
        """A request any broker answers, on a connection to some live
        broker; a connection that breaks meanwhile (its broker died) is
        replaced by one to another broker, a few times."""
        for attempt in range(ANY_BROKER_TRIES_MAX):
            connection = await self._any_connection()
            try:
                return await connection.request(make)
            except ConnectionClosedError:
                if attempt + 1 == ANY_BROKER_TRIES_MAX:
                    raise
                self._brokers = []  # discover again
                await trio.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    async def _listener(self) -> str | None:
        """The listener whose addresses this client dials (None: internal)."""
        if not self._listener_found:
            brokers = (await self.admin("brokers"))["brokers"]
            given = set(self._service_addresses or ())
            kind = "listeners" if self._tls_context is None else "tls_listeners"
            named = sorted({name for broker in brokers for name, address in (broker.get(kind) or {}).items()
                            if address in given})
            # An address two listeners share is taken as the internal one.
            self.listener_name = None if not named or INTERNAL_LISTENER in named else named[0]
            self._listener_found = True
        return self.listener_name

    async def _address_in(self, body: dict) -> str:
        """The address of the broker a lookup answer names, on our listener."""
        listener = await self._listener()
        if listener is None and self._tls_context is None:
            return body["address"]
        info = BrokerInfo(body["broker_id"], body["address"], dict(body.get("listeners") or {}),
                          tls_listeners=dict(body.get("tls_listeners") or {}))
        return info.address_for(listener, tls=self._tls_context is not None)

    async def lookup(self, partition: str) -> str:
        """The address of the broker serving `partition`."""
        partition = quire_name(partition)
        body = await self._ask_any(lambda request_id: Lookup(request_id, partition, False))
        for _ in range(LOOKUP_HOPS_MAX):
            if not body["redirect"]:
                return await self._address_in(body)
            connection = await self.connection(await self._address_in(body))
            body = await connection.request(lambda request_id: Lookup(request_id, partition, True))
        raise ServiceUnavailableError(f"lookup of {partition} redirected {LOOKUP_HOPS_MAX} times")

    async def connection_for(self, partition: str) -> BrokerConnection:
        return await self.connection(await self.lookup(partition))

    async def admin(self, action: str, **arguments: Any) -> dict:
        """An admin request any broker answers."""
        return await self._ask_any(lambda request_id: Admin(request_id, action, arguments))

    async def admin_at_owner(self, partition: str, action: str, **arguments: Any) -> dict:
        connection = await self.connection_for(partition)
        return await connection.request(lambda request_id: Admin(request_id, action, {"partition": partition, **arguments}))

    async def partition_names(self, topic: str, *, create: bool) -> list[tuple[str, int]]:
        """(partition name, index) of each partition of a topic; a topic that
        is not partitioned is its own partition, index -1."""
        topic = check_name(quire_name(topic))
        body = await self.admin("topic_metadata", topic=topic, create=create)
        count = body["partitions"]
        if count == 0:
            return [(topic, -1)]
        return [(partition_name(topic, index), index) for index in range(count)]

    # --- producers, consumers, readers -----------------------------------------------------------

    async def create_producer(
        self,
        topic: str,
        producer_id: str | None = None,
        *,
        batching: bool = False,
        batch_messages_max: int = 1_000,
        batch_bytes_max: int = 1024 * 1024,
        batch_delay_ms: float = 1.0,
        codec: Codec | str = Codec.NONE,
        pending_messages_max: int = 10_000,
        hashing_scheme: HashingScheme | str = HashingScheme.JAVA_STRING,
        chunking: bool = False,
    ) -> Producer:
        """A producer on `topic` (created on first use if the brokers allow
        it). A `producer_id` makes publishing exactly-once across restarts:
        the producer learns the last sequence id the partition persisted for it.
        `codec`: none, lz4, zlib, zstd or snappy (Pulsar's). `hashing_scheme`:
        how a key picks its partition, java_string (as Pulsar's Java and Go
        clients do) or murmur3_32. `chunking` (Pulsar's chunking_enabled): a
        message of more than 5 MiB goes in chunks, put together again by
        consumers (of exclusive and failover subscriptions, and readers)."""
        producer_id = check_name(producer_id or f"producer-{uuid.uuid4().hex[:12]}", "producer")
        scheme = HashingScheme.parse(hashing_scheme)
        options = ProducerOptions(batching, batch_messages_max, batch_bytes_max, batch_delay_ms, Codec.parse(codec),
                                  pending_messages_max, scheme, chunking)
        topic = quire_name(topic)
        partitions = []
        for name, index in await self.partition_names(topic, create=True):
            partition = PartitionProducer(self._services, topic, name, index, producer_id, options)
            await self.nursery.start(partition.run)
            partitions.append(partition)
        producer = Producer(topic, producer_id, partitions, scheme)
        self._closables.append(producer)
        return producer

    async def subscribe(
        self,
        topic: str,
        subscription: str,
        subscription_type: SubscriptionType | str = SubscriptionType.EXCLUSIVE,
        *,
        consumer_name: str = "",
        receiver_queue_size: int = 1_000,
        ack_timeout_ms: float | None = None,
        negative_ack_delay_ms: float = 1_000.0,
        ack_group_ms: float = 1.0,
        priority: int = 0,
        initial_position: str = "latest",
        important: bool = False,
        dead_letter_policy: DeadLetterPolicy | None = None,
        read_compacted: bool = False,
    ) -> Consumer:
        """A consumer of a durable subscription (created if new, at the
        `initial_position`). `important`: the subscription holds every
        message it has not acknowledged, whatever the topic's retention.
        `dead_letter_policy`: where messages go that were delivered too often
        (negatively acknowledged, or not acknowledged within `ack_timeout_ms`).
        `read_compacted` (exclusive and failover): messages up to the topic's
        last compaction come from its compacted view, the latest of each
        key; then every message after it."""
        check_name(subscription, "subscription")
        # One name for every partition: failover's choice (partition i to
        # consumer i mod n, by name) and key-shared's ring stay put.
        consumer_name = consumer_name or f"consumer-{uuid.uuid4().hex[:12]}"
        options = ConsumerOptions(
            SubscriptionType.parse(subscription_type).value, consumer_name, receiver_queue_size, ack_timeout_ms,
            negative_ack_delay_ms, ack_group_ms, priority, initial_position, important, dead_letter=dead_letter_policy,
            read_compacted=read_compacted,
        )
        return await self._consumer(topic, subscription, options)

    async def create_reader(self, topic: str, *, start: str | int = "earliest", receiver_queue_size: int = 1_000,
                            read_compacted: bool = False) -> Consumer:
        """A non-durable reader: nothing of it is stored, it holds no data,
        and it reads from `start`: "earliest", "latest", or a partition offset
        (for a topic that is not partitioned, or one partition by its name).
        `read_compacted`: the topic's compacted view, then what follows it."""
        initial_position, start_offset = ("earliest", None) if start == "earliest" else ("latest", None)
        if isinstance(start, int) and not isinstance(start, bool):
            start_offset = start
        elif start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest', 'latest' or an offset, got {start!r}")
        options = ConsumerOptions(SubscriptionType.EXCLUSIVE.value, "", receiver_queue_size, None, 1_000.0, 1.0, 0,
                                  initial_position, False, durable=False, start_offset=start_offset,
                                  read_compacted=read_compacted)
        return await self._consumer(topic, f"reader-{uuid.uuid4().hex[:12]}", options)

    async def _consumer(self, topic: str, subscription: str, options: ConsumerOptions) -> Consumer:
        topic = quire_name(topic)
        consumer = Consumer(topic, subscription, self.create_producer, options.dead_letter)
        for name, index in await self.partition_names(topic, create=True):
            partition = PartitionConsumer(self._services, consumer, topic, name, index, subscription, options)
            await self.nursery.start(partition.run)
            consumer.partitions.append(partition)
        self._closables.append(consumer)
        return consumer

    # --- admin -----------------------------------------------------------------------------------

    async def create_topic(self, topic: str, partitions: int = 0, **policies: Any) -> dict:
        return await self.admin("create_topic", topic=quire_name(topic), partitions=partitions, policies=policies)

    async def set_policies(self, topic: str, **policies: Any) -> dict:
        return await self.admin("set_policies", topic=quire_name(topic), policies=policies)

    async def list_topics(self, namespace: str | None = None) -> list[dict]:
        """The topics (of `namespace`, TENANT/NAMESPACE, when given) this client's role may see."""
        arguments = {} if namespace is None else {"namespace": namespace}
        return (await self.admin("list_topics", **arguments))["topics"]

    # --- tenants and namespaces (superusers and tenant admins, once brokers authenticate) ---

    async def list_tenants(self) -> list[str]:
        return (await self.admin("list_tenants"))["tenants"]

    async def create_tenant(self, tenant: str, *, admin_roles: list[str] = (), allowed_clusters: list[str] = ()) -> dict:
        return await self.admin("create_tenant", tenant=tenant, admin_roles=list(admin_roles),
                                allowed_clusters=list(allowed_clusters))

    async def update_tenant(self, tenant: str, *, admin_roles: list[str] = (), allowed_clusters: list[str] = ()) -> dict:
        return await self.admin("update_tenant", tenant=tenant, admin_roles=list(admin_roles),
                                allowed_clusters=list(allowed_clusters))

    async def delete_tenant(self, tenant: str) -> None:
        await self.admin("delete_tenant", tenant=tenant)

    async def list_namespaces(self, tenant: str) -> list[str]:
        return (await self.admin("list_namespaces", tenant=tenant))["namespaces"]

    async def create_namespace(self, namespace: str) -> None:
        await self.admin("create_namespace", namespace=namespace)

    async def delete_namespace(self, namespace: str) -> None:
        await self.admin("delete_namespace", namespace=namespace)

    async def grant_permission(self, namespace: str, role: str, actions: list[str]) -> dict:
        return (await self.admin("grant_permission", namespace=namespace, role=role, actions=list(actions)))["permissions"]

    async def revoke_permission(self, namespace: str, role: str) -> dict:
        return (await self.admin("revoke_permission", namespace=namespace, role=role))["permissions"]

    async def permissions(self, namespace: str) -> dict:
        return (await self.admin("permissions", namespace=namespace))["permissions"]

    async def namespace_policies(self, namespace: str) -> dict:
        """The namespace's grants, the policies it sets for its topics, and the broker's defaults."""
        return await self.admin("namespace_policies", namespace=namespace)

    async def set_namespace_policies(self, namespace: str, *, remove: list[str] = (), **policies: Any) -> dict:
        """Set policies for the namespace's topics (retention_time_ms,
        retention_bytes, backlog_quota_bytes, deduplication) and stop setting
        those named in `remove`; a topic's own setting still wins."""
        return await self.admin("set_namespace_policies", namespace=namespace, policies=policies, remove=list(remove))

    # --- schemas (any broker answers) ---

    async def schema(self, topic: str, version: int | None = None) -> dict:
        """The topic's schema (its latest version, or `version`): version, type, definition, properties."""
        arguments = {} if version is None else {"version": version}
        return await self.admin("schema", topic=quire_name(topic), **arguments)

    async def schemas(self, topic: str) -> list[dict]:
        return (await self.admin("schemas", topic=quire_name(topic)))["schemas"]

    async def add_schema(self, topic: str, schema_type: str, definition: str, properties: dict[str, str] | None = None) -> int:
        """A new version of the topic's schema, if its compatibility strategy takes it; its version."""
        answer = await self.admin("add_schema", topic=quire_name(topic), type=schema_type, definition=definition,
                                  properties=dict(properties or {}))
        return answer["version"]

    async def delete_schema(self, topic: str) -> None:
        await self.admin("delete_schema", topic=quire_name(topic))

    async def brokers(self) -> list[dict]:
        return (await self.admin("brokers"))["brokers"]

    async def topic_stats(self, topic: str) -> dict:
        """Each partition's stats, from its owner: offsets, rates, stored
        bytes, producers, subscriptions with their backlog, ledgers."""
        topic = quire_name(topic)
        partitions = await self.partition_names(topic, create=False)
        return {
            "topic": topic,
            "partitions": {name: await self.admin_at_owner(name, "partition_stats") for name, _ in partitions},
        }

    async def delete_topic(self, topic: str, *, force: bool = False) -> None:
        """Delete a topic: every partition's ledgers and subscriptions, then
        the topic. Refused while producers or consumers are connected,
        unless forced."""
        for name, _ in await self.partition_names(topic, create=False):
            await self.admin_at_owner(name, "delete_partition", force=force)
        await self.admin("delete_topic_record", topic=quire_name(topic))

    async def unload(self, topic: str) -> None:
        """Have each partition's owner give it up (another broker, or the
        same, takes it on the next lookup)."""
        await self._on_partitions(topic, "unload")

    # --- subscriptions, on every partition (Pulsar's `pulsar-admin topics ...-subscription`) ---

    async def _on_partitions(self, topic: str, action: str, **arguments: Any) -> dict:
        """Admin `action` on each partition's owner; the answers by partition."""
        return {name: await self.admin_at_owner(name, action, **arguments)
                for name, _ in await self.partition_names(topic, create=False)}

    async def subscriptions(self, topic: str) -> list[str]:
        stats = await self.topic_stats(topic)
        return sorted({name for partition in stats["partitions"].values() for name in partition["subscriptions"]})

    async def create_subscription(self, topic: str, subscription: str, *, position: str | list[int] = "latest") -> dict:
        """A durable subscription without consumers, on every partition, from
        `position`: latest, earliest, or [ledger id, entry id, batch index]
        (of a topic that is not partitioned)."""
        return await self._on_partitions(topic, "create_subscription", subscription=subscription, position=position)

    async def delete_subscription(self, topic: str, subscription: str, *, force: bool = False) -> dict:
        """Refused while consumers are connected, unless `force` (they are disconnected)."""
        return await self._on_partitions(topic, "delete_subscription", subscription=subscription, force=force)

    async def skip_messages(self, topic: str, subscription: str, count: int | None = None) -> dict:
        """Acknowledge the next `count` unacknowledged messages of each
        partition (all of them: clear the backlog)."""
        arguments = {} if count is None else {"count": count}
        return await self._on_partitions(topic, "skip_messages", subscription=subscription, **arguments)

    async def expire_messages(self, topic: str, seconds: int, subscription: str | None = None) -> dict:
        """Acknowledge the messages published more than `seconds` ago (on every durable subscription without one named)."""
        arguments = {} if subscription is None else {"subscription": subscription}
        return await self._on_partitions(topic, "expire_messages", seconds=seconds, **arguments)

    async def reset_cursor(self, topic: str, subscription: str, *, publish_time_ms: int | None = None,
                           message_id: list[int] | None = None) -> dict:
        """Move the subscription to the first message published at or after
        `publish_time_ms` (every partition), or to `message_id` [ledger id,
        entry id, batch index] of a partition `topic` names."""
        if message_id is not None:
            return {quire_name(topic): await self.admin_at_owner(quire_name(topic), "reset_cursor", subscription=subscription,
                                                                 message_id=list(message_id))}
        return await self._on_partitions(topic, "reset_cursor", subscription=subscription, publish_time_ms=publish_time_ms)

    async def compact(self, topic: str) -> dict:
        """Start compacting every partition (Pulsar's compaction trigger):
        a ConflictError for a partition compacting already. Answers each
        partition's compaction status."""
        return await self._on_partitions(topic, "compact")

    async def compaction_status(self, topic: str) -> dict:
        """Each partition's compaction: its status (NOT_RUN, RUNNING, SUCCESS
        or ERROR, as Pulsar's), the last error, and what its compacted
        view holds."""
        return await self._on_partitions(topic, "compaction_status")

    async def apply_retention(self, topic: str) -> dict:
        """Apply retention now (brokers do it every few seconds anyway)."""
        return await self._on_partitions(topic, "apply_retention")


__all__ = ["Client"]
