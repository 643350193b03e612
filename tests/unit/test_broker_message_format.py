"""How messages are stored in entries: the header the broker reads without
decompressing, the compressed body, and what happens to bytes that are not
an entry (MalformedEntryError, never another exception, never unbounded
memory for a body that decompresses to far more than it should)."""

from __future__ import annotations

import dataclasses
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

from broker.errors import BrokerStatus, MalformedBatchError
from broker.message_format import (
    BODY_BYTES_MAX,
    MESSAGE_BYTES_MIN,
    BatchHeader,
    Codec,
    MalformedEntryError,
    MessageRecord,
    check_batch,
    compress,
    decode_body,
    decode_entry,
    decompress,
    encode_body,
    encode_entry,
)
from broker.protocol import KEYS_MAX, Send

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


# --- the broker's check of a producer's batch ---------------------------------------------
#
# What the broker takes must be what consumers can read: a batch whose
# declared codec, count, keys or sequence ids do not match its body is
# refused (MalformedBatchError, a BAD_REQUEST to that producer) before it
# takes any offset.


def send_of(messages, codec: Codec = Codec.NONE, *, body: bytes | None = None, keys=None, **changes) -> Send:
    """The SEND a well-behaved producer makes of `messages`, with `changes`."""
    fields = dict(producer_handle=1, first_sequence_id=messages[0][0], last_sequence_id=messages[-1][0],
                  message_count=len(messages), publish_time_ms=messages[0][1], codec=codec.value, keys=keys,
                  body=encode_body(messages, codec) if body is None else body)
    fields.update(changes)
    return Send(**fields)


def numbered(count: int, payload: bytes = b"m", first: int = 0) -> list:
    return [(first + index, 1_700_000_000_000 + index, None, payload) for index in range(count)]


def refused(send: Send, match: str) -> None:
    with pytest.raises(MalformedBatchError, match=match) as caught:
        check_batch(send)
    assert caught.value.status is BrokerStatus.BAD_REQUEST and str(caught.value).startswith("malformed batch: ")


@pytest.mark.parametrize("codec", list(Codec))
def test_good_batches_of_every_codec_are_accepted(codec):
    assert check_batch(send_of(MESSAGES, codec, keys=["account-42", None, "account-7"])) is codec
    assert check_batch(send_of(numbered(1), codec)) is codec
    # Sequence ids may skip (a caller naming its own), as long as they rise.
    gaps = [(10, 0, None, b"a"), (12, 0, {"k": "v"}, b""), (99, -5, {}, b"c" * 70_000)]
    assert check_batch(send_of(gaps, codec)) is codec
    # Large: 1,000 messages of 1 KiB, as the benchmark's batches.
    assert check_batch(send_of(numbered(1000, os.urandom(1024)), codec)) is codec


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.LZ4, Codec.GZIP])
def test_bodies_of_other_writers_are_accepted(codec):
    # A frame that does not declare its size (a streaming compressor), and a
    # gzip member of another compressor, within the bounds.
    raw = encode_body(numbered(300, b"x" * 100), Codec.NONE)
    if codec is Codec.ZSTD:
        compressor = zstandard.ZstdCompressor(level=1).compressobj()
        body = compressor.compress(raw) + compressor.flush()
        assert zstandard.get_frame_parameters(body).content_size == zstandard.CONTENTSIZE_UNKNOWN
    elif codec is Codec.LZ4:
        body = lz4.frame.compress(raw, store_size=False, content_checksum=True, block_checksum=True)
        assert lz4.frame.get_frame_info(body)["content_size"] == 0
    else:
        body = gzip.compress(raw, compresslevel=1)
    assert check_batch(send_of(numbered(300, b"x" * 100), codec, body=body)) is codec


def test_the_smallest_and_the_largest_batches_are_accepted():
    # The smallest body: one byte of array header, six per message; one
    # byte less cannot hold the count, and is refused before it is read.
    smallest = [(0, 0, None, b""), (1, 0, None, b"")]
    body = encode_body(smallest, Codec.NONE)
    assert len(body) == 1 + MESSAGE_BYTES_MIN * 2
    assert check_batch(send_of(smallest)) is Codec.NONE
    refused(send_of(smallest, body=body[:-1]), "a body of 12 bytes cannot hold 2 messages")
    # 100,000 messages (the protocol's most).
    assert check_batch(send_of(numbered(KEYS_MAX, b""), Codec.ZSTD)) is Codec.ZSTD
    # A body of nearly BODY_BYTES_MAX in one message.
    assert check_batch(send_of([(0, 0, None, bytes(BODY_BYTES_MAX - 64))], Codec.LZ4)) is Codec.LZ4


def test_a_declared_count_is_checked_before_the_body_is_read():
    # The finding: 100,000 messages declared with a 1-byte body. Refused by
    # the sequence ids, or (ids wide enough) by the body's size, before a
    # byte is decompressed.
    refused(send_of(numbered(1), message_count=100_000, body=b"x"), "sequence ids 0..0 cannot number 100000 messages")
    refused(send_of(numbered(1), message_count=100_000, last_sequence_id=10**9, body=b"x"),
            "a body of 1 bytes cannot hold 100000 messages")
    small = compress(Codec.ZSTD, encode_body(numbered(2), Codec.NONE))
    refused(send_of(numbered(1000), Codec.ZSTD, body=small), r"a body of \d+ bytes cannot hold 1000 messages")
    small = compress(Codec.LZ4, encode_body(numbered(2), Codec.NONE))
    refused(send_of(numbered(1000), Codec.LZ4, body=small), r"a body of \d+ bytes cannot hold 1000 messages")


@pytest.mark.parametrize("codec", list(Codec))
def test_a_count_that_does_not_match_the_body_is_refused(codec):
    body = encode_body(numbered(10), codec)
    refused(send_of(numbered(11), codec, body=body), "the body holds 10 messages, the batch says 11")
    refused(send_of(numbered(9), codec, body=body), "the body holds 10 messages, the batch says 9")


def test_the_codec_and_the_keys_must_match_the_batch():
    refused(dataclasses.replace(send_of(numbered(2)), codec="snappy"), "unknown codec 'snappy'; known: none, zstd, lz4, gzip")
    # An uncompressed body said to be zstd.
    refused(dataclasses.replace(send_of(numbered(2)), codec="zstd"), "zstd body has no valid frame header")
    refused(send_of(numbered(2), keys=["a"]), "1 keys for 2 messages")
    refused(send_of(numbered(2), keys=["a", "b", None]), "3 keys for 2 messages")


def test_sequence_ids_must_match_the_body():
    messages = numbered(3, first=5)  # 5, 6, 7
    refused(send_of(messages, first_sequence_id=4), "message 0: sequence id 5 is not the batch's first")
    refused(send_of(messages, first_sequence_id=6), "sequence ids 6..7 cannot number 3 messages")
    refused(send_of(messages, last_sequence_id=8), "the last message's sequence id is 7, the batch says 8")
    refused(send_of(messages, first_sequence_id=7, last_sequence_id=5), "sequence ids 7..5 cannot number")
    refused(send_of([(5, 0, None, b""), (5, 0, None, b""), (7, 0, None, b"")]), "message 1: sequence id 5 is not above 5")
    refused(send_of([(5, 0, None, b""), (7, 0, None, b""), (6, 0, None, b"")], last_sequence_id=7),
            "message 2: sequence id 6 is not above 7")


def ext_timestamp() -> bytes:
    return msgpack.packb(msgpack.Timestamp(1, 0))


X = b"x" * 16  # a first message long enough that the body could hold two


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (msgpack.packb({"a": X}), "not an array of messages"),
        (msgpack.packb("text" * 4), "not an array of messages"),
        (msgpack.packb([[0, 0, None, X], [1, 0, None]]), "message 1 is not an array of 4 fields"),
        (msgpack.packb([[0, 0, None, X], [1, 0, None, b"y", 5]]), "message 1 is not an array of 4 fields"),
        (msgpack.packb([[0, 0, None, X], {"1": 0}]), "message 1 is not an array of 4 fields"),
        (msgpack.packb([[0, 0, None, X], [True, 0, None, b"y"]]), "message 1: its sequence id is not an integer"),
        (msgpack.packb([[0, 0, None, X], [1.0, 0, None, b"y"]]), "message 1: its sequence id is not an integer"),
        (msgpack.packb([[0, 0, None, X], [[1], 0, None, b"y"]]), "message 1: its sequence id is not an integer"),
        (msgpack.packb([[0, 0, None, X], [1, 0.5, None, b"y"]]), "message 1: its publish time is not an integer"),
        (msgpack.packb([[0, 0, None, X], [1, None, None, b"y"]]), "message 1: its publish time is not an integer"),
        (msgpack.packb([[0, 0, None, X], [1, 0, [], b"y"]]), "properties are not a map of strings"),
        (msgpack.packb([[0, 0, None, X], [1, 0, {"k": b"v"}, b"y"]]), "properties are not a map of strings"),
        (msgpack.packb([[0, 0, None, X], [1, 0, {"k": 1}, b"y"]]), "properties are not a map of strings"),
        (msgpack.packb([[0, 0, None, X], [1, 0, {1: "v"}, b"y"]]), "properties are not a map of strings"),
        (msgpack.packb([[0, 0, None, X], [1, 0, {"k": {"n": "v"}}, b"y"]]), "properties are not a map of strings"),
        (msgpack.packb([[0, 0, None, X], [1, 0, None, "text"]]), "message 1: its payload is not binary"),
        (msgpack.packb([[0, 0, None, X], [1, 0, None, None]]), "message 1: its payload is not binary"),
        (msgpack.packb([[0, 0, None, [1, 0, None, X]], [1, 0, None, b"y"]]), "message 0: its payload is not binary"),
        (msgpack.packb([[0, 0, None, X], [1, 0, None, b"y"]])[:-1], "the body ends inside message 1"),
        (msgpack.packb([[0, 0, None, X], [1, 0, None, b"yy"]])[:-1] + b"\x00" * 0, "the body ends inside message 1"),
        (msgpack.packb([[0, 0, None, X], [1, 0, None, b"y"]]) + b"\xc0", "1 bytes follow the last message"),
        (msgpack.packb([[0, 0, None, X], [1, 0, None, b"y"]]) * 2, "bytes follow the last message"),
        # A bin header claiming more bytes than the body has.
        (b"\x92\x94\x00\x00\xc0\xc4\x01x\x94\x01\x00\xc0\xc6\xff\xff\xff\xff" + b"y" * 8, "the body ends inside message 1"),
        # A property that is not UTF-8 (a consumer could not decode it).
        (b"\x92\x94\x00\x00\xc0\xc4\x01x\x94\x01\x00\x81\xa1\xff\xa1v\xc4\x01y", "message 1 does not decode"),
        (b"\x92\x94\x00\x00\xc0\xc4\x01x\x94\x01" + ext_timestamp() + b"\xc0\xc4\x01y", "its publish time is not an integer"),
    ],
)
def test_bodies_that_do_not_hold_the_declared_messages_are_refused(body, match):
    send = Send(1, 0, 1, 2, 0, "none", None, body)
    refused(send, match)
    # And a consumer could not have read them either (the one exception,
    # rising sequence ids, is the broker's own rule).
    with pytest.raises(MalformedEntryError):
        decode_body(make_header(Codec.NONE, 2), body)


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
    cases = [
        ("random bytes", os.urandom(2000), ""),
        ("truncated", good[: len(good) // 2], ""),
        ("truncated at the end", good[:-1], ""),
        ("trailing bytes", good + b"\x00", "after its|unused data"),
        ("two frames", good + good, "after its|unused data"),
        ("a flipped byte", good[:len(good) // 2] + bytes([good[len(good) // 2] ^ 0xff]) + good[len(good) // 2 + 1:], ""),
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


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.LZ4, Codec.GZIP])
def test_compressed_bodies_that_do_not_decode_to_the_batch_are_refused(codec):
    for what, body, match in garbage_bodies(codec):
        with pytest.raises(MalformedBatchError, match=match or None) as caught:
            check_batch(send_of(numbered(100, b"p" * 1000), codec, body=body))
        assert caught.value.status is BrokerStatus.BAD_REQUEST, what


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.LZ4, Codec.GZIP])
def test_a_bomb_batch_is_refused_within_the_bound(codec):
    # 256 MiB of zeros in a body of a few hundred kilobytes: refused, memory
    # near the bound (the tracked part: Python's allocations).
    tracemalloc.start()
    try:
        with pytest.raises(MalformedBatchError, match=f"past {BODY_BYTES_MAX} bytes"):
            check_batch(send_of(numbered(1), codec, body=bomb(codec, 256)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * BODY_BYTES_MAX


@pytest.mark.parametrize(
    "message",
    [
        # A field holding a million empty arrays, or a million small maps:
        # as Python objects 60 times the body's size.
        b"\x94" + b"\xdd" + (1_000_000).to_bytes(4, "big") + b"\x90" * 1_000_000 + b"\x00\xc0\xc4\x00",
        b"\x94\x00\x00" + b"\xdd" + (1_000_000).to_bytes(4, "big") + b"\x80" * 1_000_000 + b"\xc4\x00",
        b"\x94\x00\x00\xc0" + b"\xdd" + (1_000_000).to_bytes(4, "big") + b"\x90" * 1_000_000,
        # Properties with 200,000 distinct keys: read one string at a time.
        b"\x94\x00\x00\xdf" + (200_000).to_bytes(4, "big")
        + b"".join(msgpack.packb(f"{n:06}") + b"\xa0" for n in range(200_000)) + b"\xc4\x00" + b"\xc0",
    ],
)
def test_the_walk_of_a_body_never_builds_its_values(message):
    body = b"\x91" + message
    assert len(body) < 10 * 1024 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(MalformedBatchError):
            check_batch(Send(1, 0, 0, 1, 0, "none", None, body))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(body) + 1024 * 1024


def mutations(body: bytes, data) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "cut", "append", "insert"]))
    at = data.draw(st.integers(0, max(0, len(body) - 1)))
    if kind == "flip":
        return body[:at] + bytes([body[at] ^ data.draw(st.integers(1, 255))]) + body[at + 1:]
    if kind == "cut":
        return body[:at]
    if kind == "append":
        return body + data.draw(st.binary(min_size=1, max_size=8))
    return body[:at] + data.draw(st.binary(min_size=1, max_size=8)) + body[at:]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(list(Codec)),
    st.lists(
        st.tuples(
            st.integers(0, 1000),  # steps between sequence ids, added up below
            st.integers(-(2**63), 2**63 - 1),
            st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
            st.binary(max_size=300),
        ),
        min_size=1,
        max_size=6,
    ),
    st.data(),
)
def test_what_the_broker_accepts_a_consumer_reads(codec, drawn, data):
    # A producer's batch is accepted; any mutation of its body is either
    # refused (MalformedBatchError, nothing else) or still a body every
    # consumer reads as the batch declares.
    sequence_id = data.draw(st.integers(0, 2**40))
    messages = []
    for step, publish_ms, properties, payload in drawn:
        sequence_id += step + (1 if messages else 0)
        messages.append((sequence_id, publish_ms, properties, payload))
    send = send_of(messages, codec)
    assert check_batch(send) is codec
    header = make_header(codec, len(messages), first_sequence_id=send.first_sequence_id,
                         last_sequence_id=send.last_sequence_id)
    assert [record.payload for record in decode_body(header, send.body)] == [message[3] for message in messages]
    mutated = mutations(send.body, data)
    try:
        check_batch(send_of(messages, codec, body=mutated))
    except MalformedBatchError:
        return
    records = decode_body(header, mutated)
    assert len(records) == len(messages)
    assert records[0].sequence_id == send.first_sequence_id and records[-1].sequence_id == send.last_sequence_id
