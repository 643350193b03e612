"""A standalone Spark cluster started from the pyspark package, for tests and
benchmarks: a master and N workers as separate processes on loopback, each
worker in a mount namespace of its own where given directories (the
checkout, and with it .venv) are hidden under an empty tmpfs, running its
own copy of Spark: as on machines that cannot see the project at all.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from coordination.zk_launcher import die_with_parent_hook

START_DEADLINE_S = 120.0  # a master and its workers registered, on a busy 2-core machine
STOP_DEADLINE_S = 10.0  # after SIGTERM, before SIGKILL
POLL_S = 0.2
LOG_TAIL_LINES_MAX = 30
# Variables that would lead a worker's processes back to this machine's
# Python environment (which the worker is not meant to see).
ENVIRONMENT_DROPPED = ("PYTHONPATH", "VIRTUAL_ENV", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_HOME",
                       "SPARK_CONF_DIR")


class IsolationRefused(RuntimeError):
    """This machine does not let a process have a mount namespace of its own
    (unshare or mount refused): the workers could not be hidden from the
    project."""


def spark_home() -> Path:
    """The pyspark package's directory, a Spark distribution of its own
    (bin/spark-class, jars/)."""
    import pyspark

    return Path(pyspark.__file__).parent


def private_spark_copy(target: Path) -> Path:
    """A copy of the pyspark package at `target` (hard links where the file
    system allows: seconds, not 500 MB written), so that a worker with the
    checkout (and .venv in it) hidden still has a Spark."""
    if not (target / "bin" / "spark-class").exists():
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)

        def link_or_copy(source: str, destination: str) -> None:
            try:
                os.link(source, destination)
            except OSError:  # another file system
                shutil.copy2(source, destination)

        shutil.copytree(spark_home(), partial, symlinks=True, copy_function=link_or_copy,
                        ignore=shutil.ignore_patterns("__pycache__"))
        os.rename(partial, target)
    return target


def check_isolation(hidden: Sequence[Path]) -> None:
    """IsolationRefused unless a process may hide `hidden` in a mount
    namespace of its own here."""
    try:
        completed = subprocess.run(isolated_command(hidden, ["true"]), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise IsolationRefused(f"unshare --mount could not run: {error}") from None
    if completed.returncode != 0:
        raise IsolationRefused(f"unshare --mount with a tmpfs over {', '.join(map(str, hidden))} was refused: "
                               f"{completed.stderr.strip() or completed.returncode}")


def isolated_command(hidden: Sequence[Path], command: Sequence[str]) -> list[str]:
    """`command` in a mount namespace of its own where each of `hidden` is an
    empty tmpfs (private propagation: the host's mounts are not touched)."""
    if not hidden:
        return list(command)
    mounts = " && ".join(f"mount -t tmpfs -o size=1m,mode=0755 quire-hidden {shlex.quote(str(path))}" for path in hidden)
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", f'{mounts} && exec "$@"', "sh",
            *command]


@dataclass
class StandaloneCluster:
    """`with StandaloneCluster(base, workers=2, hidden=[checkout], port=free_port) as spark:`
    then `spark.master_url`. Every process (the master, the workers, their
    executors and Python workers: each started in a process group of its
    own) is stopped on exit, and dies with this process if it dies."""

    base: Path
    workers: int
    port: Callable[[], int]  # a free TCP port on 127.0.0.1
    hidden: Sequence[Path] = ()
    cores_per_worker: int = 1
    memory_per_worker: str = "1g"
    spark: Path | None = None  # a private copy of Spark (default: made under base)
    processes: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.master_port = self.port()
        self.web_port = self.port()

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    def worker_directory(self, index: int) -> Path:
        """Where worker `index` (from 1) keeps its executors' folders:
        app-<id>/<executor id>/ with each executor's stderr and the
        archives it unpacked."""
        return self.base / f"worker-{index}" / "work"

    def log_path(self, name: str) -> Path:
        return self.base / f"{name}.log"

    def __enter__(self) -> "StandaloneCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        if self.hidden:
            check_isolation(self.hidden)
        spark = self.spark or private_spark_copy(self.base / "spark")
        environment = {name: value for name, value in os.environ.items() if name not in ENVIRONMENT_DROPPED}
        environment.update(SPARK_HOME=str(spark), SPARK_LOCAL_IP="127.0.0.1", SPARK_NO_DAEMONIZE="1")
        spark_class = str(spark / "bin" / "spark-class")
        self._start("master", [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(self.master_port), "--webui-port", str(self.web_port)], environment)
        for index in range(1, self.workers + 1):
            directory = self.worker_directory(index)
            directory.mkdir(parents=True, exist_ok=True)
            command = [spark_class, "org.apache.spark.deploy.worker.Worker", self.master_url, "--host", "127.0.0.1",
                       "--webui-port", str(self.port()), "--cores", str(self.cores_per_worker),
                       "--memory", self.memory_per_worker, "--work-dir", str(directory)]
            self._start(f"worker-{index}", isolated_command(self.hidden, command), environment, cwd=directory)
        self.wait_workers_alive()

    def _start(self, name: str, command: list[str], environment: dict[str, str], cwd: Path | None = None) -> None:
        with open(self.log_path(name), "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=environment, cwd=cwd or self.base, start_new_session=True,
                                       preexec_fn=die_with_parent_hook())
        self.processes.append((name, process))

    def master_state(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/json/", timeout=5) as answer:
            return json.load(answer)

    def wait_workers_alive(self, deadline_s: float = START_DEADLINE_S) -> None:
        end = time.monotonic() + deadline_s
        while True:
            for name, process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"Spark {name} exited with {process.returncode}:\n{self.log_tail(name)}")
            try:
                if self.master_state().get("aliveworkers", 0) >= self.workers:
                    return
            except OSError:  # the master's web UI is not up yet
                pass
            except ValueError:
                # The UI answers its HTML page for /json/ until the JSON
                # handler is attached, early in the master's start.
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"{self.workers} Spark workers not registered after {deadline_s}s:\n"
                                   + "\n".join(self.log_tail(name) for name, _ in self.processes))
            time.sleep(POLL_S)

    def log_tail(self, name: str) -> str:
        try:
            lines = self.log_path(name).read_text(errors="replace").splitlines()[-LOG_TAIL_LINES_MAX:]
        except OSError:
            lines = []
        return "\n".join([f"--- {name} ---", *lines])

    def stop(self) -> None:
        """SIGTERM to each process group (a worker's executors and their
        Python workers with it), SIGKILL to what is left after a while."""
        from coordination.zk_launcher import stop_children

        stop_children([process for _, process in self.processes], STOP_DEADLINE_S, whole_groups=True)
        self.processes.clear()
