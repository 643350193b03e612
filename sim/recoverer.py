"""A simulated recoverer: picks a ledger that is not closed (as a broker
taking over a topic would) and recovers it through the real `RecoveryCore`,
carrying out its fencing reads, recovery reads, recovery adds and metadata
writes the way `ledger_client.recovery` does with trio. It can say where a
recovery that does not end waits, for the liveness phase's verdict."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from bookie.protocol.entry_format import DigestManager, DigestMismatchError, EntryFormatError
from bookie.protocol.wire import LAST_ADD_CONFIRMED, AddFlag, ReadFlag, ReadRequest, Status
from ledger_client.metadata import LedgerMetadata
from ledger_client.recovery_core import (
    FenceRead,
    Phase,
    RecoveryCore,
    RecoveryDone,
    RecoveryFailed,
    RecoveryRead,
)
from ledger_client.write_core import SendAdd, WriteMetadata
from sim.client_node import SimClient, answer_metadata_write
from sim.parameters import SimParameters
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
        self.core: RecoveryCore | None = None
        self._choosing = False
        self.given_up = 0
        self.digest_mismatches = 0  # recovery reads answered OK with bytes that fail the digest
        # ledger -> where the last recovery of it that was given up waited
        self.stuck_when_given_up: dict[int, StuckRecovery] = {}
        self._fence_errors: dict[str, int] = {}  # bookie -> entry its fence read could not read (IO_ERROR)
        self.recovered = 0
        self.recovered_with_a_bookie_down = 0  # closed while a bookie of the fenced ensemble was down
        self.failed = 0
        self.start()

    def start(self) -> None:
        super().start()
        self.core = None
        self._choosing = False
        self.after(self.world.exponential(self.idle_ms_mean), self._next)

    def crash(self) -> None:
        super().crash()
        self.core = None
        self.world.log(f"{self.name} crashed")

    def recover_all(self, ledger_ids: list[int]) -> None:
        """Liveness: recover these ledgers one after the other, retrying."""
        self.targets = list(ledger_ids)
        self.idle_ms_mean = 0.0

    # --- choosing a ledger ------------------------------------------------------------

    def _next(self) -> None:
        if self.core is not None or self._choosing or not (self.active or self.targets):
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
        self.core = self.recovery_core_class(
            metadata, version, digest, bookies=self.writable_bookies(), rng=self.world.rng,
            add_timeout_ms=self.parameters.add_timeout_ms,
        )
        self._fence_errors = {}
        self.world.log(f"{self.name} recovers ledger {metadata.ledger_id}")
        self.after(RECOVERY_MS_MAX, self._give_up, self.core)
        self._execute(self.core, self.core.start(self.world.now_ms))

    def _give_up(self, core: RecoveryCore) -> None:
        if self.core is core:
            self.given_up += 1
            stuck = self.stuck_when_given_up[core.metadata.ledger_id] = self._stuck(core)
            self.world.log(f"{self.name} gives up recovering ledger {core.metadata.ledger_id} ({stuck})")
            self._finished()

    def _stuck(self, core: RecoveryCore) -> StuckRecovery:
        fence_errors = dict(sorted(self._fence_errors.items())) if core.phase is Phase.FENCING else {}
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
        self.core = None
        delay_ms = RETRY_MS if self.targets else self.world.exponential(self.idle_ms_mean)
        self.after(delay_ms, self._next)

    # --- carrying out the core's actions ------------------------------------------------

    def _execute(self, core: RecoveryCore, actions: list) -> None:
        ledger_id = core.metadata.ledger_id
        sends: list[SendAdd] = []
        for action in actions:
            kind = type(action)
            if kind is FenceRead:
                self.call(
                    action.bookie_id,
                    lambda request_id: ReadRequest(request_id, ReadFlag.FENCE, ledger_id, LAST_ADD_CONFIRMED, MASTER_KEY),
                    functools.partial(self._on_fence, core, action.bookie_id),
                )
            elif kind is RecoveryRead:
                flags = ReadFlag.FENCE if action.fence else ReadFlag.NONE
                entry_id = action.entry_id
                self.call(
                    action.bookie_id,
                    lambda request_id, flags=flags, entry_id=entry_id: ReadRequest(request_id, flags, ledger_id, entry_id, MASTER_KEY),
                    functools.partial(self._on_read, core, action.bookie_id, entry_id),
                )
            elif kind is SendAdd:
                sends.append(action)
            elif kind is WriteMetadata:
                self.write_metadata(action, functools.partial(self._on_metadata, core))
            elif kind is RecoveryDone:
                self.recovered += 1
                fenced_ensemble = core.metadata.last_ensemble[1]  # as marked; the rewriter's changes are its own
                if core.writer is not None and not all(self.network.nodes[bookie_id].up for bookie_id in fenced_ensemble):
                    self.recovered_with_a_bookie_down += 1
                self.world.log(f"{self.name} recovered ledger {ledger_id}: last entry {action.metadata.last_entry_id}")
            elif kind is RecoveryFailed:
                self.failed += 1
                self.world.log(f"{self.name} recovery of ledger {ledger_id} failed: {type(action.error).__name__}")
            else:
                raise AssertionError(f"unknown recovery action {action!r}")
        if sends:  # (the rewriter's add timeout acts, its tick)
            self.send_add_batches(sends, AddFlag.RECOVERY_ADD, MASTER_KEY, functools.partial(self._on_add, core))
        if core.phase not in (Phase.NEW, Phase.MARKING, Phase.FENCING):
            self.checker.fence_complete(ledger_id)
        if core.result is not None:
            if self.core is core:
                self._finished()
            return
        self.arm_core_timer(core.next_deadline_ms(), functools.partial(self._tick, core))

    def _on_fence(self, core: RecoveryCore, bookie_id: str, response: Any) -> None:
        if self.core is not core:
            return
        if response is None:
            actions = core.fence_response(bookie_id, None, -1, None, self.world.now_ms)
        else:
            if response.status is Status.IO_ERROR:
                self._fence_errors[bookie_id] = response.entry_id
            else:
                self._fence_errors.pop(bookie_id, None)
            actions = core.fence_response(bookie_id, response.status, response.last_add_confirmed, response.entry, self.world.now_ms)
        self._execute(core, actions)

    def _on_read(self, core: RecoveryCore, bookie_id: str, entry_id: int, response: Any) -> None:
        if self.core is not core:
            return
        status, entry = (None, None) if response is None else (response.status, response.entry)
        if status is Status.OK and entry is not None and not intact(core.digest, entry, entry_id):
            self.digest_mismatches += 1  # a corrupt copy served as OK: the core counts it neither present nor absent
        self._execute(core, core.read_response(bookie_id, entry_id, status, entry, self.world.now_ms))

    def _on_add(self, core: RecoveryCore, bookie_id: str, entry_id: int, status: Any) -> None:
        if self.core is not core:
            return
        core.bookies_changed(self.writable_bookies())
        self._execute(core, core.add_response(bookie_id, entry_id, status, self.world.now_ms))

    def _on_metadata(self, core, outcome: str, value: Any) -> None:
        if self.core is not core:
            return
        self._execute(core, answer_metadata_write(core, outcome, value, self.world.now_ms))

    def _tick(self, core: RecoveryCore) -> None:
        if self.core is not core:
            return
        core.bookies_changed(self.writable_bookies())
        self._execute(core, core.tick(self.world.now_ms))


def intact(digest: DigestManager, entry: bytes, entry_id: int) -> bool:
    try:
        digest.decode(entry, expected_entry_id=entry_id)
    except (DigestMismatchError, EntryFormatError):
        return False
    return True


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
