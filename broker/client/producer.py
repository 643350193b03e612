"""Producers. A `PartitionProducer` publishes to one partition: it gives each
message a sequence id (one more than the last, unless the caller names
one), groups messages into batches when batching is on, keeps every batch
until the broker's receipt, and after a broken connection or a partition
that moved, looks the partition up again and resends what is pending in
order; the broker's deduplication drops what it had persisted already.
`Producer` routes messages over a topic's partitions by key hash.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from broker.client.backoff import HEALTHY_CONNECTION_S, RECONNECT_ERRORS, Backoff
from broker.client.client_services import ClientServices
from broker.client.connection import BrokerConnection
from broker.client.routing import HashingScheme, partition_for_key
from broker.client.messages import MessageId, SendResult
from broker.errors import (
    BrokerError,
    BrokerStatus,
    ClientClosedError,
    ConnectionClosedError,
    error_for_status,
)
from broker.codecs import Codec
from broker.pulsar_message import build_batch, build_chunks
from broker.protocol import CloseProducer, ProducerOpen, Send, SendReceipt

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.05  # after the broker says "being written, ask again"
MESSAGE_BYTES_MAX = 5 * 1024 * 1024  # one message's payload (Pulsar's default maximum message size)
CHUNK_HEADROOM_BYTES = 64 * 1024  # a chunk's payload is this much below MESSAGE_BYTES_MAX: room for its metadata
CHUNKED_MESSAGE_BYTES_MAX = 1024 * 1024 * 1024  # a chunked message's payload (what consumers put together)


@dataclass(frozen=True)
class ProducerOptions:
    batching: bool = False
    batch_messages_max: int = 1_000
    batch_bytes_max: int = 1024 * 1024
    batch_delay_ms: float = 1.0
    codec: Codec = Codec.NONE
    pending_messages_max: int = 10_000  # sent and not yet acknowledged by the broker; past it, send waits
    hashing_scheme: HashingScheme = HashingScheme.JAVA_STRING  # how a key picks its partition (broker/client/routing.py)
    # Pulsar's chunking: a message larger than MESSAGE_BYTES_MAX goes in
    # chunks that consumers put together (else it is refused).
    chunking: bool = False

    def __post_init__(self) -> None:
        if self.batch_messages_max < 1 or self.batch_bytes_max < 1 or self.pending_messages_max < 1:
            raise ValueError("batch_messages_max, batch_bytes_max and pending_messages_max must be at least 1")
        if self.batch_delay_ms < 0:
            raise ValueError("batch_delay_ms must not be negative")


class SendFuture:
    """A message handed to a producer; `await future.wait()` gives its
    `SendResult` once the broker has persisted it."""

    __slots__ = ("sequence_id", "_event", "_result", "_error", "_callbacks")

    def __init__(self, sequence_id: int) -> None:
        self.sequence_id = sequence_id
        self._event = trio.Event()
        self._result: SendResult | None = None
        self._error: BaseException | None = None
        self._callbacks: list | None = None

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def add_done_callback(self, callback) -> None:
        """`callback(future)` once the message is persisted or failed (at
        once if it is already): many sends in flight without a task each.
        It runs in the client's event loop and must not block."""
        if self._event.is_set():
            callback(self)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def result(self) -> SendResult:
        """The result of a settled future (raises its error)."""
        assert self._event.is_set(), "the send is still pending"
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _resolve(self, result: SendResult | None, error: BaseException | None = None) -> None:
        if not self._event.is_set():
            self._result, self._error = result, error
            self._event.set()
            for callback in self._callbacks or ():
                try:
                    callback(self)
                except Exception:
                    # The application's callback must not break the connection it runs on.
                    log.exception("a send callback failed")

    async def wait(self) -> SendResult:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


@dataclass(slots=True)
class _OutMessage:
    sequence_id: int
    publish_time_ms: int
    key: str | None
    properties: dict[str, str] | None
    payload: bytes
    event_time_ms: int
    future: SendFuture
    deliver_at_ms: int = 0


@dataclass(slots=True)
class _Batch:
    messages: list[_OutMessage]
    frame: Send | None = None  # built once, resent as is
    # A chunked message: its chunks' frames (one message, one sequence id),
    # and how many of their receipts are still to come.
    chunk_frames: list[Send] | None = None
    receipts_left: int = 0
    duplicate: bool = False  # its last chunk was answered a duplicate (it may come before the others' receipts)

    @property
    def last_sequence_id(self) -> int:
        return self.messages[-1].sequence_id


@dataclass(slots=True)
class _Building:
    messages: list[_OutMessage] = field(default_factory=list)
    bytes: int = 0


class PartitionProducer:
    def __init__(self, services: ClientServices, topic: str, partition: str, partition_index: int, producer_id: str,
                 options: ProducerOptions) -> None:
        self._services = services
        self.topic = topic
        self.partition = partition
        self.partition_index = partition_index
        self.producer_id = producer_id
        self.options = options
        self.handle = services.new_handle()
        self.last_sequence_id = -1  # the highest given to a message
        self.last_persisted_sequence_id = -1  # as the broker said on connecting
        self._pending: collections.OrderedDict[int, _Batch] = collections.OrderedDict()  # by last sequence id, send order
        self._by_sequence: dict[int, SendFuture] = {}
        self._building = _Building()
        self._pending_message_slots = trio.Semaphore(options.pending_messages_max)
        self._connection: BrokerConnection | None = None
        self._lost = trio.Event()
        self._flush_wakeup = trio.Event()
        self._closed = False
        self._cancel_scope = trio.CancelScope()

    # --- lifetime --------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Connect (raising what no retry gets past: a topic that does not
        exist, a bad name), then stay connected until closed."""
        backoff = Backoff(self._services.rng)
        with self._cancel_scope:
            while True:
                try:
                    await self._connect(first=True)
                    break
                except RECONNECT_ERRORS as error:
                    log.info("producer %s on %s: connecting: %s", self.producer_id, self.partition, error)
                    await trio.sleep(backoff.next_delay_s())
            task_status.started()
            backoff.reset()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._batch_timer)
                while not self._closed:
                    connected_at = trio.current_time()
                    await self._lost.wait()
                    # A connection that breaks at once again and again (a
                    # broker that refuses what we resend) must not make us
                    # reconnect ten times a second: back off until one holds.
                    if trio.current_time() - connected_at >= HEALTHY_CONNECTION_S:
                        backoff.reset()
                    await trio.sleep(backoff.next_delay_s())
                    try:
                        await self._connect(first=False)
                    except RECONNECT_ERRORS as error:
                        log.info("producer %s on %s: reconnecting: %s", self.producer_id, self.partition, error)
                    except BrokerError as error:
                        log.warning("producer %s on %s: %s; retrying", self.producer_id, self.partition, error)

    async def _connect(self, *, first: bool) -> None:
        connection = await self._services.connection_for(self.partition)
        body = await connection.request(lambda request_id: ProducerOpen(request_id, self.handle, self.partition, self.producer_id))
        last = body.get("last_sequence_id", -1)
        self.last_persisted_sequence_id = last
        if first or self.last_sequence_id < last:
            self.last_sequence_id = max(self.last_sequence_id, last)
        self._lost = trio.Event()
        self._connection = connection
        connection.register_producer(self.handle, self._on_receipt, self._on_closed)
        for batch in self._pending.values():
            self._send_frame(batch)
        if not first:
            log.info("producer %s on %s reconnected to %s; resent %d batches", self.producer_id, self.partition,
                     connection.address, len(self._pending))

    def _on_closed(self, reason: str) -> None:
        if self._connection is not None:
            log.info("producer %s on %s: %s", self.producer_id, self.partition, reason)
        self._connection = None
        self._lost.set()

    async def close(self) -> None:
        """Send what is being batched, wait for every receipt, then close."""
        if self._closed:
            return
        await self.flush()
        self._closed = True
        connection = self._connection
        if connection is not None and connection.closed is None:
            connection.forget_producer(self.handle)
            try:
                await connection.request(lambda request_id: CloseProducer(request_id, self.handle))
            except BrokerError:
                pass
        self._fail_all(ClientClosedError(f"producer {self.producer_id} closed"))
        self._cancel_scope.cancel()

    def abort(self) -> None:
        self._closed = True
        self._fail_all(ClientClosedError(f"producer {self.producer_id} closed"))
        self._cancel_scope.cancel()

    # --- sending ---------------------------------------------------------------------------

    async def send_async(
        self,
        data: bytes,
        *,
        key: str | None = None,
        properties: dict[str, str] | None = None,
        sequence_id: int | None = None,
        event_time_ms: int | None = None,
        deliver_at_ms: int | None = None,
    ) -> SendFuture:
        """Hand a message over (waiting only for room under
        `pending_messages_max`); the future gives its result.
        `event_time_ms`: when the event happened, as the application
        knows it (Pulsar's event time; none by default). `deliver_at_ms`:
        shared and key-shared subscriptions get it at this time (ms since
        the epoch), not before (Pulsar's deliver_at); it is sent alone."""
        if self._closed:
            raise ClientClosedError(f"producer {self.producer_id} is closed")
        _check_message(data, key, properties)
        if event_time_ms is not None and (type(event_time_ms) is not int or event_time_ms <= 0):
            raise ValueError(f"event_time_ms must be a positive integer (ms since the epoch), got {event_time_ms!r}")
        if deliver_at_ms is not None and (type(deliver_at_ms) is not int or deliver_at_ms <= 0):
            raise ValueError(f"deliver_at_ms must be a positive integer (ms since the epoch), got {deliver_at_ms!r}")
        chunked = len(data) > MESSAGE_BYTES_MAX
        if chunked and not self.options.chunking:
            raise ValueError(f"a message holds at most {MESSAGE_BYTES_MAX} bytes, got {len(data)} (chunking=True sends "
                             f"larger ones in chunks)")
        if len(data) > CHUNKED_MESSAGE_BYTES_MAX:
            raise ValueError(f"a chunked message holds at most {CHUNKED_MESSAGE_BYTES_MAX} bytes, got {len(data)}")
        if sequence_id is not None:
            if type(sequence_id) is not int or sequence_id < 0:
                raise ValueError(f"sequence_id must be a non-negative integer, got {sequence_id!r}")
            pending = self._by_sequence.get(sequence_id)
            if pending is not None:
                return pending  # a retry of a message still on its way
        try:
            self._pending_message_slots.acquire_nowait()  # no scheduling point while there is room
        except trio.WouldBlock:
            await self._pending_message_slots.acquire()
        # An explicit retry of a message no longer pending (at or below the
        # last sequence id this producer used or was told was persisted) goes
        # in a batch of its own, after what is being batched: the broker
        # judges a batch by its highest sequence id, so a retry batched with
        # a newer message would be taken as new and persisted twice.
        retry = sequence_id is not None and sequence_id <= self.last_sequence_id
        alone = retry or deliver_at_ms is not None or chunked
        if sequence_id is None:
            sequence_id = self.last_sequence_id + 1
        if alone:
            self._flush_building()
        self.last_sequence_id = max(self.last_sequence_id, sequence_id)
        future = SendFuture(sequence_id)
        self._by_sequence[sequence_id] = future
        message = _OutMessage(sequence_id, int(time.time() * 1000), key, properties, bytes(data), event_time_ms or 0, future,
                              deliver_at_ms or 0)
        if self._building.messages and self._building.bytes + len(data) > self.options.batch_bytes_max:
            self._flush_building()  # a batch stays within its byte bound
        if chunked:
            self._pending[sequence_id] = batch = _Batch([message], chunk_frames=[])
            self._send_frame(batch)
            return future
        building = self._building
        building.messages.append(message)
        building.bytes += len(data)
        options = self.options
        if (not options.batching or len(building.messages) >= options.batch_messages_max
                or building.bytes >= options.batch_bytes_max or alone):
            self._flush_building()
        elif len(building.messages) == 1:
            self._flush_wakeup.set()
        return future

    async def send(self, data: bytes, **options: Any) -> SendResult:
        future = await self.send_async(data, **options)
        return await future.wait()

    async def flush(self) -> None:
        """Send what is being batched and wait until everything sent is persisted."""
        self._flush_building()
        for batch in list(self._pending.values()):
            for message in batch.messages:
                try:
                    await message.future.wait()
                except BrokerError:
                    pass

    async def _batch_timer(self) -> None:
        delay_s = self.options.batch_delay_ms / 1000.0
        while True:
            await self._flush_wakeup.wait()
            self._flush_wakeup = trio.Event()
            if delay_s > 0:
                await trio.sleep(delay_s)
            self._flush_building()

    def _flush_building(self) -> None:
        messages = self._building.messages
        if not messages:
            return
        self._building = _Building()
        batch = _Batch(messages)
        self._pending[batch.last_sequence_id] = batch
        self._send_frame(batch)

    def _send_frame(self, batch: _Batch) -> None:
        if batch.chunk_frames is not None:
            self._send_chunks(batch)
            return
        if batch.frame is None:
            messages = batch.messages
            # Built as Pulsar's clients build it: a producer without batching
            # sends each message on its own, one with batching sends batches.
            # An _OutMessage has OutMessage's fields: it is handed over as it is.
            body = build_batch(self.producer_id, messages[0].publish_time_ms, messages, self.options.codec,
                               batched=self.options.batching or len(messages) > 1)
            batch.frame = Send(self.handle, messages[0].sequence_id, messages[-1].sequence_id, len(messages), body)
        connection = self._connection
        if connection is None:
            return  # sent on reconnection
        try:
            connection.send(batch.frame)
        except ConnectionClosedError:
            self._on_closed("connection closed")

    def _send_chunks(self, batch: _Batch) -> None:
        """A chunked message: every chunk, each answered by a receipt of
        the message's sequence id; the last receipt settles it."""
        message = batch.messages[0]
        if not batch.chunk_frames:
            bodies = build_chunks(self.producer_id, message.publish_time_ms, message, self.options.codec,
                                  MESSAGE_BYTES_MAX - CHUNK_HEADROOM_BYTES, f"{self.producer_id}-{message.sequence_id}")
            batch.chunk_frames = [Send(self.handle, message.sequence_id, message.sequence_id, 1, body) for body in bodies]
        connection = self._connection
        if connection is None:
            return  # sent on reconnection
        batch.receipts_left, batch.duplicate = len(batch.chunk_frames), False
        try:
            for frame in batch.chunk_frames:
                connection.send(frame)
        except ConnectionClosedError:
            self._on_closed("connection closed")

    # --- receipts ----------------------------------------------------------------------------

    def _on_receipt(self, receipt: SendReceipt) -> None:
        batch = self._pending.get(receipt.last_sequence_id)
        if batch is None:
            return  # a receipt for a batch settled already (answered twice after a resend)
        status = BrokerStatus(receipt.status) if receipt.status in BrokerStatus._value2member_map_ else BrokerStatus.ERROR
        if batch.chunk_frames and status in (BrokerStatus.OK, BrokerStatus.DUPLICATE):
            # Only the last chunk can be a duplicate (the others are not
            # deduplicated), and its receipt may come first; otherwise the
            # last receipt is the last chunk's (persisted in order).
            batch.duplicate = batch.duplicate or status is BrokerStatus.DUPLICATE
            batch.receipts_left -= 1
            if batch.receipts_left > 0:
                return
            if batch.duplicate:
                status = BrokerStatus.DUPLICATE
        if status is BrokerStatus.OK:
            self._resolve_batch(batch, lambda index, message: SendResult(
                MessageId(receipt.ledger_id, receipt.entry_id, index, self.partition_index),
                receipt.first_offset + index, message.sequence_id))
        elif status is BrokerStatus.DUPLICATE:
            self._resolve_batch(batch, lambda index, message: SendResult(
                MessageId(-1, -1, -1, self.partition_index), -1, message.sequence_id))
        elif status is BrokerStatus.RETRY:
            self._services.spawn(self._resend_later, batch)
        elif status in (BrokerStatus.TOPIC_FENCED, BrokerStatus.NOT_OWNER, BrokerStatus.SERVICE_UNAVAILABLE, BrokerStatus.ERROR):
            # The partition moved or its broker failed: reconnect and resend everything pending.
            connection = self._connection
            if connection is not None:
                connection.forget_producer(self.handle)
                self._on_closed(f"broker answered {status.name}: {receipt.message}")
        else:
            error = error_for_status(status, receipt.message)
            self._resolve_batch(batch, None, error)

    async def _resend_later(self, batch: _Batch) -> None:
        await trio.sleep(RETRY_DELAY_S)
        if self._pending.get(batch.last_sequence_id) is batch:
            self._send_frame(batch)

    def _resolve_batch(self, batch: _Batch, result_of, error: BaseException | None = None) -> None:
        del self._pending[batch.last_sequence_id]
        for index, message in enumerate(batch.messages):
            if self._by_sequence.get(message.sequence_id) is message.future:
                del self._by_sequence[message.sequence_id]
            message.future._resolve(None if error is not None else result_of(index, message), error)
            self._pending_message_slots.release()

    def _fail_all(self, error: BaseException) -> None:
        for batch in list(self._pending.values()):
            self._resolve_batch(batch, None, error)
        for message in self._building.messages:
            message.future._resolve(None, error)
            self._pending_message_slots.release()
        self._building = _Building()

    @property
    def pending_messages(self) -> int:
        return sum(len(batch.messages) for batch in self._pending.values()) + len(self._building.messages)


def _check_message(data: Any, key: Any, properties: Any) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"message data must be bytes, got {type(data).__name__}")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key must be a string, got {type(key).__name__}")
    if properties is not None and (
        not isinstance(properties, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in properties.items())
    ):
        raise TypeError("properties must be a dict of str to str")


class Producer:
    """A producer on a topic: one partition producer per partition; a
    message with a key goes to the partition its key hashes to, one without
    to the next partition in turn. Sequence ids are per partition."""

    def __init__(self, topic: str, producer_id: str, partitions: list[PartitionProducer],
                 hashing_scheme: HashingScheme = HashingScheme.JAVA_STRING) -> None:
        self.topic = topic
        self.producer_id = producer_id
        self.partitions = partitions
        self.hashing_scheme = hashing_scheme
        self._round_robin = 0

    def _route(self, key: str | None) -> PartitionProducer:
        if len(self.partitions) == 1:
            return self.partitions[0]
        if key is not None:
            return self.partitions[partition_for_key(key, len(self.partitions), self.hashing_scheme)]
        self._round_robin = (self._round_robin + 1) % len(self.partitions)
        return self.partitions[self._round_robin]

    @property
    def last_sequence_id(self) -> int:
        """For a topic that is not partitioned: the last sequence id given out."""
        return self.partitions[0].last_sequence_id if len(self.partitions) == 1 else -1

    async def send_async(self, data: bytes, *, key: str | None = None, properties: dict[str, str] | None = None,
                         sequence_id: int | None = None, partition: int | None = None,
                         event_time_ms: int | None = None, deliver_at_ms: int | None = None,
                         deliver_after_ms: int | None = None) -> SendFuture:
        """`deliver_at_ms` (ms since the epoch) or `deliver_after_ms` (from
        now): when shared and key-shared subscriptions get the message."""
        if deliver_after_ms is not None:
            if deliver_at_ms is not None:
                raise ValueError("give deliver_at_ms or deliver_after_ms, not both")
            if type(deliver_after_ms) is not int or deliver_after_ms < 0:
                raise ValueError(f"deliver_after_ms must be a non-negative integer, got {deliver_after_ms!r}")
            deliver_at_ms = int(time.time() * 1000) + deliver_after_ms
        target = self.partitions[partition] if partition is not None else self._route(key)
        return await target.send_async(data, key=key, properties=properties, sequence_id=sequence_id,
                                       event_time_ms=event_time_ms, deliver_at_ms=deliver_at_ms)

    async def send(self, data: bytes, *, key: str | None = None, properties: dict[str, str] | None = None,
                   sequence_id: int | None = None, partition: int | None = None,
                   event_time_ms: int | None = None, deliver_at_ms: int | None = None,
                   deliver_after_ms: int | None = None) -> MessageId:
        """Send and wait until persisted; returns the message id."""
        future = await self.send_async(data, key=key, properties=properties, sequence_id=sequence_id, partition=partition,
                                       event_time_ms=event_time_ms, deliver_at_ms=deliver_at_ms,
                                       deliver_after_ms=deliver_after_ms)
        return (await future.wait()).message_id

    async def flush(self) -> None:
        for partition in self.partitions:
            await partition.flush()

    async def close(self) -> None:
        for partition in self.partitions:
            await partition.close()


__all__ = ["Producer", "ProducerOptions", "PartitionProducer", "SendFuture", "partition_for_key"]
