"""The entry format quire wrote before Pulsar's layout: entries written with
every legacy codec read back (through `broker.legacy_entry` and through the
broker's `broker.message_format`, a Pulsar consumer's message included), and
bytes that are not such an entry raise MalformedEntryError, never another
exception, never unbounded memory for a body that decompresses to far more."""

from __future__ import annotations

import dataclasses
import gzip
import os
import struct
import tracemalloc
import zlib

import lz4.frame
import msgpack
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import legacy_entry, message_format
from broker.entry_types import BODY_BYTES_MAX, BatchHeader, BodyColumns, MalformedEntryError, MessageRecord
from broker.legacy_entry import Codec, compress, decompress, encode_body, encode_entry
from broker.pulsar_message import parse_message, properties_of, read_batch

# Both read legacy entries: the module of the format, and the broker's
# reader of every format (what brokers, consumers and exports call).
READERS = [pytest.param(legacy_entry, id="legacy_entry"), pytest.param(message_format, id="message_format")]

MESSAGES = [
    (7, 1_700_000_000_000, {"kind": "debit", "currency": "EUR"}, b"payload one"),
    (8, 1_700_000_000_001, None, b""),
    (9, 1_700_000_000_002, {}, bytes(range(256)) * 4),
]
MIB = 1024 * 1024


def make_header(codec: Codec, count: int, keys=None, **changes) -> BatchHeader:
    fields = {"producer_id": "billing-1", "first_sequence_id": 7, "last_sequence_id": 7 + count - 1, "first_offset": 1000,
                  "message_count": count, "publish_time_ms": 1_700_000_000_000, "codec": codec, "keys": keys}
    fields.update(changes)
    return BatchHeader(**fields)


def write_and_read(reader, header: BatchHeader, messages) -> tuple[BatchHeader, list[MessageRecord]]:
    """A producer's body, the broker's entry, and a consumer's decoding."""
    entry = encode_entry(header, encode_body(messages, header.codec))
    decoded_header, body = reader.decode_entry(entry)
    return decoded_header, reader.decode_body(decoded_header, body)


def records_of(messages) -> list[MessageRecord]:
    # An empty or missing property map reads as {}; the format has no event time.
    return [MessageRecord(sequence_id, publish_ms, properties or {}, payload, 0)
            for sequence_id, publish_ms, properties, payload in messages]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("codec", list(Codec))
def test_a_batch_round_trips_with_every_codec(reader, codec):
    # Keys (one missing), properties (some empty) and payloads come back as sent.
    header = make_header(codec, 3, keys=("account-42", None, "account-7"))
    decoded_header, records = write_and_read(reader, header, MESSAGES)
    assert decoded_header == header and decoded_header.legacy
    assert decoded_header.last_offset == 1002 and decoded_header.key_of(1) is None
    assert records == records_of(MESSAGES)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("codec", list(Codec))
def test_body_items_and_body_columns_read_what_decode_body_reads(reader, codec):
    header, body = reader.decode_entry(encode_entry(make_header(codec, 3), encode_body(MESSAGES, codec)))
    assert reader.body_items(header, body) == [tuple(vars_of(record)) for record in records_of(MESSAGES)]
    columns = reader.body_columns(header, body)
    assert isinstance(columns, BodyColumns)
    assert columns == BodyColumns((7, 8, 9), tuple(message[1] for message in MESSAGES),
                                  ({"kind": "debit", "currency": "EUR"}, None, None), tuple(message[3] for message in MESSAGES))


def vars_of(record: MessageRecord) -> tuple:
    return (record.sequence_id, record.publish_time_ms, record.properties, record.payload, record.event_time_ms)


@pytest.mark.parametrize("codec", list(Codec))
def test_a_large_body_round_trips_whole(codec):
    # Several megabytes, part incompressible: decompression must not stop
    # early at some internal buffer size.
    payload = os.urandom(2 * MIB) + bytes(6 * MIB) + os.urandom(100_000)
    assert decompress(codec, compress(codec, payload)) == payload


@pytest.mark.parametrize("reader", READERS)
def test_the_header_is_read_without_the_body(reader):
    # The broker reads producer, sequence ids, offsets and keys from an entry
    # whose body it never decompresses (here not even a valid body).
    header = make_header(Codec.ZSTD, 2, keys=("a", "b"))
    decoded, body = reader.decode_entry(encode_entry(header, b"not zstd at all"))
    assert decoded == header and body == b"not zstd at all"
    with pytest.raises(MalformedEntryError):
        reader.decode_body(decoded, body)


@pytest.mark.parametrize("reader", READERS)
def test_keys_are_none_when_no_message_has_one(reader):
    decoded, _ = reader.decode_entry(encode_entry(make_header(Codec.NONE, 2), encode_body(MESSAGES[:2], Codec.NONE)))
    assert decoded.keys is None and decoded.key_of(1) is None


def test_unknown_codec_names_are_refused():
    assert Codec.parse("lz4") is Codec.LZ4
    with pytest.raises(ValueError, match="known: none, zstd, lz4, gzip"):
        Codec.parse("snappy")


# --- what a Pulsar consumer receives for a legacy entry ----------------------------------


@pytest.mark.parametrize("codec", list(Codec))
def test_a_legacy_entry_reaches_pulsar_consumers_as_a_batch_of_the_same_messages(codec):
    # Re-encoded in Pulsar's layout, uncompressed: the same payloads, keys,
    # properties and sequence ids, checksummed.
    keys = ("account-42", None, "account-7")
    header, body = message_format.decode_entry(encode_entry(make_header(codec, 3, keys=keys), encode_body(MESSAGES, codec)))
    parsed = parse_message(message_format.pulsar_message(header, body))
    metadata = parsed.metadata
    assert parsed.checksummed and parsed.batched and parsed.message_count == 3
    assert (metadata.producer_name, metadata.sequence_id, metadata.highest_sequence_id, metadata.publish_time) == (
        "billing-1", 7, 9, 1_700_000_000_000)
    singles = read_batch(parsed, BODY_BYTES_MAX)
    assert [(single.metadata.sequence_id,
             single.metadata.partition_key if single.metadata.HasField("partition_key") else None,
             properties_of(single.metadata.properties), single.payload) for single in singles] == [
        (sequence_id, key, properties or {}, payload) for (sequence_id, _, properties, payload), key in zip(MESSAGES, keys)]


def test_a_legacy_publish_time_before_1970_reaches_pulsar_consumers_as_0():
    # The legacy format took any integer; Pulsar's publish time is unsigned.
    messages = [(0, -5, None, b"a"), (1, 10, None, b"b")]
    header, body = message_format.decode_entry(encode_entry(make_header(Codec.NONE, 2, first_sequence_id=0, last_sequence_id=1),
                                                            encode_body(messages, Codec.NONE)))
    assert parse_message(message_format.pulsar_message(header, body)).metadata.publish_time == 0
    assert [record.publish_time_ms for record in message_format.decode_body(header, body)] == [-5, 10]


def test_a_legacy_sequence_id_no_pulsar_message_holds_is_malformed():
    # Only a corrupt entry has one (the broker checked them when it took
    # them); it is malformed, not a ValueError.
    messages = [(-3, 0, None, b"a")]
    header, body = message_format.decode_entry(encode_entry(make_header(Codec.NONE, 1, first_sequence_id=-3, last_sequence_id=-3),
                                                            encode_body(messages, Codec.NONE)))
    with pytest.raises(MalformedEntryError, match="no Pulsar message"):
        message_format.pulsar_message(header, body)


def test_an_entry_of_pulsars_layout_reaches_pulsar_consumers_as_stored():
    header = dataclasses.replace(make_header(Codec.NONE, 1), message_start=10)
    assert not header.legacy and message_format.pulsar_message(header, b"as stored") == b"as stored"


# --- bounded decompression ---------------------------------------------------------------


def bomb(codec: Codec, mebibytes: int) -> bytes:
    """A small body that decompresses to `mebibytes` MiB of zeros, built
    without ever holding them."""
    chunk = bytes(MIB)
    if codec is Codec.ZSTD:
        compressor = zstandard.ZstdCompressor(level=3).compressobj()
        return b"".join(compressor.compress(chunk) for _ in range(mebibytes)) + compressor.flush()
    if codec is Codec.LZ4:
        compressor = lz4.frame.LZ4FrameCompressor()
        return compressor.begin() + b"".join(compressor.compress(chunk) for _ in range(mebibytes)) + compressor.flush()
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return b"".join(compressor.compress(chunk) for _ in range(mebibytes)) + compressor.flush()


COMPRESSED = [Codec.ZSTD, Codec.LZ4, Codec.GZIP]


@pytest.mark.parametrize("codec", COMPRESSED)
def test_a_zip_bomb_is_refused_within_the_bound(codec):
    # 256 MiB of zeros in a few hundred kilobytes: decompressing stops at
    # the bound and raises; memory stays near the bound, not the bomb.
    data = bomb(codec, 256)
    assert len(data) < 2 * MIB
    tracemalloc.start()
    try:
        with pytest.raises(MalformedEntryError, match="past 1048576 bytes"):
            decompress(codec, data, bytes_max=MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MIB


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("codec", COMPRESSED)
def test_a_body_past_the_entry_bound_is_malformed(reader, codec):
    header = make_header(codec, 1)
    with pytest.raises(MalformedEntryError, match=f"past {BODY_BYTES_MAX}"):
        reader.decode_body(header, bomb(codec, BODY_BYTES_MAX // MIB + 1))


@pytest.mark.parametrize("codec", list(Codec))
def test_a_body_of_exactly_the_bound_decompresses(codec):
    data = compress(codec, b"x" * 1000)
    assert len(decompress(codec, data, bytes_max=1000)) == 1000
    with pytest.raises(MalformedEntryError):
        decompress(codec, data, bytes_max=999)


# --- bodies of other writers -------------------------------------------------------------


def numbered(count: int, payload: bytes = b"m") -> list:
    return [(index, 1_700_000_000_000 + index, None, payload) for index in range(count)]


def other_writers_body(codec: Codec, raw: bytes) -> bytes:
    """`raw` compressed as another writer may have: a frame that does not
    declare its size (a streaming compressor), or another gzip member."""
    if codec is Codec.ZSTD:
        compressor = zstandard.ZstdCompressor(level=1).compressobj()
        body = compressor.compress(raw) + compressor.flush()
        assert zstandard.get_frame_parameters(body).content_size == zstandard.CONTENTSIZE_UNKNOWN
        return body
    if codec is Codec.LZ4:
        body = lz4.frame.compress(raw, store_size=False, content_checksum=True, block_checksum=True)
        assert lz4.frame.get_frame_info(body)["content_size"] == 0
        return body
    return gzip.compress(raw, compresslevel=1)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("codec", COMPRESSED)
def test_bodies_of_other_writers_decode(reader, codec):
    messages = numbered(300, b"x" * 100)
    body = other_writers_body(codec, encode_body(messages, Codec.NONE))
    assert reader.decode_body(make_header(codec, 300, first_sequence_id=0), body) == records_of(messages)


# --- garbage -----------------------------------------------------------------------------


HEADER_FIELDS = {"producer_id": "p", "first_sequence_id": 0, "last_sequence_id": 1, "first_offset": 0, "count": 2,
                 "publish_ms": 0, "codec": "none", "keys": None}


def raw_entry(*, version: int = 1, header_length: int | None = None, packed: bytes | None = None, body: bytes = b"",
              **changes) -> bytes:
    """An entry of the legacy layout ([version][u32 header length][msgpack
    header][body]) with its header fields changed."""
    if packed is None:
        fields = dict(HEADER_FIELDS)
        fields.update(changes)
        packed = msgpack.packb(list(fields.values()))
    return struct.pack(">BI", version, len(packed) if header_length is None else header_length) + packed + body


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x01",
        b"\x01\x00\x00\x00",  # shorter than the prefix
        raw_entry(version=2),
        raw_entry(header_length=1000),  # past the end
        raw_entry(header_length=3),  # cut inside the header
        raw_entry(packed=msgpack.packb(list(HEADER_FIELDS.values())) + b"\x00"),  # bytes after the header's array
        raw_entry(packed=b"\xc1"),  # never used in msgpack
        raw_entry(packed=msgpack.packb({"not": "a list"})),
        raw_entry(packed=msgpack.packb(list(HEADER_FIELDS.values())[:-1])),
        raw_entry(packed=msgpack.packb([*HEADER_FIELDS.values(), None])),
        raw_entry(codec="snappy"),
        raw_entry(codec=["none"]),
        raw_entry(codec=None),
        raw_entry(producer_id=5),
        raw_entry(producer_id=b"p"),
        raw_entry(first_offset=1.5),
        raw_entry(first_sequence_id=True),
        raw_entry(publish_ms=None),
        raw_entry(count=0),
        raw_entry(count=-1),
        raw_entry(count=False),
        raw_entry(keys=["a"]),  # one key for two messages
        raw_entry(keys=["a", 3]),
        raw_entry(keys=["a", b"b"]),
        raw_entry(keys="ab"),
    ],
)
def test_garbage_entries_are_malformed(data):
    with pytest.raises(MalformedEntryError):
        legacy_entry.decode_entry(data)
    with pytest.raises(MalformedEntryError):
        message_format.decode_entry(data)


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb([[1, 0, None, b"only one"]]),  # the header says two
        msgpack.packb([[1, 0, None, b"x"], [2, 0, None, b"y"], [3, 0, None, b"z"]]),
        msgpack.packb({"a": 1}),
        msgpack.packb("text"),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, None]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, None, b"y", 5]]),
        msgpack.packb([[1, 0, None, b"x"], {"2": 0}]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, {"k": 1}, b"y"]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, {1: "v"}, b"y"]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, {"k": b"v"}, b"y"]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, [], b"y"]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, None, "text"]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, None, None]]),
        msgpack.packb([[1, 0, None, b"x"], [True, 0, None, b"y"]]),
        msgpack.packb([[1, 0, None, b"x"], [2.0, 0, None, b"y"]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0.5, None, b"y"]]),
        msgpack.packb([[1, 0, None, b"x"], [2, msgpack.Timestamp(1, 0), None, b"y"]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, None, b"y"]])[:-1],
        msgpack.packb([[1, 0, None, b"x"], [2, 0, None, b"y"]]) + b"\xc0",  # trailing bytes
        # A property that is not UTF-8 (a consumer could not decode it).
        b"\x92\x94\x01\x00\xc0\xc4\x01x\x94\x02\x00\x81\xa1\xff\xa1v\xc4\x01y",
    ],
)
def test_garbage_bodies_are_malformed(body):
    header = make_header(Codec.NONE, 2)
    for read in (legacy_entry.decode_body, legacy_entry.body_columns, message_format.decode_body,
                 message_format.body_columns, message_format.pulsar_message):
        with pytest.raises(MalformedEntryError):
            read(header, body)


@pytest.mark.parametrize("codec", COMPRESSED)
def test_a_truncated_compressed_body_is_malformed(codec):
    body = encode_body(MESSAGES * 50, codec)
    with pytest.raises(MalformedEntryError):
        legacy_entry.decode_body(make_header(codec, 150), body[: len(body) // 2])


def forged_zstd_size(body: bytes, size: int) -> bytes:
    """A zstd frame whose header declares `size` (its 4-byte content size field)."""
    descriptor = body[4]
    assert descriptor >> 6 == 2 and descriptor >> 5 & 1, "a single-segment frame with a 4-byte content size"
    return body[:5] + size.to_bytes(4, "little") + body[9:]


def forged_lz4_size(body: bytes, size: int) -> bytes:
    """An lz4 frame whose header declares `size`, with the header checksum
    (one byte) found by trying them all."""
    assert body[4] & 0x08, "a frame with a content size"
    forged = bytearray(body)
    forged[6:14] = size.to_bytes(8, "little")
    for checksum in range(256):
        forged[14] = checksum
        try:
            lz4.frame.get_frame_info(bytes(forged))
            return bytes(forged)
        except RuntimeError:
            continue
    raise AssertionError("no header checksum fits")


def garbage_bodies(codec: Codec) -> list[tuple[str, bytes, str]]:
    """(what, body, refusal) for a batch of 100 messages."""
    good = encode_body(numbered(100, b"p" * 1000), codec)
    raw_size = len(encode_body(numbered(100, b"p" * 1000), Codec.NONE))
    middle = len(good) // 2
    cases = [
        ("random bytes", os.urandom(2000), ""),
        ("truncated", good[:middle], ""),
        ("truncated at the end", good[:-1], ""),
        ("trailing bytes", good + b"\x00", "after its|unused data"),
        ("two frames", good + good, "after its|unused data"),
        ("a flipped byte", good[:middle] + bytes([good[middle] ^ 0xFF]) + good[middle + 1:], ""),
        ("another batch's body", compress(codec, encode_body(numbered(99, b"p" * 1000), Codec.NONE)), "holds 99 messages"),
    ]
    magic = {Codec.ZSTD: b"\x28\xb5\x2f\xfd", Codec.LZ4: b"\x04\x22\x4d\x18", Codec.GZIP: b"\x1f\x8b\x08\x00"}[codec]
    cases.append(("its magic, then garbage", magic + os.urandom(2000), ""))
    if codec is Codec.ZSTD:
        cases.append(("a declared size one more", forged_zstd_size(good, raw_size + 1), "does not decompress"))
        cases.append(("a declared size one less", forged_zstd_size(good, raw_size - 1), "does not decompress"))
        cases.append(("a declared size past the bound", forged_zstd_size(good, BODY_BYTES_MAX + 1),
                      f"past {BODY_BYTES_MAX} bytes \\(it declares {BODY_BYTES_MAX + 1}\\)"))
    if codec is Codec.LZ4:
        cases.append(("a declared size one more", forged_lz4_size(good, raw_size + 1), "does not decompress"))
        cases.append(("a declared size one less", forged_lz4_size(good, raw_size - 1), "does not decompress"))
        cases.append(("a declared size past the bound", forged_lz4_size(good, BODY_BYTES_MAX + 1),
                      f"past {BODY_BYTES_MAX} bytes \\(it declares {BODY_BYTES_MAX + 1}\\)"))
    if codec is Codec.GZIP:
        cases.append(("a wrong size in the trailer", good[:-4] + (raw_size + 1).to_bytes(4, "little"), "incorrect length"))
        cases.append(("a wrong CRC", good[:-8] + bytes([good[-8] ^ 1]) + good[-7:], "incorrect data check"))
        cases.append(("a trailer size past the bound", good[:-4] + (BODY_BYTES_MAX + 1).to_bytes(4, "little"),
                      f"past {BODY_BYTES_MAX} bytes"))
    return cases


@pytest.mark.parametrize("codec", COMPRESSED)
def test_compressed_bodies_that_do_not_decode_to_the_batch_are_malformed(codec):
    header = make_header(codec, 100, first_sequence_id=0)
    for what, body, match in garbage_bodies(codec):
        with pytest.raises(MalformedEntryError, match=match or None):
            legacy_entry.decode_body(header, body)
        with pytest.raises(MalformedEntryError, match=match or None):
            message_format.body_columns(header, body)


# --- any bytes ---------------------------------------------------------------------------


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=11) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=25,
)


def prefixed(packed: bytes) -> bytes:
    return struct.pack(">BI", 1, len(packed)) + packed


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | msgpack_values.map(msgpack.packb).map(prefixed)
       | st.lists(msgpack_values, min_size=8, max_size=8).map(msgpack.packb).map(prefixed))
def test_any_bytes_decode_to_an_entry_or_raise_malformed(data):
    for reader in (legacy_entry, message_format):
        try:
            header, body = reader.decode_entry(data)
        except MalformedEntryError:
            continue
        assert type(header.producer_id) is str and isinstance(body, memoryview) and header.message_count >= 1


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(Codec)), st.binary(max_size=200) | msgpack_values.map(msgpack.packb), st.integers(1, 3))
def test_any_body_decodes_to_messages_or_raises_malformed(codec, body, count):
    header = make_header(codec, count)
    for read in (legacy_entry.decode_body, legacy_entry.body_columns, message_format.pulsar_message):
        try:
            decoded = read(header, body)
        except MalformedEntryError:
            continue
        if read is legacy_entry.decode_body:
            assert len(decoded) == count
        elif read is legacy_entry.body_columns:
            assert len(decoded.payloads) == count
        else:
            assert parse_message(decoded).message_count == count


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(list(Codec)),
    st.lists(
        st.tuples(
            st.integers(0, 2**63 - 1),
            st.integers(-(2**63), 2**63 - 1),
            st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
            st.binary(max_size=300),
        ),
        min_size=1,
        max_size=5,
    ),
    st.data(),
)
def test_random_batches_round_trip(codec, messages, data):
    # Through either reader, and to a Pulsar consumer: the same messages.
    keys = data.draw(st.none() | st.lists(st.none() | st.text(max_size=6), min_size=len(messages),
                                          max_size=len(messages)).map(tuple))
    header = make_header(codec, len(messages), keys=keys)
    for reader in (legacy_entry, message_format):
        decoded_header, records = write_and_read(reader, header, messages)
        assert decoded_header == header
        assert records == records_of(messages)
    decoded_header, body = message_format.decode_entry(encode_entry(header, encode_body(messages, codec)))
    singles = read_batch(parse_message(message_format.pulsar_message(decoded_header, body)), BODY_BYTES_MAX)
    assert [(single.metadata.sequence_id, single.metadata.partition_key if single.metadata.HasField("partition_key") else None,
             properties_of(single.metadata.properties), single.payload) for single in singles] == [
        (sequence_id, header.key_of(index), properties or {}, payload)
        for index, (sequence_id, _, properties, payload) in enumerate(messages)]
