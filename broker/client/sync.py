"""`Client` for code that is not async: the same calls, run on a trio event
loop the client keeps in a thread of its own.

    from broker.client.sync import Client
    with Client.connect("127.0.0.1:2181", root="/quire") as client:
        producer = client.create_producer("orders", producer_id="billing-1")
        message_id = producer.send(b"payload", key="account-42")
        consumer = client.subscribe("orders", subscription="audit", subscription_type="shared")
        message = consumer.receive(timeout_s=10)
        consumer.acknowledge(message)
"""

from __future__ import annotations

from typing import Any

import trio

from broker.client import client as async_client
from broker.client.consumer import Consumer as AsyncConsumer
from broker.client.messages import Message, MessageId, SendResult
from broker.client.producer import Producer as AsyncProducer
from ledger_client.sync import LoopThread


class Producer:
    def __init__(self, loop: LoopThread, producer: AsyncProducer) -> None:
        self._loop = loop
        self._producer = producer

    @property
    def producer_id(self) -> str:
        return self._producer.producer_id

    @property
    def last_sequence_id(self) -> int:
        return self._producer.last_sequence_id

    def send(self, data: bytes, **options: Any) -> MessageId:
        """Send and wait until persisted (options: key, properties, sequence_id, partition)."""
        return self._loop.call(self._producer.send, data, **options)

    def send_many(self, messages: list[bytes], **options: Any) -> list[SendResult]:
        """Send many messages pipelined (the same options for each); wait for all."""
        async def send_all() -> list[SendResult]:
            futures = [await self._producer.send_async(data, **options) for data in messages]
            return [await future.wait() for future in futures]

        return self._loop.call(send_all)

    def flush(self) -> None:
        self._loop.call(self._producer.flush)

    def close(self) -> None:
        self._loop.call(self._producer.close)


class Consumer:
    def __init__(self, loop: LoopThread, consumer: AsyncConsumer) -> None:
        self._loop = loop
        self._consumer = consumer

    def receive(self, timeout_s: float | None = None) -> Message | None:
        """The next message; None if none came within `timeout_s` (None: wait for ever)."""
        async def receive() -> Message | None:
            if timeout_s is None:
                return await self._consumer.receive()
            with trio.move_on_after(timeout_s):
                return await self._consumer.receive()
            return None

        return self._loop.call(receive)

    def acknowledge(self, message: Message) -> None:
        self._loop.call(self._consumer.acknowledge, message)

    def acknowledge_cumulative(self, message: Message) -> None:
        self._loop.call(self._consumer.acknowledge_cumulative, message)

    def negative_acknowledge(self, message: Message) -> None:
        self._loop.call_sync(self._consumer.negative_acknowledge, message)

    def seek(self, **target: Any) -> None:
        """offset=..., message_id=... or publish_time_ms=..."""
        self._loop.call(self._consumer.seek, **target)

    def unsubscribe(self) -> None:
        self._loop.call(self._consumer.unsubscribe)

    def close(self) -> None:
        self._loop.call(self._consumer.close)


class Client:
    def __init__(self, loop: LoopThread) -> None:
        self._loop = loop
        self._client: async_client.Client = loop.value

    @classmethod
    def connect(cls, zk_hosts: str = "127.0.0.1:2181", root: str = "/quire", **options: Any) -> "Client":
        return cls(LoopThread(lambda: async_client.Client.connect(zk_hosts, root, **options)))

    def create_producer(self, topic: str, producer_id: str | None = None, **options: Any) -> Producer:
        return Producer(self._loop, self._loop.call(self._client.create_producer, topic, producer_id, **options))

    def subscribe(self, topic: str, subscription: str, subscription_type: str = "exclusive", **options: Any) -> Consumer:
        return Consumer(self._loop, self._loop.call(self._client.subscribe, topic, subscription, subscription_type, **options))

    def create_reader(self, topic: str, **options: Any) -> Consumer:
        return Consumer(self._loop, self._loop.call(self._client.create_reader, topic, **options))

    def create_topic(self, topic: str, partitions: int = 0, **policies: Any) -> dict:
        return self._loop.call(self._client.create_topic, topic, partitions, **policies)

    def set_policies(self, topic: str, **policies: Any) -> dict:
        return self._loop.call(self._client.set_policies, topic, **policies)

    def list_topics(self) -> list[dict]:
        return self._loop.call(self._client.list_topics)

    def topic_stats(self, topic: str) -> dict:
        return self._loop.call(self._client.topic_stats, topic)

    def delete_topic(self, topic: str, *, force: bool = False) -> None:
        self._loop.call(self._client.delete_topic, topic, force=force)

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["Client", "Consumer", "Producer"]
