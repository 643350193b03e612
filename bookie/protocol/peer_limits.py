"""What peers may hold of a server process, shared by the bookie and the
broker: how many connections in total and per client address, how much
memory frames being received may take across all connections, and how long a
frame may take to arrive once it has started.

`ConnectionLimits` is plain bookkeeping; `FrameBudget` and `FrameReader` are
driver code (they wait, with trio).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Awaitable, Callable, Iterator

import trio

from bookie.protocol.wire import FrameDecoder, ProtocolError

RECEIVE_BYTES = 256 * 1024
CONNECTIONS_MAX_DEFAULT = 10_000
CONNECTIONS_PER_ADDRESS_MAX_DEFAULT = 1_000
FRAME_BUFFER_BYTES_MAX_DEFAULT = 64 * 1024 * 1024
FRAME_DEADLINE_S_DEFAULT = 30.0
# Frames up to this size are read without a reservation: every connection
# may hold one (a read's worth) without asking the process-wide budget.
FRAME_BYTES_UNRESERVED = 256 * 1024


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


@contextlib.contextmanager
def peer_faults(log: logging.Logger, peer: str, count: Callable[[], None]) -> Iterator[None]:
    """Where a connection's work runs: what its peer did wrong ends that
    connection only. Bytes that break the protocol are logged with the
    reason (and counted); a broken connection is not news; anything else
    raised by one peer's input that we did not foresee is logged with its
    traceback (and counted) and ends that connection too. An assert that
    fails is our own invariant breaking: it propagates, and the process
    stops, as a bug should."""
    try:
        yield
    except ProtocolError as error:
        count()
        log.info("closing connection from %s: protocol error: %s", peer, error)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
        pass
    except AssertionError:
        raise
    except Exception:
        count()
        log.exception("closing connection from %s: unexpected error handling what it sent", peer)


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


class FrameBudget:
    """The bytes that large frames being received may hold across all of a
    process's connections. A connection reserves a frame's declared size
    before reading its body; when the budget is spent it waits (within its
    frame deadline) for others to finish, first come first served."""

    def __init__(self, bytes_max: int = FRAME_BUFFER_BYTES_MAX_DEFAULT) -> None:
        if bytes_max < 1:
            raise ValueError("the frame budget must be at least 1 byte")
        self.bytes_max = bytes_max
        self.reserved = 0
        self._lot = trio.lowlevel.ParkingLot()

    async def reserve(self, size: int) -> None:
        if size > self.bytes_max:
            raise ProtocolError(f"a frame of {size} bytes exceeds the process's frame budget of {self.bytes_max}")
        while self.reserved + size > self.bytes_max:
            await self._lot.park()
        self.reserved += size

    def release(self, size: int) -> None:
        assert 0 <= size <= self.reserved
        self.reserved -= size
        self._lot.unpark_all()


class FrameReader:
    """Reads one connection's bytes into its decoder under the process's
    limits: a frame, once its first byte is in, must be whole within
    `frame_deadline_s`; a frame larger than `FRAME_BYTES_UNRESERVED`
    reserves its size from the `FrameBudget` before more of it is read; and,
    where `idle_timeout_s` is given, a connection silent that long between
    frames is closed (`IdleTimeout`). `last_received_s` is when bytes last came."""

    def __init__(self, stream: trio.SocketStream, decoder: FrameDecoder, budget: FrameBudget | None,
                 frame_deadline_s: float = FRAME_DEADLINE_S_DEFAULT) -> None:
        self.stream = stream
        self.decoder = decoder
        self.budget = budget
        self.frame_deadline_s = frame_deadline_s
        self.last_received_s = trio.current_time()
        self._frame_started_s: float | None = None
        self._frame_number = -1
        self._reserved = 0

    async def receive(self) -> bool:
        """Feed the next bytes to the decoder; False once the peer closed its end."""
        decoder = self.decoder
        deadline = math.inf
        if decoder.started_frame:
            if self._frame_number != decoder.frames_decoded:
                # A new frame began since the last look (the previous one
                # finished): its own clock and its own reservation.
                self._release()
                self._frame_number = decoder.frames_decoded
                self._frame_started_s = trio.current_time()
            deadline = self._frame_started_s + self.frame_deadline_s
            size = decoder.pending_frame_bytes
            if self.budget is not None and size > FRAME_BYTES_UNRESERVED and self._reserved < size:
                with trio.move_on_at(deadline):
                    await self.budget.reserve(size - self._reserved)
                    self._reserved = size
                if self._reserved < size:
                    raise ProtocolError(
                        f"frame of {size} bytes waited {self.frame_deadline_s:g}s for room in the process's frame budget"
                    )
        else:
            self._release()
            self._frame_started_s = None
        with trio.move_on_at(deadline):
            data = await self.stream.receive_some(RECEIVE_BYTES)
            if data:
                self.last_received_s = trio.current_time()
                decoder.feed(data)
            return bool(data)
        raise ProtocolError(f"a frame did not arrive whole within {self.frame_deadline_s:g}s of its first byte")

    def _release(self) -> None:
        if self._reserved:
            self.budget.release(self._reserved)
            self._reserved = 0

    def close(self) -> None:
        """Give back what this connection reserved (call when it ends)."""
        self._release()
