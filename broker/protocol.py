"""The broker wire protocol: the framing the bookie's uses too (`framing`:
4-byte length + msgpack array, bounded by `frame_bytes_max`), with the
broker's own commands.

Pure code, as `bookie.protocol.wire`: `encode(message)` gives a frame and
`decode(fields)` checks a decoded array against the command's schema,
raising `ProtocolError` for anything malformed (the driver then closes that
one connection). Each message is a dataclass; its fields, in order, are the
array after the command number.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields as dataclass_fields
from typing import Any, Callable

from framing.codec import FRAME_BYTES_MAX_DEFAULT, FrameDecoder, ProtocolError, describe, encode_frame

# 2: a SEND's body is the producer's message in Pulsar's layout; 3: CONNECT
# carries credentials and CONNECTED says why it refused them.
PROTOCOL_VERSION = 4
AUTH_DATA_BYTES_MAX = 64 * 1024
I64_MAX = 2**63 - 1
NAME_BYTES_MAX = 256
KEYS_MAX = 100_000  # messages in one batch
OFFSETS_MAX = 100_000  # offsets in one ack or redelivery
# Items of all arrays and maps of one client frame together: a SEND's keys or
# an ACK's offsets, the fields around them, and an admin request's arguments.
REQUEST_ITEMS_MAX = max(KEYS_MAX, OFFSETS_MAX) + 1024


class Command(enum.IntEnum):
    CONNECT = 0
    CONNECTED = 1
    LOOKUP = 2
    PRODUCER = 3
    SEND = 4
    SEND_RECEIPT = 5
    CLOSE_PRODUCER = 6
    SUBSCRIBE = 7
    FLOW = 8
    MESSAGE = 9
    ACK = 10
    REDELIVER = 11
    SEEK = 12
    CLOSE_CONSUMER = 13
    UNSUBSCRIBE = 14
    RESPONSE = 15
    CLOSED = 16
    ADMIN = 17
    PING = 18  # either side, after a silence: the other answers PONG
    PONG = 19


# --- field checks -----------------------------------------------------------------


def _int(low: int, high: int) -> Callable[[Any, str], int]:
    def check(value: Any, name: str) -> int:
        if type(value) is not int or not low <= value <= high:
            raise ProtocolError(f"field {name} must be an integer in [{low}, {high}], got {describe(value)}")
        return value

    return check


def _str(value: Any, name: str) -> str:
    if type(value) is not str or len(value) > NAME_BYTES_MAX:
        raise ProtocolError(f"field {name} must be a string of at most {NAME_BYTES_MAX} characters")
    return value


def _text(value: Any, name: str) -> str:
    if type(value) is not str:
        raise ProtocolError(f"field {name} must be a string")
    return value


def _bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"field {name} must be a boolean")
    return value


def _bytes(value: Any, name: str) -> bytes:
    if type(value) is not bytes:
        raise ProtocolError(f"field {name} must be binary")
    return value


def _bytes_max(bytes_max: int):
    def bounded(value: Any, name: str) -> bytes:
        if type(value) is not bytes or len(value) > bytes_max:
            raise ProtocolError(f"field {name} must be binary of at most {bytes_max} bytes")
        return value
    return bounded


def _optional(check):
    def optional(value: Any, name: str):
        return None if value is None else check(value, name)

    return optional


def _int_list(low: int, high: int, length_max: int):
    item = _int(low, high)

    def check(value: Any, name: str) -> list[int]:
        if type(value) is not list or len(value) > length_max:
            raise ProtocolError(f"field {name} must be a list of at most {length_max} integers")
        for element in value:
            item(element, name)
        return value

    return check


def _map(value: Any, name: str) -> dict:
    if type(value) is not dict or not all(type(key) is str for key in value):
        raise ProtocolError(f"field {name} must be a map with string keys")
    return value


_u32 = _int(0, 2**32 - 1)
_id = _int(0, I64_MAX)  # request ids, handles, ledger ids, sequence ids are non-negative i64
_i64 = _int(-(2**63), I64_MAX)
_offset = _int(-1, I64_MAX)


# --- messages ---------------------------------------------------------------------


@dataclass(slots=True)
class Connect:
    protocol_version: int
    client_name: str
    auth_method: str  # "token", or "" (none, or a TLS client certificate)
    auth_data: bytes  # the token


@dataclass(slots=True)
class Connected:
    status: int
    protocol_version: int
    broker_id: str
    frame_bytes_max: int
    message: str  # why the broker refused the connection ("" when it did not)


@dataclass(slots=True)
class Lookup:
    request_id: int
    topic: str  # a partition's name
    authoritative: bool  # the asking client was redirected here: take the topic if nobody owns it


@dataclass(slots=True)
class ProducerOpen:
    request_id: int
    producer_handle: int
    topic: str
    producer_id: str


@dataclass(slots=True)
class Send:
    """A producer's message or batch. `body` is it in Pulsar's layout
    (`broker/pulsar_message.py`): its metadata tells the codec, the keys,
    properties and event times; the fields beside it are what the broker
    checks it against."""

    producer_handle: int
    first_sequence_id: int
    last_sequence_id: int
    message_count: int
    body: bytes


@dataclass(slots=True)
class SendReceipt:
    producer_handle: int
    last_sequence_id: int
    status: int
    ledger_id: int
    entry_id: int
    first_offset: int
    message: str


@dataclass(slots=True)
class CloseProducer:
    request_id: int
    producer_handle: int


@dataclass(slots=True)
class Subscribe:
    request_id: int
    consumer_handle: int
    topic: str
    subscription: str
    subscription_type: str
    consumer_name: str
    priority: int
    initial_position: str  # "earliest" | "latest"
    durable: bool
    important: bool
    start_offset: int | None  # a non-durable reader's first offset
    read_compacted: bool  # read the partition's compacted view, then what follows it (exclusive and failover only)


@dataclass(slots=True)
class Flow:
    consumer_handle: int
    permits: int


@dataclass(slots=True)
class MessageDelivery:
    consumer_handle: int
    ledger_id: int
    entry_id: int
    batch_indexes: list[int]  # which messages of the entry are delivered (the others were acknowledged)
    redelivery_count: int
    entry: bytes


@dataclass(slots=True)
class Ack:
    request_id: int
    consumer_handle: int
    cumulative: bool
    offsets: list[int]


@dataclass(slots=True)
class Redeliver:
    consumer_handle: int
    offsets: list[int] | None  # None: every message delivered to this consumer and not acknowledged


@dataclass(slots=True)
class Seek:
    request_id: int
    consumer_handle: int
    offset: int | None
    publish_time_ms: int | None
    message_id: list[int] | None  # [ledger id, entry id, batch index]


@dataclass(slots=True)
class CloseConsumer:
    request_id: int
    consumer_handle: int


@dataclass(slots=True)
class Unsubscribe:
    request_id: int
    consumer_handle: int


@dataclass(slots=True)
class Response:
    request_id: int
    status: int
    message: str
    body: dict


@dataclass(slots=True)
class Closed:
    kind: str  # "producer" | "consumer"
    handle: int
    message: str


@dataclass(slots=True)
class Admin:
    request_id: int
    action: str
    arguments: dict


@dataclass(slots=True)
class Ping:
    """Are you there? (Sent after a silence; a peer silent for two keep-alive
    intervals is taken for gone and its connection closed.)"""


@dataclass(slots=True)
class Pong:
    """Here (the answer to a PING)."""


_SCHEMAS: dict[type, tuple[Command, tuple]] = {
    Connect: (Command.CONNECT, (_u32, _str, _str, _bytes_max(AUTH_DATA_BYTES_MAX))),
    Connected: (Command.CONNECTED, (_u32, _u32, _str, _u32, _text)),
    Lookup: (Command.LOOKUP, (_id, _str, _bool)),
    ProducerOpen: (Command.PRODUCER, (_id, _id, _str, _str)),
    Send: (Command.SEND, (_id, _id, _id, _int(1, KEYS_MAX), _bytes)),
    SendReceipt: (Command.SEND_RECEIPT, (_id, _id, _u32, _i64, _i64, _offset, _text)),
    CloseProducer: (Command.CLOSE_PRODUCER, (_id, _id)),
    Subscribe: (Command.SUBSCRIBE, (_id, _id, _str, _str, _str, _str, _i64, _str, _bool, _bool, _optional(_offset), _bool)),
    Flow: (Command.FLOW, (_id, _u32)),
    MessageDelivery: (Command.MESSAGE, (_id, _id, _id, _int_list(0, KEYS_MAX, KEYS_MAX), _u32, _bytes)),
    Ack: (Command.ACK, (_id, _id, _bool, _int_list(0, I64_MAX, OFFSETS_MAX))),
    Redeliver: (Command.REDELIVER, (_id, _optional(_int_list(0, I64_MAX, OFFSETS_MAX)))),
    Seek: (Command.SEEK, (_id, _id, _optional(_offset), _optional(_i64), _optional(_int_list(0, I64_MAX, 3)))),
    CloseConsumer: (Command.CLOSE_CONSUMER, (_id, _id)),
    Unsubscribe: (Command.UNSUBSCRIBE, (_id, _id)),
    Response: (Command.RESPONSE, (_id, _u32, _text, _map)),
    Closed: (Command.CLOSED, (_str, _id, _text)),
    Admin: (Command.ADMIN, (_id, _str, _map)),
    Ping: (Command.PING, ()),
    Pong: (Command.PONG, ()),
}
_BY_COMMAND = {command: (cls, checks) for cls, (command, checks) in _SCHEMAS.items()}
_COMMAND_NUMBERS = frozenset(int(command) for command in _BY_COMMAND)
_FIELD_NAMES = {cls: tuple(field.name for field in dataclass_fields(cls)) for cls in _SCHEMAS}
for _cls, (_command, _checks) in _SCHEMAS.items():
    assert len(_checks) == len(_FIELD_NAMES[_cls]), _cls

Message = Any  # one of the dataclasses above


def encode(message: Message) -> bytes:
    cls = type(message)
    command = _SCHEMAS[cls][0]
    return encode_frame([command, *(getattr(message, name) for name in _FIELD_NAMES[cls])])


def decode(fields: list[Any]) -> Message:
    """A frame's array as a message; `ProtocolError` if it is not one."""
    if type(fields) is not list or not fields:
        raise ProtocolError(f"a message is a non-empty array, got {describe(fields)}")
    # `type(...) is int`: true and 1.0 equal 1 but are not a command number.
    if type(fields[0]) is not int or fields[0] not in _COMMAND_NUMBERS:
        raise ProtocolError(f"unknown command {describe(fields[0])}")
    cls, checks = _BY_COMMAND[Command(fields[0])]
    if len(fields) != len(checks) + 1:
        raise ProtocolError(f"{cls.__name__} has {len(checks)} fields, got {len(fields) - 1}")
    names = _FIELD_NAMES[cls]
    return cls(*(check(value, name) for check, value, name in zip(checks, fields[1:], names)))


__all__ = [
    "Ack",
    "Admin",
    "Closed",
    "CloseConsumer",
    "CloseProducer",
    "Command",
    "Connect",
    "Connected",
    "FRAME_BYTES_MAX_DEFAULT",
    "Flow",
    "FrameDecoder",
    "Lookup",
    "MessageDelivery",
    "PROTOCOL_VERSION",
    "Ping",
    "Pong",
    "REQUEST_ITEMS_MAX",
    "ProducerOpen",
    "ProtocolError",
    "Redeliver",
    "Response",
    "Seek",
    "Send",
    "SendReceipt",
    "Subscribe",
    "Unsubscribe",
    "decode",
    "encode",
]
