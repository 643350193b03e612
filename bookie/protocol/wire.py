"""The bookie wire protocol: the messages (their types are in `messages`)
inside the length-prefixed msgpack frames of `framing.codec`.

Pure code: frames' arrays in, messages out (and back), as h11 does for HTTP.
An array of the wrong shape, or a field of the wrong type or range, gets a
`ProtocolError` (the framing's), and the driver closes that one connection.
Error messages describe a peer's value by its type and size (`describe`),
never by formatting the value itself.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from bookie.protocol.messages import __all__ as _message_names
from bookie.protocol.messages import (  # re-exported: one import serves a codec's user
    ADD_BATCH_ADDS_MAX,
    AddBatchRequest,
    AddBatchResponse,
    AddFlag,
    AddRequest,
    AddResponse,
    BatchReadRequest,
    BatchReadResponse,
    GetInfoRequest,
    GetInfoResponse,
    Hello,
    HelloReply,
    LAST_ADD_CONFIRMED,
    ListEntriesRequest,
    ListEntriesResponse,
    Op,
    PROTOCOL_VERSION,
    PROTOCOL_VERSION_MIN,
    ReadFlag,
    ReadLacRequest,
    ReadLacResponse,
    ReadRequest,
    ReadResponse,
    Request,
    Response,
    Status,
)
from framing.codec import LENGTH_PREFIX, ProtocolError, describe, encode_frame

# A request to a bookie is a flat array, or an ADD_BATCH holding three items per add.
REQUEST_ITEMS_MAX = 3 * ADD_BATCH_ADDS_MAX + 16
U64_MAX = 2**64 - 1
I64_MIN = -(2**63)

_REQUEST_OPS: dict[type, Op] = {
    AddRequest: Op.ADD,
    ReadRequest: Op.READ,
    ReadLacRequest: Op.READ_LAC,
    BatchReadRequest: Op.BATCH_READ,
    GetInfoRequest: Op.GET_INFO,
    ListEntriesRequest: Op.LIST_ENTRIES,
    AddBatchRequest: Op.ADD_BATCH,
}
_RESPONSE_OPS: dict[type, Op] = {
    AddResponse: Op.ADD,
    ReadResponse: Op.READ,
    ReadLacResponse: Op.READ_LAC,
    BatchReadResponse: Op.BATCH_READ,
    GetInfoResponse: Op.GET_INFO,
    ListEntriesResponse: Op.LIST_ENTRIES,
    AddBatchResponse: Op.ADD_BATCH,
}
_REQUEST_TYPES = {op: cls for cls, op in _REQUEST_OPS.items()}
_RESPONSE_TYPES = {op: cls for cls, op in _RESPONSE_OPS.items()}
# The hot paths (adds and their answers) pack fields into frames themselves.
_packer = msgpack.Packer(use_bin_type=True)


# --- field checks -------------------------------------------------------------


def _int(value: Any, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"field {name} must be an integer in [{low}, {high}], got {describe(value)}")
    return value


def _u64(value: Any, name: str) -> int:
    return _int(value, name, 0, U64_MAX)


def _entry_id(value: Any, name: str) -> int:
    return _int(value, name, LAST_ADD_CONFIRMED, U64_MAX)


def _i64(value: Any, name: str) -> int:
    return _int(value, name, I64_MIN, 2**63 - 1)


def _bytes(value: Any, name: str) -> bytes:
    if type(value) is not bytes:
        raise ProtocolError(f"field {name} must be binary, got {type(value).__name__}")
    return value


def _optional(check, value: Any, name: str):
    return None if value is None else check(value, name)


_STATUSES = {int(status): status for status in Status}


def _status(value: Any) -> Status:
    status = _STATUSES.get(value) if type(value) is int else None
    if status is None:
        raise ProtocolError(f"unknown status {describe(value)}")
    return status


def _arity(fields: list[Any], count: int, what: str) -> None:
    if len(fields) != count:
        raise ProtocolError(f"{what} needs {count} fields, got {len(fields)}")


# --- handshake ----------------------------------------------------------------

AUTH_METHOD_CHARS_MAX = 64
AUTH_DATA_BYTES_MAX = 64 * 1024


def encode_hello(hello: Hello) -> bytes:
    # Credentials travel only when there are some: a HELLO without them is
    # what bookies that authenticate nobody have always taken.
    credentials = [hello.auth_method, hello.auth_data] if hello.auth_method or hello.auth_data else []
    return encode_frame([Op.HELLO, hello.protocol_version, hello.peer_name, *credentials])


def decode_hello(fields: list[Any]) -> Hello:
    if type(fields[0]) is not int or fields[0] != Op.HELLO:
        raise ProtocolError("the first frame must be a HELLO")
    if len(fields) != 5:
        _arity(fields, 3, "HELLO")
    if type(fields[2]) is not str:
        raise ProtocolError("HELLO peer name must be a string")
    hello = Hello(_int(fields[1], "protocol_version", 0, 2**31), fields[2])
    if len(fields) == 5:
        if type(fields[3]) is not str or len(fields[3]) > AUTH_METHOD_CHARS_MAX:
            raise ProtocolError(f"HELLO authentication method must be a string of at most {AUTH_METHOD_CHARS_MAX} characters")
        if type(fields[4]) is not bytes or len(fields[4]) > AUTH_DATA_BYTES_MAX:
            raise ProtocolError(f"HELLO authentication data must be binary of at most {AUTH_DATA_BYTES_MAX} bytes")
        hello.auth_method, hello.auth_data = fields[3], fields[4]
    return hello


def encode_hello_reply(reply: HelloReply) -> bytes:
    return encode_frame([Op.HELLO, int(reply.status), reply.protocol_version, reply.bookie_id, reply.frame_bytes_max])


def decode_hello_reply(fields: list[Any]) -> HelloReply:
    if type(fields[0]) is not int or fields[0] != Op.HELLO:
        raise ProtocolError("the first frame from a bookie must be a HELLO reply")
    _arity(fields, 5, "HELLO reply")
    if type(fields[3]) is not str:
        raise ProtocolError("HELLO reply bookie id must be a string")
    return HelloReply(
        _status(fields[1]),
        _int(fields[2], "protocol_version", 0, 2**31),
        fields[3],
        _int(fields[4], "frame_bytes_max", 1, 2**32 - 1),
    )


# --- requests -----------------------------------------------------------------


def encode_add(request_id: int, flags: int, master_key: bytes, entry: bytes) -> bytes:
    """An ADD request, without building the request object."""
    body = _packer.pack([1, request_id, flags, master_key, entry])
    return LENGTH_PREFIX.pack(len(body)) + body


def encode_add_tail(flags: int, master_key: bytes, entry: bytes) -> bytes:
    """The part of an ADD frame after the request id; the same for every
    bookie an entry goes to, so a client encodes it once per entry."""
    return encode_add_tail_after(encode_add_tail_prefix(flags, master_key), entry)


def encode_add_tail_prefix(flags: int, master_key: bytes) -> bytes:
    """The start of an ADD's tail, the same for every entry of a writer."""
    return _packer.pack(flags) + _packer.pack(master_key)


def encode_add_tail_after(prefix: bytes, entry: bytes) -> bytes:
    """`encode_add_tail` with its prefix encoded once (`encode_add_tail_prefix`)."""
    return prefix + _packer.pack(entry)


_ADD_ARRAY_AND_OP = bytes([0x95, 1])  # a msgpack array of 5, then op ADD
# The head of an ADD whose request id takes msgpack's uint32 form (ids from
# 65,536 up), as one struct: length prefix, array of 5, op ADD, 0xce, id.
_ADD_HEAD_UINT32 = struct.Struct(">IBBBI")


def encode_add_head(request_id: int, tail_bytes: int) -> bytes:
    """Length prefix, array header, op and request id of an ADD whose tail
    (see `encode_add_tail`) is `tail_bytes` long; head + tail is the frame."""
    if 0x10000 <= request_id <= 0xFFFFFFFF:  # a writer's case after its first 65,536 requests
        return _ADD_HEAD_UINT32.pack(7 + tail_bytes, 0x95, 1, 0xCE, request_id)
    request = _packer.pack(request_id)
    return LENGTH_PREFIX.pack(2 + len(request) + tail_bytes) + _ADD_ARRAY_AND_OP + request


_ADD_BATCH_ARRAY_AND_OP = bytes([0x93, Op.ADD_BATCH])  # a msgpack array of 3, then op ADD_BATCH


def encode_add_batch_head(request_id: int, count: int, tails_bytes: int) -> bytes:
    """Length prefix, array header, op, request id and the adds' array
    header of an ADD_BATCH carrying `count` adds whose tails (see
    `encode_add_tail`), `tails_bytes` long in all, follow it: head + tails
    is the frame. A writer encodes an entry's tail once for all its bookies
    and a batch only joins them."""
    middle = _packer.pack(request_id) + _packer.pack_array_header(3 * count)
    return LENGTH_PREFIX.pack(2 + len(middle) + tails_bytes) + _ADD_BATCH_ARRAY_AND_OP + middle


def encode_request(request: Request) -> bytes:
    if type(request) is AddRequest:  # the hot path
        return encode_add(request.request_id, request.flags, request.master_key, request.entry)
    if type(request) is AddBatchRequest:
        return encode_frame([Op.ADD_BATCH, request.request_id, request.adds])
    op = _REQUEST_OPS[type(request)]
    if op is Op.ADD:
        return encode_frame([op, request.request_id, request.flags, request.master_key, request.entry])
    if op is Op.READ:
        return encode_frame(
            [
                op,
                request.request_id,
                request.flags,
                request.ledger_id,
                request.entry_id,
                request.master_key,
                request.previous_lac,
                request.timeout_ms,
            ]
        )
    if op is Op.READ_LAC:
        return encode_frame([op, request.request_id, request.ledger_id])
    if op is Op.BATCH_READ:
        return encode_frame(
            [op, request.request_id, request.ledger_id, request.first_entry_id, request.entries_max, request.bytes_max]
        )
    if op is Op.GET_INFO:
        return encode_frame([op, request.request_id])
    return encode_frame([op, request.request_id, request.ledger_id, request.first_entry_id, request.last_entry_id])


def decode_request(fields: list[Any]) -> Request:
    """Turn a frame's fields into a request, or raise ProtocolError."""
    if len(fields) == 5:
        # The hot path: an ADD whose fields have the right types.
        op, request_id, flags, key, entry = fields
        if (
            op == 1 and type(op) is int and type(request_id) is int and 0 <= request_id <= U64_MAX
            and type(flags) is int and 0 <= flags <= 2**31 and type(key) is bytes and type(entry) is bytes
        ):
            return AddRequest(request_id, flags, key, entry)
    op = fields[0]
    if type(op) is not int or op not in _REQUEST_TYPES:
        raise ProtocolError(f"unknown request op {describe(op)}")
    if len(fields) < 2:
        raise ProtocolError("request without a request id")
    request_id = _u64(fields[1], "request_id")
    if op == Op.ADD:
        _arity(fields, 5, "ADD")
        return AddRequest(
            request_id,
            _int(fields[2], "flags", 0, 2**31),
            _bytes(fields[3], "master_key"),
            _bytes(fields[4], "entry"),
        )
    if op == Op.ADD_BATCH:
        _arity(fields, 3, "ADD_BATCH")
        return AddBatchRequest(request_id, _add_batch_adds(fields[2]))
    if op == Op.READ:
        _arity(fields, 8, "READ")
        return ReadRequest(
            request_id,
            _int(fields[2], "flags", 0, 2**31),
            _u64(fields[3], "ledger_id"),
            _entry_id(fields[4], "entry_id"),
            _optional(_bytes, fields[5], "master_key"),
            _optional(_i64, fields[6], "previous_lac"),
            _optional(lambda value, name: _int(value, name, 0, 2**31), fields[7], "timeout_ms"),
        )
    if op == Op.READ_LAC:
        _arity(fields, 3, "READ_LAC")
        return ReadLacRequest(request_id, _u64(fields[2], "ledger_id"))
    if op == Op.BATCH_READ:
        _arity(fields, 6, "BATCH_READ")
        return BatchReadRequest(
            request_id,
            _u64(fields[2], "ledger_id"),
            _u64(fields[3], "first_entry_id"),
            _int(fields[4], "entries_max", 1, 2**31),
            _int(fields[5], "bytes_max", 1, 2**40),
        )
    if op == Op.GET_INFO:
        _arity(fields, 2, "GET_INFO")
        return GetInfoRequest(request_id)
    _arity(fields, 5, "LIST_ENTRIES")
    return ListEntriesRequest(
        request_id, _u64(fields[2], "ledger_id"), _u64(fields[3], "first_entry_id"), _u64(fields[4], "last_entry_id")
    )


def _add_batch_adds(adds: Any) -> list:
    if type(adds) is not list or not adds or len(adds) % 3:
        raise ProtocolError("ADD_BATCH adds must be a non-empty array of (flags, master_key, entry) triples")
    if len(adds) > 3 * ADD_BATCH_ADDS_MAX:
        raise ProtocolError(f"ADD_BATCH of {len(adds) // 3} adds exceeds the bound of {ADD_BATCH_ADDS_MAX}")
    # The same checks as an ADD's, in one pass over each field's column.
    flags, keys, entries = adds[0::3], adds[1::3], adds[2::3]
    if not all(type(value) is int and 0 <= value <= 2**31 for value in flags):
        raise ProtocolError("ADD_BATCH flags must be integers in [0, 2**31]")
    if not all(type(value) is bytes for value in keys) or not all(type(value) is bytes for value in entries):
        raise ProtocolError("ADD_BATCH master keys and entries must be binary")
    return adds


# --- responses ----------------------------------------------------------------


def encode_add_ok(request_id: int, ledger_id: int, entry_id: int) -> bytes:
    """An OK answer to an ADD, without building the response object."""
    body = _packer.pack([1, request_id, 0, ledger_id, entry_id])
    return LENGTH_PREFIX.pack(len(body)) + body


def encode_response(response: Response) -> bytes:
    if type(response) is AddResponse:  # the hot path
        body = _packer.pack([1, response.request_id, response.status, response.ledger_id, response.entry_id])
        return LENGTH_PREFIX.pack(len(body)) + body
    if type(response) is AddBatchResponse:
        # [op, request id, count, status]: one status when all are the same
        # (the usual case: all OK), else a list of one per add.
        statuses = response.statuses
        uniform = statuses.count(statuses[0]) == len(statuses)
        return encode_frame([Op.ADD_BATCH, response.request_id, len(statuses), statuses[0] if uniform else statuses])
    op = _RESPONSE_OPS[type(response)]
    head = [op, response.request_id, int(response.status)]
    if op is Op.ADD:
        return encode_frame(head + [response.ledger_id, response.entry_id])
    if op is Op.READ:
        return encode_frame(
            head + [response.ledger_id, response.entry_id, response.last_add_confirmed, response.entry]
        )
    if op is Op.READ_LAC:
        return encode_frame(head + [response.ledger_id, response.last_add_confirmed])
    if op is Op.BATCH_READ:
        return encode_frame(head + [response.ledger_id, response.first_entry_id, response.entries])
    if op is Op.GET_INFO:
        return encode_frame(head + [response.info])
    return encode_frame(head + [response.ledger_id, [list(run) for run in response.ranges]])


def add_ok_fields(fields: list[Any]) -> tuple[int, int, int] | None:
    """(request id, ledger id, entry id) of a well-formed OK answer to an
    ADD, without building the response object (a writer takes thousands a
    second); None for any other frame, which `decode_response` takes."""
    if len(fields) == 5:
        op, request_id, status, ledger_id, entry_id = fields
        if (
            op == 1 and status == 0 and type(op) is int and type(status) is int
            and type(request_id) is int and type(ledger_id) is int and type(entry_id) is int
            and 0 <= request_id <= U64_MAX and 0 <= ledger_id <= U64_MAX and 0 <= entry_id <= U64_MAX
        ):
            return request_id, ledger_id, entry_id
    return None


def add_batch_ok_fields(fields: list[Any]) -> tuple[int, int] | None:
    """(request id, count) of a well-formed answer to an ADD_BATCH whose
    adds were all OK, without building the response object; None for any
    other frame, which `decode_response` takes."""
    if len(fields) == 4:
        op, request_id, count, status = fields
        if (
            op == 7 and status == 0 and type(op) is int and type(status) is int
            and type(request_id) is int and type(count) is int
            and 0 <= request_id <= U64_MAX and 1 <= count <= ADD_BATCH_ADDS_MAX
        ):
            return request_id, count
    return None


def decode_response(fields: list[Any]) -> Response:
    """Turn a frame's fields into a response, or raise ProtocolError."""
    # (A writer's OK answers to adds take `add_ok_fields` instead.)
    op = fields[0]
    if type(op) is not int or op not in _RESPONSE_TYPES:
        raise ProtocolError(f"unknown response op {describe(op)}")
    if len(fields) < 3:
        raise ProtocolError("response without request id and status")
    request_id = _u64(fields[1], "request_id")
    if op == Op.ADD_BATCH:
        _arity(fields, 4, "ADD_BATCH response")
        count = _int(fields[2], "count", 1, ADD_BATCH_ADDS_MAX)
        statuses = fields[3]
        if type(statuses) is list:
            if len(statuses) != count:
                raise ProtocolError(f"ADD_BATCH response has {len(statuses)} statuses for {count} adds")
            return AddBatchResponse(request_id, [_status(status) for status in statuses])
        return AddBatchResponse(request_id, [_status(statuses)] * count)
    status = _status(fields[2])
    if op == Op.ADD:
        _arity(fields, 5, "ADD response")
        return AddResponse(request_id, status, _u64(fields[3], "ledger_id"), _u64(fields[4], "entry_id"))
    if op == Op.READ:
        _arity(fields, 7, "READ response")
        return ReadResponse(
            request_id,
            status,
            _u64(fields[3], "ledger_id"),
            _entry_id(fields[4], "entry_id"),
            _i64(fields[5], "last_add_confirmed"),
            _optional(_bytes, fields[6], "entry"),
        )
    if op == Op.READ_LAC:
        _arity(fields, 5, "READ_LAC response")
        return ReadLacResponse(request_id, status, _u64(fields[3], "ledger_id"), _i64(fields[4], "last_add_confirmed"))
    if op == Op.BATCH_READ:
        _arity(fields, 6, "BATCH_READ response")
        entries = fields[5]
        if not isinstance(entries, list):
            raise ProtocolError("BATCH_READ entries must be an array")
        return BatchReadResponse(
            request_id,
            status,
            _u64(fields[3], "ledger_id"),
            _u64(fields[4], "first_entry_id"),
            [_bytes(entry, "entry") for entry in entries],
        )
    if op == Op.GET_INFO:
        _arity(fields, 4, "GET_INFO response")
        if not isinstance(fields[3], dict):
            raise ProtocolError("GET_INFO info must be a map")
        return GetInfoResponse(request_id, status, fields[3])
    _arity(fields, 5, "LIST_ENTRIES response")
    runs = fields[4]
    if not isinstance(runs, list):
        raise ProtocolError("LIST_ENTRIES ranges must be an array")
    ranges = []
    for run in runs:
        if not isinstance(run, list) or len(run) != 2:
            raise ProtocolError("LIST_ENTRIES range must be a pair")
        ranges.append((_u64(run[0], "first"), _u64(run[1], "last")))
    return ListEntriesResponse(request_id, status, _u64(fields[3], "ledger_id"), ranges)


__all__ = [
    "encode_add_head",
    "encode_add_tail",
    "encode_add_tail_after",
    "encode_add_tail_prefix",
    "encode_add_batch_head",
    "add_batch_ok_fields",
    "REQUEST_ITEMS_MAX",
    "encode_hello",
    "decode_hello",
    "encode_hello_reply",
    "decode_hello_reply",
    "encode_request",
    "decode_request",
    "encode_response",
    "encode_add_ok",
    "encode_add",
    "add_ok_fields",
    "decode_response",
    *_message_names,
]
