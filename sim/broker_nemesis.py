"""The broker simulation's nemesis: during the safety phase, one fault after
another (partitions, slow links, broker crashes and restarts, pauses of
brokers and clients, ZooKeeper session expiries, storage failures under
the owner, client crashes), each undone after a while; `heal` undoes
everything for the liveness phase. Connection resets and duplicated
requests are rates, on from the start. A session expires as ZooKeeper
expires one, its holder unheard of for longer than the timeout (paused,
crashed or cut off), never at an arbitrary moment."""

from __future__ import annotations

from typing import Sequence

from sim.broker_client import SimBrokerClient
from sim.broker_links import Links
from sim.bookie_node import SimBookie
from sim.broker_node import SimBroker
from sim.broker_parameters import BrokerSimParameters
from sim.metadata_node import ZK_NAME, ZkNode
from sim.nemesis import NemesisBase
from sim.network import Network
from sim.world import World

DOWN_MS_MAX = 3_000.0
QUICK_RESTART_MS_MAX = 20.0
OWNER_EXPIRY_SHARE = 0.75  # of the session expiries, those aimed at the partition's owner


class BrokerNemesis(NemesisBase):
    def __init__(self, world: World, network: Network, links: Links, zk: ZkNode, parameters: BrokerSimParameters, *,
                 bookies: Sequence[SimBookie], brokers: Sequence[SimBroker], clients: Sequence[SimBrokerClient]) -> None:
        super().__init__(world, network, faults=parameters.faults, fault_interval_ms_mean=parameters.fault_interval_ms_mean)
        self.links = links
        self.zk = zk
        self.parameters = parameters
        self.bookies = list(bookies)
        self.brokers = list(brokers)
        self.clients = list(clients)

    def start(self) -> None:
        self.links.break_probability = self.parameters.break_probability
        self._start_injecting()

    def _names(self) -> list[str]:
        return [ZK_NAME] + [node.name for node in [*self.bookies, *self.brokers, *self.clients]]

    def _partition(self) -> None:
        self._partition_among(self._names())

    def _slow_link(self) -> None:
        self._slow_link_among(self._names())

    # --- processes ------------------------------------------------------------------------------

    def _crash(self) -> None:
        self._crash_one("crash", self.brokers, DOWN_MS_MAX)

    def _client_crash(self) -> None:
        # Half the time a supervisor starts it again at once (while what it
        # had in flight may still be on its way).
        self._crash_one("client_crash", self.clients,
                        QUICK_RESTART_MS_MAX if self.world.rng.random() < 0.5 else DOWN_MS_MAX)

    def _crash_one(self, kind: str, nodes: Sequence[SimBroker | SimBrokerClient], down_ms_max: float) -> None:
        candidates = [node for node in nodes if node.up]
        if not candidates:
            return self._skip(kind, "every one is down")
        node = self.world.rng.choice(candidates)
        node.crash()
        self._record(kind, node.name)
        self.world.after(self.world.uniform(1, down_ms_max), self._restart, node)

    def _restart(self, node: SimBroker | SimBrokerClient) -> None:
        if not node.up:
            node.restart()

    def _pause(self) -> None:
        self._pause_one([*self.brokers, *self.clients], self.parameters.session_timeout_ms)

    def _expire(self) -> None:
        """A broker cut off from ZooKeeper past its session timeout: the
        session expires (as ZooKeeper expires one: after the timeout, never
        earlier), while the broker may still reach its clients."""
        candidates = [broker for broker in self.brokers if broker.up]
        if not candidates:
            return self._skip("expire", "every broker is down")
        # Mostly the topic's owner: the expiry that moves the partition.
        owners = [broker for broker in candidates if broker.partition is not None and broker.partition.serving]
        if owners and self.world.rng.random() < OWNER_EXPIRY_SHARE:
            candidates = owners
        broker = self.world.rng.choice(candidates)
        duration_ms = self.world.uniform(1.1, 1.6) * self.parameters.session_timeout_ms
        self._block_for([(broker.name, ZK_NAME), (ZK_NAME, broker.name)], duration_ms)
        self._record("expire", f"{broker.name} cut off from ZooKeeper for {duration_ms:.0f} ms")

    def _unload(self) -> None:
        """The owner unloads the partition gracefully (an operator's unload,
        a rebalance or a shutdown): another broker may take it at once."""
        for broker in self.brokers:
            if broker.up and not broker.paused and broker.unload_gracefully():
                return self._record("unload", broker.name)
        self._skip("unload", "no broker serves the partition")

    def _storage_error(self) -> None:
        """A bookie goes: crashed (what it had not synced is lost) or paused,
        and back after a while. The owner's ledger changes its ensemble, or
        fails and the partition is loaded again."""
        candidates = [bookie for bookie in self.bookies if bookie.up and not bookie.paused]
        if not candidates:
            return self._skip("storage_error", "every bookie is down")
        bookie = self.world.rng.choice(candidates)
        if self.world.chance(0.5):
            bookie.crash()
            self.world.after(self.world.uniform(1, DOWN_MS_MAX), self._restart_bookie, bookie)
            self._record("storage_error", f"{bookie.name} crashed")
        else:
            bookie.pause()
            self.world.after(self.world.uniform(1, self.parameters.session_timeout_ms), bookie.resume)
            self._record("storage_error", f"{bookie.name} paused")

    def _restart_bookie(self, bookie: SimBookie) -> None:
        if not bookie.up:
            bookie.restart()

    # --- the end of the safety phase -------------------------------------------------------------

    def heal(self) -> None:
        """Undo every fault. Stragglers go too: on an ordered connection one
        holds up everything behind it (TCP's head-of-line blocking), which
        the liveness bound is not meant to measure."""
        self._heal_network()
        self.links.break_probability = 0.0
        self.network.slow_message_probability = 0.0
        for bookie in self.bookies:
            if not bookie.up:
                bookie.restart()
            elif bookie.paused:
                bookie.resume()
        for node in [*self.brokers, *self.clients]:
            if not node.up:
                node.restart()
            elif node.paused:
                node.resume()
        self.world.log("nemesis healed everything")
