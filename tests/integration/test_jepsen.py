"""A short Jepsen-style run against real processes (ZooKeeper, five bookies,
writer and reader processes, a nemesis through per-link proxies): the
history it records is checked valid and complete, readers' recoveries raced
the writers, every session expiry was confirmed by ZooKeeper, and the
summary and plot are written. A longer run is marked slow."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sim.jepsen import check, fault_windows, read_history

REPOSITORY = Path(__file__).resolve().parents[2]


def run_jepsen(work_dir: Path, duration_s: int, seed: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "quire", "jepsen", "--duration", str(duration_s), "--seed", str(seed), "--work-dir", str(work_dir)],
        cwd=REPOSITORY, capture_output=True, text=True, timeout=duration_s + 600,
    )


def assert_valid_run(work_dir: Path, completed: subprocess.CompletedProcess) -> None:
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert re.search(r"^VALID$", completed.stdout, re.MULTILINE), completed.stdout[-3000:]
    operations = read_history(work_dir / "history.jsonl")
    result = check(operations)
    assert result.verdict == "VALID" and result.adds_ok > 100 and result.reads_final > 0, result.summary()
    assert not result.unseen, result.summary()
    assert fault_windows(operations), "the nemesis injected nothing"
    # A reader recovered a ledger while the writers were writing (before
    # the final reader started).
    assert any(
        operation.process.startswith("reader") and operation.f == "recover" and operation.type == "ok"
        for operation in operations
    ), result.summary()
    # ZooKeeper was seen to expire every session the nemesis meant to expire.
    expiries = [
        operation.value for operation in operations
        if operation.process == "nemesis" and operation.f == "fault-end" and operation.value["fault"] == "expire-session"
    ]
    assert all(expiry["confirmed"] for expiry in expiries), expiries
    assert (work_dir / "plot.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert (work_dir / "summary.txt").read_text().startswith("quire jepsen: seed")
    # Every process the run started is gone.
    leftover = subprocess.run(["pgrep", "-f", str(work_dir)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout


def test_a_short_jepsen_run_is_valid(tmp_path):
    work_dir = tmp_path / "jepsen"
    assert_valid_run(work_dir, run_jepsen(work_dir, 20, seed=1))


@pytest.mark.slow
def test_a_long_jepsen_run_is_valid(tmp_path):
    work_dir = tmp_path / "jepsen"
    assert_valid_run(work_dir, run_jepsen(work_dir, 180, seed=2))
