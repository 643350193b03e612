"""The part of the bookie's trio driver that serves client connections:
admission under the connection bounds, the handshake, reading requests
into the request core under the frame budget and deadline, and the writer
task. `BookieServer` inherits it; its state (`core`, `config`, `stats`,
`_connections`, ...) is the server's."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import trio

from bookie.protocol.wire import (
    PROTOCOL_VERSION,
    PROTOCOL_VERSION_MIN,
    REQUEST_ITEMS_MAX,
    AddBatchRequest,
    AddRequest,
    BatchReadRequest,
    Hello,
    HelloReply,
    ReadRequest,
    Status,
    decode_hello,
    decode_request,
    encode_hello_reply,
)
from framing.codec import FrameDecoder
from framing.peer_limits import (
    HANDSHAKE_FRAME_BYTES_MAX,
    FrameReader,
    decode_from_peer,
    peer_faults,
    serve_admitted,
    serve_admitted_tls,
    wait_for_output_room,
)
from framing.stream import FrameOutput
from security.tls import stream_peer_common_name as peer_common_name
from security.authentication import RefusalLog
from security.tokens import AuthenticationError

log = logging.getLogger("bookie.server")

HANDSHAKE_TIMEOUT_S = 10.0


def now_ms() -> float:
    return trio.current_time() * 1000.0


@dataclass(eq=False)
class ClientConnection:
    id: int
    stream: trio.SocketStream
    peer: str
    output: FrameOutput
    # With metrics on: when each add and read in progress arrived (ms).
    started_ms: dict[int, float] = field(default_factory=dict)
    unanswered: int = 0  # requests read and not yet answered
    answered: trio.Event | None = None  # set when `unanswered` drops, for a reader that waits on it

    @property
    def name(self) -> str:
        return f"{self.peer} (connection {self.id})"



class ClientConnections:
    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        connection_id = self._next_connection_id
        self._next_connection_id += 1
        if self.config.tls_context is None:
            await serve_admitted(stream, self.connection_limits, log,
                                 lambda peer: self._serve_connection(connection_id, stream, peer))
        else:
            await serve_admitted_tls(stream, self.connection_limits, log, self.config.tls_context,
                                     self.config.tls_handshake_deadline_s, self._count_tls_refusal,
                                     lambda tls_stream, peer: self._serve_connection(connection_id, tls_stream, peer))

    def _count_tls_refusal(self) -> None:
        self.stats.tls_handshakes_refused += 1

    async def _serve_connection(self, connection_id: int, stream: trio.SocketStream, peer: str) -> None:
        connection = ClientConnection(connection_id, stream, peer, FrameOutput(stream))
        self.stats.connections_accepted += 1
        decoder = FrameDecoder(self.config.frame_bytes_max, REQUEST_ITEMS_MAX)
        reader = FrameReader(stream, decoder, self.frame_budget, self.config.frame_deadline_s)
        try:
            handshaken = False
            with peer_faults(log, connection.name, self._count_protocol_error):
                decoder.frame_bytes_max = HANDSHAKE_FRAME_BYTES_MAX
                handshaken = await self._handshake(connection, reader)
                decoder.frame_bytes_max = self.config.frame_bytes_max
            if not handshaken:
                return
            self._connections[connection_id] = connection
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop, connection, nursery.cancel_scope)
                if await self._read_requests(connection, reader):
                    # The client finished sending: give the writer a bounded
                    # moment to send what is already answered.
                    with trio.move_on_after(1):
                        while connection.output:
                            await connection.output.wait_drained()
                nursery.cancel_scope.cancel()
        finally:
            reader.close()
            self._connections.pop(connection_id, None)
            self._execute(self.core.connection_closed(connection_id))
            await trio.aclose_forcefully(stream)

    def _count_protocol_error(self) -> None:
        self.stats.protocol_errors += 1

    async def _handshake(self, connection: ClientConnection, reader: FrameReader) -> bool:
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            while True:
                for fields in reader.decoder.frames():
                    hello = decode_from_peer(decode_hello, fields, "handshake")
                    if not PROTOCOL_VERSION_MIN <= hello.protocol_version <= PROTOCOL_VERSION:
                        reply = HelloReply(Status.BAD_VERSION, PROTOCOL_VERSION, self.core.bookie_id, self.config.frame_bytes_max)
                        await connection.stream.send_all(encode_hello_reply(reply))
                        log.info("refusing %s: protocol version %d", connection.peer, hello.protocol_version)
                        return False
                    refusal = self._refusal(hello, connection)
                    status = Status.OK if refusal is None else Status.UNAUTHORIZED
                    reply = HelloReply(status, PROTOCOL_VERSION, self.core.bookie_id, self.config.frame_bytes_max)
                    await connection.stream.send_all(encode_hello_reply(reply))
                    if refusal is not None:
                        self.stats.authentication_refusals += 1
                        if self._refusal_log.allows(time.monotonic()):
                            suppressed = self._refusal_log.take_suppressed()
                            log.warning("refusing ledger client %s: %s%s", connection.peer, refusal,
                                        f" ({suppressed} more refused since the last line)" if suppressed else "")
                        return False
                    return True
                if not await reader.receive():
                    return False

    def _refusal(self, hello: Hello, connection: ClientConnection) -> str | None:
        """Why a ledger client may not use this bookie (None: it may): its
        credentials are refused, or its role is not one of the client roles."""
        authenticator = self.config.authenticator
        if not authenticator.enabled:
            return None
        try:
            principal = authenticator.authenticate(hello.auth_method, hello.auth_data, now=time.time(),
                                                   peer_common_name=peer_common_name(connection.stream))
        except AuthenticationError as error:
            return str(error)
        if principal.role not in self.config.client_roles:
            return f"role {principal.role[:100]!r} is not one of the bookie's client roles"
        return None

    async def _read_requests(self, connection: ClientConnection, reader: FrameReader) -> bool:
        """Read and handle requests until the client closes (True) or breaks
        the protocol or the connection (False). Errors stay here, so that
        the connection's nursery never has to carry them."""
        with peer_faults(log, connection.name, self._count_protocol_error):
            await self._read_loop(connection, reader)
            return True
        return False

    async def _read_loop(self, connection: ClientConnection, reader: FrameReader) -> None:
        core, execute, decoder = self.core, self._execute, reader.decoder
        output_max = self.config.connection_output_bytes_max
        journal_max = self.config.journal_queue_bytes_max
        unanswered_max = self.config.requests_per_connection_max
        measured = self.metrics is not None
        started_ms = connection.started_ms
        # Frames that arrived with the handshake are handled first.
        while True:
            now = now_ms()
            deadline_before = core.next_deadline_ms()
            actions: list = []
            try:
                for fields in decoder.frames():
                    request = decode_from_peer(decode_request, fields, "request")
                    connection.unanswered += 1
                    kind = type(request)
                    if kind is AddRequest or kind is AddBatchRequest:
                        if measured:
                            started_ms[request.request_id] = now
                        actions += core.receive(connection.id, request, now)
                    else:
                        # A long poll waits on purpose: its time says nothing of the bookie.
                        if measured and (kind is BatchReadRequest or kind is ReadRequest and request.previous_lac is None):
                            started_ms[request.request_id] = now
                        actions += core.receive(connection.id, request, now)
                        # A read may be answered at once, from memory: carry
                        # it out now, so that a connection's unsent answers
                        # are checked against their bound request by request.
                        execute(actions)
                        actions = []
                        if connection.output.bytes > output_max:
                            break
                    if connection.unanswered > unanswered_max:
                        break
            finally:
                # Requests before a malformed frame are the core's now: their
                # actions must run even though the connection will close.
                if actions:
                    execute(actions)
            if core.next_deadline_ms() != deadline_before:
                self._tick_wakeup.set()
            await wait_for_output_room(connection.output, output_max, self.config.frame_deadline_s)
            while self._journal_bytes > journal_max:
                await self._journal_room.wait()
            while connection.unanswered > unanswered_max:
                connection.answered = trio.Event()
                await connection.answered.wait()
            connection.answered = None
            if decoder.has_whole_frame:
                continue  # the loop above stopped early: take what is buffered before reading more
            if not await reader.receive():
                return

    async def _write_loop(self, connection: ClientConnection, cancel_scope: trio.CancelScope) -> None:
        try:
            await connection.output.run_writer()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            cancel_scope.cancel()
