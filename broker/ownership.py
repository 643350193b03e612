"""Brokers and who owns which partition, through ZooKeeper.

A broker registers an ephemeral node under /brokers with its address. A
partition is owned by the broker holding the ephemeral node
/owners/<partition>; when that broker dies or loses its ZooKeeper session
the node goes, and the next lookup gives the partition to another broker.
An unowned partition goes to the broker that rendezvous hashing picks among
the live ones, so that partitions spread over brokers and every broker
picks the same one.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass, field

import trio

from broker.topic_records import BROKERS, broker_path, owner_path
from coordination.async_store import AsyncMetadataStore
from coordination.retry import RetryPolicy
from coordination.store import BadVersionError, MetadataError, NodeExistsError, NoNodeError

log = logging.getLogger(__name__)
# Delays between tries of a registration that ZooKeeper failed after a
# session loss: growing over the first tries, then `delay_max_ms` each.
REGISTRATION_RETRY = RetryPolicy(tries_max=10, delay_initial_ms=100.0, delay_max_ms=2_000.0)


INTERNAL_LISTENER = "internal"


class NoSuchListenerError(ValueError):
    """A client asked for a listener a broker does not advertise."""


@dataclass(frozen=True)
class BrokerInfo:
    """A broker as its registration says. `address` is its internal
    listener's host:port (what brokers and clients use unless a client names
    another listener); `listeners` maps every advertised listener's name to
    its host:port (Pulsar's `advertisedListeners`), the internal one
    included."""

    broker_id: str
    address: str
    listeners: dict[str, str] = field(default_factory=dict, hash=False)
    # Its Pulsar listeners, by the same names (Pulsar clients name one with
    # `listenerName`); empty when it serves no Pulsar listener.
    pulsar_listeners: dict[str, str] = field(default_factory=dict, hash=False)
    # The same over TLS (quire's protocol; Pulsar's pulsar+ssl://), by
    # listener name; empty when it serves no TLS listener.
    tls_listeners: dict[str, str] = field(default_factory=dict, hash=False)
    pulsar_tls_listeners: dict[str, str] = field(default_factory=dict, hash=False)
    # Its web service (REST admin API, HTTP lookup), over HTTP and HTTPS, by
    # listener name; empty when it serves none.
    web_listeners: dict[str, str] = field(default_factory=dict, hash=False)
    web_tls_listeners: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.listeners.get(INTERNAL_LISTENER, self.address) != self.address:
            raise ValueError(f"the internal listener ({self.listeners[INTERNAL_LISTENER]}) is the advertised address ({self.address})")
        if INTERNAL_LISTENER not in self.listeners:
            object.__setattr__(self, "listeners", {INTERNAL_LISTENER: self.address, **self.listeners})

    def address_for(self, listener: str | None, *, tls: bool = False) -> str:
        """The host:port of `listener` (None: the internal one), over TLS if `tls`."""
        if listener is None and not tls:
            return self.address
        listeners = self.tls_listeners if tls else self.listeners
        try:
            return listeners[INTERNAL_LISTENER if listener is None else listener]
        except KeyError:
            kind = "TLS listener" if tls else "listener"
            name = "internal" if listener is None else listener[:100]
            raise NoSuchListenerError(f"broker {self.broker_id} advertises no {kind} named {name!r} "
                                      f"(it has: {', '.join(sorted(listeners)) or 'none'})") from None

    def pulsar_address_for(self, listener: str | None, *, tls: bool = False) -> str | None:
        """The host:port of its Pulsar listener `listener` (None: the
        internal one), over TLS if `tls`; None if it has no such listener."""
        listeners = self.pulsar_tls_listeners if tls else self.pulsar_listeners
        return listeners.get(INTERNAL_LISTENER if listener is None else listener)

    def web_url_for(self, listener: str | None, *, tls: bool = False) -> str | None:
        """The http:// (https:// if `tls`) URL of its web service `listener`
        (None: the internal one); None if it has no such listener."""
        listeners = self.web_tls_listeners if tls else self.web_listeners
        address = listeners.get(INTERNAL_LISTENER if listener is None else listener)
        return None if address is None else f"{'https' if tls else 'http'}://{address}"

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "BrokerInfo":
        fields = json.loads(data)
        return cls(fields["broker_id"], fields["address"], dict(fields.get("listeners") or {}),
                   dict(fields.get("pulsar_listeners") or {}), dict(fields.get("tls_listeners") or {}),
                   dict(fields.get("pulsar_tls_listeners") or {}), dict(fields.get("web_listeners") or {}),
                   dict(fields.get("web_tls_listeners") or {}))


@dataclass(frozen=True)
class Owner:
    info: BrokerInfo
    session_id: int  # the owning ZooKeeper session


async def list_brokers(store: AsyncMetadataStore) -> dict[str, BrokerInfo]:
    """The registered brokers, by id (one that goes while we read is skipped)."""
    try:
        names = await store.children(BROKERS)
    except NoNodeError:
        return {}
    brokers = {}
    for name in names:
        try:
            data, _ = await store.get(broker_path(name))
        except NoNodeError:
            continue
        brokers[name] = BrokerInfo.from_bytes(data)
    return brokers


class Ownership:
    def __init__(
        self,
        store: AsyncMetadataStore,
        info: BrokerInfo,
        *,
        stale_wait_s: float = 30.0,
        retry: RetryPolicy = REGISTRATION_RETRY,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.info = info
        self.stale_wait_s = stale_wait_s  # waiting this long for a stale node is worth a warning
        self.retry = retry
        self.rng = rng if rng is not None else random.Random()
        self.stale_owner: int | None = None  # the other session holding our node while we wait for it

    async def register(self) -> None:
        """Create this broker's ephemeral node under /brokers. A node of
        another session (this broker's previous process, killed before its
        session expired) is waited out: ZooKeeper deletes it when that
        session expires. It is never deleted by us: if it outlives its
        session timeout, another live process uses this broker id, and
        taking its node would hide that. Waits as long as that takes; the
        caller bounds it (the start-up deadline). ZooKeeper errors
        propagate."""
        path = broker_path(self.info.broker_id)
        data = self.info.to_bytes()
        self.stale_owner = None  # as found by this try, not an earlier one
        while True:
            try:
                await self.store.create(path, data, ephemeral=True, make_parents=True)
                break
            except NodeExistsError:
                pass
            stat, gone = await self.store.exists_watch(path)
            if stat is None:
                self.stale_owner = None
                continue
            # The session now: a node of our own (a try whose answer was
            # lost) is ours; bring its address up to date.
            if stat.ephemeral_owner == self.store.session_id:
                await self.store.set(path, data)
                break
            if self.stale_owner != stat.ephemeral_owner:
                log.warning(
                    "broker %s is still registered by another ZooKeeper session (0x%x), probably its previous "
                    "process; waiting for that session to expire", self.info.broker_id, stat.ephemeral_owner,
                )
            self.stale_owner = stat.ephemeral_owner
            # The watch also fires when our connection drops: then look again.
            with trio.move_on_after(self.stale_wait_s) as waiting:
                await gone.wait()
            if waiting.cancelled_caught:
                log.warning(
                    "broker %s is still registered by ZooKeeper session 0x%x after %.0fs: is another broker running "
                    "with this id? still waiting", self.info.broker_id, stat.ephemeral_owner, self.stale_wait_s,
                )
        self.stale_owner = None
        log.info("registered broker %s at %s", self.info.broker_id, path)

    async def register_with_retries(self) -> None:
        """`register`, tried again with backoff and jitter whenever
        ZooKeeper fails it (the connection or the session lost, and also a
        refusal: the broker serves, and must not stop over its
        registration), until it succeeds: unbounded in tries (a broker that
        gave up would serve unregistered for good), bounded in delay;
        cancel it to stop."""
        delays_ms = self.retry.iter_delays_ms(self.rng)
        while True:
            try:
                await self.register()
                return
            except MetadataError as error:
                delay_ms = next(delays_ms, self.retry.delay_max_ms)
                log.warning("registering broker %s failed (%s); trying again in %.1fs", self.info.broker_id, error, delay_ms / 1000)
                await trio.sleep(delay_ms / 1000)

    def problem(self) -> str | None:
        """Why registration is not done yet, for the start-up error line."""
        if self.stale_owner is None:
            return None
        return (
            f"{broker_path(self.info.broker_id)} is still held by another ZooKeeper session (0x{self.stale_owner:x}) "
            f"that has not expired: is another broker running with id {self.info.broker_id}?"
        )

    async def unregister(self) -> None:
        try:
            await self.store.delete(broker_path(self.info.broker_id))
        except NoNodeError:
            pass

    async def registered(self) -> bool:
        """Whether this broker's registration is in ZooKeeper, held by its
        own session (a ZooKeeper read: it also says the session works)."""
        try:
            _, stat = await self.store.get(broker_path(self.info.broker_id))
        except NoNodeError:
            return False
        return stat.ephemeral_owner == self.store.session_id

    async def live_brokers(self) -> dict[str, BrokerInfo]:
        return await list_brokers(self.store)

    async def owner_of(self, partition: str) -> Owner | None:
        try:
            data, stat = await self.store.get(owner_path(partition))
        except NoNodeError:
            return None
        return Owner(BrokerInfo.from_bytes(data), stat.ephemeral_owner)

    async def claim(self, partition: str) -> Owner:
        """Take the partition if nobody owns it; returns its owner (this
        broker, or whoever got there first)."""
        # The session taken before the create: one that ended and was
        # replaced while it ran must not be named as the node's (its node
        # went with it), or this broker would serve a partition it holds no
        # node for. The ownership core refuses a session that is not current.
        session_id = self.store.session_id
        try:
            await self.store.create(owner_path(partition), self.info.to_bytes(), ephemeral=True, make_parents=True)
            return Owner(self.info, session_id)
        except NodeExistsError:
            owner = await self.owner_of(partition)
            if owner is None:
                return await self.claim(partition)
            return owner

    def is_mine(self, owner: Owner) -> bool:
        return owner.info.broker_id == self.info.broker_id and owner.session_id == self.store.session_id

    async def release(self, partition: str, session_id: int | None = None) -> None:
        """Give the partition up, if `session_id` (default: this broker's
        current session) still holds it: the node read is deleted at its
        version, so that a node another owner created meanwhile stays."""
        if session_id is None:
            session_id = self.store.session_id
        try:
            data, stat = await self.store.get(owner_path(partition))
        except NoNodeError:
            return
        owner = Owner(BrokerInfo.from_bytes(data), stat.ephemeral_owner)
        if owner.info.broker_id == self.info.broker_id and owner.session_id == session_id:
            try:
                await self.store.delete(owner_path(partition), stat.version)
            except (NoNodeError, BadVersionError):
                pass  # gone, or another owner's by now


__all__ = ["BrokerInfo", "Owner", "Ownership", "list_brokers"]
