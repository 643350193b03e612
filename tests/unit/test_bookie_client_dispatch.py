"""BookieClient hands answers that arrive together to their callbacks in
arrival order: back-to-back OK answers to one writer's adds of one ledger as
a single run of entry ids, everything else one answer at a time. A stand-in
bookie on loopback sends a crafted mix of answers in one write."""

import trio

from bookie.protocol.wire import (
    PROTOCOL_VERSION,
    AddResponse,
    FrameDecoder,
    HelloReply,
    Status,
    encode_add_ok,
    encode_add_tail,
    encode_frame,
    encode_hello_reply,
    encode_response,
)
from ledger_client.bookie_client import BookieClient, BookieConnectionError
from tests.support import wait_until_async

LEDGER = 7


class Writer:
    """A callback shaped like a ledger handle's: runs of OK answers go to
    `acknowledged`, anything else to the call."""

    def __init__(self, name: str, events: list) -> None:
        self.name = name
        self.events = events

    def __call__(self, response) -> None:
        if isinstance(response, BookieConnectionError):
            self.events.append((self.name, "lost"))
        else:
            self.events.append((self.name, response.status.name, response.entry_id))

    def acknowledged(self, ledger_id: int, entry_ids: list[int]) -> None:
        self.events.append((self.name, "ok", ledger_id, list(entry_ids)))


async def stand_in_bookie(listeners, answers_for, task_status=trio.TASK_STATUS_IGNORED):
    """Accept one client, answer its hello, wait for `len(answers_for)`
    requests and send every answer (answers_for(request_ids)) in one write."""
    task_status.started()
    stream = await listeners[0].accept()
    decoder = FrameDecoder()
    request_ids: list[int] = []
    hello_answered = False
    while len(request_ids) < answers_for.requests:
        data = await stream.receive_some(65536)
        assert data
        decoder.feed(data)
        for fields in decoder.frames():
            if not hello_answered:
                await stream.send_all(encode_hello_reply(HelloReply(Status.OK, PROTOCOL_VERSION, "stand-in", 1 << 20)))
                hello_answered = True
            else:
                request_ids.append(fields[1])
    await stream.send_all(b"".join(answers_for(request_ids)))
    await trio.sleep_forever()


async def exchange(sends: list, answers_for, until) -> None:
    """Connect to a stand-in bookie, send an add for each (callback, _) of
    `sends`, and return once `await until(client)` returns."""
    answers_for.requests = len(sends)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(stand_in_bookie, listeners, answers_for)
        async with BookieClient.connect(f"127.0.0.1:{port}") as client:
            tail = encode_add_tail(0, b"key", b"entry")
            for callback, _ in sends:
                client.submit_add_tail_nowait(tail, callback)
            with trio.fail_after(10):
                await until(client)
        nursery.cancel_scope.cancel()


async def test_runs_of_acknowledgements_keep_the_order_of_arrival():
    events: list = []
    first, second = Writer("first", events), Writer("second", events)
    plain: list = []

    # What each request is, in the order the client sends them.
    sends = [(first, 0), (first, 1), (second, 5), (first, 2), (first, 3), (first, 4), (first, 6), (plain.append, 9)]

    def answers_for(request_ids):
        frames = []
        for request_id, (_, entry_id) in zip(request_ids, sends):
            if entry_id == 3:
                frames.append(encode_response(AddResponse(request_id, Status.FENCED, LEDGER, entry_id)))
            elif entry_id == 6:
                frames.append(encode_add_ok(request_id, LEDGER + 1, entry_id))  # about another ledger
            else:
                frames.append(encode_add_ok(request_id, LEDGER, entry_id))
        frames.append(encode_add_ok(10_000, LEDGER, 99))  # answers nothing asked: dropped
        return frames

    async def all_answered(client) -> None:
        await wait_until_async(lambda: client.requests_in_flight == 0, deadline_s=10, what="every request answered")

    await exchange(sends, answers_for, all_answered)
    assert events == [
        ("first", "ok", LEDGER, [0, 1]),
        ("second", "ok", LEDGER, [5]),
        ("first", "ok", LEDGER, [2]),
        ("first", "FENCED", 3),
        ("first", "ok", LEDGER, [4]),
        ("first", "ok", LEDGER + 1, [6]),
    ]
    assert [(response.status, response.entry_id) for response in plain] == [(Status.OK, 9)]


async def test_a_malformed_answer_closes_the_connection_after_the_run_before_it():
    # Two acknowledgements, then an answer with a negative request id (bad
    # bytes from the bookie), then an acknowledgement that is never read:
    # the run before the bad frame is delivered, the connection is failed,
    # and the add still in flight hears that it was lost.
    events: list = []
    first = Writer("first", events)
    sends = [(first, 0), (first, 1), (first, 2)]

    def answers_for(request_ids):
        return [
            encode_add_ok(request_ids[0], LEDGER, 0),
            encode_add_ok(request_ids[1], LEDGER, 1),
            encode_frame([1, -5, 0, LEDGER, 1]),
            encode_add_ok(request_ids[2], LEDGER, 2),
        ]

    reasons: list = []

    async def closed(client) -> None:
        reasons.append(await client.wait_closed())

    await exchange(sends, answers_for, closed)
    assert "protocol error" in str(reasons[0])
    assert events == [("first", "ok", LEDGER, [0, 1]), ("first", "lost")]
