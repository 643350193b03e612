"""The broker's Pulsar front-end (trio): client connections on
`--pulsar-port` speaking Pulsar's binary protocol, each command turned into
the broker's own calls (lookups, producers, publishing, subscriptions,
acknowledgements, seeks) and each answer into Pulsar's commands. The rules
are the broker's, shared with quire's own protocol (`broker/server.py`):
this module translates, it does not decide.

Pulsar identifies a message by (ledger id, entry id, batch index); quire's
subscriptions by partition offset. A consumer's connection keeps what it
delivered (each entry's first offset and the batch indexes sent) until it
is acknowledged, so that an acknowledgement acknowledges exactly what that
consumer received; an id it never delivered is looked up in the ledger.
Receipts go back to a producer in the order it sent its messages, as
Pulsar's clients require.
"""

from __future__ import annotations

import collections
import itertools
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from broker.config import BrokerConfig
from broker.dispatcher import SubscriptionType
from broker.errors import (
    AuthenticationError,
    BrokerError,
    BrokerStatus,
    ConsumerBusyError,
    IncompatibleSchemaError,
    NotAllowedError,
    NotFoundError,
    SubscriptionNotFoundError,
    TopicFencedError,
)
from broker.managed_ledger import EntryGoneError, Position
from broker.access import AccessControl
from broker.authorization import Action
from broker.message_format import MalformedEntryError, decode_entry, pulsar_message
from broker.protocol import MessageDelivery, Send, SendReceipt
from broker.ownership import BrokerInfo
from broker.publish_buffer import PublishBuffer, batch_cost_bytes
from broker.publish_core import AccessMode
from broker.pulsar.pulsar_api_pb2 import (
    AuthData,
    CommandAck,
    CommandLookupTopicResponse,
    CommandPartitionedTopicMetadataResponse,
    CommandSubscribe,
    FeatureFlags,
    KeySharedMode,
    MessageIdData,
    ProducerAccessMode,
    Schema,
    ServerError,
)
from broker.pulsar.wire import Frame, PulsarFrameDecoder, Type, command, encode, encode_parts
from broker.subscription import ConsumerLink, TakenAcknowledgement
from broker.topic import PartitionService, ProducerLink
from broker.topic_names import NotPersistentError, TopicNameError, namespace_of, quire_name
from broker.topic_records import TopicRecord
from broker.topic_store import TopicStore
from broker.topic_lookup import ensure_topic, lookup_partition, partition_count, topics_of_namespace
from coordination.store import MetadataError
from framing.codec import ProtocolError
from framing.peer_limits import HANDSHAKE_FRAME_BYTES_MAX, ConnectionLimits, FrameBudget, FrameReader, keepalive_sweep, peer_faults, serve_admitted, serve_admitted_tls, wait_for_output_room
from framing.stream import FrameOutput, enable_keepalive
from ledger_client import BKError
from security.tls import stream_peer_common_name as peer_common_name
from security.authentication import ANONYMOUS_WHEN_OFF, TOKEN_METHOD, Principal

# What an AUTH_CHALLENGE carries to ask for a fresh token (Pulsar's
# AuthData.REFRESH_AUTH_DATA).
REFRESH_AUTH_DATA = b"PulsarAuthRefresh"
ERROR_DRAIN_S = 1.0  # for a last ERROR to go out before its connection closes


class BrokerAccess(Protocol):
    """What the front-end needs of its broker (broker.server.BrokerServer is one)."""

    config: BrokerConfig
    info: BrokerInfo
    access: AccessControl

    def count_tls_refusal(self) -> None: ...

    @property
    def session_id(self) -> int: ...
    topic_store: TopicStore
    schemas: Any  # broker.schema_registry.SchemaRegistry
    publish_buffer: PublishBuffer
    frame_budget: FrameBudget
    protocol_errors: int
    connections_timed_out: int

    @property
    def connection_limits(self) -> ConnectionLimits: ...

    def new_consumer_id(self) -> int: ...

    def spawn(self, async_fn, *args) -> None: ...

    async def wait_publish_resumed(self) -> None: ...

    async def topic_record(self, topic: str, *, create: bool) -> TopicRecord: ...

    async def lookup(self, partition: str, authoritative: bool) -> tuple[BrokerInfo, bool]: ...

    async def serving(self, partition: str) -> PartitionService: ...

    async def seek(self, service: PartitionService, subscription_name: str, *, offset: int | None = None,
                   publish_time_ms: int | None = None, message_id: list[int] | None = None,
                   close_consumers: bool = True) -> int: ...

    def close_consumers(self, service: PartitionService, subscription_name: str) -> None: ...

log = logging.getLogger(__name__)

SERVER_VERSION = "quire"
# The newest protocol version this front-end speaks (Pulsar 3.x's 21);
# a client's older version is answered with its own.
PROTOCOL_VERSION_MAX = 21
PROTOCOL_VERSION_MIN = 6  # checksums on messages; older clients are refused
HANDSHAKE_TIMEOUT_S = 10.0
RETRY_DELAY_S = 0.05  # a resend of a message still being written is taken again after this
ACK_RESOLVE_READS_MAX = 64  # entries read to resolve the ids of one acknowledgement (ids not delivered here)

_SCHEMA_NONE = Schema.Type.Value("None")  # bytes: nothing stored
_ACCESS_MODES = {
    ProducerAccessMode.Value("Shared"): AccessMode.SHARED,
    ProducerAccessMode.Value("Exclusive"): AccessMode.EXCLUSIVE,
    ProducerAccessMode.Value("WaitForExclusive"): AccessMode.WAIT_FOR_EXCLUSIVE,
    ProducerAccessMode.Value("ExclusiveWithFencing"): AccessMode.EXCLUSIVE_WITH_FENCING,
}

_SUBSCRIPTION_TYPES = {
    CommandSubscribe.Exclusive: SubscriptionType.EXCLUSIVE,
    CommandSubscribe.Shared: SubscriptionType.SHARED,
    CommandSubscribe.Failover: SubscriptionType.FAILOVER,
    CommandSubscribe.Key_Shared: SubscriptionType.KEY_SHARED,
}

# The broker's statuses as Pulsar's server errors (what its clients retry
# on: ServiceNotReady, TooManyRequests, MetadataError, PersistenceError).
_SERVER_ERRORS = {
    BrokerStatus.ERROR: ServerError.PersistenceError,
    BrokerStatus.BAD_REQUEST: ServerError.UnknownError,
    BrokerStatus.NOT_OWNER: ServerError.ServiceNotReady,
    BrokerStatus.TOPIC_NOT_FOUND: ServerError.TopicNotFound,
    BrokerStatus.TOPIC_EXISTS: ServerError.UnknownError,
    BrokerStatus.PRODUCER_BUSY: ServerError.ProducerBusy,
    BrokerStatus.CONSUMER_BUSY: ServerError.ConsumerBusy,
    BrokerStatus.RETRY: ServerError.ServiceNotReady,
    BrokerStatus.PARTITION_OVERFLOW: ServerError.ProducerBlockedQuotaExceededException,
    BrokerStatus.SUBSCRIPTION_NOT_FOUND: ServerError.SubscriptionNotFound,
    BrokerStatus.TOPIC_FENCED: ServerError.ServiceNotReady,
    BrokerStatus.SERVICE_UNAVAILABLE: ServerError.ServiceNotReady,
    BrokerStatus.BAD_VERSION: ServerError.UnsupportedVersionError,
    BrokerStatus.CHECKSUM: ServerError.ChecksumError,
    BrokerStatus.NOT_ALLOWED: ServerError.NotAllowedError,
    BrokerStatus.PRODUCER_FENCED: ServerError.ProducerFenced,
    BrokerStatus.UNAUTHENTICATED: ServerError.AuthenticationError,
    BrokerStatus.UNAUTHORIZED: ServerError.AuthorizationError,
    BrokerStatus.NOT_FOUND: ServerError.TopicNotFound,  # a namespace that does not exist: not retried
    BrokerStatus.CONFLICT: ServerError.UnknownError,
}
# Receipts that mean "this partition is not served here (any more)": the
# producer is closed, and its client looks the topic up again and resends.
_MOVED = frozenset({BrokerStatus.TOPIC_FENCED, BrokerStatus.NOT_OWNER, BrokerStatus.SERVICE_UNAVAILABLE, BrokerStatus.ERROR})


def server_error(error: BaseException) -> tuple[int, str]:
    """(Pulsar server error, message) of an error a request raised."""
    if isinstance(error, IncompatibleSchemaError):
        return ServerError.IncompatibleSchema, str(error)
    if isinstance(error, BrokerError):
        return _SERVER_ERRORS.get(error.status, ServerError.UnknownError), str(error)
    if isinstance(error, NotPersistentError):
        # Not InvalidTopicName: Pulsar's clients retry that one until their
        # operation times out; this one they report at once.
        return ServerError.NotAllowedError, str(error)
    if isinstance(error, TopicNameError):
        return ServerError.InvalidTopicName, str(error)
    if isinstance(error, ValueError):
        return ServerError.UnknownError, str(error)
    if isinstance(error, MetadataError):
        return ServerError.MetadataError, f"{type(error).__name__}: {error}"
    return ServerError.PersistenceError, f"{type(error).__name__}: {error}"


@dataclass(slots=True)
class _PendingSend:
    send: Send
    sequence_id: int  # as the producer sent it (its batch's first)
    highest_sequence_id: int
    receipt: bytes | None = None  # the answer's frame, once answered


@dataclass(eq=False)
class _Producer:
    handle: int
    name: str
    service: PartitionService
    link: ProducerLink
    pending: collections.deque[_PendingSend] = field(default_factory=collections.deque)
    closed: bool = False


@dataclass(eq=False)
class _Consumer:
    handle: int
    service: PartitionService
    subscription: str
    consumer_id: int
    subscription_type: SubscriptionType
    # What was delivered and not yet acknowledged: (ledger id, entry id) ->
    # (first offset of the entry, batch indexes delivered, whether a batch).
    delivered: dict[tuple[int, int], tuple[int, tuple[int, ...], bool]] = field(default_factory=dict)
    active: bool | None = None  # as last told (Failover and Exclusive)


@dataclass(eq=False)
class _Connection:
    peer: str
    stream: trio.SocketStream
    output: FrameOutput
    reader: FrameReader | None = None
    producers: dict[int, _Producer] = field(default_factory=dict)
    consumers: dict[int, _Consumer] = field(default_factory=dict)
    closed: bool = False
    pinged: bool = False
    cancel_scope: trio.CancelScope | None = None
    output_bytes_max: int = 64 * 1024 * 1024
    protocol_version: int = PROTOCOL_VERSION_MAX
    # ("producer" | "consumer", id) of those being opened on this connection.
    reserved: set = field(default_factory=set)
    principal: Principal = ANONYMOUS_WHEN_OFF  # who the client authenticated as
    supports_auth_refresh: bool = False
    challenged_at: float | None = None  # when an AUTH_CHALLENGE went out unanswered (loop time)

    def send(self, frame: bytes) -> None:
        if self.closed:
            return
        self.output.queue(frame)
        self.output.flush()

    def send_parts(self, parts: list, nbytes: int) -> None:
        if self.closed:
            return
        self.output.queue_parts(parts, nbytes)
        self.output.flush()

    async def drain_briefly(self) -> None:
        """Give what is queued (a last ERROR) a moment to go out before the
        connection closes; nothing to wait for when it went out at once."""
        with trio.move_on_after(ERROR_DRAIN_S):
            while self.output.bytes:
                await self.output.wait_drained()

    async def wait_for_room(self) -> None:
        while self.output.bytes > self.output_bytes_max and not self.closed:
            with trio.move_on_after(1.0):
                await self.output.wait_drained()


class PulsarFrontEnd:
    def __init__(self, broker: BrokerAccess) -> None:
        self.broker = broker
        self.config = broker.config
        self._connections: set[_Connection] = set()
        self._listeners: list[trio.SocketListener] = []
        self._tls_listeners: list[trio.SocketListener] = []
        self._producer_names = itertools.count(0)
        self.protocol_errors = 0

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    # --- lifetime ----------------------------------------------------------------------------

    async def listen(self, port: int | None, tls_port: int | None = None) -> tuple[int | None, int | None]:
        """Bind Pulsar's port and its TLS port (pulsar+ssl://), each if given
        (0 picks one); returns the ports bound."""
        bound = []
        for wanted, attribute in ((port, "_listeners"), (tls_port, "_tls_listeners")):
            if wanted is None:
                bound.append(None)
                continue
            listeners = await trio.open_tcp_listeners(wanted, host=self.config.host)
            setattr(self, attribute, listeners)
            bound.append(listeners[0].socket.getsockname()[1])
        return bound[0], bound[1]

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keepalive_loop)
            if self._listeners:
                await nursery.start(trio.serve_listeners, self._handle_connection, self._listeners)
            if self._tls_listeners:
                await nursery.start(trio.serve_listeners, self._handle_tls_connection, self._tls_listeners)
            task_status.started()

    async def _keepalive_loop(self) -> None:
        """As the broker's own protocol: a PING after an interval of silence,
        closed after two."""
        interval_s = self.config.keepalive_interval_s
        ping = encode(command(Type.PING))
        while True:
            await trio.sleep(interval_s / 4)
            now = trio.current_time()
            keepalive_sweep(self._connections, now, interval_s, ping=lambda connection: connection.send(ping),
                            timed_out=self._timed_out)
            for connection in list(self._connections):
                if connection.cancel_scope is not None:
                    self._check_credentials(connection, now)

    def _timed_out(self, connection: _Connection, silent_s: float) -> None:
        self.broker.connections_timed_out += 1
        log.info("closing Pulsar connection from %s: silent for %.0fs", connection.peer, silent_s)

    def _check_credentials(self, connection: _Connection, now: float) -> None:
        """A connection whose token expired is asked for a fresh one (Pulsar's
        AUTH_CHALLENGE) if its client can refresh, and closed if it cannot,
        or does not answer within a keep-alive interval."""
        expires_at = connection.principal.expires_at
        if expires_at is None or time.time() < expires_at:
            return
        if connection.challenged_at is None and connection.supports_auth_refresh:
            connection.challenged_at = now
            connection.send(encode(command(Type.AUTH_CHALLENGE, server_version=SERVER_VERSION,
                                           protocol_version=connection.protocol_version,
                                           challenge=AuthData(auth_method_name=TOKEN_METHOD, auth_data=REFRESH_AUTH_DATA))))
        elif connection.challenged_at is None or now - connection.challenged_at >= self.config.keepalive_interval_s:
            self.broker.access.refused_authentication(connection.peer, "Pulsar", "its token expired and no fresh one came")
            connection.cancel_scope.cancel()

    async def _auth_response(self, connection: _Connection, body) -> None:
        """A fresh token, in answer to AUTH_CHALLENGE: the connection goes on
        under it; a refused one closes the connection."""
        if connection.principal.method != TOKEN_METHOD:
            raise ProtocolError("AUTH_RESPONSE on a connection that did not authenticate with a token")
        try:
            connection.principal = self.broker.access.refresh(connection.principal, body.response.auth_data,
                                                              peer=connection.peer, now=time.time(), protocol="Pulsar")
        except BrokerError as error:
            connection.send(encode(command(Type.ERROR, request_id=0, error=ServerError.AuthenticationError,
                                           message=str(error)[:500])))
            await connection.drain_briefly()
            connection.cancel_scope.cancel()
            return
        connection.challenged_at = None

    # --- what the broker tells its clients -----------------------------------------------------

    def close_clients(self, service: PartitionService) -> None:
        """The partition moved: its producers and consumers are closed, and
        their clients look it up again."""
        for connection in list(self._connections):
            for handle, producer in list(connection.producers.items()):
                if producer.service is service:
                    self._close_producer(connection, producer)
            for handle, consumer in list(connection.consumers.items()):
                if consumer.service is service:
                    del connection.consumers[handle]
                    connection.send(encode(command(Type.CLOSE_CONSUMER, consumer_id=handle, request_id=0)))

    def close_consumers(self, service: PartitionService, subscription_name: str) -> None:
        """After a seek: every consumer of the subscription subscribes again."""
        for connection in list(self._connections):
            for handle, consumer in list(connection.consumers.items()):
                if consumer.service is service and consumer.subscription == subscription_name:
                    del connection.consumers[handle]
                    service.remove_consumer(subscription_name, consumer.consumer_id, keep=True)
                    connection.send(encode(command(Type.CLOSE_CONSUMER, consumer_id=handle, request_id=0)))

    def _close_producer(self, connection: _Connection, producer: _Producer) -> None:
        if connection.producers.get(producer.handle) is producer:
            del connection.producers[producer.handle]
        producer.closed = True
        producer.pending.clear()  # its client resends them to wherever the partition goes
        producer.service.remove_producer(producer.link.producer_id, producer.link.handle)
        connection.send(encode(command(Type.CLOSE_PRODUCER, producer_id=producer.handle, request_id=0)))

    # --- connections -----------------------------------------------------------------------------

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        await serve_admitted(stream, self.broker.connection_limits, log, lambda peer: self._serve_connection(stream, peer))

    async def _handle_tls_connection(self, stream: trio.SocketStream) -> None:
        await serve_admitted_tls(stream, self.broker.connection_limits, log, self.config.tls_context,
                                 self.config.tls_handshake_deadline_s, self.broker.count_tls_refusal,
                                 self._serve_connection)

    def _count_protocol_error(self) -> None:
        self.protocol_errors += 1
        self.broker.protocol_errors += 1

    async def _serve_connection(self, stream: trio.SocketStream, peer: str) -> None:
        connection = _Connection(peer, stream, FrameOutput(stream), output_bytes_max=self.config.connection_output_bytes_max)
        decoder = PulsarFrameDecoder(self.config.frame_bytes_max)
        connection.reader = FrameReader(stream, decoder, self.broker.frame_budget, self.config.frame_deadline_s)
        enable_keepalive(stream)
        try:
            early: list[Frame] | None = None
            with peer_faults(log, peer, self._count_protocol_error):
                with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                    decoder.frame_bytes_max = HANDSHAKE_FRAME_BYTES_MAX
                    early = await self._handshake(connection, decoder)
                    decoder.frame_bytes_max = self.config.frame_bytes_max
            if early is None:
                return
            self._connections.add(connection)
            slots = trio.Semaphore(self.config.requests_in_flight_max)
            async with trio.open_nursery() as nursery:
                connection.cancel_scope = nursery.cancel_scope
                nursery.start_soon(self._write_loop, connection, nursery.cancel_scope)
                with peer_faults(log, peer, self._count_protocol_error):
                    try:
                        for frame in early:
                            await self._handle(connection, frame, nursery, slots)
                        await self._read_loop(connection, decoder, nursery, slots)
                    except ProtocolError as error:
                        # An ERROR first, where one can be sent; then only this connection closes.
                        connection.send(encode(command(Type.ERROR, request_id=0, error=ServerError.UnknownError,
                                                       message=f"protocol error: {error}"[:500])))
                        await connection.drain_briefly()
                        raise
                nursery.cancel_scope.cancel()
        finally:
            connection.reader.close()
            connection.closed = True
            self._connections.discard(connection)
            self._forget_connection(connection)
            await trio.aclose_forcefully(stream)

    async def _handshake(self, connection: _Connection, decoder: PulsarFrameDecoder) -> list[Frame] | None:
        frames = list(decoder.frames())
        while not frames:
            if not await connection.reader.receive():
                return None
            frames = list(decoder.frames())
        hello = frames[0]
        if hello.type != Type.CONNECT:
            raise ProtocolError(f"the first command must be CONNECT, got {Type.Name(hello.type)}")
        connect = hello.body
        version = min(connect.protocol_version, PROTOCOL_VERSION_MAX)
        if version < PROTOCOL_VERSION_MIN:
            await connection.stream.send_all(encode(command(
                Type.ERROR, request_id=0, error=ServerError.UnsupportedVersionError,
                message=f"protocol version {connect.protocol_version} is too old: quire brokers speak {PROTOCOL_VERSION_MIN} and later")))
            return None
        if connect.HasField("proxy_to_broker_url"):
            raise ProtocolError("this is a broker, not a proxy: proxy_to_broker_url is not served")
        try:
            if self.broker.access.enabled and (connect.original_principal or connect.original_auth_data):
                # A proxy's fields: quire brokers take no proxied identity, so
                # a client cannot claim another role through them.
                self.broker.access.refused_authentication(connection.peer, "Pulsar", "a proxy's credentials (original_principal)")
                raise AuthenticationError("this broker takes no proxied credentials (original_principal, original_auth_data)")
            connection.principal = self.broker.access.authenticate(
                connect.auth_method_name, connect.auth_data, peer=connection.peer,
                peer_common_name=peer_common_name(connection.stream), now=time.time(), protocol="Pulsar")
        except BrokerError as error:
            await connection.stream.send_all(encode(command(Type.ERROR, request_id=0, error=ServerError.AuthenticationError,
                                                            message=str(error)[:500])))
            return None
        connection.supports_auth_refresh = connect.feature_flags.supports_auth_refresh
        connection.protocol_version = version
        await connection.stream.send_all(encode(command(
            Type.CONNECTED, server_version=SERVER_VERSION, protocol_version=version,
            max_message_size=self.config.pulsar_max_message_size, feature_flags=FeatureFlags(supports_auth_refresh=True))))
        return frames[1:]

    async def _write_loop(self, connection: _Connection, cancel_scope: trio.CancelScope) -> None:
        try:
            await connection.output.run_writer()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            cancel_scope.cancel()

    async def _read_loop(self, connection: _Connection, decoder: PulsarFrameDecoder, nursery: trio.Nursery,
                         slots: trio.Semaphore) -> None:
        broker = self.broker
        while True:
            for frame in decoder.frames():
                await self._handle(connection, frame, nursery, slots)
            await wait_for_output_room(connection.output, self.config.connection_output_bytes_max, self.config.frame_deadline_s)
            while broker.publish_buffer.paused and connection.producers and not connection.closed:
                with trio.move_on_after(self.config.keepalive_interval_s) as waited:
                    await broker.wait_publish_resumed()
                if waited.cancelled_caught:
                    connection.send(encode(command(Type.PING)))
            if not await connection.reader.receive():
                return
            connection.pinged = False

    def _forget_connection(self, connection: _Connection) -> None:
        for producer in connection.producers.values():
            producer.closed = True
            producer.service.remove_producer(producer.link.producer_id, producer.link.handle)
        consumers = list(connection.consumers.values())
        connection.producers.clear()
        connection.consumers.clear()
        for consumer in consumers:
            self._remove_consumer(consumer)

    # --- commands ----------------------------------------------------------------------------------

    async def _handle(self, connection: _Connection, frame: Frame, nursery: trio.Nursery, slots: trio.Semaphore) -> None:
        kind = frame.type
        body = frame.body
        if kind == Type.SEND:
            await self._send(connection, body, frame.payload)
        elif kind == Type.FLOW:
            consumer = connection.consumers.get(body.consumer_id)
            subscription = None if consumer is None else consumer.service.subscriptions.get(consumer.subscription)
            if subscription is not None:
                subscription.flow(consumer.consumer_id, body.messagePermits)
        elif kind == Type.ACK:
            consumer = connection.consumers.get(body.consumer_id)
            if consumer is None:
                if body.HasField("request_id"):
                    connection.send(encode(command(Type.ACK_RESPONSE, consumer_id=body.consumer_id, request_id=body.request_id,
                                                   error=ServerError.ConsumerNotFound, message="no such consumer")))
                return
            # Taken now, in the connection's order (a SEEK that follows must
            # not be overtaken by it); what needs the ledger or an answer
            # goes on in a task.
            taken, unresolved, error = self._take_ack(consumer, body)
            if unresolved or body.HasField("request_id"):
                await slots.acquire()
                nursery.start_soon(self._ack, connection, consumer, body, taken, unresolved, error, slots)
        elif kind == Type.REDELIVER_UNACKNOWLEDGED_MESSAGES:
            consumer = connection.consumers.get(body.consumer_id)
            subscription = None if consumer is None else consumer.service.subscriptions.get(consumer.subscription)
            if subscription is not None:
                offsets = None
                if body.message_ids:
                    offsets = [offset for message_id in body.message_ids
                               for offset in self._delivered_offsets(consumer, message_id, forget=True)]
                else:
                    consumer.delivered.clear()  # all of it goes back (to this consumer or another)
                subscription.redeliver(consumer.consumer_id, offsets)
        elif kind == Type.PING:
            connection.send(encode(command(Type.PONG)))
        elif kind == Type.PONG:
            pass
        elif kind == Type.AUTH_RESPONSE:
            await self._auth_response(connection, body)
        elif kind == Type.CLOSE_PRODUCER:
            producer = connection.producers.pop(body.producer_id, None)
            if producer is not None:
                producer.closed = True
                producer.service.remove_producer(producer.link.producer_id, producer.link.handle)
            connection.send(encode(command(Type.SUCCESS, request_id=body.request_id)))
        elif kind == Type.CLOSE_CONSUMER:
            consumer = connection.consumers.pop(body.consumer_id, None)
            if consumer is not None:
                self._remove_consumer(consumer)
            connection.send(encode(command(Type.SUCCESS, request_id=body.request_id)))
        elif kind in _REQUESTS:
            # A producer or consumer id is taken from here on: a second
            # PRODUCER or SUBSCRIBE with it, sent while the first is under
            # way, is refused instead of leaving the first one orphaned.
            reserved = _reservation(kind, body)
            if reserved is not None:
                if reserved in connection.reserved or _holds(connection, reserved):
                    connection.send(encode(self._error_answer(frame, ServerError.UnknownError,
                                                              f"{reserved[0]} id {reserved[1]} is in use on this connection")))
                    return
                connection.reserved.add(reserved)
            await slots.acquire()
            nursery.start_soon(self._request, connection, frame, slots)
        elif kind in (Type.TC_CLIENT_CONNECT_REQUEST, Type.NEW_TXN):
            response = Type.TC_CLIENT_CONNECT_RESPONSE if kind == Type.TC_CLIENT_CONNECT_REQUEST else Type.NEW_TXN_RESPONSE
            connection.send(encode(command(response, request_id=body.request_id, error=ServerError.NotAllowedError,
                                           message="transactions are not supported by quire brokers")))
        else:
            raise ProtocolError(f"{Type.Name(kind)} is not a command a client sends to a quire broker")

    async def _request(self, connection: _Connection, frame: Frame, slots: trio.Semaphore) -> None:
        body = frame.body
        try:
            answer = await _REQUESTS[frame.type](self, connection, body)
        except (BrokerError, ValueError, BKError, MetadataError, trio.TooSlowError) as error:
            answer = self._error_answer(frame, *server_error(error))
        except AssertionError:
            raise
        except Exception as error:
            log.exception("Pulsar %s from %s failed unexpectedly", Type.Name(frame.type), connection.peer)
            answer = self._error_answer(frame, ServerError.UnknownError, f"{type(error).__name__}: {error}")
        finally:
            slots.release()
            reserved = _reservation(frame.type, body)
            if reserved is not None:
                connection.reserved.discard(reserved)  # opened (then in producers or consumers) or refused
        if answer is not None:
            connection.send(encode(answer))

    @staticmethod
    def _error_answer(frame: Frame, error: int, message: str):
        body = frame.body
        message = message[:1000]
        if frame.type == Type.LOOKUP:
            return command(Type.LOOKUP_RESPONSE, request_id=body.request_id, response=CommandLookupTopicResponse.Failed,
                           error=error, message=message)
        if frame.type == Type.PARTITIONED_METADATA:
            return command(Type.PARTITIONED_METADATA_RESPONSE, request_id=body.request_id,
                           response=CommandPartitionedTopicMetadataResponse.Failed, error=error, message=message)
        if frame.type == Type.GET_SCHEMA:
            return command(Type.GET_SCHEMA_RESPONSE, request_id=body.request_id, error_code=error, error_message=message)
        if frame.type == Type.GET_OR_CREATE_SCHEMA:
            return command(Type.GET_OR_CREATE_SCHEMA_RESPONSE, request_id=body.request_id, error_code=error,
                           error_message=message)
        if frame.type == Type.CONSUMER_STATS:
            return command(Type.CONSUMER_STATS_RESPONSE, request_id=body.request_id, error_code=error, error_message=message)
        return command(Type.ERROR, request_id=body.request_id, error=error, message=message)

    # --- topics --------------------------------------------------------------------------------

    async def _partitioned_metadata(self, connection: _Connection, body) -> Any:
        partitions = await partition_count(self.broker, quire_name(body.topic), connection.principal.role,
                                           create=body.metadata_auto_creation_enabled)
        return command(Type.PARTITIONED_METADATA_RESPONSE, request_id=body.request_id, partitions=partitions,
                       response=CommandPartitionedTopicMetadataResponse.Success)

    async def _lookup(self, connection: _Connection, body) -> Any:
        name = quire_name(body.topic)
        info, redirect = await lookup_partition(self.broker, name, connection.principal.role, authoritative=body.authoritative)
        listener = body.advertised_listener_name or None  # clients send "" for none
        address = info.pulsar_address_for(listener)
        tls_address = info.pulsar_address_for(listener, tls=True)
        if address is None and tls_address is None:
            # A client's setting, not a passing state: refused at once, not retried.
            raise NotAllowedError(f"broker {info.broker_id} serves {name} and has no Pulsar listener"
                                  + (f" named {listener[:100]!r} (it has: {', '.join(sorted(info.pulsar_listeners)) or 'none'})"
                                     if listener else ""))
        urls = {}
        if address is not None:
            urls["brokerServiceUrl"] = f"pulsar://{address}"
        if tls_address is not None:
            urls["brokerServiceUrlTls"] = f"pulsar+ssl://{tls_address}"
        return command(Type.LOOKUP_RESPONSE, request_id=body.request_id, **urls,
                       response=CommandLookupTopicResponse.Redirect if redirect else CommandLookupTopicResponse.Connect,
                       authoritative=redirect)

    async def _topics_of_namespace(self, connection: _Connection, body) -> Any:
        namespace = namespace_of(body.namespace)
        names = await topics_of_namespace(self.broker, namespace, connection.principal.role)
        if body.mode == body.NON_PERSISTENT:
            names = []  # quire's topics are all persistent
        filtered = False
        if body.HasField("topics_pattern"):
            pattern = _topics_pattern(body.topics_pattern)
            names = [name for name in names if pattern.fullmatch(name)]
            filtered = True
        return command(Type.GET_TOPICS_OF_NAMESPACE_RESPONSE, request_id=body.request_id, topics=sorted(names),
                       filtered=filtered, changed=True)

    async def _get_schema(self, connection: _Connection, body) -> Any:
        await self.broker.access.check_topic(connection.principal.role, quire_name(body.topic), None, "read the schema of")
        registry = self.broker.schemas
        name = await registry.topic_of(quire_name(body.topic))
        version = int.from_bytes(body.schema_version, "big") if body.HasField("schema_version") and body.schema_version else None
        try:
            stored = await registry.get(name, version)
        except NotFoundError as error:
            return command(Type.GET_SCHEMA_RESPONSE, request_id=body.request_id, error_code=ServerError.TopicNotFound,
                           error_message=str(error))
        return command(Type.GET_SCHEMA_RESPONSE, request_id=body.request_id, schema=stored.schema,
                       schema_version=stored.version.to_bytes(8, "big"))

    async def _get_or_create_schema(self, connection: _Connection, body) -> Any:
        await self.broker.access.check_topic(connection.principal.role, quire_name(body.topic), Action.PRODUCE,
                                             "set the schema of")
        version = await self._schema_version(quire_name(body.topic), body.schema)
        return command(Type.GET_OR_CREATE_SCHEMA_RESPONSE, request_id=body.request_id, schema_version=version)

    async def _schema_version(self, name: str, schema) -> bytes:
        """The version of a producer's `schema` on the topic: an equal
        version's, or a new one its compatibility strategy takes
        (IncompatibleSchema otherwise)."""
        registry = self.broker.schemas
        version = await registry.add(await registry.topic_of(name), schema)
        return version.to_bytes(8, "big")

    # --- producers -----------------------------------------------------------------------------

    async def _producer(self, connection: _Connection, body) -> Any:
        name = quire_name(body.topic)
        if body.producer_id in connection.producers:
            raise ConsumerBusyError(f"producer id {body.producer_id} is in use on this connection")
        if body.txn_enabled:
            raise NotAllowedError("transactions are not supported by quire brokers")
        if body.encrypted:
            raise NotAllowedError("encrypted messages are not supported by quire brokers")
        access = _ACCESS_MODES.get(body.producer_access_mode)
        if access is None:
            raise ValueError(f"unknown producer access mode {body.producer_access_mode}")
        # A generated name is new for good (its ZooKeeper session's id is in
        # it): with deduplication on, a name given again would inherit
        # another producer's sequence ids.
        producer_name = body.producer_name if body.HasField("producer_name") and body.producer_name else \
            f"{self.config.cluster_name}-{self.broker.info.broker_id}-{self.broker.session_id:x}-{next(self._producer_names)}"
        await self.broker.access.check_topic(connection.principal.role, name, Action.PRODUCE, "produce to")
        await ensure_topic(self.broker, name)
        schema_version = None
        if body.HasField("schema") and body.schema.type != _SCHEMA_NONE:
            schema_version = await self._schema_version(name, body.schema)
        service = await self.broker.serving(name)
        link = ProducerLink(body.producer_id, producer_name, lambda receipt: None)
        producer = _Producer(body.producer_id, producer_name, service, link)
        link.send_receipt = lambda receipt: self._receipt(connection, producer, receipt)
        link.close = lambda reason: self._close_producer(connection, producer)

        def waiting() -> None:
            # WaitForExclusive: the client waits (without a timeout) for a
            # second answer, ready, once the other producers are gone.
            connection.send(encode(command(Type.PRODUCER_SUCCESS, request_id=body.request_id, producer_name=producer_name,
                                           producer_ready=False)))

        last_sequence_id = await service.add_producer(link, access, waiting)
        if connection.closed:
            service.remove_producer(producer_name, link.handle)
            return None
        connection.producers[body.producer_id] = producer
        answer = command(Type.PRODUCER_SUCCESS, request_id=body.request_id, producer_name=producer_name,
                         last_sequence_id=last_sequence_id, producer_ready=True)
        if access is not AccessMode.SHARED:
            answer.producer_success.topic_epoch = service.publishing.topic_epoch
        if schema_version is not None:
            answer.producer_success.schema_version = schema_version
        return answer

    async def _send(self, connection: _Connection, body, payload: bytes | None) -> None:
        producer = connection.producers.get(body.producer_id)
        if producer is None or producer.closed:
            connection.send(encode(command(Type.SEND_ERROR, producer_id=body.producer_id, sequence_id=body.sequence_id,
                                           error=ServerError.ServiceNotReady, message="no such producer on this connection")))
            return
        if payload is None:
            raise ProtocolError("a SEND without its message")
        if body.txnid_most_bits or body.txnid_least_bits:
            self._answer_now(connection, producer, body, ServerError.NotAllowedError, "transactions are not supported")
            return
        count = body.num_messages
        if count < 1:
            self._answer_now(connection, producer, body, ServerError.UnknownError,
                             f"a SEND holds at least one message, not {count}")
            return
        first = body.sequence_id
        last = max(body.highest_sequence_id, first + count - 1)
        send = Send(body.producer_id, first, last, count, payload)
        pending = _PendingSend(send, first, body.highest_sequence_id if body.HasField("highest_sequence_id") else last)
        producer.pending.append(pending)
        await self._publish(producer, send)

    async def _publish(self, producer: _Producer, send: Send) -> None:
        await producer.service.publish(producer.link, send,
                                       self.broker.publish_buffer.take(batch_cost_bytes(send.body, send.message_count)))

    def _answer_now(self, connection: _Connection, producer: _Producer, body, error: int, message: str) -> None:
        connection.send(encode(command(Type.SEND_ERROR, producer_id=producer.handle, sequence_id=body.sequence_id,
                                       error=error, message=message)))

    def _receipt(self, connection: _Connection, producer: _Producer, receipt: SendReceipt) -> None:
        """The broker's answer to one of the producer's messages: kept until
        every message sent before it is answered, then sent in order."""
        if producer.closed:
            return
        status = BrokerStatus(receipt.status) if receipt.status in BrokerStatus._value2member_map_ else BrokerStatus.ERROR
        pending = next((item for item in producer.pending if item.receipt is None
                        and item.send.last_sequence_id == receipt.last_sequence_id), None)
        if pending is None:
            return
        if status is BrokerStatus.RETRY:
            # Its earlier copy is still being written: ask again shortly (it
            # is then a duplicate, or stored if the earlier copy failed).
            self.broker.spawn(self._resend_later, producer, pending)
            return
        if status in _MOVED:
            self._close_producer(connection, producer)
            return
        if status in (BrokerStatus.OK, BrokerStatus.DUPLICATE):
            ledger_id = receipt.ledger_id if status is BrokerStatus.OK else -1
            entry_id = receipt.entry_id if status is BrokerStatus.OK else -1
            pending.receipt = encode(command(
                Type.SEND_RECEIPT, producer_id=producer.handle, sequence_id=pending.sequence_id,
                highest_sequence_id=pending.highest_sequence_id,
                message_id=MessageIdData(ledgerId=ledger_id & 0xFFFFFFFFFFFFFFFF, entryId=entry_id & 0xFFFFFFFFFFFFFFFF)))
        else:
            pending.receipt = encode(command(
                Type.SEND_ERROR, producer_id=producer.handle, sequence_id=pending.sequence_id,
                error=_SERVER_ERRORS.get(status, ServerError.UnknownError), message=receipt.message[:1000]))
        while producer.pending and producer.pending[0].receipt is not None:
            connection.send(producer.pending.popleft().receipt)

    async def _resend_later(self, producer: _Producer, pending: _PendingSend) -> None:
        await trio.sleep(RETRY_DELAY_S)
        if not producer.closed and pending in producer.pending:
            try:
                await self._publish(producer, pending.send)
            except trio.BrokenResourceError:
                pass

    # --- consumers -----------------------------------------------------------------------------

    async def _subscribe(self, connection: _Connection, body) -> Any:
        name = quire_name(body.topic)
        if body.consumer_id in connection.consumers:
            raise ConsumerBusyError(f"consumer id {body.consumer_id} is in use on this connection")
        if body.replicate_subscription_state:
            raise NotAllowedError("geo-replication is not supported by quire brokers")
        subscription_type = _SUBSCRIPTION_TYPES.get(body.subType)
        if subscription_type is None:
            raise ValueError(f"unknown subscription type {body.subType}")
        await self.broker.access.check_topic(connection.principal.role, name, Action.CONSUME, "consume from")
        if body.force_topic_creation:
            await ensure_topic(self.broker, name)
        if body.HasField("schema") and body.schema.type != _SCHEMA_NONE:
            registry = self.broker.schemas
            await registry.check_reader(await registry.topic_of(name), body.schema)
        service = await self.broker.serving(name)
        start_offset = None
        if not body.durable and body.HasField("start_message_id"):
            start_offset = await self._start_offset(service, body.start_message_id)
            if body.read_compacted and start_offset == service.managed_ledger.first_offset:
                start_offset = 0  # earliest: the compacted view may hold keys from before what retention left
        hash_ranges = None
        if subscription_type is SubscriptionType.KEY_SHARED and body.HasField("keySharedMeta"):
            meta = body.keySharedMeta
            if meta.keySharedMode == KeySharedMode.Value("STICKY"):
                hash_ranges = tuple((item.start, item.end) for item in meta.hashRanges)
        consumer_id = self.broker.new_consumer_id()
        consumer = _Consumer(body.consumer_id, service, body.subscription, consumer_id, subscription_type)
        link = ConsumerLink(consumer_id, body.consumer_id, body.consumer_name or f"consumer-{consumer_id}",
                            lambda delivery: self._deliver(connection, consumer, delivery), connection.wait_for_room)
        subscription = await service.subscribe(
            link, body.subscription, subscription_type, priority=body.priority_level,
            initial_position="earliest" if body.initialPosition == CommandSubscribe.Earliest else "latest",
            durable=body.durable, important=False, start_offset=start_offset, hash_ranges=hash_ranges,
            read_compacted=body.read_compacted,
        )
        if connection.closed:
            service.remove_consumer(subscription.name, consumer_id)
            return None
        connection.consumers[body.consumer_id] = consumer
        if subscription_type in (SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER):
            self._tell_active(subscription.name, service)
        return command(Type.SUCCESS, request_id=body.request_id)

    async def _start_offset(self, service: PartitionService, message_id: MessageIdData) -> int | None:
        """Where a reader starting at `message_id` starts: the entry that
        holds it (its client skips what comes before the id within it)."""
        ledger_id, entry_id = _signed(message_id.ledgerId), _signed(message_id.entryId)
        managed_ledger = service.managed_ledger
        if ledger_id < 0 or entry_id < 0:
            return managed_ledger.first_offset  # MessageId.earliest
        if ledger_id >= 2**63 - 1:
            return managed_ledger.confirmed_offset + 1  # MessageId.latest
        position = Position(ledger_id, entry_id)
        if not managed_ledger.has_entry(position):
            return managed_ledger.first_offset if ledger_id < (managed_ledger.first_position() or position).ledger_id \
                else managed_ledger.confirmed_offset + 1
        return (await managed_ledger.read_entry(position)).header.first_offset

    def _remove_consumer(self, consumer: _Consumer) -> None:
        consumer.service.remove_consumer(consumer.subscription, consumer.consumer_id)
        if consumer.subscription_type in (SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER):
            self._tell_active(consumer.subscription, consumer.service)

    def _tell_active(self, subscription_name: str, service: PartitionService) -> None:
        """ACTIVE_CONSUMER_CHANGE to the subscription's Pulsar consumers
        whose state changed (Failover: the client shows it)."""
        subscription = service.subscriptions.get(subscription_name)
        if subscription is None:
            return
        active_id = subscription.dispatcher.active_consumer_id
        for connection in list(self._connections):
            for consumer in connection.consumers.values():
                if consumer.service is service and consumer.subscription == subscription_name:
                    active = consumer.consumer_id == active_id
                    if consumer.active is not active:
                        consumer.active = active
                        connection.send(encode(command(Type.ACTIVE_CONSUMER_CHANGE, consumer_id=consumer.handle,
                                                       is_active=active)))

    def _deliver(self, connection: _Connection, consumer: _Consumer, delivery: MessageDelivery) -> None:
        try:
            header, body = decode_entry(delivery.entry)
            message = pulsar_message(header, body)
        except MalformedEntryError as error:
            log.error("Pulsar consumer %s of %s: entry %d:%d is malformed, not delivered: %s", consumer.handle,
                      consumer.service.name, delivery.ledger_id, delivery.entry_id, error)
            return
        indexes = tuple(delivery.batch_indexes)
        batched = header.batched or header.legacy
        consumer.delivered[(delivery.ledger_id, delivery.entry_id)] = (header.first_offset, indexes, batched)
        message_command = command(Type.MESSAGE, consumer_id=consumer.handle,
                                  message_id=MessageIdData(ledgerId=delivery.ledger_id, entryId=delivery.entry_id),
                                  redelivery_count=delivery.redelivery_count)
        if batched and len(indexes) < header.message_count:
            message_command.message.ack_set.extend(_bit_set(indexes, header.message_count))
        parts, nbytes = encode_parts(message_command, message)
        connection.send_parts(parts, nbytes)

    def _delivered_offsets(self, consumer: _Consumer, message_id: MessageIdData, *, forget: bool) -> list[int]:
        """The offsets `message_id` names among what this consumer was
        delivered: the messages of an entry (those its ack set leaves
        unset, or the one its batch index names for a cumulative id)."""
        key = (_signed(message_id.ledgerId), _signed(message_id.entryId))
        found = consumer.delivered.get(key)
        if found is None:
            return []
        first_offset, indexes, batched = found
        if message_id.ack_set:
            still = _indexes_of(message_id.ack_set, max(indexes) + 1 if indexes else 0)
            acked = tuple(index for index in indexes if index not in still)
            left = tuple(index for index in indexes if index in still)
        else:
            acked, left = indexes, ()
        if forget:
            if left:
                consumer.delivered[key] = (first_offset, left, batched)
            else:
                del consumer.delivered[key]
        return [first_offset + index for index in acked]

    def _take_ack(self, consumer: _Consumer, body) -> tuple[TakenAcknowledgement | None, list, tuple[int, str] | None]:
        """Apply what an ACK names among what this connection delivered;
        (what was taken, the ids it did not deliver, an error)."""
        subscription = consumer.service.subscriptions.get(consumer.subscription)
        if subscription is None or subscription.closed:
            return None, [], server_error(TopicFencedError(f"subscription {consumer.subscription} is no longer served here"))
        if body.txnid_most_bits or body.txnid_least_bits:
            return None, [], server_error(NotAllowedError("transactions are not supported by quire brokers"))
        if not body.message_id:
            return None, [], None
        try:
            if body.ack_type == CommandAck.Cumulative:
                offset = self._cumulative_offset_delivered(consumer, body.message_id[-1])
                if offset is None:
                    return None, [body.message_id[-1]], None
                return subscription.take_acknowledgement([offset], cumulative=True), [], None
            offsets: list[int] = []
            unresolved = []
            for message_id in body.message_id:
                found = self._delivered_offsets(consumer, message_id, forget=True)
                if found:
                    offsets.extend(found)
                else:
                    unresolved.append(message_id)
            taken = subscription.take_acknowledgement(offsets, cumulative=False) if offsets else None
        except BrokerError as refused:  # a cumulative one on a shared subscription, a cursor that failed, ...
            return None, [], server_error(refused)
        if len(unresolved) > ACK_RESOLVE_READS_MAX:
            return taken, unresolved[:ACK_RESOLVE_READS_MAX], server_error(NotAllowedError(
                f"an acknowledgement names {len(unresolved)} messages this connection did not deliver; "
                f"at most {ACK_RESOLVE_READS_MAX} are looked up"))
        return taken, unresolved, None

    async def _ack(self, connection: _Connection, consumer: _Consumer, body, taken: TakenAcknowledgement | None,
                   unresolved: list, error: tuple[int, str] | None, slots: trio.Semaphore) -> None:
        try:
            # Ids this connection did not deliver (acknowledged again after a
            # reconnection): their offsets come from the ledger.
            subscription = consumer.service.subscriptions.get(consumer.subscription)
            if unresolved and error is None and subscription is not None:
                if body.ack_type == CommandAck.Cumulative:
                    offset = await self._cumulative_offset(consumer, unresolved[0])
                    later = None if offset is None else subscription.take_acknowledgement([offset], cumulative=True)
                else:
                    offsets = [offset for message_id in unresolved for offset in await self._offsets_in_ledger(consumer, message_id)]
                    later = subscription.take_acknowledgement(offsets, cumulative=False) if offsets else None
                if later is not None:
                    await later.durable()
            if taken is not None:
                await taken.durable()
        except (BrokerError, BKError, MetadataError, EntryGoneError, MalformedEntryError) as caught:
            error = server_error(caught)
            log.debug("Pulsar ack from %s refused: %s", connection.peer, caught)
        finally:
            slots.release()
        if body.HasField("request_id"):
            answer = command(Type.ACK_RESPONSE, consumer_id=consumer.handle, request_id=body.request_id)
            if error is not None:
                answer.ackResponse.error = error[0]
                answer.ackResponse.message = error[1][:1000]
            connection.send(encode(answer))

    def _cumulative_offset_delivered(self, consumer: _Consumer, message_id: MessageIdData) -> int | None:
        """`_cumulative_offset` of an entry this connection delivered (None: it did not)."""
        key = (_signed(message_id.ledgerId), _signed(message_id.entryId))
        found = consumer.delivered.get(key)
        if found is None:
            return None
        first_offset, indexes, _ = found
        return self._cumulative_reach(consumer, key, message_id, first_offset, max(indexes) + 1 if indexes else 1)

    async def _cumulative_offset(self, consumer: _Consumer, message_id: MessageIdData) -> int | None:
        """The offset a cumulative acknowledgement reaches: the message its
        batch index names (the whole entry without one)."""
        offset = self._cumulative_offset_delivered(consumer, message_id)
        if offset is not None:
            return offset
        key = (_signed(message_id.ledgerId), _signed(message_id.entryId))
        try:
            header = (await consumer.service.managed_ledger.read_entry(Position(*key))).header
        except EntryGoneError:
            return None
        return self._cumulative_reach(consumer, key, message_id, header.first_offset, header.message_count)

    @staticmethod
    def _cumulative_reach(consumer: _Consumer, key: tuple[int, int], message_id: MessageIdData, first_offset: int,
                          count_hint: int) -> int:
        # A batch index past the batch names its last message, never a later one.
        batch_index = message_id.batch_index
        offset = first_offset + (min(batch_index, count_hint - 1) if batch_index >= 0 else count_hint - 1)
        for delivered_key in [item for item in consumer.delivered if item <= key]:
            first, indexes, batched = consumer.delivered[delivered_key]
            left = tuple(index for index in indexes if first + index > offset)
            if left:
                consumer.delivered[delivered_key] = (first, left, batched)
            else:
                del consumer.delivered[delivered_key]
        return offset

    async def _offsets_in_ledger(self, consumer: _Consumer, message_id: MessageIdData) -> list[int]:
        """An id this connection did not deliver (acknowledged after a
        reconnection): the messages of its entry the ack set leaves unset."""
        try:
            header = (await consumer.service.managed_ledger.read_entry(
                Position(_signed(message_id.ledgerId), _signed(message_id.entryId)))).header
        except EntryGoneError:
            return []
        if message_id.ack_set:
            still = _indexes_of(message_id.ack_set, header.message_count)
            return [header.first_offset + index for index in range(header.message_count) if index not in still]
        if message_id.batch_index >= 0 and not header.batched:
            return [header.first_offset]
        return list(range(header.first_offset, header.first_offset + header.message_count))

    async def _seek(self, connection: _Connection, body) -> Any:
        consumer = connection.consumers.get(body.consumer_id)
        if consumer is None:
            raise TopicFencedError(f"no consumer {body.consumer_id} on this connection: subscribe again")
        message_id = None
        if body.HasField("message_id"):
            ledger_id, entry_id = _signed(body.message_id.ledgerId), _signed(body.message_id.entryId)
            batch_index = max(body.message_id.batch_index, 0)
            managed_ledger = consumer.service.managed_ledger
            if ledger_id < 0 or entry_id < 0:
                offset = managed_ledger.first_offset
            elif ledger_id >= 2**63 - 1:
                offset = managed_ledger.confirmed_offset + 1
            else:
                message_id = [ledger_id, entry_id, batch_index]
                offset = None
        elif body.HasField("message_publish_time"):
            offset = None
        else:
            raise ValueError("a seek names a message id or a publish time")
        # As Pulsar's broker: the subscription's consumers are closed first,
        # so that what their clients still send (the acknowledgements a
        # client flushes once its seek is answered) reaches no consumer and
        # cannot acknowledge what the seek is to deliver again; they
        # subscribe again and read from the new position.
        self.broker.close_consumers(consumer.service, consumer.subscription)
        await self.broker.seek(consumer.service, consumer.subscription, offset=offset,
                               publish_time_ms=body.message_publish_time if body.HasField("message_publish_time") else None,
                               message_id=message_id, close_consumers=False)
        return command(Type.SUCCESS, request_id=body.request_id)

    async def _last_message_id(self, connection: _Connection, body) -> Any:
        consumer = connection.consumers.get(body.consumer_id)
        if consumer is None:
            raise TopicFencedError(f"no consumer {body.consumer_id} on this connection: subscribe again")
        managed_ledger = consumer.service.managed_ledger
        last = managed_ledger.confirmed_offset
        last_id = MessageIdData(ledgerId=(managed_ledger.current_ledger_id or 0), entryId=2**64 - 1)  # entry -1: none yet
        if last >= managed_ledger.first_offset:
            position = await managed_ledger.position_of_offset(last)
            if position is not None:
                header = (await managed_ledger.read_entry(position)).header
                last_id = MessageIdData(ledgerId=position.ledger_id, entryId=position.entry_id,
                                        batch_index=(last - header.first_offset) if header.batched else -1)
        answer = command(Type.GET_LAST_MESSAGE_ID_RESPONSE, request_id=body.request_id, last_message_id=last_id)
        subscription = consumer.service.subscriptions.get(consumer.subscription)
        if subscription is not None and subscription.cursor.mark_delete >= managed_ledger.first_offset:
            position = await managed_ledger.position_of_offset(subscription.cursor.mark_delete)
            if position is not None:
                answer.getLastMessageIdResponse.consumer_mark_delete_position.CopyFrom(
                    MessageIdData(ledgerId=position.ledger_id, entryId=position.entry_id))
        return answer

    async def _unsubscribe(self, connection: _Connection, body) -> Any:
        consumer = connection.consumers.get(body.consumer_id)
        if consumer is None:
            raise SubscriptionNotFoundError(f"no consumer {body.consumer_id} on this connection")
        if body.force:
            self.close_consumers(consumer.service, consumer.subscription)
            await consumer.service.unsubscribe(consumer.subscription, None)
        else:
            await consumer.service.unsubscribe(consumer.subscription, consumer.consumer_id)
        connection.consumers.pop(body.consumer_id, None)
        return command(Type.SUCCESS, request_id=body.request_id)

    async def _consumer_stats(self, connection: _Connection, body) -> Any:
        consumer = connection.consumers.get(body.consumer_id)
        if consumer is None:
            return command(Type.CONSUMER_STATS_RESPONSE, request_id=body.request_id, error_code=ServerError.ConsumerNotFound,
                           error_message="no such consumer")
        subscription = consumer.service.subscriptions.get(consumer.subscription)
        stats = command(Type.CONSUMER_STATS_RESPONSE, request_id=body.request_id, consumerName=str(consumer.consumer_id),
                        type=consumer.subscription_type.value, address=connection.peer)
        if subscription is not None:
            response = stats.consumerStatsResponse
            response.availablePermits = subscription.dispatcher.permits(consumer.consumer_id)
            response.unackedMessages = subscription.dispatcher.unacked_count(consumer.consumer_id)
            response.msgBacklog = subscription.backlog()
        return stats


_REQUESTS = {
    Type.PARTITIONED_METADATA: PulsarFrontEnd._partitioned_metadata,
    Type.LOOKUP: PulsarFrontEnd._lookup,
    Type.GET_TOPICS_OF_NAMESPACE: PulsarFrontEnd._topics_of_namespace,
    Type.GET_SCHEMA: PulsarFrontEnd._get_schema,
    Type.GET_OR_CREATE_SCHEMA: PulsarFrontEnd._get_or_create_schema,
    Type.PRODUCER: PulsarFrontEnd._producer,
    Type.SUBSCRIBE: PulsarFrontEnd._subscribe,
    Type.SEEK: PulsarFrontEnd._seek,
    Type.GET_LAST_MESSAGE_ID: PulsarFrontEnd._last_message_id,
    Type.UNSUBSCRIBE: PulsarFrontEnd._unsubscribe,
    Type.CONSUMER_STATS: PulsarFrontEnd._consumer_stats,
}


TOPICS_PATTERN_CHARS_MAX = 512
TOPICS_PATTERN_REPEATS_MAX = 3


def _topics_pattern(text: str) -> re.Pattern:
    """A regex subscription's pattern, if it cannot make the broker
    backtrack for ever: Python's engine would try exponentially many ways
    through a repeated group, or through many repeats in a row, and it runs
    on the broker's event loop. Pulsar's clients send a prefix and `.*`."""
    if len(text) > TOPICS_PATTERN_CHARS_MAX:
        raise NotAllowedError(f"a topics pattern holds at most {TOPICS_PATTERN_CHARS_MAX} characters")
    unescaped = re.sub(r"\\.", "", text)
    if re.search(r"\)[*+?{]", unescaped) or len(re.findall(r"[*+]|\{\d*,\}", unescaped)) > TOPICS_PATTERN_REPEATS_MAX:
        raise NotAllowedError(f"a topics pattern repeats no group and repeats at most {TOPICS_PATTERN_REPEATS_MAX} times "
                              f"(such as persistent://public/default/orders-.*)")
    try:
        return re.compile(text)
    except re.error as error:
        raise NotAllowedError(f"topics pattern does not compile: {error}") from None


def _reservation(kind: int, body) -> tuple[str, int] | None:
    if kind == Type.PRODUCER:
        return "producer", body.producer_id
    if kind == Type.SUBSCRIBE:
        return "consumer", body.consumer_id
    return None


def _holds(connection: _Connection, reserved: tuple[str, int]) -> bool:
    what, handle = reserved
    return handle in (connection.producers if what == "producer" else connection.consumers)


def _signed(value: int) -> int:
    """A uint64 on the wire as the signed long Pulsar's Java side means (-1: none)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _bit_set(indexes: tuple[int, ...], count: int) -> list[int]:
    """Java's BitSet.toLongArray of the set `indexes` (bits set: still to be acknowledged)."""
    words = [0] * ((count + 63) // 64)
    for index in indexes:
        words[index >> 6] |= 1 << (index & 63)
    return [word - (1 << 64) if word >= 1 << 63 else word for word in words]


def _indexes_of(words, count: int) -> set[int]:
    """The set bits below `count` of a BitSet's long array (a client's
    words past the batch are not read: an ack set of a million words must
    not build a set of sixty million)."""
    indexes = set()
    for word_index, word in enumerate(words[:(count + 63) // 64]):
        word &= 0xFFFFFFFFFFFFFFFF
        while word:
            low = word & -word
            indexes.add(word_index * 64 + low.bit_length() - 1)
            word ^= low
    return indexes


__all__ = ["PulsarFrontEnd"]
