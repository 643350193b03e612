"""The swarm of parameters one seed chooses for a broker simulation: how
many brokers, producers and consumers, the subscription type, batching,
pipelining, acknowledgement habits, snapshot and cursor bounds, which
faults are on (swarm testing) and how often."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from broker.dispatcher import SubscriptionType
from broker.topic_records import TopicPolicies
from sim.parameters import describe_parameters

BROKER_FAULT_KINDS = (
    "drop",  # connections reset now and then (a message is lost with everything after it)
    "duplicate",  # clients send some requests twice
    "partition",
    "slow_link",
    "crash",  # a broker crashes (its memory is gone) and restarts
    "pause",  # a broker or a client stops, sometimes past its session timeout
    "expire",  # a broker's ZooKeeper session expires
    "storage_error",  # a bookie crashes (losing what it had not synced) or pauses, and comes back
    "client_crash",  # a producer or consumer crashes and restarts
    "unload",  # the owner unloads the partition gracefully (an operator's unload, a rebalance, a shutdown)
)
RANGES_PERSISTED_SMALL = 3  # a cursor record bound that real runs reach


@dataclass(frozen=True)
class BrokerSimParameters:
    seed: int
    brokers: int
    producers: int
    consumers: int
    subscription_type: str
    faults: tuple[str, ...]
    # Producers.
    messages_per_producer: int
    batch_messages_max: int  # 1: no batching
    pending_messages_max: int  # sent and not yet acknowledged, per producer
    send_gap_ms_mean: float
    batch_delay_ms: float
    sequence_gap_probability: float  # a producer skips sequence ids (explicit ids need not be contiguous)
    keys: int
    # Consumers.
    receiver_queue_size: int
    process_ms_mean: float
    nack_probability: float
    cumulative_ack_probability: float  # exclusive and failover only (as Pulsar's clients)
    ack_timeout_ms: float  # 0: none
    forget_probability: float  # a message taken and never acknowledged (the ack timeout brings it back)
    ack_group_ms: float
    negative_ack_delay_ms: float
    # The broker's bounds.
    read_error_probability: float  # a read of an entry to deliver again fails (storage_error)
    dedup_snapshot_entries: int  # entries between two snapshots of the deduplication map
    cursor_ranges_max: int  # individually acknowledged ranges a cursor record keeps
    # Faults and timing.
    break_probability: float
    duplicate_probability: float
    fault_interval_ms_mean: float
    latency_ms_min: float
    latency_ms_max: float
    slow_message_probability: float
    session_timeout_ms: int
    safety_ms: int
    # The partition's ledgers, on simulated bookies.
    bookies: int
    ensemble_size: int
    write_quorum: int
    ack_quorum: int
    rollover_entries: int
    fsync_ms_max: float
    write_cache_bytes: int
    add_timeout_ms: int
    read_timeout_ms: int
    liveness_ms: int

    def describe(self) -> str:
        return describe_parameters(self)

    @property
    def kind(self) -> SubscriptionType:
        return SubscriptionType(self.subscription_type)

    @property
    def policies(self) -> TopicPolicies:
        return TopicPolicies(ensemble_size=self.ensemble_size, write_quorum=self.write_quorum, ack_quorum=self.ack_quorum,
                             rollover_entries=self.rollover_entries, rollover_min_time_ms=0)


def choose_broker_parameters(seed: int, **overrides) -> BrokerSimParameters:
    """Every parameter of a broker run, from its seed alone (overrides for tests)."""
    rng = random.Random(f"broker-parameters-{seed}")
    faults = tuple(kind for kind in BROKER_FAULT_KINDS[:-1] if rng.random() < 0.6)
    kind = rng.choice([kind.value for kind in SubscriptionType])
    ordered = kind in (SubscriptionType.EXCLUSIVE.value, SubscriptionType.FAILOVER.value)
    ack_timeout_ms = rng.choice([0.0, 300.0, 2_000.0])
    chosen = BrokerSimParameters(
        seed=seed,
        brokers=rng.randint(2, 3),
        producers=rng.randint(1, 3),
        consumers=rng.randint(1, 3),
        subscription_type=kind,
        faults=faults,
        messages_per_producer=rng.choice([30, 100, 300]),
        batch_messages_max=rng.choice([1, 4, 16]),
        pending_messages_max=rng.choice([1, 8, 64]),
        send_gap_ms_mean=rng.choice([0.5, 5.0, 30.0]),
        batch_delay_ms=rng.choice([0.0, 1.0, 10.0]),
        sequence_gap_probability=rng.choice([0.0, 0.1]),
        keys=rng.choice([1, 3, 10]),
        receiver_queue_size=rng.choice([2, 10, 100]),
        process_ms_mean=rng.choice([0.5, 5.0, 20.0]),
        nack_probability=rng.choice([0.0, 0.05, 0.2]),
        cumulative_ack_probability=rng.choice([0.0, 0.3]) if ordered else 0.0,
        ack_timeout_ms=ack_timeout_ms,
        forget_probability=rng.choice([0.0, 0.05]) if ack_timeout_ms else 0.0,
        ack_group_ms=rng.choice([0.0, 1.0, 10.0]),
        negative_ack_delay_ms=rng.choice([10.0, 200.0]),
        read_error_probability=0.05 if "storage_error" in faults else 0.0,
        dedup_snapshot_entries=rng.choice([1, 5, 50]),
        cursor_ranges_max=rng.choice([RANGES_PERSISTED_SMALL, 10_000]),
        break_probability=rng.choice([0.001, 0.01, 0.03]) if "drop" in faults else 0.0,
        duplicate_probability=rng.choice([0.01, 0.1]) if "duplicate" in faults else 0.0,
        fault_interval_ms_mean=rng.choice([300.0, 1_000.0, 3_000.0]),
        latency_ms_min=0.05,
        latency_ms_max=rng.choice([0.5, 3.0, 20.0]),
        slow_message_probability=rng.choice([0.0, 0.01, 0.05]),
        session_timeout_ms=rng.choice([2_000, 6_000]),
        safety_ms=rng.choice([5_000, 15_000]),
        liveness_ms=60_000,
        # Drawn last, so that the draws above stay those of the seed.
        bookies=(bookies := rng.randint(3, 5)),
        ensemble_size=(ensemble_size := rng.randint(2, min(bookies - 1, 3))),
        write_quorum=(write_quorum := rng.randint(max(1, ensemble_size - 1), ensemble_size)),
        ack_quorum=rng.randint(max(1, write_quorum - 1), write_quorum),
        rollover_entries=rng.choice([3, 20, 1_000_000]),
        fsync_ms_max=rng.choice([1.0, 5.0, 20.0]),
        write_cache_bytes=rng.choice([16 * 1024, 256 * 1024]),
        add_timeout_ms=rng.choice([500, 2_000]),
        read_timeout_ms=rng.choice([500, 2_000]),
    )
    if rng.random() < 0.6:  # the last kind, drawn last (the draws above stay those of the seed)
        chosen = dataclasses.replace(chosen, faults=faults + ("unload",))
    return dataclasses.replace(chosen, **overrides)
