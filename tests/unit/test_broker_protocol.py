"""The broker's wire messages: every message type round-trips through a
frame, and any malformed array raises ProtocolError and nothing else (the
server closes that one connection)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.protocol import (
    NAME_BYTES_MAX,
    Ack,
    Admin,
    CloseConsumer,
    Closed,
    CloseProducer,
    Command,
    Connect,
    Connected,
    Flow,
    FrameDecoder,
    Lookup,
    Ping,
    Pong,
    MessageDelivery,
    ProducerOpen,
    ProtocolError,
    Redeliver,
    Response,
    Seek,
    Send,
    SendReceipt,
    Subscribe,
    Unsubscribe,
    decode,
    encode,
)

u32 = st.integers(0, 2**32 - 1)
ids = st.integers(0, 2**63 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
offsets = st.integers(-1, 2**63 - 1)
names = st.text(max_size=12)
texts = st.text(max_size=40)
offset_lists = st.lists(ids, max_size=5)
json_like = st.recursive(
    st.none() | st.booleans() | i64 | st.floats(allow_nan=False) | texts | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(names, children, max_size=3),
    max_leaves=10,
)
maps = st.dictionaries(names, json_like, max_size=4)

MESSAGES = {
    Connect: st.builds(Connect, u32, names),
    Connected: st.builds(Connected, u32, u32, names, u32),
    Lookup: st.builds(Lookup, ids, names, st.booleans()),
    ProducerOpen: st.builds(ProducerOpen, ids, ids, names, names),
    Send: st.builds(Send, ids, ids, ids, st.integers(1, 100_000), st.binary(max_size=50)),
    SendReceipt: st.builds(SendReceipt, ids, ids, u32, i64, i64, offsets, texts),
    CloseProducer: st.builds(CloseProducer, ids, ids),
    Subscribe: st.builds(Subscribe, ids, ids, names, names, names, names, i64, names, st.booleans(), st.booleans(),
                         st.none() | offsets, st.booleans()),
    Flow: st.builds(Flow, ids, u32),
    MessageDelivery: st.builds(MessageDelivery, ids, ids, ids, st.lists(st.integers(0, 100_000), max_size=5), u32,
                               st.binary(max_size=50)),
    Ack: st.builds(Ack, ids, ids, st.booleans(), offset_lists),
    Redeliver: st.builds(Redeliver, ids, st.none() | offset_lists),
    Seek: st.builds(Seek, ids, ids, st.none() | offsets, st.none() | i64, st.none() | st.lists(ids, max_size=3)),
    CloseConsumer: st.builds(CloseConsumer, ids, ids),
    Unsubscribe: st.builds(Unsubscribe, ids, ids),
    Response: st.builds(Response, ids, u32, texts, maps),
    Closed: st.builds(Closed, names, ids, texts),
    Admin: st.builds(Admin, ids, names, maps),
    Ping: st.builds(Ping),
    Pong: st.builds(Pong),
}
messages = st.one_of(*MESSAGES.values())


def frames_of(data: bytes) -> list[list]:
    decoder = FrameDecoder()
    decoder.feed(data)
    return list(decoder.frames())


@settings(max_examples=1, deadline=None)
@given(st.data())
def test_every_command_has_a_message(data):
    assert {frames_of(encode(data.draw(strategy)))[0][0] for strategy in MESSAGES.values()} == set(Command)


@settings(max_examples=400, deadline=None)
@given(messages)
def test_every_message_round_trips_through_a_frame(message):
    [fields] = frames_of(encode(message))
    assert decode(fields) == message


def test_pipelined_frames_split_anywhere_decode_in_order():
    # Several messages in one stream, fed in pieces of 3 bytes.
    sent = [Flow(1, 100), Ack(2, 1, False, [5, 7]), Redeliver(1, None), Admin(3, "stats", {"topic": "orders"})]
    stream = b"".join(encode(message) for message in sent)
    decoder, received = FrameDecoder(), []
    for start in range(0, len(stream), 3):
        decoder.feed(stream[start : start + 3])
        received += [decode(fields) for fields in decoder.frames()]
    assert received == sent


def array(command: Command, *fields) -> list:
    """A command's array as it comes off the wire (the command as a plain int)."""
    return [int(command), *fields]


@pytest.mark.parametrize(
    "fields, complaint",
    [
        ([], "non-empty array"),
        ([99], "unknown command"),
        ([-1, 0], "unknown command"),
        (["FLOW", 1, 2], "unknown command"),
        ([None], "unknown command"),
        ([True, 0, 1, "broker", 1024], "unknown command"),  # true equals 1 (CONNECTED) but is no command number
        ([8.0, 1, 2], "unknown command"),
        ([[8], 1, 2], "unknown command"),
        (array(Command.FLOW, 1), "has 2 fields, got 1"),
        (array(Command.FLOW, 1, 2, 3), "has 2 fields, got 3"),
        (array(Command.FLOW, 1, -2), "permits"),
        (array(Command.FLOW, 1, 2**32), "permits"),
        (array(Command.FLOW, True, 2), "consumer_handle"),
        (array(Command.LOOKUP, 1, "t" * (NAME_BYTES_MAX + 1), False), "topic"),
        (array(Command.LOOKUP, 1, b"topic", False), "topic"),
        (array(Command.LOOKUP, 1, "topic", 0), "authoritative"),
        (array(Command.SEND, 1, 0, 0, 0, b""), "message_count"),
        (array(Command.SEND, 1, 0, 0, 1, "text"), "body"),
        (array(Command.ACK, 1, 1, False, [3, -1]), "offsets"),
        (array(Command.ACK, 1, 1, False, 3), "offsets"),
        (array(Command.SEEK, 1, 1, None, None, [1, 2, 3, 4]), "message_id"),
        (array(Command.SUBSCRIBE, 1, 1, "t", "s", "shared", "c", 0, "earliest", True, False, -2, False), "start_offset"),
        (array(Command.SUBSCRIBE, 1, 1, "t", "s", "shared", "c", 0, "earliest", True, False, None, 1), "read_compacted"),
        (array(Command.RESPONSE, 1, 0, "", {1: 2}), "body"),
        (array(Command.ADMIN, 1, "stats", []), "arguments"),
    ],
)
def test_malformed_arrays_raise_protocol_error(fields, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        decode(fields)


@pytest.mark.parametrize("fields", [None, 5, "abc", {}, {0: 1}, b"\x08"])
def test_something_other_than_an_array_raises_protocol_error(fields):
    with pytest.raises(ProtocolError):
        decode(fields)


# What a decoded frame can hold: msgpack has no integers past these.
msgpack_integers = st.integers(-(2**63), 2**64 - 1)
msgpack_values = st.recursive(
    st.none() | st.booleans() | msgpack_integers | st.floats(allow_nan=False) | texts | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(names | msgpack_integers, children, max_size=3),
    max_leaves=15,
)


def decode_only_raises_protocol_error(fields) -> None:
    try:
        message = decode(fields)
    except ProtocolError:
        return
    # Accepted: then it is a message that encodes back to the same array.
    assert type(message) in MESSAGES
    assert msgpack.unpackb(encode(message)[4:], strict_map_key=False) == fields


@settings(max_examples=500, deadline=None)
@given(st.lists(msgpack_values, max_size=13), st.integers(0, 21) | msgpack_values)
def test_arbitrary_arrays_only_ever_raise_protocol_error(rest, first):
    decode_only_raises_protocol_error([first, *rest])
    decode_only_raises_protocol_error(rest)


@settings(max_examples=500, deadline=None)
@given(messages, st.integers(0, 20), msgpack_values)
def test_a_valid_message_with_one_field_changed_only_ever_raises_protocol_error(message, place, value):
    # Close to valid arrays reach every field check: one field replaced by
    # anything, or one field dropped.
    [fields] = frames_of(encode(message))
    if len(fields) == 1:  # PING and PONG have no field to change: add one
        decode_only_raises_protocol_error([*fields, value])
        return
    index = 1 + place % (len(fields) - 1)
    changed = list(fields)
    changed[index] = value
    decode_only_raises_protocol_error(changed)
    decode_only_raises_protocol_error(fields[:index] + fields[index + 1 :])
