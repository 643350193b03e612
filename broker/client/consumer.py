"""Consumers. A `PartitionConsumer` is one subscription's consumer on one
partition: it gives the broker permits (flow control: at most
`receiver_queue_size` messages wait in the client), unpacks delivered
entries into messages, gathers acknowledgements into one request every
`ack_group_ms` (an acknowledgement returns once the broker has made it
durable), redelivers negatively acknowledged messages after a delay and
unacknowledged ones after the ack timeout, and after a broken connection or
a partition that moved, subscribes again (the broker redelivers what was not
acknowledged). `Consumer` merges a topic's partitions into one stream.

Delivery is at least once, as Pulsar's: after a reconnection the broker
delivers again every message not yet acknowledged durably, including ones
the application already holds. What the application has acknowledged is
not given to it again: until the broker confirms an acknowledgement, a
redelivery of its messages is dropped on arrival (Pulsar's client does the
same with its pending acknowledgements). An acknowledgement counts from the
call, not from when its awaitable runs: `nursery.start_soon(consumer.acknowledge, m)`
is enough.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable

import trio

from broker.client.backoff import HEALTHY_CONNECTION_S, RECONNECT_ERRORS, Backoff
from broker.client.client_services import ClientServices
from broker.client.connection import BrokerConnection
from broker.client.messages import Message, MessageId
from broker.errors import BrokerError, ClientClosedError, ConnectionClosedError
from broker.client.chunks import ChunkAssembler

CHUNK_EXPIRY_CHECK_S = 10.0  # incomplete chunked messages are looked at this often
from broker.message_format import MalformedEntryError, body_items, chunk_of, chunked_message, decode_entry
from broker.topic_names import pulsar_name
from broker.protocol import Ack, CloseConsumer, Flow, MessageDelivery, Redeliver, Seek, Subscribe, Unsubscribe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeadLetterPolicy:
    """Pulsar's dead-letter policy: a message delivered `max_redeliver_count`
    times again and then negatively acknowledged (or not acknowledged in
    time) once more goes to `dead_letter_topic` (default
    `<topic>-<subscription>-DLQ`) and is acknowledged, instead of coming back."""

    max_redeliver_count: int
    dead_letter_topic: str | None = None

    def __post_init__(self) -> None:
        if type(self.max_redeliver_count) is not int or self.max_redeliver_count < 1:
            raise ValueError("max_redeliver_count must be a positive integer")

    def topic_for(self, topic: str, subscription: str) -> str:
        return self.dead_letter_topic or f"{topic}-{subscription}-DLQ"


@dataclass(frozen=True)
class ConsumerOptions:
    subscription_type: str = "exclusive"
    consumer_name: str = ""
    receiver_queue_size: int = 1_000  # messages waiting in the client, per partition
    ack_timeout_ms: float | None = None  # unacknowledged this long: delivered again
    negative_ack_delay_ms: float = 1_000.0
    ack_group_ms: float = 1.0
    priority: int = 0
    initial_position: str = "latest"  # of a new subscription: "earliest" or "latest"
    important: bool = False  # the subscription holds every message it has not acknowledged, whatever the retention
    durable: bool = True
    start_offset: int | None = None  # readers: where to start
    dead_letter: DeadLetterPolicy | None = None
    read_compacted: bool = False  # the compacted view (the latest message of each key), then what follows it

    def __post_init__(self) -> None:
        if self.receiver_queue_size < 2:
            raise ValueError("receiver_queue_size must be at least 2")
        if self.initial_position not in ("earliest", "latest"):
            raise ValueError(f"initial_position must be 'earliest' or 'latest', got {self.initial_position!r}")
        if self.ack_timeout_ms is not None and self.ack_timeout_ms <= 0:
            raise ValueError("ack_timeout_ms must be positive")


class _AckGroup:
    __slots__ = ("offsets", "cumulative", "done", "error")

    def __init__(self, cumulative: bool) -> None:
        self.offsets: list[int] = []
        self.cumulative = cumulative
        self.done = trio.Event()
        self.error: BaseException | None = None


class PartitionConsumer:
    def __init__(self, services: ClientServices, consumer: "Consumer", topic: str, partition: str, partition_index: int,
                 subscription: str, options: ConsumerOptions) -> None:
        self._services = services
        self.consumer = consumer
        self.topic = topic
        self.partition = partition
        self.partition_index = partition_index
        self.subscription = subscription
        self.options = options
        self.handle = services.new_handle()
        self._connection: BrokerConnection | None = None
        self._lost = trio.Event()
        self._connected = trio.Event()
        self._closed = False
        self._generation = 0  # connections made; messages of an older one are dropped
        self._last_offset_given: int | None = None  # of the last message the application took
        self._given_since_flow = 0
        self._acks = _AckGroup(False)
        self._ack_wakeup = trio.Event()
        # Acknowledged by the application, not yet confirmed durable by the
        # broker: a redelivery of these is dropped (offset -> acknowledgements pending).
        self._acks_pending: collections.Counter[int] = collections.Counter()
        self._cumulative_pending: collections.Counter[int] = collections.Counter()
        self._unacked_deadlines: collections.OrderedDict[int, float] = collections.OrderedDict()  # offset -> deadline (s)
        # Given to the application as often as the dead-letter policy allows:
        # at their next redelivery they go to the dead-letter topic (offset -> message).
        self._last_deliveries: dict[int, Message] = {}
        self._chunks = ChunkAssembler()
        # Chunked messages given and not acknowledged: last offset -> the offsets of their other chunks.
        self._chunk_offsets_of: dict[int, tuple[int, ...]] = {}
        self._cancel_scope = trio.CancelScope()

    # --- lifetime --------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        backoff = Backoff(self._services.rng)
        with self._cancel_scope:
            while True:
                try:
                    await self._connect()
                    break
                except RECONNECT_ERRORS as error:
                    log.info("consumer of %s on %s: subscribing: %s", self.subscription, self.partition, error)
                    await trio.sleep(backoff.next_delay_s())
            task_status.started()
            backoff.reset()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._ack_loop)
                nursery.start_soon(self._chunk_expiry_loop)
                if self.options.ack_timeout_ms is not None:
                    nursery.start_soon(self._ack_timeout_loop)
                while not self._closed:
                    connected_at = trio.current_time()
                    await self._lost.wait()
                    if trio.current_time() - connected_at >= HEALTHY_CONNECTION_S:
                        backoff.reset()
                    await trio.sleep(backoff.next_delay_s())
                    try:
                        await self._connect()
                    except RECONNECT_ERRORS as error:
                        log.info("consumer of %s on %s: resubscribing: %s", self.subscription, self.partition, error)
                    except BrokerError as error:
                        log.warning("consumer of %s on %s: %s; retrying", self.subscription, self.partition, error)

    async def _connect(self) -> None:
        options = self.options
        start_offset = options.start_offset
        if not options.durable and self._last_offset_given is not None:
            # A reader has no cursor on the broker: it goes on after what it got.
            start_offset = self._last_offset_given + 1
        connection = await self._services.connection_for(self.partition)
        await connection.request(lambda request_id: Subscribe(
            request_id, self.handle, self.partition, self.subscription, options.subscription_type,
            options.consumer_name, options.priority, options.initial_position, options.durable, options.important,
            start_offset, options.read_compacted,
        ))
        self._generation += 1
        # What was queued from the last connection is delivered again by the broker.
        self.consumer._drop_queued(self)
        self._chunks.clear()
        self._unacked_deadlines.clear()
        self._given_since_flow = 0
        self._lost = trio.Event()
        self._connection = connection
        connection.register_consumer(self.handle, self._on_message, self._on_closed)
        connection.send(Flow(self.handle, options.receiver_queue_size))
        self._connected.set()

    def _on_closed(self, reason: str) -> None:
        if self._connection is not None:
            log.info("consumer of %s on %s: %s", self.subscription, self.partition, reason)
        self._connection = None
        self._connected = trio.Event()
        self._lost.set()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        connection = self._connection
        if connection is not None and connection.closed is None:
            connection.forget_consumer(self.handle)
            try:
                await connection.request(lambda request_id: CloseConsumer(request_id, self.handle))
            except BrokerError:
                pass
        self._cancel_scope.cancel()

    # --- receiving ---------------------------------------------------------------------------

    def _on_message(self, delivery: MessageDelivery) -> None:
        try:
            header, body = decode_entry(delivery.entry)
            if header.chunked:
                self._on_chunk(delivery, header, body)
                return
            items = body_items(header, body)
        except MalformedEntryError as error:
            # A batch no consumer can read (a producer's bug): acknowledged
            # and skipped, loudly, as Pulsar discards a corrupt batch; left
            # unacknowledged it would come back for ever and hold retention.
            log.error("consumer of %s on %s: entry %d:%d is malformed, acknowledged and skipped: %s",
                      self.subscription, self.partition, delivery.ledger_id, delivery.entry_id, error)
            self._discard(delivery)
            return
        topic, partition, partition_index = self.topic, self.partition, self.partition_index
        ledger_id, entry_id, redelivery_count = delivery.ledger_id, delivery.entry_id, delivery.redelivery_count
        first_offset, keys, producer_id, codec = header.first_offset, header.keys, header.producer_id, header.codec.value
        count = len(items)
        messages = []
        append = messages.append
        acks_pending = self._acks_pending
        acked_through = max(self._cumulative_pending) if self._cumulative_pending else -1
        dropped = 0
        # MessageId's own __new__ is a Python function: a tenth of a
        # message's cost at 200,000 messages/s; tuple's is not.
        new_id, message_id_class = tuple.__new__, MessageId
        for index in delivery.batch_indexes:
            if not 0 <= index < count:
                continue
            if acks_pending or acked_through >= 0:
                offset = first_offset + index
                if offset <= acked_through or offset in acks_pending:
                    dropped += 1  # redelivered, and acknowledged already
                    continue
            sequence_id, publish_ms, properties, payload, event_time_ms = items[index]
            append(Message(topic, partition, new_id(message_id_class, (ledger_id, entry_id, index, partition_index)), first_offset + index,
                           payload, None if keys is None else keys[index], properties, publish_ms, producer_id,
                           sequence_id, codec, redelivery_count, event_time_ms))
        self.consumer._enqueue(self, self._generation, messages)
        if dropped:
            self._permits_used(dropped)

    def _on_chunk(self, delivery: MessageDelivery, header, body) -> None:
        """A chunk of a chunked message: held until its message's last
        chunk, then the whole message is given (raises MalformedEntryError)."""
        offset = header.first_offset
        if offset in self._acks_pending or (self._cumulative_pending and offset <= max(self._cumulative_pending)):
            self._permits_used(1)  # redelivered, and acknowledged already
            return
        chunk = chunk_of(header, body)
        assert chunk is not None
        now_ms = int(time.time() * 1000)
        self._expire_chunks(now_ms)
        assembled = self._chunks.add(chunk, offset, header.publish_time_ms, now_ms)
        if assembled.acknowledge:
            self._acknowledge_quietly(assembled.acknowledge)
        if assembled.redeliver:
            self._services.spawn(self._redeliver_later, list(assembled.redeliver), self.options.negative_ack_delay_ms / 1000.0)
        if assembled.payloads is None:
            self._permits_used(1)  # held: the application gets it with the message
            return
        sequence_id, publish_ms, properties, payload, event_time_ms = chunked_message(header, body, assembled.payloads)
        message = Message(self.topic, self.partition, MessageId(delivery.ledger_id, delivery.entry_id, 0, self.partition_index),
                          offset, payload, None if header.keys is None else header.keys[0], properties, publish_ms,
                          header.producer_id, sequence_id, header.codec.value, delivery.redelivery_count, event_time_ms,
                          assembled.offsets[:-1])
        self.consumer._enqueue(self, self._generation, [message])

    def _expire_chunks(self, now_ms: int) -> None:
        expired = self._chunks.expire(now_ms)
        if expired:
            log.warning("consumer of %s on %s: a chunked message got no chunk for %d s: its %d chunks dropped",
                        self.subscription, self.partition, self._chunks.expiry_ms // 1000, len(expired))
            self._acknowledge_quietly(expired)

    async def _chunk_expiry_loop(self) -> None:
        """Chunked messages that get no new chunk expire also when no chunk comes at all."""
        while True:
            await trio.sleep(CHUNK_EXPIRY_CHECK_S)
            if self._chunks.pending_count:
                self._expire_chunks(int(time.time() * 1000))

    def _acknowledge_quietly(self, offsets) -> None:
        """Acknowledge chunks nobody will be given (whether it took is not awaited)."""
        group = _AckGroup(False)
        group.offsets.extend(offsets)
        self._services.spawn(self._send_acks, group)

    def _discard(self, delivery: MessageDelivery) -> None:
        try:
            header, _ = decode_entry(delivery.entry)
        except MalformedEntryError:
            return  # not even its header: the broker never writes such an entry
        self._send(Flow(self.handle, len(delivery.batch_indexes)))
        if self.options.durable:
            group = _AckGroup(False)
            group.offsets.extend(header.first_offset + index for index in delivery.batch_indexes)
            self._services.spawn(self._send_acks, group)

    def _given(self, message: Message) -> None:
        """The application took a message: track its ack timeout, and give
        permits back once half the queue was taken."""
        self._last_offset_given = message.offset
        if message.chunk_offsets:
            self._chunk_offsets_of[message.offset] = message.chunk_offsets
        dead_letter = self.options.dead_letter
        if dead_letter is not None and message.redelivery_count >= dead_letter.max_redeliver_count:
            self._last_deliveries[message.offset] = message
        if self.options.ack_timeout_ms is not None:
            self._unacked_deadlines[message.offset] = trio.current_time() + self.options.ack_timeout_ms / 1000.0
        self._permits_used(1)

    def _permits_used(self, count: int) -> None:
        """Messages left the receiver queue (or never entered it): give the
        permits back once half the queue's worth is due."""
        self._given_since_flow += count
        if self._given_since_flow >= self.options.receiver_queue_size // 2:
            self._send(Flow(self.handle, self._given_since_flow))
            self._given_since_flow = 0
            if not self.options.durable and self._last_offset_given is not None:
                # A reader acknowledges what it was given, cumulatively, as
                # Pulsar's readers do: the broker would otherwise hold every
                # message out to it as unacknowledged, and stop at its bound.
                self._take_cumulative(self._last_offset_given)

    def _send(self, message) -> None:
        connection = self._connection
        if connection is not None:
            try:
                connection.send(message)
            except ConnectionClosedError:
                self._on_closed("connection closed")

    # --- acknowledging ---------------------------------------------------------------------

    def acknowledge(self, offset: int) -> Awaitable[None]:
        """Taken when called; the awaitable returns once it is durable."""
        self._unacked_deadlines.pop(offset, None)
        self._last_deliveries.pop(offset, None)
        offsets = (offset, *self._chunk_offsets_of.pop(offset, ()))
        group = self._acks
        for each in offsets:
            self._acks_pending[each] += 1
            group.offsets.append(each)
        self._ack_wakeup.set()
        return self._acknowledged(group)

    def acknowledge_cumulative(self, offset: int) -> Awaitable[None]:
        """Taken when called; the awaitable returns once it is durable."""
        return self._acknowledged(self._take_cumulative(offset))

    def _take_cumulative(self, offset: int) -> _AckGroup:
        for tracked in [tracked for tracked in self._unacked_deadlines if tracked <= offset]:
            del self._unacked_deadlines[tracked]
        for tracked in [tracked for tracked in self._last_deliveries if tracked <= offset]:
            del self._last_deliveries[tracked]
        for tracked in [tracked for tracked in self._chunk_offsets_of if tracked <= offset]:
            del self._chunk_offsets_of[tracked]
        self._cumulative_pending[offset] += 1
        group = _AckGroup(True)
        group.offsets.append(offset)
        self._services.spawn(self._send_acks, group)
        return group

    @staticmethod
    async def _acknowledged(group: _AckGroup) -> None:
        await group.done.wait()
        if group.error is not None:
            raise group.error

    async def _ack_loop(self) -> None:
        delay_s = self.options.ack_group_ms / 1000.0
        while True:
            await self._ack_wakeup.wait()
            self._ack_wakeup = trio.Event()
            if delay_s > 0:
                await trio.sleep(delay_s)
            group, self._acks = self._acks, _AckGroup(False)
            if group.offsets:
                self._services.spawn(self._send_acks, group)

    async def _send_acks(self, group: _AckGroup) -> None:
        """Send a group of acknowledgements until the broker takes it (over
        reconnections: an acknowledgement names an offset, valid for any
        consumer of the subscription)."""
        try:
            while not self._closed:
                await self._connected.wait()
                connection = self._connection
                if connection is None:
                    continue
                try:
                    await connection.request(lambda request_id: Ack(request_id, self.handle, group.cumulative, group.offsets))
                    return
                except RECONNECT_ERRORS:
                    if self._connection is connection:
                        connection.forget_consumer(self.handle)
                        self._on_closed("acknowledgement failed")
                    await trio.sleep(0.05)
                except BrokerError as error:
                    group.error = error
                    return
            group.error = ClientClosedError("consumer closed")
        finally:
            # Durable now, or refused (then a redelivery is the application's again).
            pending = self._cumulative_pending if group.cumulative else self._acks_pending
            pending.subtract(group.offsets)
            for offset in group.offsets:
                if pending[offset] <= 0:
                    del pending[offset]
            group.done.set()

    def negative_acknowledge(self, offset: int) -> None:
        self._unacked_deadlines.pop(offset, None)
        self._services.spawn(self._redeliver_later, [offset], self.options.negative_ack_delay_ms / 1000.0)

    async def _redeliver_later(self, offsets: list[int], delay_s: float) -> None:
        await trio.sleep(delay_s)
        self._redeliver(offsets)

    def _redeliver(self, offsets: list[int]) -> None:
        """Ask for these again, except those the dead-letter policy sends to
        its topic instead."""
        dead = [self._last_deliveries.pop(offset) for offset in offsets if offset in self._last_deliveries]
        # A chunked message comes again whole: every chunk (a dead one's
        # chunks are acknowledged with it, by `acknowledge`).
        dead_offsets = {message.offset for message in dead}
        offsets = [each for offset in offsets
                   for each in ((offset,) if offset in dead_offsets else (offset, *self._chunk_offsets_of.pop(offset, ())))]
        if dead:
            self._services.spawn(self._dead_letter, dead)
            dead_offsets = {message.offset for message in dead}
            offsets = [offset for offset in offsets if offset not in dead_offsets]
        if offsets:
            self._send(Redeliver(self.handle, offsets))

    async def _dead_letter(self, messages: list[Message]) -> None:
        """Publish each message to the dead-letter topic (with Pulsar's
        REAL_TOPIC and ORIGIN_MESSAGE_ID properties), then acknowledge it;
        one that could not be published is delivered again."""
        for message in messages:
            try:
                producer = await self.consumer.dead_letter_producer()
                properties = {**message.properties, "REAL_TOPIC": pulsar_name(message.partition),
                              "ORIGIN_MESSAGE_ID": ":".join(map(str, message.message_id[:3]))}
                await producer.send(message.data, key=message.key, properties=properties)
            except (BrokerError, ValueError) as error:
                log.warning("consumer of %s on %s: message %s not sent to the dead-letter topic (%s); delivered again",
                            self.subscription, self.partition, message.message_id, error)
                self._send(Redeliver(self.handle, [message.offset]))
                continue
            try:
                await self.acknowledge(message.offset)
            except BrokerError as error:
                # Sent, not acknowledged: it comes again (and goes to the
                # dead-letter topic again), as with Pulsar's clients.
                log.warning("consumer of %s on %s: message %s sent to the dead-letter topic, not acknowledged (%s)",
                            self.subscription, self.partition, message.message_id, error)

    async def _ack_timeout_loop(self) -> None:
        timeout_s = self.options.ack_timeout_ms / 1000.0
        while True:
            await trio.sleep(max(0.01, timeout_s / 4))
            now = trio.current_time()
            expired = [offset for offset, deadline in self._unacked_deadlines.items() if deadline <= now]
            for offset in expired:
                del self._unacked_deadlines[offset]
            if expired:
                log.info("consumer of %s on %s: %d messages not acknowledged in time, delivered again",
                         self.subscription, self.partition, len(expired))
                self._redeliver(expired)

    # --- seeking and unsubscribing --------------------------------------------------------------

    async def seek(self, *, offset: int | None = None, publish_time_ms: int | None = None,
                   message_id: MessageId | None = None) -> int:
        await self._connected.wait()
        connection = self._connection
        assert connection is not None
        position = None if message_id is None else [message_id.ledger_id, message_id.entry_id, message_id.batch_index]
        body = await connection.request(lambda request_id: Seek(request_id, self.handle, offset, publish_time_ms, position))
        self.consumer._drop_queued(self)
        self._unacked_deadlines.clear()
        self._last_deliveries.clear()
        # What comes from the new position is the application's, acknowledged before or not.
        self._acks_pending.clear()
        self._cumulative_pending.clear()
        return body.get("offset", -1)

    async def unsubscribe(self) -> None:
        await self._connected.wait()
        connection = self._connection
        assert connection is not None
        await connection.request(lambda request_id: Unsubscribe(request_id, self.handle))
        self._closed = True
        connection.forget_consumer(self.handle)
        self._cancel_scope.cancel()


class Consumer:
    """A subscription's consumer on a topic: every partition's messages in
    one queue, `receive()` in arrival order (per partition, in order)."""

    def __init__(self, topic: str, subscription: str, make_producer=None, dead_letter: DeadLetterPolicy | None = None) -> None:
        """`make_producer(topic, producer_id)`: the client's, for the dead-letter topic."""
        self.topic = topic
        self.subscription = subscription
        self.partitions: list[PartitionConsumer] = []
        self._make_producer = make_producer
        self._dead_letter = dead_letter
        self._dead_letter_producer = None
        self._dead_letter_lock = trio.Lock()
        self._queue: collections.deque[tuple[PartitionConsumer, int, Message]] = collections.deque()
        self._arrived = trio.Event()
        self._closed = False

    def _enqueue(self, source: PartitionConsumer, generation: int, messages: list[Message]) -> None:
        for message in messages:
            self._queue.append((source, generation, message))
        if messages:
            self._arrived.set()

    async def dead_letter_producer(self):
        """The producer to the dead-letter topic, made on first use."""
        async with self._dead_letter_lock:
            if self._dead_letter_producer is None:
                assert self._dead_letter is not None and self._make_producer is not None
                topic = self._dead_letter.topic_for(self.topic, self.subscription)
                # A name of its own: every consumer of the subscription has
                # one (a producer name is one producer at a time).
                self._dead_letter_producer = await self._make_producer(topic, f"dlq-{uuid.uuid4().hex}", chunking=True)
            return self._dead_letter_producer

    def _drop_queued(self, source: PartitionConsumer) -> None:
        self._queue = collections.deque(item for item in self._queue if item[0] is not source)

    def _by_partition(self, message: Message) -> PartitionConsumer:
        for partition in self.partitions:
            if partition.partition == message.partition:
                return partition
        raise ValueError(f"message {message.message_id} is not from this consumer's partitions")

    async def receive(self) -> Message:
        """The next message (waits for one). Bound it with trio.fail_after."""
        while True:
            if self._closed:
                raise ClientClosedError(f"consumer of {self.subscription} is closed")
            while self._queue:
                source, generation, message = self._queue.popleft()
                if generation != source._generation:
                    continue  # from a connection since replaced: the broker delivers it again
                source._given(message)
                return message
            self._arrived = trio.Event()
            await self._arrived.wait()

    def receive_nowait(self) -> Message | None:
        while self._queue:
            source, generation, message = self._queue.popleft()
            if generation == source._generation:
                source._given(message)
                return message
        return None

    def acknowledge(self, message: Message) -> Awaitable[None]:
        """Acknowledge one message. It counts from this call (a redelivery
        is not given again); await the result to know it durable."""
        return self._by_partition(message).acknowledge(message.offset)

    def acknowledge_cumulative(self, message: Message) -> Awaitable[None]:
        """Acknowledge this message and every one before it in its
        partition; as `acknowledge`, it counts from the call."""
        return self._by_partition(message).acknowledge_cumulative(message.offset)

    def negative_acknowledge(self, message: Message) -> None:
        """Ask for the message again, after the negative-ack delay."""
        self._by_partition(message).negative_acknowledge(message.offset)

    async def seek(self, *, offset: int | None = None, message_id: MessageId | None = None,
                   publish_time_ms: int | None = None) -> None:
        """Move the subscription: to a partition offset (one partition), to
        just at a message id, or to the first message published at or after a time."""
        if publish_time_ms is not None:
            for partition in self.partitions:
                await partition.seek(publish_time_ms=publish_time_ms)
            return
        if message_id is not None:
            for partition in self.partitions:
                if partition.partition_index == message_id.partition:
                    await partition.seek(message_id=message_id)
                    return
            raise ValueError(f"message id {message_id} names partition {message_id.partition}, not one of this consumer's")
        if offset is None:
            raise ValueError("seek needs an offset or a publish time")
        if len(self.partitions) != 1:
            raise ValueError("seek to an offset is per partition: use a consumer of one partition")
        await self.partitions[0].seek(offset=offset)

    async def unsubscribe(self) -> None:
        for partition in self.partitions:
            await partition.unsubscribe()
        self._closed = True
        self._arrived.set()

    async def close(self) -> None:
        for partition in self.partitions:
            await partition.close()
        self._closed = True
        self._arrived.set()
        if self._dead_letter_producer is not None:
            await self._dead_letter_producer.close()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Message:
        return await self.receive()


__all__ = ["Consumer", "ConsumerOptions", "DeadLetterPolicy", "PartitionConsumer"]
