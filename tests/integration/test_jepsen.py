"""A short Jepsen-style run against real processes (ZooKeeper, five bookies,
writer and reader processes, a nemesis through per-link proxies): the
history it records is checked valid and complete, readers' recoveries raced
the writers, every session expiry was confirmed by ZooKeeper, and the
summary and plot are written. A longer run is marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.jepsen import check, read_history
from tests.jepsen_support import assert_exited_valid, assert_run_left_its_traces, run_quire_jepsen


def assert_valid_run(work_dir: Path, status: int, output: str) -> None:
    assert_exited_valid(status, output)
    operations = read_history(work_dir / "history.jsonl")
    result = check(operations)
    assert result.verdict == "VALID" and result.adds_ok > 100 and result.reads_final > 0, result.summary()
    assert not result.unseen, result.summary()
    # A reader recovered a ledger while the writers were writing (before
    # the final reader started).
    assert any(
        operation.process.startswith("reader") and operation.f == "recover" and operation.type == "ok"
        for operation in operations
    ), result.summary()
    assert_run_left_its_traces(work_dir, operations, "quire jepsen: seed")


def test_a_short_jepsen_run_is_valid(tmp_path):
    work_dir = tmp_path / "jepsen"
    assert_valid_run(work_dir, *run_quire_jepsen(work_dir, 20, seed=1))


@pytest.mark.slow(seconds=220)
def test_a_long_jepsen_run_is_valid(tmp_path):
    work_dir = tmp_path / "jepsen"
    assert_valid_run(work_dir, *run_quire_jepsen(work_dir, 180, seed=2))
