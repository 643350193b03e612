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

import hashlib
import json
import logging
from dataclasses import asdict, dataclass

import trio

from broker.topic_store import BROKERS, broker_path, owner_path
from coordination.async_store import AsyncMetadataStore
from coordination.store import NodeExistsError, NoNodeError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BrokerInfo:
    broker_id: str
    address: str  # host:port clients connect to

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "BrokerInfo":
        return cls(**json.loads(data))


@dataclass(frozen=True)
class Owner:
    info: BrokerInfo
    session_id: int  # the owning ZooKeeper session


def rendezvous_choice(partition: str, broker_ids: list[str]) -> str:
    """The broker with the highest hash of (broker, partition): stable, and
    only the partitions of a broker that leaves move."""
    assert broker_ids, "no broker to choose from"
    return max(broker_ids, key=lambda broker_id: hashlib.blake2b(f"{broker_id}\0{partition}".encode(), digest_size=8).digest())


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
    def __init__(self, store: AsyncMetadataStore, info: BrokerInfo, *, stale_wait_s: float = 30.0) -> None:
        self.store = store
        self.info = info
        self.stale_wait_s = stale_wait_s

    async def register(self) -> None:
        """Create this broker's ephemeral node. A node left by this broker's
        previous process (same id, another session) is waited out: it goes
        when that session expires."""
        path = broker_path(self.info.broker_id)
        with trio.move_on_after(self.stale_wait_s):
            while True:
                try:
                    await self.store.create(path, self.info.to_bytes(), ephemeral=True, make_parents=True)
                    return
                except NodeExistsError:
                    try:
                        _, stat = await self.store.get(path)
                    except NoNodeError:
                        continue
                    if stat.ephemeral_owner == self.store.session_id:
                        return
                    log.warning("broker %s is still registered by an earlier session; waiting for it to expire", self.info.broker_id)
                    await trio.sleep(0.5)
        raise RuntimeError(f"broker {self.info.broker_id} is registered by another live process")

    async def unregister(self) -> None:
        try:
            await self.store.delete(broker_path(self.info.broker_id))
        except NoNodeError:
            pass

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
        try:
            await self.store.create(owner_path(partition), self.info.to_bytes(), ephemeral=True, make_parents=True)
            return Owner(self.info, self.store.session_id)
        except NodeExistsError:
            owner = await self.owner_of(partition)
            if owner is None:
                return await self.claim(partition)
            return owner

    def is_mine(self, owner: Owner) -> bool:
        return owner.info.broker_id == self.info.broker_id and owner.session_id == self.store.session_id

    async def release(self, partition: str) -> None:
        """Give the partition up, if this session still holds it."""
        owner = await self.owner_of(partition)
        if owner is not None and self.is_mine(owner):
            try:
                await self.store.delete(owner_path(partition))
            except NoNodeError:
                pass


__all__ = ["BrokerInfo", "Owner", "Ownership", "list_brokers", "rendezvous_choice"]
