"""The real processes of a Jepsen-style run: started with a log file, killed
with SIGKILL, stopped with SIGTERM, paused with SIGSTOP and resumed with
SIGCONT, and killed by the kernel if the controller dies."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import trio

from coordination.zk_launcher import die_with_parent_hook

STOP_DEADLINE_S = 20.0


# Below the kernel's ephemeral range (32768 and up by default), where no
# port-0 listener (the run's proxies) and no outgoing connection takes a port.
SERVER_PORTS = range(20_000, 32_000)


def free_server_ports(count: int, *, rng: random.Random | None = None) -> list[int]:
    """`count` different ports on 127.0.0.1 that nothing listens on at the
    time of the call, for servers started later: chosen below the ephemeral
    range, so that the proxies listening meanwhile (on ephemeral ports)
    cannot take one, and checked all at once, so none is given twice."""
    rng = rng or random.Random()
    while True:
        ports = rng.sample(SERVER_PORTS, count)
        sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in ports]
        try:
            for sock, port in zip(sockets, ports):
                sock.bind(("127.0.0.1", port))
            return ports
        except OSError:
            continue  # one is in use: draw again
        finally:
            for sock in sockets:
                sock.close()


class ManagedProcess:
    def __init__(self, name: str, command: list[str], log_path: Path, *, port: int | None = None) -> None:
        self.name = name
        self.command = command
        self.log_path = log_path
        self.port = port
        self.process: subprocess.Popen | None = None
        self.paused = False
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        assert not self.running, f"{self.name} is already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')} {' '.join(self.command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent_hook(), env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.paused = False
        self.starts += 1

    async def wait_serving(self, deadline_s: float = 60.0) -> None:
        """Wait until the process accepts connections on its port."""
        assert self.port is not None
        with trio.fail_after(deadline_s):
            while True:
                if not self.running:
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}: see {self.log_path}")
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", self.port)
                except OSError:
                    await trio.sleep(0.1)
                    continue
                await stream.aclose()
                return

    def kill(self) -> None:
        """kill -9, and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self.paused = False

    def pause(self) -> None:
        if self.running:
            self.process.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.running and self.paused:
            self.process.send_signal(signal.SIGCONT)
        self.paused = False

    async def stop(self, deadline_s: float = STOP_DEADLINE_S) -> int | None:
        """SIGTERM (after SIGCONT if paused), then SIGKILL past the deadline."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.resume()
            self.process.send_signal(signal.SIGTERM)
            with trio.move_on_after(deadline_s):
                while self.process.poll() is None:
                    await trio.sleep(0.05)
            self.kill()
        return self.process.returncode

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
