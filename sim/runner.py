"""One simulated run from one seed: build the cluster the seed's parameters
describe, run the safety phase (workload and nemesis on, invariants checked
as it goes), heal, run the liveness phase (every ledger must close and every
acknowledged entry must be read back within a bound), and report."""

from __future__ import annotations

import dataclasses
import textwrap
import traceback
from dataclasses import dataclass, field
from typing import Iterable

from ledger_client.recovery_core import RecoveryCore
from ledger_client.write_core import WriteCore
from sim.bookie_node import SimBookie
from sim.checker import SimChecker, Violation
from sim.metadata_node import ZkNode
from sim.mistakes import MISTAKES
from sim.nemesis import SimNemesis
from sim.network import Network
from sim.parameters import SimParameters, choose_parameters
from sim.reader import SimReader
from sim.recoverer import SimRecoverer
from sim.world import LivelockError, World
from sim.writer import SimWriter

DURABILITY_CHECK_MS = 1_000.0
LIVENESS_STEP_MS = 250.0


@dataclass
class SimResult:
    seed: int
    parameters: SimParameters
    mistake: str | None
    violations: list[Violation]
    digest: str
    stats: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # known limits met (not violations)
    trace: list[str] | None = None

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        verdict = "ok" if self.ok else f"{len(self.violations)} VIOLATION(S)"
        lines = [f"seed {self.seed}: {verdict}" + (f" (planted mistake: {self.mistake})" if self.mistake else "")]
        lines.append(f"  parameters: {self.parameters.describe()}")
        lines.append("  " + " ".join(f"{name}={value}" for name, value in self.stats.items()))
        lines.append(f"  event log digest: {self.digest}")
        lines += [f"  note: {note}" for note in self.notes]
        lines += [f"  {violation}" for violation in self.violations]
        return "\n".join(lines)


def run_seed(seed: int, *, mistake: str | None = None, trace: bool = False, **overrides) -> SimResult:
    """Run one seed (with a planted mistake from `sim.mistakes`, for tests).
    An exception inside the run (an assert in a core) or a livelock ends it
    with a violation, so that a batch goes on and names the seed."""
    if mistake is not None and mistake not in MISTAKES:
        raise ValueError(f"unknown mistake {mistake!r}; known: {', '.join(sorted(MISTAKES))}")
    parameters = choose_parameters(seed, **overrides)
    return run_phases(SimRun(parameters, MISTAKES.get(mistake, {}) if mistake else {}, trace=trace), mistake)


def run_phases(run, mistake: str | None) -> SimResult:
    """Build a run (a SimRun or a BrokerSimRun), run its safety phase and,
    if that kept every invariant, its liveness phase. An exception inside
    (an assert in a core) or a livelock ends the run with a violation."""
    world, seed = run.world, run.parameters.seed
    world.log(f"parameters {run.parameters.describe()} mistake={mistake}")
    crashes: list[Violation] = []
    try:
        run.build()
        run.safety()
        if run.checker.ok:
            run.liveness()
    except LivelockError as error:
        crashes.append(Violation(world.now_ms, "livelock", f"seed {seed}: {error}"))
    except Exception as error:
        trace_text = "".join(traceback.format_exception(error)).rstrip()
        crashes.append(Violation(
            world.now_ms, "crash",
            f"seed {seed}: {type(error).__name__}: {error}\n" + textwrap.indent(trace_text, "    "),
        ))
    return SimResult(seed, run.parameters, mistake, run.checker.violations + crashes, world.digest(), run.stats(), run.notes, world.trace)


class SimRun:
    """The nodes of one run and its two phases."""

    def __init__(self, parameters: SimParameters, classes: dict, *, trace: bool) -> None:
        self.parameters = parameters
        self.write_core_class = classes.get("write_core_class", WriteCore)
        self.recovery_class = classes.get("recovery_core_class", RecoveryCore)
        self.world = World(parameters.seed, trace=trace)
        self.checker = SimChecker(lambda: self.world.now_ms)
        self.notes: list[str] = []  # known limits met (not violations)
        self.network: Network | None = None
        self.zk: ZkNode | None = None
        self.nemesis: SimNemesis | None = None
        self.bookies: list[SimBookie] = []
        self.writers: list[SimWriter] = []
        self.recoverers: list[SimRecoverer] = []
        self.readers: list[SimReader] = []
        self.closers: list[SimRecoverer] = []  # the liveness phase's, one per ledger left open
        self.final_readers: list[SimReader] = []  # the liveness phase's
        self.unclosed_entries_read = 0

    def build(self) -> None:
        world, parameters, checker = self.world, self.parameters, self.checker
        network = self.network = Network(
            world, latency_ms_min=parameters.latency_ms_min, latency_ms_max=parameters.latency_ms_max,
            slow_message_probability=parameters.slow_message_probability,
        )
        zk = self.zk = ZkNode(world, network)
        self.bookies = [
            SimBookie(f"bookie-{index}", world, network, zk, checker, fsync_ms_max=parameters.fsync_ms_max,
                      slow_fsync_probability=parameters.slow_fsync_probability,
                      write_cache_bytes=parameters.write_cache_bytes, session_timeout_ms=parameters.session_timeout_ms)
            for index in range(parameters.bookies)
        ]
        common = dict(session_timeout_ms=parameters.session_timeout_ms, parameters=parameters)
        self.writers = [
            SimWriter(f"writer-{index}", world, network, zk, checker, write_core_class=self.write_core_class, **common)
            for index in range(parameters.writers)
        ]
        self.recoverers = [
            SimRecoverer(f"recoverer-{index}", world, network, zk, checker, recovery_core_class=self.recovery_class,
                         idle_ms_mean=parameters.recovery_interval_ms_mean, **common)
            for index in range(parameters.recoverers)
        ]
        self.readers = [SimReader(f"reader-{index}", world, network, zk, checker, **common) for index in range(parameters.readers)]
        self.nemesis = SimNemesis(world, network, zk, checker, parameters, bookies=self.bookies,
                                  clients=self.writers + self.recoverers + self.readers)

    # --- safety: workload and faults -------------------------------------------------------

    def safety(self) -> None:
        world, checker = self.world, self.checker

        def durability_check() -> None:
            checker.check_durability(self.bookies, "a periodic check")
            world.after(DURABILITY_CHECK_MS, durability_check)

        self.nemesis.start()
        world.after(DURABILITY_CHECK_MS, durability_check)
        world.run_until(self.parameters.safety_ms, stop=lambda: not checker.ok)

    # --- liveness: heal, then everything must close and read back --------------------------

    def liveness(self) -> None:
        world, checker, parameters = self.world, self.checker, self.parameters
        self.nemesis.heal()
        for client in self.writers + self.recoverers + self.readers:
            client.active = False
        deadline_ms = world.now_ms + parameters.liveness_ms
        # Adds in flight get their answers (or time out) first. Inactive
        # writers add nothing more and close nothing: every ledger still
        # open is left to the recoverers below.
        world.run_until(world.now_ms + 2 * parameters.add_timeout_ms, stop=lambda: not checker.ok)
        # One recoverer per ledger (as many brokers taking over their topics at
        # once would): a ledger that cannot be recovered holds up no other.
        closers: dict[int, SimRecoverer] = {}
        for ledger_id in sorted(ledger_id for ledger_id in checker.metadata if ledger_id not in checker.closed):
            closer = closers[ledger_id] = SimRecoverer(
                f"liveness-recoverer-{ledger_id}", self.world, self.network, self.zk, checker,
                recovery_core_class=self.recovery_class, session_timeout_ms=parameters.session_timeout_ms, parameters=parameters,
                idle_ms_mean=0.0,
            )
            closer.recover_all([ledger_id])
        self.closers = list(closers.values())
        all_closed = lambda: all(ledger_id in checker.closed for ledger_id in checker.metadata)  # noqa: E731
        while world.now_ms < deadline_ms and checker.ok and not all_closed():
            world.run_until(world.now_ms + LIVENESS_STEP_MS, stop=lambda: not checker.ok or all_closed())
        if not checker.ok:
            return
        unclosed = sorted(ledger_id for ledger_id in checker.metadata if ledger_id not in checker.closed)
        stored = {bookie.name: bookie.durable_entries() for bookie in self.bookies if bookie.up}
        for ledger_id in unclosed:
            self._excuse_or_report(ledger_id, closers.get(ledger_id), stored)
        # Read back every entry of every closed ledger, and every
        # acknowledged entry of a ledger left open.
        targets = {ledger_id: (checker.metadata[ledger_id], range(last + 1)) for ledger_id, last in checker.closed.items()}
        for ledger_id in unclosed:
            acked = checker.acked.get(ledger_id, {})
            targets[ledger_id] = (checker.metadata[ledger_id], range(max(acked, default=-1) + 1))
        deadline_ms = world.now_ms + parameters.liveness_ms
        reader = SimReader("liveness-reader", world, self.network, self.zk, checker,
                           session_timeout_ms=parameters.session_timeout_ms, parameters=parameters)
        reader.active = False
        self.final_readers = [reader]
        reader.read_all(dict(sorted(targets.items())))
        while world.now_ms < deadline_ms and not reader.final_done:
            world.run_until(world.now_ms + LIVENESS_STEP_MS, stop=lambda: reader.final_done)
        for ledger_id, missing in sorted((reader.final_missing or {}).items()):
            if ledger_id in checker.closed:
                what = f"closed at {checker.closed[ledger_id]}"
            else:
                what = "left open"
                self.unclosed_entries_read += len(targets[ledger_id][1]) - len(missing)
            if missing:
                checker.violate(
                    "liveness: acknowledged entries read back",
                    f"entries {sorted(missing)[:10]} of ledger {ledger_id} ({what}) "
                    f"unreadable {parameters.liveness_ms} ms after healing",
                )
        checker.check_durability(self.bookies, "the liveness phase")

    def _excuse_or_report(self, ledger_id: int, closer: SimRecoverer | None, stored) -> None:
        """A ledger still open after the liveness bound is excused only when
        its recovery waits on corruption the nemesis made that the copies
        left on live bookies cannot get past: an entry with no intact copy
        and fewer than WQ - AQ + 1 bookies without it, or fence reads that
        fail on corrupt copies so that fencing never reaches its coverage."""
        stuck = None if closer is None else closer.stuck_on(ledger_id)
        why = None
        corrupted = self.nemesis.corrupted
        if stuck is not None and stuck.entry_id is not None and (ledger_id, stuck.entry_id) in corrupted:
            why = self.checker.recovery_cannot_decide(stored, ledger_id, stuck.entry_id)
            why = why and f"corrupt entry {stuck.entry_id} is undecidable: {why}"
        elif stuck is not None and stuck.fence_errors:
            why = self.checker.fencing_cannot_cover(stored, ledger_id, stuck.fence_errors, corrupted)
        if why is not None:
            self.notes.append(f"ledger {ledger_id} cannot be recovered: {why}")
            return
        self.checker.violate(
            "liveness: every ledger closes",
            f"ledger {ledger_id} is not closed {self.parameters.liveness_ms} ms after healing (recovery: {stuck or 'not started'})",
        )

    def stats(self) -> dict[str, object]:
        checker, nemesis = self.checker, self.nemesis
        return {
            "virtual_ms": round(self.world.now_ms),
            "events": self.world.events_run,
            "messages": 0 if self.network is None else self.network.sent,
            "ledgers": len(checker.metadata),
            "entries_acked": checker.acked_count(),
            "acks_racing_recovery": checker.acks_racing_recovery,
            "reads": checker.reads,
            # Corrupt copies served as intact, caught by the clients' digest checks.
            "digest_mismatches": sum(client.digest_mismatches for client in self.readers + self.recoverers + self.closers + self.final_readers),
            "unclosed_entries_read": self.unclosed_entries_read,
            "faults": {} if nemesis is None else dict(sorted(nemesis.injected.items())),
            "faults_skipped": {} if nemesis is None else dict(sorted(nemesis.skipped.items())),
            "bookie_restarts": sum(bookie.restarts for bookie in self.bookies),
            "recoveries": sum(recoverer.recovered for recoverer in self.recoverers),
            # Recoveries that closed a ledger while a bookie of the ensemble
            # they fenced was down (with WQ = AQ: entries with one copy left).
            "recoveries_with_a_bookie_down": sum(recoverer.recovered_with_a_bookie_down for recoverer in self.recoverers),
        }


def run_seeds(seeds: Iterable[int], **options) -> Iterable[SimResult]:
    for seed in seeds:
        yield run_seed(seed, **options)


def parameters_for(seed: int, **overrides) -> SimParameters:
    return dataclasses.replace(choose_parameters(seed), **overrides)
