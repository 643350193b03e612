"""Known mistakes, planted on purpose (test-only): each is a subclass of a
real core that breaks one safety rule, so that tests can show the simulator
finds it. Production code never imports this module.

- `unfenced-recovery-reads`: recovery reads without the fence flag, so a
  bookie that missed the fencing keeps taking the old writer's adds while
  recovery decides that an entry is absent;
- `io-error-is-negative`: a corrupt replica's IO_ERROR counts as "no such
  entry", so one bad disk can truncate a ledger below an acknowledged entry;
- `ack-before-ensemble-written`: the writer uses a new ensemble (and
  acknowledges adds through the replacement) before the metadata that names
  it is written; if the write never lands, recovery reads the old ensemble.

One more is no safety mistake but a crash: `assert-in-write-core`, a write
core whose own invariant check fails (an assert) on entry 3, to show that a
crash in a run is reported as a failing seed and the batch goes on.
"""

from __future__ import annotations

from bookie.protocol.wire import Status
from ledger_client.recovery_core import RecoveryCore, RecoveryRead
from ledger_client.write_core import WriteCore


class UnfencedRecoveryReads(RecoveryCore):
    def _read_action(self, bookie_id: str, entry_id: int, fence: bool) -> RecoveryRead:
        return RecoveryRead(bookie_id, entry_id, False)


class IoErrorIsNegative(RecoveryCore):
    def _is_negative(self, status: Status | None) -> bool:
        return status in (Status.NO_ENTRY, Status.NO_LEDGER, Status.IO_ERROR)


class AckBeforeEnsembleWritten(WriteCore):
    def _maybe_change_ensemble(self, now_ms: float) -> list:
        actions = super()._maybe_change_ensemble(now_ms)
        proposed = self._change_in_flight
        if proposed is None or proposed is self.metadata:
            return actions
        # The mistake: take the proposed ensemble as if it were written.
        self.metadata = proposed
        return actions + self._adopt_ensemble(now_ms)

    def _deliver(self) -> list:
        if self._closing:
            return super()._deliver()
        in_flight, self._change_in_flight = self._change_in_flight, None
        try:
            return super()._deliver()
        finally:
            self._change_in_flight = in_flight


class AssertInWriteCore(WriteCore):
    def add(self, payload: bytes, now_ms: float) -> tuple[int, list]:
        entry_id, actions = super().add(payload, now_ms)
        assert entry_id != 3, "planted: the write core's invariant broke at entry 3"
        return entry_id, actions


# The mistakes that break a safety rule (each found by a checker).
SAFETY_MISTAKES = ("unfenced-recovery-reads", "io-error-is-negative", "ack-before-ensemble-written")

MISTAKES = {
    "unfenced-recovery-reads": {"recovery_core_class": UnfencedRecoveryReads},
    "io-error-is-negative": {"recovery_core_class": IoErrorIsNegative},
    "ack-before-ensemble-written": {"write_core_class": AckBeforeEnsembleWritten},
    "assert-in-write-core": {"write_core_class": AssertInWriteCore},
}
