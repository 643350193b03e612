"""Topic compaction in the deterministic compaction world
(`sim.compaction_world`): the real CompactionCore crashing, failing or
racing at every step of its run, over seeded partitions of keyed messages,
tombstones and keyless messages. Whatever happens, the record names a whole
view of the latest value of each key up to its horizon (the previous
compaction's or the new one's), and the next compaction finishes and leaves
no ledger behind but its view."""

from __future__ import annotations

import random

import pytest

from sim.compaction_world import CompactionWorld, Fault, check_nothing_left, check_view

SEEDS = range(12)
FAULT_KINDS = ("crash", "fail", "refuse", "unknown")


def steps_of_a_clean_run(seed: int, compacted_before: bool) -> int:
    world = _world(seed, compacted_before)
    compaction = world.compaction()
    assert compaction.run()
    return compaction.steps


def _world(seed: int, compacted_before: bool) -> CompactionWorld:
    world = CompactionWorld(seed)
    if compacted_before:
        assert world.compaction().run()
        world.publish(30)
    return world


@pytest.mark.parametrize("compacted_before", [False, True], ids=["first", "again"])
@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_compaction_stopped_at_any_step_leaves_a_whole_view_and_the_next_cleans_up(seed, kind, compacted_before):
    for step in range(1, steps_of_a_clean_run(seed, compacted_before) + 1):
        world = _world(seed, compacted_before)
        before = world.read_record()
        horizon_before = before[0].horizon if before is not None else -1
        compaction = world.compaction()
        finished = compaction.run(Fault(step, kind))
        context = f"seed {seed}, {kind} at step {step}"
        check_view(world)
        after = world.read_record()
        horizon_after = after[0].horizon if after is not None else -1
        assert horizon_after in (horizon_before, world.next_offset - 1), context
        if finished and compaction.error is None:
            assert horizon_after == world.next_offset - 1, context
        # More messages, then a compaction that runs through.
        world.publish(10)
        last = world.compaction()
        assert last.run(), context
        assert last.error is None, f"{context}: {last.error}"
        check_view(world)
        check_nothing_left(world)
        assert world.read_record()[0].horizon == world.next_offset - 1, context


@pytest.mark.parametrize("seed", range(40))
def test_two_compactions_racing_switch_in_at_most_one_whole_view(seed):
    """Two brokers that both believe they own the partition: their steps
    interleave at random; one switch wins, the other fails, and nothing
    either left survives the next compaction."""
    rng = random.Random(seed)
    world = _world(seed, compacted_before=rng.random() < 0.5)
    first = world.compaction("first")
    if rng.random() < 0.5:
        for _ in range(rng.randrange(8)):
            if not first.finished:
                first.step()
        world.publish(rng.randrange(5))
    second = world.compaction("second")
    while not (first.finished and second.finished):
        running = [compaction for compaction in (first, second) if not compaction.finished]
        rng.choice(running).step()
        check_view(world)
    assert (first.switched is None) or (second.switched is None) or first.switched != second.switched
    last = world.compaction("last")
    assert last.run() and last.error is None, last.error
    check_view(world)
    check_nothing_left(world)


@pytest.mark.parametrize("seed", range(20))
def test_compactions_again_and_again_keep_the_latest_of_every_key(seed):
    world = CompactionWorld(seed, keys=20, messages=10)
    for _ in range(8):
        world.publish(random.Random(seed).randrange(1, 40))
        compaction = world.compaction()
        assert compaction.run() and compaction.error is None
        check_view(world)
        check_nothing_left(world)
