"""A process of the `quire` command line started by a test: its log file,
kill -9, SIGTERM, SIGSTOP/SIGCONT, and the tail of its log for failures.
Bookies and brokers build on it; their fixtures stop every one they started,
even when the test fails."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from coordination.zk_launcher import die_with_parent_hook
from tests.support import wait_until_async


@dataclass
class QuireProcess:
    zk_hosts: str
    root: str
    directory: Path
    port: int
    options: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    role = "process"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.directory / f"{self.role}.log"

    def arguments(self) -> list[str]:
        raise NotImplementedError

    def command(self) -> list[str]:
        return [sys.executable, "-m", "quire", *self.arguments(), *self.options]

    def start(self) -> None:
        assert not self.running, f"{self.role} already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')} {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent_hook(),
            )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """kill -9: no shutdown, no flush, nothing."""
        if self.running:
            self.process.send_signal(signal.SIGCONT)  # a stopped process dies at once too
            self.process.send_signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=10)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def terminate(self, deadline_s: float = 30) -> int:
        if self.running:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"{self.role} did not stop within {deadline_s}s of SIGTERM:\n{self.log_tail()}")
        return self.process.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def wait_until_probe_answers(self, probe, deadline_s: float):
        """Wait until `probe()` (async) returns something truthy and
        return it; fail at once if the process exits, and after
        `deadline_s` with its log."""
        async def answered():
            if not self.running:
                raise AssertionError(f"{self.role} exited with {self.process.returncode}:\n{self.log_tail()}")
            return await probe()

        try:
            return await wait_until_async(answered, deadline_s=deadline_s, what=f"{self.address} serving", poll_s=0.05)
        except AssertionError as error:
            if self.running:
                raise AssertionError(f"{error}:\n{self.log_tail()}") from None
            raise


def print_logs(processes: list[QuireProcess], lines: int = 60) -> None:
    """Pytest shows captured output only when the test failed."""
    for process in processes:
        print(f"--- log of {process.role} {process.address} ---\n{process.log_tail(lines)}", file=sys.stderr)
