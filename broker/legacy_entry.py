"""The entry format quire wrote before it took Pulsar's message layout
(`broker/message_format.py`): still read, never written by the broker
(`encode_entry` and `encode_body` are here for tests and for tools that
make such entries). One entry holds a batch of one producer's messages.

An entry's data: a format version byte and the header's length (u32), the
header, a msgpack array the broker reads without touching the rest
(producer, sequence ids, partition offset of the first message, publish
time, codec, message count, the message keys for key-shared dispatch), then
the body, the producer's messages compressed with the codec.

Body, once decompressed: a msgpack array of [sequence id, publish time (ms),
properties (map of str to str, or nil), payload (bytes)], one per message.
A compressed body is one whole frame (zstd, lz4) or gzip member, nothing
after it.
"""

from __future__ import annotations

import enum
import gzip
import itertools
import struct
import zlib
from typing import Any, Iterable

import msgpack

from broker.entry_types import BODY_BYTES_MAX, BatchHeader, BodyColumns, MalformedEntryError, MessageRecord


ENTRY_FORMAT_VERSION = 1


class Codec(str, enum.Enum):
    """The codecs of this format (lz4 is an LZ4 frame here, gzip a gzip member)."""

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
    """Decompress a whole body: one complete frame (or gzip member) and
    nothing after it, of the size its header declares, refusing anything
    that would grow past `bytes_max` (checked against the declared size
    before decompressing, where the format declares one)."""
    if codec is Codec.NONE:
        if len(data) > bytes_max:
            raise MalformedEntryError(f"body holds more than {bytes_max} bytes")
        return data
    try:
        if codec is Codec.ZSTD:
            return _decompress_zstd(data, bytes_max)
        if codec is Codec.LZ4:
            return _decompress_lz4(data, bytes_max)
        if codec is Codec.GZIP:
            return _decompress_gzip(data, bytes_max)
        raise AssertionError(codec)
    except MalformedEntryError:
        raise
    except Exception as error:  # each codec library raises its own types
        raise MalformedEntryError(f"{codec.value} body does not decompress: {error}") from None


def _past(codec: Codec, bytes_max: int, declared: int | None = None) -> MalformedEntryError:
    said = "" if declared is None else f" (it declares {declared})"
    return MalformedEntryError(f"{codec.value} body decompresses past {bytes_max} bytes{said}")


# The window a body may need when streamed (a frame that does not declare
# its size is streamed to find out whether it fits): at most the body bound,
# but never less than the windows of zstd's levels up to 19, which any
# writer's stream may use.
_ZSTD_WINDOW_BYTES_MIN = 8 * 1024 * 1024


def _decompress_zstd(data: bytes, bytes_max: int) -> bytes:
    import zstandard

    declared = zstandard.get_frame_parameters(data).content_size
    decompressor = zstandard.ZstdDecompressor(max_window_size=max(bytes_max, _ZSTD_WINDOW_BYTES_MIN))
    if declared != zstandard.CONTENTSIZE_UNKNOWN:
        if declared > bytes_max:
            raise _past(Codec.ZSTD, bytes_max, declared)
        # Into a buffer of the declared size; zstd checks that the frame
        # fills it exactly, and nothing may follow the frame.
        return decompressor.decompress(data, allow_extra_data=False)
    try:
        return decompressor.decompress(data, max_output_size=bytes_max, allow_extra_data=False)
    except zstandard.ZstdError:
        # A frame that does not declare its size failed to fit the bound,
        # or is broken: which of the two, a bounded read tells.
        with decompressor.stream_reader(data) as reader:
            if len(reader.read(bytes_max + 1)) > bytes_max:
                raise _past(Codec.ZSTD, bytes_max) from None
        raise


def _decompress_lz4(data: bytes, bytes_max: int) -> bytes:
    import lz4.frame

    declared = lz4.frame.get_frame_info(data)["content_size"]  # 0: not declared (a body is never empty)
    if declared > bytes_max:
        raise _past(Codec.LZ4, bytes_max, declared)
    decompressor = lz4.frame.LZ4FrameDecompressor()
    out = decompressor.decompress(data, max_length=bytes_max + 1)
    if len(out) > bytes_max:
        raise _past(Codec.LZ4, bytes_max)
    if not decompressor.eof:
        raise MalformedEntryError("lz4 body is a truncated frame")
    if decompressor.unused_data:
        raise MalformedEntryError(f"lz4 body has {len(decompressor.unused_data)} bytes after its frame")
    if declared and len(out) != declared:
        raise MalformedEntryError(f"lz4 body decompresses to {len(out)} bytes, its header says {declared}")
    return out


def _decompress_gzip(data: bytes, bytes_max: int) -> bytes:
    if data[:2] != b"\x1f\x8b":
        raise MalformedEntryError("gzip body is not a gzip member")
    if len(data) >= 4:
        # The trailer's size is modulo 2**32; a body within the bound (far
        # below 2**32) has exactly that size.
        declared = int.from_bytes(data[-4:], "little")
        if declared > bytes_max:
            raise _past(Codec.GZIP, bytes_max, declared)
    decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out = decompressor.decompress(data, bytes_max + 1)
    if len(out) > bytes_max:
        raise _past(Codec.GZIP, bytes_max)
    # zlib checks the trailer (CRC-32 and size) before it says eof.
    if not decompressor.eof:
        raise MalformedEntryError("gzip body is a truncated member")
    if decompressor.unused_data:
        raise MalformedEntryError(f"gzip body has {len(decompressor.unused_data)} bytes after its member")
    return out


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


def body_items(header: BatchHeader, body: bytes) -> list[tuple[int, int, dict[str, str], bytes, int]]:
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
        append((sequence_id, publish_ms, properties, payload, 0))  # no event time in this format
    return decoded


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
    "ENTRY_FORMAT_VERSION",
    "Codec",
    "body_columns",
    "body_items",
    "compress",
    "decode_entry",
    "decompress",
    "encode_body",
    "encode_entry",
]
