"""A simulated broker process (as `broker/server.py` with its ownership):
client connections, the partition's ownership through an ephemeral node in
the simulated ZooKeeper, loading and unloading the partition, and routing
each request to it.

Its ZooKeeper client behaves as kazoo does: a call made in one session
fails once that session has expired, even if it arrives later; the broker
hears of the expiry from a failed call (its periodic session check, or any
other), gives the partition up and starts a new session.

Until it hears, it would go on serving what it loaded: a broker cut off
from ZooKeeper, or paused past its session timeout, would then deliver to
the consumers still connected to it messages they have since acknowledged
through the new owner. So the simulated broker holds a
lease, as the trio broker does, with the same rule (`LeaseCore`): a call
answered in its session proves the session alive until the call was sent
plus the session timeout (ZooKeeper expires a session only that long after
it last heard of it), and the subscription dispatches only within a part of
that (`dispatch-without-lease` in `sim.broker_mistakes` plants dispatching
without it, and the simulation finds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from broker.errors import BrokerStatus
from broker.managed_ledger_core import ManagedLedgerCore
from broker.ownership_core import (
    Access,
    Answer,
    CancelLoad,
    CloseClients,
    LeaseCore,
    OwnershipCommand,
    OwnershipCore,
    Register,
    Release,
    StartLoad,
    StopPartition,
    decide_lookup,
)
from broker.publish_core import PublishCore
from broker.subscription_core import SubscriptionCore
from broker.topic_records import owner_path
from coordination.store import NodeExistsError, NoNodeError, SessionExpiredError
from sim.broker_checker import BrokerChecker
from sim.broker_links import Connection, LinkedNode, Links
from sim.broker_messages import (
    PARTITION,
    Ack,
    Flow,
    ProducerOpen,
    Redeliver,
    Response,
    Send,
    SendReceipt,
    Subscribe,
)
from sim.broker_parameters import BrokerSimParameters
from sim.broker_calls import ConsumerLink, ProducerLink
from sim.broker_partition import SimPartition
from sim.broker_subscription import SimSubscription
from ledger_client.recovery_core import RecoveryCore
from ledger_client.write_core import WriteCore
from sim.bookie_node import LAYOUT
from sim.checker import SimChecker
from sim.client_node import BookieCalls
from sim.metadata_node import MetadataLink, MetadataReply, ZkNode
from sim.network import Network
from sim.world import World

OWNER_PATH = owner_path(PARTITION)
RECONNECT_RETRY_MS = 200.0

# (partition or None, status, owner when NOT_OWNER)
OnServing = Callable[[SimPartition | None, BrokerStatus, str | None], None]


@dataclass
class _ConnectionState:
    connection: Connection
    producers: dict[int, tuple[SimPartition, ProducerLink]] = field(default_factory=dict)  # by handle
    consumers: dict[int, tuple[SimPartition, ConsumerLink]] = field(default_factory=dict)


class SimBroker(BookieCalls, LinkedNode):
    def __init__(self, name: str, world: World, network: Network, links: Links, zk: ZkNode, checker: BrokerChecker,
                 ledger_checker: SimChecker, parameters: BrokerSimParameters, *, owner_session: Callable[[], int | None],
                 publish_core_class: type[PublishCore] = PublishCore,
                 subscription_core_class: type[SubscriptionCore] = SubscriptionCore,
                 managed_ledger_core_class: type[ManagedLedgerCore] = ManagedLedgerCore,
                 write_core_class: type[WriteCore] = WriteCore,
                 recovery_core_class: type[RecoveryCore] = RecoveryCore) -> None:
        super().__init__(name, world, network, links)
        self.zk = zk
        self.checker = checker
        self.ledger_checker = ledger_checker  # what it writes to bookies, checked as the ledger simulation checks it
        self.parameters = parameters
        self.request_timeout_ms = parameters.read_timeout_ms
        self.policies = parameters.policies
        self._owner_session = owner_session  # the simulator's look at who owns the partition now
        # The real cores' classes (a planted mistake, from sim.broker_mistakes, replaces one).
        self.publish_core_class = publish_core_class
        self.subscription_core_class = subscription_core_class
        self.managed_ledger_core_class = managed_ledger_core_class
        self.write_core_class = write_core_class
        self.recovery_core_class = recovery_core_class
        self.subscription_class = SimSubscription
        self.metadata = MetadataLink(self, zk, session_timeout_ms=parameters.session_timeout_ms,
                                     call_timeout_ms=parameters.session_timeout_ms)
        self.loads = 0
        self.sessions_lost = 0
        self._next_consumer_id = 1
        self.start()

    # --- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        super().start()
        self._reset_bookie_calls()
        self._core_timers: dict[object, float] = {}
        store = self.metadata.start()
        store.auto_reconnect = False  # as kazoo: a new session only when the broker asks for one
        self.partition: SimPartition | None = None  # held: loading, serving or being handed over
        self._claiming: list[OnServing] | None = None
        self._waiting_load: list[OnServing] = []
        self._reconnecting = False
        self.lease = LeaseCore(self.parameters.session_timeout_ms)
        self.lease.renewed(self.world.now_ms, self.world.now_ms, store.session_id)  # a session just made
        self.ownership = OwnershipCore(store.session_id, lease=self.lease)
        self._connections: dict[int, _ConnectionState] = {}
        self.after(self.parameters.session_timeout_ms / 3, self._check_session)
        self.world.log(f"{self.name} started (session {store.session_id})")

    def crash(self) -> None:
        super().crash()
        if self.partition is not None:
            self.partition.ledger.stop()
        self.partition = None

    def arm_core_timer(self, deadline_ms: float | None, fire: Callable[[], None]) -> None:
        """A ledger core's timer: one per driver (a fenced load's writer and
        the next load's recovery may both be running)."""
        driver = getattr(fire, "__self__", fire)
        armed_ms = self._core_timers.get(driver)
        if deadline_ms is None or (armed_ms is not None and armed_ms <= deadline_ms):
            return
        self._core_timers[driver] = deadline_ms
        self.after(max(0.0, deadline_ms - self.world.now_ms), self._fire_core_timer, driver, deadline_ms, fire)

    def _fire_core_timer(self, driver: object, deadline_ms: float, fire: Callable[[], None]) -> None:
        if self._core_timers.get(driver) != deadline_ms:
            return
        del self._core_timers[driver]
        fire()

    def writable_bookies(self):
        return self.zk.registered(LAYOUT.writable_bookies)

    def send_to(self, connection: Connection, message: Any) -> None:
        self.links.send(connection, self.name, message)

    def owns_now(self, session_id: int) -> bool:
        """Whether the session that loaded a partition still owns it (what the
        simulator sees, not what the broker knows)."""
        return self._owner_session() == session_id

    # --- ZooKeeper ------------------------------------------------------------------------------

    def zk_call(self, function: Callable[[Any], Any], on_done: Callable[[Any, Exception | None], None], description: str) -> None:
        """A call in the current session: it fails if that session is gone
        when the call arrives (kazoo fails a request of an expired session)."""
        session_id = self.metadata.store.session_id
        sent_ms, epoch = self.world.now_ms, self.ownership.session_id

        def pinned(store) -> Any:
            if session_id == 0 or store.session_id != session_id:
                raise SessionExpiredError("the session of this call expired")
            return function(store)

        def done(result: Any, error: Exception | None) -> None:
            if isinstance(error, SessionExpiredError) and epoch is not None and epoch == self.ownership.session_id:
                self._session_lost()  # sent in the session still current: not a late answer to an older one
            elif error is None and session_id == self.metadata.store.session_id:
                self._renew_lease(sent_ms, session_id)
            on_done(result, error)

        self.metadata.call(pinned, done, description)

    def _renew_lease(self, sent_ms: float, session_id: int) -> None:
        """A call sent at `sent_ms` in `session_id` was answered in it."""
        if self.lease.renewed(sent_ms, self.world.now_ms, session_id) and self.partition is not None and self.partition.subscription is not None:
            self.partition.subscription.wake()

    def holds_lease(self, session_id: int) -> bool:
        """Whether a partition owned by `session_id` may deliver now."""
        return self.lease.valid(self.world.now_ms, session_id)

    def _check_session(self) -> None:
        self.zk_call(lambda store: store.session_id, lambda result, error: None, "session check")
        self.after(self.parameters.session_timeout_ms / 3, self._check_session)

    def _session_lost(self) -> None:
        """The session expired: the ownership went with it. Give the partition
        up (another broker may be fencing it already), then start a new session."""
        if self._reconnecting:
            return
        self._reconnecting = True
        self.sessions_lost += 1
        self.world.log(f"{self.name} lost its ZooKeeper session")
        self._carry_out(self.ownership.session_lost())
        self._reconnect()

    def _reconnect(self) -> None:
        def reconnect(store) -> int:
            if store.session_id == 0:
                store.reconnect()
            return store.session_id

        sent_ms = self.world.now_ms

        def reconnected(result: Any, error: Exception | None) -> None:
            if error is not None:
                self.after(RECONNECT_RETRY_MS, self._reconnect)
                return
            self._reconnecting = False
            self._carry_out(self.ownership.session_started(result))
            self._renew_lease(sent_ms, result)
            self.world.log(f"{self.name} has a new session {result}")

        self.metadata.call(reconnect, reconnected, "new session")

    def deliver(self, source: str, message: Any) -> None:
        if isinstance(message, MetadataReply):
            self.metadata.reply(message)
        else:
            self.bookie_answered(source, message)

    # --- ownership and loading ------------------------------------------------------------------

    def _carry_out(self, commands: list[OwnershipCommand]) -> None:
        """The ownership core's commands (as broker/hosting.py carries them out with trio)."""
        for command in commands:
            if isinstance(command, StartLoad):
                self._start_load(command.session_id)
            elif isinstance(command, CancelLoad):
                assert self.partition is not None
                self.partition.cancel_load()
            elif isinstance(command, StopPartition):
                partition, ownership = self.partition, self.ownership
                assert partition is not None
                partition.unload(command.graceful,
                                 lambda: self._carry_out(ownership.stopped(PARTITION)) if ownership is self.ownership else None)
            elif isinstance(command, Release):
                self._release(command.session_id, self.ownership)
            elif isinstance(command, CloseClients):
                self._let_go()
            else:
                # A new session: the trio broker registers again; the
                # simulated clients try brokers in turn, without a registry.
                assert isinstance(command, Register), f"unknown command {command!r}"

    def _serve(self, on_ready: OnServing) -> None:
        """The loaded partition, claiming and loading it if nobody owns it
        (the lookup and `serving` of broker/server.py and broker/hosting.py)."""
        access = self.ownership.access(PARTITION)
        if access is Access.SERVE:
            return on_ready(self.partition, BrokerStatus.OK, None)
        if access is Access.WAIT:
            self._waiting_load.append(on_ready)
            return
        if access is Access.MOVING:
            return on_ready(None, BrokerStatus.SERVICE_UNAVAILABLE, None)
        if self._claiming is not None:
            self._claiming.append(on_ready)
            return
        self._claiming = [on_ready]
        self._claim()

    def _claim(self) -> None:
        name = self.name

        def claim(store) -> tuple[str, int]:
            try:
                store.create(OWNER_PATH, name.encode(), ephemeral=True, make_parents=True)
                return name, store.session_id
            except NodeExistsError:
                pass
            try:
                data, stat = store.get(OWNER_PATH)
            except NoNodeError:
                return "", 0  # gone meanwhile: ask again
            return data.decode(), stat.ephemeral_owner

        session_id, releases = self.metadata.store.session_id, self.ownership.releases
        self.zk_call(claim, lambda result, error: self._claimed(session_id, releases, result, error), "claim the partition")

    def _claimed(self, session_id: int, releases: int, result: Any, error: Exception | None) -> None:
        waiting, self._claiming = self._claiming or [], None
        if error is not None or not result[0]:
            for on_ready in waiting:
                on_ready(None, BrokerStatus.SERVICE_UNAVAILABLE, None)
            return
        # Decided as a lookup of broker/server.py decides, with authority
        # (the simulated clients try brokers in turn; no redirects).
        decision = decide_lookup(PARTITION, self.name, session_id, result, [], stopping=False, authoritative=True)
        if decision.answer is Answer.ELSEWHERE:
            for on_ready in waiting:
                on_ready(None, BrokerStatus.NOT_OWNER, decision.broker_id)
            return
        commands = self.ownership.claimed(PARTITION, session_id, releases) if decision.answer is Answer.SERVE else []
        if not commands:
            # This broker's previous session still holds it, or the
            # partition is held already, or the session changed meanwhile.
            for on_ready in waiting:
                on_ready(None, BrokerStatus.SERVICE_UNAVAILABLE, None)
            return
        self._waiting_load = waiting
        self._carry_out(commands)

    def _start_load(self, session_id: int) -> None:
        self.loads += 1
        partition = self.partition = SimPartition(self, f"{self.name}/{self.incarnation}.{self.loads}", session_id)
        self.world.log(f"{partition.instance} loading")
        partition.load(lambda load_error: self._loaded(partition, load_error))

    def _loaded(self, partition: SimPartition, error: str | None) -> None:
        assert partition is self.partition
        waiting, self._waiting_load = self._waiting_load, []
        if error is not None:
            self.world.log(f"{partition.instance} loading failed: {error}")
        else:
            self.world.log(f"{partition.instance} serves the partition (ledger {partition.ledger.core.current_ledger_id}, "
                           f"{len(partition.entries)} entries)")
        self._carry_out(self.ownership.loaded(PARTITION, error is None))
        for on_ready in waiting:
            self._serve(on_ready)

    def unload_gracefully(self) -> bool:
        """Give the partition up gracefully (an operator's unload or a
        shutdown); False when it serves none."""
        if self.ownership.access(PARTITION) is not Access.SERVE:
            return False
        self._carry_out(self.ownership.unload(PARTITION, graceful=True))
        return True

    def partition_fenced(self, partition: SimPartition) -> None:
        """A load fenced itself: unload it, fenced."""
        if partition is self.partition:
            self._carry_out(self.ownership.unload(PARTITION, graceful=False))

    def _let_go(self) -> None:
        """Handed over: tell its clients, forget it."""
        partition, self.partition = self.partition, None
        assert partition is not None
        partition.close_clients()
        for state in self._connections.values():
            for handles in (state.producers, state.consumers):
                for handle in [handle for handle, (owner, _) in handles.items() if owner is partition]:
                    del handles[handle]
        self.world.log(f"{partition.instance} let go of")

    def _release(self, session_id: int, ownership: OwnershipCore) -> None:
        name = self.name

        def release(store) -> None:
            try:
                data, stat = store.get(OWNER_PATH)
            except NoNodeError:
                return
            if data.decode() == name and stat.ephemeral_owner == session_id:
                store.delete(OWNER_PATH, stat.version)

        def released(result: Any, error: Exception | None) -> None:
            if ownership is self.ownership:  # not a previous incarnation's
                self._carry_out(ownership.released(PARTITION))

        self.zk_call(release, released, "release the partition")

    # --- requests -------------------------------------------------------------------------------

    def receive(self, connection: Connection, message: Any) -> None:
        state = self._connections.get(connection.connection_id)
        if state is None:
            state = self._connections[connection.connection_id] = _ConnectionState(connection)
        kind = type(message)
        if kind is Send:
            found = state.producers.get(message.handle)
            if found is None:
                self.send_to(connection, SendReceipt(message.handle, message.last_sequence_id, BrokerStatus.TOPIC_FENCED,
                                                  detail="no such producer on this connection: reconnect"))
                return
            partition, link = found
            partition.publish(link, message)
        elif kind is Flow or kind is Redeliver:
            found = state.consumers.get(message.handle)
            subscription = None if found is None else found[0].subscription
            if subscription is not None and not subscription.closed:
                if kind is Flow:
                    subscription.flow(found[1].consumer_id, message.permits)
                else:
                    subscription.redeliver(found[1].consumer_id, message.offsets)
        elif kind is Ack:
            found = state.consumers.get(message.handle)
            subscription = None if found is None else found[0].subscription
            if subscription is None or subscription.closed or found[0].fenced is not None or not found[0].serving:
                self.send_to(connection, Response(message.request_id, BrokerStatus.TOPIC_FENCED, "subscribe again"))
                return
            subscription.acknowledge(
                message.offsets, message.cumulative,
                lambda status: self.send_to(connection, Response(message.request_id, status)),
            )
        elif kind is ProducerOpen:
            self._serve(lambda partition, status, owner: self._producer_open(state, message, partition, status, owner))
        elif kind is Subscribe:
            self._serve(lambda partition, status, owner: self._subscribe(state, message, partition, status, owner))
        else:
            raise AssertionError(f"{kind.__name__} is not a request a client sends")

    def _still_open(self, state: _ConnectionState) -> bool:
        """A request of a connection that closed meanwhile was cancelled with
        it (the real server's connection nursery)."""
        return self._connections.get(state.connection.connection_id) is state

    def _producer_open(self, state: _ConnectionState, request: ProducerOpen, partition: SimPartition | None,
                       status: BrokerStatus, owner: str | None) -> None:
        if not self._still_open(state):
            return
        last_sequence_id = -1
        if partition is not None:
            link = ProducerLink(state.connection, request.handle, request.producer_id)
            status, last_sequence_id = partition.add_producer(link)
            if status is BrokerStatus.OK:
                state.producers[request.handle] = (partition, link)
        self.send_to(state.connection, Response(request.request_id, status, last_sequence_id=last_sequence_id, owner=owner))

    def _subscribe(self, state: _ConnectionState, request: Subscribe, partition: SimPartition | None,
                   status: BrokerStatus, owner: str | None) -> None:
        if not self._still_open(state):
            return
        if partition is None:
            self.send_to(state.connection, Response(request.request_id, status, owner=owner))
            return
        consumer_id = self._next_consumer_id
        self._next_consumer_id += 1
        link = ConsumerLink(state.connection, request.handle, consumer_id, request.consumer_name)

        def subscribed(result: BrokerStatus) -> None:
            if result is BrokerStatus.OK:
                if not self._still_open(state):
                    partition.subscription.remove_consumer(consumer_id)  # the connection went meanwhile
                    return
                state.consumers[request.handle] = (partition, link)
            self.send_to(state.connection, Response(request.request_id, result))

        partition.subscribe(link, request.subscription_type, request.priority, subscribed)

    def connection_closed(self, connection: Connection) -> None:
        """A client's connection broke: its producers and consumers are gone."""
        state = self._connections.pop(connection.connection_id, None)
        if state is None:
            return
        for partition, link in state.producers.values():
            partition.remove_producer(link)
        for partition, link in state.consumers.values():
            if partition.subscription is not None and not partition.subscription.closed:
                partition.subscription.remove_consumer(link.consumer_id)
