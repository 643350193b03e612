"""Malformed and hostile frames for the bookie and broker protocols, drawn
from a `random.Random`: the fuzz tests (through hypothesis's seeded randoms)
and the soak benchmark send them to real processes, which must close the
offending connection and go on serving everyone else.

Each case is a `FuzzCase`: whether a valid handshake goes first, and the
bytes that follow. The kinds cover random bytes, truncated frames, values
nested at many depths, wrong types in every field, huge counts and lengths
declared in headers, and well-formed requests with invalid field values.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from bookie.protocol import wire
from bookie.protocol.entry_format import DigestManager, DigestType, master_key
from broker import protocol as broker_protocol
from broker.codecs import Codec
from broker.pulsar import wire as pulsar_wire
from broker.pulsar.pulsar_api_pb2 import MessageIdData
from broker.pulsar_message import OutMessage, build_batch
from framing.codec import LENGTH_PREFIX

BOOKIE = "bookie"
BROKER = "broker"
PULSAR = "pulsar"  # a broker's Pulsar listener
DEPTH_CHOICES = (2, 15, 16, 17, 100, 1000, 1023, 1024, 1025, 5000)


@dataclass(frozen=True)
class FuzzCase:
    kind: str
    handshake: bool
    payload: bytes


def handshake(protocol: str) -> bytes:
    if protocol == BOOKIE:
        return wire.encode_hello(wire.Hello(wire.PROTOCOL_VERSION, "fuzz"))
    if protocol == PULSAR:
        return pulsar_wire.encode(pulsar_wire.command(pulsar_wire.Type.CONNECT, client_version="fuzz", protocol_version=21))
    return broker_protocol.encode(broker_protocol.Connect(broker_protocol.PROTOCOL_VERSION, "fuzz", "", b""))


def frame(value: Any) -> bytes:
    body = msgpack.packb(value, use_bin_type=True)
    return LENGTH_PREFIX.pack(len(body)) + body


def _scalar(rng: random.Random) -> Any:
    choice = rng.randrange(9)
    if choice == 0:
        return None
    if choice == 1:
        return rng.random() < 0.5
    if choice == 2:
        return rng.choice((-1, 0, 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1))
    if choice == 3:
        return rng.randrange(-(2**63), 2**64)
    if choice == 4:
        return rng.random() * 1e6
    if choice == 5:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(0, 300)))
    if choice == 6:
        return rng.randbytes(rng.randrange(0, 300))
    if choice == 7:
        return rng.choice(("", "x" * 257, "persistent://public/default/t", "\x00"))
    return rng.choice((b"", b"\x00" * 40))


def random_value(rng: random.Random, depth: int = 3) -> Any:
    """Any msgpack value: scalars, and arrays and maps of them a few levels deep."""
    if depth <= 0 or rng.random() < 0.5:
        return _scalar(rng)
    if rng.random() < 0.6:
        return [random_value(rng, depth - 1) for _ in range(rng.randrange(0, 6))]
    return {str(_scalar(rng))[:20]: random_value(rng, depth - 1) for _ in range(rng.randrange(0, 5))}


def nested(depth: int, inner: Any = None) -> bytes:
    """The msgpack bytes of `inner` inside `depth` arrays of one."""
    return b"\x91" * depth + msgpack.packb(inner, use_bin_type=True)


def _bookie_requests(rng: random.Random) -> list[list[Any]]:
    # A few ledgers, far from the ids real tests use: a valid add creates
    # the ledger on the bookie, which is data kept, not hostility.
    ledger_id = (1 << 40) + rng.randrange(8)
    digest = DigestManager(ledger_id, DigestType.CRC32C, b"fuzz")
    entry = digest.encode(0, -1, 1, b"x")
    key = master_key(b"fuzz")
    request_id = rng.randrange(1 << 32)
    return [
        [1, request_id, 0, key, entry],
        [7, request_id, [0, key, entry] * rng.randrange(1, 4)],
        [2, request_id, 0, ledger_id, 0, None, None, None],
        [2, request_id, 1, ledger_id, -1, key, None, None],
        [2, request_id, 0, ledger_id, 0, None, 0, 5],
        [3, request_id, ledger_id],
        [4, request_id, ledger_id, 0, 100, 1 << 20],
        [5, request_id],
        [6, request_id, ledger_id, 0, 10],
    ]


def _broker_requests(rng: random.Random) -> list[list[Any]]:
    request_id = rng.randrange(1 << 32)
    # A few topics only: a valid request for a new topic makes the broker
    # load it (a ledger, ZooKeeper writes), which is load, not hostility.
    topic = f"fuzz-{rng.randrange(8)}"
    return [
        [2, request_id, topic, False],
        [3, request_id, 1, topic, "fuzz-producer"],
        [4, 1, 0, 0, 1, b"\x00"],
        [6, request_id, 1],
        [7, request_id, 1, topic, "sub", "shared", "fuzz", 0, "earliest", True, False, None],
        [8, 1, 100],
        [10, request_id, 1, False, [0, 1, 2]],
        [11, 1, None],
        [12, request_id, 1, 0, None, None],
        [13, request_id, 1],
        [14, request_id, 1],
        [17, request_id, "topic-stats", {"topic": topic}],
        [17, request_id, "create-topic", {"topic": topic, "partitions": rng.choice((0, 1, -1, 2**40, "x", [1]))}],
    ]


def _invalid_value(rng: random.Random, valid: Any) -> Any:
    """A value of the wrong type or out of range for a field that held `valid`."""
    if type(valid) is int and rng.random() < 0.5:
        return rng.choice((-1, -(2**63), 2**63, 2**64 - 1, valid + (1 << 62)))
    if rng.random() < 0.2:
        return msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randrange(10)))
    return random_value(rng, depth=2)


def _hostile_header(rng: random.Random) -> bytes:
    """A frame whose headers declare far more than follows."""
    choice = rng.randrange(6)
    if choice == 0:
        return LENGTH_PREFIX.pack(rng.randrange(1 << 32))  # a length prefix alone, any size
    if choice == 1:
        body = b"\xdd" + struct.pack(">I", rng.randrange(1 << 32)) + b"\xc0" * rng.randrange(10)  # array32
    elif choice == 2:
        body = b"\xdf" + struct.pack(">I", rng.randrange(1 << 32)) + b"\xa1a\xc0"  # map32
    elif choice == 3:
        body = b"\x95\x01\x01\x00\xc6" + struct.pack(">I", rng.randrange(1 << 32)) + b"k"  # bin32 master key
    elif choice == 4:
        body = b"\xdb" + struct.pack(">I", rng.randrange(1 << 32)) + b"abc"  # str32
    else:
        count = rng.choice((65535, 100_001, 3 * wire.ADD_BATCH_ADDS_MAX + 3))
        body = b"\xdc" + struct.pack(">H", min(count, 65535)) + b"\x90" * min(count, 65535)  # many empty arrays
    return LENGTH_PREFIX.pack(len(body)) + body


def _many_items(rng: random.Random) -> bytes:
    """A frame that decodes to far more Python objects than it has bytes:
    many small integers, many empty arrays or maps (one byte each on the
    wire), or a count declared far past what follows."""
    count = rng.choice((10_000, 65_535, 300_000, 4_000_000))
    filler = rng.choice((b"\x90", b"\x80", b"\xcd\x01\x00"))  # empty array, empty map, a 16-bit integer
    if rng.random() < 0.2:
        filler = filler[:1] * rng.randrange(0, 3)  # fewer items than declared
        count = rng.choice((2**20, 2**32 - 1))
        return _frame_body(b"\xdd" + struct.pack(">I", count) + filler)
    if count <= 65_535:
        return _frame_body(b"\xdc" + struct.pack(">H", count) + filler * count)
    return _frame_body(b"\xdd" + struct.pack(">I", count) + filler * count)


def _frame_body(body: bytes) -> bytes:
    return LENGTH_PREFIX.pack(len(body)) + body


def _pulsar_requests(rng: random.Random) -> list[bytes]:
    """Well-formed Pulsar commands (frames), as a client sends them."""
    Type, command, encode = pulsar_wire.Type, pulsar_wire.command, pulsar_wire.encode
    request_id = rng.randrange(1 << 32)
    topic = f"persistent://public/default/fuzz-{rng.randrange(8)}"
    message = build_batch("fuzz-producer", 0, [OutMessage(index, b"x" * rng.randrange(20), rng.choice((None, "k")))
                                               for index in range(rng.randrange(1, 5))], rng.choice(list(Codec)))
    return [
        encode(command(Type.LOOKUP, topic=topic, request_id=request_id)),
        encode(command(Type.PARTITIONED_METADATA, topic=topic, request_id=request_id)),
        encode(command(Type.PRODUCER, topic=topic, producer_id=1, request_id=request_id, producer_name="fuzz-producer")),
        encode(command(Type.SEND, producer_id=1, sequence_id=0, num_messages=rng.randrange(0, 6)), message),
        encode(command(Type.SUBSCRIBE, topic=topic, subscription="sub", subType=rng.randrange(4), consumer_id=1,
                       request_id=request_id)),
        encode(command(Type.FLOW, consumer_id=1, messagePermits=rng.randrange(1 << 32))),
        encode(command(Type.ACK, consumer_id=1, ack_type=rng.randrange(2),
                       message_id=[MessageIdData(ledgerId=rng.randrange(1 << 64), entryId=rng.randrange(1 << 64),
                                                 ack_set=[rng.randrange(-(1 << 63), 1 << 63)])])),
        encode(command(Type.REDELIVER_UNACKNOWLEDGED_MESSAGES, consumer_id=1)),
        encode(command(Type.SEEK, consumer_id=1, request_id=request_id, message_publish_time=rng.randrange(1 << 64))),
        encode(command(Type.GET_TOPICS_OF_NAMESPACE, request_id=request_id, namespace="public/default",
                       topics_pattern=rng.choice(("fuzz.*", "(", "[a-")))),
        encode(command(Type.GET_LAST_MESSAGE_ID, consumer_id=1, request_id=request_id)),
        encode(command(Type.CLOSE_CONSUMER, consumer_id=1, request_id=request_id)),
        encode(command(Type.CLOSE_PRODUCER, producer_id=1, request_id=request_id)),
        encode(command(Type.PING)),
    ]


def _pulsar_frame(command_bytes: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">II", 4 + len(command_bytes) + len(payload), len(command_bytes)) + command_bytes + payload


def _flip(rng: random.Random, data: bytes) -> bytes:
    """`data` with a few bytes changed (past the frame's sizes, mostly)."""
    changed = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        changed[rng.randrange(min(8, len(changed) - 1) if rng.random() < 0.1 else 8, len(changed))] = rng.randrange(256)
    return bytes(changed)


def _pulsar_case(rng: random.Random) -> tuple[str, bytes]:
    requests = _pulsar_requests(rng)
    kinds: list[tuple[str, Callable[[], bytes]]] = [
        ("random bytes", lambda: rng.randbytes(rng.randrange(1, 2048))),
        ("random command", lambda: _pulsar_frame(rng.randbytes(rng.randrange(1, 200)))),
        ("truncated", lambda: (lambda whole: whole[: rng.randrange(1, len(whole))])(rng.choice(requests))),
        ("flipped bytes", lambda: _flip(rng, rng.choice(requests))),
        ("hostile sizes", lambda: struct.pack(">II", rng.choice((0, 3, 4, 1 << 31, (1 << 32) - 1, rng.randrange(1 << 32))),
                                              rng.randrange(1 << 32)) + rng.randbytes(rng.randrange(40))),
        ("command past its frame", lambda: struct.pack(">II", 20, 100) + rng.randbytes(16)),
        ("type without its command", lambda: _pulsar_frame(bytes([0x08, rng.choice((4, 5, 6, 9, 10, 23, 99, 200))]))),
        ("many commands", lambda: b"".join(rng.choice(requests) for _ in range(rng.randrange(2, 50)))),
        ("valid then bad", lambda: rng.choice(requests) + _pulsar_frame(rng.randbytes(rng.randrange(1, 50)))),
    ]
    kind, make = rng.choice(kinds)
    return kind, make()


def fuzz_case(rng: random.Random, protocol: str) -> FuzzCase:
    """One hostile case for `protocol` (BOOKIE, BROKER or PULSAR)."""
    if protocol == PULSAR:
        kind, payload = _pulsar_case(rng)
        return FuzzCase(kind, rng.random() < 0.8, payload)
    requests = _bookie_requests(rng) if protocol == BOOKIE else _broker_requests(rng)
    kinds: list[tuple[str, Callable[[], bytes]]] = [
        ("random bytes", lambda: rng.randbytes(rng.randrange(1, 2048))),
        ("random frame", lambda: frame(random_value(rng))),
        ("random array", lambda: frame([random_value(rng) for _ in range(rng.randrange(1, 10))])),
        ("truncated", lambda: (lambda whole: whole[: rng.randrange(1, len(whole))])(frame(rng.choice(requests)))),
        ("nested", lambda: _nested_request(rng, requests)),
        ("wrong field", lambda: _wrong_field(rng, requests)),
        ("hostile header", lambda: _hostile_header(rng)),
        ("many items", lambda: _many_items(rng)),
        ("valid then bad", lambda: frame(rng.choice(requests)) + frame([random_value(rng)])),
    ]
    kind, make = rng.choice(kinds)
    # Most cases follow a valid handshake (the request paths); some are the
    # first frame (the handshake's own decoding).
    return FuzzCase(kind, rng.random() < 0.8, make())


def _nested_request(rng: random.Random, requests: list[list[Any]]) -> bytes:
    request = rng.choice(requests)
    position = rng.randrange(len(request))
    depth = rng.choice(DEPTH_CHOICES)
    parts = [msgpack.packb(value, use_bin_type=True) for value in request]
    parts[position] = nested(depth, request[position])
    body = bytes([0x90 | len(request)]) + b"".join(parts)
    return LENGTH_PREFIX.pack(len(body)) + body


def _wrong_field(rng: random.Random, requests: list[list[Any]]) -> bytes:
    request = list(rng.choice(requests))
    position = rng.randrange(len(request))
    request[position] = _invalid_value(rng, request[position])
    if rng.random() < 0.2:
        request = request[: rng.randrange(len(request))] if rng.random() < 0.5 else request + [random_value(rng)]
    try:
        return frame(request)
    except (OverflowError, TypeError, ValueError):
        return frame([request[0]])


def send_case(host: str, port: int, protocol: str, case: FuzzCase, timeout_s: float = 5.0) -> bytes:
    """Send one case on a fresh connection, say that nothing more follows,
    and read until the process closes it; returns what it answered. A
    process that keeps the connection open past `timeout_s` raises
    `TimeoutError`: after the client's end of stream every bad or finished
    connection must be closed."""
    import errno
    import socket

    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        try:
            if case.handshake:
                sock.sendall(handshake(protocol))
            sock.sendall(case.payload)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            return b""  # closed on us while we sent: the outcome we want
        except OSError as error:
            if error.errno != errno.ENOTCONN:
                raise
            return b""  # closed and reset before our end of stream: the same
        answered = bytearray()
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                return bytes(answered)
            except socket.timeout:
                raise TimeoutError(f"{protocol} kept a {case.kind} connection open for {timeout_s}s") from None
            if not data:
                return bytes(answered)
            answered += data


__all__ = ["BOOKIE", "BROKER", "PULSAR", "FuzzCase", "frame", "fuzz_case", "handshake", "nested", "random_value", "send_case"]
