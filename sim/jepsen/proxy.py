"""Per-link TCP proxies through which a Jepsen run partitions one client from
some bookies without root: the nemesis cuts a direction (bytes and new
connections are held, nothing is closed), heals it, or resets every connection."""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import partial

import trio

log = logging.getLogger(__name__)

TO_TARGET = "to_target"
FROM_TARGET = "from_target"
BOTH = "both"
DIRECTIONS = (BOTH, TO_TARGET, FROM_TARGET)

CHUNK_BYTES_MAX = 64 * 1024
# Per direction of each connection. A bookie add is a few KiB, so this holds a
# good backlog of requests during a cut while a mesh of 10 clients x 5 bookies
# stays under about 30 MiB even if every link is full both ways.
BUFFER_BYTES_MAX = 256 * 1024

# SO_LINGER on with a zero timeout makes close() send an RST instead of a FIN.
_LINGER_RESET = struct.pack("ii", 1, 0)


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """What a proxy has done so far, for the nemesis log. Bytes forwarded are
    bytes delivered to the far side; held bytes wait for a heal (or for a slow
    reader: when nothing is cut they are just the proxy's own buffering)."""

    bytes_to_target: int
    bytes_from_target: int
    bytes_held_to_target: int
    bytes_held_from_target: int
    connections_open: int
    connections_waiting: int  # accepted, not yet connected to the target (a cut holds them there)
    connections_accepted: int


class _HeldBytes:
    """One direction of one connection: the bytes read from the source that
    the destination has not yet received, and whether the source has ended."""

    __slots__ = ("direction", "data", "source_ended")

    def __init__(self, direction: str) -> None:
        self.direction = direction
        self.data = bytearray()
        self.source_ended = False


class _Connection:
    """One client connection through the proxy and the target connection it
    gets once no cut holds it."""

    def __init__(self, number: int, client_stream: trio.SocketStream) -> None:
        self.number = number
        self.client_stream = client_stream
        self.target_stream: trio.SocketStream | None = None
        self.to_target = _HeldBytes(TO_TARGET)
        self.from_target = _HeldBytes(FROM_TARGET)
        # Every wait in this connection's tasks parks here; anything that may
        # change what they wait for (bytes held or delivered, a source ending,
        # a cut or heal) wakes them all and each checks its own condition.
        self.changed = trio.lowlevel.ParkingLot()
        self.cancel_scope = trio.CancelScope()
        self.was_reset = False

    def reset(self) -> None:
        self.was_reset = True
        for stream in (self.client_stream, self.target_stream):
            if stream is None:
                continue
            try:
                stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            except OSError:
                # Already closed or broken: the close that follows ends it either way.
                pass
        self.cancel_scope.cancel()


class LinkProxy:
    """A TCP proxy for one (client, bookie) link. `run` serves until cancelled;
    `cut`, `heal` and `reset` are called from a task of the same trio run."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        name: str,
        listen_host: str = "127.0.0.1",
        buffer_bytes_max: int = BUFFER_BYTES_MAX,
        chunk_bytes_max: int = CHUNK_BYTES_MAX,
    ) -> None:
        if buffer_bytes_max < 1:
            raise ValueError(f"buffer_bytes_max must be at least 1, not {buffer_bytes_max}")
        if chunk_bytes_max < 1:
            raise ValueError(f"chunk_bytes_max must be at least 1, not {chunk_bytes_max}")
        self.target_host = target_host
        self.target_port = target_port
        self.name = name
        self.listen_host = listen_host
        self.buffer_bytes_max = buffer_bytes_max
        self.chunk_bytes_max = chunk_bytes_max
        self.port: int | None = None
        self._running = False
        self._cut_to_target = False
        self._cut_from_target = False
        self._connections: set[_Connection] = set()
        self._connections_accepted = 0
        self._bytes_to_target = 0
        self._bytes_from_target = 0

    # -- the nemesis side ---------------------------------------------------

    @property
    def is_cut(self) -> bool:
        return self._cut_to_target or self._cut_from_target

    @property
    def cut_to_target(self) -> bool:
        return self._cut_to_target

    @property
    def cut_from_target(self) -> bool:
        return self._cut_from_target

    @property
    def cut_direction(self) -> str | None:
        """"both", "to_target", "from_target", or None when nothing is cut."""
        if self._cut_to_target and self._cut_from_target:
            return BOTH
        if self._cut_to_target:
            return TO_TARGET
        if self._cut_from_target:
            return FROM_TARGET
        return None

    def cut(self, direction: str = BOTH) -> None:
        """Stop bytes moving in `direction` (added to whatever is cut already)
        and hold new connections until `heal`."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
        if direction in (BOTH, TO_TARGET):
            self._cut_to_target = True
        if direction in (BOTH, FROM_TARGET):
            self._cut_from_target = True
        log.debug("proxy %s: cut %s (now %s)", self.name, direction, self.cut_direction)
        self._wake_all()

    def heal(self) -> None:
        """Let bytes move both ways again: held bytes go out in order and
        held connections are connected to the target."""
        was = self.cut_direction
        self._cut_to_target = False
        self._cut_from_target = False
        log.debug("proxy %s: heal (was %s)", self.name, was)
        self._wake_all()

    def reset(self) -> int:
        """Close every current connection on both sides with an RST, at once;
        new connections are served as usual. Returns how many were closed."""
        connections = list(self._connections)
        for connection in connections:
            connection.reset()
        log.debug("proxy %s: reset %d connections", self.name, len(connections))
        return len(connections)

    def stats(self) -> ProxyStats:
        return ProxyStats(
            bytes_to_target=self._bytes_to_target,
            bytes_from_target=self._bytes_from_target,
            bytes_held_to_target=sum(len(connection.to_target.data) for connection in self._connections),
            bytes_held_from_target=sum(len(connection.from_target.data) for connection in self._connections),
            connections_open=len(self._connections),
            connections_waiting=sum(1 for connection in self._connections if connection.target_stream is None),
            connections_accepted=self._connections_accepted,
        )

    def _direction_is_cut(self, direction: str) -> bool:
        return self._cut_to_target if direction == TO_TARGET else self._cut_from_target

    def _wake_all(self) -> None:
        for connection in self._connections:
            connection.changed.unpark_all()

    # -- serving ------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on an ephemeral port, report it through `task_status` (and
        `self.port`), and proxy every connection until cancelled."""
        if self._running:
            raise RuntimeError(f"proxy {self.name} is already running")
        listeners = await trio.open_tcp_listeners(0, host=self.listen_host)
        if len(listeners) != 1:
            for listener in listeners:
                await trio.aclose_forcefully(listener)
            raise ValueError(
                f"listen_host {self.listen_host!r} names {len(listeners)} addresses; "
                "give one numeric address so the proxy has one port"
            )
        listener = listeners[0]
        self._running = True
        try:
            async with trio.open_nursery() as nursery:
                self.port = listener.socket.getsockname()[1]
                nursery.start_soon(
                    partial(trio.serve_listeners, self._serve_connection, listeners, handler_nursery=nursery)
                )
                log.debug(
                    "proxy %s: %s:%d -> %s:%d",
                    self.name, self.listen_host, self.port, self.target_host, self.target_port,
                )
                task_status.started(self.port)
        finally:
            self._running = False
            # serve_listeners closes it too, unless cancelled before it began.
            await trio.aclose_forcefully(listener)

    async def _serve_connection(self, client_stream: trio.SocketStream) -> None:
        self._connections_accepted += 1
        connection = _Connection(self._connections_accepted, client_stream)
        self._connections.add(connection)
        log.debug("proxy %s: connection %d accepted", self.name, connection.number)
        try:
            with connection.cancel_scope:
                async with trio.open_nursery() as nursery:
                    # Read the client from the start, so a client that leaves
                    # while a cut holds its connection is noticed.
                    nursery.start_soon(self._read, connection, client_stream, connection.to_target)
                    target_stream = await self._connect(connection)
                    if target_stream is None:
                        connection.cancel_scope.cancel()
                        return
                    connection.target_stream = target_stream
                    nursery.start_soon(self._deliver, connection, target_stream, connection.to_target)
                    nursery.start_soon(self._read, connection, target_stream, connection.from_target)
                    nursery.start_soon(self._deliver, connection, client_stream, connection.from_target)
        finally:
            self._connections.discard(connection)
            if connection.target_stream is not None:
                await trio.aclose_forcefully(connection.target_stream)
            await trio.aclose_forcefully(client_stream)
            log.debug(
                "proxy %s: connection %d closed%s",
                self.name, connection.number, " (reset)" if connection.was_reset else "",
            )

    async def _connect(self, connection: _Connection) -> trio.SocketStream | None:
        """The target connection, once no cut holds it; None when the client
        left during the cut or the target refused."""
        if self.is_cut:
            log.debug("proxy %s: connection %d held by the cut", self.name, connection.number)
        # Either cut direction stops a real handshake (the SYN or its answer
        # is lost), so any cut holds the connect.
        while self.is_cut:
            if connection.to_target.source_ended:
                log.debug("proxy %s: connection %d left before the heal", self.name, connection.number)
                return None
            await connection.changed.park()
        try:
            target_stream = await trio.open_tcp_stream(self.target_host, self.target_port)
        except OSError as error:
            log.debug("proxy %s: connection %d: target refused: %s", self.name, connection.number, error)
            return None
        log.debug("proxy %s: connection %d connected to the target", self.name, connection.number)
        return target_stream

    async def _read(self, connection: _Connection, source: trio.SocketStream, held: _HeldBytes) -> None:
        """Read the source into `held`, never past `buffer_bytes_max`: when it
        is full the source is left unread and TCP back-pressure stops the sender."""
        try:
            while True:
                while len(held.data) >= self.buffer_bytes_max:
                    await connection.changed.park()
                room_bytes = self.buffer_bytes_max - len(held.data)
                data = await source.receive_some(min(self.chunk_bytes_max, room_bytes))
                if not data:
                    break
                held.data += data
                connection.changed.unpark_all()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            log.debug(
                "proxy %s: connection %d: %s source broke: %r", self.name, connection.number, held.direction, error
            )
        # The end of the stream is delivered after the bytes before it, like a
        # FIN that waits behind held segments.
        held.source_ended = True
        connection.changed.unpark_all()

    async def _deliver(self, connection: _Connection, destination: trio.SocketStream, held: _HeldBytes) -> None:
        """Send `held` on to the destination while its direction is not cut;
        once the source has ended and everything is delivered, or the
        destination breaks, close the whole connection."""
        try:
            while True:
                while self._direction_is_cut(held.direction) or not (held.data or held.source_ended):
                    await connection.changed.park()
                if not held.data:
                    log.debug("proxy %s: connection %d: %s source ended", self.name, connection.number, held.direction)
                    break
                chunk = bytes(held.data[: self.chunk_bytes_max])
                await destination.send_all(chunk)
                # Removed only once sent, so stats count bytes in a send as held.
                del held.data[: len(chunk)]
                if held.direction == TO_TARGET:
                    self._bytes_to_target += len(chunk)
                else:
                    self._bytes_from_target += len(chunk)
                connection.changed.unpark_all()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            log.debug(
                "proxy %s: connection %d: %s destination broke: %r", self.name, connection.number, held.direction, error
            )
        # One side gone closes the other: bookie connections are not half-closed.
        connection.cancel_scope.cancel()


class ProxyMesh:
    """One LinkProxy per (client, bookie) link, run in one nursery, with the
    nemesis operations named by client and bookie."""

    def __init__(
        self,
        links: Mapping[tuple[str, str], tuple[str, int]],
        *,
        listen_host: str = "127.0.0.1",
        buffer_bytes_max: int = BUFFER_BYTES_MAX,
        chunk_bytes_max: int = CHUNK_BYTES_MAX,
    ) -> None:
        self.listen_host = listen_host
        self._proxies: dict[tuple[str, str], LinkProxy] = {}
        for (client, bookie), (host, port) in links.items():
            self._proxies[(client, bookie)] = LinkProxy(
                host,
                port,
                name=f"{client}->{bookie}",
                listen_host=listen_host,
                buffer_bytes_max=buffer_bytes_max,
                chunk_bytes_max=chunk_bytes_max,
            )

    async def run(
        self, *, task_status: trio.TaskStatus[dict[tuple[str, str], str]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start every proxy; once all listen, report `addresses()`; serve
        until cancelled."""
        async with trio.open_nursery() as nursery:
            for proxy in self._proxies.values():
                await nursery.start(proxy.run)
            task_status.started(self.addresses())

    def proxy(self, client: str, bookie: str) -> LinkProxy:
        try:
            return self._proxies[(client, bookie)]
        except KeyError:
            raise ValueError(f"no link from client {client!r} to bookie {bookie!r}") from None

    def address(self, client: str, bookie: str) -> str:
        """Where `client` reaches `bookie`: "host:port" of the link's proxy."""
        proxy = self.proxy(client, bookie)
        if proxy.port is None:
            raise ValueError(f"the proxy for {client!r} -> {bookie!r} is not listening yet")
        return f"{self.listen_host}:{proxy.port}"

    def addresses(self) -> dict[tuple[str, str], str]:
        return {link: self.address(*link) for link in self._proxies}

    def cut(self, client: str, bookies: Iterable[str] | None = None, direction: str = BOTH) -> None:
        """Cut `client` from `bookies` (all of its bookies when None)."""
        for proxy in self._select(client, bookies):
            proxy.cut(direction)

    def heal(self, client: str | None = None) -> None:
        """Heal every link of `client`, or every link when None."""
        if client is None:
            proxies = list(self._proxies.values())
        else:
            proxies = self._select(client, None)
        for proxy in proxies:
            proxy.heal()

    def reset(self, client: str, bookies: Iterable[str] | None = None) -> int:
        """Reset the connections from `client` to `bookies` (all when None);
        returns how many were closed."""
        return sum(proxy.reset() for proxy in self._select(client, bookies))

    def partitions(self) -> dict[tuple[str, str], str]:
        """The links cut now, each with its cut direction."""
        return {
            link: proxy.cut_direction
            for link, proxy in self._proxies.items()
            if proxy.cut_direction is not None
        }

    def stats(self) -> dict[tuple[str, str], ProxyStats]:
        return {link: proxy.stats() for link, proxy in self._proxies.items()}

    def _select(self, client: str, bookies: Iterable[str] | None) -> list[LinkProxy]:
        if isinstance(bookies, str):
            raise TypeError("bookies is a collection of bookie names, not one name")
        if bookies is None:
            proxies = [proxy for (link_client, _), proxy in self._proxies.items() if link_client == client]
            if not proxies:
                raise ValueError(f"no links from client {client!r}")
            return proxies
        return [self.proxy(client, bookie) for bookie in bookies]
