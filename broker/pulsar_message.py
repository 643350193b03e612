"""Pulsar's layout of a message as producers send it, brokers store it and
consumers receive it (what Pulsar calls "headers and payload"):

    [magic 0x0e01][CRC32C, u32][metadata size, u32][MessageMetadata][payload]

The checksum covers everything after it. The payload is compressed with
the metadata's codec; when the metadata says `num_messages_in_batch`, the
decompressed payload is a batch, each message as

    [size, u32][SingleMessageMetadata][payload of payload_size bytes]

Pure code: reading (`parse_message`, `read_batch`) checks everything
against what the bytes declare and raises MalformedMessageError; writing
(`build_message`, `build_batch`) is for quire's producers and tests.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import crc32c
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from broker.codecs import Codec, CodecError, compress, decompress
from broker.pulsar.pulsar_api_pb2 import KeyValue, MessageMetadata, SingleMessageMetadata

MAGIC_CRC32C = 0x0E01
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
SIZE_PREFIX = _U32  # the u32 before a metadata block (big-endian, as all of Pulsar's sizes)
_CHECKSUM_HEADER = struct.Struct(">HI")  # magic, CRC32C
# A metadata block (the producer's, or one message's in a batch) is at most
# this big: Pulsar's clients write a few hundred bytes at most.
METADATA_BYTES_MAX = 1024 * 1024
_COMPRESSION_FIELD_NUMBER = MessageMetadata.DESCRIPTOR.fields_by_name["compression"].number


class MalformedMessageError(Exception):
    """Bytes that are not a message in Pulsar's layout, or a payload that
    does not hold what its metadata declares."""


class ChecksumError(MalformedMessageError):
    """The CRC32C does not match: corrupted on the way."""


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    metadata: MessageMetadata
    payload: memoryview  # still compressed
    checksummed: bool  # the message carried a CRC32C (and it matched)

    @property
    def batched(self) -> bool:
        return self.metadata.HasField("num_messages_in_batch")

    @property
    def message_count(self) -> int:
        return self.metadata.num_messages_in_batch if self.batched else 1


@dataclass(frozen=True, slots=True)
class SingleMessage:
    """One message of a batch (or the one message of a message that is not)."""

    metadata: SingleMessageMetadata | None  # None: not a batch (the MessageMetadata says it all)
    payload: bytes


def parse_message(data: bytes | memoryview, *, verify_checksum: bool = True) -> ParsedMessage:
    view = memoryview(data)
    checksummed = False
    if len(view) >= 2 and _U16.unpack_from(view)[0] == MAGIC_CRC32C:
        if len(view) < _CHECKSUM_HEADER.size + _U32.size:
            raise MalformedMessageError("message is shorter than its checksum header")
        expected = _CHECKSUM_HEADER.unpack_from(view)[1]
        view = view[_CHECKSUM_HEADER.size:]
        if verify_checksum and crc32c.crc32c(view) != expected:
            raise ChecksumError("message checksum does not match (corrupted on the way)")
        checksummed = True
    if len(view) < _U32.size:
        raise MalformedMessageError("message is shorter than its metadata size")
    size = _U32.unpack_from(view)[0]
    if size > METADATA_BYTES_MAX or _U32.size + size > len(view):
        raise MalformedMessageError(f"message metadata of {size} bytes runs past the message")
    metadata = MessageMetadata()
    try:
        metadata.ParseFromString(view[_U32.size:_U32.size + size])
    except DecodeError as error:
        raise MalformedMessageError(f"message metadata does not decode: {error}") from None
    return ParsedMessage(metadata, view[_U32.size + size:], checksummed)


def codec_of(metadata: MessageMetadata) -> Codec:
    # protobuf keeps a compression type its enum does not know (a codec of
    # a newer Pulsar) among the unknown fields and reads the field as NONE:
    # such a payload is not uncompressed.
    for field in UnknownFieldSet(metadata):
        if field.field_number == _COMPRESSION_FIELD_NUMBER:
            raise MalformedMessageError(f"unknown compression type {field.data!r:.40}")
    try:
        return Codec.from_wire(metadata.compression)
    except CodecError as error:
        raise MalformedMessageError(str(error)) from None


def uncompressed_payload(message: ParsedMessage, bytes_max: int) -> bytes:
    """The payload decompressed: exactly the size the metadata declares,
    at most `bytes_max`."""
    metadata = message.metadata
    codec = codec_of(metadata)
    if codec is Codec.NONE:
        if len(message.payload) > bytes_max:
            raise MalformedMessageError(f"payload of {len(message.payload)} bytes is past {bytes_max}")
        return bytes(message.payload)
    size = metadata.uncompressed_size
    if size > bytes_max:
        raise MalformedMessageError(f"payload declares {size} bytes uncompressed, past {bytes_max}")
    try:
        return decompress(codec, message.payload, size)
    except CodecError as error:
        raise MalformedMessageError(f"payload: {error}") from None


def read_batch(message: ParsedMessage, bytes_max: int) -> list[SingleMessage]:
    """Every message of `message`: the messages of a batch, or the message
    itself (decompressed)."""
    raw = uncompressed_payload(message, bytes_max)
    if not message.batched:
        return [SingleMessage(None, raw)]
    return split_batch(raw, message.metadata.num_messages_in_batch)


def split_batch(raw: bytes, count: int) -> list[SingleMessage]:
    """A decompressed batch payload as its `count` messages; nothing may follow them."""
    return list(iterate_batch(raw, count))


def iterate_batch(raw: bytes, count: int) -> Iterator[SingleMessage]:
    """The messages of a decompressed batch payload one by one, as
    `split_batch` gives them, raising MalformedMessageError where the
    payload goes wrong. A reader that keeps only what it needs of each
    message holds one message's metadata at a time: decoded, a metadata
    block of empty properties takes some 30 times its size, and a batch
    may hold megabytes of them."""
    for metadata, start, end in walk_batch(raw, count):
        yield SingleMessage(metadata, raw[start:end])


def walk_batch(raw: bytes, count: int) -> Iterator[tuple[SingleMessageMetadata, int, int]]:
    """`iterate_batch` for the hot paths (the broker's check of every batch,
    a consumer's decoding): each message's metadata and where its payload
    lies in `raw`, without copying the payload or wrapping the two (a
    third of the cost per message)."""
    if count < 1:
        raise MalformedMessageError(f"a batch of {count} messages")
    if count * _U32.size > len(raw):
        raise MalformedMessageError(f"a payload of {len(raw)} bytes cannot hold {count} messages")
    view = memoryview(raw)
    position = 0
    unpack_size = _U32.unpack_from
    parse = SingleMessageMetadata.FromString
    end = len(raw)
    for index in range(count):
        if position + _U32.size > end:
            raise MalformedMessageError(f"the batch ends before message {index}")
        size = unpack_size(view, position)[0]
        position += _U32.size
        if size > METADATA_BYTES_MAX or position + size > end:
            raise MalformedMessageError(f"message {index}: its metadata of {size} bytes runs past the batch")
        try:
            metadata = parse(view[position:position + size])
        except DecodeError as error:
            raise MalformedMessageError(f"message {index}: its metadata does not decode: {error}") from None
        position += size
        payload_size = metadata.payload_size
        if payload_size < 0 or position + payload_size > end:
            raise MalformedMessageError(f"message {index}: its payload of {payload_size} bytes runs past the batch")
        yield metadata, position, position + payload_size
        position += payload_size
    if position != end:
        raise MalformedMessageError(f"{end - position} bytes follow the batch's last message")


# --- writing -------------------------------------------------------------------------------


def frame_message(metadata: MessageMetadata, payload: bytes) -> bytes:
    """[magic][CRC32C][size][metadata][payload]."""
    packed = metadata.SerializeToString()
    body = b"".join((_U32.pack(len(packed)), packed, payload))
    return _CHECKSUM_HEADER.pack(MAGIC_CRC32C, crc32c.crc32c(body)) + body


@dataclass(frozen=True, slots=True)
class OutMessage:
    """A message as a producer hands it over."""

    sequence_id: int
    payload: bytes
    key: str | None = None
    properties: dict[str, str] | None = None
    event_time_ms: int = 0
    deliver_at_ms: int = 0  # Pulsar's deliver_at_time; such a message travels in a batch of its own


def _properties(pairs: dict[str, str] | None) -> list[KeyValue]:
    return [KeyValue(key=key, value=value) for key, value in (pairs or {}).items()]


def build_batch(producer_name: str, publish_time_ms: int, messages: Sequence[OutMessage], codec: Codec, *,
                batched: bool = True) -> bytes:
    """A producer's batch in Pulsar's layout, as Pulsar's clients build one:
    the first message's sequence id and the last one's as the highest, each
    message's key, properties, event time and sequence id in its own
    metadata, the payload compressed with `codec`. With `batched` False, a
    single message is sent as Pulsar's clients send a message without
    batching (its metadata is the message's)."""
    assert messages, "a batch holds at least one message"
    first, last = messages[0], messages[-1]
    metadata = MessageMetadata(producer_name=producer_name, sequence_id=first.sequence_id, publish_time=publish_time_ms)
    deliver_at_ms = getattr(first, "deliver_at_ms", 0)
    if deliver_at_ms:
        assert len(messages) == 1, "a message with a delivery time travels alone"
        metadata.deliver_at_time = deliver_at_ms
    if not batched:
        assert len(messages) == 1, "only one message goes without a batch"
        if first.key is not None:
            metadata.partition_key = first.key
        metadata.properties.extend(_properties(first.properties))
        if first.event_time_ms:
            metadata.event_time = first.event_time_ms
        raw = first.payload
    else:
        metadata.num_messages_in_batch = len(messages)
        metadata.highest_sequence_id = last.sequence_id
        keys = {message.key for message in messages}
        if len(keys) == 1 and first.key is not None:
            metadata.partition_key = first.key  # one key for the batch, as key-based batching writes
        parts = []
        append = parts.append
        pack_size = _U32.pack
        # One metadata object for the batch, cleared only after a message
        # that set more than its size and sequence id: making one per
        # message costs as much again (a producer's hot path).
        single = SingleMessageMetadata()
        extras = False
        for message in messages:
            if extras:
                single.Clear()
                extras = False
            single.payload_size = len(message.payload)
            single.sequence_id = message.sequence_id
            if message.key is not None:
                single.partition_key = message.key
                extras = True
            if message.properties:
                single.properties.extend(_properties(message.properties))
                extras = True
            if message.event_time_ms:
                single.event_time = message.event_time_ms
                extras = True
            packed = single.SerializeToString()
            append(pack_size(len(packed)))
            append(packed)
            append(message.payload)
        raw = b"".join(parts)
    if codec is not Codec.NONE:
        metadata.compression = codec.wire_number
        metadata.uncompressed_size = len(raw)
    return frame_message(metadata, compress(codec, raw))


def build_chunks(producer_name: str, publish_time_ms: int, message: OutMessage, codec: Codec, chunk_bytes: int,
                 uuid: str) -> list[bytes]:
    """A message too large for one send, as Pulsar's producers cut it with
    chunking on: its payload compressed whole, then cut into chunks of at
    most `chunk_bytes`, each a message of its own with the message's
    metadata, its sequence id, and its place (`uuid`, `chunk_id`,
    `num_chunks_from_msg`, `total_chunk_msg_size`)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    metadata = MessageMetadata(producer_name=producer_name, sequence_id=message.sequence_id, publish_time=publish_time_ms)
    if message.key is not None:
        metadata.partition_key = message.key
    metadata.properties.extend(_properties(message.properties))
    if message.event_time_ms:
        metadata.event_time = message.event_time_ms
    payload = compress(codec, message.payload)
    if codec is not Codec.NONE:
        metadata.compression = codec.wire_number
        metadata.uncompressed_size = len(message.payload)
    count = max(1, -(-len(payload) // chunk_bytes))
    metadata.uuid = uuid
    metadata.num_chunks_from_msg = count
    metadata.total_chunk_msg_size = len(payload)
    chunks = []
    for chunk_id in range(count):
        metadata.chunk_id = chunk_id
        chunks.append(frame_message(metadata, payload[chunk_id * chunk_bytes:(chunk_id + 1) * chunk_bytes]))
    return chunks


def properties_of(pairs: Iterable[KeyValue]) -> dict[str, str]:
    return {pair.key: pair.value for pair in pairs}


__all__ = [
    "ChecksumError",
    "MAGIC_CRC32C",
    "METADATA_BYTES_MAX",
    "SIZE_PREFIX",
    "MalformedMessageError",
    "build_chunks",
    "OutMessage",
    "ParsedMessage",
    "SingleMessage",
    "build_batch",
    "codec_of",
    "frame_message",
    "iterate_batch",
    "parse_message",
    "properties_of",
    "read_batch",
    "split_batch",
    "uncompressed_payload",
    "walk_batch",
]
