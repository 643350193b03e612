"""One simulated run from one seed: build the cluster the seed's parameters
describe, run the safety phase (workload and nemesis on, invariants checked
as it goes), heal, run the liveness phase (every ledger must close and every
acknowledged entry must be read back within a bound), and report."""

from __future__ import annotations

import dataclasses
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
from sim.world import World
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
    """Run one seed (with a planted mistake from `sim.mistakes`, for tests)."""
    params = choose_parameters(seed, **overrides)
    if mistake is not None and mistake not in MISTAKES:
        raise ValueError(f"unknown mistake {mistake!r}; known: {', '.join(sorted(MISTAKES))}")
    classes = MISTAKES.get(mistake, {}) if mistake else {}
    world = World(seed, trace=trace)
    world.log(f"parameters {params.describe()} mistake={mistake}")
    network = Network(
        world, latency_ms_min=params.latency_ms_min, latency_ms_max=params.latency_ms_max,
        slow_message_probability=params.slow_message_probability,
    )
    checker = SimChecker(lambda: world.now_ms)
    zk = ZkNode(world, network)
    bookies = [
        SimBookie(f"bookie-{index}", world, network, zk, checker, fsync_ms_max=params.fsync_ms_max,
                  slow_fsync_probability=params.slow_fsync_probability,
                  write_cache_bytes=params.write_cache_bytes, session_timeout_ms=params.session_timeout_ms)
        for index in range(params.bookies)
    ]
    common = dict(session_timeout_ms=params.session_timeout_ms, params=params)
    writers = [
        SimWriter(f"writer-{index}", world, network, zk, checker,
                  write_core_class=classes.get("write_core_class", WriteCore), **common)
        for index in range(params.writers)
    ]
    recovery_class = classes.get("recovery_core_class", RecoveryCore)
    recoverers = [
        SimRecoverer(f"recoverer-{index}", world, network, zk, checker, recovery_core_class=recovery_class,
                     idle_ms_mean=params.recovery_interval_ms_mean, **common)
        for index in range(params.recoverers)
    ]
    readers = [SimReader(f"reader-{index}", world, network, zk, checker, **common) for index in range(params.readers)]
    nemesis = SimNemesis(world, network, zk, checker, params, bookies=bookies, clients=writers + recoverers + readers)

    def durability_check() -> None:
        checker.check_durability(bookies, "a periodic check")
        world.after(DURABILITY_CHECK_MS, durability_check)

    # --- safety: workload and faults ---------------------------------------------------
    nemesis.start()
    world.after(DURABILITY_CHECK_MS, durability_check)
    world.run_until(params.safety_ms, stop=lambda: not checker.ok)

    # --- liveness: heal, then everything must close and read back -----------------------------
    notes: list[str] = []
    if checker.ok:
        liveness(world, nemesis, checker, bookies, writers, recoverers, readers, zk, network, params, recovery_class, notes)
    stats = {
        "virtual_ms": round(world.now_ms),
        "events": world.events_run,
        "messages": network.sent,
        "ledgers": len(checker.metadata),
        "entries_acked": checker.acked_count(),
        "acks_after_fence": checker.acks_after_fence,
        "reads": checker.reads,
        "faults": dict(sorted(nemesis.injected.items())),
        "bookie_restarts": sum(bookie.restarts for bookie in bookies),
        "recoveries": sum(recoverer.recovered for recoverer in recoverers),
    }
    return SimResult(seed, params, mistake, list(checker.violations), world.digest(), stats, notes, world.trace)


def liveness(world, nemesis, checker, bookies, writers, recoverers, readers, zk, network, params, recovery_class, notes) -> None:
    nemesis.heal()
    for client in writers + recoverers + readers:
        client.active = False
    deadline_ms = world.now_ms + params.liveness_ms
    # Writers get a moment to finish (and close) what they have in flight.
    world.run_until(world.now_ms + 2 * params.add_timeout_ms, stop=lambda: not checker.ok)
    # One recoverer per ledger (as many brokers taking over their topics at
    # once would): a ledger that cannot be recovered holds up no other.
    for ledger_id in sorted(ledger_id for ledger_id in checker.metadata if ledger_id not in checker.closed):
        closer = SimRecoverer(f"liveness-recoverer-{ledger_id}", world, network, zk, checker, recovery_core_class=recovery_class,
                              session_timeout_ms=params.session_timeout_ms, params=params, idle_ms_mean=0.0)
        closer.recover_all([ledger_id])
    all_closed = lambda: all(ledger_id in checker.closed for ledger_id in checker.metadata)  # noqa: E731
    while world.now_ms < deadline_ms and checker.ok and not all_closed():
        world.run_until(world.now_ms + LIVENESS_STEP_MS, stop=lambda: not checker.ok or all_closed())
    if not checker.ok:
        return
    unclosed = sorted(ledger_id for ledger_id in checker.metadata if ledger_id not in checker.closed)
    for ledger_id in unclosed:
        if any(ledger == ledger_id for ledger, _ in nemesis.corrupted):
            # Recovery needs AQ intact copies or WQ - AQ + 1 "no entry"
            # answers; a corrupt replica gives neither (DESIGN section 3).
            notes.append(f"ledger {ledger_id} cannot be recovered: a corrupt replica leaves an entry undecided")
        else:
            checker._violate("liveness: every ledger closes", f"ledger {ledger_id} is not closed {params.liveness_ms} ms after healing")
    deadline_ms = world.now_ms + params.liveness_ms
    reader = SimReader("liveness-reader", world, network, zk, checker, session_timeout_ms=params.session_timeout_ms, params=params)
    reader.active = False
    reader.read_all({ledger_id: checker.metadata[ledger_id] for ledger_id in sorted(checker.closed)})
    while world.now_ms < deadline_ms and not reader.final_done:
        world.run_until(world.now_ms + LIVENESS_STEP_MS, stop=lambda: reader.final_done)
    for ledger_id, missing in sorted((reader.final_missing or {}).items()):
        if missing:
            checker._violate(
                "liveness: closed ledgers read back",
                f"entries {sorted(missing)[:10]} of ledger {ledger_id} (closed at {checker.closed[ledger_id]}) "
                f"unreadable {params.liveness_ms} ms after healing",
            )
    checker.check_durability(bookies, "the liveness phase")


def run_seeds(seeds: Iterable[int], **options) -> Iterable[SimResult]:
    for seed in seeds:
        yield run_seed(seed, **options)


def parameters_for(seed: int, **overrides) -> SimParameters:
    return dataclasses.replace(choose_parameters(seed), **overrides)
