"""Ownership rules of a broker, pure: the dispatch lease that a broker's
ZooKeeper session gives it, which broker takes an unowned partition, what
a lookup answers given who owns the partition, and what a broker does with
the partitions it holds (`OwnershipCore`: loading only in its current
session, stopping everything when the session goes, the order of a
hand-over).

The lease: a ZooKeeper reply to a request sent at t shows the broker's
session alive at t, so it cannot have expired (and no other broker can own
this broker's partitions) before t plus the session timeout. Subscriptions
deliver only within the lease, with a margin (`LEASE_FRACTION` of the
timeout): a broker cut off from ZooKeeper, or paused, stops delivering
before another could take its partitions over. The trio broker
(broker/lease.py, broker/hosting.py) and the simulator (sim/broker_node.py)
both keep their lease with `LeaseCore` and their partitions with
`OwnershipCore` (the trio broker through broker/hosting.py).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

LEASE_FRACTION = 0.6  # of the session timeout a ZooKeeper reply lets subscriptions deliver for


class LeaseCore:
    """The lease of one session at a time: a partition delivers only within
    the lease of the session that owns it, so that a partition of a lost
    session (one still being handed over, say) never delivers on the
    renewals of the broker's next session."""

    def __init__(self, session_timeout_ms: float, *, fraction: float = LEASE_FRACTION) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"a lease is a fraction of the session timeout in (0, 1], got {fraction}")
        self.session_timeout_ms = session_timeout_ms
        self.fraction = fraction
        self.until_ms = float("-inf")  # nothing is delivered before the first renewal
        self.session_id = 0  # the session the lease is of

    def valid(self, now_ms: float, session_id: int = 0) -> bool:
        """Whether a partition owned by `session_id` may deliver now."""
        return now_ms < self.until_ms and session_id == self.session_id

    def renewed(self, sent_ms: float, now_ms: float, session_id: int = 0) -> bool:
        """A request sent at `sent_ms` in `session_id` was answered in that
        session. True when that made a lapsed lease valid again (wake the
        subscriptions)."""
        if session_id != self.session_id:
            self.session_id, self.until_ms = session_id, float("-inf")  # the lease of a new session
        lapsed = not self.valid(now_ms, session_id)
        self.until_ms = max(self.until_ms, sent_ms + self.session_timeout_ms * self.fraction)
        return lapsed and self.valid(now_ms, session_id)

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


# --- what a broker holds, and the order of a hand-over -----------------------------------


class Held(enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    UNLOADING = "unloading"  # stopping: the partition's writes finish (graceful) or are abandoned (fenced)
    RELEASING = "releasing"  # stopped: the ownership node is being deleted


class Access(enum.Enum):
    SERVE = "serve"  # loaded: serve the request
    WAIT = "wait"  # loading: wait for the load to end, then ask again
    ABSENT = "absent"  # not held: look the owner up (and claim it, as `decide_lookup` says)
    MOVING = "moving"  # being given up, or no session to own it with: the client looks it up again later


@dataclass(frozen=True, slots=True)
class StartLoad:
    """Load the partition, owned by `session_id`; then `loaded`."""

    partition: str
    session_id: int


@dataclass(frozen=True, slots=True)
class CancelLoad:
    """Stop the partition's load where it is (its session is gone, or it
    fenced itself); then `loaded` as failed."""

    partition: str


@dataclass(frozen=True, slots=True)
class StopPartition:
    """Unload the partition (gracefully, or fenced: nothing more is
    written); then `stopped`."""

    partition: str
    graceful: bool


@dataclass(frozen=True, slots=True)
class Release:
    """Delete the ownership node if `session_id` still holds it; then `released`."""

    partition: str
    session_id: int


@dataclass(frozen=True, slots=True)
class CloseClients:
    """Tell the partition's producers and consumers to look it up again."""

    partition: str


@dataclass(frozen=True, slots=True)
class Register:
    """A new session: register the broker again (its node went with the old one)."""


OwnershipCommand = StartLoad | CancelLoad | StopPartition | Release | CloseClients | Register


# How each event moves a partition's holding (None: not held). Anything
# else is a driver bug: it raises.
_HELD_TRANSITIONS: dict[tuple[Held | None, str], tuple[Held | None, ...]] = {
    (None, "claimed"): (Held.LOADING,),
    (Held.LOADING, "loaded"): (Held.SERVING, Held.UNLOADING),
    (Held.SERVING, "unload"): (Held.UNLOADING,),
    (Held.UNLOADING, "stopped"): (Held.RELEASING, None),
    (Held.RELEASING, "released"): (None,),
}


@dataclass(slots=True)
class _Holding:
    held: Held
    session_id: int  # the session that claimed it
    # Unloaded while it loaded: unload it once loaded (True: gracefully;
    # False: fenced, its session was lost or it fenced itself).
    stop_when_loaded: bool | None = None


class OwnershipCore:
    """The partitions a broker holds and what it does with them.

    Rules:
    - a partition is loaded only by the session that owns its node, and only
      while that session is the broker's current one;
    - the session lost, every partition served is stopped at once, fenced,
      and every load is cancelled, without waiting for a new session: the
      nodes are gone, and another broker may be loading the partitions
      already (a hand-over already under way goes on: its writes are
      compare-and-set, and fail where the next owner got there first, and
      it delivers nothing more, the lease being of one session);
    - a claim stands only if no release happened since the ownership was
      read (the node read may be one this broker has released meanwhile);
    - a partition is deleted only by the session that still holds it;
    - a hand-over goes: stop (writes finish or are abandoned), then release
      the node, then tell the clients, so that the lookup they make finds
      the partition free or taken by its next owner; a partition being
      handed over is neither served nor claimed again until its node is
      released (a release arriving after a new claim would delete the new
      node);
    - a broker that is stopping takes nothing.
    """

    def __init__(self, session_id: int | None = None, *, lease: LeaseCore | None = None) -> None:
        self.session_id = session_id  # None: no session (lost, and no new one yet)
        self.lease = lease  # lapses with the session: nothing is delivered until a new one renews it
        self.stopping = False
        self.holdings: dict[str, _Holding] = {}
        self.releases = 0  # releases so far: a claim on an ownership read before one is refused

    def access(self, partition: str) -> Access:
        holding = self.holdings.get(partition)
        if holding is None:
            return Access.MOVING if self.session_id is None or self.stopping else Access.ABSENT
        if holding.held is Held.SERVING:
            return Access.SERVE
        if holding.held is Held.LOADING and holding.stop_when_loaded is None:
            return Access.WAIT
        return Access.MOVING

    def held(self, partition: str) -> Held | None:
        holding = self.holdings.get(partition)
        return None if holding is None else holding.held

    def _move(self, partition: str, event: str, to: Held | None) -> None:
        before = self.held(partition)
        if to not in _HELD_TRANSITIONS.get((before, event), ()):
            raise AssertionError(f"{partition}: {event} while {before.value if before else 'not held'}")
        if to is None:
            del self.holdings[partition]
        else:
            self.holdings[partition].held = to

    def claimed(self, partition: str, session_id: int, releases: int) -> list[OwnershipCommand]:
        """This broker's `session_id` owns the partition's node, as read when
        `releases` was the count of releases: load it, unless it is held
        already, a release happened since (the node read may be gone), the
        session is no longer current, or the broker is stopping."""
        if partition in self.holdings or session_id != self.session_id or self.stopping or releases != self.releases:
            return []
        self.holdings[partition] = _Holding(Held.LOADING, session_id)
        return [StartLoad(partition, session_id)]

    def loaded(self, partition: str, ok: bool) -> list[OwnershipCommand]:
        self._move(partition, "loaded", Held.SERVING if ok else Held.UNLOADING)
        if not ok:
            return self.stopped(partition)
        holding = self.holdings[partition]
        if holding.stop_when_loaded is not None:
            return self.unload(partition, graceful=holding.stop_when_loaded)
        return []

    def unload(self, partition: str, *, graceful: bool) -> list[OwnershipCommand]:
        """Give a partition up (graceful: an operator's unload, a rebalance,
        a shutdown; else fenced: a write failed, or the session went)."""
        holding = self.holdings.get(partition)
        if holding is None:
            return []
        if holding.held is Held.LOADING:
            if not graceful:
                holding.stop_when_loaded = False
                return [CancelLoad(partition)]
            if holding.stop_when_loaded is None:
                holding.stop_when_loaded = True
            return []
        if holding.held is not Held.SERVING:
            return []  # being handed over already
        self._move(partition, "unload", Held.UNLOADING)
        return [StopPartition(partition, graceful)]

    def stopped(self, partition: str) -> list[OwnershipCommand]:
        """The partition has stopped writing: release its node, if the
        session that claimed it is still current (else it went with it)."""
        holding = self.holdings.get(partition)
        if holding is not None and holding.session_id == self.session_id:
            self._move(partition, "stopped", Held.RELEASING)
            return [Release(partition, holding.session_id)]
        self._move(partition, "stopped", None)
        return [CloseClients(partition)]

    def released(self, partition: str) -> list[OwnershipCommand]:
        """The node is deleted (or the driver gave up releasing it: it goes
        with the session, or is released by the next unload's lookup)."""
        self._move(partition, "released", None)
        self.releases += 1
        return [CloseClients(partition)]

    def may_delete(self, partition: str) -> bool:
        """Whether a stopped partition may be deleted: only while the
        session that claimed it still holds it (else another broker may
        serve it already)."""
        holding = self.holdings.get(partition)
        return (holding is not None and holding.held is Held.UNLOADING and holding.session_id == self.session_id
                and self.session_id is not None)

    def session_lost(self) -> list[OwnershipCommand]:
        if self.session_id is None:
            return []
        self.session_id = None
        if self.lease is not None:
            self.lease.lost()
        commands: list[OwnershipCommand] = []
        for partition in sorted(self.holdings):
            commands += self.unload(partition, graceful=False)
        return commands

    def session_started(self, session_id: int) -> list[OwnershipCommand]:
        """A new session (after a loss): whatever the old one held is being
        stopped; register again."""
        commands = self.session_lost() if session_id != self.session_id else []
        self.session_id = session_id
        if self.stopping:
            return commands  # unregistered on purpose
        # Also when it is the session this core already knew of: the
        # registration may have been made in the session before it.
        return [*commands, Register()]

    def stop(self) -> list[OwnershipCommand]:
        """The broker shuts down: take nothing more, unload everything gracefully."""
        self.stopping = True
        commands: list[OwnershipCommand] = []
        for partition in sorted(self.holdings):
            commands += self.unload(partition, graceful=True)
        return commands


__all__ = [
    "LEASE_FRACTION", "Access", "Answer", "CancelLoad", "CloseClients", "Decision", "Held", "LeaseCore", "OwnershipCommand",
    "OwnershipCore", "Register", "Release", "StartLoad", "StopPartition", "decide_lookup", "rendezvous_choice",
]
