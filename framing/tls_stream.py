"""TLS over a connected socket as a trio stream, through the `ssl` module's
own socket (OpenSSL reads and writes the descriptor itself), for speed:
trio's SSLStream feeds OpenSSL through memory buffers in Python, which
costs a broker or bookie a good part of its throughput. The descriptor is
non-blocking; the stream waits with trio for readability or writability
whenever OpenSSL asks for it (SSLWantRead / SSLWantWrite), in either
direction: a read may need to write (TLS 1.3 key updates, tickets).

One task may receive while another sends, as on a trio.SocketStream; two
tasks may not both send (or both receive) at once.
"""

from __future__ import annotations

import socket
import ssl

import trio

# Waits that collided with the other direction's (a receive that OpenSSL
# made wait for writability while a send waited for it too) are tried
# again after this long.
BUSY_RETRY_S = 0.001
# TLS records a receive takes beyond its first, when they are already there.
MORE_RECORDS_MAX = 16


class TLSSocketStream(trio.abc.Stream):
    def __init__(self, tls_socket: ssl.SSLSocket) -> None:
        self._socket = tls_socket
        self._closed = False

    @classmethod
    def wrap(cls, stream: trio.SocketStream, context: ssl.SSLContext, *, server_side: bool,
             server_hostname: str | None = None) -> "TLSSocketStream":
        """Take `stream`'s socket over (the trio stream must not be used
        again); the handshake is `do_handshake`'s."""
        trio_socket = stream.socket
        plain = socket.socket(trio_socket.family, trio_socket.type, trio_socket.proto, fileno=trio_socket.detach())
        plain.setblocking(False)
        try:
            tls_socket = context.wrap_socket(plain, server_side=server_side, server_hostname=server_hostname,
                                             do_handshake_on_connect=False, suppress_ragged_eofs=True)
        except BaseException:
            plain.close()
            raise
        return cls(tls_socket)

    @property
    def socket(self) -> ssl.SSLSocket:
        return self._socket

    def fileno(self) -> int:
        return self._socket.fileno()

    def getpeercert(self, binary_form: bool = False):
        return self._socket.getpeercert(binary_form)

    def setsockopt(self, *arguments) -> None:
        self._socket.setsockopt(*arguments)

    async def _wait(self, error: ssl.SSLError) -> None:
        try:
            if isinstance(error, ssl.SSLWantWriteError):
                await trio.lowlevel.wait_writable(self._socket)
            else:
                await trio.lowlevel.wait_readable(self._socket)
        except trio.BusyResourceError:
            # The other direction waits on the same readiness (a read that
            # needs to write while a send waits for room): its wait ends
            # as soon as the socket is ready, and this one tries again then.
            await trio.sleep(BUSY_RETRY_S)
        except (OSError, ValueError) as closed:  # the descriptor went away
            raise trio.ClosedResourceError("the TLS connection is closed") from closed

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the TLS connection is closed")

    async def do_handshake(self) -> None:
        while True:
            self._check_open()
            try:
                self._socket.do_handshake()
                return
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as error:
                await self._wait(error)
            except (ssl.SSLError, OSError) as error:
                raise trio.BrokenResourceError(f"TLS handshake failed: {error}") from error

    def try_send(self, data) -> int:
        """Send what the socket takes now, without waiting: the bytes sent
        (0 when it is full). Raises BrokenResourceError if it broke.

        After a 0, OpenSSL may hold part of `data` in a record it has begun:
        the next send must start with the same bytes, and be no shorter
        (SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER, which Python sets, lets the
        buffer move). FrameOutput's writer does exactly that: it sends what
        is left from the first unsent byte on."""
        self._check_open()
        try:
            return self._socket.send(data)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return 0
        except (ssl.SSLError, OSError) as error:
            raise trio.BrokenResourceError(f"TLS send failed: {error}") from error

    async def send_all(self, data) -> None:
        view = memoryview(data).cast("B")
        sent = 0
        while sent < len(view):
            self._check_open()
            try:
                sent += self._socket.send(view[sent:])
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as error:
                await self._wait(error)
            except (ssl.SSLError, OSError) as error:
                raise trio.BrokenResourceError(f"TLS send failed: {error}") from error
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self._socket)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        max_bytes = max_bytes or 65536
        while True:
            self._check_open()
            try:
                data = self._socket.recv(max_bytes)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as error:
                await self._wait(error)
                continue
            except ssl.SSLZeroReturnError:
                return b""
            except (ssl.SSLError, OSError) as error:
                raise trio.BrokenResourceError(f"TLS receive failed: {error}") from error
            if data and len(data) < max_bytes:
                data = self._more(data, max_bytes)
            await trio.lowlevel.checkpoint()
            return data

    def _more(self, data: bytes, max_bytes: int) -> bytes:
        """`data` and what else is there to read now: one read gives one TLS
        record (16 KiB at most), and a receiver is faster with many at once."""
        chunks = [data]
        total = len(data)
        # Bounded in reads, not only bytes: a peer sending one-byte records
        # would otherwise hold the event loop for thousands of them.
        for _ in range(MORE_RECORDS_MAX):
            if total >= max_bytes:
                break
            try:
                more = self._socket.recv(max_bytes - total)
            except (ssl.SSLError, OSError):
                break  # nothing more now (or a failure the next receive reports)
            if not more:
                break
            chunks.append(more)
            total += len(more)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._socket)
        self._socket.close()
        await trio.lowlevel.checkpoint()


__all__ = ["TLSSocketStream"]
