"""How messages are stored in entries: the header the broker reads without
decompressing, the compressed body, and what happens to bytes that are not
an entry (MalformedEntryError, never another exception, never unbounded
memory for a body that decompresses to far more than it should)."""

from __future__ import annotations

import gzip
import os
import tracemalloc
import zlib

import lz4.frame
import msgpack
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.message_format import (
    BODY_BYTES_MAX,
    BatchHeader,
    Codec,
    MalformedEntryError,
    MessageRecord,
    compress,
    decode_body,
    decode_entry,
    decompress,
    encode_body,
    encode_entry,
)

MESSAGES = [
    (7, 1_700_000_000_000, {"kind": "debit", "currency": "EUR"}, b"payload one"),
    (8, 1_700_000_000_001, None, b""),
    (9, 1_700_000_000_002, {}, bytes(range(256)) * 4),
]


def make_header(codec: Codec, count: int, keys=None, **changes) -> BatchHeader:
    fields = dict(producer_id="billing-1", first_sequence_id=7, last_sequence_id=7 + count - 1, first_offset=1000,
                  message_count=count, publish_time_ms=1_700_000_000_000, codec=codec, keys=keys)
    fields.update(changes)
    return BatchHeader(**fields)


def write_and_read(header: BatchHeader, messages) -> tuple[BatchHeader, list[MessageRecord]]:
    """A producer's body, the broker's entry, and a consumer's decoding."""
    entry = encode_entry(header, encode_body(messages, header.codec))
    decoded_header, body = decode_entry(entry)
    return decoded_header, decode_body(decoded_header, body)


@pytest.mark.parametrize("codec", list(Codec))
def test_a_batch_round_trips_with_every_codec(codec):
    # Keys (one missing), properties (some empty) and payloads come back as
    # sent; an empty or missing property map reads as {}.
    header = make_header(codec, 3, keys=("account-42", None, "account-7"))
    decoded_header, records = write_and_read(header, MESSAGES)
    assert decoded_header == header
    assert decoded_header.last_offset == 1002 and decoded_header.key_of(1) is None
    assert records == [MessageRecord(sequence_id, publish_ms, properties or {}, payload)
                       for sequence_id, publish_ms, properties, payload in MESSAGES]


@pytest.mark.parametrize("codec", list(Codec))
def test_a_large_body_round_trips_whole(codec):
    # Several megabytes, part incompressible: decompression must not stop
    # early at some internal buffer size.
    payload = os.urandom(2 * 1024 * 1024) + bytes(6 * 1024 * 1024) + os.urandom(100_000)
    data = compress(codec, payload)
    assert decompress(codec, data) == payload


def test_the_header_is_read_without_the_body():
    # The broker reads producer, sequence ids, offsets and keys from an entry
    # whose body it never decompresses (here not even a valid body).
    header = make_header(Codec.ZSTD, 2, keys=("a", "b"))
    decoded, body = decode_entry(encode_entry(header, b"not zstd at all"))
    assert decoded == header and body == b"not zstd at all"
    with pytest.raises(MalformedEntryError):
        decode_body(decoded, body)


def test_keys_are_none_when_no_message_has_one():
    decoded, _ = decode_entry(encode_entry(make_header(Codec.NONE, 2), encode_body(MESSAGES[:2], Codec.NONE)))
    assert decoded.keys is None and decoded.key_of(1) is None


def test_unknown_codec_names_are_refused():
    assert Codec.parse("lz4") is Codec.LZ4
    with pytest.raises(ValueError, match="known: none, zstd, lz4, gzip"):
        Codec.parse("snappy")


# --- bounded decompression ----------------------------------------------------------------

CHUNK = bytes(1024 * 1024)


def bomb(codec: Codec, mebibytes: int) -> bytes:
    """A small body that decompresses to `mebibytes` MiB of zeros, built
    without ever holding them."""
    if codec is Codec.ZSTD:
        compressor = zstandard.ZstdCompressor(level=3).compressobj()
        return b"".join(compressor.compress(CHUNK) for _ in range(mebibytes)) + compressor.flush()
    if codec is Codec.LZ4:
        compressor = lz4.frame.LZ4FrameCompressor()
        return compressor.begin() + b"".join(compressor.compress(CHUNK) for _ in range(mebibytes)) + compressor.flush()
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return b"".join(compressor.compress(CHUNK) for _ in range(mebibytes)) + compressor.flush()


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.LZ4, Codec.GZIP])
def test_a_zip_bomb_is_refused_within_the_bound(codec):
    # 256 MiB of zeros in a few hundred kilobytes: decompressing stops at
    # the bound and raises; memory stays near the bound, not the bomb.
    data = bomb(codec, 256)
    assert len(data) < 2 * 1024 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(MalformedEntryError, match="past 1048576 bytes"):
            decompress(codec, data, bytes_max=1024 * 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.LZ4, Codec.GZIP])
def test_a_body_past_the_entry_bound_is_malformed(codec):
    header = make_header(codec, 1)
    with pytest.raises(MalformedEntryError, match=f"past {BODY_BYTES_MAX}"):
        decode_body(header, bomb(codec, BODY_BYTES_MAX // len(CHUNK) + 1))


@pytest.mark.parametrize("codec", list(Codec))
def test_a_body_of_exactly_the_bound_decompresses(codec):
    data = compress(codec, b"x" * 1000)
    assert len(decompress(codec, data, bytes_max=1000)) == 1000
    with pytest.raises(MalformedEntryError):
        decompress(codec, data, bytes_max=999)


# --- garbage ------------------------------------------------------------------------------


def entry_fields(**changes) -> list:
    fields = {"version": 1, "producer_id": "p", "first_sequence_id": 0, "last_sequence_id": 1, "first_offset": 0,
              "count": 2, "publish_ms": 0, "codec": "none", "keys": None, "body": b""}
    fields.update(changes)
    return list(fields.values())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used in msgpack
        msgpack.packb({"not": "a list"}),
        msgpack.packb(entry_fields()[:-1]),
        msgpack.packb(entry_fields(version=2)),
        msgpack.packb(entry_fields(version=True)),
        msgpack.packb(entry_fields(version=1.0)),
        msgpack.packb(entry_fields(codec="snappy")),
        msgpack.packb(entry_fields(codec=["none"])),
        msgpack.packb(entry_fields(producer_id=5)),
        msgpack.packb(entry_fields(first_offset=1.5)),
        msgpack.packb(entry_fields(count=0)),
        msgpack.packb(entry_fields(count=False)),
        msgpack.packb(entry_fields(keys=["a"])),  # one key for two messages
        msgpack.packb(entry_fields(keys=["a", 3])),
        msgpack.packb(entry_fields(keys="ab")),
        msgpack.packb(entry_fields(body="text")),
        msgpack.packb(entry_fields()) + b"\x00",  # trailing bytes
    ],
)
def test_garbage_entries_are_malformed(data):
    with pytest.raises(MalformedEntryError):
        decode_entry(data)


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb([[1, 0, None, b"only one"]]),  # the header says two
        msgpack.packb({"a": 1}),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, None]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, {"k": 1}, b"y"]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, None, "text"]]),
        msgpack.packb([[1, 0, None, b"x"], [True, 0, None, b"y"]]),
        msgpack.packb([[1, 0, None, b"x"], [2, 0, None, b"y"]])[:-1],
    ],
)
def test_garbage_bodies_are_malformed(body):
    with pytest.raises(MalformedEntryError):
        decode_body(make_header(Codec.NONE, 2), body)


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.LZ4, Codec.GZIP])
def test_a_truncated_compressed_body_is_malformed(codec):
    body = encode_body(MESSAGES * 50, codec)
    with pytest.raises(MalformedEntryError):
        decode_body(make_header(codec, 150), body[: len(body) // 2])


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=11) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64) | msgpack_values.map(msgpack.packb))
def test_any_bytes_decode_to_an_entry_or_raise_malformed(data):
    try:
        header, body = decode_entry(data)
    except MalformedEntryError:
        return
    assert type(header.producer_id) is str and type(body) is bytes and header.message_count >= 1


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(Codec)), st.binary(max_size=200) | msgpack_values.map(msgpack.packb), st.integers(1, 3))
def test_any_body_decodes_to_messages_or_raises_malformed(codec, body, count):
    try:
        records = decode_body(make_header(codec, count), body)
    except MalformedEntryError:
        return
    assert len(records) == count


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(list(Codec)),
    st.lists(
        st.tuples(
            st.integers(0, 2**63 - 1),
            st.integers(0, 2**63 - 1),
            st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
            st.binary(max_size=300),
        ),
        min_size=1,
        max_size=5,
    ),
    st.data(),
)
def test_random_batches_round_trip(codec, messages, data):
    keys = data.draw(st.none() | st.lists(st.none() | st.text(max_size=6), min_size=len(messages), max_size=len(messages)).map(tuple))
    header = make_header(codec, len(messages), keys=keys)
    decoded_header, records = write_and_read(header, messages)
    assert decoded_header == header
    assert [(record.sequence_id, record.publish_time_ms, record.properties, record.payload) for record in records] == [
        (sequence_id, publish_ms, properties or {}, payload) for sequence_id, publish_ms, properties, payload in messages
    ]


def test_gzip_bodies_of_other_writers_decode():
    # A gzip body need not come from our own compressor (any gzip member).
    raw = msgpack.packb([[1, 0, None, b"x"]])
    assert decode_body(make_header(Codec.GZIP, 1), gzip.compress(raw, compresslevel=1)) == [MessageRecord(1, 0, {}, b"x")]
