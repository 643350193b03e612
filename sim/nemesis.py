"""The simulator's nemesis: during the safety phase it injects one fault
after another (partitions of three shapes with a minimum duration, bookie
crashes that lose unsynced writes and restarts, a bookie kept down for a
long stretch, pauses, corrupted entries on disk, ZooKeeper session expiries,
client crashes), each undone after a while; `heal` undoes everything at
once for the liveness phase."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from sim.bookie_node import SimBookie
from sim.checker import SimChecker
from sim.metadata_node import ZK_NAME, ZkNode
from sim.network import Network
from sim.node import SimNode
from sim.parameters import SimParameters
from sim.world import World

PARTITION_MS_MIN = 100.0
PARTITION_MS_MAX = 4_000.0
DOWN_MS_MAX = 3_000.0
# A bookie down for a long stretch ("bookie_down"): past a recoverer's
# retries and often to the end of the safety phase, so that recoveries
# (of WQ = AQ ledgers too) have to decide without it. One at a time.
LONG_DOWN_MS_MIN = 5_000.0
LONG_DOWN_MS_MAX = 30_000.0
CORRUPT_TAIL_ENTRIES = 8  # corruption aims at the last entries of open ledgers, where recovery decides
CORRUPT_CANDIDATES_MAX = 20  # stored entries one corruption tries before it gives up
AIM_PAST_LIVE_COPIES_PROBABILITY = 0.5  # a corruption aims at copies no live bookie has another intact one of
# The first fault comes within this time, so that a short safety phase with
# a long mean interval between faults does not end before any fault.
FIRST_FAULT_MS_MAX = 1_000.0


class NemesisBase:
    """What every nemesis shares: one fault after another (the first within
    FIRST_FAULT_MS_MAX, then at exponential intervals) while active, each
    counted as injected or skipped; partitions and slow links among named
    nodes, undone after a while. A subclass names its fault kinds and has a
    method `_<kind>` for each."""

    def __init__(self, world: World, network: Network, *, faults: Sequence[str], fault_interval_ms_mean: float) -> None:
        self.world = world
        self.network = network
        self.fault_interval_ms_mean = fault_interval_ms_mean
        self.active = False
        self.kinds = [kind for kind in faults if kind not in ("drop", "duplicate")]  # those are rates, not faults
        self.injected: Counter[str] = Counter()
        # Faults chosen that found nothing to act on (every node down, a
        # session already gone, no copy that may be corrupted).
        self.skipped: Counter[str] = Counter()
        self._blocked: Counter[tuple[str, str]] = Counter()

    def _start_injecting(self) -> None:
        self.active = True
        if self.kinds:
            first_ms = min(self.world.exponential(self.fault_interval_ms_mean), FIRST_FAULT_MS_MAX)
            self.world.after(first_ms, self._inject)

    def _inject(self) -> None:
        if not self.active:
            return
        kind = self.world.rng.choice(self.kinds)
        getattr(self, f"_{kind}")()
        self.world.after(self.world.exponential(self.fault_interval_ms_mean), self._inject)

    def _record(self, kind: str, detail: str) -> None:
        self.injected[kind] += 1
        self.world.log(f"nemesis {kind} {detail}")

    def _skip(self, kind: str, why: str) -> None:
        self.skipped[kind] += 1
        self.world.log(f"nemesis {kind} skipped: {why}")

    # --- the network -----------------------------------------------------------------

    def _partition_among(self, names: list[str]) -> None:
        """A partition of one of three shapes among `names`, for a while."""
        rng = self.world.rng
        shape = rng.choice(["symmetric", "asymmetric", "isolate"])
        if shape == "isolate":
            side = [rng.choice(names)]
        else:
            side = sorted(rng.sample(names, rng.randint(1, len(names) - 1)))
        other = [name for name in names if name not in side]
        links = [(a, b) for a in side for b in other]
        if shape != "asymmetric":
            links += [(b, a) for a in side for b in other]
        duration_ms = self.world.uniform(PARTITION_MS_MIN, PARTITION_MS_MAX)
        self._block_for(links, duration_ms)
        self._record("partition", f"{shape} {side} | {other} for {duration_ms:.0f} ms")

    def _block_for(self, links: list[tuple[str, str]], duration_ms: float) -> None:
        for link in links:
            self._blocked[link] += 1
        self.network.block(links)
        self.world.after(duration_ms, self._end_partition, links)

    def _end_partition(self, links: list[tuple[str, str]]) -> None:
        ended = []
        for link in links:
            if self._blocked[link] > 0:
                self._blocked[link] -= 1
                if self._blocked[link] == 0:
                    ended.append(link)
        self.network.unblock(ended)

    def _slow_link_among(self, names: list[str]) -> None:
        """Messages from one node to some others take far longer for a while
        (a congested or retransmitting link): they arrive after messages
        other nodes sent later."""
        rng = self.world.rng
        source = rng.choice(names)
        others = [name for name in names if name != source]
        links = [(source, name) for name in rng.sample(others, rng.randint(1, len(others)))]
        if rng.random() < 0.5:
            links = [(destination, source) for source, destination in links]
        extra_ms = rng.choice([20.0, 200.0, 1_000.0])
        for link in links:
            self.network.slow_links[link] = extra_ms
        duration_ms = self.world.uniform(PARTITION_MS_MIN, PARTITION_MS_MAX)
        self._record("slow_link", f"{links} +{extra_ms:.0f} ms for {duration_ms:.0f} ms")
        self.world.after(duration_ms, self._end_slow_link, links, extra_ms)

    def _end_slow_link(self, links: list[tuple[str, str]], extra_ms: float) -> None:
        for link in links:
            if self.network.slow_links.get(link) == extra_ms:
                del self.network.slow_links[link]

    # --- processes ---------------------------------------------------------------------

    def _pause_one(self, nodes: Sequence[SimNode], session_timeout_ms: float) -> None:
        """SIGSTOP one of `nodes`, sometimes past the session timeout (so that
        ZooKeeper drops its session), then SIGCONT."""
        candidates = [node for node in nodes if node.up and not node.paused]
        if not candidates:
            return self._skip("pause", "every node is down or paused")
        node = self.world.rng.choice(candidates)
        node.pause()
        duration_ms = self.world.uniform(1, 1.5 * session_timeout_ms)
        self._record("pause", f"{node.name} for {duration_ms:.0f} ms")
        self.world.after(duration_ms, node.resume)

    def _heal_network(self) -> None:
        self.active = False
        self._blocked.clear()
        self.network.heal()


class SimNemesis(NemesisBase):
    def __init__(self, world: World, network: Network, zk: ZkNode, checker: SimChecker, parameters: SimParameters, *,
                 bookies: Sequence[SimBookie], clients: Sequence[SimNode]) -> None:
        super().__init__(world, network, faults=parameters.faults, fault_interval_ms_mean=parameters.fault_interval_ms_mean)
        self.zk = zk
        self.checker = checker
        self.parameters = parameters
        self.bookies = list(bookies)
        self.clients = list(clients)
        self.corrupted: set[tuple[int, int]] = set()
        self.long_down: SimBookie | None = None  # the bookie "bookie_down" keeps down

    def start(self) -> None:
        self.network.drop_probability = self.parameters.drop_probability
        self.network.duplicate_probability = self.parameters.duplicate_probability
        self._start_injecting()

    def _partition(self) -> None:
        self._partition_among([ZK_NAME] + [node.name for node in self.bookies + self.clients])

    def _slow_link(self) -> None:
        self._slow_link_among([node.name for node in self.bookies + self.clients])

    # --- processes --------------------------------------------------------------------------

    def _crash(self) -> None:
        candidates = [bookie for bookie in self.bookies if bookie.up]
        if not candidates:
            return self._skip("crash", "every bookie is down")
        bookie = self.world.rng.choice(candidates)
        bookie.crash()
        self._record("crash", bookie.name)
        self.checker.check_durability(self.bookies, f"crash of {bookie.name}")
        self.world.after(self.world.uniform(1, DOWN_MS_MAX), self._restart, bookie)

    def _bookie_down(self) -> None:
        if self.long_down is not None and not self.long_down.up:
            return self._skip("bookie_down", f"{self.long_down.name} is down for long already")
        candidates = [bookie for bookie in self.bookies if bookie.up]
        if not candidates:
            return self._skip("bookie_down", "every bookie is down")
        bookie = self.long_down = self.world.rng.choice(candidates)
        bookie.crash()
        duration_ms = self.world.uniform(LONG_DOWN_MS_MIN, LONG_DOWN_MS_MAX)
        self._record("bookie_down", f"{bookie.name} for {duration_ms:.0f} ms")
        self.checker.check_durability(self.bookies, f"crash of {bookie.name}")
        self.world.after(duration_ms, self._restart, bookie)

    def _restart(self, node: SimNode) -> None:
        if not node.up:
            node.restart() if isinstance(node, SimBookie) else node.start()

    def _pause(self) -> None:
        self._pause_one(self.bookies + self.clients, self.parameters.session_timeout_ms)

    def _client_crash(self) -> None:
        candidates = [node for node in self.clients if node.up]
        if not candidates:
            return self._skip("client_crash", "every client is down")
        node = self.world.rng.choice(candidates)
        node.crash()
        self._record("client_crash", node.name)
        self.world.after(self.world.uniform(1, DOWN_MS_MAX), self._restart, node)

    def _expire(self) -> None:
        candidates = [node for node in self.bookies + self.clients if node.up and node.metadata.store is not None]
        if not candidates:
            return self._skip("expire", "no node has a session")
        node = self.world.rng.choice(candidates)
        session_id = node.metadata.store.session_id
        if session_id not in self.zk.server.session_ids():
            return self._skip("expire", f"the session of {node.name} has expired already")
        self.zk.server.expire_session(session_id)
        self._record("expire", node.name)

    # --- disks --------------------------------------------------------------------------------

    def _corrupt(self) -> None:
        """Damage one stored entry on one bookie, never the last intact copy
        of an entry: aimed at the tail of open ledgers, and half the time at
        copies no live bookie holds another intact one of. Half the time the
        entry log's own checksum catches it (the bookie answers IO_ERROR);
        else the damage is served as if intact (a checksum written over
        the bad bytes) and only the client's digest can tell."""
        rng = self.world.rng
        stored = {bookie.name: bookie.durable_entries() for bookie in self.bookies}
        open_ledgers = {ledger_id for ledger_id in self.checker.metadata if ledger_id not in self.checker.closed}
        candidates: list[tuple[SimBookie, int, int]] = []
        for bookie in self.bookies:
            by_ledger: dict[int, list[int]] = {}
            for ledger_id, entry_id in bookie.indexed_entries():
                by_ledger.setdefault(ledger_id, []).append(entry_id)
            for ledger_id, entry_ids in sorted(by_ledger.items()):
                chosen = entry_ids[-CORRUPT_TAIL_ENTRIES:] if ledger_id in open_ledgers else entry_ids
                candidates += [(bookie, ledger_id, entry_id) for entry_id in chosen]
        rng.shuffle(candidates)
        if rng.random() < AIM_PAST_LIVE_COPIES_PROBABILITY:
            # Copies of open ledgers' entries whose every other intact copy
            # is on a bookie that is down come first: a recovery now meets
            # the corrupt copy with no intact one to read, where an error
            # taken for "no entry" would cut the ledger short.
            up = {bookie.name for bookie in self.bookies if bookie.up}
            live = {name: entries for name, entries in stored.items() if name in up}
            candidates.sort(key=lambda candidate: candidate[1] not in open_ledgers or self.checker.intact_copies(
                live, candidate[1], candidate[2], excluding=candidate[0].name) > 0)
        for bookie, ledger_id, entry_id in candidates[:CORRUPT_CANDIDATES_MAX]:
            if self.checker.intact_copies(stored, ledger_id, entry_id, excluding=bookie.name) >= 1:
                served = rng.random() < 0.5
                bookie.corrupt(ledger_id, entry_id, served=served)
                self.corrupted.add((ledger_id, entry_id))
                how = "served as intact" if served else "caught by the entry log"
                self._record("corrupt", f"{bookie.name} ledger {ledger_id} entry {entry_id} ({how})")
                self.checker.check_durability(self.bookies, f"corrupting entry {entry_id} of ledger {ledger_id} on {bookie.name}")
                return
        self._skip("corrupt", f"none of {min(len(candidates), CORRUPT_CANDIDATES_MAX)} stored entries tried has another intact copy")

    # --- the end of the safety phase ------------------------------------------------------------

    def heal(self) -> None:
        """Stop injecting and undo every fault: the liveness phase begins."""
        self._heal_network()
        self.network.drop_probability = 0.0
        self.network.duplicate_probability = 0.0
        for node in self.bookies + self.clients:
            if not node.up:
                self._restart(node)
            elif node.paused:
                node.resume()
        self.world.log("nemesis healed everything")
