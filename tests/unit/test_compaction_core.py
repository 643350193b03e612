"""Topic compaction's rules (`broker.compaction_core`), driven by hand: the
latest offset of each key, tombstones, the compacted entries' layout, the
record, and the order of the steps (with what a failure deletes)."""

from __future__ import annotations

import pytest

from broker.codecs import Codec
from broker.compaction_core import (
    CloseLedger,
    CompactedEntry,
    CompactionCore,
    CompactionError,
    CompactionRecord,
    Copy,
    CreateLedger,
    DeleteLedgers,
    Finished,
    KeyScan,
    Phase,
    Scan,
    Switched,
    WriteRecord,
    retained_indexes,
)
from broker.message_format import decode_entry, entry_of, null_values
from broker.pulsar_message import OutMessage


def test_the_latest_offset_of_each_key_is_kept_and_a_null_value_deletes_its_key():
    scan = KeyScan()
    for offset, key, null_value in [(0, "a", False), (1, "b", False), (2, None, False), (3, "a", False), (4, "b", True),
                                    (5, "c", False), (6, "c", True), (7, "c", False)]:
        scan.message(offset, key, null_value)
    assert scan.latest == {"a": 3, "c": 7}
    assert scan.retained() == frozenset({3, 7})
    assert scan.messages_read == 8
    assert retained_indexes(2, 4, scan.retained()) == (1,)


def test_a_scan_past_its_key_bound_fails_and_out_of_order_offsets_are_a_bug():
    scan = KeyScan(keys_max=2)
    scan.message(0, "a", False)
    scan.message(1, "b", False)
    scan.message(2, "a", False)  # a known key: no new room needed
    with pytest.raises(CompactionError, match="more than 2 distinct keys"):
        scan.message(3, "c", False)
    with pytest.raises(AssertionError):
        scan.message(1, "a", False)


def test_a_compacted_entry_round_trips_and_bad_bytes_are_refused():
    entry = CompactedEntry(7, 3, 100, 4, (1, 3), b"original entry")
    assert CompactedEntry.from_bytes(entry.to_bytes()) == entry
    assert entry.retained_offsets == [101, 103] and entry.last_offset == 103
    for bad in (b"", b"\x93\x01\x02\x03", CompactedEntry(7, 3, 100, 4, (4,), b"x").to_bytes(),
                CompactedEntry(7, 3, 100, 4, (), b"x").to_bytes()):
        with pytest.raises(CompactionError):
            CompactedEntry.from_bytes(bad)


def test_the_record_round_trips_and_a_bad_one_is_refused():
    record = CompactionRecord(ledger_id=4, horizon=99, entries=3, messages=5, bytes=100, compacted_ms=1, writing=6, garbage=(2, 3))
    assert CompactionRecord.from_dict(record.to_dict()) == record
    assert record.leftovers == (2, 3, 6) and record.ledger_ids == [4, 2, 3, 6]
    with pytest.raises(ValueError):
        CompactionRecord.from_dict({"ledger_id": "4"})
    with pytest.raises(ValueError):
        CompactionRecord.from_dict({"garbage": [1, "2"]})


def test_null_values_are_found_in_single_messages_and_batches_of_every_codec():
    single = entry_of("p", 0, 1, [OutMessage(0, b"", key="a")])
    assert null_values(*decode_entry(single)) == [True]
    for codec in (Codec.NONE, Codec.LZ4, Codec.ZSTD):
        batch = entry_of("p", 0, 1, [OutMessage(0, b"x", key="a"), OutMessage(1, b"", key="b"), OutMessage(2, b"y")], codec)
        assert null_values(*decode_entry(batch)) == [False, True, False]
        alone = entry_of("p", 0, 1, [OutMessage(0, b"value", key="a")], codec)
        assert null_values(*decode_entry(alone)) == [False]


def test_messages_compacted_out_lose_their_payloads_and_keep_their_indexes():
    from broker.message_format import body_items, compacted_out

    for codec in (Codec.NONE, Codec.ZLIB):
        messages = [OutMessage(index, b"payload-%d" % index * 50, key=f"k{index}") for index in range(6)]
        entry = entry_of("p", 10, 1, messages, codec)
        trimmed = compacted_out(entry, (1, 4))
        assert len(trimmed) < len(entry) / 2 or codec is not Codec.NONE
        header, body = decode_entry(trimmed)
        assert header.first_offset == 10 and header.message_count == 6 and header.keys == tuple(f"k{i}" for i in range(6))
        payloads = [item[3] for item in body_items(header, body)]
        assert payloads == [b"", messages[1].payload, b"", b"", messages[4].payload, b""]
        assert compacted_out(entry, tuple(range(6))) == entry
    single = entry_of("p", 0, 1, [OutMessage(0, b"alone", key="a")])
    assert compacted_out(single, (0,)) == single


def _run_to_copy(core: CompactionCore) -> None:
    assert core.start() == [Scan(None, 0, 9)]
    core.scan.message(0, "a", False)
    core.scan.message(5, "a", False)
    assert core.scanned() == [CreateLedger()]
    [claim] = core.created(11)
    assert isinstance(claim, WriteRecord) and claim.record.writing == 11 and claim.expected_version is None
    assert core.record_written(0) == [DeleteLedgers(())]
    assert core.deleted() == [Copy(None, 0, 9, 11)]
    core.copied_entry(CompactedEntry(1, 2, 5, 1, (0,), b"e"), 30)


def test_a_compaction_claims_copies_closes_switches_then_deletes_the_view_it_replaced():
    previous = CompactionRecord(ledger_id=3, horizon=-1, writing=8, garbage=(2,))
    core = CompactionCore("p", previous, 4, 9, now_ms=50)
    assert core.start() == [Scan(3, 0, 9)]
    assert core.scanned() == [CreateLedger()]
    [claim] = core.created(11)
    assert claim == WriteRecord(CompactionRecord(ledger_id=3, horizon=-1, writing=11, garbage=(2, 8)), 4)
    assert core.record_written(5) == [DeleteLedgers((2, 8))]  # once claimed, what earlier ones left is nobody's
    assert core.deleted() == [Copy(3, 0, 9, 11)]
    assert core.copied() == [CloseLedger(11)]
    [switch] = core.closed()
    assert switch == WriteRecord(CompactionRecord(ledger_id=11, horizon=9, compacted_ms=50, garbage=(3,)), 5)
    switched, delete = core.record_written(6)
    assert isinstance(switched, Switched) and delete == DeleteLedgers((3,))
    assert core.deleted() == [Finished(None)]
    assert core.phase is Phase.DONE


def test_a_failure_deletes_the_new_ledger_unless_the_switch_may_have_happened():
    core = CompactionCore("p", None, None, 9, now_ms=0)
    _run_to_copy(core)
    assert core.failed("an add failed") == [DeleteLedgers((11,)), Finished("compaction of p failed: an add failed")]

    core = CompactionCore("p", None, None, 9, now_ms=0)
    _run_to_copy(core)
    core.copied()
    core.closed()
    # The switch's write went out and its answer was lost: the ledger may be the view.
    assert core.failed("connection lost") == [Finished("compaction of p failed: connection lost")]

    core = CompactionCore("p", None, None, 9, now_ms=0)
    _run_to_copy(core)
    core.copied()
    core.closed()
    # ... refused for another writer's version: it surely is not.
    assert core.failed("bad version", record_refused=True)[0] == DeleteLedgers((11,))


def test_a_copy_that_lost_a_kept_message_is_never_switched_in():
    core = CompactionCore("p", None, None, 9, now_ms=0)
    assert core.start()
    core.scan.message(0, "a", False)
    core.scan.message(1, "b", False)
    core.scanned()
    core.created(11)
    core.record_written(0)
    core.deleted()
    core.copied_entry(CompactedEntry(1, 0, 0, 1, (0,), b"e"), 10)
    commands = core.copied()
    assert commands[0] == DeleteLedgers((11,)) and "found 1 of the 2 messages" in commands[-1].error


def test_steps_out_of_order_are_a_bug():
    core = CompactionCore("p", None, None, 9, now_ms=0)
    with pytest.raises(AssertionError):
        core.closed()


def test_a_chunked_message_is_kept_or_left_out_whole():
    scan = KeyScan()
    scan.chunk(0, "p/a", 0, 3, "k")
    scan.message(1, "j", False)
    scan.chunk(2, "p/a", 1, 3, "k")
    scan.chunk(3, "p/a", 1, 3, "k")  # a copy of a chunk held
    scan.chunk(4, "p/a", 2, 3, "k")
    assert scan.latest == {"k": (0, 2, 4), "j": 1}
    scan.chunk(5, "p/b", 1, 2, "j")  # its first chunk is not here: left out
    scan.chunk(6, "p/c", 0, 2, "k")  # never finished: the older one stays
    assert scan.retained() == frozenset({0, 1, 2, 4})
    scan.message(7, "k", True)
    assert scan.retained() == frozenset({1})


def test_a_chunked_message_being_written_moves_the_horizon_back_before_it():
    core = CompactionCore("p", None, None, 9, now_ms=0)
    core.start()
    core.scan.message(5, "a", False)
    core.scan.chunk(7, "p/x", 0, 3, "b")
    core.scan.chunk(9, "p/x", 1, 3, "b")  # its last chunk comes after offset 9
    assert core.scanned() == [Scan(None, 0, 6)]
    assert core.through_offset == 6 and core.scan.latest == {}
    core.scan.message(5, "a", False)
    assert core.scanned() == [CreateLedger()]
    assert core.retained == frozenset({5})
