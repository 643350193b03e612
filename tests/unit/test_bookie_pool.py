"""BookiePool against a stand-in bookie on loopback that answers every add
OK at once: what the pool keeps of a request once it is answered, and a
bookie at the address that is not the one the registry named."""

import contextlib
import functools
import gc
import weakref

import trio

from bookie.protocol.wire import (
    AddBatchRequest,
    HelloReply,
    Op,
    Status,
    decode_request,
    encode_add_ok,
    encode_add_tail,
    encode_hello_reply,
)
from framing.codec import FrameDecoder, encode_frame
from ledger_client.bookie_client import AddListener, BookieConnectionError
from ledger_client.bookie_pool import BookiePool
from tests.support import wait_until_async

LEDGER = 7


class Registry:
    """What the pool asks of the registry: where a bookie listens, and
    whether it serves TLS (these do not)."""

    def __init__(self, address: str) -> None:
        self._address = address

    def address(self, bookie_id: str) -> str:
        return self._address

    def serves_tls(self, bookie_id: str) -> bool:
        return False


class Writer(AddListener):
    def __init__(self, *, expect_failures: bool = False) -> None:
        self.acknowledged_entry_ids: list[int] = []
        self.expect_failures = expect_failures
        self.failures: list[tuple[str, BookieConnectionError]] = []

    def add_answered(self, bookie_id: str, response) -> None:
        if not self.expect_failures or not isinstance(response, BookieConnectionError):
            raise AssertionError(f"only OK answers were expected, got {response!r} from {bookie_id}")
        self.failures.append((bookie_id, response))

    def adds_acknowledged(self, bookie_id: str, ledger_id: int, entry_ids: list[int]) -> None:
        assert bookie_id == "bookie-1"
        self.acknowledged_entry_ids += entry_ids


async def answer_every_add(stream: trio.SocketStream, calls_itself: str = "bookie-1") -> None:
    decoder = FrameDecoder()
    hello_answered = False
    while data := await stream.receive_some(65536):
        decoder.feed(data)
        for fields in decoder.frames():
            if not hello_answered:
                await stream.send_all(encode_hello_reply(HelloReply(Status.OK, 2, calls_itself, 1 << 20)))
                hello_answered = True
                continue
            request = decode_request(fields)
            if type(request) is AddBatchRequest:
                await stream.send_all(encode_frame([Op.ADD_BATCH, request.request_id, len(request.adds) // 3, Status.OK]))
            else:
                header = request.entry
                await stream.send_all(encode_add_ok(request.request_id, LEDGER, int.from_bytes(header[8:16], "big")))


@contextlib.asynccontextmanager
async def pool_of(handler):
    """A pool whose "bookie-1" is `handler` on loopback; closed after."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    address = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handler, listeners)
        pool = BookiePool(Registry(address), nursery)
        yield pool
        pool.close()
        nursery.cancel_scope.cancel()


def send_adds(pool: BookiePool, writer: Writer, entry_ids) -> None:
    for entry_id in entry_ids:
        pool.send_add_tail("bookie-1", encode_add_tail(0, b"key", entry_id.to_bytes(16, "big")), writer, LEDGER, entry_id)


async def test_adds_that_waited_for_the_connection_are_let_go_once_answered():
    # Adds sent before the connection is up wait in a list, handed to the
    # client once it connects. That list must not outlive the hand-over:
    # kept in the connection's task for as long as the connection lasts, it
    # held every waiting add's callback and bytes.
    async with pool_of(answer_every_add) as pool:
        writer = Writer()
        send_adds(pool, writer, range(3))
        await wait_until_async(lambda: writer.acknowledged_entry_ids == [0, 1, 2], deadline_s=10, what="the three adds answered")
        gone = weakref.ref(writer)
        del writer
        gc.collect()
        assert gone() is None, f"still held by {[type(referrer).__name__ for referrer in gc.get_referrers(gone())]}"


async def test_a_bookie_that_calls_itself_by_another_id_is_refused():
    # The registry sends "bookie-1" to an address where another bookie
    # answers (a stale registration): no add may land there, and each
    # fails as a lost connection to the bookie it was meant for.
    async with pool_of(functools.partial(answer_every_add, calls_itself="bookie-2")) as pool:
        writer = Writer(expect_failures=True)
        send_adds(pool, writer, range(2))
        await wait_until_async(lambda: len(writer.failures) == 2, deadline_s=10, what="both adds failed")
        assert writer.acknowledged_entry_ids == []
        assert [bookie_id for bookie_id, _ in writer.failures] == ["bookie-1", "bookie-1"]
        assert "'bookie-2', not 'bookie-1'" in str(writer.failures[0][1])


async def test_draining_waits_for_the_answers_to_adds_still_on_their_way():
    # A client closing right after its last add (complete at the ack
    # quorum) waits for the slower bookies' answers, so that their copies
    # are not dropped with the connection; a bookie that never answers
    # holds the close up only for the bound.
    async def answer_late(stream: trio.SocketStream) -> None:
        await trio.sleep(0.3)
        await answer_every_add(stream)

    async def never_answer(stream: trio.SocketStream) -> None:
        decoder = FrameDecoder()
        data = await stream.receive_some(65536)
        decoder.feed(data)
        await stream.send_all(encode_hello_reply(HelloReply(Status.OK, 2, "bookie-1", 1 << 20)))
        await trio.sleep_forever()

    for handler, answered in ((answer_late, True), (never_answer, False)):
        async with pool_of(handler) as pool:
            writer = Writer()
            send_adds(pool, writer, range(3))
            started = trio.current_time()
            await pool.drain_adds(deadline_s=2.0)
            waited = trio.current_time() - started
            if answered:
                assert writer.acknowledged_entry_ids == [0, 1, 2] and waited < 2.0
            else:
                assert writer.acknowledged_entry_ids == [] and waited >= 2.0
