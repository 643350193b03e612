"""Ownership rules of a broker, pure: the dispatch lease that a broker's
ZooKeeper session gives it, which broker takes an unowned partition, and
what a lookup answers given who owns the partition.

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

import enum
import hashlib
from dataclasses import dataclass

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


class Answer(enum.Enum):
    SERVE = "serve"  # this broker's session owns it: load it (if it is not loaded) and serve it
    CLAIM = "claim"  # nobody owns it and this broker is the one to take it: claim it, then decide again
    ELSEWHERE = "elsewhere"  # another broker owns it: the client goes there
    REDIRECT = "redirect"  # nobody owns it: the client asks that broker, with authority
    RETRY = "retry"  # not decidable now (this broker's previous session still holds it, say): ask again


@dataclass(frozen=True, slots=True)
class Decision:
    answer: Answer
    broker_id: str | None = None  # for ELSEWHERE and REDIRECT
    reason: str = ""  # for RETRY


def decide_lookup(partition: str, broker_id: str, session_id: int, owner: tuple[str, int] | None, live: list[str], *,
                  stopping: bool, authoritative: bool) -> Decision:
    """What a broker answers a lookup of `partition`, given its owner
    ((broker id, session) of the ownership node, or None) and the live
    brokers. A broker that is stopping takes nothing; an unowned partition
    goes to the broker rendezvous hashing picks, unless the lookup is
    authoritative (that broker sent the client here)."""
    if owner is not None:
        owner_id, owner_session = owner
        if owner_id == broker_id and owner_session == session_id:
            return Decision(Answer.SERVE)
        if owner_id == broker_id:
            return Decision(Answer.RETRY, reason=f"{partition} is still held by this broker's previous session; retry")
        return Decision(Answer.ELSEWHERE, owner_id)
    if stopping:
        others = sorted(other for other in live if other != broker_id)
        if not others:
            return Decision(Answer.RETRY, reason=f"broker {broker_id} is stopping and no other broker is live")
        return Decision(Answer.REDIRECT, rendezvous_choice(partition, others))
    if not authoritative and live:
        chosen = rendezvous_choice(partition, sorted(live))
        if chosen != broker_id:
            return Decision(Answer.REDIRECT, chosen)
    return Decision(Answer.CLAIM)


__all__ = ["LEASE_FRACTION", "Answer", "Decision", "LeaseCore", "decide_lookup", "rendezvous_choice"]
