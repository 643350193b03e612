"""The frame decoder's bounds, for the bookie's and the broker's protocol (one
decoder, each protocol with its own item bound): nesting depth, items in a
frame, counts declared past what a frame holds, extension types and invalid
UTF-8 are each a ProtocolError with a short message, never a RecursionError
or a large allocation; and `describe` names any value in bounded space."""

from __future__ import annotations

import struct
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import pytest

from bookie.protocol import wire
from broker import protocol as broker_protocol
from framing.codec import FRAME_DEPTH_MAX, FrameDecoder, ProtocolError, describe

FRAME_BYTES_MAX = 1024 * 1024
MESSAGE_CHARS_MAX = 200  # what an error message may take, whatever the frame holds


@dataclass(frozen=True)
class Protocol:
    items_max: int  # as the server's decoder is built (bookie.client_connections, broker.server)
    decode: Callable[[list[Any]], Any]  # a frame's array as a request


@pytest.fixture(
    params=[
        Protocol(wire.REQUEST_ITEMS_MAX, wire.decode_request),
        Protocol(broker_protocol.REQUEST_ITEMS_MAX, broker_protocol.decode),
    ],
    ids=["bookie", "broker"],
)
def protocol(request) -> Protocol:
    return request.param


def frames(body: bytes, protocol: Protocol) -> list[list[Any]]:
    """What a server's decoder makes of one frame holding `body`."""
    decoder = FrameDecoder(FRAME_BYTES_MAX, protocol.items_max)
    decoder.feed(struct.pack(">I", len(body)) + body)
    return list(decoder.frames())


def refused(body: bytes, protocol: Protocol, match: str | None = None) -> None:
    with pytest.raises(ProtocolError, match=match) as raised:
        frames(body, protocol)
    assert len(str(raised.value)) <= MESSAGE_CHARS_MAX


# --- nesting ------------------------------------------------------------------


def arrays(depth: int) -> bytes:
    """`depth` arrays, each holding the next; the innermost is empty."""
    return b"\x91" * (depth - 1) + b"\x90"


def maps(depth: int) -> bytes:
    """An array holding `depth - 1` maps, each the value of the one before."""
    return b"\x91" + b"\x81\xa1k" * (depth - 2) + b"\x80"


@pytest.mark.parametrize("nesting", [arrays, maps])
def test_nesting_to_the_bound_is_accepted(protocol, nesting):
    assert FRAME_DEPTH_MAX == 16
    [fields] = frames(nesting(FRAME_DEPTH_MAX), protocol)
    value, depth = fields, 1
    while value:
        value = value[0] if type(value) is list else value["k"]
        depth += 1
    assert depth == FRAME_DEPTH_MAX
    # Not a request: the message says so briefly.
    with pytest.raises(ProtocolError, match="an array of 1|a map of 1") as raised:
        protocol.decode(fields)
    assert len(str(raised.value)) <= MESSAGE_CHARS_MAX


@pytest.mark.parametrize("nesting", [arrays, maps])
@pytest.mark.parametrize("depth", [FRAME_DEPTH_MAX + 1, 1000, 5000])
def test_deeper_nesting_is_a_protocol_error_not_a_recursion_error(protocol, nesting, depth):
    refused(nesting(depth), protocol, "nested deeper than 16 levels" if depth == FRAME_DEPTH_MAX + 1 else None)


# --- items ------------------------------------------------------------------------


def test_a_frame_of_as_many_items_as_the_bound_is_accepted(protocol):
    # The array counts as an item itself.
    fields = [0] * (protocol.items_max - 1)
    assert frames(msgpack.packb(fields), protocol) == [fields]
    refused(msgpack.packb(fields + [0]), protocol, f"frame holds more than {protocol.items_max} items")


@pytest.mark.parametrize(
    "fields_of",
    [
        lambda items_max: [[0] * 1000] * (items_max // 1000 + 1),  # each array within the bound
        lambda items_max: [{str(key): 0 for key in range(500)}] * (items_max // 1000 + 1),
        lambda items_max: [[]] * items_max,  # one byte each on the wire, a list each in memory
    ],
    ids=["arrays", "maps", "empty arrays"],
)
def test_items_of_all_containers_together_are_bounded(protocol, fields_of):
    refused(msgpack.packb(fields_of(protocol.items_max)), protocol, f"frame holds more than {protocol.items_max} items")


# --- declared counts --------------------------------------------------------------------

HUGE_HEADERS = {
    "array32": b"\xdd\xff\xff\xff\xff",
    "map32": b"\xdf\xff\xff\xff\xff",
    "str32": b"\xdb\xff\xff\xff\xff",
    "bin32": b"\xc6\xff\xff\xff\xff",
    "ext32": b"\xc9\xff\xff\xff\xff\x05",
}


@pytest.mark.parametrize("header", HUGE_HEADERS.values(), ids=HUGE_HEADERS.keys())
@pytest.mark.parametrize("inside", [False, True], ids=["alone", "inside an array"])
def test_a_count_of_2_to_the_32_in_a_tiny_frame_is_refused_before_anything_is_allocated(protocol, header, inside):
    body = (b"\x92\x01" if inside else b"") + header + bytes(16)
    tracemalloc.start()
    try:
        refused(body, protocol)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 256 * 1024


# --- types ----------------------------------------------------------------------------

EXTENSIONS = {
    "ext": msgpack.packb([1, msgpack.ExtType(5, b"abc")]),
    "ext without data": msgpack.packb([1, msgpack.ExtType(5, b"")]),
    "timestamp32": msgpack.packb([1, msgpack.Timestamp(1, 0)]),
    "timestamp64": msgpack.packb([1, msgpack.Timestamp(1, 5)]),
    "timestamp96": msgpack.packb([1, msgpack.Timestamp(2**40, 5)]),
    "timestamp in a map": msgpack.packb([1, {"k": msgpack.Timestamp(1, 0)}]),
    "timestamp alone": msgpack.packb(msgpack.Timestamp(1, 0)),
}


@pytest.mark.parametrize("body", EXTENSIONS.values(), ids=EXTENSIONS.keys())
def test_extension_types_and_timestamps_are_refused(protocol, body):
    refused(body, protocol)


@pytest.mark.parametrize(
    "body",
    [b"\x92\x01\xa2\xff\xfe", b"\x92\x01\xd9\x02\xc3\x28", b"\x92\x01\x81\xa1\xff\x00"],
    ids=["fixstr", "str8", "map key"],
)
def test_invalid_utf8_is_refused(protocol, body):
    refused(body, protocol, "UnicodeDecodeError")


# --- describe -----------------------------------------------------------------------------

HUGE = 1_000_000


def deep_list(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda: "x" * HUGE, "'xxxxxxxx"),
        (lambda: b"x" * HUGE, f"binary of {HUGE} bytes"),
        (lambda: [0] * HUGE, f"an array of {HUGE}"),
        (lambda: dict.fromkeys(range(HUGE)), f"a map of {HUGE}"),
        (lambda: deep_list(100_000), "an array of 1"),  # repr() of it raises RecursionError
        (lambda: 2**100_000, "an integer beyond 64 bits"),
        (lambda: msgpack.Timestamp(1, 0), "Timestamp"),
    ],
    ids=["str", "bin", "array", "map", "deep array", "int", "timestamp"],
)
def test_describe_names_type_and_size_in_bounded_space(make, named):
    text = describe(make())
    assert named in text and len(text) <= 60, text
