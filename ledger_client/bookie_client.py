"""A trio client for one bookie connection: handshake, pipelined requests
matched to responses by request id, writes coalesced into one send, and a
bound on requests in flight (callers wait for a slot).

A writer's adds (`submit_add_tail_nowait`) that queue up while earlier
requests are in flight leave together as one ADD_BATCH (protocol 2), which
the bookie answers once; with nothing in flight an add leaves at once.

    async with BookieClient.connect("127.0.0.1:3181") as client:
        response = await client.add(entry_bytes, master_key)
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from typing import AsyncIterator, Callable, Iterable

import trio

from bookie.protocol.wire import (
    LAST_ADD_CONFIRMED,
    PROTOCOL_VERSION,
    PROTOCOL_VERSION_MIN,
    AddBatchResponse,
    AddFlag,
    AddRequest,
    AddResponse,
    BatchReadRequest,
    BatchReadResponse,
    GetInfoRequest,
    GetInfoResponse,
    Hello,
    ListEntriesRequest,
    ListEntriesResponse,
    ReadFlag,
    ReadLacRequest,
    ReadLacResponse,
    ReadRequest,
    ReadResponse,
    Request,
    Response,
    Status,
    add_batch_ok_fields,
    add_ok_fields,
    decode_hello_reply,
    decode_response,
    encode_hello,
    encode_add,
    encode_add_batch_head,
    encode_add_head,
    encode_request,
)
from framing.codec import FRAME_BYTES_MAX_DEFAULT, FrameDecoder, ProtocolError
from framing.stream import RECEIVE_BYTES, FrameOutput, connect_tls, receive_first_frames
from ledger_client.exception_groups import unwrap_single_exception
from security.credentials import NO_CREDENTIALS, ClientCredentials
from ledger_client.fifo_semaphore import FifoSemaphore

log = logging.getLogger(__name__)
# An ADD_BATCH being gathered is sent once it holds this many adds or bytes
# (or when the connection's writer runs, whichever comes first).
ADD_BATCH_GATHER_ADDS = 128
ADD_BATCH_GATHER_BYTES = 128 * 1024
# Scheduling rounds the connection's writer waits while callers keep adding
# (see FrameOutput): callers that yield between adds then share a send.
COALESCE_ROUNDS = 64
Callback = Callable[["Response | BookieConnectionError"], None]


class BookieConnectionError(Exception):
    """The connection to the bookie failed or was refused; requests still in
    flight on it have an unknown outcome."""


class BookieRefusedError(BookieConnectionError):
    """The bookie refused this client: its credentials or role (a bookie
    that authenticates its clients), or TLS. Trying again will not help
    until the client's settings change."""


class _OlderBookie(Exception):
    """The bookie refused our protocol version and speaks an older one we speak too."""

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version


def _call_back(callback: Callable, *results) -> None:
    """Run a caller's callback from the connection's reader task. Its bug is
    logged and stays its own: it must neither break this connection nor
    keep the other requests' callbacks from running."""
    try:
        callback(*results)
    except Exception:
        log.exception("a bookie request's callback failed")


class AddListener:
    """What hears about adds for many entries (a ledger handle, answered
    for thousands of adds a second): given as an add's callback to
    `BookieClient.submit_add_tail_nowait`, it gets the OK answers to its
    adds that came back to back as one run, and everything else one by
    one, each with the id of the bookie that answered, so that one
    listener serves every bookie. (A class to inherit, not a protocol:
    telling a listener from a plain callback then costs no lookup of a
    method on every answer.)"""

    __slots__ = ()

    def adds_acknowledged(self, bookie_id: str, ledger_id: int, entry_ids: list[int]) -> None:
        raise NotImplementedError

    def add_answered(self, bookie_id: str, result: "AddResponse | BookieConnectionError") -> None:
        """An answer other than OK, or the connection's failure."""
        raise NotImplementedError


def answer_add(callback, bookie_id: str, result) -> None:
    """Hand an add's answer (any but an OK run: an error status, or a
    BookieConnectionError) to its callback: `add_answered` for an
    AddListener, else the call itself."""
    if isinstance(callback, AddListener):
        _call_back(callback.add_answered, bookie_id, result)
    else:
        _call_back(callback, result)


def _described(pending) -> str:
    """What a pending request is, for a protocol error's message."""
    if type(pending) is _Call:
        return f"which expects a {pending.answer_type.__name__}"
    if type(pending) is _AddBatch:
        return f"a batch of {len(pending.entry_ids)} adds"
    return "a single add"


def parse_address(address: str, what: str = "bookie") -> tuple[str, int]:
    """(host, port) of a HOST:PORT; ValueError naming `what` if it is not one."""
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"{what} address must be HOST:PORT, got {address[:100]!r}")
    return host, int(port)


# The answer each request other than an add expects, by the request's type.
_ANSWER_TYPES: dict[type, type] = {
    ReadRequest: ReadResponse,
    ReadLacRequest: ReadLacResponse,
    BatchReadRequest: BatchReadResponse,
    GetInfoRequest: GetInfoResponse,
    ListEntriesRequest: ListEntriesResponse,
}


class _Call:
    """A request other than an add, in flight: its callback and the type of
    answer it expects. What `_pending` holds tells the three kinds apart,
    one type check per answer: a plain ADD's callback as it is, an
    ADD_BATCH's `_AddBatch`, anything else a `_Call`."""

    __slots__ = ("callback", "answer_type")

    def __init__(self, callback: Callback, answer_type: type) -> None:
        self.callback = callback
        self.answer_type = answer_type


class _AddBatch:
    """Adds gathered for one ADD_BATCH: their encoded tails (until sent),
    and for each the callback, ledger id and entry id to hand its answer to
    (columns, not a tuple per add: they live until the answer, and every
    object that lives that long is one more for the garbage collector to
    look at)."""

    __slots__ = ("tails", "tails_bytes", "callbacks", "ledger_ids", "entry_ids")

    def __init__(self) -> None:
        self.tails: list[bytes] = []
        self.tails_bytes = 0
        self.callbacks: list[Callback] = []
        self.ledger_ids: list[int] = []
        self.entry_ids: list[int] = []

    def adds(self):
        """(callback, ledger id, entry id) of each add, in order."""
        return zip(self.callbacks, self.ledger_ids, self.entry_ids)


async def _over_tls(stream: trio.SocketStream, context: ssl.SSLContext, host: str, address: str) -> trio.SSLStream:
    try:
        return await connect_tls(stream, context, host)
    except trio.BrokenResourceError as error:
        cause = error.__cause__
        reason = getattr(cause, "verify_message", None) or getattr(cause, "reason", None) or type(cause or error).__name__
        raise BookieRefusedError(f"TLS with bookie {address} failed: {reason}") from None


class BookieClient:
    def __init__(
        self, stream: trio.SocketStream, address: str, bookie_id: str, frame_bytes_max: int, requests_in_flight_max: int,
        *, batching: bool = True,
    ):
        self.address = address
        self.bookie_id = bookie_id
        self.frame_bytes_max = frame_bytes_max
        self._stream = stream
        # The in-flight bound counts adds, batched or not, and other requests.
        self._in_flight_max = requests_in_flight_max
        self._in_flight_slots = FifoSemaphore(requests_in_flight_max)
        self._pending: dict[int, Callback | _AddBatch | _Call] = {}
        self._next_request_id = 1
        self._batching = batching  # the bookie speaks protocol 2
        self._gathering: _AddBatch | None = None
        self._gather_bytes_max = min(ADD_BATCH_GATHER_BYTES, frame_bytes_max - 64)
        self._output = FrameOutput(stream, gather=self._seal_batch, coalesce_rounds=COALESCE_ROUNDS)
        self._failure: BookieConnectionError | None = None
        self._failed = trio.Event()
        self._decoder: FrameDecoder | None = None

    # --- lifetime -----------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        address: str,
        *,
        peer_name: str = "quire-client",
        requests_in_flight_max: int = 10_000,
        frame_bytes_max: int = FRAME_BYTES_MAX_DEFAULT,
        expected_bookie_id: str | None = None,
        credentials: ClientCredentials = NO_CREDENTIALS,
    ) -> AsyncIterator["BookieClient"]:
        """Connect and shake hands. With `expected_bookie_id`, a bookie at
        the address that calls itself anything else is refused (a stale
        registration): adds meant for one bookie must not land on another,
        and add listeners are told answers by that id. `credentials`: the
        token and TLS context shown to bookies that authenticate their
        clients (their TLS context for bookies that serve TLS)."""
        host, port = parse_address(address)
        version = PROTOCOL_VERSION
        while True:
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError as error:
                raise BookieConnectionError(f"cannot connect to bookie {address}: {error}") from None
            try:
                if credentials.tls_context is not None:
                    stream = await _over_tls(stream, credentials.tls_context, host, address)
                client = await cls._handshake(
                    stream, address, peer_name, requests_in_flight_max, frame_bytes_max, version, expected_bookie_id,
                    credentials,
                )
                break
            except _OlderBookie as older:
                # A bookie not upgraded yet: speak its protocol (no ADD_BATCH) on a new connection.
                await trio.aclose_forcefully(stream)
                version = older.version
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
        try:
            with unwrap_single_exception():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(client._read_loop)
                    nursery.start_soon(client._write_loop)
                    try:
                        yield client
                    finally:
                        nursery.cancel_scope.cancel()
        finally:
            await trio.aclose_forcefully(stream)

    @classmethod
    async def _handshake(
        cls, stream: trio.SocketStream, address: str, peer_name: str, requests_in_flight_max: int, frame_bytes_max: int,
        version: int, expected_bookie_id: str | None, credentials: ClientCredentials = NO_CREDENTIALS,
    ) -> "BookieClient":
        decoder = FrameDecoder(frame_bytes_max)
        try:
            await stream.send_all(encode_hello(Hello(version, peer_name, *credentials.auth_fields())))
            frames = await receive_first_frames(stream, decoder)
            if not frames:
                raise BookieConnectionError(f"bookie {address} closed the connection during the handshake")
            reply = decode_hello_reply(frames[0])
        except (ProtocolError, trio.BrokenResourceError) as error:
            raise BookieConnectionError(f"handshake with bookie {address} failed: {error}") from None
        if reply.status is Status.BAD_VERSION and PROTOCOL_VERSION_MIN <= reply.protocol_version < version:
            raise _OlderBookie(reply.protocol_version)
        if reply.status is Status.UNAUTHORIZED:
            raise BookieRefusedError(f"bookie {address} refused this client: no credentials it takes, or a role "
                                        f"that is not one of its client roles (its log says which)")
        if reply.status is not Status.OK:
            raise BookieConnectionError(
                f"bookie {address} refused the handshake ({reply.status.name}, it speaks protocol {reply.protocol_version})"
            )
        if expected_bookie_id is not None and reply.bookie_id != expected_bookie_id:
            raise BookieConnectionError(f"the bookie at {address} is {reply.bookie_id!r}, not {expected_bookie_id!r}")
        # The expected id itself where there is one (equal, and the very
        # string the writers' metadata holds: their lookups by it then
        # match on identity).
        client = cls(
            stream, address, expected_bookie_id or reply.bookie_id, min(reply.frame_bytes_max, frame_bytes_max), requests_in_flight_max,
            batching=min(version, reply.protocol_version) >= 2,
        )
        client._decoder = decoder
        client._early_frames = frames[1:]
        return client

    @property
    def closed(self) -> bool:
        return self._failure is not None

    @property
    def requests_in_flight(self) -> int:
        """Adds (each add of a batch counts) and other requests sent or
        about to be, not answered yet."""
        return self._in_flight_max - self._in_flight_slots.available

    def adds_unanswered(self) -> bool:
        """Whether an add sent to this bookie, or queued to go, has had no
        answer yet (reads and other calls do not count)."""
        return self._gathering is not None or any(type(callback) is not _Call for callback in self._pending.values())

    async def wait_closed(self) -> BookieConnectionError:
        """Return (the reason) once the connection has failed or closed."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = BookieConnectionError(f"connection to bookie {self.address} lost: {reason}")
            self._failed.set()
        unanswered = list(self._pending.values())
        self._pending = {}
        if self._gathering is not None:
            unanswered.append(self._gathering)  # never sent
            self._gathering = None
        for callback in unanswered:
            if type(callback) is _Call:
                self._in_flight_slots.release(1)
                _call_back(callback.callback, self._failure)
            elif type(callback) is _AddBatch:
                self._in_flight_slots.release(len(callback.entry_ids))
                told = None
                for add_callback in callback.callbacks:
                    # Each add hears it, except that an add listener (about
                    # the bookie, not the add) hears it once per run of its adds.
                    if add_callback is not told or not isinstance(add_callback, AddListener):
                        told = add_callback
                        answer_add(add_callback, self.bookie_id, self._failure)
            else:
                self._in_flight_slots.release(1)
                answer_add(callback, self.bookie_id, self._failure)

    # --- requests -------------------------------------------------------------

    async def submit(self, request_factory: Callable[[int], Request], callback: Callback) -> int:
        """Send a request built for a fresh request id; `callback` later gets
        the response or a BookieConnectionError. Waits while the in-flight
        bound is reached (and is a scheduling point only then); returns the
        request id."""
        request_id = await self._take_slot()
        request = request_factory(request_id)
        request_type = type(request)
        if request_type is AddRequest:
            return self._send(request_id, encode_request(request), callback)
        answer_type = _ANSWER_TYPES.get(request_type)
        if answer_type is None:
            # An ADD_BATCH is gathered by `submit_add_tail_nowait`, which
            # keeps what its answer must be checked against.
            self._in_flight_slots.release(1)
            raise ValueError(f"submit sends one request with one answer; got a {request_type.__name__}")
        return self._send(request_id, encode_request(request), _Call(callback, answer_type))

    async def _take_slot(self) -> int:
        """Wait for room in the in-flight bound; return a fresh request id."""
        if self._failure is not None:
            raise self._failure
        # No scheduling point while the window has room: requests queued
        # back to back then leave in one send instead of one each.
        await self._in_flight_slots.acquire()
        if self._failure is not None:
            self._in_flight_slots.release()
            raise self._failure
        return self._new_request_id()

    def _new_request_id(self) -> int:
        request_id = self._next_request_id
        self._next_request_id = request_id + 1
        return request_id

    def _send(self, request_id: int, frame: bytes, callback: Callback) -> int:
        if len(frame) - 4 > self.frame_bytes_max:
            self._in_flight_slots.release(1)
            raise ValueError(f"request of {len(frame)} bytes exceeds the bookie's frame bound {self.frame_bytes_max}")
        self._seal_batch()  # adds gathered before this request leave before it
        self._pending[request_id] = callback
        self._output.queue(frame)
        self._send_queued()
        return request_id

    def _send_queued(self) -> None:
        if len(self._pending) == 1:
            # Nothing else in flight: nobody waits on an answer that would
            # hide this request's latency, so it goes out now. Otherwise the
            # writer task sends it with whatever else is queued by then.
            self._output.flush()
        else:
            self._output.schedule()

    def submit_add_tail_nowait(self, tail: bytes, callback: Callback, ledger_id: int, entry_id: int) -> None:
        """`submit_add` for callers that cannot wait (a driver carrying out a
        core's actions), for the add of entry `entry_id` of `ledger_id`
        whose tail (flags, master key, entry) was encoded once with
        `encode_add_tail` for every bookie the entry goes to. Raises
        trio.WouldBlock at the in-flight bound, ValueError for an entry past
        the bookie's frame bound and BookieConnectionError when the
        connection is gone.

        With requests in flight the add joins the ADD_BATCH being gathered,
        which the writer task sends when it runs; with none it leaves now,
        as a plain ADD.

        The callback is called with the AddResponse or the
        BookieConnectionError, unless it is an AddListener."""
        if self._failure is not None:
            raise self._failure
        tail_bytes = len(tail)
        if tail_bytes + 32 > self.frame_bytes_max:
            raise ValueError(f"an add of {tail_bytes} bytes exceeds the bookie's frame bound {self.frame_bytes_max}")
        self._in_flight_slots.acquire_nowait()
        if not self._batching or not self._pending and self._gathering is None:
            # A bookie of protocol 1, or nothing in flight: a plain ADD
            # leaves now (a batch of one would cost both sides more work).
            request_id = self._new_request_id()
            self._pending[request_id] = callback
            self._output.queue(encode_add_head(request_id, tail_bytes))
            self._output.queue(tail)
            self._send_queued()
            return
        batch = self._gathering
        if batch is None:
            batch = self._gathering = _AddBatch()
        elif len(batch.tails) >= ADD_BATCH_GATHER_ADDS or batch.tails_bytes + tail_bytes > self._gather_bytes_max:
            self._seal_batch()
            batch = self._gathering = _AddBatch()
        batch.tails.append(tail)
        batch.tails_bytes += tail_bytes
        batch.callbacks.append(callback)
        batch.ledger_ids.append(ledger_id)
        batch.entry_ids.append(entry_id)
        self._output.schedule()

    def _seal_batch(self) -> None:
        """Give the ADD_BATCH being gathered its request id and queue it."""
        batch = self._gathering
        if batch is None:
            return
        self._gathering = None
        request_id = self._new_request_id()
        self._pending[request_id] = batch
        output = self._output
        output.queue(encode_add_batch_head(request_id, len(batch.tails), batch.tails_bytes))
        output.queue_parts(batch.tails, batch.tails_bytes)
        batch.tails = []  # the output holds them until sent; the answer needs only the ids

    async def submit_add(self, flags: int, master_key: bytes, entry: bytes, callback: Callback) -> int:
        """`submit` for an ADD without building a request object: the path
        a writer pipelining many adds takes. Returns the request id."""
        request_id = await self._take_slot()
        return self._send(request_id, encode_add(request_id, flags, master_key, entry), callback)

    async def call(self, request_factory: Callable[[int], Request]) -> Response:
        done = trio.Event()
        result: list = []

        def callback(response) -> None:
            result.append(response)
            done.set()

        request_id = await self.submit(request_factory, callback)
        try:
            await done.wait()
        except trio.Cancelled:
            # Nobody will look at the answer: forget the request (its answer,
            # if it comes, is dropped) and free its slot.
            if self._pending.pop(request_id, None) is not None:
                self._in_flight_slots.release(1)
            raise
        if isinstance(result[0], BookieConnectionError):
            raise result[0]
        return result[0]

    async def add(self, entry: bytes, master_key: bytes, *, recovery: bool = False) -> AddResponse:
        flags = AddFlag.RECOVERY_ADD if recovery else AddFlag.NONE
        return await self.call(lambda request_id: AddRequest(request_id, flags, master_key, entry))

    async def read(
        self,
        ledger_id: int,
        entry_id: int = LAST_ADD_CONFIRMED,
        *,
        fence: bool = False,
        master_key: bytes | None = None,
        previous_lac: int | None = None,
        timeout_ms: int | None = None,
    ) -> ReadResponse:
        """Read one entry (LAST_ADD_CONFIRMED: the bookie's LAC entry). With
        `fence`, the bookie fences the ledger first. With `previous_lac`, the
        bookie answers once its LAC passes it, or after `timeout_ms`."""
        flags = ReadFlag.FENCE if fence else ReadFlag.NONE
        return await self.call(
            lambda request_id: ReadRequest(request_id, flags, ledger_id, entry_id, master_key, previous_lac, timeout_ms)
        )

    async def read_lac(self, ledger_id: int) -> ReadLacResponse:
        return await self.call(lambda request_id: ReadLacRequest(request_id, ledger_id))

    async def batch_read(self, ledger_id: int, first_entry_id: int, *, entries_max: int = 1000, bytes_max: int = 4 * 1024 * 1024) -> BatchReadResponse:
        return await self.call(lambda request_id: BatchReadRequest(request_id, ledger_id, first_entry_id, entries_max, bytes_max))

    async def get_info(self) -> GetInfoResponse:
        return await self.call(lambda request_id: GetInfoRequest(request_id))

    async def list_entries(self, ledger_id: int, first_entry_id: int = 0, last_entry_id: int = 2**64 - 1) -> ListEntriesResponse:
        return await self.call(lambda request_id: ListEntriesRequest(request_id, ledger_id, first_entry_id, last_entry_id))

    # --- I/O tasks ----------------------------------------------------------------

    def _dispatch(self, frames: Iterable[list]) -> None:
        """Hand the answers that arrived together to their callbacks, in
        order. An AddListener gets its OK answers to adds that came back to
        back, alone or in batches, as one run of entry ids; every other
        answer goes to `answer_add` (an add of a batch as its own
        AddResponse).

        An answer whose type is not its request's (a READ's answer to an
        ADD, an add's to a READ, a plain add's to a batch) is the bookie
        breaking the protocol: ProtocolError, and the connection fails as
        when the bookie fails.

        (Plain locals, no closure: with many ledgers open each answer is a
        run of its own, and this loop is a writer's per-answer cost.)"""
        pending, release, bookie_id = self._pending, self._in_flight_slots.release, self.bookie_id
        run_owner = None  # the listener whose run is being gathered
        run_ledger_id = -1
        run_entry_ids: list[int] = []
        try:
            for fields in frames:
                ok = add_ok_fields(fields)
                if ok is not None:
                    request_id, ledger_id, entry_id = ok
                    callback = pending.get(request_id)
                    if callback is None:
                        continue
                    kind = type(callback)
                    if kind is _AddBatch or kind is _Call:
                        raise ProtocolError(f"an answer for one add to request {request_id}, {_described(callback)}")
                    del pending[request_id]
                    release(1)
                    acknowledged = ((callback, ledger_id, entry_id),)
                else:
                    batch_ok = add_batch_ok_fields(fields)
                    if batch_ok is None:
                        # Anything but OK: each callback hears its own answer.
                        response = decode_response(fields)
                        callback = pending.get(response.request_id)
                        if callback is None:
                            continue
                        kind = type(callback)
                        batched = kind is _AddBatch
                        expected = callback.answer_type if kind is _Call else AddBatchResponse if batched else AddResponse
                        if type(response) is not expected or batched and len(response.statuses) != len(callback.entry_ids):
                            raise ProtocolError(
                                f"a {type(response).__name__} to request {response.request_id}, {_described(callback)}"
                            )
                        del pending[response.request_id]
                        if run_owner is not None:
                            owner, run_owner = run_owner, None
                            _call_back(owner.adds_acknowledged, bookie_id, run_ledger_id, run_entry_ids)
                        if kind is _Call:
                            release(1)
                            _call_back(callback.callback, response)
                        elif batched:  # (rare: some adds of the batch were refused)
                            release(len(callback.entry_ids))
                            for (add_callback, ledger_id, entry_id), status in zip(callback.adds(), response.statuses):
                                answer_add(add_callback, bookie_id, AddResponse(response.request_id, status, ledger_id, entry_id))
                        else:
                            release(1)
                            answer_add(callback, bookie_id, response)
                        continue
                    request_id, count = batch_ok
                    batch = pending.get(request_id)
                    if batch is None:
                        continue
                    if type(batch) is not _AddBatch or len(batch.entry_ids) != count:
                        raise ProtocolError(f"an answer for {count} batched adds to request {request_id}, which is not such a batch")
                    del pending[request_id]
                    release(count)
                    acknowledged = batch.adds()
                for callback, ledger_id, entry_id in acknowledged:
                    if callback is run_owner and ledger_id == run_ledger_id:
                        run_entry_ids.append(entry_id)
                        continue
                    if run_owner is not None:
                        # Cleared before the call: a run is handed over
                        # once, whatever the callback raises.
                        owner, run_owner = run_owner, None
                        try:  # (`_call_back`, inlined)
                            owner.adds_acknowledged(bookie_id, run_ledger_id, run_entry_ids)
                        except Exception:
                            log.exception("a bookie request's callback failed")
                    if isinstance(callback, AddListener):
                        run_owner, run_ledger_id, run_entry_ids = callback, ledger_id, [entry_id]
                    else:
                        _call_back(callback, AddResponse(request_id, Status.OK, ledger_id, entry_id))
        finally:
            # Also when a later frame was malformed: these were taken off
            # `pending`, so nobody else would answer them.
            if run_owner is not None:
                _call_back(run_owner.adds_acknowledged, bookie_id, run_ledger_id, run_entry_ids)

    async def _read_loop(self) -> None:
        decoder = self._decoder
        try:
            self._dispatch(self._early_frames)
            while True:
                data = await self._stream.receive_some(RECEIVE_BYTES)
                if not data:
                    self._fail("closed by the bookie")
                    return
                decoder.feed(data)
                self._dispatch(decoder.frames())
        except ProtocolError as error:
            self._fail(f"protocol error: {error}")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            self._fail(str(error) or type(error).__name__)
        finally:
            self._fail("connection closed")

    async def _write_loop(self) -> None:
        try:
            await self._output.run_writer()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            self._fail(str(error) or type(error).__name__)
        finally:
            self._fail("connection closed")
