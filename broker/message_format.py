"""How messages are stored in ledger entries: one entry holds a batch of one
producer's messages (one message is a batch of one).

An entry's data: a format version byte and the header's length (u32), the
header, a msgpack array the broker reads without touching the rest
(producer, sequence ids, partition offset of the first message, publish
time, codec, message count, the message keys for key-shared dispatch), then
the body, the producer's messages compressed with the codec.
The producer builds and compresses the body; the broker checks it once, when
it takes the batch (`check_batch`), then only adds the header: a dispatch to
a consumer never decompresses.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

import msgpack

from broker.errors import MalformedBatchError

if TYPE_CHECKING:
    from broker.protocol import Send

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


# --- checking a producer's batch -------------------------------------------------------------

# The fewest bytes a message takes in a body: [0, 0, nil, b""] is 94 00 00 c0 c4 00.
MESSAGE_BYTES_MIN = 6

# What the first byte of a msgpack value says it is (the body's walk looks
# before it reads, so that it never builds a value of a type it refuses).
_OTHER, _INT, _NIL, _MAP, _STR, _BIN = range(6)  # _OTHER: refused wherever it appears
_KINDS = bytearray(256)
_KINDS[0x00:0x80] = bytes([_INT]) * 0x80  # positive fixint
_KINDS[0xe0:0x100] = bytes([_INT]) * 0x20  # negative fixint
_KINDS[0xcc:0xd4] = bytes([_INT]) * 8  # uint 8..64, int 8..64
_KINDS[0xc0] = _NIL
_KINDS[0x80:0x90] = bytes([_MAP]) * 0x10  # fixmap
_KINDS[0xde] = _KINDS[0xdf] = _MAP  # map 16, 32
_KINDS[0xa0:0xc0] = bytes([_STR]) * 0x20  # fixstr
_KINDS[0xd9] = _KINDS[0xda] = _KINDS[0xdb] = _STR  # str 8, 16, 32
_KINDS[0xc4] = _KINDS[0xc5] = _KINDS[0xc6] = _BIN  # bin 8, 16, 32
_KINDS = bytes(_KINDS)


def check_batch(send: "Send") -> Codec:
    """Whether a producer's batch can be stored as it is: its codec is
    known, it has one key (or nil) per message, its sequence ids can hold
    its count, its body decompresses (whole, within BODY_BYTES_MAX, to the
    size its frame declares) to exactly `message_count` well-formed messages
    whose sequence ids rise from the first to the last the batch declares,
    and nothing follows them. Returns the codec; raises MalformedBatchError.

    The declared count is trusted for nothing before it is checked: it is
    compared with the sequence ids and with the body's (declared) size
    before anything is decompressed, and the walk of the body reads each
    message from the body's bytes. Memory: the decompressed body and the
    unpacker's copy of it (each at most BODY_BYTES_MAX), and one integer or
    property string at a time; no payload or message is built."""
    try:
        codec = Codec(send.codec)
    except ValueError:
        raise MalformedBatchError(f"malformed batch: unknown codec {send.codec!r:.40}; "
                                  f"known: {', '.join(codec.value for codec in Codec)}") from None
    count = send.message_count
    if send.keys is not None and len(send.keys) != count:
        raise MalformedBatchError(f"malformed batch: {len(send.keys)} keys for {count} messages (one key, or nil, per message)")
    first_sequence_id, last_sequence_id = send.first_sequence_id, send.last_sequence_id
    if last_sequence_id - first_sequence_id < count - 1:
        raise MalformedBatchError(f"malformed batch: sequence ids {first_sequence_id}..{last_sequence_id} cannot number "
                                  f"{count} messages (they rise within a batch)")
    body = send.body
    try:
        declared = _declared_size(codec, body)
        if declared is not None and declared < 1 + MESSAGE_BYTES_MIN * count:
            raise MalformedEntryError(f"a body of {declared} bytes cannot hold {count} messages")
        raw = decompress(codec, body)
        _walk_body(raw, count, first_sequence_id, last_sequence_id)
    except MalformedEntryError as error:
        raise MalformedBatchError(f"malformed batch: {error}") from None
    return codec


def _declared_size(codec: Codec, body: bytes) -> int | None:
    """The decompressed size a body's own header declares, if it declares
    one (checked against the real size when decompressing)."""
    if codec is Codec.NONE:
        return len(body)
    try:
        if codec is Codec.ZSTD:
            import zstandard

            size = zstandard.get_frame_parameters(body).content_size
            return None if size == zstandard.CONTENTSIZE_UNKNOWN else size
        if codec is Codec.LZ4:
            import lz4.frame

            return lz4.frame.get_frame_info(body)["content_size"] or None
    except Exception as error:  # each codec library raises its own types
        raise MalformedEntryError(f"{codec.value} body has no valid frame header: {error}") from None
    # gzip: the trailer's size is modulo 2**32, and `decompress` checks it.
    return None


def _walk_body(raw: bytes, count: int, first_sequence_id: int, last_sequence_id: int) -> None:
    """Check a decompressed body message by message: msgpack's C unpacker
    reads the headers and the sequence ids and skips the rest, each value's
    first byte looked at before (about 0.35 µs a message, as fast as
    unpacking the body whole, without building its objects: a body of
    nested empty arrays would take 60 times its size as Python lists)."""
    if len(raw) < 1 + MESSAGE_BYTES_MIN * count:
        raise MalformedEntryError(f"a body of {len(raw)} bytes cannot hold {count} messages")
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(raw), 1))
    unpacker.feed(raw)
    tell, unpack, skip, array_header = unpacker.tell, unpacker.unpack, unpacker.skip, unpacker.read_array_header
    kinds = _KINDS
    previous = first_sequence_id - 1
    index = -1
    try:
        if raw[0] not in _ARRAY_HEADERS:
            raise MalformedEntryError("the body is not an array of messages")
        held = array_header()
        if held != count:
            raise MalformedEntryError(f"the body holds {held} messages, the batch says {count}")
        for index in range(count):
            if raw[tell()] not in _ARRAY_HEADERS or array_header() != 4:
                raise MalformedEntryError(f"message {index} is not an array of 4 fields")
            if kinds[raw[tell()]] != _INT:
                raise MalformedEntryError(f"message {index}: its sequence id is not an integer")
            sequence_id = unpack()
            if sequence_id <= previous or (index == 0 and sequence_id != first_sequence_id):
                raise MalformedEntryError(f"message {index}: sequence id {sequence_id} is not "
                                          + ("the batch's first" if index == 0 else f"above {previous}"))
            previous = sequence_id
            if kinds[raw[tell()]] != _INT:
                raise MalformedEntryError(f"message {index}: its publish time is not an integer")
            skip()
            kind = kinds[raw[tell()]]
            if kind == _NIL:
                skip()
            elif kind == _MAP:
                for _ in range(2 * unpacker.read_map_header()):
                    if kinds[raw[tell()]] != _STR:
                        raise MalformedEntryError(f"message {index}: its properties are not a map of strings")
                    unpack()  # decodes the UTF-8 a consumer will decode
            else:
                raise MalformedEntryError(f"message {index}: its properties are not a map of strings (or nil)")
            if kinds[raw[tell()]] != _BIN:
                raise MalformedEntryError(f"message {index}: its payload is not binary")
            skip()
    except MalformedEntryError:
        raise
    except (IndexError, msgpack.OutOfData):  # raw[tell()] at the end of the body, or a length past it
        raise MalformedEntryError(f"the body ends inside {_where(index)}") from None
    except Exception as error:  # msgpack raises several unrelated types (bad UTF-8, a type where a header was read)
        raise MalformedEntryError(f"{_where(index)} does not decode: {type(error).__name__}: {error}"[:200]) from None
    if previous != last_sequence_id:
        raise MalformedEntryError(f"the last message's sequence id is {previous}, the batch says {last_sequence_id}")
    if tell() != len(raw):
        raise MalformedEntryError(f"{len(raw) - tell()} bytes follow the last message")


_ARRAY_HEADERS = frozenset([*range(0x90, 0xa0), 0xdc, 0xdd])  # fixarray, array 16, array 32


def _where(index: int) -> str:
    return "its array header" if index < 0 else f"message {index}"


def _ints(*values: Any) -> bool:
    return all(type(value) is int for value in values)


def _str_map(value: Any) -> bool:
    return type(value) is dict and all(type(key) is str and type(item) is str for key, item in value.items())


__all__ = [
    "BODY_BYTES_MAX",
    "MESSAGE_BYTES_MIN",
    "BatchHeader",
    "BodyColumns",
    "Codec",
    "MalformedEntryError",
    "MessageRecord",
    "body_columns",
    "body_items",
    "check_batch",
    "compress",
    "decode_body",
    "decode_entry",
    "decompress",
    "encode_body",
    "encode_entry",
]
