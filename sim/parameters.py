"""The swarm of parameters one seed chooses: cluster size, E/WQ/AQ, how many
writers, readers and recoverers, which faults are on and how often. Swarm
testing (Groce et al.) turns fault kinds on and off per run, so that rare
combinations are not drowned out by the always-on ones."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

FAULT_KINDS = (
    "drop", "duplicate", "partition", "slow_link", "crash", "pause", "corrupt", "expire", "client_crash", "bookie_down",
)
# Each kind is on with this probability. "bookie_down" (a bookie crashed and
# kept down for a long stretch, so that recovery has to decide without it)
# is drawn after every other parameter: whether it is on leaves the other
# draws of a seed as they are without it.
FAULT_PROBABILITY = 0.6


@dataclass(frozen=True)
class SimParameters:
    seed: int
    bookies: int
    ensemble_size: int
    write_quorum: int
    ack_quorum: int
    writers: int
    readers: int
    recoverers: int
    # Faults (swarm): which kinds are on, and their rates.
    faults: tuple[str, ...]
    drop_probability: float
    duplicate_probability: float
    fault_interval_ms_mean: float  # time between two nemesis faults
    # The workload.
    entries_per_ledger_max: int
    add_window: int  # adds in flight per writer
    add_gap_ms_mean: float
    payload_bytes_max: int
    # Timing.
    latency_ms_min: float
    latency_ms_max: float
    slow_message_probability: float  # a message that takes far longer (reordering)
    fsync_ms_max: float
    slow_fsync_probability: float  # an fsync that takes up to SLOW_FSYNC_MS (a disk hiccup)
    recovery_interval_ms_mean: float  # between two recoveries of one recoverer
    write_cache_bytes: int
    session_timeout_ms: int
    add_timeout_ms: int
    read_timeout_ms: int
    safety_ms: int
    liveness_ms: int

    def describe(self) -> str:
        return describe_parameters(self)


def describe_parameters(parameters) -> str:
    """A run's parameters on one line, `name=value` each (faults joined by commas)."""
    fields = dataclasses.asdict(parameters)
    fields["faults"] = ",".join(parameters.faults) or "none"
    return " ".join(f"{name}={value}" for name, value in fields.items())


def choose_parameters(seed: int, **overrides) -> SimParameters:
    """Every parameter of a run, from its seed alone (overrides for tests)."""
    rng = random.Random(f"parameters-{seed}")
    bookies = rng.randint(3, 7)
    ensemble_size = rng.randint(2, min(bookies, 5))
    write_quorum = rng.randint(max(1, ensemble_size - 2), ensemble_size)
    ack_quorum = rng.randint(max(1, write_quorum - 2), write_quorum)
    faults = tuple(kind for kind in FAULT_KINDS if kind != "bookie_down" and rng.random() < FAULT_PROBABILITY)
    if write_quorum == 1:
        # One copy of each entry: the nemesis never corrupts the last intact
        # copy, so corruption could never happen. (Drawn first all the same,
        # so that the draws after it stay those of the seed.)
        faults = tuple(kind for kind in faults if kind != "corrupt")
    chosen = SimParameters(
        seed=seed,
        bookies=bookies,
        ensemble_size=ensemble_size,
        write_quorum=write_quorum,
        ack_quorum=ack_quorum,
        writers=rng.randint(1, 3),
        readers=rng.randint(0, 2),
        recoverers=rng.randint(0, 2),
        faults=faults,
        drop_probability=rng.choice([0.001, 0.01, 0.05]) if "drop" in faults else 0.0,
        duplicate_probability=rng.choice([0.001, 0.01, 0.05]) if "duplicate" in faults else 0.0,
        fault_interval_ms_mean=rng.choice([300.0, 1000.0, 3000.0]),
        entries_per_ledger_max=rng.choice([5, 30, 150]),
        add_window=rng.choice([1, 4, 16]),
        add_gap_ms_mean=rng.choice([0.5, 5.0, 50.0]),
        payload_bytes_max=rng.choice([16, 200, 2000]),
        latency_ms_min=0.05,
        latency_ms_max=rng.choice([0.5, 3.0, 20.0]),
        slow_message_probability=rng.choice([0.0, 0.01, 0.05]),
        fsync_ms_max=rng.choice([1.0, 5.0, 20.0]),
        slow_fsync_probability=rng.choice([0.0, 0.05]),
        recovery_interval_ms_mean=rng.choice([100.0, 1_000.0, 5_000.0]),
        write_cache_bytes=rng.choice([16 * 1024, 256 * 1024]),
        session_timeout_ms=rng.choice([2_000, 6_000]),
        add_timeout_ms=rng.choice([500, 2_000]),
        read_timeout_ms=rng.choice([500, 2_000]),
        safety_ms=rng.choice([5_000, 15_000]),
        liveness_ms=60_000,
    )
    if rng.random() < FAULT_PROBABILITY:
        chosen = dataclasses.replace(chosen, faults=faults + ("bookie_down",))
    return dataclasses.replace(chosen, **overrides)
