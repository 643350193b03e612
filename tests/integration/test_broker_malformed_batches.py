"""A broker refuses a batch it cannot store faithfully, against real
processes (3 bookies and a broker): garbage compressed bodies, counts and
sequence ids that do not match the body. The producer that sent it gets a
BAD_REQUEST receipt saying why; nothing is stored, offsets and stats count
real messages only, and that producer and the others go on."""

from __future__ import annotations

import os

import pytest
import trio

import broker.client.producer as producer_module
from broker.client import Client
from broker.errors import BadRequestError, BrokerStatus
from broker.message_format import Codec, compress, encode_body
from broker.protocol import PROTOCOL_VERSION, Connect, ProducerOpen, Response, Send, SendReceipt, decode, encode
from framing.codec import FrameDecoder
from framing.stream import receive_first_frames
from tests.integration.broker_processes import shared_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

TOPIC = "malformed"


def client_of(cluster):
    return Client.connect(cluster.zk_hosts, cluster.root)


class RawProducer:
    """A producer speaking the protocol itself, to send what no client builds."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder(1 << 20)
        self.handle = 7

    @classmethod
    async def open(cls, address: str, producer_id: str) -> "RawProducer":
        host, _, port = address.rpartition(":")
        producer = cls(await trio.open_tcp_stream(host, int(port)))
        await producer.stream.send_all(encode(Connect(PROTOCOL_VERSION, "raw")))
        await receive_first_frames(producer.stream, producer.decoder)
        await producer.stream.send_all(encode(ProducerOpen(1, producer.handle, TOPIC, producer_id)))
        response = await producer.next_answer()
        assert isinstance(response, Response) and response.status == 0, response
        return producer

    async def next_answer(self):
        with trio.fail_after(20):
            while True:
                for fields in self.decoder.frames():
                    return decode(fields)
                data = await self.stream.receive_some(65536)
                assert data, "the broker closed the connection"
                self.decoder.feed(data)

    async def send(self, first_sequence_id: int, last_sequence_id: int, count: int, codec: str, keys, body: bytes) -> SendReceipt:
        await self.stream.send_all(encode(Send(self.handle, first_sequence_id, last_sequence_id, count, 0, codec, keys, body)))
        receipt = await self.next_answer()
        assert isinstance(receipt, SendReceipt) and receipt.last_sequence_id == last_sequence_id, receipt
        return receipt


async def offset_of(producer, data: bytes) -> int:
    """Send and wait; the message's partition offset."""
    return (await (await producer.send_async(data)).wait()).offset


def messages_from(first: int, count: int, label: str) -> list:
    return [(first + index, 1_700_000_000_000, {"from": label}, f"{label}-{first + index}".encode()) for index in range(count)]


def bad_batches(next_id: int) -> list[tuple[str, tuple, str]]:
    """(what, Send fields after the handle, what the refusal says), each
    numbered from `next_id`, so that a stored one would take that id."""
    ten = messages_from(next_id, 10, "bad")
    good_zstd = compress(Codec.ZSTD, encode_body(ten, Codec.NONE))
    last = next_id + 9
    return [
        ("garbage zstd", (next_id, last, 10, "zstd", None, b"garbage" + os.urandom(500)), "zstd body has no valid frame header"),
        ("garbage lz4", (next_id, last, 10, "lz4", None, b"garbage" + os.urandom(500)), "lz4 body has no valid frame header"),
        ("garbage gzip", (next_id, last, 10, "gzip", None, b"garbage" + os.urandom(500)), "gzip body is not a gzip member"),
        ("zstd magic then garbage", (next_id, last, 10, "zstd", None, b"\x28\xb5\x2f\xfd" + os.urandom(500)), "zstd body"),
        ("truncated zstd", (next_id, last, 10, "zstd", None, good_zstd[:-5]), "zstd body does not decompress"),
        ("gzip with bytes after it", (next_id, last, 10, "gzip", None, compress(Codec.GZIP, encode_body(ten, Codec.NONE)) + b"\0"),
         "bytes after its member"),
        # The finding: 100,000 messages declared, a 1-byte body.
        ("100,000 messages in 1 byte", (next_id, next_id + 99_999, 100_000, "none", None, b"x"),
         "a body of 1 bytes cannot hold 100000 messages"),
        ("100,000 messages under one sequence id", (next_id, next_id, 100_000, "none", None, b"x"), "cannot number 100000 messages"),
        ("one message more than the body", (next_id, last + 1, 11, "zstd", None, good_zstd), "the body holds 10 messages, the batch says 11"),
        ("one message less than the body", (next_id, last - 1, 9, "none", None, encode_body(ten, Codec.NONE)),
         "the body holds 10 messages, the batch says 9"),
        ("a last sequence id the body does not have", (next_id, last + 5, 10, "none", None, encode_body(ten, Codec.NONE)),
         "the last message's sequence id"),
        ("keys for fewer messages", (next_id, last, 10, "none", ["k"] * 9, encode_body(ten, Codec.NONE)), "9 keys for 10 messages"),
        ("an unknown codec", (next_id, last, 10, "snappy", None, encode_body(ten, Codec.NONE)), "unknown codec 'snappy'"),
        ("a payload that is text", (next_id, next_id, 1, "none", None, b"\x91\x94" + bytes([next_id]) + b"\x00\xc0\xa5hello"),
         "its payload is not binary"),
    ]


async def test_malformed_batches_are_refused_and_nothing_else_changes(shared_cluster):
    async with client_of(shared_cluster) as client:
        await client.create_topic(TOPIC)  # deduplication on, as by default
        other = await client.create_producer(TOPIC, "other-producer")
        stored = [await offset_of(other, b"other-before")]
        raw = await RawProducer.open(await client.lookup(TOPIC), "raw-producer")
        next_id = 0
        expected = [b"other-before"]
        for index in range(len(bad_batches(0))):
            what, fields, says = bad_batches(next_id)[index]
            receipt = await raw.send(*fields)
            assert receipt.status == BrokerStatus.BAD_REQUEST, f"{what}: {receipt}"
            assert receipt.message.startswith("malformed batch: ") and says in receipt.message, f"{what}: {receipt.message}"
            assert receipt.first_offset == -1 and receipt.ledger_id == -1, what
            # The same producer goes on with the ids the refused batch
            # claimed (nothing of it was stored, deduplication included);
            # so does another producer.
            good = messages_from(next_id, 3, "raw")
            receipt = await raw.send(next_id, next_id + 2, 3, "zstd", None, encode_body(good, Codec.ZSTD))
            assert receipt.status == BrokerStatus.OK, f"after {what}: {receipt}"
            assert receipt.first_offset == stored[-1] + 1, f"offsets after {what}"
            stored.append(receipt.first_offset + 2)
            expected.extend(payload for *_, payload in good)
            next_id += 3
            stored.append(await offset_of(other, f"other-after-{what}".encode()))
            expected.append(f"other-after-{what}".encode())
        await raw.stream.aclose()

        # Offsets count the stored messages only, and a reader reads them all.
        stats = (await client.topic_stats(TOPIC))["partitions"][TOPIC]
        assert stats["next_offset"] == len(expected) == stored[-1] + 1
        assert stats["messages_in"] == len(expected)
        reader = await client.create_reader(TOPIC, start="earliest")
        got = []
        with trio.fail_after(30):
            while len(got) < len(expected):
                message = await reader.receive()
                assert message.offset == len(got), "offsets have no holes"
                got.append(message.data)
        assert got == expected


async def test_a_client_producer_sees_the_refusal_and_goes_on(shared_cluster, monkeypatch):
    # A client whose body encoder is broken (here: it loses the last
    # message): the send fails with the broker's reason; the next one,
    # built right, is stored at the next offset.
    async with client_of(shared_cluster) as client:
        producer = await client.create_producer("malformed-client", "client-producer", batching=True, batch_delay_ms=50)
        first = await offset_of(producer, b"first")
        real_encode_body = producer_module.encode_body
        monkeypatch.setattr(producer_module, "encode_body", lambda messages, codec: real_encode_body(list(messages)[:-1], codec))
        futures = [await producer.send_async(f"lost-{n}".encode()) for n in range(3)]
        for future in futures:
            with pytest.raises(BadRequestError, match="malformed batch: the body holds 2 messages, the batch says 3"):
                await future.wait()
        monkeypatch.setattr(producer_module, "encode_body", real_encode_body)
        assert await offset_of(producer, b"after") == first + 1
        stats = (await client.topic_stats("malformed-client"))["partitions"]["malformed-client"]
        assert stats["next_offset"] == 2 and stats["messages_in"] == 2
