"""One client connection to a broker: the handshake, requests matched to
responses by id, and the frames a broker pushes (send receipts, messages,
"closed, look it up again") routed to the producer or consumer they name.

When the connection breaks, every pending request fails with
`ConnectionClosedError` and every producer and consumer on it is told, so
that it reconnects.
"""

from __future__ import annotations

import itertools
import logging
import ssl
from typing import Any, Callable

import trio

from broker.errors import AuthenticationError, BrokerStatus, ConnectionClosedError, ProtocolVersionError, error_for_status
from broker.protocol import (
    PROTOCOL_VERSION,
    Closed,
    Connect,
    Connected,
    FrameDecoder,
    MessageDelivery,
    Ping,
    Pong,
    ProtocolError,
    Response,
    SendReceipt,
    decode,
    encode,
)
from framing.stream import RECEIVE_BYTES, FrameOutput, connect_tls, enable_keepalive, receive_first_frames

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
OUTPUT_BYTES_MAX = 32 * 1024 * 1024  # queued requests not yet taken by the socket; past it senders wait
# A broker silent this long is sent a PING; one silent for two intervals is
# taken for gone and the connection closed (its producers and consumers
# reconnect). The broker does the same the other way.
KEEPALIVE_INTERVAL_S = 30.0


class _Endpoint:
    """A producer's or consumer's callbacks on a connection."""

    __slots__ = ("on_frame", "on_closed")

    def __init__(self, on_frame: Callable[[Any], None], on_closed: Callable[[str], None]) -> None:
        self.on_frame = on_frame
        self.on_closed = on_closed


class BrokerConnection:
    def __init__(self, address: str, stream: trio.SocketStream, broker_id: str, frame_bytes_max: int) -> None:
        self.address = address
        self.broker_id = broker_id
        self._stream = stream
        self._output = FrameOutput(stream)
        self._decoder = FrameDecoder(frame_bytes_max)
        self._request_ids = itertools.count(1)
        self._pending: dict[int, tuple[trio.Event, list]] = {}
        self._producers: dict[int, _Endpoint] = {}
        self._consumers: dict[int, _Endpoint] = {}
        self.closed: str | None = None  # why, once closed
        self._closed_event = trio.Event()
        self._last_received_s = trio.current_time()
        self.keepalive_interval_s = KEEPALIVE_INTERVAL_S

    @classmethod
    async def connect(cls, address: str, client_name: str, *, frame_bytes_max: int,
                      auth_token: str | None = None, tls_context: ssl.SSLContext | None = None) -> "BrokerConnection":
        host, _, port = address.rpartition(":")
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                stream = await trio.open_tcp_stream(host, int(port))
                enable_keepalive(stream)
                if tls_context is not None:
                    try:
                        stream = await connect_tls(stream, tls_context, host)
                    except BaseException:
                        await trio.aclose_forcefully(stream)
                        raise
                try:
                    credentials = ("token", auth_token.encode()) if auth_token else ("", b"")
                    await stream.send_all(encode(Connect(PROTOCOL_VERSION, client_name, *credentials)))
                    frames = await receive_first_frames(stream, FrameDecoder(frame_bytes_max))
                    if not frames:
                        raise ConnectionClosedError(f"broker {address} closed the connection during the handshake")
                    reply = decode(frames[0])
                    if not isinstance(reply, Connected):
                        raise ProtocolError("the broker's first frame is not CONNECTED")
                    if reply.status == BrokerStatus.UNAUTHENTICATED:
                        raise AuthenticationError(f"broker {address} refused the connection: {reply.message}")
                    if reply.status != BrokerStatus.OK:
                        raise ProtocolVersionError(f"broker {address} speaks protocol {reply.protocol_version}, not {PROTOCOL_VERSION}")
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
        except (OSError, trio.BrokenResourceError, trio.TooSlowError, ProtocolError, ValueError) as error:
            if isinstance(getattr(error, "__cause__", None), ssl.SSLCertVerificationError):
                raise ConnectionClosedError(f"cannot connect to broker {address}: its certificate is not trusted: "
                                            f"{error.__cause__.verify_message}") from None
            # Refused, reset (a broker killed during the handshake), too slow or not a broker.
            raise ConnectionClosedError(f"cannot connect to broker {address}: {error}") from None
        connection = cls(address, stream, reply.broker_id, frame_bytes_max)
        # Frames that came with the handshake reply.
        for fields in frames[1:]:
            connection._dispatch(decode(fields))
        return connection

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read and write until the connection breaks or is closed."""
        task_status.started()
        reason = "closed"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop, nursery.cancel_scope)
                nursery.start_soon(self._keepalive_loop, nursery.cancel_scope)
                reason = await self._read_loop()
                nursery.cancel_scope.cancel()
            if self._last_received_s + 2 * self.keepalive_interval_s <= trio.current_time():
                reason = f"broker {self.address} silent for {2 * self.keepalive_interval_s:g}s"
        finally:
            self._close(reason)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self._stream)

    async def _read_loop(self) -> str:
        try:
            while True:
                data = await self._stream.receive_some(RECEIVE_BYTES)
                if not data:
                    return f"broker {self.address} closed the connection"
                self._last_received_s = trio.current_time()
                self._decoder.feed(data)
                for fields in self._decoder.frames():
                    self._dispatch(decode(fields))
        except ProtocolError as error:
            log.warning("broker %s broke the protocol: %s", self.address, error)
            return f"broker {self.address} broke the protocol: {error}"
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            return f"connection to broker {self.address} broke: {error}"

    async def _keepalive_loop(self, cancel_scope: trio.CancelScope) -> None:
        pinged_for = None
        while True:
            await trio.sleep(self.keepalive_interval_s / 4)
            silent_s = trio.current_time() - self._last_received_s
            if silent_s >= 2 * self.keepalive_interval_s:
                cancel_scope.cancel()
                return
            if silent_s >= self.keepalive_interval_s and pinged_for != self._last_received_s:
                pinged_for = self._last_received_s
                self.send(Ping())

    async def _write_loop(self, cancel_scope: trio.CancelScope) -> None:
        try:
            await self._output.run_writer()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            cancel_scope.cancel()

    def _dispatch(self, message: Any) -> None:
        kind = type(message)
        if kind is SendReceipt:
            endpoint = self._producers.get(message.producer_handle)
        elif kind is MessageDelivery:
            endpoint = self._consumers.get(message.consumer_handle)
        elif kind is Response:
            pending = self._pending.pop(message.request_id, None)
            if pending is not None:
                pending[1].append(message)
                pending[0].set()
            return
        elif kind is Closed:
            registry = self._producers if message.kind == "producer" else self._consumers
            endpoint = registry.pop(message.handle, None)
            if endpoint is not None:
                endpoint.on_closed(message.message)
            return
        elif kind is Ping:
            self.send(Pong())
            return
        elif kind is Pong:
            return
        else:
            raise ProtocolError(f"a broker does not send {kind.__name__}")
        if endpoint is not None:
            endpoint.on_frame(message)

    def _close(self, reason: str) -> None:
        if self.closed is not None:
            return
        self.closed = reason
        self._closed_event.set()
        pending, self._pending = self._pending, {}
        for event, result in pending.values():
            result.append(ConnectionClosedError(reason))
            event.set()
        for registry in (self._producers, self._consumers):
            endpoints = list(registry.values())
            registry.clear()
            for endpoint in endpoints:
                endpoint.on_closed(reason)

    async def aclose(self) -> None:
        self._close("closed by the client")
        await trio.aclose_forcefully(self._stream)

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    # --- sending -----------------------------------------------------------------------

    def new_request_id(self) -> int:
        return next(self._request_ids)

    def send(self, message: Any) -> None:
        """Queue a frame (no answer expected, or one routed by handle)."""
        if self.closed is not None:
            raise ConnectionClosedError(self.closed)
        self._output.queue(encode(message))
        self._output.flush()

    async def wait_for_room(self) -> None:
        """Back-pressure: wait while too much is queued for the socket."""
        while self._output.bytes > OUTPUT_BYTES_MAX and self.closed is None:
            await self._output.wait_drained()

    async def request(self, make: Callable[[int], Any]) -> dict:
        """Send a request built with a fresh request id; returns the
        response's body, or raises the error its status names."""
        request_id = self.new_request_id()
        event, result = trio.Event(), []
        self._pending[request_id] = (event, result)
        try:
            self.send(make(request_id))
            await event.wait()
        finally:
            self._pending.pop(request_id, None)
        response = result[0]
        if isinstance(response, Exception):
            raise response
        if response.status != BrokerStatus.OK:
            raise error_for_status(BrokerStatus(response.status), response.message)
        return response.body

    # --- producers and consumers -------------------------------------------------------

    def register_producer(self, handle: int, on_receipt: Callable[[SendReceipt], None], on_closed: Callable[[str], None]) -> None:
        self._producers[handle] = _Endpoint(on_receipt, on_closed)

    def register_consumer(self, handle: int, on_message: Callable[[MessageDelivery], None], on_closed: Callable[[str], None]) -> None:
        self._consumers[handle] = _Endpoint(on_message, on_closed)

    def forget_producer(self, handle: int) -> None:
        self._producers.pop(handle, None)

    def forget_consumer(self, handle: int) -> None:
        self._consumers.pop(handle, None)


__all__ = ["BrokerConnection"]
