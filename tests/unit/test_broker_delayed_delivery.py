"""Delayed delivery in the dispatcher core: a message with a delivery time
is held back from shared and key-shared subscriptions until then (not from
exclusive and failover ones, as in Pulsar), does not hold back the messages
behind it, and is delivered once; past the index's bound, held messages are
found again by reading, never lost nor delivered twice."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cursor import Cursor
from broker.dispatcher import Dispatcher, EntryRef, SubscriptionType
from tests.unit.test_broker_dispatcher import offsets_of

SHARED, KEY_SHARED, EXCLUSIVE, FAILOVER = (SubscriptionType.SHARED, SubscriptionType.KEY_SHARED,
                                           SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER)


def entry(offset: int, deliver_at_ms: int = 0, key: str | None = None) -> EntryRef:
    return EntryRef(1, offset, offset, 1, None if key is None else (key,), deliver_at_ms)


def dispatcher(kind: SubscriptionType, **options) -> Dispatcher:
    core = Dispatcher(kind, Cursor.at(0), **options)
    core.add_consumer(1, "c1")
    core.flow(1, 1_000)
    return core


def test_a_delayed_message_waits_for_its_time_and_does_not_hold_back_the_rest():
    core = dispatcher(SHARED)
    # Offset 0 is due at t=1000; offsets 1 and 2 at once. Read at t=0.
    delivered = offsets_of(core.entry_read(entry(0, 1_000), 0)) + offsets_of(core.entry_read(entry(1), 0))
    delivered += offsets_of(core.entry_read(entry(2), 0))
    assert delivered == [(1, 1), (1, 2)]
    assert core.next_delayed_ms() == 1_000 and core.delayed_count == 1
    assert not core.release_due(999) and core.dispatch_replay() == []
    assert not core.release_due(1_000)
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


def test_past_its_bound_the_index_reads_again_and_loses_nothing():
    core = dispatcher(SHARED, delayed_max=2)
    for offset in range(5):  # due at 100, 200, ... 500
        assert core.entry_read(entry(offset, (offset + 1) * 100), 0) == []
    assert core.delayed_count == 2  # offsets 2..4 were left out
    delivered = []
    for now in range(100, 600, 100):
        if core.release_due(now):
            # The driver reads again where the rescan says, as long as it jumps.
            offset = core.read_offset
            assert 0 <= offset < 5  # the start of the stretch holding what was left out
            while offset < 5:
                delivered += offsets_of(core.entry_read(entry(offset, (offset + 1) * 100), now))
                offset = core.read_offset if core.take_jump() else offset + 1
        delivered += offsets_of(core.dispatch_replay())
    delivered += offsets_of(core.dispatch_replay()) if not core.release_due(1_000) else []
    assert sorted(delivered) == [(1, offset) for offset in range(5)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 8))
def test_every_message_is_delivered_once_and_never_early(delays, delayed_max, segment_offsets):
    # Messages i with delivery times delays[i] * 100 (0: at once); time
    # moves in steps of 50; the driver reads where the dispatcher jumps to.
    core = dispatcher(SHARED, delayed_max=delayed_max, delayed_segment_offsets=segment_offsets)
    due = {offset: delay * 100 for offset, delay in enumerate(delays)}
    delivered: dict[int, int] = {}
    position = 0

    def note(deliveries, now):
        for _, offset in offsets_of(deliveries):
            assert offset not in delivered, f"offset {offset} delivered twice"
            assert due[offset] <= now, f"offset {offset} delivered at {now}, due at {due[offset]}"
            # On time: within the step its time came in (the driver reads
            # again at once when the index rewinds).
            assert now - due[offset] < 50 or due[offset] == 0, f"offset {offset} due at {due[offset]}, delivered at {now}"
            delivered[offset] = now

    for now in range(0, 800, 50):
        if core.release_due(now):
            position = core.read_offset
        note(core.dispatch_replay(), now)
        while position < len(delays):
            note(core.entry_read(entry(position, due[position]), now), now)
            position = core.read_offset if core.take_jump() else position + 1
            if core.release_due(now):
                position = core.read_offset
        note(core.dispatch_replay(), now)
    assert sorted(delivered) == list(range(len(delays)))


def test_a_full_index_keeps_the_earliest_due_and_drops_the_latest():
    core = dispatcher(SHARED, delayed_max=2)
    for offset, due_ms in enumerate((400, 300, 200, 100)):
        core.entry_read(entry(offset, due_ms), 0)
    # 400 and 300 came first; 200 and 100 took their places.
    assert core.delayed_count == 2 and core.next_delayed_ms() == 100
    assert core.release_due(100)  # half empty: read again from offset 0
    assert core.read_offset == 0
    assert offsets_of(core.dispatch_replay()) == [(1, 3)]
    for offset, due_ms in enumerate((400, 300)):
        core.entry_read(entry(offset, due_ms), 100)
    assert core.next_delayed_ms() == 200 and core.delayed_count == 2


def test_skipped_held_messages_leave_the_index():
    core = dispatcher(SHARED)
    for offset in range(3):
        core.entry_read(entry(offset, 10_000), 0)
    assert core.delayed_count == 3
    core.cursor.skip_to(3)
    core.acknowledged_through(2)
    assert core.delayed_count == 0 and core.next_delayed_ms() is None


def test_nothing_is_due_while_the_replay_set_is_full():
    core = Dispatcher(SHARED, Cursor.at(0), replay_max=1)
    core.add_consumer(1, "c1")  # no permits: nothing leaves the replay set
    for offset in range(3):
        core.entry_read(entry(offset, 10), 0)
    core.release_due(20)
    assert core.replay_count == 1
    assert core.next_delayed_ms() is None  # the driver waits for flow or acknowledgements, not a time in the past
