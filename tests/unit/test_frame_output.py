"""FrameOutput: frames leave in order whether flush() writes them at once or
the writer task sends them, including when the socket takes only part."""

import socket

import pytest
import trio
import trio.testing

from framing.stream import FrameOutput


def stream_pair(send_buffer_bytes: int | None = None) -> tuple[trio.SocketStream, trio.SocketStream]:
    left, right = socket.socketpair()
    if send_buffer_bytes is not None:
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        right.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, send_buffer_bytes)
    return trio.SocketStream(trio.socket.from_stdlib_socket(left)), trio.SocketStream(trio.socket.from_stdlib_socket(right))


async def receive_exactly(stream: trio.SocketStream, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = await stream.receive_some(count - len(data))
        assert chunk, "peer closed early"
        data += chunk
    return bytes(data)


async def test_flush_writes_without_the_writer_task():
    # No writer task runs at all: flush alone must deliver the frames.
    sender, receiver = stream_pair()
    output = FrameOutput(sender)
    output.queue(b"one ")
    output.queue(b"two")
    assert output.bytes == 7
    output.flush()
    assert not output and output.bytes == 0
    with trio.fail_after(5):
        assert await receive_exactly(receiver, 7) == b"one two"


async def test_schedule_leaves_frames_to_the_writer_which_coalesces_them():
    sender, receiver = stream_pair()
    output = FrameOutput(sender)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(output.run_writer)
        for index in range(100):
            output.queue(b"%03d" % index)
            output.schedule()
        assert output.bytes == 300  # nothing left before the writer ran
        with trio.fail_after(5):
            data = await receive_exactly(receiver, 300)
        nursery.cancel_scope.cancel()
    assert data == b"".join(b"%03d" % index for index in range(100))


async def test_a_partial_write_is_finished_by_the_writer_in_order():
    # A tiny socket buffer: flush() gets only part of a large frame out and
    # later frames must queue behind the rest, never overtake it.
    sender, receiver = stream_pair(send_buffer_bytes=4096)
    output = FrameOutput(sender)
    big = bytes(range(256)) * 4096  # 1 MiB
    received = bytearray()

    async def read_all() -> None:
        while len(received) < len(big) + 5:
            chunk = await receiver.receive_some(65536)
            assert chunk
            received.extend(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(output.run_writer)
        output.queue(big)
        output.flush()
        assert 0 < output.bytes < len(big)  # the socket took some, not all
        output.queue(b"after")
        output.flush()  # must not write "after" ahead of the rest of big
        with trio.fail_after(10):
            await read_all()
        nursery.cancel_scope.cancel()
    assert bytes(received) == big + b"after"


async def test_flush_while_the_writer_is_sending_waits_for_it():
    sender, receiver = stream_pair(send_buffer_bytes=4096)
    output = FrameOutput(sender)
    big = b"x" * (1024 * 1024)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(output.run_writer)
        output.queue(big)
        output.schedule()
        await trio.testing.wait_all_tasks_blocked()  # the writer is stuck in send_all
        output.queue(b"tail")
        output.flush()
        # Left for the writer, behind its send; what it is sending still counts.
        assert output.bytes == len(big) + 4
        with trio.fail_after(10):
            data = await receive_exactly(receiver, len(big) + 4)
        nursery.cancel_scope.cancel()
    assert data == big + b"tail"


async def test_wait_drained_returns_once_the_queue_is_empty():
    sender, receiver = stream_pair(send_buffer_bytes=4096)
    output = FrameOutput(sender)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(output.run_writer)
        output.queue(b"y" * 100_000)
        output.flush()
        assert output.bytes > 0
        nursery.start_soon(receive_exactly, receiver, 100_000)
        with trio.fail_after(10):
            while output.bytes:
                await output.wait_drained()
        nursery.cancel_scope.cancel()


async def test_flush_on_a_closed_stream_leaves_the_error_to_the_writer():
    sender, receiver = stream_pair()
    output = FrameOutput(sender)
    await receiver.aclose()
    await sender.aclose()
    output.queue(b"lost")
    output.flush()  # the descriptor is gone: nothing written, nothing raised
    assert output.bytes == 4
    with pytest.raises(trio.ClosedResourceError):
        with trio.fail_after(5):
            await output.run_writer()


async def test_flushes_on_a_full_socket_leave_the_queue_to_the_writer(monkeypatch):
    # Once a write did not go through, later flushes do not try again (each
    # would join and copy everything queued, quadratic under a slow peer):
    # frames queue, and the writer task sends them, in order, when it can.
    import framing.stream as frame_output

    writes = []
    real_write = frame_output.os.write
    monkeypatch.setattr(frame_output.os, "write", lambda fd, data: writes.append(len(data)) or real_write(fd, data))
    sender, receiver = stream_pair(send_buffer_bytes=4096)
    output = FrameOutput(sender)
    big = bytes(range(256)) * 4096  # 1 MiB: far more than the socket takes
    output.queue(big)
    output.flush()
    assert output.bytes > 0, "the socket took everything: the test needs a fuller one"
    left = output.bytes
    for index in range(50):
        output.queue(b"%02d" % index)
        output.flush()
    assert len(writes) == 1, f"flush wrote again on a full socket: {writes[:5]}..."
    assert output.bytes == left + 100
    async with trio.open_nursery() as nursery:
        nursery.start_soon(output.run_writer)
        with trio.fail_after(10):
            data = await receive_exactly(receiver, len(big) + 100)
        nursery.cancel_scope.cancel()
    assert data == big + b"".join(b"%02d" % index for index in range(50))
    # Drained: flush writes at once again.
    output.queue(b"after")
    output.flush()
    assert output.bytes == 0


class CountingStream:
    """A stream that records each send (no socket: the writer task's path only)."""

    def __init__(self) -> None:
        self.sends: list[bytes] = []

    async def send_all(self, data) -> None:
        self.sends.append(bytes(data))
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize("coalesce_rounds", [0, 64])
async def test_a_coalescing_writer_shares_one_send_between_callers_that_yield(coalesce_rounds):
    # Ten tasks, each queueing a frame, yielding, queueing the next (a task
    # per request). Without coalescing the writer sends as soon as it runs;
    # with it, it waits while the tasks keep queueing, and sends them together.
    stream = CountingStream()
    output = FrameOutput(stream, coalesce_rounds=coalesce_rounds)

    async def caller(index: int) -> None:
        for round_ in range(5):
            output.queue(b"%d.%d;" % (index, round_))
            output.schedule()
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(output.run_writer)
        async with trio.open_nursery() as callers:
            for index in range(10):
                callers.start_soon(caller, index)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    sent = b"".join(stream.sends)
    assert sorted(sent.split(b";")[:-1]) == sorted(b"%d.%d" % (index, round_) for index in range(10) for round_ in range(5))
    if coalesce_rounds:
        assert len(stream.sends) <= 2, len(stream.sends)
    else:
        assert len(stream.sends) >= 4, len(stream.sends)


async def test_a_coalescing_writer_sends_at_once_when_nobody_adds(autojump_clock):
    # One frame and nobody else runnable: a few empty rounds, then it leaves
    # (no clock time passes: idle rounds end it, not the deadline).
    stream = CountingStream()
    output = FrameOutput(stream, coalesce_rounds=64)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(output.run_writer)
        began = trio.current_time()
        output.queue(b"alone")
        output.schedule()
        await trio.testing.wait_all_tasks_blocked()
        assert stream.sends == [b"alone"] and trio.current_time() == began
        nursery.cancel_scope.cancel()
