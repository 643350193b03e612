"""Ownership rules of a broker, pure: the dispatch lease that a broker's
ZooKeeper session gives it, and which broker takes an unowned partition.

The lease: a ZooKeeper reply to a request sent at t shows the broker's
session alive at t, so it cannot have expired (and no other broker can own
this broker's partitions) before t plus the session timeout. Subscriptions
deliver only within the lease, with a margin (`LEASE_FRACTION` of the
timeout): a broker cut off from ZooKeeper, or paused, stops delivering
before another could take its partitions over. The trio broker
(broker/lease.py, BrokerServer._lease_loop) and the simulator
(sim/broker_node.py) both keep their lease with `LeaseCore`.
"""

from __future__ import annotations

import hashlib

LEASE_FRACTION = 0.6  # of the session timeout a ZooKeeper reply lets subscriptions deliver for


class LeaseCore:
    def __init__(self, session_timeout_ms: float, *, fraction: float = LEASE_FRACTION) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"a lease is a fraction of the session timeout in (0, 1], got {fraction}")
        self.session_timeout_ms = session_timeout_ms
        self.fraction = fraction
        self.until_ms = float("-inf")  # nothing is delivered before the first renewal

    def valid(self, now_ms: float) -> bool:
        return now_ms < self.until_ms

    def renewed(self, sent_ms: float, now_ms: float) -> bool:
        """A request sent at `sent_ms` was answered in the current session.
        True when that made a lapsed lease valid again (wake the subscriptions)."""
        lapsed = not self.valid(now_ms)
        self.until_ms = max(self.until_ms, sent_ms + self.session_timeout_ms * self.fraction)
        return lapsed and self.valid(now_ms)

    def lost(self) -> None:
        """The session expired: nothing is delivered until a new one renews it."""
        self.until_ms = float("-inf")


def rendezvous_choice(partition: str, broker_ids: list[str]) -> str:
    """The broker that takes an unowned partition: the highest hash of
    (broker, partition). Stable, and only the partitions of a broker that
    leaves move."""
    assert broker_ids, "no broker to choose from"
    return max(broker_ids, key=lambda broker_id: hashlib.blake2b(f"{broker_id}\0{partition}".encode(), digest_size=8).digest())


__all__ = ["LEASE_FRACTION", "LeaseCore", "rendezvous_choice"]
