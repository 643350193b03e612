"""A throwaway cluster for benchmarks: a real ZooKeeper and real bookie
processes in a scratch directory, stopped (and the directory removed) on
exit. Also the percentile and JSON helpers every benchmark shares."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import trio

from coordination.zk_launcher import ZooKeeperServer, die_with_parent_hook, stop_children
from ledger_client.bookie_client import BookieClient
from security.credentials import NO_CREDENTIALS, ClientCredentials


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, int(round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU a process has used (every thread), or None if it is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # After the command's closing parenthesis (it may hold spaces)
            # the state is field 3 of proc(5): utime (14) and stime (15) follow.
            fields = stat.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def role_cpu_seconds(cluster: "BenchCluster | None") -> dict[str, float]:
    """CPU seconds used so far by this process ("client") and, in a
    cluster, by its brokers (if it has any), its bookies and ZooKeeper
    (each role summed)."""
    used = {"client": cpu_seconds(os.getpid()) or 0.0}
    if cluster is not None:
        if cluster.brokers:
            used["broker"] = sum(cpu_seconds(process.pid) or 0.0 for _, process in cluster.brokers)
        used["bookies"] = sum(cpu_seconds(process.pid) or 0.0 for _, process in cluster.bookies)
        used["zookeeper"] = cpu_seconds(cluster.zk.pid) or 0.0
    return used


def cpu_percent_between(before: dict[str, float], after: dict[str, float], elapsed_s: float) -> dict[str, float]:
    """Each role's share of one core over `elapsed_s`, in percent."""
    return {role: round((after[role] - before[role]) / elapsed_s * 100, 1) for role in after}


def rss_mb(pid: int) -> float:
    """The process's resident memory in MiB (as every "_mb" here)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def latency_summary(latencies_ms: list[float]) -> dict:
    """p50, p99 and p99.9 in ms; null (JSON has no NaN) where nothing was timed."""
    latencies_ms = sorted(latencies_ms)
    if not latencies_ms:
        return {"latency_ms_p50": None, "latency_ms_p99": None, "latency_ms_p999": None}
    return {
        "latency_ms_p50": round(percentile(latencies_ms, 0.5), 4),
        "latency_ms_p99": round(percentile(latencies_ms, 0.99), 4),
        "latency_ms_p999": round(percentile(latencies_ms, 0.999), 4),
    }


def start_process(role: str, directory: Path, arguments: list[str]) -> subprocess.Popen:
    """`quire ROLE run ...` in the background, logging to DIRECTORY/ROLE.log."""
    directory.mkdir(parents=True, exist_ok=True)
    log = open(directory / f"{role}.log", "ab")
    command = [sys.executable, "-m", "quire", role, "run", *arguments,
               "--log-level", os.environ.get(f"BENCH_{role.upper()}_LOG", "warning")]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent_hook())


def start_bookie(zk: ZooKeeperServer, root: str, directory: Path, port: int, extra: list[str]) -> subprocess.Popen:
    return start_process("bookie", directory, [
        "--zk", zk.address, "--root", root, "--port", str(port),
        "--journal-dir", str(directory / "journal"), "--ledger-dir", str(directory / "ledgers"), *extra,
    ])


async def wait_serving(address: str, process: subprocess.Popen, deadline_s: float = 60,
                       credentials: ClientCredentials = NO_CREDENTIALS) -> None:
    end = time.monotonic() + deadline_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"bookie exited with {process.returncode}")
        try:
            async with BookieClient.connect(address, credentials=credentials) as client:
                await client.get_info()
                return
        except Exception:
            if time.monotonic() > end:
                raise
            await trio.sleep(0.1)


async def wait_broker_serving(address: str, process: subprocess.Popen, deadline_s: float = 60) -> None:
    from broker.client.connection import BrokerConnection
    from broker.errors import AuthenticationError, ConnectionClosedError

    end = time.monotonic() + deadline_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"broker exited with {process.returncode}")
        try:
            connection = await BrokerConnection.connect(address, "bench", frame_bytes_max=1 << 20)
            await connection.aclose()
            return
        except AuthenticationError:
            return  # a broker that authenticates answered
        except ConnectionClosedError:
            if time.monotonic() > end:
                raise
            await trio.sleep(0.1)


def _metrics_options(metrics: bool) -> list[str]:
    return ["--metrics-port", str(free_port())] if metrics else []


@dataclass
class BenchCluster:
    directory: Path
    zk: ZooKeeperServer
    root: str
    bookies: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    brokers: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    @property
    def zk_hosts(self) -> str:
        return self.zk.address

    @property
    def bookie_addresses(self) -> list[str]:
        return [address for address, _ in self.bookies]


@contextlib.contextmanager
def bench_cluster(bookie_count: int, *, base: Path | None = None, root: str = "/bench", bookie_options: list[str] = (),
                  broker_count: int = 0, broker_options: list[str] = (), metrics: bool = False,
                  bookie_credentials: ClientCredentials = NO_CREDENTIALS) -> Iterator[BenchCluster]:
    """ZooKeeper, `bookie_count` bookies and `broker_count` brokers, serving,
    in a new directory under `base` (default ./.bench); everything stopped
    and removed after. With `metrics`, each bookie and broker serves
    Prometheus /metrics on a port of its own (and so measures itself)."""
    base = base or Path(".bench")
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="cluster-", dir=base))
    zk = ZooKeeperServer(free_port(), directory / "zookeeper", die_with_parent=True)
    cluster = BenchCluster(directory, zk, root)
    try:
        zk.start()
        for index in range(bookie_count):
            port = free_port()
            process = start_bookie(zk, root, directory / f"bookie-{index + 1}", port, list(bookie_options) + _metrics_options(metrics))
            cluster.bookies.append((f"127.0.0.1:{port}", process))

        async def all_serving() -> None:
            async with trio.open_nursery() as nursery:
                for address, process in cluster.bookies:
                    nursery.start_soon(wait_serving, address, process, 60, bookie_credentials)

        trio.run(all_serving)
        for index in range(broker_count):
            port = free_port()
            process = start_process("broker", directory / f"broker-{index + 1}",
                                    ["--zk", zk.address, "--root", root, "--port", str(port), *broker_options,
                                     *_metrics_options(metrics)])
            cluster.brokers.append((f"127.0.0.1:{port}", process))
        for address, process in cluster.brokers:
            trio.run(wait_broker_serving, address, process)
        yield cluster
    finally:
        stop_children([process for _, process in cluster.brokers + cluster.bookies], deadline_s=30)
        zk.stop()
        shutil.rmtree(directory, ignore_errors=True)
