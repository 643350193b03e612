"""How the broker takes and stores a producer's message (Pulsar's layout):
its check (`check_batch`: what is refused, with which error, and which keys
the entry stores), the entry around it, what consumers read back, and bytes
that are not an entry (MalformedEntryError, never another exception)."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
import zlib

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.codecs import Codec, compress
from broker.errors import BrokerStatus, ChecksumMismatchError, MalformedBatchError, NotAllowedError
from broker.message_format import (
    BODY_BYTES_MAX,
    BatchHeader,
    BodyColumns,
    CheckedBatch,
    MalformedEntryError,
    MessageRecord,
    body_columns,
    body_items,
    check_batch,
    decode_body,
    decode_entry,
    encode_entry,
    pulsar_message,
)
from broker.protocol import KEYS_MAX
from broker.pulsar.pulsar_api_pb2 import BrokerEntryMetadata, EncryptionKeys, MessageMetadata, SingleMessageMetadata
from broker.pulsar_message import MAGIC_CRC32C, OutMessage, build_batch, frame_message, parse_message

PRODUCER = "billing-1"
PUBLISH_MS = 1_700_000_000_000  # the producer's clock
BROKER_MS = 1_700_000_000_500  # when the broker took the entry
MESSAGES = [
    OutMessage(7, b"payload one", "account-42", {"kind": "debit", "currency": "EUR"}, 1_600_000_000_000),
    OutMessage(8, b"", None, None, 0),
    OutMessage(9, bytes(range(256)) * 4, "account-7", {}, 1_600_000_000_002),
]


def message_of(messages, codec: Codec = Codec.NONE, *, batched: bool = True, producer: str = PRODUCER) -> bytes:
    """What a producer of quire's or Pulsar's clients sends."""
    return build_batch(producer, PUBLISH_MS, messages, codec, batched=batched)


def sender_for(first_sequence_id: int, last_sequence_id: int, message_count: int) -> dict:
    """What the SEND beside a message says (check_batch's arguments besides the message)."""
    return {"first_sequence_id": first_sequence_id, "last_sequence_id": last_sequence_id, "message_count": message_count,
            "producer_id": PRODUCER}


def sender_of(messages, **changes) -> dict:
    """What a well-behaved sender of `messages` says, with `changes`."""
    return {**sender_for(messages[0].sequence_id, messages[-1].sequence_id, len(messages)), **changes}


def checked(messages, codec: Codec = Codec.NONE, *, batched: bool = True, **changes) -> CheckedBatch:
    return check_batch(message_of(messages, codec, batched=batched), **sender_of(messages, **changes))


def checked_message(message: bytes, messages, **changes) -> CheckedBatch:
    return check_batch(message, **sender_of(messages, **changes))


def numbered(count: int, payload: bytes = b"m", first: int = 0, key=None) -> list[OutMessage]:
    return [OutMessage(first + index, payload, key) for index in range(count)]


def refused(message: bytes, sender: dict, match: str, error: type = MalformedBatchError) -> None:
    """`message` is refused with `error` (and its status), the reason in its text."""
    with pytest.raises(error, match=match) as caught:
        check_batch(message, **sender)
    assert type(caught.value) is error
    assert caught.value.status is {MalformedBatchError: BrokerStatus.BAD_REQUEST, ChecksumMismatchError: BrokerStatus.CHECKSUM,
                                   NotAllowedError: BrokerStatus.NOT_ALLOWED}[error]
    if error is MalformedBatchError:
        assert str(caught.value).startswith("malformed batch: ")


def single_of(payload: bytes = b"m", **fields) -> bytes:
    """One message of a batch payload: [u32 size][SingleMessageMetadata][payload]."""
    packed = SingleMessageMetadata(payload_size=len(payload), **fields).SerializeToString()
    return struct.pack(">I", len(packed)) + packed + payload


def checksummed(body: bytes) -> bytes:
    """[magic][CRC32C of `body`][`body`]: a message as Pulsar's clients frame it."""
    return struct.pack(">HI", MAGIC_CRC32C, crc32c.crc32c(body)) + body


def forged(raw: bytes, count: int | None = None, codec: Codec = Codec.NONE, **fields) -> bytes:
    """A message with any metadata (`count` None: not a batch) around `raw`."""
    metadata = MessageMetadata(**{"producer_name": PRODUCER, "sequence_id": 0, "publish_time": PUBLISH_MS, **fields})
    if count is not None:
        metadata.num_messages_in_batch = count
    if codec is not Codec.NONE:
        metadata.compression = codec.wire_number
        metadata.uncompressed_size = len(raw)
    return frame_message(metadata, compress(codec, raw))


# --- what the broker takes ---------------------------------------------------------------


@pytest.mark.parametrize("codec", list(Codec))
def test_good_batches_of_every_codec_are_accepted(codec):
    assert checked(MESSAGES, codec) == CheckedBatch(codec, ("account-42", None, "account-7"), True, True)
    assert checked(numbered(1), codec) == CheckedBatch(codec, None, True, False)
    assert checked(numbered(1), codec, batched=False) == CheckedBatch(codec, None, False, False)
    # Sequence ids may skip (a caller naming its own), as long as they rise.
    gaps = [OutMessage(10, b"a"), OutMessage(12, b"", properties={"k": "v"}), OutMessage(99, b"c" * 70_000)]
    assert checked(gaps, codec).codec is codec
    # Large: 1,000 messages of 1 KiB, as the benchmark's batches.
    assert checked(numbered(1000, os.urandom(1024)), codec).codec is codec


@pytest.mark.parametrize("codec", list(Codec))
def test_keyed_messages_of_every_codec_are_accepted_batched_or_not(codec):
    one = [OutMessage(3, b"x", "account-42")]
    assert checked(one, codec, batched=False) == CheckedBatch(codec, ("account-42",), False, False)
    assert checked(one, codec) == CheckedBatch(codec, ("account-42",), True, False)
    shared = numbered(5, key="account-42")
    assert checked(shared, codec) == CheckedBatch(codec, ("account-42",) * 5, True, False)


def test_a_message_without_its_checksum_is_accepted():
    # Pulsar's clients may leave the checksum out (the magic and the CRC32C).
    assert checked_message(message_of(MESSAGES)[6:], MESSAGES).keys == ("account-42", None, "account-7")


def test_the_smallest_and_the_largest_batches_are_accepted():
    # The smallest batch payload: six bytes a message (its size, and a
    # metadata of payload_size 0); one byte less cannot hold them.
    smallest = forged(single_of(b"") + single_of(b""), count=2, highest_sequence_id=1)
    raw_size = len(single_of(b"")) * 2
    assert raw_size == 12
    sender = sender_for(0, 1, 2)
    assert check_batch(smallest, **sender).batched
    cut = forged((single_of(b"") + single_of(b""))[:-1], count=2, highest_sequence_id=1)
    refused(cut, sender, "the batch ends before message 1|runs past the batch")
    # 100,000 messages (the protocol's most).
    assert checked(numbered(KEYS_MAX, b""), Codec.ZSTD).codec is Codec.ZSTD
    # A payload of nearly BODY_BYTES_MAX in one message.
    assert checked([OutMessage(0, bytes(BODY_BYTES_MAX - 64))], Codec.LZ4, batched=False).codec is Codec.LZ4


# --- which keys an entry stores ----------------------------------------------------------


def test_an_entry_stores_no_keys_where_the_metadata_tells_them():
    # A message without batching: its metadata's key is its own.
    assert not checked([OutMessage(0, b"x", "account-42")], batched=False).store_keys
    # A batch whose messages all have the batch's key (key-based batching).
    assert not checked(numbered(3, key="account-42")).store_keys
    # No key at all.
    assert checked(numbered(3)) == CheckedBatch(Codec.NONE, None, True, False)


def test_an_entry_stores_the_keys_of_a_batch_of_mixed_keys():
    mixed = [OutMessage(0, b"x", "a"), OutMessage(1, b"x", "b"), OutMessage(2, b"x", "a")]
    assert checked(mixed) == CheckedBatch(Codec.NONE, ("a", "b", "a"), True, True)
    partly = [OutMessage(0, b"x", "a"), OutMessage(1, b"x")]
    assert checked(partly) == CheckedBatch(Codec.NONE, ("a", None), True, True)


def test_an_entry_stores_the_keys_when_the_batch_key_is_not_the_messages():
    # A batch's key, messages without one: readers would take the batch's
    # key for each message unless the entry says otherwise.
    message = forged(single_of(sequence_id=0) + single_of(sequence_id=1), count=2, highest_sequence_id=1,
                     partition_key="batch-key")
    sender = sender_for(0, 1, 2)
    batch = check_batch(message, **sender)
    assert batch == CheckedBatch(Codec.NONE, (None, None), True, True)
    header, _ = stored(message, batch)
    assert header.keys == (None, None)
    # The other way round: messages of one key the batch does not name.
    keyed = forged(single_of(sequence_id=0, partition_key="k") + single_of(sequence_id=1, partition_key="k"), count=2,
                   highest_sequence_id=1)
    batch = check_batch(keyed, **sender)
    assert batch == CheckedBatch(Codec.NONE, ("k", "k"), True, True)
    assert stored(keyed, batch)[0].keys == ("k", "k")


# --- what the broker refuses -------------------------------------------------------------


def test_a_message_of_another_producer_is_refused():
    refused(message_of(MESSAGES, producer="someone-else"), sender_of(MESSAGES),
            "written by producer 'someone-else', sent by 'billing-1'")


@pytest.mark.parametrize("codec", list(Codec))
def test_a_count_that_does_not_match_the_message_is_refused(codec):
    message = message_of(numbered(10), codec)
    refused(message, sender_of(numbered(11)), "it holds 10 messages, its sender says 11")
    refused(message, sender_of(numbered(9)), "it holds 10 messages, its sender says 9")
    one = message_of(numbered(1), codec, batched=False)
    refused(one, sender_of(numbered(2)), "it holds 1 messages, its sender says 2")


def test_a_declared_count_is_checked_before_the_payload_is_read():
    # 100,000 messages declared with a 1-byte payload: refused by the
    # sequence ids, or (ids wide enough) by the payload's size, before the
    # batch is split.
    message = forged(b"x", count=100_000, highest_sequence_id=10**9)
    refused(message, sender_for(0, 0, 100_000),
            "sequence ids 0..0 cannot number 100000 messages")
    refused(message, sender_for(0, 10**9, 100_000),
            "a payload of 1 bytes cannot hold 100000 messages")
    small = forged(single_of() + single_of(), count=1000, codec=Codec.ZSTD, highest_sequence_id=999)
    refused(small, sender_of(numbered(1000)), r"a payload of \d+ bytes cannot hold 1000 messages")


def batch(*singles: bytes, first: int, highest: int) -> bytes:
    return forged(b"".join(singles), count=len(singles), sequence_id=first, highest_sequence_id=highest)


def test_sequence_ids_must_match_what_the_sender_says():
    messages = numbered(3, first=5)  # 5, 6, 7
    message = message_of(messages)
    refused(message, sender_of(messages, first_sequence_id=4), "its first sequence id is 5, its sender says 4")
    refused(message, sender_of(messages, first_sequence_id=6), "its first sequence id is 5, its sender says 6")
    refused(message, sender_of(messages, last_sequence_id=6), "sequence ids 5..6 cannot number 3 messages")
    refused(message, sender_of(messages, last_sequence_id=8), "its last sequence id is 7, its sender says 8")
    refused(message, sender_of(messages, first_sequence_id=7, last_sequence_id=5), "first sequence id is 5")
    one = message_of(messages[:1], batched=False)
    refused(one, sender_of(messages[:1], last_sequence_id=9), "its last sequence id is 5, its sender says 9")


def test_sequence_ids_must_rise_within_the_batch_up_to_the_last():
    sender = sender_for(5, 7, 3)
    refused(batch(single_of(sequence_id=5), single_of(sequence_id=5), single_of(sequence_id=7), first=5, highest=7), sender,
            "message 1: sequence id 5 is not above 5 and at most 7")
    refused(batch(single_of(sequence_id=5), single_of(sequence_id=7), single_of(sequence_id=6), first=5, highest=7), sender,
            "message 2: sequence id 6 is not above 7")
    refused(batch(single_of(sequence_id=4), single_of(sequence_id=6), single_of(sequence_id=7), first=5, highest=7), sender,
            "message 0: sequence id 4 is not the batch's first")
    # Past the last, named or implied (one more than the one before).
    refused(batch(single_of(sequence_id=5), single_of(sequence_id=6), single_of(sequence_id=8), first=5, highest=7), sender,
            "message 2: sequence id 8 is not above 6 and at most 7")
    refused(batch(single_of(sequence_id=5), single_of(sequence_id=7), single_of(), first=5, highest=7), sender,
            "message 2: sequence id 8 is not above 7 and at most 7")
    # Implied from the first where no message names its own; a gap before the last is allowed.
    assert check_batch(batch(single_of(), single_of(), single_of(), first=5, highest=7), **sender).batched
    assert check_batch(batch(single_of(sequence_id=5), single_of(sequence_id=6), single_of(), first=5, highest=9),
                       **sender_for(5, 9, 3)).batched


@pytest.mark.parametrize("codec", list(Codec))
def test_a_checksum_that_does_not_match_is_refused(codec):
    message = message_of(MESSAGES, codec)
    for at in (2, 6, 10, len(message) // 2, len(message) - 1):
        corrupted = message[:at] + bytes([message[at] ^ 0x20]) + message[at + 1:]
        refused(corrupted, sender_of(MESSAGES), "checksum error: message checksum does not match", ChecksumMismatchError)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"encryption_keys": [EncryptionKeys(key="consumer-a", value=b"secret")]}, "encrypted messages are not supported"),
        ({"encryption_algo": "RSA"}, "encrypted messages are not supported"),
        ({"txnid_most_bits": 1, "txnid_least_bits": 2}, "transactions are not supported"),
        ({"txnid_least_bits": 2}, "transactions are not supported"),
        ({"marker_type": 1}, "marker messages are not supported"),
    ],
)
def test_what_quire_does_not_do_is_not_allowed(fields, match):
    message = forged(single_of(sequence_id=0), count=1, **fields)
    refused(message, sender_for(0, 0, 1), match, NotAllowedError)


def test_a_message_of_one_chunk_is_a_message():
    # What Pulsar's clients write when chunking is on and the message fits.
    message = forged(single_of(sequence_id=0), count=1, num_chunks_from_msg=1)
    assert check_batch(message, first_sequence_id=0, last_sequence_id=0, message_count=1, producer_id=PRODUCER).batched


def test_keys_and_properties_that_are_not_utf8_are_refused():
    # protobuf hands over their bytes; no consumer could decode them, nor an
    # entry store them as keys.
    sender = sender_for(0, 1, 2)
    key = b"\x12\x01\xff"  # partition_key (field 2): one byte, not UTF-8
    property_value = b"\x0a\x06\x0a\x01k\x12\x01\xfe"  # properties (field 1): k -> 0xfe
    for bad in (key, property_value):
        packed = SingleMessageMetadata(payload_size=1, sequence_id=1).SerializeToString() + bad
        raw = single_of(b"x", sequence_id=0, partition_key="good") + struct.pack(">I", len(packed)) + packed + b"y"
        refused(forged(raw, count=2, highest_sequence_id=1), sender, "message 1: its key or properties are not UTF-8")
    # The metadata of a message without batching.
    metadata = MessageMetadata(producer_name=PRODUCER, sequence_id=0, publish_time=0).SerializeToString()
    for bad in (b"\x32\x01\xff", b"\x22\x06\x0a\x01\xff\x12\x01v"):  # partition_key (6); properties (4), a key of 0xff
        packed = metadata + bad
        body = struct.pack(">I", len(packed)) + packed + b"payload"
        refused(checksummed(body), sender_for(0, 0, 1), "its key or properties are not UTF-8")


def test_an_unknown_codec_is_refused():
    metadata = MessageMetadata(producer_name=PRODUCER, sequence_id=0, publish_time=0, uncompressed_size=1).SerializeToString()
    packed = metadata + b"\x40\x09"  # compression (field 8) = 9: a codec of some newer Pulsar
    body = struct.pack(">I", len(packed)) + packed + b"x"
    refused(checksummed(body), sender_for(0, 0, 1),
            "unknown compression type")


@pytest.mark.parametrize("codec", [codec for codec in Codec if codec is not Codec.NONE])
def test_a_payload_that_does_not_decompress_to_its_declared_size_is_refused(codec):
    messages = numbered(100, b"p" * 1000)
    good = parse_message(message_of(messages, codec))
    metadata, payload = good.metadata, bytes(good.payload)
    sender = sender_of(messages)

    def with_(new_payload: bytes = payload, **changes) -> bytes:
        changed = MessageMetadata()
        changed.CopyFrom(metadata)
        for name, value in changes.items():
            setattr(changed, name, value)
        return frame_message(changed, new_payload)

    size = metadata.uncompressed_size
    refused(with_(uncompressed_size=size + 1), sender, f"payload: {codec.value} ")
    refused(with_(uncompressed_size=size - 1), sender, f"payload: {codec.value} ")
    refused(with_(payload[: len(payload) // 2]), sender, f"payload: {codec.value} ")
    refused(with_(payload + b"\x00"), sender, f"payload: {codec.value} ")
    refused(with_(os.urandom(len(payload))), sender, f"payload: {codec.value} ")
    refused(with_(compress(codec, b"".join(single_of(b"p" * 1000, sequence_id=n) for n in range(99))),
                  uncompressed_size=len(b"".join(single_of(b"p" * 1000, sequence_id=n) for n in range(99)))),
            sender, "cannot hold 100 messages|ends before message 99")
    # Another codec's data.
    other = Codec.ZLIB if codec is not Codec.ZLIB else Codec.ZSTD
    refused(with_(compress(other, b"".join(single_of(b"p" * 1000, sequence_id=n) for n in range(100)))), sender,
            f"payload: {codec.value} ")


def test_a_bomb_is_refused_before_it_is_decompressed():
    # 256 MiB declared: refused from the metadata.
    metadata = MessageMetadata(producer_name=PRODUCER, sequence_id=0, publish_time=0, num_messages_in_batch=1,
                               compression=Codec.ZSTD.wire_number, uncompressed_size=256 * 1024 * 1024)
    message = frame_message(metadata, compress(Codec.ZSTD, bytes(1024)))
    sender = sender_for(0, 0, 1)
    refused(message, sender, f"declares 268435456 bytes uncompressed, past {BODY_BYTES_MAX}")
    # Declared small, 256 MiB in the data: decompression stops at the declared size.
    compressor = zlib.compressobj(9)
    data = b"".join(compressor.compress(bytes(1024 * 1024)) for _ in range(256)) + compressor.flush()
    metadata = MessageMetadata(producer_name=PRODUCER, sequence_id=0, publish_time=0, num_messages_in_batch=1,
                               compression=Codec.ZLIB.wire_number, uncompressed_size=1024 * 1024)
    refused(frame_message(metadata, data), sender, "zlib data decompresses past the 1048576 bytes declared")


# The check of a batch whose messages' metadata are empty properties, in a
# fresh interpreter (protobuf's memory is not Python's: tracemalloc does not
# see it): its resident memory must stay near the payload's size. Decoded,
# each property takes some 30 times its 2 bytes: all of them at once would
# take 8 MiB * 30.
_PROPERTIES_BOMB = """
import json, resource, struct, sys
from broker.codecs import Codec, compress
from broker.message_format import check_batch
from broker.pulsar.pulsar_api_pb2 import MessageMetadata
from broker.pulsar_message import frame_message

count = 8
packed = b"\\x0a\\x00" * (512 * 1024 - 4) + b"\\x18\\x00"  # empty properties, payload_size 0
raw = b"".join(struct.pack(">I", len(packed)) + packed for _ in range(count))
metadata = MessageMetadata(producer_name="p", sequence_id=0, publish_time=0, num_messages_in_batch=count,
                           highest_sequence_id=count - 1, compression=Codec.ZSTD.wire_number, uncompressed_size=len(raw))
message = frame_message(metadata, compress(Codec.ZSTD, raw))
del raw
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
checked = check_batch(message, 0, count - 1, count, "p")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"message_bytes": len(message), "grown_kib": after - before, "keys": checked.keys}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_the_check_of_a_batch_holds_one_messages_metadata_at_a_time():
    result = subprocess.run([sys.executable, "-c", _PROPERTIES_BOMB], capture_output=True, text=True, timeout=60,
                            check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    report = json.loads(result.stdout)
    assert report["message_bytes"] < 4096 and report["keys"] is None
    assert report["grown_kib"] < 96 * 1024, report


# --- entries -----------------------------------------------------------------------------


def header_for(message: bytes, batch: CheckedBatch, *, first_offset: int = 1000) -> BatchHeader:
    """The header the broker makes of a checked message (as the partition's appender does)."""
    parsed = parse_message(message)
    metadata = parsed.metadata
    count = parsed.message_count
    last_sequence_id = max(metadata.highest_sequence_id, metadata.sequence_id + count - 1)
    return BatchHeader(metadata.producer_name, metadata.sequence_id, last_sequence_id, first_offset, count, BROKER_MS,
                       batch.codec, batch.keys)


def stored(message: bytes, batch: CheckedBatch, **changes) -> tuple[BatchHeader, memoryview]:
    entry = encode_entry(header_for(message, batch, **changes), message, store_keys=batch.store_keys)
    return decode_entry(entry)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("batched", [True, False])
def test_an_entry_round_trips_its_header(codec, batched):
    messages = MESSAGES if batched else MESSAGES[:1]
    message = message_of(messages, codec, batched=batched)
    batch = check_batch(message, **sender_of(messages))
    header = header_for(message, batch)
    entry = encode_entry(header, message, store_keys=batch.store_keys)
    decoded, body = decode_entry(entry)
    assert decoded == dataclasses.replace(header, message_start=decoded.message_start, batched=batched)
    assert not decoded.legacy and entry[decoded.message_start:] == message and body == message
    assert decoded.first_offset == 1000 and decoded.last_offset == 1000 + len(messages) - 1
    assert decoded.publish_time_ms == BROKER_MS  # the broker's time, not the producer's
    assert decoded.keys == tuple(message.key for message in messages) and decoded.codec is codec


def broker_metadata_of(entry: bytes) -> BrokerEntryMetadata:
    magic, size = struct.unpack_from(">HI", entry)
    assert magic == 0x0E02
    metadata = BrokerEntryMetadata()
    metadata.ParseFromString(entry[6:6 + size])
    return metadata


def test_the_broker_metadata_holds_the_time_the_last_offset_and_the_keys_it_must():
    # Pulsar's broker_timestamp and index (of the entry's last message),
    # and the keys only where the message's metadata does not tell them.
    message = message_of(MESSAGES)
    batch = check_batch(message, **sender_of(MESSAGES))
    entry = encode_entry(header_for(message, batch), message, store_keys=True)
    metadata = broker_metadata_of(entry)
    assert (metadata.broker_timestamp, metadata.index) == (BROKER_MS, 1002)
    assert [key.key if key.HasField("key") else None for key in metadata.message_keys] == ["account-42", None, "account-7"]
    shared = message_of(numbered(3, key="k"))
    batch = check_batch(shared, **sender_of(numbered(3)))
    entry = encode_entry(header_for(shared, batch), shared, store_keys=batch.store_keys)
    assert not broker_metadata_of(entry).message_keys
    assert decode_entry(entry)[0].keys == ("k", "k", "k")


def test_an_entry_of_messages_without_keys_has_none():
    message = message_of(numbered(2))
    header, _ = stored(message, check_batch(message, **sender_of(numbered(2))))
    assert header.keys is None and header.key_of(1) is None


def test_the_header_is_read_without_the_payload():
    # A dispatch never decompresses: an entry whose payload is not what its
    # codec says reads its header, and fails only when its messages are read.
    messages = numbered(3, b"x" * 100)
    good = parse_message(message_of(messages, Codec.ZSTD))
    message = frame_message(good.metadata, b"not zstd at all")
    batch = CheckedBatch(Codec.ZSTD, None, True, False)
    header, body = stored(message, batch)
    assert header.message_count == 3 and header.codec is Codec.ZSTD and bytes(body) == message
    for read in (body_items, decode_body, body_columns):
        with pytest.raises(MalformedEntryError, match="entry body: payload: zstd data does not decompress"):
            read(header, body)


@pytest.mark.parametrize("codec", list(Codec))
def test_consumers_read_what_the_producer_wrote(codec):
    # Payloads, properties (an empty map reads as {}), event times (0: not
    # set) and sequence ids; the publish time is the producer's.
    message = message_of(MESSAGES, codec)
    header, body = stored(message, check_batch(message, **sender_of(MESSAGES)))
    expected = [(m.sequence_id, PUBLISH_MS, m.properties or {}, m.payload, m.event_time_ms) for m in MESSAGES]
    assert body_items(header, body) == expected
    assert decode_body(header, body) == [MessageRecord(*item) for item in expected]
    assert body_columns(header, body) == BodyColumns((7, 8, 9), (PUBLISH_MS,) * 3,
                                                     ({"kind": "debit", "currency": "EUR"}, None, None),
                                                     tuple(m.payload for m in MESSAGES))


@pytest.mark.parametrize("codec", list(Codec))
def test_consumers_read_a_message_sent_without_batching(codec):
    one = OutMessage(41, b"x" * 300, "account-42", {"kind": "credit"}, 1_600_000_000_000)
    message = message_of([one], codec, batched=False)
    header, body = stored(message, check_batch(message, **sender_of([one])))
    assert not header.batched and header.keys == ("account-42",)
    assert decode_body(header, body) == [MessageRecord(41, PUBLISH_MS, {"kind": "credit"}, b"x" * 300, 1_600_000_000_000)]
    assert body_columns(header, body) == BodyColumns((41,), (PUBLISH_MS,), ({"kind": "credit"},), (b"x" * 300,))


def test_consumers_read_implied_sequence_ids():
    # Messages that do not name their sequence ids are numbered on from
    # the one before (the batch's first for the first).
    message = batch(single_of(b"a"), single_of(b"b", sequence_id=8), single_of(b"c"), first=5, highest=9)
    header, body = stored(message, check_batch(message, first_sequence_id=5, last_sequence_id=9, message_count=3,
                                               producer_id=PRODUCER))
    assert [record.sequence_id for record in decode_body(header, body)] == [5, 8, 9]
    assert (header.first_sequence_id, header.last_sequence_id) == (5, 9)


def test_a_pulsar_consumer_receives_the_message_as_stored():
    message = message_of(MESSAGES, Codec.LZ4)
    header, body = stored(message, check_batch(message, **sender_of(MESSAGES)))
    assert bytes(pulsar_message(header, body)) == message


def test_a_body_that_does_not_match_its_header_is_malformed():
    message = message_of(numbered(3))
    header, body = stored(message, check_batch(message, **sender_of(numbered(3))))
    other = dataclasses.replace(header, message_count=2)
    for read in (body_items, body_columns):
        with pytest.raises(MalformedEntryError, match="entry body does not match its header"):
            read(other, body)
    with pytest.raises(MalformedEntryError, match="entry body"):
        body_items(header, b"\x0e\x01garbage")


def entry_of(broker_metadata: BrokerEntryMetadata | bytes, message: bytes, *, size: int | None = None) -> bytes:
    packed = broker_metadata if isinstance(broker_metadata, bytes) else broker_metadata.SerializeToString()
    return struct.pack(">HI", 0x0E02, len(packed) if size is None else size) + packed + message


GOOD = message_of(numbered(3))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "shorter than its prefix"),
        (b"\x0e\x02\x00", "shorter than its prefix"),
        (b"\x0e\x01" + GOOD, "neither a message batch nor a legacy entry"),
        (GOOD, "neither a message batch nor a legacy entry"),  # a message without its entry
        (entry_of(BrokerEntryMetadata(index=2), GOOD, size=10_000), "runs past the end of the entry"),
        (entry_of(BrokerEntryMetadata(index=2), GOOD, size=2**32 - 1), "runs past the end of the entry"),
        (entry_of(b"\xff\xff", GOOD), "does not decode"),
        (entry_of(BrokerEntryMetadata(index=2), b""), "does not decode"),
        (entry_of(BrokerEntryMetadata(index=2), GOOD[:20]), "does not decode"),
        (entry_of(BrokerEntryMetadata(index=2), b"\x00\x00\x00\x03\xff\xff\xff"), "does not decode"),
        (entry_of(BrokerEntryMetadata(broker_timestamp=1), GOOD), "does not match its message count"),  # no index
        (entry_of(BrokerEntryMetadata(index=1), GOOD), "does not match its message count"),  # 3 messages end at 1
        (entry_of(BrokerEntryMetadata(index=2, message_keys=[{"key": "a"}]), GOOD), "holds 1 keys for 3 messages"),
        (entry_of(BrokerEntryMetadata(index=2), forged(b"", count=0)), "does not match its message count"),
        (entry_of(BrokerEntryMetadata(index=2), GOOD[:9] + b"\xff" + GOOD[10:]), "metadata of 255 bytes runs past"),
    ],
)
def test_garbage_entries_are_malformed(data, match):
    with pytest.raises(MalformedEntryError, match=match):
        decode_entry(data)


def test_an_entry_of_an_unknown_codec_is_malformed():
    metadata = MessageMetadata(producer_name="p", sequence_id=0, publish_time=0).SerializeToString() + b"\x40\x09"
    message = struct.pack(">I", len(metadata)) + metadata + b"x"
    with pytest.raises(MalformedEntryError, match="unknown compression type"):
        decode_entry(entry_of(BrokerEntryMetadata(index=0), message))


# --- any bytes ---------------------------------------------------------------------------


def mutated(data: bytes, draw) -> bytes:
    kind = draw(st.sampled_from(["flip", "cut", "append", "insert"]))
    at = draw(st.integers(0, max(0, len(data) - 1)))
    if kind == "flip" and data:
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    if kind == "cut":
        return data[:at]
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=8))
    return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]


drawn_messages = st.lists(
    st.tuples(
        st.integers(0, 1000),  # steps between sequence ids, added up below
        st.binary(max_size=300),
        st.none() | st.sampled_from(["a", "b", "é"]),
        st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
        st.integers(0, 2**63 - 1),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=250, deadline=None)
@given(st.sampled_from(list(Codec)), drawn_messages, st.booleans(), st.integers(0, 2**40), st.data())
def test_what_the_broker_accepts_a_consumer_reads(codec, drawn, batched, first_sequence_id, data):
    # A producer's message is accepted, stored and read back as written;
    # any change to it (its checksum made to match, as a buggy producer's
    # would) is either refused (nothing but the three errors) or still a
    # message every consumer reads as its sender declared.
    messages = []
    sequence_id = first_sequence_id
    for step, payload, key, properties, event_time_ms in drawn if batched else drawn[:1]:
        sequence_id += step + (1 if messages else 0)
        messages.append(OutMessage(sequence_id, payload, key, properties, event_time_ms))
    message = message_of(messages, codec, batched=batched)
    sender = sender_of(messages)
    batch = check_batch(message, **sender)
    header, body = stored(message, batch)
    assert (header.first_sequence_id, header.last_sequence_id, header.message_count) == (
        sender["first_sequence_id"], sender["last_sequence_id"], len(messages))
    assert header.keys == (None if all(m.key is None for m in messages) else tuple(m.key for m in messages))
    assert body_items(header, body) == [(m.sequence_id, PUBLISH_MS, m.properties or {}, m.payload, m.event_time_ms)
                                        for m in messages]
    changed = checksummed(mutated(message[6:], data.draw))
    try:
        batch = check_batch(changed, **sender)
    except (MalformedBatchError, ChecksumMismatchError, NotAllowedError):
        return
    header, body = stored(changed, batch)
    assert (header.first_sequence_id, header.last_sequence_id, header.message_count) == (
        sender["first_sequence_id"], sender["last_sequence_id"], len(messages))
    records = decode_body(header, body)
    assert len(records) == len(messages) == len(body_columns(header, body).payloads)
    assert records[0].sequence_id == sender["first_sequence_id"]
    assert all(record.sequence_id <= sender["last_sequence_id"] for record in records)
    assert header.keys is None or all(key is None or type(key) is str for key in header.keys)


entries = st.builds(
    lambda index, timestamp, keys, message: entry_of(
        BrokerEntryMetadata(index=index, broker_timestamp=timestamp,
                            message_keys=[{} if key is None else {"key": key} for key in keys]), message),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.lists(st.none() | st.text(max_size=3), max_size=4),
    st.sampled_from([GOOD, message_of(MESSAGES, Codec.ZSTD), message_of(MESSAGES[:1], Codec.SNAPPY, batched=False)])
    | st.binary(max_size=40),
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | entries, st.booleans(), st.data())
def test_any_bytes_decode_to_an_entry_or_raise_malformed(data, mutate, draw):
    # Random bytes, or entries around random or good messages, or those
    # with a byte changed, cut or added.
    if mutate:
        data = mutated(data, draw.draw)
    try:
        header, body = decode_entry(data)
    except MalformedEntryError:
        return
    assert type(header.producer_id) is str and header.message_count >= 1 and isinstance(body, memoryview)
    assert header.keys is None or len(header.keys) == header.message_count
    try:
        items = body_items(header, body)
    except MalformedEntryError:
        return
    assert len(items) == header.message_count
    assert len(body_columns(header, body).payloads) == header.message_count
    assert pulsar_message(header, body) is body
