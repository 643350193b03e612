"""Stories for the per-link TCP proxies of the Jepsen nemesis: real sockets on
loopback with in-test trio servers, cut, heal and reset while bytes move."""

from __future__ import annotations

from functools import partial

import pytest
import trio

from sim.jepsen.proxy import LinkProxy, ProxyMesh
from tests.support import wait_until_async

# How long a held direction must stay quiet to count as held. This is the only
# use of time as evidence; everything else waits for a condition.
HOLD_CHECK_S = 0.15
# A condition that does not come true within this long fails the test.
DEADLINE_S = 2.0
POLL_S = 0.001


class Server:
    """A loopback server that records what it receives and counts the
    connections it accepts and sees closed; it echoes unless told not to, and
    may close each connection at once."""

    def __init__(self, *, echo: bool = True, close_at_once: bool = False) -> None:
        self.echo = echo
        self.close_at_once = close_at_once
        self.received = bytearray()
        self.connections_accepted = 0
        self.connections_ended = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections_accepted += 1
        try:
            if self.close_at_once:
                return
            async for data in stream:
                self.received += data
                if self.echo:
                    await stream.send_all(data)
        except trio.BrokenResourceError:
            pass
        finally:
            self.connections_ended += 1


async def start_server(nursery: trio.Nursery, server: Server) -> int:
    listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1]


async def start_proxy(nursery: trio.Nursery, target_port: int, **options) -> LinkProxy:
    proxy = LinkProxy("127.0.0.1", target_port, name="client-1->bookie-1", **options)
    port = await nursery.start(proxy.run)
    assert port == proxy.port
    return proxy


class Clients:
    """The client streams a test opens, all closed when it ends."""

    def __init__(self) -> None:
        self.streams: list[trio.SocketStream] = []

    async def connect(self, port: int) -> trio.SocketStream:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        self.streams.append(stream)
        return stream


@pytest.fixture
async def clients():
    opened = Clients()
    yield opened
    for stream in opened.streams:
        await trio.aclose_forcefully(stream)


async def wait_until(predicate) -> None:
    await wait_until_async(predicate, deadline_s=DEADLINE_S, what="the proxy's state", poll_s=POLL_S)


async def comes_true_within_hold_check(predicate) -> bool:
    with trio.move_on_after(HOLD_CHECK_S):
        await wait_until(predicate)
        return True
    return False


async def receive_exactly(stream: trio.SocketStream, byte_count: int) -> bytes:
    data = bytearray()
    with trio.fail_after(DEADLINE_S):
        while len(data) < byte_count:
            chunk = await stream.receive_some(byte_count - len(data))
            assert chunk, f"stream ended after {len(data)} of {byte_count} bytes"
            data += chunk
    return bytes(data)


async def receives_nothing_within_hold_check(stream: trio.SocketStream) -> bool:
    with trio.move_on_after(HOLD_CHECK_S):
        data = await stream.receive_some()
        raise AssertionError(f"a held direction delivered {data!r}")
    return True


async def round_trip(stream: trio.SocketStream, message: bytes) -> None:
    await stream.send_all(message)
    assert await receive_exactly(stream, len(message)) == message


async def sees_the_end(stream: trio.SocketStream) -> bool:
    """True once the stream ends (EOF or a reset); fails past the deadline."""
    with trio.fail_after(DEADLINE_S):
        try:
            while await stream.receive_some():
                pass
        except trio.BrokenResourceError:
            pass
    return True


def parse_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


# Bytes go through both ways, small and large, and the stats count them.
async def test_bytes_go_through_both_ways(nursery, clients):
    server = Server()
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    client = await clients.connect(proxy.port)
    await round_trip(client, b"hello bookie")
    large = bytes(range(256)) * 4096  # 1 MiB, many chunks each way
    async with trio.open_nursery() as senders:
        senders.start_soon(client.send_all, large)
        assert await receive_exactly(client, len(large)) == large
    total_bytes = len(b"hello bookie") + len(large)
    await wait_until(lambda: proxy.stats().bytes_from_target == total_bytes)
    stats = proxy.stats()
    assert stats.bytes_to_target == total_bytes
    assert (stats.connections_open, stats.connections_accepted, stats.connections_waiting) == (1, 1, 0)
    assert not proxy.is_cut and proxy.cut_direction is None


# A cut holds bytes both ways; the heal delivers them complete and in order.
async def test_cut_holds_bytes_until_heal(nursery, clients):
    server = Server()
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    client = await clients.connect(proxy.port)
    await round_trip(client, b"before the cut;")
    proxy.cut()
    assert proxy.is_cut and proxy.cut_direction == "both"
    messages = [b"first;", b"second;", b"third;"]
    for message in messages:
        await client.send_all(message)
    assert await receives_nothing_within_hold_check(client)
    assert bytes(server.received) == b"before the cut;"
    assert proxy.stats().bytes_held_to_target == len(b"".join(messages))
    proxy.heal()
    assert not proxy.is_cut
    expected = b"".join(messages)
    assert await receive_exactly(client, len(expected)) == expected
    assert bytes(server.received) == b"before the cut;" + expected


# Cut towards the target only: the request is held, nothing reaches the server.
async def test_cut_to_target_holds_the_request(nursery, clients):
    server = Server()
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    client = await clients.connect(proxy.port)
    await round_trip(client, b"ping;")
    proxy.cut("to_target")
    assert (proxy.cut_to_target, proxy.cut_from_target, proxy.cut_direction) == (True, False, "to_target")
    await client.send_all(b"request;")
    assert not await comes_true_within_hold_check(lambda: len(server.received) > len(b"ping;"))
    proxy.heal()
    assert await receive_exactly(client, len(b"request;")) == b"request;"
    assert bytes(server.received) == b"ping;request;"


# Cut from the target only: the request reaches the server, its reply is held.
async def test_cut_from_target_holds_the_reply(nursery, clients):
    server = Server()
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    client = await clients.connect(proxy.port)
    await round_trip(client, b"ping;")
    proxy.cut("from_target")
    assert proxy.cut_direction == "from_target"
    await client.send_all(b"request;")
    await wait_until(lambda: bytes(server.received) == b"ping;request;")
    assert await receives_nothing_within_hold_check(client)
    await wait_until(lambda: proxy.stats().bytes_held_from_target == len(b"request;"))
    proxy.heal()
    assert await receive_exactly(client, len(b"request;")) == b"request;"


# A cut in either direction adds to what is cut; one heal clears both.
async def test_cuts_add_up_and_heal_clears_them(nursery, clients):
    server = Server()
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    proxy.cut("to_target")
    proxy.cut("from_target")
    assert proxy.cut_direction == "both"
    proxy.heal()
    assert proxy.cut_direction is None
    with pytest.raises(ValueError):
        proxy.cut("sideways")


# A connection made during a cut (in any direction) reaches the target only after the heal.
@pytest.mark.parametrize("direction", ["both", "to_target", "from_target"])
async def test_new_connection_during_cut_waits_for_heal(nursery, clients, direction):
    server = Server()
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    proxy.cut(direction)
    client = await clients.connect(proxy.port)  # the proxy's listener accepts it at once
    await client.send_all(b"first request;")
    assert not await comes_true_within_hold_check(lambda: server.connections_accepted > 0)
    stats = proxy.stats()
    assert (stats.connections_waiting, stats.connections_accepted) == (1, 1)
    assert stats.bytes_held_to_target == len(b"first request;")
    proxy.heal()
    await wait_until(lambda: server.connections_accepted == 1)
    assert await receive_exactly(client, len(b"first request;")) == b"first request;"
    assert proxy.stats().connections_waiting == 0


# A client that gives up while its connection is held is never connected to the target.
async def test_client_leaving_during_cut_is_not_connected(nursery, clients):
    server = Server()
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    proxy.cut()
    client = await clients.connect(proxy.port)
    await client.aclose()
    await wait_until(lambda: proxy.stats().connections_open == 0)
    proxy.heal()
    # A later connection is served, and it is the only one the server saw.
    second_client = await clients.connect(proxy.port)
    await round_trip(second_client, b"hello;")
    assert server.connections_accepted == 1


# Reset closes every open connection at once; a new connection works afterwards.
async def test_reset_closes_open_connections(nursery, clients):
    server = Server()
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    streams = [await clients.connect(proxy.port) for _ in range(2)]
    for client in streams:
        await round_trip(client, b"hello;")
    assert proxy.reset() == 2
    for client in streams:
        assert await sees_the_end(client)
    await wait_until(lambda: server.connections_ended == 2)
    await wait_until(lambda: proxy.stats().connections_open == 0)
    new_client = await clients.connect(proxy.port)
    await round_trip(new_client, b"after the reset;")
    assert proxy.stats().connections_accepted == 3


# Reset also closes a connection that a cut holds before it reached the target.
async def test_reset_closes_held_connections(nursery, clients):
    server = Server()
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    proxy.cut()
    client = await clients.connect(proxy.port)
    await wait_until(lambda: proxy.stats().connections_waiting == 1)
    assert proxy.reset() == 1
    assert await sees_the_end(client)
    proxy.heal()
    assert server.connections_accepted == 0


# While cut, a direction holds at most buffer_bytes_max: the proxy stops
# reading the client, and after the heal every byte arrives in order.
async def test_hold_bound_stops_reading(nursery, clients):
    buffer_bytes_max = 16 * 1024
    server = Server(echo=False)
    proxy = await start_proxy(
        nursery, await start_server(nursery, server), buffer_bytes_max=buffer_bytes_max, chunk_bytes_max=4 * 1024
    )
    client = await clients.connect(proxy.port)
    await wait_until(lambda: server.connections_accepted == 1)
    proxy.cut("to_target")
    payload = bytes(range(251)) * 4096  # about 1 MiB, far past the bound
    nursery.start_soon(client.send_all, payload)
    held_bytes_seen_max = 0

    def held_bytes() -> int:
        nonlocal held_bytes_seen_max
        held = proxy.stats().bytes_held_to_target
        held_bytes_seen_max = max(held_bytes_seen_max, held)
        return held

    await wait_until(lambda: held_bytes() >= buffer_bytes_max)
    # Keep watching for a while: the proxy must not read on past the bound.
    assert not await comes_true_within_hold_check(lambda: held_bytes() > buffer_bytes_max)
    assert held_bytes_seen_max == buffer_bytes_max
    assert not server.received
    proxy.heal()
    await wait_until(lambda: len(server.received) == len(payload))
    assert bytes(server.received) == payload


# A target that drops the connection closes the client side too.
async def test_target_closing_closes_the_client(nursery, clients):
    server = Server(close_at_once=True)
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    client = await clients.connect(proxy.port)
    assert await sees_the_end(client)
    await wait_until(lambda: proxy.stats().connections_open == 0)


# A target that refuses the connection closes the client side too.
async def test_target_refusing_closes_the_client(nursery, clients):
    # A port that was just free and has no listener now: connecting is refused.
    with trio.socket.socket() as placeholder:
        await placeholder.bind(("127.0.0.1", 0))
        refused_port = placeholder.getsockname()[1]
    proxy = await start_proxy(nursery, refused_port)
    client = await clients.connect(proxy.port)
    assert await sees_the_end(client)
    await wait_until(lambda: proxy.stats().connections_open == 0)


# A client that closes its connection closes the target side too.
async def test_client_closing_closes_the_target(nursery, clients):
    server = Server()
    proxy = await start_proxy(nursery, await start_server(nursery, server))
    client = await clients.connect(proxy.port)
    await round_trip(client, b"hello;")
    await client.aclose()
    await wait_until(lambda: server.connections_ended == 1)
    await wait_until(lambda: proxy.stats().connections_open == 0)


# Cancelling the proxy closes its connections and leaves no task behind.
async def test_cancel_closes_everything(clients):
    server = Server()
    async with trio.open_nursery() as servers:
        server_port = await start_server(servers, server)
        with trio.CancelScope() as proxy_scope:
            async with trio.open_nursery() as proxies:
                proxy = await start_proxy(proxies, server_port)
                client = await clients.connect(proxy.port)
                await round_trip(client, b"hello;")
                proxy.cut()
                held_client = await clients.connect(proxy.port)
                await wait_until(lambda: proxy.stats().connections_waiting == 1)
                proxy_scope.cancel()
        # The proxy's nursery has exited, so none of its tasks is left.
        assert proxy.stats().connections_open == 0
        assert await sees_the_end(client)
        assert await sees_the_end(held_client)
        await wait_until(lambda: server.connections_ended == 1)
        servers.cancel_scope.cancel()


# Cutting one (client, bookie) link of a mesh leaves the other links flowing.
async def test_mesh_cut_of_one_link_leaves_others_flowing(nursery, clients):
    bookie_1, bookie_2 = Server(), Server()
    bookie_ports = {
        "bookie-1": await start_server(nursery, bookie_1),
        "bookie-2": await start_server(nursery, bookie_2),
    }
    links = {
        (client, bookie): ("127.0.0.1", bookie_ports[bookie])
        for client in ("client-1", "client-2")
        for bookie in ("bookie-1", "bookie-2")
    }
    mesh = ProxyMesh(links)
    addresses = await nursery.start(mesh.run)
    assert set(addresses) == set(links)
    assert addresses[("client-1", "bookie-1")] == mesh.address("client-1", "bookie-1")
    assert len({parse_address(address)[1] for address in addresses.values()}) == len(links)
    streams = {link: await clients.connect(parse_address(mesh.address(*link))[1]) for link in links}
    for link, stream in streams.items():
        await round_trip(stream, f"hello from {link};".encode())

    mesh.cut("client-1", ["bookie-1"])
    assert mesh.partitions() == {("client-1", "bookie-1"): "both"}
    cut_stream = streams[("client-1", "bookie-1")]
    await cut_stream.send_all(b"held;")
    for link, stream in streams.items():
        if link != ("client-1", "bookie-1"):
            await round_trip(stream, b"still flowing;")
    assert await receives_nothing_within_hold_check(cut_stream)

    mesh.heal()
    assert mesh.partitions() == {}
    assert await receive_exactly(cut_stream, len(b"held;")) == b"held;"


# The mesh names links by client and bookie: all of a client's links at once,
# one direction, heal by client, reset, and clear errors for wrong names.
async def test_mesh_operations_by_client(nursery, clients):
    bookie_port = await start_server(nursery, Server())
    links = {(client, bookie): ("127.0.0.1", bookie_port) for client in ("c1", "c2") for bookie in ("b1", "b2")}
    mesh = ProxyMesh(links)
    await nursery.start(mesh.run)
    mesh.cut("c1", direction="from_target")
    mesh.cut("c2", ["b2"], direction="to_target")
    assert mesh.partitions() == {("c1", "b1"): "from_target", ("c1", "b2"): "from_target", ("c2", "b2"): "to_target"}
    mesh.heal("c1")
    assert mesh.partitions() == {("c2", "b2"): "to_target"}
    mesh.heal()
    assert mesh.partitions() == {}

    stream = await clients.connect(parse_address(mesh.address("c2", "b1"))[1])
    await round_trip(stream, b"hello;")
    assert mesh.reset("c2", ["b1"]) == 1
    assert await sees_the_end(stream)
    assert mesh.stats()[("c2", "b1")].connections_accepted == 1

    with pytest.raises(ValueError):
        mesh.cut("c3", ["b1"])
    with pytest.raises(ValueError):
        mesh.address("c1", "b3")
    with pytest.raises(TypeError):
        mesh.cut("c1", "b1")
