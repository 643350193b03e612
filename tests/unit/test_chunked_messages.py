"""Chunked messages (Pulsar's chunking), by hand: the broker's check of a
chunk, deduplication by the last chunk only, and a consumer putting chunks
together (in order, copies, gaps, the bounds)."""

from __future__ import annotations

import pytest

from broker.client.chunks import ChunkAssembler
from broker.codecs import Codec
from broker.entry_types import BatchHeader
from broker.errors import BrokerStatus, MalformedBatchError
from broker.message_format import check_batch, chunk_of, chunked_message, decode_entry, encode_entry
from broker.publish_core import PublishCore
from broker.pulsar.pulsar_api_pb2 import MessageMetadata
from broker.pulsar_message import OutMessage, build_chunks, frame_message


def _entries(chunks: list[bytes], first_offset: int = 0) -> list[bytes]:
    entries = []
    for index, body in enumerate(chunks):
        checked = check_batch(body, 5, 5, 1, "p")
        header = BatchHeader("p", 5, 5, first_offset + index, 1, 1_000, checked.codec, checked.keys)
        entries.append(encode_entry(header, body, store_keys=checked.store_keys))
    return entries


@pytest.mark.parametrize("codec", [Codec.NONE, Codec.ZSTD])
def test_chunks_are_stored_as_they_come_and_put_together_again(codec):
    payload = bytes(range(256)) * 40
    chunks = build_chunks("p", 1_000, OutMessage(5, payload, key="k", properties={"a": "b"}), codec, 1_000, "u-1")
    assert len(chunks) > 1 or codec is not Codec.NONE
    checks = [check_batch(body, 5, 5, 1, "p") for body in chunks]
    assert [check.partial_chunk for check in checks] == [True] * (len(chunks) - 1) + [False]
    decoded = [decode_entry(entry) for entry in _entries(chunks)]
    assert [header.partial_chunk for header, _ in decoded] == [check.partial_chunk for check in checks]
    assert all(header.chunked and header.keys == ("k",) for header, _ in decoded)
    parts = [chunk_of(header, body).payload for header, body in decoded]
    sequence_id, _, properties, whole, _ = chunked_message(*decoded[-1], parts)
    assert (sequence_id, properties, whole) == (5, {"a": "b"}, payload)


def test_a_chunk_must_name_its_message_and_its_place():
    for change in ({"uuid": ""}, {"chunk_id": 3, "num_chunks_from_msg": 3}, {"chunk_id": -1},
                   {"num_chunks_from_msg": 200_000}, {"total_chunk_msg_size": -1}):
        metadata = MessageMetadata(producer_name="p", sequence_id=5, publish_time=1, uuid="u", chunk_id=0,
                                   num_chunks_from_msg=2, total_chunk_msg_size=4)
        for name, value in change.items():
            setattr(metadata, name, value)
        with pytest.raises(MalformedBatchError):
            check_batch(frame_message(metadata, b"ab"), 5, 5, 1, "p")


def test_only_the_last_chunk_is_deduplicated():
    core = PublishCore("t")
    core.add_producer("p", object())
    judged = [core.judge("p", 5, 5, stored_bytes=0, backlog_quota_bytes=None, partial_chunk=partial) for partial in (True, True, False)]
    assert [judgement.deduplicated for judgement in judged] == [False, False, True]
    for judgement in judged:
        core.pushed("p", 5, 5, judgement)
        core.persisted("p", 5, 5, (1, 0), judgement)
    # The message again (its producer resent it): its first chunks are
    # taken, its last is a duplicate.
    assert core.judge("p", 5, 5, stored_bytes=0, backlog_quota_bytes=None, partial_chunk=True).status is BrokerStatus.OK
    assert core.judge("p", 5, 5, stored_bytes=0, backlog_quota_bytes=None).status is BrokerStatus.DUPLICATE


def _chunks(uuid: str, count: int, total: int | None = None):
    bodies = build_chunks("p", 1_000, OutMessage(5, b"x" * (10 * count)), Codec.NONE, 10, uuid)
    return [chunk_of(*decode_entry(entry)) for entry in _entries(bodies)]


def test_the_assembler_gives_a_message_once_its_last_chunk_comes():
    assembler = ChunkAssembler()
    first, second, third = _chunks("a", 3)
    assert assembler.add(first, 10, 0, 0).payloads is None
    assert assembler.add(second, 11, 0, 0).payloads is None
    assert assembler.add(second, 12, 0, 0).acknowledge == (12,)  # a copy of a chunk held
    done = assembler.add(third, 13, 0, 0)
    assert done.payloads == [b"x" * 10] * 3 and done.offsets == (10, 11, 13)
    assert assembler.pending_count == 0


def test_the_assembler_starts_again_from_a_first_chunk_and_waits_for_missing_ones():
    assembler = ChunkAssembler(expiry_ms=1_000)
    first, second, third = _chunks("a", 3)
    assembler.add(first, 10, 0, 0)
    again = assembler.add(first, 20, 0, 0)
    assert again.acknowledge == (10,)  # the message from its start again
    # A chunk whose earlier ones are not here: asked for again while young,
    # dropped once older than the expiry.
    assert assembler.add(third, 30, 0, 500).redeliver == (30,)
    assert assembler.add(third, 30, 0, 5_000).acknowledge == (30,)
    assert assembler.expire(5_000) == (20,)


def test_the_assembler_holds_a_bounded_number_of_messages():
    assembler = ChunkAssembler(pending_max=2)
    assembler.add(_chunks("a", 2)[0], 1, 0, 0)
    assembler.add(_chunks("b", 2)[0], 2, 0, 0)
    third = assembler.add(_chunks("c", 2)[0], 3, 0, 0)
    assert third.redeliver == (1,) and assembler.pending_count == 2
    oversized = ChunkAssembler(bytes_max=15)
    oversized.add(_chunks("d", 2)[0], 1, 0, 0)
    assert oversized.add(_chunks("d", 2)[1], 2, 0, 0).acknowledge == (1, 2)


def test_the_very_chunk_held_delivered_again_is_not_a_copy():
    # A failover's replay brings back a chunk at the offset it is held at:
    # acknowledging it as a copy would lose it if the message came again.
    assembler = ChunkAssembler()
    first, second, _ = _chunks("a", 3)
    assembler.add(first, 10, 0, 0)
    again = assembler.add(first, 10, 0, 0)
    assert again.payloads is None and again.acknowledge == () and again.redeliver == ()
    replayed = assembler.add(second, 11, 0, 0)
    assert replayed.acknowledge == () and replayed.redeliver == ()
    assert assembler.add(second, 11, 0, 0).acknowledge == ()
