"""The local ZooKeeper launcher: start, stop, port conflicts, missing jars,
and that ZooKeeper dies with the process that launched it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coordination.zk_launcher import (
    ZooKeeperNotInstalledError,
    ZooKeeperServer,
    ZooKeeperStartError,
    four_letter_word,
)
from tests.support import free_port, wait_until

REPOSITORY = Path(__file__).resolve().parents[2]


def process_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_start_serves_ruok_and_stop_ends_the_process(tmp_path):
    server = ZooKeeperServer(free_port(), tmp_path, die_with_parent=True)
    with server:
        pid = server.pid
        assert pid is not None and process_alive(pid)
        assert server.is_serving()
        assert four_letter_word("127.0.0.1", server.port, "ruok", 2) == "imok"
        assert "Zookeeper version" in four_letter_word("127.0.0.1", server.port, "stat", 2)
        assert (tmp_path / "conf" / "zoo.cfg").is_file()
    assert not process_alive(pid)
    assert server.pid is None and not server.is_serving()
    # Logging works: slf4j is bound to log4j and writes where we asked.
    assert "binding to port" in (tmp_path / "zookeeper.log").read_text()


def test_port_in_use_is_reported_before_launching(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        server = ZooKeeperServer(port, tmp_path)
        with pytest.raises(ZooKeeperStartError, match=f"^port {port} is already in use$"):
            server.start()
        assert server.pid is None


def test_port_held_by_the_shared_zookeeper_is_in_use(zookeeper, tmp_path):
    with pytest.raises(ZooKeeperStartError, match="already in use"):
        ZooKeeperServer(zookeeper.port, tmp_path).start()


def test_missing_jars_say_which_package_to_install(tmp_path):
    server = ZooKeeperServer(free_port(), tmp_path / "data", jar_dir=tmp_path / "no-jars")
    with pytest.raises(ZooKeeperNotInstalledError, match="zookeeper package"):
        server.start()


def test_missing_java_is_reported(tmp_path):
    server = ZooKeeperServer(free_port(), tmp_path, java="no-such-java-binary")
    with pytest.raises(ZooKeeperNotInstalledError, match="java"):
        server.start()


def test_early_exit_reports_the_end_of_the_log(tmp_path):
    # A JVM that cannot start: its complaint must reach the error message.
    server = ZooKeeperServer(free_port(), tmp_path, jvm_heap_mb=0)
    with pytest.raises(ZooKeeperStartError, match="exited with status") as caught:
        server.start()
    assert "heap" in str(caught.value).lower()


def test_zookeeper_dies_with_its_parent(tmp_path):
    # A parent process starts ZooKeeper with die_with_parent, reports the pid,
    # and is killed with SIGKILL: no clean-up code runs, yet ZooKeeper goes.
    port = free_port()
    parent_script = textwrap.dedent(
        f"""
        import sys, threading
        from pathlib import Path
        from coordination.zk_launcher import ZooKeeperServer
        server = ZooKeeperServer({port}, Path({str(tmp_path)!r}), die_with_parent=True)
        server.start()
        print(server.pid, flush=True)
        threading.Event().wait()
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_script], cwd=REPOSITORY, stdout=subprocess.PIPE, text=True
    )
    zookeeper_pid = None
    try:
        zookeeper_pid = int(parent.stdout.readline())
        assert process_alive(zookeeper_pid)
        parent.kill()
        parent.wait(timeout=10)
        wait_until(lambda: not process_alive(zookeeper_pid), deadline_s=15, what="ZooKeeper to die with its parent")
    finally:
        parent.kill()
        parent.wait(timeout=10)
        if zookeeper_pid is not None and process_alive(zookeeper_pid):
            os.kill(zookeeper_pid, 9)


def test_run_foreground_serves_until_sigterm_then_stops_cleanly(tmp_path):
    port = free_port()
    command = [
        sys.executable,
        "-c",
        f"import sys; from coordination.zk_launcher import run_foreground; "
        f"sys.exit(run_foreground({port}, {str(tmp_path)!r}))",
    ]
    foreground = subprocess.Popen(command, cwd=REPOSITORY, stdout=subprocess.PIPE, text=True)
    try:
        assert foreground.stdout.readline() == f"zookeeper serving on 127.0.0.1:{port} (data {tmp_path})\n"
        assert four_letter_word("127.0.0.1", port, "ruok", 2) == "imok"
        foreground.send_signal(signal.SIGTERM)
        assert foreground.wait(timeout=15) == 0
        with pytest.raises(OSError):
            four_letter_word("127.0.0.1", port, "ruok", 2)
    finally:
        foreground.kill()
        foreground.wait(timeout=10)
