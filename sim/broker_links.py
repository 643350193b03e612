"""Connections between simulated broker clients and brokers, as TCP gives
them: messages arrive in the order sent and never twice, each after its own
delay (later ones wait for earlier ones); a connection breaks (a reset, a
partition that outlasts retransmission, a crashed peer) and then loses what
it still carried, and each end hears of the break. A paused node reads what
arrived for it, in order, once it runs again.

The loss, delay and partition settings are those of `sim.network.Network`,
which also carries the brokers' ZooKeeper traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from sim.network import CONNECTION_LOSS_MS_MAX, Network, describe
from sim.node import SimNode
from sim.world import World


class Endpoint(Protocol):
    name: str
    incarnation: int
    up: bool
    paused: bool

    def receive(self, connection: "Connection", message: Any) -> None: ...

    def connection_closed(self, connection: "Connection") -> None: ...


class LinkedNode(SimNode):
    """A simulated process with connections: a crash breaks every one of
    them, and a paused one reads what arrived once it runs again."""

    def __init__(self, name: str, world: World, network: Network, links: "Links") -> None:
        super().__init__(name, world, network)
        self.links = links
        self.restarts = 0
        links.add(self)

    def restart(self) -> None:
        self.restarts += 1
        self.start()

    def crash(self) -> None:
        super().crash()
        self.links.crashed(self.name)
        self.world.log(f"{self.name} crashed")

    def resume(self) -> None:
        super().resume()
        self.links.resumed(self.name)


@dataclass(eq=False)
class Connection:
    connection_id: int
    client: str
    broker: str
    incarnations: dict[str, int]  # each end's incarnation when it opened
    open: bool = True
    last_arrival_ms: dict[str, float] = field(default_factory=dict)  # per destination

    def peer_of(self, name: str) -> str:
        return self.broker if name == self.client else self.client

    def __str__(self) -> str:
        return f"c{self.connection_id}"


class Links:
    def __init__(self, world: World, network: Network, *, break_probability: float = 0.0) -> None:
        self.world = world
        self.network = network
        self.break_probability = break_probability  # per message sent: the connection resets
        self._endpoints: dict[str, Endpoint] = {}
        self._connections: dict[str, dict[int, Connection]] = {}  # node -> its open connections
        self._held: dict[str, list[tuple[Connection, str, Any]]] = {}  # what waits for a paused node
        self._next_id = 1
        self.sent = 0
        self.breaks = 0

    def add(self, endpoint: Endpoint) -> None:
        self._endpoints[endpoint.name] = endpoint
        self._connections.setdefault(endpoint.name, {})

    # --- opening and closing ------------------------------------------------------------

    def connect(self, client: str, broker: str) -> Connection:
        """Open a connection; if the broker is down it breaks at once (the
        client hears of it after a moment, as of a refused connect)."""
        incarnations = {name: self._endpoints[name].incarnation for name in (client, broker)}
        connection = Connection(self._next_id, client, broker, incarnations)
        self._next_id += 1
        self._connections[client][connection.connection_id] = connection
        self._connections[broker][connection.connection_id] = connection
        self.world.log(f"{client} connects to {broker} ({connection})")
        if not self._endpoints[broker].up:
            self.break_connection(connection, "connection refused")
        return connection

    def break_connection(self, connection: Connection, why: str) -> None:
        """The connection is gone; both ends hear of it after a moment
        (what is still on its way is lost)."""
        if not connection.open:
            return
        connection.open = False
        self.breaks += 1
        self.world.log(f"{connection} {connection.client}-{connection.broker} breaks: {why}")
        for name in (connection.client, connection.broker):
            self._connections[name].pop(connection.connection_id, None)
            delay_ms = self.world.uniform(0.1, CONNECTION_LOSS_MS_MAX)
            self.world.after(delay_ms, self._arrive, connection, name, None, connection.incarnations[name], True)

    def crashed(self, name: str) -> None:
        """`name` crashed: every connection it had breaks."""
        for connection in sorted(self._connections[name].values(), key=lambda c: c.connection_id):
            self.break_connection(connection, f"{name} crashed")
        self._held.pop(name, None)

    def resumed(self, name: str) -> None:
        """A paused node runs again: it reads what arrived meanwhile, in order."""
        endpoint = self._endpoints[name]
        for connection, source, message in self._held.pop(name, []):
            if not (endpoint.up and not endpoint.paused):
                break
            self._hand_over(endpoint, connection, source, message)

    # --- sending ------------------------------------------------------------------------

    def send(self, connection: Connection, source: str, message: Any) -> None:
        if not connection.open:
            return  # the sender hears of the break, if it has not yet
        self.sent += 1
        world, network = self.world, self.network
        destination = connection.peer_of(source)
        if world.chance(self.break_probability):
            self.break_connection(connection, "reset")
            return
        # In order: a message never overtakes one sent before it.
        arrival_ms = max(world.now_ms + network.message_delay_ms(source, destination),
                         connection.last_arrival_ms.get(destination, 0.0))
        connection.last_arrival_ms[destination] = arrival_ms
        world.at(arrival_ms, self._arrive, connection, destination, message, connection.incarnations[destination], False)

    def _arrive(self, connection: Connection, destination: str, message: Any, incarnation: int, closing: bool) -> None:
        endpoint = self._endpoints[destination]
        if not endpoint.up or endpoint.incarnation != incarnation:
            return
        if not closing:
            if not connection.open:
                return
            source = connection.peer_of(destination)
            if (source, destination) in self.network.blocked:
                # Retransmissions across the partition time out.
                self.break_connection(connection, "partitioned")
                return
        else:
            source = connection.peer_of(destination)
        if endpoint.paused:
            self._held.setdefault(destination, []).append((connection, source, None if closing else message))
            return
        self._hand_over(endpoint, connection, source, None if closing else message)

    def _hand_over(self, endpoint: Endpoint, connection: Connection, source: str, message: Any) -> None:
        if message is None:
            endpoint.connection_closed(connection)
            return
        if not connection.open:
            return
        self.world.log(f"{source}>{endpoint.name} {connection} {describe(message)}")
        endpoint.receive(connection, message)
