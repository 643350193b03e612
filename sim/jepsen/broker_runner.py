"""`quire jepsen --broker`: a real ZooKeeper, bookies and three brokers, a
partitioned topic, deduplicating producers and consumers of a durable
subscription of each type, as processes. Every client-broker,
broker-ZooKeeper and bookie-ZooKeeper link goes through a proxy the nemesis
controls: brokers advertise one listener per client, its proxy's address.
The frame of the run (runner.ClusterRun) and the nemesis (runner.Nemesis)
are shared with the ledger run. The nemesis kills (-9) and restarts
brokers, bookies, producers and consumers, pauses brokers and bookies,
partitions a client from brokers or a server from ZooKeeper, and expires
the ZooKeeper session of a partition's owner. Then everything heals,
producers and consumers stop, a drain reads every subscription to the end,
and the merged history is checked (broker_checker.py) and plotted."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

import trio

from broker.client import BrokerError, Client, TopicExistsError
from broker.topic_records import partition_name
from coordination.zk_launcher import stop_children
from sim.jepsen.broker_checker import SUBSCRIPTION_TYPES, check_broker
from sim.jepsen.broker_client import history_path
from sim.jepsen.history import Operation
from sim.jepsen.processes import ManagedProcess
from sim.jepsen.proxy import DIRECTIONS, FROM_TARGET, ProxyMesh
from sim.jepsen.runner import (
    BOOKIE_SESSION_TIMEOUT_MS,
    FAULTS,
    ROOT,
    ZK,
    ClusterRun,
    JepsenReport,
    ephemeral_owners,
    heal,
    injector,
    start_serving,
    write_report,
)

TOPIC = "jepsen"
PARTITIONS = 3
BROKERS = 3
PRODUCERS = 2  # the second one batches
PRODUCER_RATE = 40.0  # messages per second, each
CONSUMERS = {"exclusive": 1, "failover": 2, "shared": 2, "key_shared": 2}
BROKER_SESSION_TIMEOUT_MS = 4_000
# Ledgers of 3 bookies, 2 copies of each entry, rolled over often (a
# partition that moves reopens and fences its last ledger).
LEDGER_POLICIES = ("--ensemble-size", "3", "--write-quorum", "2", "--ack-quorum", "2", "--rollover-entries", "200")
# What a kill hits, by weight: brokers most (failover), then consumers.
KILL_WEIGHTS = {"broker": 4, "bookie": 2, "consumer": 3, "producer": 2}
PRODUCER_ANSWERS_HELD_S = (0.5, 1.5)  # before a producer is killed
CLIENT_PARTITION_SHARE = 0.6  # of the partitions: a client from brokers; the rest a server from ZooKeeper
RESET_SHARE = 0.5  # of the client partitions: end by resetting the connections
ZK_CUT_FRACTION = 0.5  # of the session timeout: a cut from ZooKeeper that does not expire the session
SETUP_DEADLINE_S = 120.0
CLIENTS_START_DEADLINE_S = 60.0
PRODUCER_STOP_S = 30.0
CONSUMER_STOP_S = 20.0
SERVER_STOP_S = 20.0
DRAIN_DEADLINE_S = 180.0
DRAIN = "drain"


def subscription_name(kind: str) -> str:
    return f"sub-{kind}"


class BrokerJepsenRun(ClusterRun):
    def __init__(self, work_dir: Path, *, duration_s: float, bookies: int, seed: int, faults: Iterable[str] = FAULTS,
                 progress=print) -> None:
        super().__init__(work_dir, duration_s=duration_s, bookies=bookies, seed=seed, faults=faults, progress=progress)
        self.broker_names = [f"broker-{index}" for index in range(BROKERS)]
        self.server_names += self.broker_names
        self.producer_names = [f"producer-{index}" for index in range(PRODUCERS)]
        self.consumer_kinds = {f"consumer-{kind}-{index}": kind for kind, count in CONSUMERS.items() for index in range(count)}
        self.client_names = self.producer_names + list(self.consumer_kinds) + [DRAIN]
        self.brokers: dict[str, ManagedProcess] = {}

    # --- the cluster ----------------------------------------------------------------

    def _broker_command(self, name: str, port: int, mesh: ProxyMesh) -> list[str]:
        # Each client dials this broker by a listener named after it: the
        # address of its own proxy, which the nemesis cuts.
        listeners = ",".join(f"{client}:{mesh.address(client, name)}" for client in self.client_names)
        return [
            sys.executable, "-m", "quire", "broker", "run", "--zk", mesh.address(name, ZK), "--root", ROOT,
            "--port", str(port), "--session-timeout-ms", str(BROKER_SESSION_TIMEOUT_MS),
            "--advertised-listeners", listeners, "--retention-check-interval", "1s", *LEDGER_POLICIES,
        ]

    def _client_command(self, role: str, name: str, mesh: ProxyMesh, *options: str) -> list[str]:
        service_url = ",".join(mesh.address(name, broker) for broker in self.broker_names)
        return [
            sys.executable, "-m", "sim.jepsen.broker_client", role, "--name", name, "--service-url", service_url,
            "--work-dir", str(self.work_dir), "--start-monotonic", repr(self.start_monotonic), "--seed", str(self.seed),
            "--topic", TOPIC, "--partitions", str(PARTITIONS), *options,
        ]

    def _start_client(self, role: str, name: str, mesh: ProxyMesh, *options: str) -> ManagedProcess:
        return self._start_client_process(name, self._client_command(role, name, mesh, *options))

    def _links(self, zk_port: int) -> dict[tuple[str, str], tuple[str, int]]:
        links = {(name, ZK): ("127.0.0.1", zk_port) for name in self.bookie_names + self.broker_names}
        links.update({(client, broker): ("127.0.0.1", self.ports[broker]) for client in self.client_names for broker in self.broker_names})
        return links

    async def _work(self, mesh: ProxyMesh) -> None:
        assert self.nemesis is not None
        await self._start_servers(mesh)
        await self._set_up()
        self.progress(f"topic {TOPIC} with {PARTITIONS} partitions and a subscription of each type")
        for index, name in enumerate(self.producer_names):
            self._start_client("producer", name, mesh, "--rate", str(PRODUCER_RATE), *(["--batching"] if index % 2 else []))
        for name, kind in self.consumer_kinds.items():
            self._start_client("consumer", name, mesh, "--subscription", subscription_name(kind), "--subscription-type", kind)
        await self._wait_clients_working()
        self.progress(f"{len(self.producer_names)} producers and {len(self.consumer_kinds)} consumers running; "
                      f"nemesis on for {self.duration_s:.0f}s")
        await self.nemesis.run(self.duration_s, injector(self, mesh))
        # Clients killed by the nemesis are running again by now; one that
        # exited by itself starts again too.
        await heal(mesh, [*self.bookies.values(), *self.brokers.values(), *self.clients.values()])
        await self._stop_clients(self.producer_names, PRODUCER_STOP_S)
        await self._stop_clients(list(self.consumer_kinds), CONSUMER_STOP_S)
        self.progress("faults healed, producers and consumers stopped: the drain reads every subscription to the end")
        subscriptions = json.dumps({subscription_name(kind): kind for kind in SUBSCRIPTION_TYPES})
        drain = self._start_client("drain", DRAIN, mesh, "--subscriptions", subscriptions, "--deadline-s", str(DRAIN_DEADLINE_S))
        with trio.move_on_after(DRAIN_DEADLINE_S + 30):
            while drain.running:
                await trio.sleep(0.2)
        await drain.stop()
        # While the proxies still run: brokers unload their partitions
        # through ZooKeeper and the bookies.
        await self._stop_processes(list(self.brokers.values()))
        await self._stop_processes(list(self.bookies.values()))

    def _stop_leftovers(self) -> None:
        processes = [*self.clients.values(), *self.brokers.values(), *self.bookies.values()]
        for process in processes:
            process.resume()  # a paused process cannot take the SIGTERM
        stop_children([process.process for process in processes if process.process is not None])

    async def _start_servers(self, mesh: ProxyMesh) -> None:
        await self._start_bookies(mesh)
        for name in self.broker_names:
            self.brokers[name] = ManagedProcess(name, self._broker_command(name, self.ports[name], mesh),
                                                self.work_dir / name / "broker.log", port=self.ports[name])
        await start_serving(self.brokers.values())
        self.progress(f"{len(self.bookies)} bookies and {len(self.brokers)} brokers started")

    async def _set_up(self) -> None:
        """The topic and its subscriptions, before anything is produced (a
        subscription sees every message from the first)."""
        service_url = ",".join(f"127.0.0.1:{self.ports[name]}" for name in self.broker_names)
        error: BrokerError | None = None
        with trio.move_on_after(SETUP_DEADLINE_S):
            while True:
                try:
                    async with Client.connect(service_url=service_url, client_name="jepsen-setup") as client:
                        try:
                            await client.create_topic(TOPIC, partitions=PARTITIONS)
                        except TopicExistsError:
                            pass  # an earlier try created it
                        for kind in SUBSCRIPTION_TYPES:
                            consumer = await client.subscribe(TOPIC, subscription_name(kind), kind, consumer_name="setup",
                                                              initial_position="earliest")
                            await consumer.close()
                    return
                except BrokerError as failed:
                    error = failed
                    self.progress(f"setting up the topic: {error}; trying again")
                    await trio.sleep(1.0)
        raise RuntimeError(f"the brokers did not create topic {TOPIC} and its subscriptions within {SETUP_DEADLINE_S:.0f}s "
                           f"(last error: {error}); see {self.work_dir}/broker-*/broker.log")

    async def _wait_clients_working(self) -> None:
        """Until every producer and consumer has recorded its first
        operation (the faults are for a workload that runs)."""
        with trio.move_on_after(CLIENTS_START_DEADLINE_S):
            for name in [*self.producer_names, *self.consumer_kinds]:
                path = history_path(self.work_dir, name, incarnation=1)
                while not (path.exists() and path.stat().st_size > 0):
                    if not self.clients[name].running:
                        raise RuntimeError(f"{name} exited with {self.clients[name].process.returncode}: see {self.clients[name].log_path}")
                    await trio.sleep(0.1)

    async def _stop_clients(self, names: list[str], deadline_s: float) -> None:
        await self._stop_processes([self.clients[name] for name in names], deadline_s)

    @staticmethod
    async def _stop_processes(processes: list[ManagedProcess], deadline_s: float = SERVER_STOP_S) -> None:
        """SIGTERM to each at once; SIGKILL to those still running past the deadline."""
        async with trio.open_nursery() as nursery:
            for process in processes:
                nursery.start_soon(process.stop, deadline_s)

    # --- the nemesis: its targets ----------------------------------------------------------

    async def _kill(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        kinds = list(KILL_WEIGHTS)
        kind = self.rng.choices(kinds, weights=[KILL_WEIGHTS[kind] for kind in kinds])[0]
        targets = {
            "broker": list(self.brokers.values()),
            "bookie": list(self.bookies.values()),
            "consumer": [self.clients[name] for name in self.consumer_kinds],
            "producer": [self.clients[name] for name in self.producer_names],
        }[kind]
        process = self.rng.choice(targets)
        if kind != "producer":
            await self.nemesis.kill(process, fault_id, duration_s)
            return
        # The brokers' answers are held for a moment first, so that the
        # producer dies with messages stored that it never heard about: its
        # next incarnation sends them again, and deduplication must drop them.
        held_s = self.rng.uniform(*PRODUCER_ANSWERS_HELD_S)
        mesh.cut(process.name, self.broker_names, FROM_TARGET)
        await trio.sleep(held_s)
        await self.nemesis.kill(process, fault_id, duration_s, on_killed=lambda: mesh.heal(process.name),
                                answers_held_s=round(held_s, 3))

    async def _pause(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        await self.nemesis.pause(self.rng.choice([*self.brokers.values(), *self.bookies.values()]), fault_id, duration_s)

    async def _partition(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        if self.rng.random() < CLIENT_PARTITION_SHARE:
            client = self.rng.choice(self.producer_names + list(self.consumer_kinds))
            brokers = sorted(self.rng.sample(self.broker_names, self.rng.randint(1, len(self.broker_names) - 1)))
            direction = self.rng.choice(DIRECTIONS)
            reset = self.rng.random() < RESET_SHARE
            await self.nemesis.partition(mesh, client, brokers, direction, fault_id, duration_s, reset=reset)
            return
        # A server cut from ZooKeeper for less than its session timeout: its
        # connection is lost, its session is not.
        server = self.rng.choice(self.broker_names + self.bookie_names)
        timeout_ms = BROKER_SESSION_TIMEOUT_MS if server in self.brokers else BOOKIE_SESSION_TIMEOUT_MS
        await self.nemesis.partition(mesh, server, [ZK], "both", fault_id, min(duration_s, timeout_ms / 1000 * ZK_CUT_FRACTION))

    async def _expire_session(self, mesh: ProxyMesh, fault_id: int, duration_s: float) -> None:
        # The owner of a partition, cut from ZooKeeper past its session
        # timeout: the partition must move, and the old owner stop serving it.
        partition = partition_name(TOPIC, self.rng.randrange(PARTITIONS))
        owner = await self._owner_of(partition)
        if owner is None:
            broker = self.rng.choice(self.broker_names)
            owner = (broker, await self._registration_session(broker))
        broker, session = owner
        await self.nemesis.expire_session(mesh, broker, session, BROKER_SESSION_TIMEOUT_MS, fault_id, partition=partition)

    async def _owner_of(self, partition: str) -> tuple[str, str] | None:
        """The broker owning `partition` and its session, from ZooKeeper's
        list of ephemeral nodes (the ownership node and the owner's
        registration share the session)."""
        assert self.nemesis is not None
        path = f"{ROOT}/owners/{partition}"
        session = await self.nemesis.session_of(lambda found: found == path)
        if session is None:
            return None
        owners = ephemeral_owners(await self.nemesis.zk_dump() or "")
        for name, process in self.brokers.items():
            if owners.get(f"{ROOT}/brokers/127.0.0.1:{process.port}") == session:
                return name, session
        return None

    async def _registration_session(self, broker: str) -> str | None:
        assert self.nemesis is not None
        path = f"{ROOT}/brokers/127.0.0.1:{self.brokers[broker].port}"
        return await self.nemesis.session_of(lambda found: found == path)

    # --- the verdict -----------------------------------------------------------------------

    def _report(self) -> JepsenReport:
        def describe(operations: list[Operation], duration_s: float) -> str:
            return (f"quire jepsen --broker: seed {self.seed}, {duration_s:.1f}s, {len(operations)} operations, "
                    f"{len(self.bookie_names)} bookies, {len(self.broker_names)} brokers, {len(self.producer_names)} producers, "
                    f"{len(self.consumer_kinds)} consumers; topic {TOPIC} with {PARTITIONS} partitions")

        assert self.nemesis is not None
        return write_report(self.work_dir, check_broker, self.nemesis, describe=describe,
                            plot_title=f"quire jepsen --broker, seed {self.seed}", plot_operation_name="produce",
                            plot_noun="messages")


def run_broker_jepsen(work_dir: Path, *, duration_s: float = 60.0, bookies: int = 4, seed: int = 0,
                      faults: Iterable[str] = FAULTS, progress=print) -> JepsenReport:
    run = BrokerJepsenRun(work_dir, duration_s=duration_s, bookies=bookies, seed=seed, faults=faults, progress=progress)
    return trio.run(run.run)
