"""How messages are stored in ledger entries: one entry holds a batch of one
producer's messages (one message is a batch of one).

An entry's data: a format version byte and the header's length (u32), the
header, a msgpack array the broker reads without touching the rest
(producer, sequence ids, partition offset of the first message, publish
time, codec, message count, the message keys for key-shared dispatch), then
the body, the producer's messages compressed with the codec.
The producer builds and compresses the body; the broker only adds the header,
so that neither the broker nor a dispatch to a consumer ever decompresses.

Body, once decompressed: a msgpack array of [sequence id, publish time (ms),
properties (map of str to str, or nil), payload (bytes)], one per message.
"""

from __future__ import annotations

import enum
import gzip
import itertools
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import msgpack

ENTRY_FORMAT_VERSION = 1
# A body never decompresses past this (a crafted or corrupt body must not
# exhaust memory): the largest entry a ledger takes, with room for headers.
BODY_BYTES_MAX = 16 * 1024 * 1024


class MalformedEntryError(Exception):
    """Bytes that are not an entry this broker wrote (or a body that does not
    decompress): a bug or corruption, never silently skipped."""


class Codec(str, enum.Enum):
    NONE = "none"
    ZSTD = "zstd"
    LZ4 = "lz4"
    GZIP = "gzip"

    @classmethod
    def parse(cls, value: "Codec | str") -> "Codec":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown codec {value!r}; known: {', '.join(codec.value for codec in cls)}") from None


def compress(codec: Codec, data: bytes) -> bytes:
    if codec is Codec.NONE:
        return data
    if codec is Codec.ZSTD:
        import zstandard

        return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)
    if codec is Codec.LZ4:
        import lz4.frame

        return lz4.frame.compress(data, store_size=True)
    if codec is Codec.GZIP:
        return gzip.compress(data, compresslevel=6, mtime=0)
    raise AssertionError(codec)


def decompress(codec: Codec, data: bytes, bytes_max: int = BODY_BYTES_MAX) -> bytes:
    """Decompress, refusing anything that would grow past `bytes_max`."""
    try:
        if codec is Codec.NONE:
            out = data
        elif codec is Codec.ZSTD:
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(data) as reader:
                out = reader.read(bytes_max + 1)
        elif codec is Codec.LZ4:
            import lz4.frame

            decompressor = lz4.frame.LZ4FrameDecompressor()
            out = decompressor.decompress(data, max_length=bytes_max + 1)
        elif codec is Codec.GZIP:
            decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            out = decompressor.decompress(data, bytes_max + 1)
        else:
            raise AssertionError(codec)
    except MalformedEntryError:
        raise
    except Exception as error:  # each codec library raises its own types
        raise MalformedEntryError(f"{codec.value} body does not decompress: {error}") from None
    if len(out) > bytes_max:
        raise MalformedEntryError(f"{codec.value} body decompresses past {bytes_max} bytes")
    return out


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """What the broker knows of an entry without decompressing it."""

    producer_id: str
    first_sequence_id: int
    last_sequence_id: int
    first_offset: int  # partition offset of the first message
    message_count: int
    publish_time_ms: int  # of the first message
    codec: Codec
    keys: tuple[str | None, ...] | None  # one per message, or None when no message has a key

    @property
    def last_offset(self) -> int:
        return self.first_offset + self.message_count - 1

    def key_of(self, batch_index: int) -> str | None:
        return None if self.keys is None else self.keys[batch_index]


@dataclass(frozen=True, slots=True)
class MessageRecord:
    """One message of a decoded body."""

    sequence_id: int
    publish_time_ms: int
    properties: dict[str, str]
    payload: bytes


_packer = msgpack.Packer(use_bin_type=True)


def encode_body(messages: Iterable[tuple[int, int, dict[str, str] | None, bytes]], codec: Codec) -> bytes:
    """A producer's batch body: (sequence id, publish time, properties,
    payload) per message, compressed with `codec`."""
    return compress(codec, _packer.pack([[sequence_id, publish_ms, properties or None, payload]
                                         for sequence_id, publish_ms, properties, payload in messages]))


_ENTRY_PREFIX = struct.Struct(">BI")  # format version, header length


def encode_entry(header: BatchHeader, body: bytes) -> bytes:
    packed = _packer.pack([
        header.producer_id,
        header.first_sequence_id,
        header.last_sequence_id,
        header.first_offset,
        header.message_count,
        header.publish_time_ms,
        header.codec.value,
        None if header.keys is None else list(header.keys),
    ])
    return b"".join((_ENTRY_PREFIX.pack(ENTRY_FORMAT_VERSION, len(packed)), packed, body))


def decode_entry(data: bytes) -> tuple[BatchHeader, memoryview]:
    """The header and the (still compressed) body of an entry. The header
    is read on its own (its length comes first), so that a broker never
    copies a body to learn where an entry's messages start."""
    view = memoryview(data)
    if len(view) < _ENTRY_PREFIX.size:
        raise MalformedEntryError("entry is shorter than its prefix")
    version, header_bytes = _ENTRY_PREFIX.unpack_from(view)
    if version != ENTRY_FORMAT_VERSION:
        raise MalformedEntryError(f"entry is not a version-{ENTRY_FORMAT_VERSION} message batch (version {version})")
    body_start = _ENTRY_PREFIX.size + header_bytes
    if body_start > len(view):
        raise MalformedEntryError("entry header runs past the end of the entry")
    try:
        fields = msgpack.unpackb(view[_ENTRY_PREFIX.size:body_start])
    except Exception as error:  # msgpack raises several unrelated types
        raise MalformedEntryError(f"entry header is not msgpack: {error}") from None
    if type(fields) is not list or len(fields) != 8:
        raise MalformedEntryError("entry header is not an array of 8 fields")
    producer_id, first_sequence_id, last_sequence_id, first_offset, count, publish_ms, codec, keys = fields
    try:
        codec = Codec(codec)
    except (ValueError, TypeError):
        raise MalformedEntryError(f"entry names an unknown codec {codec!r:.40}") from None
    if not (type(producer_id) is str and _ints(first_sequence_id, last_sequence_id, first_offset, count, publish_ms)
            and count >= 1):
        raise MalformedEntryError("entry header has fields of the wrong type")
    if keys is not None and (type(keys) is not list or len(keys) != count
                             or not all(key is None or type(key) is str for key in keys)):
        raise MalformedEntryError("entry keys do not match its message count")
    header = BatchHeader(producer_id, first_sequence_id, last_sequence_id, first_offset, count, publish_ms, codec,
                         None if keys is None else tuple(keys))
    return header, view[body_start:]


def decode_body(header: BatchHeader, body: bytes) -> list[MessageRecord]:
    return [MessageRecord(*item) for item in body_items(header, body)]


def _unpack_body(header: BatchHeader, body: bytes) -> list:
    """The body's array of messages, as many as the header says."""
    raw = decompress(header.codec, body)
    try:
        items = msgpack.unpackb(raw)
    except Exception as error:
        raise MalformedEntryError(f"entry body is not msgpack: {error}") from None
    if type(items) is not list or len(items) != header.message_count:
        raise MalformedEntryError(f"entry body holds {len(items) if type(items) is list else '?'} messages, "
                                  f"the header says {header.message_count}")
    return items


def body_items(header: BatchHeader, body: bytes) -> list[tuple[int, int, dict[str, str], bytes]]:
    """The messages of a body as (sequence id, publish time, properties,
    payload) tuples, checked: the consumer's hot path (a few µs per message
    matter at 100,000 messages/s)."""
    items = _unpack_body(header, body)
    decoded = []
    append = decoded.append
    for item in items:
        if type(item) is not list or len(item) != 4:
            raise MalformedEntryError("a message of the body has the wrong shape")
        sequence_id, publish_ms, properties, payload = item
        if type(sequence_id) is not int or type(publish_ms) is not int or type(payload) is not bytes:
            raise MalformedEntryError("a message of the body has fields of the wrong type")
        if properties is None:
            properties = {}
        elif not _str_map(properties):
            raise MalformedEntryError("a message's properties are not a map of strings")
        append((sequence_id, publish_ms, properties, payload))
    return decoded


class BodyColumns(NamedTuple):
    """The messages of a body column by column (the Spark export's path)."""

    sequence_ids: tuple[int, ...]
    publish_times_ms: tuple[int, ...]
    properties: tuple[dict[str, str] | None, ...]  # None: no properties
    payloads: tuple[bytes, ...]


def body_columns(header: BatchHeader, body: bytes) -> BodyColumns:
    """What `body_items` gives, as columns, checked as strictly but with the
    loops in C (`map(type, ...)` over each column): about 1 µs a message
    less, which is a third of what an export spends per message."""
    items = _unpack_body(header, body)
    if set(map(type, items)) != {list} or set(map(len, items)) != {4}:
        raise MalformedEntryError("a message of the body has the wrong shape")
    sequence_ids, publish_times_ms, properties, payloads = zip(*items)
    if not (set(map(type, sequence_ids)) == set(map(type, publish_times_ms)) == {int}
            and set(map(type, payloads)) == {bytes}):
        raise MalformedEntryError("a message of the body has fields of the wrong type")
    kinds = set(map(type, properties))
    if not kinds <= {dict, type(None)}:
        raise MalformedEntryError("a message's properties are not a map of strings")
    if dict in kinds:
        maps = [item for item in properties if item]
        if not set(map(type, itertools.chain.from_iterable(maps))) <= {str} or not set(
                map(type, itertools.chain.from_iterable(map(dict.values, maps)))) <= {str}:
            raise MalformedEntryError("a message's properties are not a map of strings")
    return BodyColumns(sequence_ids, publish_times_ms, properties, payloads)


def _ints(*values: Any) -> bool:
    return all(type(value) is int for value in values)


def _str_map(value: Any) -> bool:
    return type(value) is dict and all(type(key) is str and type(item) is str for key, item in value.items())


__all__ = [
    "BODY_BYTES_MAX",
    "BatchHeader",
    "BodyColumns",
    "Codec",
    "MalformedEntryError",
    "MessageRecord",
    "body_columns",
    "body_items",
    "compress",
    "decode_body",
    "decode_entry",
    "decompress",
    "encode_body",
    "encode_entry",
]
