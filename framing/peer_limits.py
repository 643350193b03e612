"""What peers may hold of a server process, shared by the bookie and the
broker: how many connections in total and per client address, how much
memory frames being received may take across all connections, and how long a
frame may take to arrive once it has started.

`ConnectionLimits` is plain bookkeeping; `FrameBudget` and `FrameReader` are
driver code (they wait, with trio).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import ssl
from typing import Any, Awaitable, Callable, Iterable, Iterator, TypeVar

import trio

from framing.codec import FrameDecoder, ProtocolError
from framing.stream import RECEIVE_BYTES, TLSHandshakeError, accept_tls
from framing.tls_stream import TLSSocketStream

T = TypeVar("T")

CONNECTIONS_MAX_DEFAULT = 10_000
CONNECTIONS_PER_ADDRESS_MAX_DEFAULT = 1_000
FRAME_BUFFER_BYTES_MAX_DEFAULT = 64 * 1024 * 1024
FRAME_DEADLINE_S_DEFAULT = 30.0
# What each connection may buffer without asking the process-wide budget:
# small frames (a lone add) never wait for it, and 10,000 connections hold at
# most 160 MiB beyond it.
FRAME_BYTES_UNRESERVED = 16 * 1024


class ConnectionLimits:
    """Open connections in total and per client address (Pulsar's
    `maxConnectionsPerIp`); `admit` says why a new one is refused, if it is."""

    def __init__(self, total_max: int = CONNECTIONS_MAX_DEFAULT,
                 per_address_max: int = CONNECTIONS_PER_ADDRESS_MAX_DEFAULT) -> None:
        if total_max < 1 or per_address_max < 1:
            raise ValueError("connection limits must be at least 1")
        self.total_max = total_max
        self.per_address_max = per_address_max
        self.total = 0
        self.by_address: dict[str, int] = {}
        self.refused = 0
        self._refusal_logged_s = -math.inf

    def admit(self, address: str) -> str | None:
        """Count a new connection from `address`, or return why it is refused."""
        if self.total >= self.total_max:
            self.refused += 1
            return f"{self.total} connections open, the bound is {self.total_max}"
        held = self.by_address.get(address, 0)
        if held >= self.per_address_max:
            self.refused += 1
            return f"{held} connections open from {address}, the bound per address is {self.per_address_max}"
        self.total += 1
        self.by_address[address] = held + 1
        return None

    def release(self, address: str) -> None:
        held = self.by_address[address] - 1
        assert held >= 0 and self.total > 0
        self.total -= 1
        if held:
            self.by_address[address] = held
        else:
            del self.by_address[address]

    def should_log_refusal(self, now_s: float) -> bool:
        """At most one log line a second: a flood of connections must not become a flood of logs."""
        if now_s - self._refusal_logged_s < 1.0:
            return False
        self._refusal_logged_s = now_s
        return True


class _LogRate:
    """Protocol errors are logged at most once a second per logger, with how
    many were not: a flood of bad connections must not become a flood of
    log lines."""

    def __init__(self) -> None:
        self.logged_s = -math.inf
        self.held_back = 0


_protocol_error_log_rates: dict[str, _LogRate] = {}


@contextlib.contextmanager
def peer_faults(log: logging.Logger, peer: str, count: Callable[[], None]) -> Iterator[None]:
    """Where a connection's work runs: what its peer did wrong ends that
    connection only. Bytes that break the protocol (decoding raises
    ProtocolError for anything a peer's bytes cause) are logged with the
    reason and counted; a broken connection is not news. Anything else is
    our own bug: it propagates and stops the process, as h11 keeps them
    apart."""
    try:
        yield
    except ProtocolError as error:
        count()
        rate = _protocol_error_log_rates.setdefault(log.name, _LogRate())
        now_s = trio.current_time()
        if now_s - rate.logged_s >= 1.0:
            held_back, rate.held_back = rate.held_back, 0
            rate.logged_s = now_s
            log.info("closing connection from %s: protocol error: %s%s", peer, error,
                     f" ({held_back} more since the last line)" if held_back else "")
        else:
            rate.held_back += 1
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
        pass


def decode_from_peer(decode: Callable[[list], T], fields: list, what: str) -> T:
    """`decode(fields)`, where whatever a peer's bytes make the decoder raise
    is the peer's fault: ProtocolError, which ends that connection only."""
    try:
        return decode(fields)
    except ProtocolError:
        raise
    except Exception as error:
        raise ProtocolError(f"undecodable {what} ({type(error).__name__})") from error


async def wait_for_output_room(output, bytes_max: int, stall_s: float) -> None:
    """Wait while a connection's unsent answers pass `bytes_max`; a peer that
    takes none of them for `stall_s` is closed (ProtocolError): a client that
    sends requests and never reads the answers holds nothing for long."""
    while output.bytes > bytes_max:
        with trio.move_on_after(stall_s) as scope:
            await output.wait_drained()
        if scope.cancelled_caught:
            raise ProtocolError(f"took none of its answers for {stall_s:g}s ({output.bytes} bytes waiting)")


async def serve_admitted(stream: trio.SocketStream, limits: ConnectionLimits, log: logging.Logger,
                         serve: Callable[[str], Awaitable[None]]) -> None:
    """Serve an accepted connection (`serve(peer)`) if `limits` admit its
    address; otherwise close it at once, logging why."""
    try:
        address, port = stream.socket.getpeername()[:2]
    except OSError:
        address, port = "?", 0
    peer = f"{address}:{port}"
    refusal = limits.admit(address)
    if refusal is not None:
        if limits.should_log_refusal(trio.current_time()):
            log.warning("refusing connection from %s: %s (%d refused so far)", peer, refusal, limits.refused)
        await trio.aclose_forcefully(stream)
        return
    try:
        await serve(peer)
    finally:
        limits.release(address)


def keepalive_sweep(connections: Iterable, now_s: float, interval_s: float, *, ping: Callable[[Any], None],
                    timed_out: Callable[[Any, float], None]) -> None:
    """Pulsar's keep-alive, one pass over a server's connections: one silent
    for an interval (while the server reads it) is sent a PING (`ping`), one
    silent for two is closed (`timed_out` first, to count and log it). A
    connection has `reader` (its FrameReader), `cancel_scope`, `pinged`."""
    for connection in list(connections):
        if connection.reader is None or connection.cancel_scope is None:
            continue
        silent_s = connection.reader.silence_s(now_s)
        if silent_s >= 2 * interval_s:
            timed_out(connection, silent_s)
            connection.cancel_scope.cancel()
        elif silent_s >= interval_s and not connection.pinged:
            connection.pinged = True
            ping(connection)


# The largest frame a peer may send before its handshake is answered: its
# CONNECT or HELLO, credentials included. A peer that has not shown who it
# is reserves nothing of the frame budget for a large frame.
HANDSHAKE_FRAME_BYTES_MAX = 128 * 1024


async def serve_admitted_tls(stream: trio.SocketStream, limits: ConnectionLimits, log: logging.Logger,
                             context: ssl.SSLContext, handshake_deadline_s: float, refused: Callable[[], None],
                             serve: Callable[[TLSSocketStream, str], Awaitable[None]]) -> None:
    """`serve_admitted` for a TLS listener: the handshake first, within
    `handshake_deadline_s` (a server's bound, as the frame deadline); a peer
    whose handshake fails (plaintext, an untrusted certificate) or stalls is
    closed, counted (`refused()`) and logged with its address."""
    async def handshake_then_serve(peer: str) -> None:
        try:
            with trio.fail_after(handshake_deadline_s):
                tls_stream = await accept_tls(stream, context)
        except trio.TooSlowError:
            error = TLSHandshakeError(f"no TLS handshake within {handshake_deadline_s:g}s")
        except TLSHandshakeError as failed:
            error = failed
        else:
            await serve(tls_stream, peer)
            return
        refused()
        if limits.should_log_refusal(trio.current_time()):
            log.warning("refusing TLS connection from %s: %s", peer, error)
        await trio.aclose_forcefully(stream)

    await serve_admitted(stream, limits, log, handshake_then_serve)


class FrameBudget:
    """The bytes that frames being received may hold beyond each
    connection's small allowance, across all of a process's connections. A
    connection reserves a frame's size (less its allowance) before reading
    its body; when the budget is spent it waits, first come first served,
    within its frame deadline."""

    def __init__(self, bytes_max: int = FRAME_BUFFER_BYTES_MAX_DEFAULT) -> None:
        if bytes_max < 1:
            raise ValueError("the frame budget must be at least 1 byte")
        self.bytes_max = bytes_max
        self.reserved = 0
        self._waiters: collections.deque[tuple[int, trio.Event]] = collections.deque()

    async def reserve(self, size: int) -> None:
        if size > self.bytes_max:
            raise ProtocolError(f"a frame of {size} bytes exceeds the process's frame budget of {self.bytes_max}")
        if not self._waiters and self.reserved + size <= self.bytes_max:
            self.reserved += size
            return
        waiter = (size, trio.Event())
        self._waiters.append(waiter)
        try:
            await waiter[1].wait()
        except BaseException:
            if waiter[1].is_set():
                self.release(size)  # granted, then cancelled before it could use the room
            else:
                self._waiters.remove(waiter)
                self._grant()  # those behind it may fit now
            raise

    def release(self, size: int) -> None:
        assert 0 <= size <= self.reserved
        self.reserved -= size
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.reserved + self._waiters[0][0] <= self.bytes_max:
            size, granted = self._waiters.popleft()
            self.reserved += size
            granted.set()


class FrameReader:
    """Reads one connection's bytes into its decoder under the process's
    limits. A connection buffers at most its allowance (`unreserved_bytes`)
    plus what it reserved from the `FrameBudget` for the frame it is
    receiving, so all connections together hold at most the budget plus one
    allowance each. A frame, once its first byte is in, must be whole within
    `frame_deadline_s` of time spent waiting for the peer (the server's own
    pauses, while it does not read, do not count). `silence_s` is how long
    the peer has been silent while the server was reading (for keep-alive)."""

    def __init__(self, stream: trio.SocketStream, decoder: FrameDecoder, budget: FrameBudget | None,
                 frame_deadline_s: float = FRAME_DEADLINE_S_DEFAULT, *,
                 unreserved_bytes: int = FRAME_BYTES_UNRESERVED) -> None:
        self.stream = stream
        self.decoder = decoder
        self.budget = budget
        self.frame_deadline_s = frame_deadline_s
        self.unreserved_bytes = unreserved_bytes
        self.receiving = False  # inside `receive`: the server waits for the peer
        self.last_received_s = trio.current_time()
        self._waiting_since_s = self.last_received_s
        self._frame_number = -1
        self._frame_spent_s = 0.0  # of the frame under way, time spent waiting for its bytes
        self._reserved = 0

    def silence_s(self, now_s: float) -> float:
        """How long the peer has sent nothing while the server was ready to
        read it (0 while the server is not reading: a pause of ours is not
        the peer's silence)."""
        if not self.receiving:
            return 0.0
        return now_s - max(self.last_received_s, self._waiting_since_s)

    async def receive(self) -> bool:
        """Feed the next bytes to the decoder; False once the peer closed its
        end. Call only once every whole frame buffered was taken."""
        decoder = self.decoder
        assert not decoder.has_whole_frame, "frames already whole must be taken before reading more"
        started = decoder.started_frame
        if started:
            if self._frame_number != decoder.frames_decoded:
                self._frame_number = decoder.frames_decoded  # a new frame: its own clock
                self._frame_spent_s = 0.0
            # Never below 0: a read that returned just past the deadline
            # leaves the frame's time overspent, and the next read ends it.
            time_left_s = max(0.0, self.frame_deadline_s - self._frame_spent_s)
        else:
            self._frame_number = -1
            time_left_s = math.inf
        entered_s = trio.current_time()
        self.receiving = True
        self._waiting_since_s = entered_s
        data = b""
        reserving = False
        try:
            with trio.move_on_after(time_left_s) as scope:
                if self.budget is not None:
                    reserving = True
                    await self._fit_reservation(decoder.pending_frame_bytes if started else 0)
                    reserving = False
                    room = self.unreserved_bytes + self._reserved - decoder.buffered_bytes
                else:
                    room = RECEIVE_BYTES
                data = await self.stream.receive_some(max(1, min(room, RECEIVE_BYTES)))
        finally:
            self.receiving = False
            if started:
                self._frame_spent_s += trio.current_time() - entered_s
        if scope.cancelled_caught:
            if reserving:
                raise ProtocolError(f"a frame of {decoder.pending_frame_bytes} bytes waited "
                                    f"{self.frame_deadline_s:g}s for room in the process's frame budget")
            raise ProtocolError(f"a frame did not arrive whole within {self.frame_deadline_s:g}s of its first byte")
        if data:
            self.last_received_s = trio.current_time()
            decoder.feed(data)
        return bool(data)

    async def _fit_reservation(self, frame_bytes: int) -> None:
        """Hold what the frame under way needs beyond the allowance, no more."""
        wanted = max(0, frame_bytes - self.unreserved_bytes)
        if self._reserved > wanted:
            self.budget.release(self._reserved - wanted)
            self._reserved = wanted
        elif self._reserved < wanted:
            await self.budget.reserve(wanted - self._reserved)
            self._reserved = wanted

    def _release(self) -> None:
        if self._reserved:
            self.budget.release(self._reserved)
            self._reserved = 0

    def close(self) -> None:
        """Give back what this connection reserved (call when it ends)."""
        self._release()


__all__ = [
    "CONNECTIONS_MAX_DEFAULT",
    "CONNECTIONS_PER_ADDRESS_MAX_DEFAULT",
    "FRAME_BUFFER_BYTES_MAX_DEFAULT",
    "FRAME_BYTES_UNRESERVED",
    "FRAME_DEADLINE_S_DEFAULT",
    "ConnectionLimits",
    "FrameBudget",
    "FrameReader",
    "decode_from_peer",
    "peer_faults",
    "serve_admitted",
    "wait_for_output_room",
]
