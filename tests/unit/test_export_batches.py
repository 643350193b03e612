"""The export's rows from entries, without Spark or a cluster: the columnar
body decoder agrees with the consumer's (`body_items`) and refuses what it
refuses, and a record batch holds every message of its entries (in Pulsar's
layout or the legacy format) with its id, offset, key, properties and
payload; a malformed entry is skipped."""

from __future__ import annotations

import msgpack
import pytest

from bookie.protocol.entry_format import Entry
from broker.export_plan import LedgerSplit, Selection
from broker import legacy_entry
from broker.codecs import Codec
from broker.message_format import (
    BatchHeader,
    MalformedEntryError,
    body_columns,
    body_items,
    decode_entry,
    entry_of,
)
from broker.pulsar_message import OutMessage
from broker.spark_source import ARROW_SCHEMA, entries_to_batches


def entry(entry_id: int, first_offset: int, messages: list, codec: Codec = Codec.NONE, keys=None, append_ms: int = 1_000) -> Entry:
    """An entry in Pulsar's layout of (sequence id, publish time, properties,
    payload) messages; a batch's publish time is its first message's."""
    keys = keys or (None,) * len(messages)
    return Entry(7, entry_id, entry_id, 0, entry_of(
        "producer-1", first_offset, append_ms,
        [OutMessage(sequence_id, payload, key, properties) for (sequence_id, _, properties, payload), key in zip(messages, keys)],
        codec, publish_time_ms=messages[0][1], batched=True))


def legacy(entry_id: int, first_offset: int, messages: list, codec: legacy_entry.Codec, append_ms: int = 1_000) -> Entry:
    """An entry of the format quire wrote before."""
    header = BatchHeader("producer-1", messages[0][0], messages[-1][0], first_offset, len(messages), append_ms, codec, None)
    return Entry(7, entry_id, entry_id, 0, legacy_entry.encode_entry(header, legacy_entry.encode_body(messages, codec)))


def header_of(count: int, codec=legacy_entry.Codec.NONE) -> BatchHeader:
    return BatchHeader("p", 0, count - 1, 0, count, 0, codec, None)


MESSAGES = [(5, 100, {"a": "1"}, b"x"), (6, 100, None, b""), (7, 100, {"b": "2", "c": "3"}, b"\x00" * 300)]


def _agree(header: BatchHeader, body) -> None:
    items = body_items(header, body)
    columns = body_columns(header, body)
    assert list(zip(columns.sequence_ids, columns.publish_times_ms, [item or {} for item in columns.properties],
                    columns.payloads)) == [item[:4] for item in items]
    assert [item[:4] for item in items] == [(sequence_id, publish_ms, properties or {}, payload)
                                            for sequence_id, publish_ms, properties, payload in MESSAGES]


@pytest.mark.parametrize("codec", list(Codec))
def test_columns_agree_with_the_consumer_s_decoder(codec):
    _agree(*decode_entry(entry(0, 0, MESSAGES, codec).data))


@pytest.mark.parametrize("codec", list(legacy_entry.Codec))
def test_columns_agree_with_the_consumer_s_decoder_on_legacy_entries(codec):
    _agree(*decode_entry(legacy(0, 0, MESSAGES, codec).data))


@pytest.mark.parametrize("messages", [
    [[1, 2, None]],  # three fields
    ["abcd"],  # not an array
    [[1, 2, None, "text"]],  # payload not bytes
    [[True, 2, None, b""]],  # a bool is not a sequence id
    [[1, 2, {"k": 1}, b""]],  # property value not a string
    [[1, 2, [["k", "v"]], b""]],  # properties not a map
])
def test_columns_refuse_what_the_consumer_refuses(messages):
    body = msgpack.packb(messages, use_bin_type=True)
    for decode in (body_items, body_columns):
        with pytest.raises(MalformedEntryError):
            decode(header_of(len(messages)), body)


def test_a_batch_holds_every_message_of_its_entries_with_ids_and_offsets():
    split = LedgerSplit("orders", "orders-partition-1", 1, 7, 0, 2, 40, 3, 1_000)
    entries = [
        entry(0, 40, [(0, 10, {"k": "v"}, b"a"), (1, 10, None, b"b")], Codec.ZSTD, keys=("x", None)),
        Entry(7, 1, 1, 0, b"\x09not an entry"),
        legacy(2, 42, [(2, 12, None, b"c")], legacy_entry.Codec.GZIP),
    ]
    [batch] = entries_to_batches(split, entries)
    assert batch.schema == ARROW_SCHEMA
    rows = batch.to_pylist()
    assert [(row["offset"], row["entry_id"], row["batch_index"], row["key"], row["properties"], row["payload"]) for row in rows] == [
        (40, 0, 0, "x", [("k", "v")], b"a"), (41, 0, 1, None, [], b"b"), (42, 2, 0, None, [], b"c")]
    assert {(row["topic"], row["partition"], row["ledger_id"], row["producer_id"]) for row in rows} == {("orders", 1, 7, "producer-1")}
    assert [row["sequence_id"] for row in rows] == [0, 1, 2]
    assert [row["publish_time"].timestamp() * 1000 for row in rows] == [10, 10, 12]


def test_a_ledger_whose_first_entry_disagrees_with_its_record_is_refused():
    split = LedgerSplit("orders", "orders", -1, 7, 0, 0, 40, 1, 100)
    with pytest.raises(RuntimeError, match="starts at offset 39"):
        list(entries_to_batches(split, [entry(0, 39, [(0, 10, None, b"a")])]))


def test_entries_outside_the_time_range_are_left_out():
    split = LedgerSplit("orders", "orders", -1, 7, 0, 1, 0, 2, 100)
    entries = [entry(0, 0, [(0, 10, None, b"a")], append_ms=1_000), entry(1, 1, [(1, 10, None, b"b")], append_ms=2_000)]
    [batch] = entries_to_batches(split, entries, Selection(start_time_ms=1_500))
    assert batch.column("payload").to_pylist() == [b"b"]
    assert list(entries_to_batches(split, entries, Selection(end_time_ms=1_000))) == []


def test_batches_are_cut_by_decompressed_payload_bytes_never_inside_an_entry():
    # zstd entries of 4 messages of 1000 zero bytes: ~40 bytes each stored,
    # 4000 decompressed. Cut at 10,000 payload bytes: three entries a batch.
    split = LedgerSplit("orders", "orders", -1, 7, 0, 9, 0, 10, 400)
    entries = [entry(number, number * 4, [(number * 4 + index, 10, None, bytes(1000)) for index in range(4)], Codec.ZSTD)
               for number in range(10)]
    assert sum(len(item.data) for item in entries) < 2_000
    batches = list(entries_to_batches(split, entries, payload_bytes_max=10_000))
    assert [batch.num_rows for batch in batches] == [12, 12, 12, 4]
    offsets = [offset for batch in batches for offset in batch.column("offset").to_pylist()]
    assert offsets == list(range(40))
    assert all(sum(map(len, batch.column("payload").to_pylist())) <= 12_000 for batch in batches)
