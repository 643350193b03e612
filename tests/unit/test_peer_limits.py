"""The limits on what peers may hold: connections per process and per
address, the process-wide budget for large frames, and the deadline of a
frame once started (on trio's virtual clock)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from framing.codec import FrameDecoder, ProtocolError, encode_frame
from framing.peer_limits import FRAME_BYTES_UNRESERVED, ConnectionLimits, FrameBudget, FrameReader


def test_connections_are_bounded_in_total_and_per_address():
    limits = ConnectionLimits(total_max=3, per_address_max=2)
    assert limits.admit("10.0.0.1") is None
    assert limits.admit("10.0.0.1") is None
    assert "from 10.0.0.1" in limits.admit("10.0.0.1")
    assert limits.admit("10.0.0.2") is None
    assert "3 connections open" in limits.admit("10.0.0.3")
    limits.release("10.0.0.1")
    assert limits.admit("10.0.0.3") is None
    assert limits.refused == 2
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        limits.release(address)
    assert limits.total == 0 and limits.by_address == {}


async def test_a_frame_budget_makes_large_frames_wait_for_room():
    budget = FrameBudget(1000)
    await budget.reserve(600)
    order = []

    async def second() -> None:
        await budget.reserve(600)
        order.append("second reserved")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert order == [] and budget.reserved == 600
        budget.release(600)
    assert order == ["second reserved"] and budget.reserved == 600


async def test_a_frame_larger_than_the_whole_budget_is_refused():
    with pytest.raises(ProtocolError, match="exceeds the process's frame budget"):
        await FrameBudget(1000).reserve(1001)


async def test_a_frame_must_arrive_whole_within_its_deadline(autojump_clock):
    client, server = trio.testing.memory_stream_pair()
    reader = FrameReader(server, FrameDecoder(), None, frame_deadline_s=5.0)
    frame = encode_frame([1, 2, 3])
    await client.send_all(frame[:3])
    assert await reader.receive()
    started = trio.current_time()
    # Bytes keep coming, but too slowly: the deadline counts from the frame's start.
    async with trio.open_nursery() as nursery:
        async def trickle() -> None:
            for byte in frame[3:-1]:
                await trio.sleep(2)
                await client.send_all(bytes([byte]))

        nursery.start_soon(trickle)
        with pytest.raises(ProtocolError, match="did not arrive whole within 5s"):
            while True:
                assert await reader.receive()
        nursery.cancel_scope.cancel()
    assert trio.current_time() - started == pytest.approx(5.0)


async def test_a_frame_whose_time_a_late_read_overspent_is_cut_off_not_a_crash(autojump_clock):
    # A read that returns bytes just past the deadline (they came as it
    # expired) leaves the frame's time overspent; the next read refuses the
    # frame. It once gave trio a negative timeout, which stopped the process.
    client, server = trio.testing.memory_stream_pair()
    reader = FrameReader(server, FrameDecoder(), None, frame_deadline_s=5.0)
    frame = encode_frame([1, 2, 3])
    await client.send_all(frame[:3])
    assert await reader.receive()
    await client.send_all(frame[3:4])
    assert await reader.receive()  # a read within the frame: its clock runs
    reader._frame_spent_s = 5.001
    with pytest.raises(ProtocolError, match="did not arrive whole within 5s"):
        await reader.receive()


async def test_the_servers_own_pauses_do_not_count_against_a_frames_deadline(autojump_clock):
    client, server = trio.testing.memory_stream_pair()
    reader = FrameReader(server, FrameDecoder(), None, frame_deadline_s=5.0)
    frame = encode_frame([1, 2, 3])
    await client.send_all(frame[:3])
    assert await reader.receive()
    await trio.sleep(60)  # the server does not read (its own back-pressure)
    await client.send_all(frame[3:])
    assert await reader.receive()
    assert list(reader.decoder.frames()) == [[1, 2, 3]]


async def test_silence_counts_only_while_the_server_reads(autojump_clock):
    client, server = trio.testing.memory_stream_pair()
    reader = FrameReader(server, FrameDecoder(), None)
    await trio.sleep(100)
    assert reader.silence_s(trio.current_time()) == 0  # not reading: our pause, not the peer's silence
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader.receive)
        await trio.sleep(7)
        assert reader.silence_s(trio.current_time()) == pytest.approx(7)
        await client.send_all(encode_frame([1]))


async def test_a_connection_may_wait_between_frames_for_ever_and_each_frame_has_its_own_clock(autojump_clock):
    client, server = trio.testing.memory_stream_pair()
    reader = FrameReader(server, FrameDecoder(), None, frame_deadline_s=5.0)

    async def send_later(delay_s: float, data: bytes) -> None:
        await trio.sleep(delay_s)
        await client.send_all(data)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_later, 3600, encode_frame([1]))  # an hour of silence is fine here
        assert await reader.receive()
    assert list(reader.decoder.frames()) == [[1]]
    first, second = encode_frame([2]), encode_frame([3])
    await client.send_all(first + second[:2])  # one whole frame and the start of the next
    assert await reader.receive()
    assert list(reader.decoder.frames()) == [[2]]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_later, 4, second[2:])  # the second frame's own 5 s
        assert await reader.receive()
    assert list(reader.decoder.frames()) == [[3]]


async def test_a_large_frame_reserves_its_size_and_gives_it_back(autojump_clock):
    client, server = trio.testing.memory_stream_pair()
    budget = FrameBudget(4 * FRAME_BYTES_UNRESERVED)
    reader = FrameReader(server, FrameDecoder(), budget, frame_deadline_s=5.0)
    frame = encode_frame([b"x" * (2 * FRAME_BYTES_UNRESERVED)])
    await client.send_all(frame[:1000])
    assert await reader.receive()
    await client.send_all(frame[1000:])
    assert await reader.receive()  # reserves the frame's size beyond the allowance before reading on
    assert budget.reserved == len(frame) - FRAME_BYTES_UNRESERVED
    while len(list(reader.decoder.frames())) == 0:
        assert await reader.receive()
    await client.send_all(encode_frame([1])[:2])
    assert await reader.receive()  # the next frame's look gives the finished one's room back
    assert budget.reserved == 0
    reader.close()


async def test_a_large_frame_that_finds_no_room_before_its_deadline_is_refused(autojump_clock):
    budget = FrameBudget(3 * FRAME_BYTES_UNRESERVED)
    await budget.reserve(2 * FRAME_BYTES_UNRESERVED)
    client, server = trio.testing.memory_stream_pair()
    reader = FrameReader(server, FrameDecoder(), budget, frame_deadline_s=5.0)
    await client.send_all(encode_frame([b"x" * (2 * FRAME_BYTES_UNRESERVED)])[:1000])
    assert await reader.receive()
    with pytest.raises(ProtocolError, match="waited 5s for room"):
        await reader.receive()
    assert budget.reserved == 2 * FRAME_BYTES_UNRESERVED


async def test_peer_faults_end_the_connection_but_our_own_bugs_stop_the_process(caplog, autojump_clock):
    import logging

    from framing.peer_limits import peer_faults

    caplog.set_level(logging.INFO)
    counted = []
    log = logging.getLogger("test.peer_faults")
    with peer_faults(log, "10.0.0.1:5", lambda: counted.append(1)):
        raise ProtocolError("bad bytes")
    with peer_faults(log, "10.0.0.1:5", lambda: counted.append(1)):
        raise trio.BrokenResourceError
    with peer_faults(log, "10.0.0.1:5", lambda: counted.append(1)):
        raise ProtocolError("more bad bytes")  # within the second: counted, not logged
    await trio.sleep(1)
    with peer_faults(log, "10.0.0.1:6", lambda: counted.append(1)):
        raise ProtocolError("later bad bytes")
    assert len(counted) == 3
    assert "protocol error: bad bytes" in caplog.text
    assert "more bad bytes" not in caplog.text
    assert "later bad bytes (1 more since the last line)" in caplog.text
    for bug in (AssertionError("an invariant of ours"), KeyError("a bug of ours")):
        with pytest.raises(type(bug)):
            with peer_faults(log, "10.0.0.1:5", lambda: counted.append(1)):
                raise bug
