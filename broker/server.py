"""The broker's trio server: client connections, lookups, and routing each
command to the partition that serves it (`broker/hosting.py` loads and
hands over the partitions this broker owns).

A connection handles its commands in order; a send waits (and so stops
reading the connection) while its partition's queue for the ledger is full,
and a connection with producers is not read while the broker's publish
buffer (the bytes of batches taken and not yet answered, all partitions
together) is past its bound: that is the producers' back-pressure.
Commands that wait on ZooKeeper or on a cursor write (lookups, subscribes,
acknowledgements, admin) run as tasks of the connection, at most
`requests_in_flight_max` at once.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from framing.stream import FrameOutput, enable_keepalive
from framing.peer_limits import (
    ConnectionLimits,
    FrameBudget,
    HANDSHAKE_FRAME_BYTES_MAX,
    FrameReader,
    decode_from_peer,
    keepalive_sweep,
    peer_faults,
    serve_admitted,
    serve_admitted_tls,
    wait_for_output_room,
)
from broker.access import AccessControl
from broker.admin import AdminHandler
from broker.authorization import Action
from broker.config import BrokerConfig
from broker.cursor_ledger import CursorWritePacer
from broker.dispatcher import SubscriptionType
from broker.errors import (
    BadRequestError,
    BrokerError,
    BrokerStatus,
    ConsumerBusyError,
    ServiceUnavailableError,
    TopicFencedError,
    TopicNotFoundError,
)
from broker.managed_ledger import EntryCache
from broker.lease import Lease
from broker.metrics import BrokerMetrics
from broker.ownership import INTERNAL_LISTENER, BrokerInfo, Ownership
from broker.ownership_core import Access, Answer, decide_lookup
from broker.protocol import (
    Command,
    PROTOCOL_VERSION,
    REQUEST_ITEMS_MAX,
    Ack,
    Admin,
    CloseConsumer,
    Closed,
    CloseProducer,
    Connect,
    Connected,
    Flow,
    FrameDecoder,
    Lookup,
    Ping,
    Pong,
    ProducerOpen,
    ProtocolError,
    Redeliver,
    Response,
    Seek,
    Send,
    SendReceipt,
    Subscribe,
    Unsubscribe,
    decode,
    encode,
)
from broker.publish_buffer import PublishBuffer, batch_cost_bytes
from broker.subscription import ConsumerLink, TakenAcknowledgement
from broker.hosting import PartitionHosting
from broker.pulsar.server import PulsarFrontEnd
from broker.topic import BrokerContext, PartitionService, ProducerLink
from broker.topic_records import TopicPolicies, TopicRecord, check_name, split_partition
from broker.tenant_store import TenantStore
from broker.schema_registry import SchemaRegistry
from broker.topic_store import TopicStore
from coordination.async_store import AsyncMetadataStore
from coordination.startup import Startup
from coordination.store import MetadataError, NodeExistsError
from ledger_client import BKError, BookKeeper
from security.tls import stream_peer_common_name as peer_common_name
from security.authentication import ANONYMOUS_WHEN_OFF, Principal

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0


@dataclass(eq=False)
class _Connection:
    peer: str
    stream: trio.SocketStream
    output: FrameOutput
    producers: dict[int, tuple[PartitionService, ProducerLink]] = field(default_factory=dict)
    consumers: dict[int, tuple[PartitionService, str, int]] = field(default_factory=dict)  # handle -> (partition, subscription, consumer id)
    closed: bool = False
    output_bytes_max: int = 64 * 1024 * 1024
    metrics: BrokerMetrics | None = None
    # With metrics on: when each batch in progress arrived, by (producer handle, last sequence id).
    publish_started_s: dict[tuple[int, int], float] = field(default_factory=dict)
    reader: FrameReader | None = None
    pinged: bool = False  # a PING went out since the client last sent anything
    cancel_scope: trio.CancelScope | None = None
    principal: Principal = ANONYMOUS_WHEN_OFF  # who the client authenticated as

    @property
    def role(self) -> str | None:
        return self.principal.role

    def send(self, message: Any) -> None:
        if self.closed:
            return
        self.output.queue(encode(message))
        self.output.flush()

    def send_receipt(self, receipt: SendReceipt) -> None:
        """`send` for producers' receipts, measured when metrics are on."""
        if self.metrics is not None:
            started_s = self.publish_started_s.pop((receipt.producer_handle, receipt.last_sequence_id), None)
            self.metrics.receipt(receipt.status, started_s)
        self.send(receipt)

    async def wait_for_room(self) -> None:
        """Until what is queued for the client is under `output_bytes_max`
        (or the connection closed)."""
        while self.output.bytes > self.output_bytes_max and not self.closed:
            with trio.move_on_after(1.0):
                await self.output.wait_drained()


class BrokerServer:
    def __init__(self, config: BrokerConfig, bookkeeper: BookKeeper, store: AsyncMetadataStore,
                 metrics: BrokerMetrics | None = None) -> None:
        """`metrics`: where to count producer batches (None: nothing is measured)."""
        self.config = config
        self.metrics = metrics
        self.bookkeeper = bookkeeper
        self.store = store
        self.topic_store = TopicStore(store)
        self.pulsar_port: int | None = None  # bound once `listen` ran
        self.pulsar_tls_port: int | None = None
        self.web_port: int | None = None
        self.web_tls_port: int | None = None
        self.tls_port: int | None = None
        self._tls_listeners: list[trio.SocketListener] = []
        self.tls_handshakes_refused = 0  # TLS handshakes that failed or stalled, both protocols
        self.info = self._broker_info(config.port)
        self.ownership = Ownership(store, self.info)
        self.context = BrokerContext(
            bookkeeper, self.topic_store, config.ledger_password, EntryCache(config.entry_cache_bytes),
            lambda service, error: self.hosting.request_unload(service, error),
            retention_check_interval_s=config.retention_check_interval_s, lease=Lease(config.session_timeout_ms),
            delayed_memory_messages=config.delayed_memory_messages,
            cursor_pacer=CursorWritePacer(config.cursor_writes_per_s),
        )
        self.hosting = PartitionHosting(self.context, store, self.ownership, partition_policies=self.partition_policies,
                                        close_clients=self._close_clients, session_timeout_ms=config.session_timeout_ms)
        self.partitions = self.hosting.partitions  # loaded here: serving, or being unloaded
        self.retired_stats = self.hosting.retired_stats
        self.admin = AdminHandler(self)
        self.tenant_store = TenantStore(self.topic_store)
        self.schemas = SchemaRegistry(self.topic_store, self.tenant_store)
        self.access = AccessControl(config.authenticator, config.superuser_roles, self.tenant_store)
        self._connections: set[_Connection] = set()
        self.protocol_errors = 0  # connections closed for breaking the protocol
        self.connections_timed_out = 0  # closed after two keep-alive intervals of silence
        self._connection_limits = ConnectionLimits(config.connections_max, config.connections_per_address_max)
        self.frame_budget = FrameBudget(config.frame_buffer_bytes_max)
        self._publish_resumed = trio.Event()
        self.publish_buffer = PublishBuffer(config.publish_buffer_bytes, on_resume=self._publish_buffer_resumed)
        self._consumer_ids = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._listeners: list[trio.SocketListener] = []
        self._serving_scope = trio.CancelScope()
        self.stopping = False
        self.started_ms = int(time.time() * 1000)
        # Pulsar's binary protocol, when its port is given (broker/pulsar/server.py).
        self.pulsar = None if config.pulsar_port is None and config.pulsar_tls_port is None else PulsarFrontEnd(self)
        # The web service (REST admin API, HTTP lookup, /metrics), when its
        # port is given (broker/web); imported only then: its stack (hypercorn,
        # Starlette, httpx) is some 25 MB of a broker's memory.
        self.web = None
        if config.web_port is not None or config.web_tls_port is not None:
            from broker.web import WebFrontEnd

            self.web = WebFrontEnd(self)
        self.metrics_registry = None  # what /metrics serves (the process sets it when it measures)

    # --- lifetime --------------------------------------------------------------------------

    async def listen(self, listeners: list[trio.SocketListener] | None = None) -> int:
        """Bind the port (0 picks one), or take `listeners` bound by the caller; returns it."""
        self._listeners = listeners or await trio.open_tcp_listeners(self.config.port, host=self.config.host)
        port = self._listeners[0].socket.getsockname()[1]
        if self.config.port == 0:
            self.config.port = port
        if self.config.tls_port is not None:
            self._tls_listeners = await trio.open_tcp_listeners(self.config.tls_port, host=self.config.host)
            self.tls_port = self._tls_listeners[0].socket.getsockname()[1]
        if self.pulsar is not None:
            self.pulsar_port, self.pulsar_tls_port = await self.pulsar.listen(self.config.pulsar_port, self.config.pulsar_tls_port)
        if self.web is not None:
            self.web_port, self.web_tls_port = self.web.listen(self.config.web_port, self.config.web_tls_port)
        self.info = self._broker_info(port)
        self.ownership.info = self.info
        return port

    @property
    def open_connections(self) -> int:
        """Client connections open, of both protocols."""
        return len(self._connections) + (0 if self.pulsar is None else self.pulsar.open_connections)

    @property
    def connection_limits(self) -> ConnectionLimits:
        return self._connection_limits

    @property
    def session_id(self) -> int:
        """The broker's ZooKeeper session's id."""
        return self.store.session_id

    def new_consumer_id(self) -> int:
        """A consumer id unique in this broker, whichever protocol the consumer speaks."""
        return next(self._consumer_ids)

    def spawn(self, async_fn, *args) -> None:
        """Run a task for as long as the broker serves."""
        assert self._nursery is not None, "the broker is not running"
        self._nursery.start_soon(async_fn, *args)

    async def wait_publish_resumed(self) -> None:
        """Until the publish buffer resumes taking batches."""
        await self._publish_resumed.wait()

    @property
    def connections_refused(self) -> int:
        """Closed at once: too many open in all or from one address."""
        return self._connection_limits.refused

    @property
    def publish_batches_measured(self) -> int:
        """Producer batches taken and not yet answered (counted with metrics on)."""
        return sum(len(connection.publish_started_s) for connection in self._connections)

    @property
    def default_policies(self) -> TopicPolicies:
        return self.config.default_policies

    def _broker_info(self, port: int) -> BrokerInfo:
        config = self.config
        address = config.advertised_address or config.advertised_listeners.get(INTERNAL_LISTENER) or f"{config.host}:{port}"
        # The internal listeners of the other protocols are on the host the internal one advertises.
        host = address.rpartition(":")[0]
        pulsar_listeners = {}
        if self.pulsar_port is not None:
            pulsar_listeners = {INTERNAL_LISTENER: f"{host}:{self.pulsar_port}", **config.pulsar_advertised_listeners}
        tls_listeners = {} if self.tls_port is None else {INTERNAL_LISTENER: f"{host}:{self.tls_port}"}
        pulsar_tls_listeners = {} if self.pulsar_tls_port is None else {INTERNAL_LISTENER: f"{host}:{self.pulsar_tls_port}"}
        web_listeners = {} if self.web_port is None else {INTERNAL_LISTENER: f"{host}:{self.web_port}"}
        web_tls_listeners = {} if self.web_tls_port is None else {INTERNAL_LISTENER: f"{host}:{self.web_tls_port}"}
        return BrokerInfo(config.broker_id, address, dict(config.advertised_listeners), pulsar_listeners,
                          tls_listeners, pulsar_tls_listeners, web_listeners, web_tls_listeners)

    async def run(self, *, startup: Startup | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Register and serve. With `startup`, its ZooKeeper steps are tried
        again after a lost connection or session, within its deadline."""
        if not self._listeners:
            await self.listen()
        # Read before registering: a session replaced from now on, even
        # before the hosting starts, makes its session loop register again.
        generation = self.store.session_generation
        if startup is None:
            await self._ensure_layout()
            await self.ownership.register()
        else:
            await startup.step("create the broker's nodes in ZooKeeper", self._ensure_layout)
            await startup.step(f"register broker {self.info.broker_id} under /brokers", self.ownership.register,
                               detail=self.ownership.problem)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.hosting.run, generation)
            nursery.start_soon(self._keepalive_loop)
            await nursery.start(self._serve)
            log.info("broker %s serving at %s%s", self.info.broker_id, self.info.address,
                     self.describe_listeners())
            task_status.started()

    def describe_listeners(self) -> str:
        """The listeners other than quire's plaintext one, for the log."""
        info = self.info
        described = [f"quire over TLS at {info.address_for(None, tls=True)}"] if info.tls_listeners else []
        for tls, scheme in ((False, "pulsar"), (True, "pulsar+ssl")):
            address = info.pulsar_address_for(None, tls=tls)
            if address is not None:
                described.append(f"Pulsar at {scheme}://{address}")
        for tls in (False, True):
            url = info.web_url_for(None, tls=tls)
            if url is not None:
                described.append(f"web service at {url}")
        return "".join(f", {text}" for text in described)

    async def _ensure_layout(self) -> None:
        await self.topic_store.ensure_layout()
        await self.tenant_store.ensure_defaults()

    async def _serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept connections of both protocols until shutdown cancels the scope."""
        with self._serving_scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._handle_connection, self._listeners)
                if self._tls_listeners:
                    await nursery.start(trio.serve_listeners, self._handle_tls_connection, self._tls_listeners)
                if self.pulsar is not None:
                    await nursery.start(self.pulsar.serve)
                if self.web is not None:
                    await nursery.start(self.web.serve)
                task_status.started()

    async def shutdown(self) -> None:
        """Graceful stop: unregister (lookups choose other brokers), unload
        every partition while clients are still connected (they are told to
        look their partitions up again), then close every connection."""
        self.stopping = True
        await self.ownership.unregister()
        await self.hosting.stop()
        self._serving_scope.cancel()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # --- ownership and loading ---------------------------------------------------------------

    async def topic_record(self, topic: str, *, create: bool) -> TopicRecord:
        found = await self.topic_store.read_topic(topic)
        if found is not None:
            return found[0]
        if not (create and self.config.auto_topic_creation):
            raise TopicNotFoundError(f"topic {topic!r} does not exist")
        await self.access.check_namespace(topic)
        record = TopicRecord(0, self.config.default_policies, int(time.time() * 1000), frozenset())
        try:
            await self.topic_store.create_topic(topic, record)
            log.info("topic %s created on first use", topic)
        except NodeExistsError:
            pass
        found = await self.topic_store.read_topic(topic)
        if found is None:
            raise TopicNotFoundError(f"topic {topic!r} was deleted")
        return found[0]

    async def partition_policies(self, partition: str, *, watch: bool = False) -> tuple[str, int, TopicPolicies]:
        """(topic, partition index, policies) of a partition that exists,
        read now; with `watch`, the topic's record read is also the one its
        policy checks start from (TopicStore.read_topic)."""
        check_name(partition)
        found = await self.topic_store.read_topic(partition, watch=watch)
        if found is not None and found[0].partitions == 0:
            return partition, -1, await self.tenant_store.policies_in_effect(partition, found[0])
        topic, index = split_partition(partition)
        if index >= 0:
            found = await self.topic_store.read_topic(topic, watch=watch)
            if found is not None and index < found[0].partitions:
                return topic, index, await self.tenant_store.policies_in_effect(topic, found[0])
        raise TopicNotFoundError(f"no partition or topic {partition!r}")

    async def lookup(self, partition: str, authoritative: bool) -> tuple[BrokerInfo, bool]:
        """The broker serving `partition` (taking it if it is unowned and this
        broker is the one to take it); the flag says "redirect": ask that
        broker, with authority."""
        if self.hosting.core.access(partition) is Access.SERVE:
            return self.info, False
        await self.partition_policies(partition)
        owner = await self.ownership.owner_of(partition)
        live = {} if owner is not None else await self.ownership.live_brokers()
        claimed = None  # (the owner this broker's claim answered, releases before it): serving need not read it again
        while True:
            decision = decide_lookup(
                partition, self.info.broker_id, self.store.session_id,
                None if owner is None else (owner.info.broker_id, owner.session_id), sorted(live),
                stopping=self.stopping, authoritative=authoritative,
            )
            if decision.answer is Answer.SERVE:
                await self.hosting.serving(partition, claimed)
                return self.info, False
            if decision.answer is Answer.ELSEWHERE:
                return owner.info, False
            if decision.answer is Answer.REDIRECT:
                return live[decision.broker_id], True
            if decision.answer is Answer.RETRY:
                raise ServiceUnavailableError(decision.reason)
            releases = self.hosting.core.releases
            owner = await self.ownership.claim(partition)  # then decide again, with its owner
            claimed = (owner, releases)

    async def serving(self, partition: str) -> PartitionService:
        """The loaded partition, loading it if this broker owns it."""
        return await self.hosting.serving(partition)

    async def unload_partition(self, partition: str) -> bool:
        return await self.hosting.unload(partition)

    async def delete_partition(self, partition: str, *, force: bool) -> None:
        """Delete a partition this broker owns: its ledgers, cursors and
        records. Refused while producers or consumers are connected, unless forced."""
        service = await self.serving(partition)
        busy = len(service.producers) + sum(len(subscription.consumers) for subscription in service.subscriptions.values())
        if busy and not force:
            raise ConsumerBusyError(f"{partition} has {busy} producers and consumers connected (force to delete anyway)")
        if not await self.hosting.unload(partition, delete=True):
            raise TopicFencedError(f"partition {partition} is being unloaded from this broker; look it up again")

    async def seek(self, service: PartitionService, subscription_name: str, *, offset: int | None = None,
                   publish_time_ms: int | None = None, message_id: list[int] | None = None,
                   close_consumers: bool = True) -> int:
        """Move a subscription to an offset, the first message published at
        or after a time, or a message id [ledger id, entry id, batch index];
        its consumers subscribe again (unless `close_consumers` is False:
        the caller closes them itself). Returns the offset."""
        subscription = self._subscription(service, subscription_name)
        if offset is None and publish_time_ms is not None:
            offset = await service.managed_ledger.offset_at_time(publish_time_ms)
        elif offset is None and message_id is not None and len(message_id) == 3:
            offset = await service.offset_of_message(*message_id)
        elif offset is None:
            raise BadRequestError("a seek names an offset, a message id or a publish time")
        await subscription.seek(offset)
        if close_consumers:
            # As Pulsar does: every consumer of the subscription subscribes
            # again, so that nothing delivered before the seek is mistaken
            # for what follows it.
            self.close_consumers(service, subscription_name)
        return offset

    def close_consumers(self, service: PartitionService, subscription_name: str) -> None:
        """Every consumer of the subscription, whichever protocol it speaks, subscribes again."""
        self._close_consumers(service, subscription_name)
        if self.pulsar is not None:
            self.pulsar.close_consumers(service, subscription_name)

    def _close_consumers(self, service: PartitionService, subscription_name: str) -> None:
        for connection in list(self._connections):
            for handle, (owner, name, consumer_id) in list(connection.consumers.items()):
                if owner is service and name == subscription_name:
                    del connection.consumers[handle]
                    # Kept even if not durable and now without consumers: its
                    # consumer comes back to the position it sought.
                    service.remove_consumer(name, consumer_id, keep=True)
                    connection.send(Closed("consumer", handle, f"subscription {name} was moved: subscribe again"))

    @staticmethod
    def _close_producer(connection: _Connection, link: ProducerLink, reason: str) -> None:
        found = connection.producers.get(link.handle)
        if found is not None and found[1] is link:
            del connection.producers[link.handle]
            connection.send(Closed("producer", link.handle, reason))

    def _close_clients(self, service: PartitionService) -> None:
        """Tell every producer and consumer of the partition to look it up again."""
        if self.pulsar is not None:
            self.pulsar.close_clients(service)
        for connection in list(self._connections):
            for handle, (owner, link) in list(connection.producers.items()):
                if owner is service:
                    del connection.producers[handle]
                    connection.send(Closed("producer", handle, f"{service.name} moved: look it up again"))
            for handle, (owner, _, _) in list(connection.consumers.items()):
                if owner is service:
                    del connection.consumers[handle]
                    connection.send(Closed("consumer", handle, f"{service.name} moved: look it up again"))

    # --- connections -------------------------------------------------------------------------

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        await serve_admitted(stream, self._connection_limits, log, lambda peer: self._serve_connection(stream, peer))

    async def _handle_tls_connection(self, stream: trio.SocketStream) -> None:
        await serve_admitted_tls(stream, self._connection_limits, log, self.config.tls_context,
                                 self.config.tls_handshake_deadline_s, self.count_tls_refusal, self._serve_connection)

    def count_tls_refusal(self) -> None:
        self.tls_handshakes_refused += 1

    async def _serve_connection(self, stream: trio.SocketStream, peer: str) -> None:
        connection = _Connection(peer, stream, FrameOutput(stream), output_bytes_max=self.config.connection_output_bytes_max,
                                 metrics=self.metrics)
        decoder = FrameDecoder(self.config.frame_bytes_max, REQUEST_ITEMS_MAX)
        connection.reader = FrameReader(stream, decoder, self.frame_budget, self.config.frame_deadline_s)
        enable_keepalive(stream)
        try:
            hello, early = None, []
            with peer_faults(log, peer, self._count_protocol_error):
                with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                    decoder.frame_bytes_max = HANDSHAKE_FRAME_BYTES_MAX
                    hello, early = await self._first_frame(connection, decoder)
                    decoder.frame_bytes_max = self.config.frame_bytes_max
            if hello is None:
                return
            self._connections.add(connection)
            slots = trio.Semaphore(self.config.requests_in_flight_max)
            async with trio.open_nursery() as nursery:
                connection.cancel_scope = nursery.cancel_scope
                nursery.start_soon(self._write_loop, connection, nursery.cancel_scope)
                await self._read_requests(connection, decoder, nursery, slots, early)
                nursery.cancel_scope.cancel()
        finally:
            connection.reader.close()
            connection.closed = True
            self._connections.discard(connection)
            self._forget_connection(connection)
            await trio.aclose_forcefully(stream)

    async def _first_frame(self, connection: _Connection, decoder: FrameDecoder) -> tuple[Connect | None, list]:
        """The client's CONNECT (None if it closed or speaks another
        version), and the frames that came behind it."""
        frames = list(decoder.frames())
        while not frames:
            if not await connection.reader.receive():
                return None, []
            frames = list(decoder.frames())
        first = frames[0]
        if type(first) is list and len(first) >= 2 and first[0] == Command.CONNECT and first[1] != PROTOCOL_VERSION:
            # Another version's CONNECT may have other fields: answered before it is decoded.
            await self._connected(connection, BrokerStatus.BAD_VERSION, f"this broker speaks protocol {PROTOCOL_VERSION}")
            return None, []
        hello = decode_from_peer(decode, first, "handshake")
        if not isinstance(hello, Connect):
            raise ProtocolError("the first frame must be CONNECT")
        try:
            connection.principal = self.access.authenticate(
                hello.auth_method, hello.auth_data, peer=connection.peer, peer_common_name=peer_common_name(connection.stream),
                now=time.time(), protocol="quire")
        except BrokerError as error:
            await self._connected(connection, error.status, str(error))
            return None, []
        await self._connected(connection, BrokerStatus.OK, "")
        return hello, frames[1:]

    async def _connected(self, connection: _Connection, status: BrokerStatus, message: str) -> None:
        await connection.stream.send_all(encode(Connected(int(status), PROTOCOL_VERSION, self.info.broker_id,
                                                          self.config.frame_bytes_max, message)))

    async def _write_loop(self, connection: _Connection, cancel_scope: trio.CancelScope) -> None:
        try:
            await connection.output.run_writer()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            cancel_scope.cancel()

    async def _read_requests(self, connection: _Connection, decoder: FrameDecoder, nursery: trio.Nursery,
                             slots: trio.Semaphore, early: list) -> None:
        """Errors of the connection stay here, so that its nursery never
        carries them: a peer that breaks the protocol loses this connection only."""
        with peer_faults(log, connection.peer, self._count_protocol_error):
            for fields in early:
                await self._handle(connection, decode_from_peer(decode, fields, "frame"), nursery, slots)
            await self._read_loop(connection, decoder, nursery, slots)

    def _count_protocol_error(self) -> None:
        self.protocol_errors += 1

    async def _read_loop(self, connection: _Connection, decoder: FrameDecoder, nursery: trio.Nursery, slots: trio.Semaphore) -> None:
        while True:
            for fields in decoder.frames():
                await self._handle(connection, decode_from_peer(decode, fields, "frame"), nursery, slots)
            await wait_for_output_room(connection.output, self.config.connection_output_bytes_max, self.config.frame_deadline_s)
            await self._wait_for_publish_room(connection)
            if not await connection.reader.receive():
                return
            connection.pinged = False

    async def _wait_for_publish_room(self, connection: _Connection) -> None:
        """While the publish buffer is paused, a connection with producers
        is not read (the frames it sent already were taken): its producers
        wait, and their batches wait unread in the sockets. Each keep-alive
        interval it is sent a PING, so that the client knows the broker is
        there (its PONG is read once reading resumes), as Pulsar's broker
        does while auto-read is off."""
        while self.publish_buffer.paused and connection.producers and not connection.closed:
            with trio.move_on_after(self.config.keepalive_interval_s) as waited:
                await self._publish_resumed.wait()
            if waited.cancelled_caught:
                connection.send(Ping())

    def _publish_buffer_resumed(self) -> None:
        resumed, self._publish_resumed = self._publish_resumed, trio.Event()
        resumed.set()

    async def _keepalive_loop(self) -> None:
        """Pulsar's keep-alive: every client connection silent for an
        interval is sent a PING; one silent for two intervals (a client gone
        without a FIN, or stuck) is closed, and its producers and consumers
        are let go. Silence counts only while the broker reads the
        connection: while it holds a client back (a full publish queue, no
        room for answers) the client's bytes wait unread and say nothing."""
        interval_s = self.config.keepalive_interval_s
        while True:
            await trio.sleep(interval_s / 4)
            keepalive_sweep(self._connections, trio.current_time(), interval_s,
                            ping=lambda connection: connection.send(Ping()), timed_out=self._timed_out)
            for connection in list(self._connections):
                expires_at = connection.principal.expires_at
                if expires_at is not None and connection.cancel_scope is not None and time.time() >= expires_at:
                    # quire's protocol has no challenge: the client connects
                    # again, with the token its token function gives now.
                    self.access.refused_authentication(connection.peer, "quire", "its token expired")
                    connection.cancel_scope.cancel()

    def _timed_out(self, connection: _Connection, silent_s: float) -> None:
        self.connections_timed_out += 1
        log.info("closing connection from %s: silent for %.0fs (keep-alive interval %gs)",
                 connection.peer, silent_s, self.config.keepalive_interval_s)

    def _forget_connection(self, connection: _Connection) -> None:
        for service, link in connection.producers.values():
            service.remove_producer(link.producer_id, link.handle)
        for service, subscription_name, consumer_id in connection.consumers.values():
            service.remove_consumer(subscription_name, consumer_id)
        connection.producers.clear()
        connection.consumers.clear()

    # --- commands ------------------------------------------------------------------------------

    async def _handle(self, connection: _Connection, message: Any, nursery: trio.Nursery, slots: trio.Semaphore) -> None:
        kind = type(message)
        if kind is Send:
            found = connection.producers.get(message.producer_handle)
            if found is None:
                connection.send_receipt(SendReceipt(message.producer_handle, message.last_sequence_id, int(BrokerStatus.TOPIC_FENCED),
                                                    -1, -1, -1, "no such producer on this connection (it was closed): reconnect"))
                return
            service, link = found
            if connection.metrics is not None:
                connection.publish_started_s[(message.producer_handle, message.last_sequence_id)] = time.perf_counter()
            # The batch's bytes (its keys' objects included) count until it is
            # answered, whatever answers it (the permit is released once, by
            # whichever path ends it).
            await service.publish(link, message, self.publish_buffer.take(batch_cost_bytes(message.body, message.message_count)))
        elif kind is Flow or kind is Redeliver:
            # For a consumer closed meanwhile: nothing to do.
            found = connection.consumers.get(message.consumer_handle)
            subscription = None if found is None else found[0].subscriptions.get(found[1])
            if subscription is not None and kind is Flow:
                subscription.flow(found[2], message.permits)
            elif subscription is not None:
                subscription.redeliver(found[2], message.offsets)
        elif kind is CloseProducer:
            found = connection.producers.pop(message.producer_handle, None)
            if found is not None:
                found[0].remove_producer(found[1].producer_id, found[1].handle)
            connection.send(Response(message.request_id, int(BrokerStatus.OK), "", {}))
        elif kind is CloseConsumer:
            found = connection.consumers.pop(message.consumer_handle, None)
            if found is not None:
                found[0].remove_consumer(found[1], found[2])
            connection.send(Response(message.request_id, int(BrokerStatus.OK), "", {}))
        elif kind is Ack:
            # Taken now, in the connection's order (a seek that follows must
            # not be overtaken by it); only the wait for durability is a task.
            try:
                service, subscription_name, _ = self._consumer(connection, message.consumer_handle)
                taken = self._subscription(service, subscription_name).take_acknowledgement(
                    message.offsets, cumulative=message.cumulative)
            except BrokerError as error:
                connection.send(Response(message.request_id, int(error.status), str(error), {}))
                return
            await slots.acquire()
            nursery.start_soon(self._request, connection, message, slots, taken)
        elif kind in (Lookup, ProducerOpen, Subscribe, Seek, Unsubscribe, Admin):
            await slots.acquire()
            nursery.start_soon(self._request, connection, message, slots)
        elif kind is Ping:
            connection.send(Pong())
        elif kind is Pong:
            pass  # any bytes from the client show it is there
        else:
            raise ProtocolError(f"{kind.__name__} is not a request a client sends")

    async def _request(self, connection: _Connection, message: Any, slots: trio.Semaphore,
                       taken: TakenAcknowledgement | None = None) -> None:
        try:
            body = await self._answer(connection, message, taken)
            response = Response(message.request_id, int(BrokerStatus.OK), "", body or {})
        except BrokerError as error:
            response = Response(message.request_id, int(error.status), str(error), {})
        except ValueError as error:
            response = Response(message.request_id, int(BrokerStatus.BAD_REQUEST), str(error), {})
        except (BKError, MetadataError, trio.TooSlowError) as error:
            response = Response(message.request_id, int(BrokerStatus.ERROR), f"{type(error).__name__}: {error}", {})
        except AssertionError:
            raise  # our own invariant broke: a bug, crash
        except Exception as error:
            log.exception("request %s from %s failed unexpectedly", type(message).__name__, connection.peer)
            response = Response(message.request_id, int(BrokerStatus.ERROR), f"{type(error).__name__}: {error}", {})
        finally:
            slots.release()
        connection.send(response)

    async def _answer(self, connection: _Connection, message: Any, taken: TakenAcknowledgement | None = None) -> dict | None:
        kind = type(message)
        if kind is Ack:
            assert taken is not None, "an acknowledgement is taken before it is answered"
            await taken.durable()
            return None
        if kind is Lookup:
            await self.access.check_topic(connection.role, message.topic, None, "look up")
            info, redirect = await self.lookup(message.topic, message.authoritative)
            return {"broker_id": info.broker_id, "address": info.address, "listeners": info.listeners,
                    "tls_listeners": info.tls_listeners, "redirect": redirect}
        if kind is ProducerOpen:
            check_name(message.producer_id, "producer")
            if message.producer_handle in connection.producers:
                raise BadRequestError(f"producer handle {message.producer_handle} is in use on this connection")
            await self.access.check_topic(connection.role, message.topic, Action.PRODUCE, "produce to")
            service = await self.serving(message.topic)
            link = ProducerLink(message.producer_handle, message.producer_id, connection.send_receipt)
            link.close = lambda reason: self._close_producer(connection, link, reason)
            last_sequence_id = await service.add_producer(link)
            connection.producers[message.producer_handle] = (service, link)
            return {"last_sequence_id": last_sequence_id, "partition": service.name}
        if kind is Subscribe:
            if message.consumer_handle in connection.consumers:
                raise BadRequestError(f"consumer handle {message.consumer_handle} is in use on this connection")
            await self.access.check_topic(connection.role, message.topic, Action.CONSUME, "consume from")
            service = await self.serving(message.topic)
            consumer_id = next(self._consumer_ids)
            link = ConsumerLink(consumer_id, message.consumer_handle, message.consumer_name or f"consumer-{consumer_id}",
                                connection.send, connection.wait_for_room)
            subscription = await service.subscribe(
                link, message.subscription, SubscriptionType.parse(message.subscription_type),
                priority=message.priority, initial_position=message.initial_position, durable=message.durable,
                important=message.important, start_offset=message.start_offset, read_compacted=message.read_compacted,
            )
            if connection.closed:
                service.remove_consumer(subscription.name, consumer_id)
                return None
            connection.consumers[message.consumer_handle] = (service, subscription.name, consumer_id)
            return {"partition": service.name, "partition_index": service.partition_index}
        service, subscription_name, consumer_id = self._consumer(connection, message.consumer_handle) if kind in (Ack, Seek, Unsubscribe) else (None, "", 0)
        if kind is Seek:
            offset = await self.seek(service, subscription_name, offset=message.offset,
                                     publish_time_ms=message.publish_time_ms, message_id=message.message_id)
            return {"offset": offset}
        if kind is Unsubscribe:
            await service.unsubscribe(subscription_name, consumer_id)
            connection.consumers.pop(message.consumer_handle, None)
            return None
        if kind is Admin:
            return await self.admin.handle(message.action, message.arguments, connection.role)
        raise AssertionError(kind)

    def _consumer(self, connection: _Connection, handle: int) -> tuple[PartitionService, str, int]:
        found = connection.consumers.get(handle)
        if found is None:
            raise TopicFencedError(f"no consumer {handle} on this connection (it was closed): subscribe again")
        return found

    def _subscription(self, service: PartitionService, name: str):
        subscription = service.subscriptions.get(name)
        if subscription is None or service.fenced is not None or service.closing or subscription.closed:
            raise TopicFencedError(f"subscription {name} is no longer served here: subscribe again")
        return subscription


__all__ = ["BrokerServer"]
