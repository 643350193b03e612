"""Real broker processes for integration tests, on ports chosen at run time;
killed -9, paused or stopped on demand, always stopped by the fixture.

Tests import the `brokers` fixture (and `bookies`) from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from broker.client.connection import BrokerConnection
from broker.errors import AuthenticationError, ConnectionClosedError
from tests.integration.bookie_processes import bookies  # noqa: F401 (a fixture)
from tests.integration.processes import QuireProcess, print_logs
from tests.support import free_ports

START_DEADLINE_S = 30.0
SESSION_TIMEOUT_MS = 4_000  # how long a killed broker keeps its partitions


@dataclass
class BrokerProcess(QuireProcess):
    role = "broker"
    pulsar_port: int = 0  # Pulsar's protocol (every test broker serves it)
    web_port: int = 0  # the web service (every test broker serves it)

    @property
    def pulsar_url(self) -> str:
        return f"pulsar://127.0.0.1:{self.pulsar_port}"

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    def arguments(self) -> list[str]:
        return [
            "broker", "run", "--zk", self.zk_hosts, "--root", self.root, "--port", str(self.port),
            "--pulsar-port", str(self.pulsar_port), "--web-port", str(self.web_port),
            "--session-timeout-ms", str(SESSION_TIMEOUT_MS), "--retention-check-interval", "500ms",
        ]

    async def wait_serving(self, deadline_s: float = START_DEADLINE_S) -> None:
        async def accepts() -> bool:
            try:
                connection = await BrokerConnection.connect(self.address, "test", frame_bytes_max=1 << 20)
            except ConnectionClosedError:
                return False
            except AuthenticationError:
                return True  # a broker that authenticates answered
            await connection.aclose()
            return True

        await self.wait_until_probe_answers(accepts, deadline_s)

    async def started(self) -> "BrokerProcess":
        self.start()
        await self.wait_serving()
        return self


@dataclass
class BrokerFactory:
    zk_hosts: str
    root: str
    base: Path
    created: list[BrokerProcess] = field(default_factory=list)

    def new(self, *options: str) -> BrokerProcess:
        port, pulsar_port, web_port = free_ports(3)
        broker = BrokerProcess(self.zk_hosts, self.root, self.base / f"broker-{len(self.created) + 1}", port, list(options),
                               pulsar_port=pulsar_port, web_port=web_port)
        self.created.append(broker)
        return broker

    async def started(self, *options: str) -> BrokerProcess:
        return await self.new(*options).started()

    def stop_all(self) -> None:
        for broker in self.created:
            if broker.running:
                broker.kill()


@pytest.fixture
def brokers(zk_hosts, zk_root, tmp_path):
    factory = BrokerFactory(zk_hosts, zk_root, tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()
        print_logs(factory.created)


@dataclass
class SharedCluster:
    """Three bookies and a broker that the tests of one module share (each
    test uses topics of its own)."""

    zk_hosts: str
    root: str
    bookies: list
    brokers: list


@pytest.fixture(scope="module")
def shared_cluster(zookeeper, tmp_path_factory):
    """ZooKeeper (the session's), 3 bookies that collect garbage every
    second, and one broker, under a chroot of this module's own."""
    import uuid

    from tests.integration.bookie_processes import BookieFactory

    root = f"/m-{uuid.uuid4().hex}"
    base = tmp_path_factory.mktemp("cluster")
    bookie_factory = BookieFactory(zookeeper.address, root, base)
    broker_factory = BrokerFactory(zookeeper.address, root, base)

    async def start() -> None:
        for _ in range(3):
            await bookie_factory.started("--gc-interval-s", "1")
        await broker_factory.started()

    try:
        trio.run(start)
        yield SharedCluster(zookeeper.address, root, bookie_factory.created, broker_factory.created)
    finally:
        broker_factory.stop_all()
        bookie_factory.stop_all()
        print_logs(broker_factory.created + bookie_factory.created)
