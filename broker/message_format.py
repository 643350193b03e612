"""How messages are stored in ledger entries: one entry holds one message
or one batch of one producer's messages, in Pulsar's layout, behind the
broker's own metadata:

    [magic 0x0e02][size, u32][BrokerEntryMetadata]
    [magic 0x0e01][CRC32C][size, u32][MessageMetadata][payload]

The second line is the producer's message exactly as it came, whichever
protocol brought it (`broker/pulsar_message.py`); it is what a Pulsar
consumer receives. The BrokerEntryMetadata holds when the broker took the
entry and the partition offset of its last message (Pulsar's
`broker_timestamp` and `index`), and, for a batch whose messages' keys the
MessageMetadata does not tell, each message's key, so that key-shared
dispatch never decompresses.

The broker checks a producer's message once, when it takes it
(`check_batch`: checksum, metadata, codec, count, sequence ids, and every
message of the batch), then only adds its metadata. Entries of the format
quire wrote before (`broker/legacy_entry.py`) are read as they are.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from broker import legacy_entry
from broker.codecs import Codec, CodecError, compress, decompress
from broker.entry_types import BODY_BYTES_MAX, BatchHeader, BodyColumns, MalformedEntryError, MessageRecord
from broker.errors import ChecksumMismatchError, MalformedBatchError, NotAllowedError
from broker.pulsar.pulsar_api_pb2 import BrokerEntryMetadata, MessageKey, MessageMetadata, SingleMessageMetadata
from broker.pulsar_message import (
    METADATA_BYTES_MAX,
    SIZE_PREFIX,
    ChecksumError,
    MalformedMessageError,
    OutMessage,
    ParsedMessage,
    build_batch,
    codec_of,
    frame_message,
    parse_message,
    properties_of,
    uncompressed_payload,
    walk_batch,
)

ENTRY_MAGIC = 0x0E02
_PREFIX = struct.Struct(">HI")  # magic, broker entry metadata size
BROKER_METADATA_BYTES_MAX = 8 * 1024 * 1024  # its keys: at most one per message of a batch
CHUNKS_MAX = 100_000  # chunks of one chunked message (Pulsar sets none; 100,000 chunks of 5 MiB: 500 GB)


@dataclass(frozen=True, slots=True)
class CheckedBatch:
    """What the broker learnt from checking a producer's message."""

    codec: Codec
    keys: tuple[str | None, ...] | None  # one per message, or None when no message has a key
    batched: bool
    store_keys: bool  # the keys are not all the MessageMetadata's: the entry stores them
    partial_chunk: bool = False  # a chunk of a chunked message other than its last (not deduplicated)


def check_batch(body: bytes, first_sequence_id: int, last_sequence_id: int, message_count: int,
                producer_id: str) -> CheckedBatch:
    """Whether a producer's message (Pulsar's layout) can be stored as it
    is: its checksum matches, its metadata decodes and names this producer,
    the first sequence id and the count its sender declared, a codec known
    here and nothing quire does not do (encryption, transactions,
    markers), and a chunk of a chunked message that names its message and
    its place in it; its payload decompresses to exactly the size declared (within
    BODY_BYTES_MAX) and, for a batch, holds exactly its messages, whose
    sequence ids (where given) rise from the first to at most the last,
    the metadata's own (its highest, or the first plus the count); keys and
    properties are UTF-8.
    Raises MalformedBatchError, ChecksumMismatchError or NotAllowedError."""
    try:
        message = parse_message(body)
    except ChecksumError as error:
        raise ChecksumMismatchError(f"checksum error: {error}") from None
    except MalformedMessageError as error:
        raise MalformedBatchError(f"malformed batch: {error}") from None
    metadata = message.metadata
    _refuse_what_quire_does_not_do(metadata)
    _check_chunk(metadata, message.batched)
    if metadata.producer_name != producer_id:
        raise MalformedBatchError(f"malformed batch: written by producer {metadata.producer_name!r:.80}, "
                                  f"sent by {producer_id!r:.80}")
    count = message.message_count
    if count != message_count:
        raise MalformedBatchError(f"malformed batch: it holds {count} messages, its sender says {message_count}")
    if metadata.sequence_id != first_sequence_id:
        raise MalformedBatchError(f"malformed batch: its first sequence id is {metadata.sequence_id}, "
                                  f"its sender says {first_sequence_id}")
    if last_sequence_id - first_sequence_id < count - 1:
        raise MalformedBatchError(f"malformed batch: sequence ids {first_sequence_id}..{last_sequence_id} cannot number "
                                  f"{count} messages (they rise within a batch)")
    # What a reader of the entry takes for its last sequence id: deduplication
    # rebuilt from the entries must learn what it was told when this one was
    # taken.
    stored_last = _last_sequence_id(metadata, count)
    if stored_last != last_sequence_id:
        raise MalformedBatchError(f"malformed batch: its last sequence id is {stored_last}, its sender says {last_sequence_id}")
    try:
        codec = codec_of(metadata)
        # A chunk holds a slice of its message's compressed payload: the
        # consumer decompresses the message once it has every chunk.
        raw = b"" if _chunked(metadata) else uncompressed_payload(message, BODY_BYTES_MAX)
    except MalformedMessageError as error:
        raise MalformedBatchError(f"malformed batch: {error}") from None
    batch_key = metadata.partition_key if metadata.HasField("partition_key") else None
    if not _text(metadata):
        raise MalformedBatchError("malformed batch: its key or properties are not UTF-8")
    if not message.batched:
        return CheckedBatch(codec, None if batch_key is None else (batch_key,), False, False, _partial_chunk(metadata))
    previous = first_sequence_id - 1
    keys = []
    try:
        # One message's metadata at a time (walk_batch): only the keys are kept.
        index = -1
        for single_metadata, _, _ in walk_batch(raw, count):
            index += 1
            sequence_id = single_metadata.sequence_id if single_metadata.HasField("sequence_id") else previous + 1
            if sequence_id <= previous or sequence_id > last_sequence_id or (index == 0 and sequence_id != first_sequence_id):
                raise MalformedBatchError(
                    f"malformed batch: message {index}: sequence id {sequence_id} is not "
                    + ("the batch's first" if index == 0 else f"above {previous} and at most {last_sequence_id}"))
            previous = sequence_id
            if single_metadata.HasField("partition_key"):
                key = single_metadata.partition_key
                if type(key) is not str:
                    raise MalformedBatchError(f"malformed batch: message {index}: its key or properties are not UTF-8")
            else:
                key = None
            if single_metadata.properties and not _text(single_metadata):
                raise MalformedBatchError(f"malformed batch: message {index}: its key or properties are not UTF-8")
            keys.append(key)
    except MalformedMessageError as error:
        raise MalformedBatchError(f"malformed batch: {error}") from None
    if batch_key is None and all(key is None for key in keys):
        return CheckedBatch(codec, None, True, False)
    # Readers take the batch's key for every message unless the entry stores
    # the keys (decode_entry): stored when any message's differs, even when
    # none has one.
    return CheckedBatch(codec, tuple(keys), True, any(key != batch_key for key in keys))


def _last_sequence_id(metadata: MessageMetadata, count: int) -> int:
    """The sequence id of a message's last message: the metadata's highest,
    unless that is not set (nor as high as the count needs)."""
    first_sequence_id = metadata.sequence_id
    highest = metadata.highest_sequence_id
    return highest if highest >= first_sequence_id + count - 1 else first_sequence_id + count - 1


def _text(metadata: MessageMetadata | SingleMessageMetadata) -> bool:
    """Whether the key and the properties of a message are UTF-8: protobuf
    gives the bytes of a string field that is not, which no consumer could
    decode (nor an entry store as a key)."""
    if metadata.HasField("partition_key") and type(metadata.partition_key) is not str:
        return False
    return all(type(pair.key) is str and type(pair.value) is str for pair in metadata.properties)


def _chunked(metadata: MessageMetadata) -> bool:
    """A chunk of a chunked message (a message of one chunk that names no
    chunked message is a message: Pulsar's clients write so with chunking
    on and a message that fits)."""
    return metadata.HasField("chunk_id") or metadata.HasField("uuid") or metadata.num_chunks_from_msg > 1


def _partial_chunk(metadata: MessageMetadata) -> bool:
    """A chunk of a chunked message other than its last."""
    return _chunked(metadata) and metadata.chunk_id < metadata.num_chunks_from_msg - 1


def _check_chunk(metadata: MessageMetadata, batched: bool) -> None:
    """A chunk (Pulsar's chunking: one message's payload cut into several
    messages of one sequence id) names its message and its place in it."""
    if not _chunked(metadata):
        return
    if batched:
        raise MalformedBatchError("malformed batch: a chunk of a chunked message cannot be in a batch")
    if not metadata.uuid or type(metadata.uuid) is not str:
        raise MalformedBatchError("malformed batch: a chunk names no chunked message (its uuid)")
    chunks, chunk_id = metadata.num_chunks_from_msg, metadata.chunk_id
    if not 1 <= chunks <= CHUNKS_MAX or not 0 <= chunk_id < chunks:
        raise MalformedBatchError(f"malformed batch: chunk {chunk_id} of {chunks} (at most {CHUNKS_MAX} chunks)")
    if metadata.total_chunk_msg_size < 0:
        raise MalformedBatchError("malformed batch: a chunked message of a negative size")


def _refuse_what_quire_does_not_do(metadata: MessageMetadata) -> None:
    if metadata.encryption_keys or metadata.HasField("encryption_algo"):
        raise NotAllowedError("encrypted messages are not supported by quire brokers")
    if metadata.txnid_most_bits or metadata.txnid_least_bits:
        raise NotAllowedError("transactions are not supported by quire brokers")
    if metadata.HasField("marker_type"):
        raise NotAllowedError("marker messages are not supported by quire brokers")


# --- entries ------------------------------------------------------------------------------


def encode_entry(header: BatchHeader, message: bytes, *, store_keys: bool) -> bytes:
    """The entry of a checked message: the broker's metadata (the time it
    took it, the offset of its last message, and the keys if `store_keys`)
    in front of the message as it came."""
    broker_metadata = BrokerEntryMetadata(broker_timestamp=header.publish_time_ms, index=header.last_offset)
    if store_keys:
        assert header.keys is not None and len(header.keys) == header.message_count
        broker_metadata.message_keys.extend(MessageKey() if key is None else MessageKey(key=key) for key in header.keys)
    packed = broker_metadata.SerializeToString()
    return b"".join((_PREFIX.pack(ENTRY_MAGIC, len(packed)), packed, message))


def decode_entry(data: bytes | memoryview) -> tuple[BatchHeader, memoryview]:
    """The header of an entry and its message (Pulsar's layout; for an
    entry of the legacy format, its still compressed body). Reads the
    metadata only: a dispatch never decompresses."""
    view = memoryview(data)
    if len(view) >= 1 and view[0] == legacy_entry.ENTRY_FORMAT_VERSION:
        return legacy_entry.decode_entry(view)
    if len(view) < _PREFIX.size:
        raise MalformedEntryError("entry is shorter than its prefix")
    magic, size = _PREFIX.unpack_from(view)
    if magic != ENTRY_MAGIC:
        raise MalformedEntryError(f"entry starts with {magic:#06x}, neither a message batch nor a legacy entry")
    start = _PREFIX.size + size
    if size > BROKER_METADATA_BYTES_MAX or start > len(view):
        raise MalformedEntryError("entry metadata runs past the end of the entry")
    broker_metadata = BrokerEntryMetadata()
    try:
        broker_metadata.ParseFromString(view[_PREFIX.size:start])
        # Checked when it was taken: only the metadata is read again here.
        message = parse_message(view[start:], verify_checksum=False)
        codec = codec_of(message.metadata)
    except (DecodeError, MalformedMessageError) as error:
        raise MalformedEntryError(f"entry does not decode: {error}") from None
    metadata = message.metadata
    count = message.message_count
    if count < 1 or not broker_metadata.HasField("index") or broker_metadata.index < count - 1:
        raise MalformedEntryError("entry metadata does not match its message count")
    stored = broker_metadata.message_keys
    if stored:
        if len(stored) != count:
            raise MalformedEntryError(f"entry holds {len(stored)} keys for {count} messages")
        keys = tuple(item.key if item.HasField("key") else None for item in stored)
    elif metadata.HasField("partition_key"):
        keys = (metadata.partition_key,) * count
    else:
        keys = None
    if type(metadata.producer_name) is not str or (keys is not None and not all(key is None or type(key) is str for key in keys)):
        raise MalformedEntryError("entry names its producer or keys in bytes that are not UTF-8")
    header = BatchHeader(metadata.producer_name, metadata.sequence_id, _last_sequence_id(metadata, count),
                         broker_metadata.index - count + 1, count, broker_metadata.broker_timestamp, codec, keys, start,
                         message.batched, metadata.deliver_at_time, _partial_chunk(metadata), _chunked(metadata))
    return header, view[start:]


def body_items(header: BatchHeader, body: bytes | memoryview) -> list[tuple[int, int, dict[str, str], bytes, int]]:
    """The messages of an entry as (sequence id, publish time, properties,
    payload, event time) tuples, checked: the consumer's hot path."""
    if header.legacy:
        return legacy_entry.body_items(header, body)
    message = _message(body, header)
    metadata = message.metadata
    publish_ms = metadata.publish_time
    try:
        raw = uncompressed_payload(message, BODY_BYTES_MAX)
        if not message.batched:
            return [(metadata.sequence_id, publish_ms, properties_of(metadata.properties), raw, metadata.event_time)]
        return _batch_items(raw, header.message_count, metadata.sequence_id, publish_ms)
    except MalformedMessageError as error:
        raise MalformedEntryError(f"entry body: {error}") from None


def _batch_items(raw: bytes, count: int, first_sequence_id: int, publish_ms: int) -> list:
    """`walk_batch` and the building of each message's tuple in one loop: a
    consumer's hot path, where a generator's step per message costs a
    fifth of the rest (the bounds are walk_batch's)."""
    if count < 1 or count * SIZE_PREFIX.size > len(raw):
        raise MalformedMessageError(f"a payload of {len(raw)} bytes cannot hold {count} messages")
    parse = SingleMessageMetadata.FromString
    unpack_size = SIZE_PREFIX.unpack_from
    view = memoryview(raw)
    end = len(raw)
    position = 0
    sequence_id = first_sequence_id - 1
    items = []
    append = items.append
    try:
        for index in range(count):
            size = unpack_size(view, position)[0]
            start = position + SIZE_PREFIX.size
            stop = start + size
            if size > METADATA_BYTES_MAX or stop > end:
                raise MalformedMessageError(f"message {index}: its metadata of {size} bytes runs past the batch")
            single = parse(view[start:stop])
            payload_end = stop + single.payload_size
            if payload_end > end or payload_end < stop:
                raise MalformedMessageError(f"message {index}: its payload runs past the batch")
            # Stored ids rise (check_batch saw to it): one that does not
            # rise was not set (it reads 0), and is the one before plus one.
            given = single.sequence_id
            sequence_id = given if given > sequence_id else sequence_id + 1
            properties = single.properties
            append((sequence_id, publish_ms, {pair.key: pair.value for pair in properties} if properties else {},
                    raw[stop:payload_end], single.event_time))
            position = payload_end
    except (struct.error, DecodeError) as error:
        raise MalformedMessageError(f"the batch does not decode: {error}") from None
    if position != end:
        raise MalformedMessageError(f"{end - position} bytes follow the batch's last message")
    return items


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a chunked message, as a consumer puts them together."""

    uuid: str  # the chunked message's, with its producer's name
    chunk_id: int
    chunks: int
    total_bytes: int  # the chunked message's payload, as sent (compressed)
    payload: bytes  # this chunk's slice of it


def chunk_of(header: BatchHeader, body: bytes | memoryview) -> Chunk | None:
    """The chunk an entry holds (None: the entry is not a chunk)."""
    if not header.chunked:
        return None
    message = _message(body, header)
    metadata = message.metadata
    return Chunk(f"{metadata.producer_name}/{metadata.uuid}", metadata.chunk_id, metadata.num_chunks_from_msg,
                 metadata.total_chunk_msg_size, bytes(message.payload))


def chunked_message(header: BatchHeader, body: bytes | memoryview, payloads: list[bytes],
                    bytes_max: int = BODY_BYTES_MAX) -> tuple[int, int, dict[str, str], bytes, int]:
    """The message of a chunked message's chunks (`header` and `body`: its
    last chunk's entry; `payloads`: every chunk's, in order), as
    `body_items` gives a message: its payload put together and
    decompressed (at most `bytes_max`)."""
    message = _message(body, header)
    metadata = message.metadata
    payload = b"".join(payloads)
    if len(payload) != metadata.total_chunk_msg_size:
        raise MalformedEntryError(f"chunked message of {metadata.total_chunk_msg_size} bytes: its chunks hold {len(payload)}")
    codec = codec_of(metadata)
    try:
        if codec is not Codec.NONE:
            size = metadata.uncompressed_size
            if size > bytes_max:
                raise MalformedMessageError(f"chunked message of {size} bytes uncompressed, past {bytes_max}")
            payload = decompress(codec, payload, size)
    except (MalformedMessageError, CodecError) as error:
        raise MalformedEntryError(f"chunked message: {error}") from None
    return (metadata.sequence_id, metadata.publish_time, properties_of(metadata.properties), payload, metadata.event_time)


def null_values(header: BatchHeader, body: bytes | memoryview) -> list[bool]:
    """For each message of an entry, whether it is a null value (Pulsar's
    `null_value`, or an empty payload): what deletes its key from a
    compacted view. A single message's answer needs no decompression."""
    if header.legacy:
        return [not item[3] for item in legacy_entry.body_items(header, body)]
    message = _message(body, header)
    metadata = message.metadata
    if not message.batched:
        empty = len(message.payload) == 0 if codec_of(metadata) is Codec.NONE else metadata.uncompressed_size == 0
        return [metadata.null_value or empty]
    try:
        raw = uncompressed_payload(message, BODY_BYTES_MAX)
        return [single.null_value or start == end for single, start, end in walk_batch(raw, header.message_count)]
    except MalformedMessageError as error:
        raise MalformedEntryError(f"entry body: {error}") from None


def compacted_out(data: bytes | memoryview, kept: tuple[int, ...]) -> bytes:
    """The entry as a compacted view stores it: the messages of a batch not
    in `kept` (batch indexes) are marked compacted out (Pulsar's
    `compacted_out`) and lose their payloads; each message keeps its batch
    index, and so its message id and offset. Raises MalformedEntryError."""
    header, body = decode_entry(data)
    if header.legacy or not header.batched or len(kept) == header.message_count:
        return bytes(data)
    message = _message(body, header)
    keep = set(kept)
    parts = []
    try:
        raw = uncompressed_payload(message, BODY_BYTES_MAX)
        for index, (single, start, end) in enumerate(walk_batch(raw, header.message_count)):
            payload = raw[start:end]
            if index not in keep:
                single.compacted_out = True
                single.payload_size = 0
                single.ClearField("null_value")
                payload = b""
            packed = single.SerializeToString()
            parts += (SIZE_PREFIX.pack(len(packed)), packed, payload)
    except MalformedMessageError as error:
        raise MalformedEntryError(f"entry body: {error}") from None
    rebuilt = b"".join(parts)
    metadata = MessageMetadata()
    metadata.CopyFrom(message.metadata)
    codec = codec_of(metadata)
    if codec is not Codec.NONE:
        metadata.uncompressed_size = len(rebuilt)
    return bytes(data[:header.message_start]) + frame_message(metadata, compress(codec, rebuilt))


def decode_body(header: BatchHeader, body: bytes | memoryview) -> list[MessageRecord]:
    return [MessageRecord(*item) for item in body_items(header, body)]


def body_columns(header: BatchHeader, body: bytes | memoryview) -> BodyColumns:
    """What `body_items` gives, column by column (the Spark export's path)."""
    if header.legacy:
        return legacy_entry.body_columns(header, body)
    sequence_ids, publish_times_ms, properties, payloads, _ = zip(*body_items(header, body))
    return BodyColumns(sequence_ids, publish_times_ms, tuple(item or None for item in properties), payloads)


def _message(body, header: BatchHeader) -> ParsedMessage:
    try:
        message = parse_message(body, verify_checksum=False)
    except MalformedMessageError as error:
        raise MalformedEntryError(f"entry body: {error}") from None
    if message.message_count != header.message_count:
        raise MalformedEntryError("entry body does not match its header")
    return message


def pulsar_message(header: BatchHeader, body: bytes | memoryview) -> bytes | memoryview:
    """What a Pulsar consumer receives for an entry: its message as stored,
    or, for an entry of the legacy format, its messages as a batch in
    Pulsar's layout (uncompressed, each with its key and properties)."""
    if not header.legacy:
        return body
    items = legacy_entry.body_items(header, body)
    parts = []
    try:
        # Pulsar's publish time is unsigned; the legacy format took any
        # integer from its producers: a time before 1970 reads as 0.
        metadata = MessageMetadata(producer_name=header.producer_id, sequence_id=header.first_sequence_id,
                                   publish_time=max(items[0][1], 0), num_messages_in_batch=len(items),
                                   highest_sequence_id=header.last_sequence_id)
        for index, (sequence_id, _, properties, payload, _) in enumerate(items):
            single = SingleMessageMetadata(payload_size=len(payload), sequence_id=sequence_id)
            key = header.key_of(index)
            if key is not None:
                single.partition_key = key
            for name, value in properties.items():
                single.properties.add(key=name, value=value)
            packed = single.SerializeToString()
            parts += (len(packed).to_bytes(4, "big"), packed, payload)
    except ValueError as error:  # a sequence id no uint64 holds (the legacy header only checks its type)
        raise MalformedEntryError(f"legacy entry has no Pulsar message: {error}") from None
    return frame_message(metadata, b"".join(parts))


def entry_of(producer_id: str, first_offset: int, broker_time_ms: int, messages: list[OutMessage],
             codec: Codec = Codec.NONE, *, publish_time_ms: int | None = None, batched: bool | None = None) -> bytes:
    """An entry as the broker would store these messages of one producer
    (built, checked and given its metadata): for tools, the simulator and
    tests. A single message goes without a batch unless `batched`."""
    batched = len(messages) > 1 if batched is None else batched
    message = build_batch(producer_id, broker_time_ms if publish_time_ms is None else publish_time_ms, messages, codec,
                          batched=batched)
    first_sequence_id, last_sequence_id = messages[0].sequence_id, messages[-1].sequence_id
    checked = check_batch(message, first_sequence_id, last_sequence_id, len(messages), producer_id)
    header = BatchHeader(producer_id, first_sequence_id, last_sequence_id, first_offset, len(messages), broker_time_ms,
                         checked.codec, checked.keys)
    return encode_entry(header, message, store_keys=checked.store_keys)


__all__ = [
    "BODY_BYTES_MAX",
    "BatchHeader",
    "BodyColumns",
    "CheckedBatch",
    "Codec",
    "MalformedEntryError",
    "MessageRecord",
    "Chunk",
    "body_columns",
    "chunk_of",
    "chunked_message",
    "compacted_out",
    "null_values",
    "body_items",
    "check_batch",
    "decode_body",
    "decode_entry",
    "encode_entry",
    "entry_of",
    "pulsar_message",
]
