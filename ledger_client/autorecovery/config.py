"""Auto-recovery's settings, with BookKeeper's names where it has them."""

from __future__ import annotations

from dataclasses import dataclass

LOST_BOOKIE_DELAY_MS_DEFAULT = 30_000.0  # lostBookieRecoveryDelay (BookKeeper's default is 0)
OPEN_LEDGER_GRACE_MS_DEFAULT = 30_000.0  # openLedgerRereplicationGracePeriod
AUDIT_INTERVAL_MS_DEFAULT = 600_000.0  # auditorPeriodicBookieCheckInterval (BookKeeper: a day)


@dataclass(frozen=True)
class AutoRecoveryConfig:
    """`lost_bookie_delay_ms`: how long a bookie must be gone from the
    registry before its ledgers are marked. `audit_interval_ms`: the
    periodic full check. `open_ledger_grace_ms`: how long an open ledger's
    last fragment is left to its writer before the ledger is fenced.
    `ledgers_in_flight_max` ledgers are re-replicated at once per worker,
    each with at most `entries_in_flight_max` entries being copied.
    `passwords`: the ledger passwords the worker may use (the metadata keeps
    only a hash; BookKeeper's bookieRecoveryPasswd). Failed ledgers are
    tried again after `retry_delay_ms_initial`, doubling up to
    `retry_delay_ms_max`. `auditor` / `worker` say which parts run."""

    lost_bookie_delay_ms: float = LOST_BOOKIE_DELAY_MS_DEFAULT
    audit_interval_ms: float = AUDIT_INTERVAL_MS_DEFAULT
    open_ledger_grace_ms: float = OPEN_LEDGER_GRACE_MS_DEFAULT
    ledgers_in_flight_max: int = 2
    entries_in_flight_max: int = 256
    passwords: tuple[bytes, ...] = (b"",)
    retry_delay_ms_initial: float = 1_000.0
    retry_delay_ms_max: float = 60_000.0
    auditor: bool = True
    worker: bool = True

    def __post_init__(self) -> None:
        for name in ("lost_bookie_delay_ms", "open_ledger_grace_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in ("audit_interval_ms", "retry_delay_ms_initial"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.retry_delay_ms_max < self.retry_delay_ms_initial:
            raise ValueError("retry_delay_ms_max must be at least retry_delay_ms_initial")
        for name in ("ledgers_in_flight_max", "entries_in_flight_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not all(isinstance(password, bytes) for password in self.passwords):
            raise TypeError("passwords must be bytes")


__all__ = ["AutoRecoveryConfig"]
