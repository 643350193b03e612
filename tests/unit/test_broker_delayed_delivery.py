"""Delayed delivery in the dispatcher core: a message with a delivery time
is held back from shared and key-shared subscriptions until then (not from
exclusive and failover ones, as in Pulsar), does not hold back the messages
behind it, and is delivered once; past the memory bound, held messages are
spilled in runs sorted by time and still come out in time order, never lost
nor delivered twice."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cursor import Cursor
import pytest

from broker.delayed_index import CARRIED_BYTES_MAX, SEGMENT_RECORDS, DelayedIndex, DiskSpillFile, MemorySpillFile, SpillError
from broker.dispatcher import Dispatcher, EntryRef, SubscriptionType
from tests.unit.test_broker_dispatcher import offsets_of

SHARED, KEY_SHARED, EXCLUSIVE, FAILOVER = (SubscriptionType.SHARED, SubscriptionType.KEY_SHARED,
                                           SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER)


def entry(offset: int, deliver_at_ms: int = 0, key: str | None = None) -> EntryRef:
    return EntryRef(1, offset, offset, 1, None if key is None else (key,), deliver_at_ms)


def dispatcher(kind: SubscriptionType, **options) -> Dispatcher:
    core = Dispatcher(kind, Cursor.at(0), **options)
    core.add_consumer(1, "c1")
    core.flow(1, 100_000)
    return core


def test_a_delayed_message_waits_for_its_time_and_does_not_hold_back_the_rest():
    core = dispatcher(SHARED)
    # Offset 0 is due at t=1000; offsets 1 and 2 at once. Read at t=0.
    delivered = offsets_of(core.entry_read(entry(0, 1_000), 0)) + offsets_of(core.entry_read(entry(1), 0))
    delivered += offsets_of(core.entry_read(entry(2), 0))
    assert delivered == [(1, 1), (1, 2)]
    assert core.next_delayed_ms() == 1_000 and core.delayed_count == 1
    core.release_due(999)
    assert core.dispatch_replay() == []
    core.release_due(1_000)
    assert offsets_of(core.dispatch_replay()) == [(1, 0)]
    assert core.next_delayed_ms() is None
    assert core.dispatch_replay() == []  # once


def test_exclusive_and_failover_deliver_at_once_as_pulsar_does():
    for kind in (EXCLUSIVE, FAILOVER):
        core = dispatcher(kind)
        assert offsets_of(core.entry_read(entry(0, 10_000), 0)) == [(1, 0)]
        assert core.next_delayed_ms() is None


def test_key_shared_holds_a_delayed_message_and_gives_its_key_the_rest():
    core = dispatcher(KEY_SHARED)
    assert core.entry_read(entry(0, 500, "k"), 0) == []
    assert offsets_of(core.entry_read(entry(1, 0, "k"), 0)) == [(1, 1)]
    core.release_due(500)
    assert offsets_of(core.dispatch_replay()) == [(1, 0)]


def test_acknowledged_while_held_is_not_delivered():
    core = dispatcher(SHARED)
    core.entry_read(entry(0, 100), 0)
    core.cursor.acknowledge([0])
    core.acknowledged([0])
    core.release_due(100)
    assert core.dispatch_replay() == []


def test_past_its_memory_bound_the_index_spills_runs_and_releases_in_time_order():
    core = dispatcher(SHARED, delayed_max=2)
    dues = [500, 100, 400, 200, 300]
    for offset, due_ms in enumerate(dues):
        assert core.entry_read(entry(offset, due_ms), 0) == []
    assert core.delayed_count == 5 and core._delayed.runs == 2  # two runs of two spilled, one in memory
    delivered = []
    for now in range(100, 600, 100):
        assert core.next_delayed_ms() == now
        core.release_due(now)
        delivered += [offset for _, offset in offsets_of(core.dispatch_replay())]
        assert [dues[offset] for offset in delivered] == list(range(100, now + 1, 100))
    assert core.delayed_count == 0 and core.next_delayed_ms() is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 6), st.integers(2, 3),
       st.sets(st.integers(0, 39), max_size=10))
def test_every_message_is_delivered_once_on_time_and_never_early(delays, delayed_max, runs_max, acked):
    # Messages i with delivery times delays[i] * 100 (0: at once), some
    # acknowledged while held; time moves in steps of 50.
    core = dispatcher(SHARED, delayed_max=delayed_max, delayed_spill=MemorySpillFile)
    core._delayed.runs_max = runs_max  # merges too
    due = {offset: delay * 100 for offset, delay in enumerate(delays)}
    delivered: dict[int, int] = {}
    late_acks: list[int] = []

    def note(deliveries, now):
        for _, offset in offsets_of(deliveries):
            assert offset not in delivered, f"offset {offset} delivered twice"
            assert offset not in late_acks, f"offset {offset} delivered after its acknowledgement"
            assert due[offset] <= now, f"offset {offset} delivered at {now}, due at {due[offset]}"
            assert now - due[offset] < 50 or due[offset] == 0, f"offset {offset} due at {due[offset]}, delivered at {now}"
            delivered[offset] = now

    for position in range(len(delays)):
        note(core.entry_read(entry(position, due[position]), 0), 0)
    late_acks += sorted(offset for offset in acked if offset < len(delays) and offset not in delivered)
    core.cursor.acknowledge(late_acks)
    core.acknowledged(late_acks)
    for now in range(0, 800, 50):
        core.release_due(now)
        note(core.dispatch_replay(), now)
    assert sorted(delivered) == sorted(set(range(len(delays))) - set(late_acks))
    assert core.delayed_count == 0


def test_memory_holds_the_bound_and_one_segment_per_run():
    index = DelayedIndex(1_000, runs_max=4)
    for offset in range(20_000):
        index.add((offset * 7919) % 20_000, [offset], entry(offset))
        assert index.loaded <= 1_000 + 4 * SEGMENT_RECORDS
    assert len(index) == 20_000 and index.runs <= 4
    released = []
    while (taken := index.take(10**9)) is not None:
        released.append(taken[0])
    assert sorted(released) == list(range(20_000))
    assert [(offset * 7919) % 20_000 for offset in released] == list(range(20_000))  # in time order


def test_skipped_held_messages_leave_the_index_spilled_runs_too():
    core = dispatcher(SHARED, delayed_max=2)
    for offset in range(5):
        core.entry_read(entry(offset, 10_000), 0)
    assert core.delayed_count == 5
    core.cursor.skip_to(5)
    core.acknowledged_through(4)
    assert core.delayed_count == 0 and core.next_delayed_ms() is None


def test_nothing_is_due_while_the_replay_set_is_full():
    core = Dispatcher(SHARED, Cursor.at(0), replay_max=1)
    core.add_consumer(1, "c1")  # no permits: nothing leaves the replay set
    for offset in range(3):
        core.entry_read(entry(offset, 10), 0)
    core.release_due(20)
    assert core.replay_count == 1
    assert core.next_delayed_ms() is None  # the driver waits for flow or acknowledgements, not a time in the past


def test_the_disk_spill_file_is_unnamed_and_its_descriptor_goes_once_a_run_is_spent():
    opened = []

    def spill() -> DiskSpillFile:
        opened.append(DiskSpillFile())
        return opened[-1]

    index = DelayedIndex(3, spill)
    for offset in range(6):
        index.add(100 + offset, [offset], entry(offset, 100 + offset, key=f"k{offset}"), b"entry %d" % offset)
    assert len(opened) == 2 and index.runs == 2
    descriptors = [spilled._fd for spilled in opened]
    assert all(os.fstat(fd).st_nlink == 0 for fd in descriptors)  # no name in any directory
    taken = [index.take(200) for _ in range(6)]
    assert [offset for offset, _, _ in taken] == list(range(6))
    assert [ref.key_of(offset) for offset, ref, _ in taken] == [f"k{offset}" for offset in range(6)]
    assert [data for _, _, data in taken] == [b"entry %d" % offset for offset in range(6)]
    assert all(spilled._file.closed for spilled in opened)


def test_a_held_entrys_bytes_come_back_with_it_from_memory_and_from_runs():
    core = dispatcher(SHARED, delayed_max=2)
    for offset in range(5):
        core.entry_read(entry(offset, 100 * (5 - offset)), 0, b"bytes %d" % offset)
    core.release_due(200)  # offsets 4 (100) and 3 (200), from a run
    assert core.take_released_data() == {(1, 4): b"bytes 4", (1, 3): b"bytes 3"}
    assert core.take_released_data() == {}  # handed out once
    core.release_due(500)
    assert core.take_released_data() == {(1, offset): b"bytes %d" % offset for offset in range(3)}
    assert sorted(offset for _, offset in offsets_of(core.dispatch_replay())) == list(range(5))


def test_memory_seals_at_its_byte_bound_and_large_entries_are_not_carried():
    index = DelayedIndex(1_000, memory_bytes_max=10_000)
    for offset in range(10):
        index.add(offset, [offset], entry(offset), bytes(1_000))
    assert index.runs == 1 and index.loaded == 10  # sealed at 10,000 bytes, the run's segment loaded
    index.add(50, [10], entry(10), bytes(CARRIED_BYTES_MAX + 1))
    assert [index.take(100)[2] is None for _ in range(11)] == [False] * 10 + [True]


def test_a_batchs_messages_share_one_copy_of_its_bytes_in_a_segment():
    index = DelayedIndex(3)
    batch = EntryRef(1, 0, 0, 3, None, 10)
    index.add(10, [0, 1, 2], batch, b"the batch")
    taken = [index.take(10) for _ in range(3)]
    assert [offset for offset, _, _ in taken] == [0, 1, 2]
    assert all(ref == batch and data == b"the batch" for _, ref, data in taken)


class FlakySpillFile(MemorySpillFile):
    """A spill file whose writes or reads fail while the test says so."""

    failing = {"append": False, "read": False}

    def append(self, data: bytes) -> tuple[int, int]:
        if self.failing["append"]:
            raise OSError(28, "No space left on device")
        return super().append(data)

    def read(self, position: int, length: int) -> bytes:
        if self.failing["read"]:
            raise OSError(5, "Input/output error")
        return super().read(position, length)


def flaky_index(memory_max: int, **options) -> tuple[DelayedIndex, dict]:
    failing = {"append": False, "read": False}
    spill = type("Flaky", (FlakySpillFile,), {"failing": failing})
    return DelayedIndex(memory_max, spill, **options), failing


def drain(index: DelayedIndex, now_ms: int = 10**9) -> list[int]:
    offsets = []
    while (taken := index.take(now_ms)) is not None:
        offsets.append(taken[0])
    return offsets


def test_a_seal_that_cannot_write_keeps_the_messages_in_memory_and_tries_again_later():
    index, failing = flaky_index(4)
    failing["append"] = True
    for offset in range(6):
        index.add(offset, [offset], entry(offset))
    assert index.runs == 0 and len(index) == 6 and index.spill_failures == 1
    assert "No space left" in index.spill_error
    failing["append"] = False
    for offset in range(6, 8):  # memory doubled since the failure: sealed now
        index.add(offset, [offset], entry(offset))
    assert index.runs == 1 and index.loaded == 8
    assert drain(index) == list(range(8))


def test_a_run_that_cannot_be_read_back_loses_nothing_and_is_read_again():
    index, failing = flaky_index(SEGMENT_RECORDS * 2)
    for offset in range(SEGMENT_RECORDS * 2):  # one run of two segments
        index.add(offset, [offset], entry(offset))
    assert index.runs == 1
    failing["read"] = True
    taken = [index.take(10**9)[0] for _ in range(SEGMENT_RECORDS)]  # the first segment, loaded
    with pytest.raises(SpillError, match="Input/output"):
        index.take(10**9)
    with pytest.raises(SpillError):
        index.take(10**9)  # still nothing taken
    assert len(index) == SEGMENT_RECORDS
    failing["read"] = False
    assert taken + drain(index) == list(range(SEGMENT_RECORDS * 2))


def test_a_merge_that_fails_keeps_its_runs():
    index, failing = flaky_index(2, runs_max=2)
    for offset in range(6):  # three runs of two: a merge
        if offset == 4:
            failing["append"] = True
        index.add(offset, [offset], entry(offset))
    assert index.spill_failures == 1 and len(index) == 6
    failing["append"] = False
    assert drain(index) == list(range(6))


def test_merging_keeps_time_order_and_the_runs_bounded():
    index = DelayedIndex(10, runs_max=4)
    for offset in range(500):
        index.add((offset * 37) % 500, [offset], entry(offset))
        assert index.runs <= 4
    assert [(offset * 37) % 500 for offset in drain(index)] == list(range(500))


def test_a_batch_is_never_split_between_segments():
    index = DelayedIndex(SEGMENT_RECORDS + 9)  # sealed at the last add: one run
    single = [EntryRef(1, offset, offset, 1, None, 5) for offset in range(SEGMENT_RECORDS - 2)]
    batch = EntryRef(1, 10_000, SEGMENT_RECORDS - 2, 10, None, 5)
    for ref in single:
        index.add(5, [ref.first_offset], ref)
    index.add(5, range(batch.first_offset, batch.first_offset + 10), batch)
    index.add(6, [10_000], EntryRef(1, 20_000, 10_000, 1, None, 6))
    assert index.runs == 1
    taken = [index.take(10) for _ in range(SEGMENT_RECORDS + 9)]
    assert len({id(ref) for _, ref, _ in taken if ref.entry_id == 10_000}) == 1  # one entry object: sent together


def test_a_closed_index_writes_no_more_spill_files():
    opened = []
    index = DelayedIndex(2, lambda: opened.append(MemorySpillFile()) or opened[-1])
    index.add(1, [0], entry(0))
    index.add(2, [1], entry(1))
    assert len(opened) == 1
    index.close()
    index.add(3, [2], entry(2))
    index.add(4, [3], entry(3))
    assert len(opened) == 1
