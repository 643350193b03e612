"""The simulated network between nodes: every message is delayed (so
messages overtake each other), may be dropped or duplicated, is lost across
a partition, waits while its receiver is paused, and is lost when its
receiver crashed or restarted before it arrived (its connection is gone)."""

from __future__ import annotations

from typing import Any, Protocol

from sim.world import World

SLOW_MESSAGE_MS_MAX = 500.0  # a straggler: how late a "slow" message may arrive
CONNECTION_LOSS_MS_MAX = 20.0  # how soon peers notice a crashed node (TCP reset)


class Node(Protocol):
    name: str
    incarnation: int  # bumped on every restart: older connections are gone
    up: bool
    paused: bool

    def deliver(self, source: str, message: Any) -> None: ...

    def connection_lost(self, peer: str) -> None:
        """The connection to `peer` broke (it crashed, or this node reset)."""


class Network:
    def __init__(self, world: World, *, latency_ms_min: float, latency_ms_max: float,
                 drop_probability: float = 0.0, duplicate_probability: float = 0.0,
                 slow_message_probability: float = 0.0) -> None:
        self.world = world
        self.nodes: dict[str, Node] = {}
        self.latency_ms_min = latency_ms_min
        self.latency_ms_max = latency_ms_max
        self.drop_probability = drop_probability
        self.duplicate_probability = duplicate_probability
        self.slow_message_probability = slow_message_probability
        self.blocked: set[tuple[str, str]] = set()  # (from, to) links that lose everything
        self.slow_links: dict[tuple[str, str], float] = {}  # (from, to) -> extra delay of every message
        self._held: dict[str, list[tuple[str, Any]]] = {}  # messages waiting for a paused node
        self._peers: dict[str, set[str]] = {}  # who talked to whom, for connection losses
        self.sent = 0
        self.dropped = 0

    def add(self, node: Node) -> None:
        self.nodes[node.name] = node

    # --- sending ------------------------------------------------------------------

    def send(self, source: str, destination: str, message: Any, *, faults: bool = True) -> None:
        """Send a message; `faults=False` for links that never drop or
        duplicate (ZooKeeper's session protocol delivers a request once)."""
        self.sent += 1
        self._peers.setdefault(source, set()).add(destination)
        self._peers.setdefault(destination, set()).add(source)
        world = self.world
        if (source, destination) in self.blocked or (faults and world.chance(self.drop_probability)):
            self.dropped += 1
            return
        copies = 2 if faults and world.chance(self.duplicate_probability) else 1
        target = self.nodes[destination]
        for _ in range(copies):
            world.after(self.message_delay_ms(source, destination), self._arrive, source, destination, message, target.incarnation)

    def message_delay_ms(self, source: str, destination: str) -> float:
        """How long one message takes: the latency, sometimes a straggler's
        delay, and a slow link's extra delay."""
        world = self.world
        delay_ms = world.uniform(self.latency_ms_min, self.latency_ms_max)
        if world.chance(self.slow_message_probability):
            delay_ms += world.uniform(0, SLOW_MESSAGE_MS_MAX)
        extra_ms = self.slow_links.get((source, destination))
        if extra_ms:
            delay_ms += world.uniform(0.5 * extra_ms, extra_ms)
        return delay_ms

    def _arrive(self, source: str, destination: str, message: Any, incarnation: int) -> None:
        target = self.nodes[destination]
        if not target.up or target.incarnation != incarnation or (source, destination) in self.blocked:
            self.dropped += 1
            return
        if target.paused:
            self._held.setdefault(destination, []).append((source, message))
            return
        self.world.log(f"{source}>{destination} {describe(message)}")
        target.deliver(source, message)

    def reachable(self, source: str, destination: str) -> bool:
        return (source, destination) not in self.blocked and self.nodes[destination].up

    # --- node faults ----------------------------------------------------------------

    def crashed(self, name: str) -> None:
        """`name` crashed: what waited for it is gone, and its peers see their
        connections to it break a moment later."""
        self._held.pop(name, None)
        for peer in sorted(self._peers.get(name, ())):
            self.world.after(self.world.uniform(0.1, CONNECTION_LOSS_MS_MAX), self._notify_loss, peer, name)

    def _notify_loss(self, peer: str, lost: str) -> None:
        node = self.nodes[peer]
        if node.up and not node.paused:
            node.connection_lost(lost)

    def resumed(self, name: str) -> None:
        """A paused node runs again: it reads what arrived meanwhile."""
        node = self.nodes[name]
        for source, message in self._held.pop(name, []):
            if node.up and not node.paused:
                self.world.log(f"{source}>{name} {describe(message)}")
                node.deliver(source, message)

    # --- partitions -------------------------------------------------------------------

    def block(self, links: list[tuple[str, str]]) -> None:
        self.blocked.update(links)

    def unblock(self, links: list[tuple[str, str]]) -> None:
        self.blocked.difference_update(links)

    def heal(self) -> None:
        self.blocked.clear()
        self.slow_links.clear()


def describe(message: Any) -> str:
    """A message in one short line for the event log: its type and its
    fields, with byte strings shown by length."""
    fields = getattr(message, "__dataclass_fields__", None)
    if fields is None:
        return type(message).__name__
    parts = []
    for name in fields:
        value = getattr(message, name)
        if isinstance(value, (bytes, bytearray)):
            parts.append(f"{name}=<{len(value)}>")
        elif isinstance(value, list):
            parts.append(f"{name}=[{len(value)}]")
        elif callable(value):
            continue
        else:
            parts.append(f"{name}={value}")
    return f"{type(message).__name__}({' '.join(parts)})"
