"""`quire cluster up|status|down` as a user runs it, and docker-compose.yml
describing the same topology."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from quire.local_cluster import ClusterState, process_alive
from tests.support import free_port, free_port_run, wait_until

REPOSITORY = Path(__file__).resolve().parents[2]


def quire(*arguments, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "quire", *map(str, arguments)],
        cwd=REPOSITORY, capture_output=True, text=True, timeout=timeout,
    )


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_cluster_up_status_simpletest_down_leaves_nothing_running(tmp_path):
    data_dir = tmp_path / "cluster"
    # Bookie i and broker i listen on their base port + i: each base starts a
    # run of free ports, not just one.
    zk_port, bookie_port, broker_port = free_port(), free_port_run(3), free_port_run(1)
    # No metrics endpoints: their default ports (8000 and up) may be taken on
    # a shared machine; tests/integration/test_metrics.py covers them.
    ports = ("--zk-port", zk_port, "--bookie-base-port", bookie_port, "--broker-base-port", broker_port, "--metrics-base-port", 0)
    up = quire("cluster", "up", "--data-dir", data_dir, *ports)
    state = ClusterState.load(data_dir)
    try:
        assert up.returncode == 0, up.stderr
        assert [record.role for record in state.processes] == ["zookeeper", "bookie", "bookie", "bookie", "broker"]
        status = quire("cluster", "status", "--data-dir", data_dir)
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.count("writable") == 3 and status.stdout.count("serving") == 2
        # Write through the broker, read it back.
        produced = quire("produce", "smoke", "--zk", f"127.0.0.1:{zk_port}", "--count", "100", "--batching")
        assert produced.returncode == 0 and json.loads(produced.stdout)["sent"] == 100, produced.stderr
        consumed = quire("consume", "smoke", "-s", "check", "--count", "100", "--zk", f"127.0.0.1:{zk_port}")
        assert consumed.returncode == 0 and len(consumed.stdout.splitlines()) == 100, consumed.stderr
        listing = quire("bookie", "ls", "--zk", f"127.0.0.1:{zk_port}")
        assert sorted(line.split("\t")[0] for line in listing.stdout.splitlines()) == sorted(
            f"127.0.0.1:{bookie_port + index}" for index in range(3)
        )
        test = quire("bookie", "simpletest", "--zk", f"127.0.0.1:{zk_port}", "--count", "2000")
        assert test.returncode == 0, test.stdout + test.stderr
        assert [line.strip() for line in test.stdout.splitlines()].count("OK") == 3
        # A second `up` on a running cluster refuses clearly.
        again = quire("cluster", "up", "--data-dir", data_dir, *ports)
        assert again.returncode == 2 and "already running" in again.stderr
        # With ZooKeeper paused, status answers in a few seconds and says why
        # it cannot tell how the bookies and the broker are.
        zookeeper = next(record for record in state.processes if record.role == "zookeeper")
        java = children(zookeeper.pid)  # `quire zk run` runs ZooKeeper's JVM as its child
        assert len(java) == 1, java
        os.kill(java[0], signal.SIGSTOP)
        try:
            started = time.monotonic()
            paused = quire("cluster", "status", "--data-dir", data_dir)
            elapsed_s = time.monotonic() - started
        finally:
            os.kill(java[0], signal.SIGCONT)
        assert elapsed_s < 5, elapsed_s
        assert paused.stderr == "", paused.stderr  # no kazoo lines
        rows = {line.split()[0]: line for line in paused.stdout.splitlines()[1:]}
        assert "not answering" in rows["zookeeper"], paused.stdout
        for name in ("bookie-1", "bookie-2", "bookie-3", "broker-1"):
            assert "unknown (ZooKeeper: no answer to ruok" in rows[name], paused.stdout
        # A process that died is reported as such by `down`.
        bookie_3 = next(record for record in state.processes if record.name == "bookie-3")
        os.kill(bookie_3.pid, signal.SIGKILL)
        wait_until(lambda: not process_alive(bookie_3), deadline_s=10, what="bookie-3 to die of SIGKILL", poll_s=0.05)
    finally:
        down = quire("cluster", "down", "--data-dir", data_dir)
    assert down.returncode == 0, down.stderr
    assert "bookie-3 was not running" in down.stdout and "bookie-1 stopped" in down.stdout, down.stdout
    assert not any(process_alive(record) for record in state.processes)
    stopped = quire("cluster", "status", "--data-dir", data_dir)
    assert stopped.returncode == 1 and "stopped" in stopped.stdout
    # The data stays: the same cluster comes back with its bookies' identities.
    up = quire("cluster", "up", "--data-dir", data_dir, *ports)
    try:
        assert up.returncode == 0, up.stderr
    finally:
        assert quire("cluster", "down", "--data-dir", data_dir).returncode == 0


def compose_services() -> dict:
    result = subprocess.run(["docker-compose", "config"], cwd=REPOSITORY, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def options(command: list[str]) -> dict[str, str]:
    return {name: value for name, value in zip(command, command[1:]) if name.startswith("--")}


def test_docker_compose_describes_the_topology_of_cluster_up(tmp_path):
    services = compose_services()
    roles = {name: service["command"][:2] for name, service in services.items()}
    assert sorted(map(tuple, roles.values())) == [("bookie", "run")] * 3 + [("broker", "run")] * 2 + [("zk", "run")]
    # `quire cluster up` with its default ports starts the same processes.
    from quire.local_cluster import quire_command

    expected_bookie_options = set(options(quire_command(
        "bookie", "run", "--zk", "z", "--root", "/quire", "--port", "1", "--journal-dir", "j", "--ledger-dir", "l",
    )))
    expected_broker_options = set(options(quire_command("broker", "run", "--zk", "z", "--root", "/quire", "--port", "1")))
    bookie_ports, broker_ports = [], []
    for name, service in services.items():
        command = service["command"]
        if command[:2] == ["broker", "run"]:
            given = options(command)
            assert expected_broker_options <= set(given), f"{name} lacks {expected_broker_options - set(given)}"
            assert given["--zk"] == "zookeeper:2181" and given["--root"] == "/quire"
            assert given["--advertised-address"] == f"{name}:{given['--port']}"
            broker_ports.append(int(given["--port"]))
        elif command[:2] == ["bookie", "run"]:
            given = options(command)
            assert expected_bookie_options <= set(given), f"{name} lacks {expected_bookie_options - set(given)}"
            assert given["--zk"] == "zookeeper:2181" and given["--root"] == "/quire"
            assert given["--advertised-host"] == name  # clients reach it by its service name
            bookie_ports.append(int(given["--port"]))
        else:
            assert options(command)["--port"] == "2181"
    assert sorted(bookie_ports) == [3181, 3182, 3183]  # cluster up's defaults: base 3181, one port each
    assert sorted(broker_ports) == [6700, 6701]  # `cluster up --brokers 2`: base 6700
    # Every bookie keeps its data in a volume of its own (brokers keep none).
    volumes = [service["volumes"][0].split(":")[0] for service in services.values() if "volumes" in service]
    assert len(set(volumes)) == len(volumes)


def test_cluster_state_file_records_every_process(tmp_path):
    state = ClusterState(str(tmp_path), "127.0.0.1:1", "/quire")
    state.save()
    assert json.loads((tmp_path / "cluster.json").read_text())["processes"] == []


def test_a_secure_cluster_runs_the_main_job_and_refuses_what_has_no_credentials(tmp_path):
    # `cluster up --secure`: tokens, TLS and ZooKeeper ACLs on every process.
    # The main job's steps with the admin token, the CA and the ZooKeeper
    # identity it made (through the environment, as scripts/main --secure
    # does); without them, the same commands are refused.
    data_dir = tmp_path / "secure"
    zk_port, bookie_port, broker_port, broker_tls_port = free_port(), free_port_run(3), free_port_run(1), free_port_run(1)
    pulsar_port = free_port_run(2)
    up = quire("cluster", "up", "--data-dir", data_dir, "--secure", "--zk-port", zk_port, "--bookie-base-port", bookie_port,
               "--broker-base-port", broker_port, "--broker-tls-base-port", broker_tls_port, "--pulsar-base-port", pulsar_port,
               "--metrics-base-port", 0)
    state = ClusterState.load(data_dir)
    security = data_dir / "security"
    try:
        assert up.returncode == 0, up.stderr
        assert f"pulsar+ssl://127.0.0.1:{pulsar_port + 1}" in up.stdout and "QUIRE_AUTH_TOKEN" in up.stdout
        assert all((security / name).stat().st_mode & 0o077 == 0 for name in ("secret.key", "admin.token", "zk.auth", "ca.key.pem"))
        zk = f"127.0.0.1:{zk_port}"
        tls = ("--tls-trust-certs-file", security / "ca.cert.pem")
        environment = {**os.environ, "QUIRE_AUTH_TOKEN": (security / "admin.token").read_text().strip(),
                       "QUIRE_ZK_AUTH": (security / "zk.auth").read_text().strip()}

        def secured(*arguments, timeout: float = 120) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "quire", *map(str, arguments)], cwd=REPOSITORY, env=environment,
                                  capture_output=True, text=True, timeout=timeout)

        status = secured("cluster", "status", "--data-dir", data_dir)
        assert status.stdout.count("writable") == 3 and status.stdout.count("serving") == 2, status.stdout + status.stderr
        assert secured("topic", "create", "orders", "--zk", zk, *tls, "--partitions", "2").returncode == 0
        produced = secured("produce", "orders", "--zk", zk, *tls, "--producer-id", "billing-1", "--count", "2000",
                           "--batching", "--codec", "zstd", "--key", "account", "--keys", "10")
        assert produced.returncode == 0 and json.loads(produced.stdout)["sent"] == 2000, produced.stderr
        consumed = secured("consume", "orders", "--zk", zk, *tls, "-s", "audit", "--count", "2000")
        assert consumed.returncode == 0 and len(consumed.stdout.splitlines()) == 2000, consumed.stderr
        example = subprocess.run(
            [sys.executable, "examples/pulsar_client.py", "--service-url", f"pulsar+ssl://127.0.0.1:{pulsar_port + 1}",
             "--topic", "orders", "--token-file", security / "admin.token", "--tls-trust-certs-file", security / "ca.cert.pem"],
            cwd=REPOSITORY, capture_output=True, text=True, timeout=120)
        assert example.returncode == 0 and "received and acknowledged 100" in example.stdout, example.stdout + example.stderr
        assert secured("topic", "unload", "orders", "--zk", zk, *tls).returncode == 0
        exported = secured("export", "orders", "--zk", zk, *tls, "--out", tmp_path / "export", "--format", "json", timeout=300)
        assert exported.returncode == 0, exported.stderr[-3000:]
        rows = sum(len(path.read_text().splitlines()) for path in (tmp_path / "export").glob("*.json"))
        assert rows == 2100
        # Without the token (and ZooKeeper's identity), refused in one line.
        bare = {name: value for name, value in environment.items() if name not in ("QUIRE_AUTH_TOKEN", "QUIRE_ZK_AUTH")}
        refused = subprocess.run([sys.executable, "-m", "quire", "topic", "ls", "--service-url", f"127.0.0.1:{broker_port}"],
                                 cwd=REPOSITORY, env=bare, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "AuthenticationError" in refused.stderr, refused.stderr
        no_zk = subprocess.run([sys.executable, "-m", "quire", "ledger", "ls", "--zk", zk], cwd=REPOSITORY, env=bare,
                               capture_output=True, text=True, timeout=60)
        assert no_zk.returncode != 0 and "not allowed" in no_zk.stderr, no_zk.stderr
    finally:
        down = quire("cluster", "down", "--data-dir", data_dir)
    assert down.returncode == 0, down.stderr
    assert not any(process_alive(record) for record in state.processes)
