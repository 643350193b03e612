"""BookieClient hands answers that arrive together to their callbacks in
arrival order: back-to-back OK answers to one writer's adds of one ledger as
a single run of entry ids, everything else one answer at a time. A stand-in
bookie on loopback sends a crafted mix of answers in one write.

A stand-in of protocol 1 gets one ADD per add; one of protocol 2 gets the
adds that queue up behind the first as ADD_BATCH requests."""

import pytest
import trio

from bookie.protocol.wire import (
    AddBatchRequest,
    AddBatchResponse,
    AddRequest,
    AddResponse,
    GetInfoResponse,
    HelloReply,
    Op,
    ReadLacResponse,
    ReadRequest,
    ReadResponse,
    Status,
    decode_request,
    encode_add_ok,
    encode_add_tail,
    encode_hello_reply,
    encode_response,
)
from framing.codec import FrameDecoder, encode_frame
from ledger_client.bookie_client import AddListener, BookieClient, BookieConnectionError
from tests.support import wait_until_async

LEDGER = 7


class Writer(AddListener):
    """An add listener, as a ledger handle is: runs of OK answers go to
    `adds_acknowledged`, anything else to `add_answered`, each with the id
    of the bookie that answered (the stand-in calls itself "stand-in")."""

    def __init__(self, name: str, events: list) -> None:
        self.name = name
        self.events = events

    def add_answered(self, bookie_id: str, response) -> None:
        assert bookie_id == "stand-in"
        if isinstance(response, BookieConnectionError):
            self.events.append((self.name, "lost"))
        else:
            self.events.append((self.name, response.status.name, response.entry_id))

    def adds_acknowledged(self, bookie_id: str, ledger_id: int, entry_ids: list[int]) -> None:
        assert bookie_id == "stand-in"
        self.events.append((self.name, "ok", ledger_id, list(entry_ids)))


def adds_of(request) -> int:
    """The adds a request holds; any request other than an ADD_BATCH counts one."""
    return len(request.adds) // 3 if type(request) is AddBatchRequest else 1


async def stand_in_bookie(listeners, answers_for, protocol_version, task_status=trio.TASK_STATUS_IGNORED):
    """Accept one client, answer its hello as a bookie of `protocol_version`,
    wait for `answers_for.adds` adds and send every answer
    (answers_for(requests)) in one write."""
    task_status.started()
    stream = await listeners[0].accept()
    decoder = FrameDecoder()
    requests: list = []
    hello_answered = False
    while sum(map(adds_of, requests)) < answers_for.adds:
        data = await stream.receive_some(65536)
        assert data
        decoder.feed(data)
        for fields in decoder.frames():
            if not hello_answered:
                await stream.send_all(encode_hello_reply(HelloReply(Status.OK, protocol_version, "stand-in", 1 << 20)))
                hello_answered = True
            else:
                requests.append(decode_request(fields))
    await stream.send_all(b"".join(answers_for(requests)))
    await trio.sleep_forever()


async def exchange(sends: list, answers_for, until, *, protocol_version: int = 1) -> None:
    """Connect to a stand-in bookie, send an add of entry e of `LEDGER` for
    each (callback, e) of `sends`, and return once `await until(client)`
    returns."""
    answers_for.adds = len(sends)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(stand_in_bookie, listeners, answers_for, protocol_version)
        async with BookieClient.connect(f"127.0.0.1:{port}") as client:
            tail = encode_add_tail(0, b"key", b"entry")
            for callback, entry_id in sends:
                client.submit_add_tail_nowait(tail, callback, LEDGER, entry_id)
            with trio.fail_after(10):
                await until(client)
        nursery.cancel_scope.cancel()


async def all_answered(client) -> None:
    await wait_until_async(lambda: client.requests_in_flight == 0, deadline_s=10, what="every request answered")


async def test_runs_of_acknowledgements_keep_the_order_of_arrival():
    events: list = []
    first, second = Writer("first", events), Writer("second", events)
    plain: list = []

    # What each request is, in the order the client sends them.
    sends = [(first, 0), (first, 1), (second, 5), (first, 2), (first, 3), (first, 4), (first, 6), (plain.append, 9)]

    def answers_for(requests):
        frames = []
        for request_id, (_, entry_id) in zip([request.request_id for request in requests], sends):
            if entry_id == 3:
                frames.append(encode_response(AddResponse(request_id, Status.FENCED, LEDGER, entry_id)))
            elif entry_id == 6:
                frames.append(encode_add_ok(request_id, LEDGER + 1, entry_id))  # about another ledger
            else:
                frames.append(encode_add_ok(request_id, LEDGER, entry_id))
        frames.append(encode_add_ok(10_000, LEDGER, 99))  # answers nothing asked: dropped
        return frames

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

    def answers_for(requests):
        request_ids = [request.request_id for request in requests]
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


async def test_batched_adds_are_answered_in_runs_across_batches():
    # The first add leaves alone as a plain ADD (nothing was in flight), the
    # rest queue up behind it and leave as one ADD_BATCH. Both answers arrive in one
    # write: runs continue across them, a plain callback gets its own
    # AddResponse, and the second writer's add splits the first's run.
    events: list = []
    first, second = Writer("first", events), Writer("second", events)
    plain: list = []
    sends = [(first, 0), (first, 1), (first, 2), (second, 5), (first, 3), (plain.append, 9), (first, 4)]

    def answers_for(requests):
        alone, batch = requests
        assert type(alone) is AddRequest and type(batch) is AddBatchRequest and adds_of(batch) == 6
        frames = [encode_add_ok(alone.request_id, LEDGER, 0), encode_response(AddBatchResponse(batch.request_id, [Status.OK] * 6))]
        frames.append(encode_frame([Op.ADD_BATCH, 10_000, 3, 0]))  # answers nothing asked: dropped
        return frames

    await exchange(sends, answers_for, all_answered, protocol_version=2)
    assert events == [
        ("first", "ok", LEDGER, [0, 1, 2]),
        ("second", "ok", LEDGER, [5]),
        ("first", "ok", LEDGER, [3]),
        ("first", "ok", LEDGER, [4]),
    ]
    assert [(response.status, response.ledger_id, response.entry_id) for response in plain] == [(Status.OK, LEDGER, 9)]


@pytest.mark.parametrize(
    "batch_answer, expected",
    [
        # Not all OK: each add of the batch hears its own status.
        (
            lambda request_id: encode_response(AddBatchResponse(request_id, [Status.OK, Status.FENCED, Status.OK])),
            [("first", "ok", LEDGER, [0]), ("first", "OK", 1), ("first", "FENCED", 2), ("first", "OK", 3)],
        ),
        # An answer counting 2 adds where the batch had 3 (bad bytes from
        # the bookie) fails the connection: the batch's adds hear once (one
        # writer) that they were lost.
        (
            lambda request_id: encode_frame([Op.ADD_BATCH, request_id, 2, 0]),
            [("first", "ok", LEDGER, [0]), ("first", "lost")],
        ),
    ],
    ids=["mixed statuses", "wrong count"],
)
async def test_the_answer_to_a_batch_behind_a_first_add(batch_answer, expected):
    events: list = []
    first = Writer("first", events)
    sends = [(first, 0), (first, 1), (first, 2), (first, 3)]

    def answers_for(requests):
        alone, batch = requests
        return [encode_add_ok(alone.request_id, LEDGER, 0), batch_answer(batch.request_id)]

    async def answered_or_closed(client) -> None:
        await wait_until_async(lambda: client.requests_in_flight == 0, deadline_s=10, what="every add answered or lost")

    await exchange(sends, answers_for, answered_or_closed, protocol_version=2)
    assert events == expected


async def test_a_bookie_of_protocol_1_is_spoken_to_in_protocol_1():
    # It refuses a HELLO of protocol 2 (BAD_VERSION, saying it speaks 1), as
    # a bookie not yet upgraded does; the client connects again with 1 and
    # sends plain ADDs, never an ADD_BATCH.
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    hellos: list[int] = []
    requests: list = []

    async def serve(stream) -> None:
        decoder = FrameDecoder()
        while data := await stream.receive_some(65536):
            decoder.feed(data)
            for fields in decoder.frames():
                if fields[0] == Op.HELLO:
                    hellos.append(fields[1])
                    status = Status.OK if fields[1] == 1 else Status.BAD_VERSION
                    await stream.send_all(encode_hello_reply(HelloReply(status, 1, "stand-in", 1 << 20)))
                    if status is not Status.OK:
                        return  # and the connection closes, as a bookie's does
                else:
                    requests.append(decode_request(fields))
                    await stream.send_all(encode_add_ok(requests[-1].request_id, LEDGER, len(requests) - 1))

    async def old_bookie() -> None:
        while True:
            async with await listeners[0].accept() as stream:
                await serve(stream)

    events: list = []
    first = Writer("first", events)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(old_bookie)
        async with BookieClient.connect(f"127.0.0.1:{port}") as client:
            tail = encode_add_tail(0, b"key", b"entry")
            for entry_id in range(3):
                client.submit_add_tail_nowait(tail, first, LEDGER, entry_id)
            with trio.fail_after(10):
                await all_answered(client)
        nursery.cancel_scope.cancel()
    assert hellos == [2, 1]
    assert [type(request) for request in requests] == [AddRequest] * 3
    assert sorted(entry for event in events for entry in event[3]) == [0, 1, 2]


# --- answers of the wrong type -------------------------------------------------------------


async def answers_to_a_read_and_an_add(answers_for) -> tuple[list, list, str]:
    """A read of entry 0 of `LEDGER` and a writer's add of entry 1, in
    flight together on a bookie of protocol 1, answered as
    `answers_for(read_request, add_request)` says. Returns what the read
    returned or raised, what the writer heard, and why the connection
    closed ("" if it did not)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    events: list = []
    writer = Writer("writer", events)
    read_outcome: list = []

    def answers(requests):
        read = next(request for request in requests if type(request) is ReadRequest)
        add = next(request for request in requests if type(request) is AddRequest)
        return answers_for(read, add)

    answers.adds = 2
    async with trio.open_nursery() as nursery:
        await nursery.start(stand_in_bookie, listeners, answers, 1)
        async with BookieClient.connect(f"127.0.0.1:{port}") as client:

            async def read() -> None:
                try:
                    read_outcome.append(await client.read(LEDGER, 0))
                except BookieConnectionError as error:
                    read_outcome.append(error)

            nursery.start_soon(read)
            await wait_until_async(lambda: client.requests_in_flight == 1, deadline_s=10, what="the read sent")
            client.submit_add_tail_nowait(encode_add_tail(0, b"key", b"entry"), writer, LEDGER, 1)
            await wait_until_async(lambda: read_outcome and events, deadline_s=10, what="both answered or lost")
            reason = str(await client.wait_closed()) if client.closed else ""
        nursery.cancel_scope.cancel()
    return read_outcome, events, reason


async def test_each_request_takes_the_answer_of_its_own_type_in_any_order():
    def answers_for(read, add):
        return [
            encode_add_ok(add.request_id, LEDGER, 1),
            encode_response(ReadResponse(read.request_id, Status.OK, LEDGER, 0, 0, b"entry 0")),
        ]

    read_outcome, events, reason = await answers_to_a_read_and_an_add(answers_for)
    assert read_outcome == [ReadResponse(1, Status.OK, LEDGER, 0, 0, b"entry 0")]
    assert events == [("writer", "ok", LEDGER, [1])]
    assert reason == ""


WRONG_TYPES = {
    # A READ's answer to an ADD was handed to the writer as the add's status.
    "a read's answer to an add": lambda read, add: [
        encode_response(ReadResponse(add.request_id, Status.OK, LEDGER, 1, 0, b"entry 1")),
    ],
    # An add's OK to a READ reached the reader as an AddResponse.
    "an add's OK to a read": lambda read, add: [encode_add_ok(read.request_id, LEDGER, 0)],
    "an add's refusal to a read": lambda read, add: [
        encode_response(AddResponse(read.request_id, Status.FENCED, LEDGER, 0)),
    ],
    "a batch's answer to an add": lambda read, add: [encode_frame([Op.ADD_BATCH, add.request_id, 1, 0])],
    "another read's answer to a read": lambda read, add: [
        encode_response(ReadLacResponse(read.request_id, Status.OK, LEDGER, 0)),
    ],
    "information to a read": lambda read, add: [
        encode_response(GetInfoResponse(read.request_id, Status.OK, {"bookie_id": "stand-in"})),
    ],
}


@pytest.mark.parametrize("answers_for", list(WRONG_TYPES.values()), ids=list(WRONG_TYPES))
async def test_an_answer_of_the_wrong_type_closes_the_connection(answers_for):
    # The bookie broke the protocol: nothing it said is believed, the
    # connection closes, and both requests fail as when a bookie fails.
    read_outcome, events, reason = await answers_to_a_read_and_an_add(answers_for)
    assert "protocol error" in reason, reason
    assert len(read_outcome) == 1 and isinstance(read_outcome[0], BookieConnectionError), read_outcome
    assert events == [("writer", "lost")]
