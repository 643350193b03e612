"""The docker-compose cluster for integration tests: a Docker engine
(started if none runs, and stopped again), the image built once per run by
the code of scripts/docker-build, and the compose file brought up under a
project name of its own, on ports chosen at run time, and taken down with
its volumes (`down -v`) even when a test fails.

Tests import the `compose` fixture from here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from quire.docker_image import IMAGE, BuildFailed, DockerUnavailable, build_image, start_engine, stop_engine
from tests.support import cannot_run_here, free_port, wait_until

REPOSITORY = Path(__file__).resolve().parents[2]
SERVICES = ("zookeeper", "bookie-1", "bookie-2", "bookie-3", "broker-1", "broker-2")
HEALTHY_DEADLINE_S = 240.0
PORT_VARIABLES = (
    "QUIRE_ZK_PORT", "QUIRE_BOOKIE_1_PORT", "QUIRE_BOOKIE_2_PORT", "QUIRE_BOOKIE_3_PORT",
    "QUIRE_BOOKIE_1_METRICS_PORT", "QUIRE_BOOKIE_2_METRICS_PORT", "QUIRE_BOOKIE_3_METRICS_PORT",
    "QUIRE_BROKER_1_PORT", "QUIRE_BROKER_2_PORT", "QUIRE_BROKER_1_METRICS_PORT", "QUIRE_BROKER_2_METRICS_PORT",
    "QUIRE_BROKER_1_PULSAR_PORT", "QUIRE_BROKER_2_PULSAR_PORT", "QUIRE_BROKER_1_WEB_PORT", "QUIRE_BROKER_2_WEB_PORT",
)


@dataclass
class ComposeCluster:
    project: str
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def environment(self) -> dict[str, str]:
        return {**os.environ, **{name: str(port) for name, port in self.ports.items()}}

    def compose(self, *arguments: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(["docker-compose", "--project-name", self.project, "--file", str(REPOSITORY / "docker-compose.yml"),
                                 *arguments], capture_output=True, text=True, timeout=timeout_s, env=self.environment,
                                cwd=REPOSITORY)
        if check and result.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(arguments)} exited {result.returncode}: {result.stderr[-3000:]}")
        return result

    def quire_inside(self, service: str, *arguments: str, timeout_s: float = 180, check: bool = True) -> subprocess.CompletedProcess:
        """`quire ARGUMENTS` in a service's container (inside the compose network)."""
        return self.compose("exec", "-T", service, "quire", *arguments, timeout_s=timeout_s, check=check)

    def quire_on_host(self, *arguments: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
        """`quire ARGUMENTS` on this machine, as a user outside the network."""
        return subprocess.run([sys.executable, "-m", "quire", *arguments], capture_output=True, text=True, timeout=timeout_s)

    def broker_url(self, *numbers: int) -> str:
        """The brokers' published addresses, as clients on the host dial them."""
        return ",".join(f"localhost:{self.ports[f'QUIRE_BROKER_{number}_PORT']}" for number in numbers or (1, 2))

    def pulsar_url(self) -> str:
        """The brokers' published Pulsar listeners, as Pulsar clients on the host dial them."""
        return "pulsar://" + ",".join(f"localhost:{self.ports[f'QUIRE_BROKER_{number}_PULSAR_PORT']}" for number in (1, 2))

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def health(self, service: str) -> str:
        container = self.container(service)
        if not container:
            return "absent"
        result = subprocess.run(["docker", "inspect", "--format", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
                                 container], capture_output=True, text=True, timeout=60)
        status = result.stdout.split()
        return status[1] if len(status) > 1 and status[0] == "running" else (status[0] if status else "absent")

    def wait_healthy(self, services=SERVICES, deadline_s: float = HEALTHY_DEADLINE_S) -> None:
        states: dict[str, str] = {}

        def all_healthy() -> bool:
            states.update((service, self.health(service)) for service in services)
            return all(states[service] == "healthy" for service in services)

        try:
            wait_until(all_healthy, deadline_s=deadline_s, what="every service healthy", poll_s=1)
        except AssertionError:
            raise AssertionError(f"services not healthy after {deadline_s:.0f}s: {states}\n{self.logs()}") from None

    def under_replicated(self) -> list:
        status = json.loads(self.quire_inside("bookie-1", "autorecovery", "status", "--zk", "zookeeper:2181", "--json").stdout)
        return status["under_replicated"]

    def logs(self, lines: int = 40) -> str:
        return self.compose("logs", "--no-color", "--tail", str(lines), check=False).stdout[-20_000:]

    def up(self) -> None:
        self.compose("up", "-d", "--no-build")
        self.wait_healthy()

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", check=False)


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory):
    try:
        started = start_engine(tmp_path_factory.mktemp("dockerd") / "dockerd.log", die_with_parent=True)
    except DockerUnavailable as error:
        cannot_run_here(f"Docker cannot run here: {error}")
    try:
        yield
    finally:
        stop_engine(started)


@pytest.fixture(scope="session")
def quire_image(docker_engine) -> str:
    """quire:latest built from this checkout, once per test run."""
    try:
        return build_image(IMAGE, say=lambda line: print(line, flush=True))
    except BuildFailed as error:
        pytest.fail(f"the image did not build: {error}")


@pytest.fixture(scope="module")
def compose(quire_image):
    cluster = ComposeCluster(f"quiretest{uuid.uuid4().hex[:8]}")
    taken: set[int] = set()
    for name in PORT_VARIABLES:
        port = free_port()
        while port in taken:
            port = free_port()
        taken.add(port)
        cluster.ports[name] = port
    try:
        cluster.up()
        yield cluster
    finally:
        print(cluster.logs())
        cluster.down()
