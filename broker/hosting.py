"""The partitions a broker holds, in trio: the driver of `OwnershipCore`,
following the broker's ZooKeeper session and renewing its dispatch lease.

It loads a partition once this broker's session owns its node, serves it,
and hands it over (stop, release the node, tell the clients) when an
operator unloads it, when it fences itself, when the broker shuts down, or
at once, fenced, when the broker's ZooKeeper session goes. Loads and
unloads run as tasks of the broker, not of the request that caused them: a
client that gives up or goes away never cuts them (or their metadata
writes) short.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from broker.errors import BrokerError, NotOwnerError, ServiceUnavailableError, TopicFencedError
from broker.ownership import Owner, Ownership
from broker.ownership_core import (
    Access,
    CancelLoad,
    CloseClients,
    OwnershipCommand,
    OwnershipCore,
    Register,
    Release,
    StartLoad,
    StopPartition,
)
from broker.metrics import PartitionStats
from broker.topic import BrokerContext, PartitionService
from broker.topic_records import TopicPolicies
from coordination.async_store import AsyncMetadataStore
from coordination.retry import RetryPolicy
from coordination.store import MetadataError
from ledger_client import BKError

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 60.0
UNLOAD_TIMEOUT_S = 15.0  # a shutdown waits this long for its partitions to be handed over
LEASE_RENEWALS = 5  # renewals per session timeout
# Tries of a release that ZooKeeper failed while the session still holds the node.
RELEASE_RETRY = RetryPolicy(tries_max=5, delay_initial_ms=100.0, delay_max_ms=2_000.0)

PartitionPolicies = Callable[..., Awaitable[tuple[str, int, TopicPolicies]]]  # (partition, *, watch)


class PartitionHosting:
    def __init__(self, context: BrokerContext, store: AsyncMetadataStore, ownership: Ownership, *,
                 partition_policies: PartitionPolicies, close_clients: Callable[[PartitionService], None],
                 session_timeout_ms: float) -> None:
        self.context = context
        self.session_timeout_ms = session_timeout_ms
        self.store = store
        self.ownership = ownership
        self.partition_policies = partition_policies
        self.close_clients = close_clients  # tells a partition's producers and consumers to look it up again
        self.core = OwnershipCore(lease=context.lease.core)
        self.partitions: dict[str, PartitionService] = {}  # loaded: serving, or being unloaded
        self.retired_stats = PartitionStats()  # counts of the partitions no longer served here
        self._services: dict[str, PartitionService] = {}  # every partition held, loading ones included
        self._load_ended: dict[str, trio.Event] = {}
        self._load_scopes: dict[str, trio.CancelScope] = {}
        self._load_errors: dict[str, str] = {}  # why a partition's last load failed
        self._handed_over: dict[str, trio.Event] = {}  # set once a held partition is let go of
        self._deleting: dict[str, list[BaseException]] = {}  # partitions to delete once stopped, and what failed
        self._nursery: trio.Nursery | None = None

    @property
    def broker_id(self) -> str:
        return self.ownership.info.broker_id

    async def run(self, generation: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Follow the broker's ZooKeeper session; `generation` was read
        before the broker registered."""
        self.core.session_id = self.store.session_id
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._session_loop, generation)
            nursery.start_soon(self._lease_loop)
            nursery.start_soon(self.context.housekeeping.run)
            task_status.started()

    def _carry_out(self, commands: list[OwnershipCommand]) -> None:
        assert self._nursery is not None
        for command in commands:
            if isinstance(command, CancelLoad):
                scope = self._load_scopes.get(command.partition)
                if scope is not None:
                    scope.cancel()
            elif isinstance(command, StartLoad):
                self._load_ended[command.partition] = trio.Event()
                self._handed_over[command.partition] = trio.Event()
                self._nursery.start_soon(self._load, command.partition, command.session_id)
            elif isinstance(command, StopPartition):
                self._nursery.start_soon(self._stop, self._services[command.partition], command.graceful)
            elif isinstance(command, Release):
                self._nursery.start_soon(self._release, command.partition, command.session_id)
            elif isinstance(command, CloseClients):
                self._let_go(command.partition)
            else:
                assert isinstance(command, Register), f"unknown command {command!r}"
                self._nursery.start_soon(self._register_again)

    # --- the session --------------------------------------------------------------------------

    async def _session_loop(self, generation: int) -> None:
        """Follow the ZooKeeper session, in order. A loss: the ownership
        nodes are gone now, and another broker may take the partitions at
        once; stop serving them before anything else (no waiting for a new
        session). A new session: whatever the old one held is given up (if
        its loss was not seen), and the broker registers again."""
        losses = self.store.session_losses
        while True:
            new_losses, new_generation = await self.store.wait_session_news(losses, generation)
            if new_losses != losses:
                losses = new_losses
                log.warning("ZooKeeper session expired: unloading %d partitions", len(self.core.holdings))
                self._carry_out(self.core.session_lost())
            if new_generation != generation:
                generation = new_generation
                self._carry_out(self.core.session_started(self.store.session_id))

    async def _lease_loop(self) -> None:
        """Renew the dispatch lease: a ZooKeeper reply to a request sent at
        t shows the session alive at t, so it cannot have expired (and no
        other broker can own this broker's partitions) before t plus the
        session timeout. Subscriptions deliver only within the lease, with
        a margin: a broker cut off from ZooKeeper, or paused, stops
        delivering before another could take its partitions over."""
        timeout_s = self.session_timeout_ms / 1000
        while True:
            sent_at, session_id = trio.current_time(), self.store.session_id
            try:
                with trio.move_on_after(timeout_s / 2):
                    await self.store.exists("/")
                    if self.store.session_id == session_id:  # answered in the session it was sent in
                        self.context.lease.renew(sent_at, session_id)
            except MetadataError:
                pass
            await trio.sleep(timeout_s / LEASE_RENEWALS)

    async def _register_again(self) -> None:
        try:
            await self.ownership.register_with_retries()
        except MetadataError as error:
            log.error("cannot register again after a session loss: %s", error)

    # --- loading ------------------------------------------------------------------------------

    async def serving(self, partition: str, claimed: tuple[Owner, int] | None = None) -> PartitionService:
        """The loaded partition, loading it if this broker owns it.
        `claimed`: the owner a claim this broker just made answered (the
        node it created, with the session it was created in), and the count
        of releases taken before the claim; it needs no second read."""
        while True:
            access = self.core.access(partition)
            if access is Access.SERVE:
                return self.partitions[partition]
            if access is Access.MOVING:
                if self.core.held(partition) is not None:
                    raise TopicFencedError(f"partition {partition} is being unloaded from this broker; look it up again")
                if self.core.stopping:
                    raise NotOwnerError(f"broker {self.broker_id} is stopping")
                raise ServiceUnavailableError(f"broker {self.broker_id} has no ZooKeeper session; retry")
            if access is Access.WAIT:
                await self._load_ended[partition].wait()
                if self.core.access(partition) is not Access.SERVE:
                    raise ServiceUnavailableError(f"loading {partition} failed: {self._load_errors.get(partition, '?')}; retry")
                continue
            if claimed is not None:
                (owner, releases), claimed = claimed, None
            else:
                releases = self.core.releases
                owner = await self.ownership.owner_of(partition)
            if owner is None or not self.ownership.is_mine(owner):
                raise NotOwnerError(f"broker {self.broker_id} does not own {partition}")
            if self.core.access(partition) is Access.ABSENT:
                commands = self.core.claimed(partition, owner.session_id, releases)
                if not commands:
                    raise ServiceUnavailableError(f"the ownership of {partition} is changing; retry")
                self._carry_out(commands)

    async def _load(self, partition: str, session_id: int) -> None:
        """Load a partition, in its own cancel scope: the ownership core
        cancels a load whose session is gone."""
        ok = False
        scope = self._load_scopes[partition] = trio.CancelScope()
        try:
            with scope:
                # Read after the claim, not from a copy kept before it: the
                # topic may have been deleted meanwhile.
                topic, index, policies = await self.partition_policies(partition, watch=True)
                service = self._services[partition] = PartitionService(self.context, partition, topic, index, policies,
                                                                       session_id=session_id)
                with trio.fail_after(LOAD_TIMEOUT_S):
                    await service.load()
                assert self._nursery is not None
                await self._nursery.start(service.run)
                self.partitions[partition] = service
                self._load_errors.pop(partition, None)
                ok = True
                log.info("broker %s now serves %s", self.broker_id, partition)
            if scope.cancelled_caught:
                log.warning("loading %s cancelled: the ZooKeeper session that owned it is gone", partition)
                self._load_errors[partition] = "cancelled: the ZooKeeper session that owned it is gone"
        except (BKError, MetadataError, BrokerError, trio.TooSlowError) as error:
            log.warning("loading %s failed: %s", partition, error)
            self._load_errors[partition] = str(error)
        finally:
            del self._load_scopes[partition]
            self._carry_out(self.core.loaded(partition, ok))
            self._load_ended.pop(partition).set()

    # --- handing over -------------------------------------------------------------------------

    def request_unload(self, service: PartitionService, error: BrokerError) -> None:
        """The partition fenced itself."""
        if self._services.get(service.name) is service:
            self._carry_out(self.core.unload(service.name, graceful=False))

    async def _stop(self, service: PartitionService, graceful: bool) -> None:
        try:
            await service.unload(graceful=graceful)
        except (BrokerError, BKError, MetadataError) as error:
            log.warning("unloading %s: %s", service.name, error)
        failures = self._deleting.pop(service.name, None)
        if failures is not None and not self.core.may_delete(service.name):
            failures.append(TopicFencedError(f"{service.name} was not deleted: this broker lost its ownership while "
                                             f"unloading it; delete it again"))
        elif failures is not None:
            # Records first: a partition whose records are gone is gone, and
            # ledgers left behind are only space; the other way round, a
            # failure would leave records naming deleted ledgers.
            try:
                compaction = await self.context.topic_store.read_compaction(service.name)
                cursor_ledgers = await service.cursor_ledgers()
                await self.context.topic_store.delete_partition_records(service.name)
            except (BrokerError, BKError, MetadataError) as error:
                failures.append(error)
            else:
                # The records are gone: every kind of ledger is tried, a
                # failure of one leaving the others to go.
                steps = [lambda: service.delete_ledgers(cursor_ledgers), service.managed_ledger.delete]
                if compaction is not None:
                    steps.append(lambda: service.delete_compacted_ledgers(compaction[0]))
                for step in steps:
                    try:
                        await step()
                    except (BrokerError, BKError, MetadataError) as error:
                        failures.append(error)
        self._carry_out(self.core.stopped(service.name))

    async def _release(self, partition: str, session_id: int) -> None:
        """Delete the ownership node, trying again (with backoff) while the
        session that holds it is current; given up, the node goes with the
        session."""
        delays_ms = RELEASE_RETRY.iter_delays_ms(self.ownership.rng)
        while True:
            try:
                await self.ownership.release(partition, session_id)
                break
            except MetadataError as error:
                delay_ms = next(delays_ms, None)
                if delay_ms is None or self.core.session_id != session_id:
                    log.warning("releasing %s: %s (its node goes with the session)", partition, error)
                    break
                log.warning("releasing %s: %s; trying again in %.1fs", partition, error, delay_ms / 1000)
                await trio.sleep(delay_ms / 1000)
        self._carry_out(self.core.released(partition))

    def _let_go(self, partition: str) -> None:
        service = self._services.pop(partition, None)
        if service is not None:
            if self.partitions.get(partition) is service:
                del self.partitions[partition]
                for name in ("messages_in", "bytes_in", "messages_out"):
                    setattr(self.retired_stats, name, getattr(self.retired_stats, name) + getattr(service.stats, name))
            self.close_clients(service)
            log.info("broker %s let go of %s", self.broker_id, partition)
        self._handed_over.pop(partition).set()

    async def unload(self, partition: str, *, delete: bool = False) -> bool:
        """Hand a served partition over gracefully (with `delete`, its
        records and ledgers are deleted once it has stopped) and wait until
        its clients are told; False when it is not served here."""
        if self.core.access(partition) is not Access.SERVE:
            return False
        handed_over = self._handed_over[partition]
        failures: list[BaseException] = []
        if delete:
            self._deleting[partition] = failures  # the stop task fills it in
        self._carry_out(self.core.unload(partition, graceful=True))
        await handed_over.wait()
        if failures:
            raise failures[0]
        return True

    async def stop(self) -> None:
        """The broker shuts down: hand every partition over, within UNLOAD_TIMEOUT_S."""
        self._carry_out(self.core.stop())
        with trio.move_on_after(UNLOAD_TIMEOUT_S):
            for handed_over in list(self._handed_over.values()):
                await handed_over.wait()


__all__ = ["LOAD_TIMEOUT_S", "UNLOAD_TIMEOUT_S", "PartitionHosting"]
