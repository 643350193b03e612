"""ZooKeeper in the simulator: the in-memory metadata server as a network
node. A call is a function run against the caller's session when the
request arrives (the linearization point); the reply travels back and may
be lost, so the caller can be left not knowing whether a write happened.
Sessions live on pings: a partitioned, paused or crashed node's session
expires and its ephemeral nodes (bookie registrations) go."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from coordination.memory_store import InMemoryMetadataServer, InMemoryMetadataStore
from coordination.store import ConnectionLossError, MetadataError
from ledger_client.errors import BKError
from sim.network import Network
from sim.node import SimNode
from sim.world import World

ZK_NAME = "zk"
ROOT = "/quire"
SESSION_CHECK_MS = 100.0  # how often the server looks for expired sessions


@dataclass(frozen=True, slots=True)
class MetadataCall:
    op_id: int
    function: Callable[[InMemoryMetadataStore], Any]
    description: str


@dataclass(frozen=True, slots=True)
class MetadataReply:
    op_id: int
    result: Any
    error: Exception | None


@dataclass(frozen=True, slots=True)
class Ping:
    pass


class ZkNode(SimNode):
    def __init__(self, world: World, network: Network) -> None:
        super().__init__(ZK_NAME, world, network)
        self.server = InMemoryMetadataServer(now_ms=0)
        self._stores: dict[str, InMemoryMetadataStore] = {}
        # The simulator's own look at the tree (it never expires).
        self._observer = self.server.connect(2**62, ROOT)
        self.start()
        self.after(SESSION_CHECK_MS, self._check_sessions)

    def connect(self, client: str, session_timeout_ms: int) -> InMemoryMetadataStore:
        """A new session for `client` (a process start)."""
        previous = self._stores.get(client)
        if previous is not None:
            previous.auto_reconnect = False  # the old process is gone; its session lingers until it times out
        store = self.server.connect(session_timeout_ms, ROOT)
        self._stores[client] = store
        return store

    def store_of(self, client: str) -> InMemoryMetadataStore:
        return self._stores[client]

    def registered(self, directory: str) -> dict[str, str | None]:
        """Children of `directory` now (bookie id -> rack, none here)."""
        if self._observer.exists(directory) is None:
            return {}
        return {name: None for name in self._observer.children(directory)}

    def _check_sessions(self) -> None:
        self.server.advance(int(self.world.now_ms))
        self.after(SESSION_CHECK_MS, self._check_sessions)

    def deliver(self, source: str, message: Any) -> None:
        store = self._stores.get(source)
        if store is None:
            return
        if isinstance(message, Ping):
            store.heartbeat(int(self.world.now_ms))
            return
        assert isinstance(message, MetadataCall)
        self.server.advance(int(self.world.now_ms))
        try:
            result, error = message.function(store), None
        except (MetadataError, BKError) as caught:  # the caller's to judge, as with a kazoo call
            result, error = None, caught
        self.world.log(f"zk {source} {message.description} -> {'ok' if error is None else type(error).__name__}")
        self.send(source, MetadataReply(message.op_id, result, error), faults=False)


class MetadataLink:
    """A node's ZooKeeper client: calls with a timeout, and pings."""

    def __init__(self, node: SimNode, zk: ZkNode, *, session_timeout_ms: int, call_timeout_ms: float) -> None:
        self.node = node
        self.zk = zk
        self.session_timeout_ms = session_timeout_ms
        self.call_timeout_ms = call_timeout_ms
        self.store: InMemoryMetadataStore | None = None
        self._pending: dict[int, Callable[[Any, Exception | None], None]] = {}
        self._next_op_id = 1

    def start(self) -> InMemoryMetadataStore:
        """On process start: a new session, pinged from now on."""
        self._pending = {}
        self.store = self.zk.connect(self.node.name, self.session_timeout_ms)
        self._ping()
        return self.store

    def _ping(self) -> None:
        self.node.send(ZK_NAME, Ping(), faults=False)
        self.node.after(self.session_timeout_ms / 3, self._ping)

    def call(self, function: Callable[[InMemoryMetadataStore], Any], on_done: Callable[[Any, Exception | None], None], description: str) -> None:
        op_id = self._next_op_id
        self._next_op_id += 1
        self._pending[op_id] = on_done
        self.node.send(ZK_NAME, MetadataCall(op_id, function, description), faults=False)
        self.node.after(self.call_timeout_ms, self._timed_out, op_id)

    def reply(self, message: MetadataReply) -> None:
        on_done = self._pending.pop(message.op_id, None)
        if on_done is not None:
            on_done(message.result, message.error)

    def _timed_out(self, op_id: int) -> None:
        on_done = self._pending.pop(op_id, None)
        if on_done is not None:
            on_done(None, ConnectionLossError("no answer from the metadata store in time"))
