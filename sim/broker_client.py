"""What the simulated producers and consumers share, as `broker/client`
does: one connection to the broker serving the partition, found by asking
any broker (a NOT_OWNER answer names the owner), reconnection with backoff
and jitter after a broken connection or a partition that moved, and
requests with ids that fail when their connection breaks. A connection
left behind (the broker closed our producer or consumer on it) stays open
until the requests still waiting on it are answered, as the real client's
shared connection does."""

from __future__ import annotations

from typing import Any, Callable

from broker.client.backoff import Backoff
from broker.errors import BrokerStatus
from sim.broker_links import Connection, LinkedNode, Links
from sim.broker_messages import Closed, Response
from sim.network import Network
from sim.world import World

# What makes a client look the partition up again and resend (RECONNECT_ERRORS).
RECONNECT_STATUSES = (BrokerStatus.TOPIC_FENCED, BrokerStatus.NOT_OWNER, BrokerStatus.SERVICE_UNAVAILABLE,
                      BrokerStatus.PRODUCER_BUSY, BrokerStatus.CONSUMER_BUSY, BrokerStatus.ERROR)
REDIRECT_MS = 1.0  # a lookup answered with the owner: ask it at once

OnResponse = Callable[[Response | None], None]  # None: the connection broke first


class SimBrokerClient(LinkedNode):
    def __init__(self, name: str, world: World, network: Network, links: Links, brokers: list[str]) -> None:
        super().__init__(name, world, network, links)
        self.brokers = brokers
        self.reconnects = 0
        self._backoff = Backoff(world.rng)
        self._next_id = 1
        self.handle = 0

    def start(self) -> None:
        super().start()
        self.connection: Connection | None = None
        self.connected = False  # opened (producer open or subscribe answered OK) on `connection`
        self._hint: str | None = None
        self._requests: dict[int, tuple[Connection, OnResponse]] = {}
        self._reconnect_scheduled = False
        self.after(self.world.uniform(0, 10), self._connect)

    def crash(self) -> None:
        super().crash()
        self.connection = None
        self.connected = False

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # --- connecting ---------------------------------------------------------------------

    def _connect(self) -> None:
        self._reconnect_scheduled = False
        if self.connection is not None:
            return
        broker = self._hint or self.world.rng.choice(self.brokers)
        self._hint = None
        connection = self.connection = self.links.connect(self.name, broker)
        self.handle = self.new_id()
        self.request(connection, self.open_request, lambda response: self._opened(connection, response))

    def open_request(self, request_id: int) -> Any:
        """The producer-open or subscribe request for a new connection."""
        raise NotImplementedError

    def _opened(self, connection: Connection, response: Response | None) -> None:
        if connection is not self.connection:
            return
        if response is not None and response.status is BrokerStatus.OK:
            self.connected = True
            self._backoff.reset()
            self.on_connected(response)
            return
        if response is not None and response.status is BrokerStatus.NOT_OWNER and response.owner:
            self._hint = response.owner
            self.lost(REDIRECT_MS)
        else:
            self.lost()

    def on_connected(self, response: Response) -> None:
        raise NotImplementedError

    def lost(self, delay_ms: float | None = None) -> None:
        """Our producer or consumer is gone from its connection: look the
        partition up again after a backoff."""
        connection, self.connection = self.connection, None
        self.connected = False
        if connection is not None:
            self._leave(connection)
        if not self._reconnect_scheduled:
            self._reconnect_scheduled = True
            self.reconnects += 1
            self.after(self._backoff.next_delay_s() * 1000.0 if delay_ms is None else delay_ms, self._connect)

    def _leave(self, connection: Connection) -> None:
        if connection.open and not any(waiting is connection for waiting, _ in self._requests.values()):
            self.links.break_connection(connection, f"closed by {self.name}")

    # --- requests ---------------------------------------------------------------------------

    def request(self, connection: Connection, make: Callable[[int], Any], on_response: OnResponse) -> None:
        request_id = self.new_id()
        self._requests[request_id] = (connection, on_response)
        self.links.send(connection, self.name, make(request_id))

    def receive(self, connection: Connection, message: Any) -> None:
        if isinstance(message, Response):
            pending = self._requests.pop(message.request_id, None)
            if pending is not None:
                pending[1](message)
                if connection is not self.connection:
                    self._leave(connection)
            return
        if connection is not self.connection:
            return  # for a producer or consumer since replaced
        if isinstance(message, Closed):
            if message.handle == self.handle:
                self.lost()
            return
        self.on_message(message)

    def on_message(self, message: Any) -> None:
        raise NotImplementedError

    def connection_closed(self, connection: Connection) -> None:
        failed = [request_id for request_id, (waiting, _) in self._requests.items() if waiting is connection]
        for request_id in failed:
            _, on_response = self._requests.pop(request_id)
            on_response(None)
        if connection is self.connection:
            self.lost()

    @property
    def requests_waiting(self) -> int:
        return len(self._requests)
