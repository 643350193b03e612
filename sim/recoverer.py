"""A simulated recoverer: picks a ledger that is not closed (as a broker
taking over a topic would) and recovers it through the real `RecoveryCore`,
carrying out its fencing reads, recovery reads, recovery adds and metadata
writes the way `ledger_client.recovery` does with trio. It can say where a
recovery that does not end waits, for the liveness phase's verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bookie.protocol.entry_format import DigestManager
from ledger_client.metadata import LedgerMetadata
from ledger_client.recovery_core import Phase, RecoveryCore, RecoveryDone, RecoveryFailed
from sim.client_node import SimClient
from sim.parameters import SimParameters
from sim.recovery_driver import RecoveryDriver
from sim.writer import MASTER_KEY, PASSWORD

IDLE_MS_MEAN = 1_000.0  # between two recoveries (a takeover now and then)
RETRY_MS = 100.0
# A recovery that has not ended by then is given up (as a caller's
# trio.fail_after would): an entry left undecided by a corrupt replica
# keeps a recovery asking for ever.
RECOVERY_MS_MAX = 10_000.0


@dataclass(frozen=True)
class StuckRecovery:
    """Where a recovery that does not end waits: its phase, the entry it
    cannot decide (while deciding entries), and while fencing the bookies
    whose fence read failed (IO_ERROR) with the entry each could not read."""

    phase: Phase
    entry_id: int | None
    fence_errors: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.entry_id is not None:
            return f"{self.phase.value}, undecided entry {self.entry_id}"
        if self.fence_errors:
            return f"{self.phase.value}, fence reads failing on {self.fence_errors}"
        return self.phase.value


class SimRecoverer(SimClient):
    def __init__(self, *args: Any, parameters: SimParameters, recovery_core_class: type[RecoveryCore] = RecoveryCore,
                 idle_ms_mean: float = IDLE_MS_MEAN, **kwargs: Any) -> None:
        super().__init__(*args, request_timeout_ms=parameters.read_timeout_ms, **kwargs)
        self.parameters = parameters
        self.recovery_core_class = recovery_core_class
        self.idle_ms_mean = idle_ms_mean
        self.active = True
        self.targets: list[int] | None = None  # set: recover these (liveness), else pick at random
        self.driver: RecoveryDriver | None = None
        self._choosing = False
        self.given_up = 0
        self._past_digest_mismatches = 0  # of the recoveries before the current one
        # ledger -> where the last recovery of it that was given up waited
        self.stuck_when_given_up: dict[int, StuckRecovery] = {}
        self.recovered = 0
        self.recovered_with_a_bookie_down = 0  # closed while a bookie of the fenced ensemble was down
        self.failed = 0
        self.start()

    def start(self) -> None:
        super().start()
        self._let_go()
        self._choosing = False
        self.after(self.world.exponential(self.idle_ms_mean), self._next)

    def crash(self) -> None:
        super().crash()
        self._let_go()
        self.world.log(f"{self.name} crashed")

    @property
    def core(self) -> RecoveryCore | None:
        return None if self.driver is None else self.driver.core

    @property
    def digest_mismatches(self) -> int:
        """Recovery reads answered OK with bytes that fail the digest."""
        return self._past_digest_mismatches + (0 if self.driver is None else self.driver.digest_mismatches)

    def _let_go(self) -> None:
        driver, self.driver = self.driver, None
        if driver is not None:
            driver.stopped = True
            self._past_digest_mismatches += driver.digest_mismatches

    def recover_all(self, ledger_ids: list[int]) -> None:
        """Liveness: recover these ledgers one after the other, retrying."""
        self.targets = list(ledger_ids)
        self.idle_ms_mean = 0.0

    # --- choosing a ledger ------------------------------------------------------------

    def _next(self) -> None:
        if self.driver is not None or self._choosing or not (self.active or self.targets):
            return
        if self.targets is not None:
            self.targets = [ledger_id for ledger_id in self.targets if ledger_id not in self.checker.closed]
            if not self.targets:
                return
            # Round robin: one ledger that cannot be recovered yet must not
            # hold up the others.
            ledger_id = self.targets.pop(0)
            self.targets.append(ledger_id)
        else:
            open_ledgers = sorted(ledger_id for ledger_id in self.checker.metadata if ledger_id not in self.checker.closed)
            if not open_ledgers:
                self.after(self.world.exponential(self.idle_ms_mean), self._next)
                return
            # Mostly the newest: most likely one a writer is still
            # writing, where fencing races the writer's adds.
            ledger_id = open_ledgers[-1] if self.world.chance(0.8) else self.world.rng.choice(open_ledgers)
        self._choosing = True
        self.read_metadata(ledger_id, self._begin)

    def _begin(self, found: tuple[LedgerMetadata, int] | None) -> None:
        self._choosing = False
        if found is None or found[0].is_closed:
            self._finished()
            return
        metadata, version = found
        digest = DigestManager(metadata.ledger_id, metadata.digest_type, PASSWORD)
        core = self.recovery_core_class(
            metadata, version, digest, bookies=self.writable_bookies(), rng=self.world.rng,
            add_timeout_ms=self.parameters.add_timeout_ms,
        )
        driver = self.driver = RecoveryDriver(self, core, MASTER_KEY, on_result=lambda action: self._result(driver, action),
                                              on_finished=lambda: self._driver_finished(driver))
        self.world.log(f"{self.name} recovers ledger {metadata.ledger_id}")
        self.after(RECOVERY_MS_MAX, self._give_up, core)
        driver.start()

    def _give_up(self, core: RecoveryCore) -> None:
        if self.core is core:
            self.given_up += 1
            stuck = self.stuck_when_given_up[core.metadata.ledger_id] = self._stuck(core)
            self.world.log(f"{self.name} gives up recovering ledger {core.metadata.ledger_id} ({stuck})")
            self._finished()

    def _stuck(self, core: RecoveryCore) -> StuckRecovery:
        fence_errors = dict(sorted(self.driver.fence_errors.items())) if core.phase is Phase.FENCING and self.driver else {}
        return StuckRecovery(core.phase, undecided_entry(core), fence_errors)

    def stuck_on(self, ledger_id: int) -> StuckRecovery | None:
        """Where recovery of `ledger_id` waits: the recovery running now,
        if it has got as far as an entry it cannot decide or a fence read
        that failed, or else the last one given up."""
        if self.core is not None and self.core.metadata.ledger_id == ledger_id:
            stuck = self._stuck(self.core)
            if stuck.entry_id is not None or stuck.fence_errors:
                return stuck
        return self.stuck_when_given_up.get(ledger_id)

    def _finished(self) -> None:
        self._let_go()
        delay_ms = RETRY_MS if self.targets else self.world.exponential(self.idle_ms_mean)
        self.after(delay_ms, self._next)

    def _result(self, driver: RecoveryDriver, action: RecoveryDone | RecoveryFailed) -> None:
        ledger_id = driver.core.metadata.ledger_id
        if type(action) is RecoveryDone:
            self.recovered += 1
            fenced_ensemble = driver.core.metadata.last_ensemble[1]  # as marked; the rewriter's changes are its own
            if driver.core.writer is not None and not all(self.network.nodes[bookie_id].up for bookie_id in fenced_ensemble):
                self.recovered_with_a_bookie_down += 1
            self.world.log(f"{self.name} recovered ledger {ledger_id}: last entry {action.metadata.last_entry_id}")
        else:
            self.failed += 1
            self.world.log(f"{self.name} recovery of ledger {ledger_id} failed: {type(action.error).__name__}")

    def _driver_finished(self, driver: RecoveryDriver) -> None:
        if self.driver is driver:
            self._finished()


def undecided_entry(core: RecoveryCore) -> int | None:
    """The entry a recovery is waiting to decide (present or absent), from
    the core's public state: the start entry while reading its length, then
    the rewriter's next entry (entries are decided, and handed to the
    rewriter, in order) until the first absent one ends the ledger. None
    while marking or fencing, and once the end is known."""
    if core.phase is Phase.LENGTH:
        return core.start_entry_id
    if core.phase is Phase.READING and core.last_entry_id is None and core.writer is not None:
        return core.writer.next_entry_id
    return None
