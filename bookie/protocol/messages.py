"""The bookie protocol's message types: operations, status codes, flags and
one dataclass per request and response, in their wire field order. `wire`
encodes and decodes them (and re-exports every name here)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Union

PROTOCOL_VERSION = 2  # 2 added ADD_BATCH
PROTOCOL_VERSION_MIN = 1  # the oldest a bookie still serves (a client of 1 never batches)
# The entry id a READ names to mean "the bookie's last-add-confirmed entry".
LAST_ADD_CONFIRMED = -1


class Op(enum.IntEnum):
    HELLO = 0
    ADD = 1
    READ = 2
    READ_LAC = 3
    BATCH_READ = 4
    GET_INFO = 5
    LIST_ENTRIES = 6
    ADD_BATCH = 7  # protocol 2: many ADDs in one frame, one answer for all


class Status(enum.IntEnum):
    """Result codes, named after BookKeeper's for operators who know it."""

    OK = 0
    NO_LEDGER = 1
    NO_ENTRY = 2
    BAD_REQUEST = 3
    IO_ERROR = 4
    UNAUTHORIZED = 5
    FENCED = 6
    READ_ONLY = 7
    TOO_MANY_REQUESTS = 8
    BAD_VERSION = 9  # handshake: protocol versions do not match


class AddFlag(enum.IntFlag):
    NONE = 0
    RECOVERY_ADD = 1


class ReadFlag(enum.IntFlag):
    NONE = 0
    FENCE = 1


# --- messages -----------------------------------------------------------------
# Field order in each dataclass is the order on the wire, after (op, request_id).


@dataclass(slots=True)
class Hello:
    protocol_version: int
    peer_name: str
    auth_method: str = ""  # "token", or "" (none, or a TLS client certificate)
    auth_data: bytes = b""  # the token


@dataclass(slots=True)
class HelloReply:
    status: Status
    protocol_version: int
    bookie_id: str
    frame_bytes_max: int


@dataclass(slots=True)
class AddRequest:
    request_id: int
    flags: int
    master_key: bytes
    entry: bytes  # header | digest | payload, as the client encoded it


@dataclass(slots=True)
class AddBatchRequest:
    """Many ADDs in one frame (protocol 2), each as an ADD would carry it:
    `adds` is the flat list [flags, master_key, entry, flags, ...]. The
    bookie handles each add on its own (they may name different ledgers)
    and answers once, when every one of them is settled."""

    request_id: int
    adds: list


@dataclass(slots=True)
class ReadRequest:
    request_id: int
    flags: int
    ledger_id: int
    entry_id: int  # or LAST_ADD_CONFIRMED
    master_key: bytes | None = None  # required with FENCE
    previous_lac: int | None = None  # long poll: answer once the LAC passes it
    timeout_ms: int | None = None  # long poll bound


@dataclass(slots=True)
class ReadLacRequest:
    request_id: int
    ledger_id: int


@dataclass(slots=True)
class BatchReadRequest:
    request_id: int
    ledger_id: int
    first_entry_id: int
    entries_max: int
    bytes_max: int


@dataclass(slots=True)
class GetInfoRequest:
    request_id: int


@dataclass(slots=True)
class ListEntriesRequest:
    request_id: int
    ledger_id: int
    first_entry_id: int
    last_entry_id: int


@dataclass(slots=True)
class AddResponse:
    request_id: int
    status: Status
    ledger_id: int
    entry_id: int


@dataclass(slots=True)
class AddBatchResponse:
    """One status per add of an AddBatchRequest, in its order."""

    request_id: int
    statuses: list[Status]


@dataclass(slots=True)
class ReadResponse:
    request_id: int
    status: Status
    ledger_id: int
    entry_id: int
    last_add_confirmed: int
    entry: bytes | None = None


@dataclass(slots=True)
class ReadLacResponse:
    request_id: int
    status: Status
    ledger_id: int
    last_add_confirmed: int


@dataclass(slots=True)
class BatchReadResponse:
    request_id: int
    status: Status
    ledger_id: int
    first_entry_id: int
    entries: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class GetInfoResponse:
    request_id: int
    status: Status
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ListEntriesResponse:
    request_id: int
    status: Status
    ledger_id: int
    ranges: list[tuple[int, int]] = field(default_factory=list)  # inclusive [first, last] runs


Request = Union[AddRequest, AddBatchRequest, ReadRequest, ReadLacRequest, BatchReadRequest, GetInfoRequest, ListEntriesRequest]
Response = Union[
    AddResponse, AddBatchResponse, ReadResponse, ReadLacResponse, BatchReadResponse, GetInfoResponse, ListEntriesResponse
]
# The most adds one ADD_BATCH may carry (a frame's byte bound applies too).
ADD_BATCH_ADDS_MAX = 1_024


__all__ = [
    "PROTOCOL_VERSION",
    "PROTOCOL_VERSION_MIN",
    "LAST_ADD_CONFIRMED",
    "ADD_BATCH_ADDS_MAX",
    "Op",
    "Status",
    "AddFlag",
    "ReadFlag",
    "Hello",
    "HelloReply",
    "AddRequest",
    "AddBatchRequest",
    "ReadRequest",
    "ReadLacRequest",
    "BatchReadRequest",
    "GetInfoRequest",
    "ListEntriesRequest",
    "AddResponse",
    "AddBatchResponse",
    "ReadResponse",
    "ReadLacResponse",
    "BatchReadResponse",
    "GetInfoResponse",
    "ListEntriesResponse",
    "Request",
    "Response",
]
