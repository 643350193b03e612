"""Kill -9 cycles under a deduplicating producer (sim/kill_cycles.py): a
random bookie or broker killed with SIGKILL and started again every few
seconds while a producer publishes numbered messages; afterwards everything
acknowledged is consumed, and nothing is stored twice."""

from __future__ import annotations

import pytest

from sim.kill_cycles import run_kill_cycles


@pytest.mark.slow(seconds=300)
async def test_everything_acknowledged_is_consumed_exactly_once_through_kill_cycles(zk_hosts, zk_root, tmp_path):
    report = await run_kill_cycles(tmp_path, zk_hosts, cycles=20, seed=20, root=zk_root)
    assert report.cycles == 20
    assert report.acknowledged > 0
    assert report.ok, report.summary()
