"""A broker refuses a batch it cannot store faithfully, against real
processes (3 bookies and a broker). A raw producer speaking quire's protocol
sends batches in Pulsar's layout (`broker/pulsar_message.py`) whose bytes do
not hold what they declare: compressed payloads of each codec that do not
decompress, are truncated, have bytes after them or another size than
declared; counts and sequence ids that do not match the batch; bytes after a
batch's last message; an unknown codec; another producer's metadata; a
corrupted message; what quire does not do (encryption, transactions, chunks,
markers). The producer gets a receipt whose status and message say why
(BAD_REQUEST "malformed batch: ...", CHECKSUM, NOT_ALLOWED); nothing of the
batch is stored, deduplication included: offsets and stats count stored
messages only, and that producer and the others go on. A client producer
whose batch builder is broken sees the broker's refusal for exactly the
messages of that batch."""

from __future__ import annotations

import struct

import crc32c
import pytest
import trio
import zstandard

import broker.client.producer as producer_module
from broker.client import Client
from broker.codecs import Codec, compress
from broker.errors import BadRequestError, BrokerStatus
from broker.message_format import BODY_BYTES_MAX
from broker.protocol import PROTOCOL_VERSION, Connect, ProducerOpen, Response, Send, SendReceipt, decode, encode
from broker.pulsar.pulsar_api_pb2 import MessageMetadata
from broker.pulsar_message import MAGIC_CRC32C, OutMessage, build_batch, frame_message, parse_message
from framing.codec import FrameDecoder
from framing.stream import receive_first_frames
from tests.integration.broker_processes import shared_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

TOPIC = "malformed"
RAW_PRODUCER = "raw-producer"
PUBLISH_TIME_MS = 1_700_000_000_000
GARBAGE = b"garbage " * 64
COMPRESSION_FIELD = MessageMetadata.DESCRIPTOR.fields_by_name["compression"].number


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
        await producer.stream.send_all(encode(Connect(PROTOCOL_VERSION, "raw", "", b"")))
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

    async def send(self, first_sequence_id: int, last_sequence_id: int, count: int, body: bytes) -> SendReceipt:
        await self.stream.send_all(encode(Send(self.handle, first_sequence_id, last_sequence_id, count, body)))
        receipt = await self.next_answer()
        assert isinstance(receipt, SendReceipt) and receipt.last_sequence_id == last_sequence_id, receipt
        return receipt


async def offset_of(producer, data: bytes) -> int:
    """Send and wait; the message's partition offset."""
    return (await (await producer.send_async(data)).wait()).offset


def messages_from(first: int, count: int, label: str) -> list[OutMessage]:
    return [OutMessage(first + index, f"{label}-{first + index}".encode(), properties={"from": label})
            for index in range(count)]


def batch_of(messages: list[OutMessage], codec: Codec = Codec.NONE, producer: str = RAW_PRODUCER) -> bytes:
    return build_batch(producer, PUBLISH_TIME_MS, messages, codec)


def changed(metadata: MessageMetadata, **fields) -> MessageMetadata:
    copy = MessageMetadata()
    copy.CopyFrom(metadata)
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy


def without_highest(metadata: MessageMetadata) -> MessageMetadata:
    copy = changed(metadata)
    copy.ClearField("highest_sequence_id")
    return copy


def encrypted(metadata: MessageMetadata) -> MessageMetadata:
    copy = changed(metadata)
    copy.encryption_keys.add(key="the-key", value=b"\x01" * 16)
    return copy


def compressed(metadata: MessageMetadata, codec: Codec, payload: bytes, declared_size: int) -> bytes:
    """A message whose metadata says `codec` and `declared_size` bytes
    uncompressed, around `payload` as it is (its checksum right)."""
    return frame_message(changed(metadata, compression=codec.wire_number, uncompressed_size=declared_size), payload)


def framed(packed_metadata: bytes, payload: bytes) -> bytes:
    """Pulsar's layout around metadata bytes no MessageMetadata would write."""
    rest = struct.pack(">I", len(packed_metadata)) + packed_metadata + payload
    return struct.pack(">HI", MAGIC_CRC32C, crc32c.crc32c(rest)) + rest


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def bad_batches(next_id: int) -> list[tuple[str, tuple[int, int, int, bytes], BrokerStatus, str]]:
    """(what, Send fields after the handle, the status of the refusal, what
    its message says), each numbered from `next_id`, so that a stored one
    would take that id (and deduplication would drop a later one there)."""
    n, last = next_id, next_id + 9
    ten = messages_from(n, 10, "bad")
    good = batch_of(ten)
    parsed = parse_message(good)
    metadata, raw = parsed.metadata, bytes(parsed.payload)
    size = len(raw)
    good_zstd, good_zlib = compress(Codec.ZSTD, raw), compress(Codec.ZLIB, raw)
    zstd_header = good_zstd[:zstandard.frame_header_size(good_zstd)]
    repeated = ten[:3] + [OutMessage(n + 2, b"again")] + ten[4:]
    falling = ten[:5] + [OutMessage(n + 1, b"back")] + ten[6:]
    past_last = parse_message(batch_of(ten[:9] + [OutMessage(last + 1, b"past")]))
    flipped = bytearray(batch_of(ten, Codec.ZSTD))
    flipped[-1] ^= 0x01
    huge = MessageMetadata(producer_name=RAW_PRODUCER, sequence_id=n, publish_time=PUBLISH_TIME_MS,
                           num_messages_in_batch=100_000, highest_sequence_id=n + 99_999)
    bad = BrokerStatus.BAD_REQUEST
    return [
        # Compressed payloads that are not what their codec writes.
        ("garbage lz4", (n, last, 10, compressed(metadata, Codec.LZ4, GARBAGE, size)), bad,
         "payload: lz4 data does not decompress"),
        ("garbage zlib", (n, last, 10, compressed(metadata, Codec.ZLIB, GARBAGE, size)), bad,
         "payload: zlib data does not decompress"),
        ("garbage zstd", (n, last, 10, compressed(metadata, Codec.ZSTD, GARBAGE, size)), bad,
         "payload: zstd data does not decompress"),
        ("garbage snappy behind the right length", (n, last, 10, compressed(metadata, Codec.SNAPPY, varint(size) + GARBAGE, size)),
         bad, "payload: snappy data does not decompress"),
        ("garbage behind a right zstd frame header", (n, last, 10, compressed(metadata, Codec.ZSTD, zstd_header + GARBAGE, size)),
         bad, "payload: zstd data does not decompress"),
        ("truncated zstd", (n, last, 10, compressed(metadata, Codec.ZSTD, good_zstd[:-5], size)), bad,
         "payload: zstd data does not decompress"),
        ("truncated zlib", (n, last, 10, compressed(metadata, Codec.ZLIB, good_zlib[:-5], size)), bad,
         "payload: zlib data is a truncated stream"),
        ("zlib with bytes after its stream", (n, last, 10, compressed(metadata, Codec.ZLIB, good_zlib + b"\0", size)), bad,
         "payload: zlib data has 1 bytes after its stream"),
        ("zstd with bytes after its frame", (n, last, 10, compressed(metadata, Codec.ZSTD, good_zstd + b"\0", size)), bad,
         "payload: zstd data does not decompress"),
        # Uncompressed sizes the payload does not have.
        ("zstd declaring one byte more than its frame", (n, last, 10, compressed(metadata, Codec.ZSTD, good_zstd, size + 1)),
         bad, f"payload: zstd frame declares {size} bytes, the metadata {size + 1}"),
        ("zlib declaring one byte more", (n, last, 10, compressed(metadata, Codec.ZLIB, good_zlib, size + 1)), bad,
         f"payload: zlib data decompresses to {size} bytes, {size + 1} were declared"),
        ("zlib declaring one byte less", (n, last, 10, compressed(metadata, Codec.ZLIB, good_zlib, size - 1)), bad,
         f"payload: zlib data decompresses past the {size - 1} bytes declared"),
        ("lz4 declaring one byte more", (n, last, 10, compressed(metadata, Codec.LZ4, compress(Codec.LZ4, raw), size + 1)), bad,
         f"payload: lz4 data decompresses to {size} bytes, {size + 1} were declared"),
        ("snappy declaring one byte more", (n, last, 10, compressed(metadata, Codec.SNAPPY, compress(Codec.SNAPPY, raw), size + 1)),
         bad, f"payload: snappy block declares {size} bytes, the metadata {size + 1}"),
        ("an uncompressed size past what a batch holds", (n, last, 10, compressed(metadata, Codec.ZSTD, good_zstd, 1 << 30)), bad,
         f"payload declares {1 << 30} bytes uncompressed, past {BODY_BYTES_MAX}"),
        # The finding: 100,000 messages declared, a 1-byte body.
        ("100,000 messages in 1 byte", (n, n + 99_999, 100_000, frame_message(huge, b"x")), bad,
         "a payload of 1 bytes cannot hold 100000 messages"),
        ("100,000 messages under one sequence id", (n, n, 100_000, frame_message(without_highest(huge), b"x")),
         bad, f"sequence ids {n}..{n} cannot number 100000 messages"),
        # Counts and sequence ids the batch does not have.
        ("one message more than the batch", (n, last + 1, 11, batch_of(ten, Codec.ZSTD)), bad,
         "it holds 10 messages, its sender says 11"),
        ("one message less than the batch", (n, last - 1, 9, good), bad, "it holds 10 messages, its sender says 9"),
        ("a first sequence id the batch does not have", (n + 1, last, 10, good), bad,
         f"its first sequence id is {n}, its sender says {n + 1}"),
        ("a last sequence id the batch does not have", (n, last + 5, 10, good), bad,
         f"its last sequence id is {last}, its sender says {last + 5}"),
        ("a sequence id twice", (n, last, 10, batch_of(repeated)), bad,
         f"message 3: sequence id {n + 2} is not above {n + 2} and at most {last}"),
        ("a sequence id going back", (n, last, 10, batch_of(falling, Codec.ZSTD)), bad,
         f"message 5: sequence id {n + 1} is not above {n + 4} and at most {last}"),
        ("a sequence id past the batch's last",
         (n, last, 10, frame_message(changed(past_last.metadata, highest_sequence_id=last), bytes(past_last.payload))), bad,
         f"message 9: sequence id {last + 1} is not above {last - 1} and at most {last}"),
        # Bytes after the last message, an unknown codec, another producer's message.
        ("a byte after the batch's last message", (n, last, 10, frame_message(metadata, raw + b"\0")), bad,
         "1 bytes follow the batch's last message"),
        ("a compressed byte after the batch's last message",
         (n, last, 10, compressed(metadata, Codec.ZSTD, compress(Codec.ZSTD, raw + b"\0"), size + 1)), bad,
         "1 bytes follow the batch's last message"),
        ("an unknown compression number", (n, last, 10, framed(metadata.SerializeToString() + bytes([COMPRESSION_FIELD << 3, 9]), raw)),
         bad, "unknown compression type 9"),
        ("another producer's message", (n, last, 10, batch_of(ten, producer="someone-else")), bad,
         "written by producer 'someone-else', sent by 'raw-producer'"),
        ("bytes that are no message", (n, last, 10, GARBAGE), bad, "message metadata of "),
        # Corrupted on the way.
        ("a flipped byte", (n, last, 10, bytes(flipped)), BrokerStatus.CHECKSUM,
         "checksum error: message checksum does not match (corrupted on the way)"),
        # What quire does not do.
        ("an encrypted message", (n, last, 10, frame_message(encrypted(metadata), raw)), BrokerStatus.NOT_ALLOWED,
         "encrypted messages are not supported by quire brokers"),
        ("a message of a transaction", (n, last, 10, frame_message(changed(metadata, txnid_most_bits=1, txnid_least_bits=7), raw)),
         BrokerStatus.NOT_ALLOWED, "transactions are not supported by quire brokers"),
        ("a batch that says it is a chunk", (n, last, 10, frame_message(changed(metadata, num_chunks_from_msg=2, chunk_id=0), raw)),
         bad, "a chunk of a chunked message cannot be in a batch"),
        ("a marker", (n, last, 10, frame_message(changed(metadata, marker_type=1), raw)), BrokerStatus.NOT_ALLOWED,
         "marker messages are not supported by quire brokers"),
    ]


async def test_malformed_batches_are_refused_and_nothing_else_changes(shared_cluster):
    async with client_of(shared_cluster) as client:
        await client.create_topic(TOPIC)  # deduplication on, as by default
        other = await client.create_producer(TOPIC, "other-producer")
        stored = [await offset_of(other, b"other-before")]
        raw = await RawProducer.open(await client.lookup(TOPIC), RAW_PRODUCER)
        next_id = 0
        expected = [b"other-before"]
        codecs = list(Codec)
        cases = len(bad_batches(0))
        for index in range(cases):
            what, fields, status, says = bad_batches(next_id)[index]
            receipt = await raw.send(*fields)
            assert receipt.status == status, f"{what}: {receipt}"
            if status == BrokerStatus.BAD_REQUEST:
                assert receipt.message.startswith("malformed batch: "), f"{what}: {receipt.message}"
            assert says in receipt.message, f"{what}: {receipt.message}"
            assert receipt.first_offset == -1 and receipt.ledger_id == -1 and receipt.entry_id == -1, what
            # The same producer goes on with the ids the refused batch
            # claimed (nothing of it was stored, deduplication included),
            # in a batch of each codec in turn; so does another producer.
            good = messages_from(next_id, 3, "raw")
            receipt = await raw.send(next_id, next_id + 2, 3, batch_of(good, codecs[index % len(codecs)]))
            assert receipt.status == BrokerStatus.OK, f"after {what}: {receipt}"
            assert receipt.first_offset == stored[-1] + 1, f"offsets after {what}"
            stored.append(receipt.first_offset + 2)
            expected.extend(message.payload for message in good)
            next_id += 3
            stored.append(await offset_of(other, f"other-after-{what}".encode()))
            expected.append(f"other-after-{what}".encode())

        # Offsets count the stored messages only, the raw producer's last
        # sequence id is its last stored one, and a reader reads them all.
        stats = (await client.topic_stats(TOPIC))["partitions"][TOPIC]
        assert stats["next_offset"] == len(expected) == stored[-1] + 1
        assert stats["messages_in"] == len(expected)
        by_producer = {producer["producer_id"]: producer for producer in stats["producers"]}
        assert by_producer[RAW_PRODUCER]["messages_in"] == 3 * cases
        assert by_producer[RAW_PRODUCER]["last_sequence_id"] == next_id - 1
        await raw.stream.aclose()
        reader = await client.create_reader(TOPIC, start="earliest")
        got = []
        with trio.fail_after(30):
            while len(got) < len(expected):
                message = await reader.receive()
                assert message.offset == len(got), "offsets have no holes"
                got.append(message.data)
        assert got == expected


async def test_a_client_producer_sees_the_refusal_and_goes_on(shared_cluster, monkeypatch):
    # A client whose batch builder is broken (here: it loses the last
    # message): the send fails with the broker's reason; the next one,
    # built right, is stored at the next offset.
    async with client_of(shared_cluster) as client:
        producer = await client.create_producer("malformed-client", "client-producer", batching=True, batch_delay_ms=50)
        first = await offset_of(producer, b"first")
        real_build_batch = producer_module.build_batch
        monkeypatch.setattr(producer_module, "build_batch",
                            lambda name, time_ms, messages, codec, **options: real_build_batch(name, time_ms, list(messages)[:-1],
                                                                                              codec, **options))
        futures = [await producer.send_async(f"lost-{n}".encode()) for n in range(3)]
        for future in futures:
            with pytest.raises(BadRequestError, match="^malformed batch: it holds 2 messages, its sender says 3$"):
                await future.wait()
        monkeypatch.setattr(producer_module, "build_batch", real_build_batch)
        assert await offset_of(producer, b"after") == first + 1
        stats = (await client.topic_stats("malformed-client"))["partitions"]["malformed-client"]
        assert stats["next_offset"] == 2 and stats["messages_in"] == 2
