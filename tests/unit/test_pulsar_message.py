"""Pulsar's layout of a message ("headers and payload"): what quire's
producers build parses back as they wrote it, batched or not, with every
codec, and bytes that are not such a message raise MalformedMessageError
(ChecksumError for a checksum that does not match), never anything else."""

from __future__ import annotations

import os
import struct

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.codecs import Codec, compress
from broker.pulsar.pulsar_api_pb2 import MessageMetadata, SingleMessageMetadata
from broker.pulsar_message import (
    MAGIC_CRC32C,
    METADATA_BYTES_MAX,
    ChecksumError,
    MalformedMessageError,
    OutMessage,
    build_batch,
    codec_of,
    frame_message,
    iterate_batch,
    parse_message,
    properties_of,
    read_batch,
    split_batch,
    uncompressed_payload,
)
from tests.support import peak_bytes_of

BOUND = 16 * 1024 * 1024
MESSAGES = [
    OutMessage(7, b"payload one", "account-42", {"kind": "debit", "currency": "EUR"}, 1_600_000_000_000),
    OutMessage(8, b"", None, None, 0),
    OutMessage(9, bytes(range(256)) * 4, "account-7", {}, 1_600_000_000_002),
]


def read_back(message: bytes) -> list[tuple]:
    """(sequence id, key, properties, event time, payload) per message, as a
    Pulsar consumer reads them."""
    parsed = parse_message(message)
    metadata = parsed.metadata
    singles = read_batch(parsed, BOUND)
    if not parsed.batched:
        key = metadata.partition_key if metadata.HasField("partition_key") else None
        return [(metadata.sequence_id, key, properties_of(metadata.properties), metadata.event_time, singles[0].payload)]
    out = []
    sequence_id = metadata.sequence_id - 1
    for single in singles:
        single_metadata = single.metadata
        sequence_id = single_metadata.sequence_id if single_metadata.HasField("sequence_id") else sequence_id + 1
        key = single_metadata.partition_key if single_metadata.HasField("partition_key") else None
        out.append((sequence_id, key, properties_of(single_metadata.properties), single_metadata.event_time, single.payload))
    return out


def written(messages) -> list[tuple]:
    return [(m.sequence_id, m.key, m.properties or {}, m.event_time_ms, m.payload) for m in messages]


# --- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("codec", list(Codec))
def test_a_batch_round_trips_with_every_codec(codec):
    # Keys (one missing), properties (some empty), event times (one unset)
    # and sequence ids come back as written.
    message = build_batch("billing-1", 1_700_000_000_000, MESSAGES, codec)
    parsed = parse_message(message)
    metadata = parsed.metadata
    assert parsed.batched and parsed.message_count == 3 and parsed.checksummed
    assert (metadata.producer_name, metadata.sequence_id, metadata.highest_sequence_id, metadata.publish_time) == (
        "billing-1", 7, 9, 1_700_000_000_000)
    assert codec_of(metadata) is codec
    assert not metadata.HasField("partition_key")  # the keys differ: each message has its own
    assert read_back(message) == written(MESSAGES)


@pytest.mark.parametrize("codec", list(Codec))
def test_a_message_without_batching_round_trips_with_every_codec(codec):
    # As Pulsar's clients send a message when batching is off: its metadata
    # is the message's.
    one = OutMessage(41, b"x" * 500, "account-42", {"kind": "credit"}, 1_600_000_000_000)
    message = build_batch("billing-1", 1_700_000_000_000, [one], codec, batched=False)
    parsed = parse_message(message)
    metadata = parsed.metadata
    assert not parsed.batched and parsed.message_count == 1
    assert metadata.partition_key == "account-42" and not metadata.HasField("highest_sequence_id")
    assert read_back(message) == written([one])
    assert read_batch(parsed, BOUND)[0].metadata is None


def test_a_batch_of_one_key_carries_it_in_its_metadata():
    # As key-based batching writes it: the batch's key is every message's.
    messages = [OutMessage(index, b"m", "account-42") for index in range(3)]
    metadata = parse_message(build_batch("p", 0, messages, Codec.NONE)).metadata
    assert metadata.partition_key == "account-42"
    unkeyed = parse_message(build_batch("p", 0, [OutMessage(0, b"m"), OutMessage(1, b"m")], Codec.NONE)).metadata
    assert not unkeyed.HasField("partition_key")


def test_an_uncompressed_message_declares_no_codec():
    metadata = parse_message(build_batch("p", 0, MESSAGES, Codec.NONE)).metadata
    assert not metadata.HasField("compression") and not metadata.HasField("uncompressed_size")
    zstd = parse_message(build_batch("p", 0, MESSAGES, Codec.ZSTD)).metadata
    raw_size = sum(len(single) for single in _raw_singles(MESSAGES))
    assert zstd.compression == Codec.ZSTD.wire_number and zstd.uncompressed_size == raw_size


def _raw_singles(messages) -> list[bytes]:
    return [bytes(part) for part in _batch_parts(messages)]


def _batch_parts(messages):
    for message in messages:
        single = SingleMessageMetadata(payload_size=len(message.payload), sequence_id=message.sequence_id)
        if message.key is not None:
            single.partition_key = message.key
        for name, value in (message.properties or {}).items():
            single.properties.add(key=name, value=value)
        if message.event_time_ms:
            single.event_time = message.event_time_ms
        packed = single.SerializeToString()
        yield struct.pack(">I", len(packed)) + packed + message.payload


def test_the_layout_is_pulsars_byte_for_byte():
    # [0x0e01][CRC32C of the rest][u32 metadata size][metadata][payload].
    message = build_batch("p", 5, MESSAGES, Codec.NONE)
    magic, checksum, size = struct.unpack_from(">HII", message)
    assert magic == MAGIC_CRC32C == 0x0E01
    assert checksum == crc32c.crc32c(message[6:])
    metadata = MessageMetadata()
    metadata.ParseFromString(message[10:10 + size])
    assert metadata.num_messages_in_batch == 3
    assert message[10 + size:] == b"".join(_raw_singles(MESSAGES))


def test_split_batch_and_iterate_batch_give_the_same_messages():
    raw = b"".join(_raw_singles(MESSAGES))
    split = split_batch(raw, 3)
    assert [(single.metadata, single.payload) for single in split] == [
        (single.metadata, single.payload) for single in iterate_batch(raw, 3)]
    assert [single.payload for single in split] == [message.payload for message in MESSAGES]


# --- checksums ---------------------------------------------------------------------------


def test_a_flipped_byte_anywhere_is_a_checksum_error():
    message = build_batch("p", 0, MESSAGES, Codec.LZ4)
    for at in range(2, len(message)):
        corrupted = message[:at] + bytes([message[at] ^ 0x01]) + message[at + 1:]
        with pytest.raises(ChecksumError, match="checksum does not match"):
            parse_message(corrupted)


def test_a_checksum_error_is_a_malformed_message():
    assert issubclass(ChecksumError, MalformedMessageError)


def test_a_stored_message_is_parsed_without_its_checksum_checked():
    # Checked once, when the broker took it; a reader may skip the check.
    message = build_batch("p", 0, MESSAGES, Codec.NONE)
    corrupted = message[:2] + bytes(4) + message[6:]
    parsed = parse_message(corrupted, verify_checksum=False)
    assert parsed.checksummed and parsed.message_count == 3


def test_a_message_without_the_magic_has_no_checksum_and_still_parses():
    # Pulsar's clients may leave out the checksum: the message then starts
    # with its metadata size.
    message = build_batch("p", 0, MESSAGES, Codec.ZLIB)[6:]
    parsed = parse_message(message)
    assert not parsed.checksummed and parsed.batched
    assert read_back(message) == written(MESSAGES)


def test_a_message_too_short_for_its_checksum_header_is_malformed():
    for data in (b"\x0e\x01", b"\x0e\x01" + bytes(7), b"", b"\x00\x00\x00"):
        with pytest.raises(MalformedMessageError) as caught:
            parse_message(data)
        assert type(caught.value) is MalformedMessageError


# --- malformed messages ------------------------------------------------------------------


def framed(metadata_bytes: bytes, payload: bytes = b"", *, size: int | None = None) -> bytes:
    """A message whose metadata is `metadata_bytes` (declared as `size`), checksummed."""
    body = struct.pack(">I", len(metadata_bytes) if size is None else size) + metadata_bytes + payload
    return struct.pack(">HI", MAGIC_CRC32C, crc32c.crc32c(body)) + body


def metadata_of(**fields) -> MessageMetadata:
    values = {"producer_name": "p", "sequence_id": 0, "publish_time": 0}
    values.update(fields)
    return MessageMetadata(**values)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (framed(metadata_of().SerializeToString(), size=1000), "metadata of 1000 bytes runs past the message"),
        (framed(b"", size=METADATA_BYTES_MAX + 1), f"metadata of {METADATA_BYTES_MAX + 1} bytes runs past"),
        (framed(b"\xff\xff\xff"), "metadata does not decode"),
        (framed(b"\x0a\x10abc"), "metadata does not decode"),  # a string longer than the metadata
        (framed(b"\x08"), "metadata does not decode"),  # a field without its value
        (framed(b"\x07\x00"), "metadata does not decode"),  # wire type 7 does not exist
    ],
)
def test_metadata_that_is_not_a_message_metadata_is_malformed(data, match):
    with pytest.raises(MalformedMessageError, match=match):
        parse_message(data)


def batch_of(raw: bytes, count: int, **fields) -> bytes:
    return frame_message(metadata_of(num_messages_in_batch=count, **fields), raw)


def single(payload: bytes, *, payload_size: int | None = None, size: int | None = None, **fields) -> bytes:
    packed = SingleMessageMetadata(payload_size=len(payload) if payload_size is None else payload_size,
                                   **fields).SerializeToString()
    return struct.pack(">I", len(packed) if size is None else size) + packed + payload


@pytest.mark.parametrize(
    ("raw", "count", "match"),
    [
        (single(b"a") + single(b"b"), 3, "cannot hold 3 messages|ends before message 2"),
        (single(b"a") + single(b"b") + bytes(3), 3, "the batch ends before message 2"),
        (single(b"a") + single(b"b"), 1, "bytes follow the batch's last message"),
        (single(b"a") + single(b"b") + b"\x00", 2, "1 bytes follow the batch's last message"),
        (single(b"a") + single(b"b", payload_size=2), 2, "message 1: its payload of 2 bytes runs past the batch"),
        (single(b"a") + single(b"b", payload_size=-1), 2, "message 1: its payload of -1 bytes runs past the batch"),
        (single(b"a") + single(b"b", size=100), 2, "message 1: its metadata of 100 bytes runs past the batch"),
        (single(b"a") + struct.pack(">I", METADATA_BYTES_MAX + 1) + bytes(8), 2, "its metadata of .* bytes runs past"),
        (single(b"a") + struct.pack(">I", 3) + b"\xff\xff\xff", 2, "message 1: its metadata does not decode"),
        (single(b"a") + b"\x00\x00", 2, "ends before message 1|cannot hold"),
        (single(b"a"), 0, "a batch of 0 messages"),
        (single(b"a"), -1, "a batch of -1 messages"),
        (b"", 1, "a payload of 0 bytes cannot hold 1 messages"),
        (bytes(12), 100_000, "a payload of 12 bytes cannot hold 100000 messages"),
    ],
)
def test_batches_that_do_not_hold_their_messages_are_malformed(raw, count, match):
    parsed = parse_message(batch_of(raw, count))
    with pytest.raises(MalformedMessageError, match=match):
        read_batch(parsed, BOUND)


def test_a_compressed_payload_that_does_not_give_its_declared_size_is_malformed():
    raw = b"".join(_raw_singles(MESSAGES))
    for declared in (len(raw) - 1, len(raw) + 1, 0):
        message = batch_of(compress(Codec.LZ4, raw), 3, compression=Codec.LZ4.wire_number, uncompressed_size=declared)
        with pytest.raises(MalformedMessageError, match="payload: lz4 data"):
            read_batch(parse_message(message), BOUND)
    garbage = batch_of(os.urandom(100), 3, compression=Codec.ZSTD.wire_number, uncompressed_size=len(raw))
    with pytest.raises(MalformedMessageError, match="payload: zstd data does not decompress"):
        read_batch(parse_message(garbage), BOUND)


def test_an_unknown_codec_is_malformed():
    # A codec of a newer Pulsar: protobuf keeps the number it does not know
    # aside and reads the field as NONE; the payload is not uncompressed.
    metadata = metadata_of(num_messages_in_batch=1, uncompressed_size=1).SerializeToString()
    for field in (b"\x40\x07", b"\x40\x03\x40\x07", b"\x42\x01\x03"):  # 7; 3 then 7; 3 as bytes
        parsed = parse_message(framed(metadata + field, single(b"a")))
        with pytest.raises(MalformedMessageError, match="unknown compression type"):
            codec_of(parsed.metadata)
        with pytest.raises(MalformedMessageError, match="unknown compression type"):
            read_batch(parsed, BOUND)
    assert codec_of(parse_message(framed(metadata + b"\x40\x04", b"")).metadata) is Codec.SNAPPY


def test_a_payload_past_the_bound_is_refused_before_it_is_decompressed():
    # 256 MiB declared in a few hundred bytes: refused from the metadata, no
    # memory spent on it.
    message = batch_of(compress(Codec.ZSTD, bytes(1024)), 1, compression=Codec.ZSTD.wire_number,
                       uncompressed_size=256 * 1024 * 1024)
    parsed = parse_message(message)
    def refused() -> None:
        with pytest.raises(MalformedMessageError, match=r"declares 268435456 bytes uncompressed, past 1048576"):
            uncompressed_payload(parsed, 1024 * 1024)

    assert peak_bytes_of(refused) < 64 * 1024
    plain = parse_message(batch_of(bytes(2000), 1))
    with pytest.raises(MalformedMessageError, match="payload of 2000 bytes is past 1999"):
        uncompressed_payload(plain, 1999)
    assert len(uncompressed_payload(plain, 2000)) == 2000


# --- any bytes ---------------------------------------------------------------------------


def read_whole(data: bytes, verify_checksum: bool) -> list:
    parsed = parse_message(data, verify_checksum=verify_checksum)
    return read_batch(parsed, 64 * 1024)


def mutated(data: bytes, draw) -> bytes:
    kind = draw(st.sampled_from(["flip", "cut", "append", "insert"]))
    at = draw(st.integers(0, max(0, len(data) - 1)))
    if kind == "flip" and data:
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    if kind == "cut":
        return data[:at]
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=8))
    return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]


out_messages = st.builds(
    OutMessage,
    st.integers(0, 2**63 - 1),
    st.binary(max_size=200),
    st.none() | st.text(max_size=8),
    st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
    st.integers(0, 2**63 - 1),
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80), st.booleans())
def test_any_bytes_parse_or_raise_malformed(data, verify_checksum):
    try:
        singles = read_whole(data, verify_checksum)
    except MalformedMessageError:
        return
    assert singles


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(Codec)), st.lists(out_messages, min_size=1, max_size=4), st.booleans(), st.booleans(), st.data())
def test_any_change_to_a_message_parses_or_raises_malformed(codec, messages, checksummed, verify_checksum, data):
    # Without the checksum (or not checking it), any byte changed, cut or
    # added: either a message that reads through, or MalformedMessageError.
    message = build_batch("p", 0, messages, codec)
    message = mutated(message if checksummed else message[6:], data.draw)
    try:
        singles = read_whole(message, verify_checksum)
    except MalformedMessageError:
        return
    assert all(isinstance(single.payload, bytes) for single in singles)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(Codec)), st.lists(out_messages, min_size=1, max_size=6), st.booleans(),
       st.integers(0, 2**63 - 1))
def test_random_batches_round_trip(codec, messages, batched, publish_ms):
    # Sequence ids as Pulsar's clients number them: rising within a batch.
    messages = [OutMessage(messages[0].sequence_id + index, *fields[1:])
                for index, fields in enumerate((m.sequence_id, m.payload, m.key, m.properties, m.event_time_ms)
                                               for m in messages)]
    if not batched:
        messages = messages[:1]
    message = build_batch("producer-é", publish_ms, messages, codec, batched=batched)
    parsed = parse_message(message)
    assert parsed.metadata.producer_name == "producer-é" and parsed.metadata.publish_time == publish_ms
    assert parsed.batched == batched and parsed.message_count == len(messages)
    assert read_back(message) == written(messages)
