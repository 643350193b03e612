"""A short `quire jepsen --broker` run against real processes (ZooKeeper,
four bookies, three brokers, deduplicating producers and consumers of a
subscription of every type, a nemesis through per-link proxies): the history
it records is checked valid and complete, every subscription was drained,
the nemesis injected faults and ZooKeeper confirmed every session expiry,
the summary and plot are written, and nothing the run started is left
running. A longer run is marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.jepsen import check_broker, read_history
from tests.jepsen_support import assert_exited_valid, assert_run_left_its_traces, run_quire_jepsen


def assert_valid_run(work_dir: Path, status: int, output: str) -> None:
    assert_exited_valid(status, output)
    operations = read_history(work_dir / "history.jsonl")
    result = check_broker(operations)
    assert result.verdict == "VALID", result.summary()
    assert result.produces_ok > 200 and result.messages_stored >= result.produces_ok, result.summary()
    assert set(result.subscriptions) == {"sub-exclusive", "sub-failover", "sub-shared", "sub-key_shared"}
    for name, subscription in result.subscriptions.items():
        assert subscription.drained and subscription.messages == result.messages_stored, (name, result.summary())
        assert subscription.acks_ok > 0, (name, result.summary())
    assert result.subscriptions["sub-exclusive"].cumulative_acks_ok > 0, result.summary()
    assert_run_left_its_traces(work_dir, operations, "quire jepsen --broker: seed")


def test_a_short_broker_jepsen_run_is_valid(tmp_path):
    work_dir = tmp_path / "jepsen"
    assert_valid_run(work_dir, *run_quire_jepsen(work_dir, 25, seed=39, broker=True))


@pytest.mark.slow(seconds=240)
def test_a_long_broker_jepsen_run_is_valid(tmp_path):
    work_dir = tmp_path / "jepsen"
    assert_valid_run(work_dir, *run_quire_jepsen(work_dir, 180, seed=13, broker=True))
