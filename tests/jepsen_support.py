"""Helpers the tests of both Jepsen runs (ledgers, and `--broker`) share: a
report that carries a given checker result, for the exit status of `quire
jepsen`; running `quire jepsen` as a process; and checking what every run
leaves behind."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from coordination.zk_launcher import stop_children
from sim.jepsen.history import Operation, fault_windows
from sim.jepsen.runner import JepsenReport

REPOSITORY = Path(__file__).resolve().parents[1]
RUN_DEADLINE_S = 600  # beyond the nemesis time: start-up, healing, the final reads or drain, the checker
OUTPUT_SHOWN_CHARS = 6000  # of a failed run's output, in the assertion message


def report_for(result, tmp_path: Path) -> JepsenReport:
    """A report of a ten-operation run whose checker found `result` (either
    checker's), with its summary written under tmp_path."""
    summary = tmp_path / "summary.txt"
    summary.write_text(result.summary())
    return JepsenReport(tmp_path, result, 10, 1.0, {}, 0, summary, tmp_path / "plot.png", tmp_path / "history.jsonl")


def run_quire_jepsen(work_dir: Path, duration_s: int, *, seed: int, broker: bool = False) -> tuple[int, str]:
    """Runs `quire jepsen` (`--broker` with `broker`); returns its exit
    status and output. The run's own processes die with it (they ask
    the kernel to kill them when their parent dies), so stopping it stops
    everything."""
    process = subprocess.Popen(
        [sys.executable, "-m", "quire", "jepsen", *(["--broker"] if broker else []), "--duration", str(duration_s), "--seed", str(seed),
         "--work-dir", str(work_dir)],
        cwd=REPOSITORY, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        output, _ = process.communicate(timeout=duration_s + RUN_DEADLINE_S)
    finally:
        stop_children([process])
    return process.returncode, output


def assert_exited_valid(status: int, output: str) -> None:
    assert status == 0, output[-OUTPUT_SHOWN_CHARS:]
    assert re.search(r"^VALID$", output, re.MULTILINE), output[-OUTPUT_SHOWN_CHARS:]


def assert_run_left_its_traces(work_dir: Path, operations: list[Operation], summary_start: str) -> None:
    """What every valid run leaves: faults in its history, every session
    expiry confirmed by ZooKeeper, a plot and a summary, and no process
    still running."""
    assert fault_windows(operations), "the nemesis injected nothing"
    # ZooKeeper was seen to expire every session the nemesis meant to expire.
    expiries = [
        operation.value for operation in operations
        if operation.process == "nemesis" and operation.f == "fault-end" and operation.value["fault"] == "expire-session"
    ]
    assert all(expiry["confirmed"] for expiry in expiries), expiries
    assert (work_dir / "plot.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert (work_dir / "summary.txt").read_text().startswith(summary_start)
    # Every process the run started is gone.
    leftover = subprocess.run(["pgrep", "-f", str(work_dir)], capture_output=True, text=True, check=False)
    assert leftover.stdout.strip() == "", leftover.stdout
