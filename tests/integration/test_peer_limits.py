"""Idle, slow and too many peers, against real bookie and broker processes:
a frame trickled byte by byte is cut off at the frame deadline; connections
past the per-address bound are closed at once and others are served; large
frames wait for the process's frame budget; a silent broker client is
pinged, and closed after two keep-alive intervals unless it answers."""

from __future__ import annotations

import socket
import time

import pytest
import trio

from bench.cluster import rss_mb
from broker.protocol import Ping, Pong, encode
from ledger_client.bookie_client import BookieConnectionError
from sim.frame_fuzz import BOOKIE, BROKER, handshake
from tests.integration.bookie_processes import bookie_takes_an_add
from tests.integration.broker_processes import bookies, brokers  # noqa: F401 (fixtures)
from tests.support import wait_until_async


def _connect(address: str, protocol: str, *, with_handshake: bool = True) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    if with_handshake:
        sock.sendall(handshake(protocol))
        _read_frame(sock)
    return sock


def _read_frame(sock: socket.socket) -> bytes:
    head = _read_exactly(sock, 4)
    return _read_exactly(sock, int.from_bytes(head, "big"))


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the peer closes the connection within `within_s` (reading and
    dropping whatever it sends meanwhile)."""
    sock.settimeout(within_s)
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True
    return False


async def _started(bookies, brokers, protocol: str, *options: str):
    """A bookie, or a broker over three bookies, started with `options`."""
    if protocol == BOOKIE:
        return await bookies.started(*options)
    for _ in range(3):
        await bookies.started()
    return await brokers.started(*options)


@pytest.mark.parametrize("protocol", [BOOKIE, BROKER])
async def test_a_frame_trickled_byte_by_byte_is_cut_off_at_the_frame_deadline(bookies, brokers, protocol):
    process = await _started(bookies, brokers, protocol, "--frame-deadline", "2s")
    sock = await trio.to_thread.run_sync(_connect, process.address, protocol)
    try:
        started = time.monotonic()

        def trickle() -> bool:
            # A frame of 100 bytes, one byte every 0.2 s: it would take 20 s.
            sock.sendall((100).to_bytes(4, "big"))
            for _ in range(100):
                try:
                    sock.sendall(b"\x00")
                except (BrokenPipeError, ConnectionResetError):
                    return True
                if _closed_by_peer(sock, 0.2):
                    return True
            return False

        assert await trio.to_thread.run_sync(trickle), "the trickled frame was never cut off"
        assert time.monotonic() - started < 15  # the frame deadline (2 s), with room for a loaded machine
    finally:
        sock.close()
    assert process.running


@pytest.mark.parametrize("protocol", [BOOKIE, BROKER])
async def test_connections_past_the_per_address_bound_are_closed_and_others_served(bookies, brokers, protocol):
    process = await _started(bookies, brokers, protocol, "--connections-per-ip-max", "5")

    def fill() -> list[socket.socket]:
        # The wait_serving probe's connection may still be closing: allow for it.
        held = []
        for _ in range(5):
            try:
                held.append(_connect(process.address, protocol))
            except ConnectionError:
                break
        return held

    held = await trio.to_thread.run_sync(fill)
    try:
        assert len(held) >= 4
        while len(held) < 5:
            held.append(await trio.to_thread.run_sync(_connect, process.address, protocol))
        extra = await trio.to_thread.run_sync(lambda: _connect(process.address, protocol, with_handshake=False))
        assert await trio.to_thread.run_sync(_closed_by_peer, extra, 5.0), "a sixth connection stayed open"
        extra.close()
        # The five are still served.
        for sock in held:
            sock.settimeout(5)
            if protocol == BROKER:
                sock.sendall(encode(Ping()))
                assert await trio.to_thread.run_sync(_read_frame, sock)
    finally:
        for sock in held:
            sock.close()
    # Once they are gone, new connections are served again.
    if protocol == BOOKIE:
        async def adds() -> bool:
            try:
                await trio.to_thread.run_sync(bookie_takes_an_add, process.address, 1 << 45)
            except BookieConnectionError:
                return False  # the bookie has not yet seen the five close
            return True

        await wait_until_async(adds, deadline_s=10, what="the bookie serving new connections")
    assert process.running


async def test_large_frames_wait_for_the_frame_budget_and_time_out_when_it_stays_spent(bookies):
    # A budget of two frames of 512 KiB: a third connection's large frame
    # waits, and is cut off at the frame deadline while the first two stay
    # unfinished.
    bookie = await bookies.started("--frame-bytes-max", "512KiB", "--frame-buffer-bytes", "1MiB", "--frame-deadline", "3s")

    def start_large_frame() -> socket.socket:
        sock = _connect(bookie.address, BOOKIE)
        sock.sendall((500 * 1024).to_bytes(4, "big") + b"\x95" + b"\x00" * (300 * 1024))
        return sock

    first = await trio.to_thread.run_sync(start_large_frame)
    second = await trio.to_thread.run_sync(start_large_frame)
    third = await trio.to_thread.run_sync(start_large_frame)
    try:
        info = await bookie.wait_serving()
        assert info["frame_buffer_bytes_reserved"] <= 1024 * 1024
        # All three are cut off at their deadline (none could finish), and
        # the budget is whole again afterwards.
        for sock in (first, second, third):
            assert await trio.to_thread.run_sync(_closed_by_peer, sock, 10.0)
        async def budget_whole() -> bool:
            # GET_INFO's counters are refreshed with each disk check (every second).
            return (await bookie.wait_serving())["frame_buffer_bytes_reserved"] == 0

        await wait_until_async(budget_whole, deadline_s=10, what="the frame budget given back")
    finally:
        for sock in (first, second, third):
            sock.close()
    await trio.to_thread.run_sync(bookie_takes_an_add, bookie.address, 1 << 46)


async def test_a_silent_broker_client_is_pinged_and_closed_after_two_intervals(bookies, brokers):
    for _ in range(3):
        await bookies.started()
    broker = await brokers.started("--keepalive-interval", "1s")
    silent = await trio.to_thread.run_sync(_connect, broker.address, BROKER)
    answering = await trio.to_thread.run_sync(_connect, broker.address, BROKER)
    try:
        def answer_pings_for(seconds: float) -> int:
            answering.settimeout(0.5)
            pings = 0
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                try:
                    frame = _read_frame(answering)
                except (socket.timeout, TimeoutError):
                    continue
                if frame == encode(Ping())[4:]:
                    pings += 1
                    answering.sendall(encode(Pong()))
            return pings

        def pinged_then_closed() -> bool:
            silent.settimeout(5)
            assert _read_frame(silent) == encode(Ping())[4:]
            return _closed_by_peer(silent, 5)

        async with trio.open_nursery() as nursery:
            result = {}

            async def watch_silent() -> None:
                result["silent closed"] = await trio.to_thread.run_sync(pinged_then_closed)

            nursery.start_soon(watch_silent)
            result["pings answered"] = await trio.to_thread.run_sync(answer_pings_for, 8.0)
        assert result["silent closed"]
        assert result["pings answered"] >= 2
        # The client that answered is still connected and served.
        answering.settimeout(5)
        answering.sendall(encode(Ping()))
        while (frame := _read_frame(answering)) == encode(Ping())[4:]:
            answering.sendall(encode(Pong()))  # the broker's own keep-alive, crossing ours
        assert frame == encode(Pong())[4:]
    finally:
        silent.close()
        answering.close()
    assert broker.running


async def test_a_client_that_never_reads_its_answers_is_closed_and_holds_little(bookies):
    # A thousand reads of a 1 MiB entry, 40 bytes each on the wire, whose
    # answers the client never reads: the bookie stops reading its requests
    # once the answers waiting pass their bound, closes it when none is
    # taken for the frame deadline, and its memory stays small.
    import msgpack

    from bookie.protocol.entry_format import DigestManager, DigestType, master_key
    from framing.codec import LENGTH_PREFIX
    from ledger_client.bookie_client import BookieClient

    bookie = await bookies.started("--frame-deadline", "2s")
    ledger_id = 1 << 47
    async with BookieClient.connect(bookie.address) as client:
        entry = DigestManager(ledger_id, DigestType.CRC32C, b"pw").encode(0, -1, 1 << 20, b"x" * (1 << 20))
        assert (await client.add(entry, master_key(b"pw"))).status == 0
    rss_before = rss_mb(bookie.process.pid)

    def flood() -> bool:
        sock = _connect(bookie.address, BOOKIE)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            reads = b"".join(_frame([2, number, 0, ledger_id, 0, None, None, None]) for number in range(1_000))
            sock.sendall(reads)
            return _closed_without_reading(sock, within_s=30)
        finally:
            sock.close()

    def _frame(fields) -> bytes:
        body = msgpack.packb(fields, use_bin_type=True)
        return LENGTH_PREFIX.pack(len(body)) + body

    assert await trio.to_thread.run_sync(flood), "the bookie kept a client that reads nothing"
    assert rss_mb(bookie.process.pid) < rss_before + 100
    await trio.to_thread.run_sync(bookie_takes_an_add, bookie.address, ledger_id + 1)


def _closed_without_reading(sock: socket.socket, within_s: float) -> bool:
    """Whether the peer closes a connection whose data we leave unread
    (its FIN or reset, seen with poll, not by reading)."""
    import select

    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(within_s * 1000))
