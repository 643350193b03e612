"""`quire zk|bookie|broker health` against real processes: exit 0 while a
process serves, exit 1 with the reason when it does not (the compose
cluster's health checks)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from tests.integration.bookie_processes import bookies  # noqa: F401 (a fixture)
from tests.integration.broker_processes import brokers  # noqa: F401 (a fixture)
from tests.support import free_port

pytestmark = pytest.mark.integration


async def health(*arguments: str) -> subprocess.CompletedProcess:
    return await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "quire", *arguments], capture_output=True, text=True, timeout=60))


async def test_health_of_each_role(zk_hosts, zk_root, bookies, brokers):
    checked = await health("zk", "health", zk_hosts.split(",")[0])
    assert checked.returncode == 0 and "healthy" in checked.stdout, checked
    closed = await health("zk", "health", f"127.0.0.1:{free_port()}", "--timeout", "1s")
    assert closed.returncode == 1 and "unhealthy: cannot be reached" in closed.stdout, closed

    started = [await bookies.started() for _ in range(3)]
    bookie = started[0]
    checked = await health("bookie", "health", bookie.address, "--zk", zk_hosts, "--root", zk_root)
    assert checked.returncode == 0, checked
    # Registered elsewhere: the bookie serves, but clients would not pick it.
    wrong_root = await health("bookie", "health", bookie.address, "--zk", zk_hosts, "--root", zk_root + "-other")
    assert wrong_root.returncode == 1 and "not registered as writable" in wrong_root.stdout, wrong_root
    bookie.pause()
    try:
        paused = await health("bookie", "health", bookie.address, "--zk", zk_hosts, "--root", zk_root, "--timeout", "1s")
    finally:
        bookie.resume()
    assert paused.returncode == 1 and "unhealthy" in paused.stdout, paused

    broker = await brokers.started()
    checked = await health("broker", "health", broker.address)
    assert checked.returncode == 0 and "healthy" in checked.stdout, checked
    broker.kill()
    gone = await health("broker", "health", broker.address, "--timeout", "2s")
    assert gone.returncode == 1 and "unhealthy" in gone.stdout, gone
    assert all("Traceback" not in result.stderr for result in (checked, gone, paused, wrong_root, closed))
