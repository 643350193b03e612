"""Runs a local standalone ZooKeeper from the jars of Debian's `zookeeper` package.

Writes `zoo.cfg` and `log4j.properties` under the data directory, starts the
JVM, waits until it serves, and stops it with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Callable, Iterable

JAR_DIR = Path("/usr/share/java")
# What QuorumPeerMain needs in standalone mode (NIO, so no netty).
_REQUIRED_JARS = ("zookeeper.jar", "zookeeper-jute.jar", "slf4j-api.jar", "log4j-1.2.jar")
# Binds slf4j to log4j. Without it slf4j falls back to its no-op logger and
# ZooKeeper writes no log at all, so a failed start cannot be explained.
_LOGGING_JAR = "slf4j-log4j12.jar"
_MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_SESSION_TIMEOUT_MAX_MS = 120_000
_LOG_LINES_ON_ERROR = 20
_POLL_INTERVAL_S = 0.1
_PROBE_TIMEOUT_S = 1.0


class ZooKeeperNotInstalledError(RuntimeError):
    """Java or the ZooKeeper jars are missing."""


class ZooKeeperStartError(RuntimeError):
    """ZooKeeper did not come up (port taken, exited early, or too slow)."""


def four_letter_word(host: str, port: int, word: str, timeout_s: float) -> str:
    """Send a four-letter command (`ruok`, `stat`, `mntr`...) and return the
    whole answer. Raises OSError if the server cannot be reached in time."""
    if len(word) != 4 or not word.isascii():
        raise ValueError(f"a four-letter word has four ASCII letters, got {word!r}")
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(word.encode("ascii"))
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError(f"{word} to {host}:{port} got no full answer within {timeout_s}s")
            sock.settimeout(remaining_s)
            chunk = sock.recv(65536)
            if not chunk:  # the server closes the connection after answering
                break
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the JVM does, so a port in TIME_WAIT counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def stop_children(processes: Iterable[subprocess.Popen], deadline_s: float = 10, *, whole_groups: bool = False) -> None:
    """SIGTERM to each child still running, then wait up to `deadline_s`
    (for all of them together), and SIGKILL (and reap) the ones that did not
    exit. With `whole_groups` (children started with start_new_session) the
    signals go to each child's process group, and SIGKILL always follows,
    for what the child started and left behind."""
    processes = [process for process in processes if process is not None]

    def send(process: subprocess.Popen, signal_number: int) -> None:
        try:
            if whole_groups:
                os.killpg(process.pid, signal_number)
            elif process.poll() is None:
                process.send_signal(signal_number)
        except ProcessLookupError:
            pass

    for process in processes:
        send(process, signal.SIGTERM)
    end = time.monotonic() + deadline_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, end - time.monotonic()))
            if whole_groups:
                send(process, signal.SIGKILL)
        except subprocess.TimeoutExpired:
            send(process, signal.SIGKILL)
            process.wait()


def die_with_parent_hook() -> Callable[[], None]:
    """A `preexec_fn` asking the kernel to SIGKILL the child when its parent
    dies. The kernel ties this to the parent *thread*: start the server from
    a thread that lives as long as the server should (the main thread)."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork, not in the child
    parent_pid = os.getpid()

    def hook() -> None:
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:
            os._exit(1)  # the parent died between fork and prctl

    return hook


def _tail(path: Path, lines_max: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines_max:]
    except FileNotFoundError:
        return []


# The four-letter words quire's ZooKeeper answers: those it asks (health,
# readiness). `dump`, `wchp` and `cons` would show anyone quire's node paths;
# the Jepsen-style runs, which find sessions with `dump`, add it.
FOUR_LETTER_WORDS = ("ruok", "srvr", "stat")


class ZooKeeperServer:
    """One standalone ZooKeeper process serving on `host:port`, with its data,
    configuration (`DATA_DIR/conf`) and log (`DATA_DIR/zookeeper.log`) in
    `data_dir`. Usable as a context manager (start on enter, stop on exit).

    With `die_with_parent` the kernel kills ZooKeeper when the thread that
    called `start` ends (PR_SET_PDEATHSIG follows the thread, not the
    process), so call `start` from the main thread, not a worker thread."""

    def __init__(
        self,
        port: int,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        tick_time_ms: int = 500,
        java: str = "java",
        die_with_parent: bool = False,
        jvm_heap_mb: int = 512,
        jar_dir: Path = JAR_DIR,
        four_letter_words: tuple[str, ...] = FOUR_LETTER_WORDS,
    ) -> None:
        """`four_letter_words`: those the server answers (ZooKeeper's
        4lw.commands.whitelist)."""
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"port must be within 1..65535, got {port!r}")
        if not isinstance(tick_time_ms, int) or tick_time_ms <= 0:
            raise ValueError(f"tick_time_ms must be a positive int, got {tick_time_ms!r}")
        self.port = port
        self.host = host
        self.data_dir = Path(data_dir).resolve()
        self.tick_time_ms = tick_time_ms
        self.java = java
        self.die_with_parent = die_with_parent
        self.jvm_heap_mb = jvm_heap_mb
        self.jar_dir = Path(jar_dir)
        self.four_letter_words = four_letter_words
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The ZooKeeper process id while it runs, else None."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "zookeeper.log"

    @property
    def conf_dir(self) -> Path:
        return self.data_dir / "conf"

    def is_serving(self) -> bool:
        """Whether our process runs, answers `ruok` with `imok` and serves
        requests. `imok` alone comes too early: for a moment after it, `srvr`
        still says "This ZooKeeper instance is not currently serving requests"
        and clients are turned away."""
        if not self.running:
            return False
        try:
            if four_letter_word(self.host, self.port, "ruok", _PROBE_TIMEOUT_S) != "imok":
                return False
            return "Mode: " in four_letter_word(self.host, self.port, "srvr", _PROBE_TIMEOUT_S)
        except OSError:
            return False

    # -- start -------------------------------------------------------------

    def _classpath(self) -> str:
        missing = [name for name in _REQUIRED_JARS if not (self.jar_dir / name).is_file()]
        if missing:
            raise ZooKeeperNotInstalledError(
                f"ZooKeeper jars missing from {self.jar_dir}: {', '.join(missing)}; "
                "install Debian's zookeeper package (apt-get install zookeeper)"
            )
        jars = [self.jar_dir / name for name in _REQUIRED_JARS]
        if (self.jar_dir / _LOGGING_JAR).is_file():
            jars.append(self.jar_dir / _LOGGING_JAR)
        # The conf directory comes first so log4j finds our log4j.properties.
        return ":".join([str(self.conf_dir)] + [str(jar) for jar in jars])

    def _java_path(self) -> str:
        found = shutil.which(self.java)
        if found is None:
            raise ZooKeeperNotInstalledError(
                f"java not found ({self.java!r}); install a Java runtime (apt-get install default-jre-headless)"
            )
        return found

    def _write_config(self) -> Path:
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.conf_dir / "zoo.cfg"
        config_path.write_text(
            "\n".join(
                [
                    f"tickTime={self.tick_time_ms}",
                    f"dataDir={self.data_dir}",
                    f"clientPort={self.port}",
                    f"clientPortAddress={self.host}",
                    f"maxSessionTimeout={_SESSION_TIMEOUT_MAX_MS}",
                    "admin.enableServer=false",
                    f"4lw.commands.whitelist={','.join(self.four_letter_words)}",
                    "",
                ]
            )
        )
        (self.conf_dir / "log4j.properties").write_text(
            "\n".join(
                [
                    "log4j.rootLogger=INFO, FILE",
                    "log4j.appender.FILE=org.apache.log4j.RollingFileAppender",
                    f"log4j.appender.FILE.File={self.log_path}",
                    "log4j.appender.FILE.MaxFileSize=10MB",
                    "log4j.appender.FILE.MaxBackupIndex=3",
                    "log4j.appender.FILE.layout=org.apache.log4j.PatternLayout",
                    "log4j.appender.FILE.layout.ConversionPattern=%d{ISO8601} %-5p [%t:%C{1}@%L] - %m%n",
                    "",
                ]
            )
        )
        return config_path

    def _failure_detail(self) -> str:
        lines = _tail(self.data_dir / "zookeeper.out", _LOG_LINES_ON_ERROR) + _tail(self.log_path, _LOG_LINES_ON_ERROR)
        if not lines:
            return "(ZooKeeper wrote no log)"
        return "last log lines:\n" + "\n".join(lines)

    def start(self, deadline_s: float = 30) -> None:
        """Start ZooKeeper and return once it serves (see `is_serving`); raise
        ZooKeeperStartError (with the end of its log) if it exits first or
        `deadline_s` passes."""
        if self.running:
            raise ValueError(f"ZooKeeper on {self.address} is already running")
        classpath = self._classpath()
        java_path = self._java_path()
        if _port_in_use(self.host, self.port):
            raise ZooKeeperStartError(f"port {self.port} is already in use")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config_path = self._write_config()
        command = [
            java_path,
            f"-Xmx{self.jvm_heap_mb}m",
            "-XX:+UseSerialGC",
            "-cp",
            classpath,
            _MAIN_CLASS,
            str(config_path),
        ]
        # The JVM's own complaints (bad flag, missing class) go to zookeeper.out.
        with open(self.data_dir / "zookeeper.out", "ab") as console:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                # Our own signal handling decides when ZooKeeper stops, not a
                # Ctrl-C sent to the terminal's process group.
                start_new_session=True,
                preexec_fn=die_with_parent_hook() if self.die_with_parent else None,
            )
        end = time.monotonic() + deadline_s
        while True:
            status = self._process.poll()
            if status is not None:
                raise ZooKeeperStartError(
                    f"ZooKeeper exited with status {status} before serving on {self.address}; {self._failure_detail()}"
                )
            if self.is_serving():
                return
            if time.monotonic() >= end:
                self.stop()
                raise ZooKeeperStartError(
                    f"ZooKeeper did not serve on {self.address} within {deadline_s}s; {self._failure_detail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    # -- stop --------------------------------------------------------------

    def stop(self, deadline_s: float = 10) -> None:
        """SIGTERM, wait up to `deadline_s`, then SIGKILL. Does nothing if
        ZooKeeper is not running."""
        if self._process is not None:
            stop_children([self._process], deadline_s)

    def wait(self) -> int:
        """Block until the ZooKeeper process exits; return its status."""
        if self._process is None:
            raise ValueError("ZooKeeper was never started")
        return self._process.wait()

    def __enter__(self) -> "ZooKeeperServer":
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


class _StopRequested(Exception):
    """Raised by the SIGTERM/SIGINT handler of `run_foreground`."""


def run_foreground(port: int, data_dir: Path, *, host: str = "127.0.0.1", tick_time_ms: int = 500) -> int:
    """`quire zk run`: serve until SIGTERM or SIGINT, then stop cleanly.
    Returns 0, or 1 if ZooKeeper exits on its own."""
    server = ZooKeeperServer(port, Path(data_dir), host=host, tick_time_ms=tick_time_ms, die_with_parent=True)

    def request_stop(signal_number: int, frame: FrameType | None) -> None:
        raise _StopRequested()

    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {signal_number: signal.signal(signal_number, request_stop) for signal_number in signals}
    try:
        server.start()
        print(f"zookeeper serving on {server.address} (data {server.data_dir})", flush=True)
        status = server.wait()
        print(f"zookeeper exited with status {status}; see {server.log_path}", file=sys.stderr, flush=True)
        return 1
    except _StopRequested:
        return 0
    finally:
        # A second signal must not interrupt the clean stop.
        for signal_number in signals:
            signal.signal(signal_number, signal.SIG_IGN)
        try:
            server.stop()
        finally:
            for signal_number, handler in previous.items():
                signal.signal(signal_number, handler)
