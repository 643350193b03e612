"""Frame encoding and decoding: round trips of every message (property tests),
and malformed input that must raise ProtocolError and nothing else."""

from __future__ import annotations

import struct
import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bookie.protocol import messages
from bookie.protocol import (
    LAST_ADD_CONFIRMED,
    AddBatchRequest,
    AddBatchResponse,
    AddRequest,
    AddResponse,
    BatchReadRequest,
    BatchReadResponse,
    GetInfoRequest,
    GetInfoResponse,
    Hello,
    HelloReply,
    ListEntriesRequest,
    ListEntriesResponse,
    ReadLacRequest,
    ReadLacResponse,
    ReadRequest,
    ReadResponse,
    Status,
    decode_hello,
    decode_hello_reply,
    decode_request,
    decode_response,
    encode_hello,
    encode_hello_reply,
    encode_request,
    encode_response,
)
from framing.codec import FrameDecoder, ProtocolError, encode_frame

u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
entry_ids = st.integers(LAST_ADD_CONFIRMED, 2**64 - 1)
flags = st.integers(0, 3)
blobs = st.binary(max_size=300)
statuses = st.sampled_from(list(Status))

add_triples = st.lists(st.tuples(flags, blobs, blobs), min_size=1, max_size=5).map(lambda adds: [f for add in adds for f in add])
requests = st.one_of(
    st.builds(AddRequest, u64, flags, blobs, blobs),
    st.builds(AddBatchRequest, u64, add_triples),
    st.builds(
        ReadRequest, u64, flags, u64, entry_ids, st.none() | blobs, st.none() | i64, st.none() | st.integers(0, 2**31)
    ),
    st.builds(ReadLacRequest, u64, u64),
    st.builds(BatchReadRequest, u64, u64, u64, st.integers(1, 2**31), st.integers(1, 2**40)),
    st.builds(GetInfoRequest, u64),
    st.builds(ListEntriesRequest, u64, u64, u64, u64),
)
responses = st.one_of(
    st.builds(AddResponse, u64, statuses, u64, u64),
    st.builds(AddBatchResponse, u64, st.lists(statuses, min_size=1, max_size=5)),
    st.builds(ReadResponse, u64, statuses, u64, entry_ids, i64, st.none() | blobs),
    st.builds(ReadLacResponse, u64, statuses, u64, i64),
    st.builds(BatchReadResponse, u64, statuses, u64, u64, st.lists(blobs, max_size=5)),
    st.builds(GetInfoResponse, u64, statuses, st.dictionaries(st.text(max_size=10), i64 | st.booleans() | st.text(max_size=10), max_size=5)),
    st.builds(ListEntriesResponse, u64, statuses, u64, st.lists(st.tuples(u64, u64), max_size=5)),
)


def frames_of(data: bytes, frame_bytes_max: int = 1 << 20, chunk: int | None = None):
    decoder = FrameDecoder(frame_bytes_max)
    found = []
    step = chunk or len(data) or 1
    for start in range(0, len(data), step):
        decoder.feed(data[start : start + step])
        found.extend(decoder.frames())
    return found, decoder


@given(st.lists(requests, max_size=8), st.integers(1, 64))
def test_requests_round_trip_through_frames_split_anywhere(messages, chunk):
    data = b"".join(encode_request(message) for message in messages)
    frames, decoder = frames_of(data, chunk=chunk)
    assert [decode_request(fields) for fields in frames] == messages
    assert decoder.buffered_bytes == 0


@given(st.lists(responses, max_size=8), st.integers(1, 64))
def test_responses_round_trip_through_frames_split_anywhere(messages, chunk):
    data = b"".join(encode_response(message) for message in messages)
    frames, _ = frames_of(data, chunk=chunk)
    assert [decode_response(fields) for fields in frames] == messages


@given(st.integers(0, 2**31), st.text(max_size=30), statuses, u64.filter(lambda n: n < 2**31), st.integers(1, 2**32 - 1))
def test_handshake_round_trips(version, name, status, reply_version, frame_max):
    (hello,), _ = frames_of(encode_hello(Hello(version, name)))
    assert decode_hello(hello) == Hello(version, name)
    reply = HelloReply(status, reply_version, name, frame_max)
    (fields,), _ = frames_of(encode_hello_reply(reply))
    assert decode_hello_reply(fields) == reply


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_protocol_error_only(data):
    decoder = FrameDecoder(1 << 16)
    decoder.feed(data)
    try:
        for fields in decoder.frames():
            decode_request(fields)
    except ProtocolError:
        pass


@settings(max_examples=500)
@given(st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.binary(max_size=5), st.text(max_size=5), st.booleans(), st.floats(allow_nan=False), st.lists(i64, max_size=3)), max_size=9))
def test_random_arrays_decode_or_raise_protocol_error_only(fields):
    frame = encode_frame(fields) if fields else encode_frame([0])
    decoder = FrameDecoder(1 << 16)
    decoder.feed(frame)
    try:
        for decoded in decoder.frames():
            decode_request(decoded)
            decode_response(decoded)
    except ProtocolError:
        pass


def test_a_frame_longer_than_the_bound_is_refused_before_it_is_buffered():
    decoder = FrameDecoder(1024)
    decoder.feed(struct.pack(">I", 1025))
    with pytest.raises(ProtocolError, match="exceeds the bound"):
        list(decoder.frames())


@pytest.mark.parametrize(
    "body, message",
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb({"a": 1}), "non-empty msgpack array"),
        (msgpack.packb([]), "non-empty msgpack array"),
    ],
)
def test_malformed_bodies(body, message):
    decoder = FrameDecoder(1024)
    decoder.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(ProtocolError, match=message):
        list(decoder.frames())


def test_empty_frame_is_a_protocol_error():
    decoder = FrameDecoder(1024)
    decoder.feed(struct.pack(">I", 0))
    with pytest.raises(ProtocolError):
        list(decoder.frames())


@pytest.mark.parametrize(
    "fields",
    [
        [99, 1],  # unknown op
        [1, -1, 0, b"k", b"e"],  # negative request id
        [1, 1, 0, "text key", b"e"],  # key must be binary
        [1, 1, 0, b"k"],  # missing field
        [2, 1, 0, 2**64, 0, None, None, None],  # ledger id out of range
        [2, 1, 0, 1, -2, None, None, None],  # entry id below LAST_ADD_CONFIRMED
        [4, 1, 1, 0, 0, 10],  # entries_max 0
        [True, 1],  # a boolean is not an op
        [7, 1, []],  # a batch of no adds
        [7, 1, [0, b"k"]],  # not whole triples
        [7, 1, [0, "k", b"e"]],  # key must be binary
        [7, 1, [0, b"k", b"e", -1, b"k", b"e"]],  # negative flags
        [7, 1, [0, b"k", None]],  # entry must be binary
        [7, 1, b"adds"],  # not an array
        [7, 1],  # missing field
        [7, 1, [0, b"k", b"e"] * 1_025],  # past ADD_BATCH_ADDS_MAX
    ],
)
def test_ill_shaped_requests(fields):
    with pytest.raises(ProtocolError):
        decode_request(fields)


def test_the_first_frame_must_be_a_hello():
    with pytest.raises(ProtocolError, match="HELLO"):
        decode_hello([1, 1, 0, b"k", b"e"])


def test_decoder_compacts_its_buffer():
    frame = encode_request(AddRequest(1, 0, b"k", b"x" * 1000))
    decoder = FrameDecoder()
    for _ in range(1000):
        decoder.feed(frame)
        assert len(list(decoder.frames())) == 1
    assert len(decoder._buffer) < 200_000


@given(st.integers(0, 2**64 - 1), st.integers(0, 255), st.binary(min_size=1, max_size=64), st.binary(max_size=4096))
def test_an_add_encoded_once_for_many_bookies_is_the_same_frame(request_id, flags, master_key, entry):
    # The ledger client encodes an entry's tail once and prefixes a request
    # id per bookie; the bytes must be exactly those of a plain ADD.
    from bookie.protocol.wire import encode_add, encode_add_head, encode_add_tail

    tail = encode_add_tail(flags, master_key, entry)
    assert encode_add_head(request_id, len(tail)) + tail == encode_add(request_id, flags, master_key, entry)


@pytest.mark.parametrize("entry_bytes", [0, 255, 256, 65_535, 65_536, 70_000])
@pytest.mark.parametrize("request_id", [0, 127, 65_535, 65_536, 2**32 - 1, 2**32])
def test_an_add_encoded_once_is_the_same_frame_at_every_size_boundary(request_id, entry_bytes):
    from bookie.protocol.wire import encode_add, encode_add_head, encode_add_tail

    entry = bytes(range(256)) * (entry_bytes // 256) + bytes(entry_bytes % 256)
    tail = encode_add_tail(3, b"key", entry)
    assert encode_add_head(request_id, len(tail)) + tail == encode_add(request_id, 3, b"key", entry)


@pytest.mark.parametrize(
    "fields",
    [
        [7, 1, 2, [0]],  # one status for two adds
        [7, 1, 0, 0],  # no adds
        [7, 1, 2, 99],  # unknown status
        [7, 1, 2, [0, 99]],  # unknown status in the list
        [7, 1, 2],  # missing field
        [7, -1, 2, 0],  # negative request id
    ],
)
def test_ill_shaped_batch_answers(fields):
    from bookie.protocol.wire import add_batch_ok_fields

    with pytest.raises(ProtocolError):
        decode_response(fields)
    assert add_batch_ok_fields(fields) is None


def test_a_batch_answer_sends_one_status_when_all_agree():
    from bookie.protocol.wire import add_batch_ok_fields

    (all_ok,), _ = frames_of(encode_response(AddBatchResponse(3, [Status.OK] * 4)))
    assert all_ok == [7, 3, 4, 0] and add_batch_ok_fields(all_ok) == (3, 4)
    (mixed,), _ = frames_of(encode_response(AddBatchResponse(3, [Status.OK, Status.FENCED])))
    assert mixed == [7, 3, 2, [0, 6]] and add_batch_ok_fields(mixed) is None
    (all_fenced,), _ = frames_of(encode_response(AddBatchResponse(3, [Status.FENCED] * 2)))
    assert decode_response(all_fenced) == AddBatchResponse(3, [Status.FENCED] * 2) and add_batch_ok_fields(all_fenced) is None


# Counts either side of msgpack's array-header forms for 3 * count elements:
# fixarray (up to 15), array16 (up to 65,535), array32; and either side of
# the bound of adds a bookie takes in one batch.
@pytest.mark.parametrize("count", [1, 5, 6, 1_024, 1_025, 21_845, 21_846])
@pytest.mark.parametrize("request_id", [0, 65_536, 2**32])
def test_a_batch_joined_from_encoded_tails_is_the_frame_of_its_request(count, request_id):
    from bookie.protocol.wire import ADD_BATCH_ADDS_MAX, encode_add_batch_head, encode_add_tail

    adds = [(index % 2, b"key", b"entry %d" % index) for index in range(count)]
    tails = [encode_add_tail(*add) for add in adds]
    frame = encode_add_batch_head(request_id, count, sum(map(len, tails))) + b"".join(tails)
    request = AddBatchRequest(request_id, [field for add in adds for field in add])
    assert frame == encode_request(request)
    (fields,), _ = frames_of(frame, frame_bytes_max=1 << 24)
    if count <= ADD_BATCH_ADDS_MAX:
        assert decode_request(fields) == request
    else:
        with pytest.raises(ProtocolError, match="exceeds the bound"):
            decode_request(fields)


def test_protocol_2_is_spoken_and_a_client_gathers_no_more_than_a_bookie_takes():
    from bookie.protocol.wire import ADD_BATCH_ADDS_MAX, PROTOCOL_VERSION, PROTOCOL_VERSION_MIN
    from ledger_client.bookie_client import ADD_BATCH_GATHER_ADDS

    assert (PROTOCOL_VERSION_MIN, PROTOCOL_VERSION) == (1, 2)
    assert ADD_BATCH_GATHER_ADDS <= ADD_BATCH_ADDS_MAX


def test_every_message_type_has_annotations_that_resolve():
    # Strategies built from the types (hypothesis's st.builds) and any other
    # reader of the annotations need every name in them importable.
    for name in messages.__all__:
        value = getattr(messages, name)
        if isinstance(value, type):
            typing.get_type_hints(value)
