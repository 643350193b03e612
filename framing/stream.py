"""Frames over a trio stream, both halves, shared by the bookie, the broker
and their clients: `receive_first_frames` reads until a handshake is in,
`FrameOutput` queues frames and writes them (`flush()` at once, or the
connection's writer task, `run_writer()`, never both at a time), and
`enable_keepalive` lets the kernel find a peer whose host died.

Why `FrameOutput` has both ways of writing: a writer task coalesces many
queued frames into one send, which is what a loaded connection needs, but
each hand-over to it costs a pass of the trio scheduler, and `send_all`
another one after the write. On this machine a pass costs 30-70 µs, so at a
window of one request the two passes on each side would be most of an add's
latency above the fsync. `flush()` writes what is queued with one
non-blocking `write` on the socket's descriptor, right where the frames were
produced; whatever the socket does not take at once (or any error) is left
to the writer task, which waits for room and reports errors through
`send_all`.
"""

from __future__ import annotations

import os
import socket
import ssl
from typing import Any, Callable

import trio

from framing.codec import FrameDecoder
from framing.tls_stream import TLSSocketStream

RECEIVE_BYTES = 256 * 1024  # the most one read of a framed connection takes


async def receive_first_frames(stream: trio.SocketStream, decoder: FrameDecoder) -> list[list[Any]]:
    """Every frame decoded once at least one is whole (a peer may send more
    behind its handshake); [] if the peer closed the connection first.
    Raises ProtocolError for a malformed frame."""
    while True:
        frames = list(decoder.frames())
        if frames:
            return frames
        data = await stream.receive_some(RECEIVE_BYTES)
        if not data:
            return []
        decoder.feed(data)


KEEPALIVE_IDLE_S = 30  # a silent connection is probed after this long
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3  # unanswered probes before the kernel drops it


def enable_keepalive(stream: trio.SocketStream) -> None:
    """TCP keepalive on a connection, so that a peer whose host died (no
    FIN, no RST) is found within about a minute instead of never: a broker
    would otherwise keep a dead client's producer id or exclusive
    subscription taken for good."""
    stream = getattr(stream, "transport_stream", stream)  # under TLS, the TCP stream
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, option):
            stream.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class TLSHandshakeError(Exception):
    """A peer's TLS handshake failed or took too long (plaintext sent to a
    TLS port, an untrusted certificate, a peer that stalls): the reason,
    for the log line and the count."""


async def accept_tls(stream: trio.SocketStream, context: ssl.SSLContext) -> TLSSocketStream:
    """`stream` as the server side of TLS, its handshake done (the caller
    bounds the time); TLSHandshakeError if it fails. On any failure or
    cancellation the TLS stream, which took `stream`'s socket, is closed."""
    tls_stream = TLSSocketStream.wrap(stream, context, server_side=True)
    try:
        await tls_stream.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
        await trio.aclose_forcefully(tls_stream)
        cause = error.__cause__
        reason = getattr(cause, "reason", None) or type(cause or error).__name__
        raise TLSHandshakeError(f"TLS handshake failed: {reason}") from None
    except BaseException:
        await trio.aclose_forcefully(tls_stream)
        raise
    return tls_stream


async def connect_tls(stream: trio.SocketStream, context: ssl.SSLContext, host: str) -> TLSSocketStream:
    """The client side of TLS over `stream` (the caller bounds the time)."""
    tls_stream = TLSSocketStream.wrap(stream, context, server_side=False, server_hostname=host)
    try:
        await tls_stream.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(tls_stream)
        raise
    return tls_stream


def _direct_writer(stream) -> Callable[[bytes], int] | None:
    """A write that does not wait: the bytes it sent (0 when the socket is
    full). None for a stream that has none (the writer task sends all)."""
    if isinstance(stream, trio.SocketStream):
        trio_socket = stream.socket

        def write(data: bytes) -> int:
            # The descriptor is looked up on every call: after the stream is
            # closed it is -1, and a number kept from before could by then
            # name another file.
            fd = trio_socket.fileno()
            return os.write(fd, data) if fd >= 0 else 0

        return write
    if isinstance(stream, TLSSocketStream):
        return stream.try_send
    return None


# The writer's coalescing (`coalesce_rounds`): it sends once this many
# rounds in a row passed with nothing scheduled, this many bytes are queued,
# or this long has passed.
COALESCE_IDLE_ROUNDS = 4
COALESCE_BYTES = 256 * 1024
COALESCE_S = 0.002


class FrameOutput:
    def __init__(self, stream: trio.SocketStream, *, gather: Callable[[], None] | None = None,
                 coalesce_rounds: int = 0) -> None:
        """`gather`, if given, is called before every send to queue what its
        owner was still gathering (a client's ADD_BATCH).

        `coalesce_rounds`: before a send, the writer task lets the other
        runnable tasks run for up to this many scheduling rounds while they
        keep scheduling more (callers that yield between requests, such as
        a task per add, then share a send instead of paying one each, and
        so does the peer); a round in which nobody scheduled anything sends
        at once."""
        self._stream = stream
        self._coalesce_rounds = coalesce_rounds
        self._schedules = 0  # calls of schedule(): the coalescing rounds watch it move
        # Written straight to the socket by `flush`, without a scheduling point.
        self._write_now = _direct_writer(stream)
        self._gather = gather
        self._frames: list[bytes] = []
        self.bytes = 0  # queued, or being sent by the writer task, and not yet taken by the socket
        self._writer_sending = False
        self._socket_full = False  # a write did not go through: leave sending to the writer task
        self._writer_wakeup = trio.Event()
        self._drained = trio.Event()

    def __bool__(self) -> bool:
        return bool(self._frames)

    def queue(self, frame: bytes) -> None:
        """Queue a frame; `flush()` or `schedule()` sends it."""
        self._frames.append(frame)
        self.bytes += len(frame)

    def queue_parts(self, parts: list[bytes], nbytes: int) -> None:
        """Queue the parts of frames, `nbytes` in all."""
        self._frames += parts
        self.bytes += nbytes

    def schedule(self) -> None:
        """Leave what is queued (or being gathered) to the writer task, which
        sends it in one write with whatever else is queued before it runs."""
        self._schedules += 1
        if self._frames or self._gather is not None:
            self._writer_wakeup.set()

    def flush(self) -> None:
        """Write what is queued now, without a scheduling point, unless the
        writer task is in the middle of a send (order would break)."""
        if self._gather is not None:
            self._gather()
        if self._write_now is None:
            if self._frames:
                self._writer_wakeup.set()
            return
        if not self._frames or self._writer_sending or self._socket_full:
            # (A full socket: the writer task waits for room and sends what
            # is queued; trying here again would copy it all at every call.)
            return
        frames = self._frames
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        try:
            sent = self._write_now(data)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            # Full (EAGAIN) or broken: the writer task waits for room, or
            # meets the same error in send_all and reports it.
            sent = 0
        if sent == len(data):
            frames.clear()
            self.bytes = 0
            self._set_drained()
        else:
            # A view of what is left, not a copy of it.
            self._frames = [memoryview(data)[sent:]] if sent else [data]
            self.bytes = len(data) - sent
            self._socket_full = True
            self._writer_wakeup.set()

    async def wait_drained(self) -> None:
        """Return once the socket took more (check `bytes` again after)."""
        await self._drained.wait()

    def _set_drained(self) -> None:
        self._drained.set()
        self._drained = trio.Event()

    async def _coalesce(self) -> None:
        """Let the other runnable tasks queue more before a send: until a
        few rounds pass in which nobody scheduled anything, COALESCE_BYTES
        are queued, or COALESCE_S have passed (a busy loop's rounds are long)."""
        seen, idle = self._schedules, 0
        deadline = trio.current_time() + COALESCE_S
        for _ in range(self._coalesce_rounds):
            # To the back of the run queue: every task runnable now runs first.
            await trio.lowlevel.cancel_shielded_checkpoint()
            if self._socket_full or self.bytes >= COALESCE_BYTES or trio.current_time() >= deadline:
                return
            if self._schedules == seen:
                # trio runs each round's tasks in a random order: a round
                # without a schedule() may only mean this task ran first.
                idle += 1
                if idle == COALESCE_IDLE_ROUNDS:
                    return
            else:
                seen, idle = self._schedules, 0

    async def run_writer(self) -> None:
        """Send what `flush()` did not, until cancelled; raises what
        `send_all` raises when the connection breaks."""
        while True:
            if self._gather is not None:
                self._gather()
            if not self._frames:
                self._writer_wakeup = trio.Event()
                await self._writer_wakeup.wait()
                continue
            if self._coalesce_rounds and not self._socket_full:
                await self._coalesce()
                if self._gather is not None:
                    self._gather()
            frames = self._frames
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            self._frames = []
            self._writer_sending = True
            try:
                await self._stream.send_all(data)
            finally:
                self._writer_sending = False
            # Counted until the socket took it: a peer that reads nothing
            # must not have answers piling up unseen behind a send.
            self.bytes -= len(data)
            self._set_drained()
            if not self._frames:
                self._socket_full = False  # all sent: the socket takes writes again


__all__ = [
    "KEEPALIVE_IDLE_S",
    "KEEPALIVE_INTERVAL_S",
    "KEEPALIVE_PROBES",
    "RECEIVE_BYTES",
    "FrameOutput",
    "TLSHandshakeError",
    "accept_tls",
    "connect_tls",
    "enable_keepalive",
    "receive_first_frames",
]
