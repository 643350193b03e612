"""The subscription core, driven directly with hand-written event
sequences: acknowledgements near the bound of individually acknowledged
ranges, their group commit (answered only once a cursor write covering them
is durable, one write at a time), what closing and a failed write answer,
and dispatching only within the lease."""

from __future__ import annotations

import pytest

from broker.cursor import Cursor
from broker.dispatcher import EntryRef, SubscriptionType
from broker.errors import BadRequestError, ConsumerBusyError, TopicFencedError
from broker.subscription_core import ACKED_RANGES_MAX, SubscriptionCore


def make_core(kind: SubscriptionType = SubscriptionType.SHARED, *, ranges_max: int = ACKED_RANGES_MAX,
              durable: bool = False) -> SubscriptionCore:
    return SubscriptionCore("s", kind, Cursor.at(0), durable=durable, acked_ranges_max=ranges_max, partition_index=0)


def deliver(core: SubscriptionCore, count: int, consumer_id: int = 1) -> None:
    core.add_consumer(consumer_id, f"c{consumer_id}", core.subscription_type, 0)
    core.dispatcher.flow(consumer_id, 100)
    for offset in range(count):
        core.dispatcher.entry_read(EntryRef(1, offset, offset, 1))


def test_the_bound_is_a_large_one_by_default():
    assert make_core().acked_ranges_max == ACKED_RANGES_MAX == 1_000_000


@pytest.mark.parametrize("kind", [SubscriptionType.SHARED, SubscriptionType.KEY_SHARED])
def test_at_the_bound_new_ranges_are_refused_and_the_oldest_message_is_taken(kind):
    core = make_core(kind, ranges_max=3)
    deliver(core, 12)
    outcome = core.acknowledge([1, 3, 5], False, 1_000, "w1")
    assert outcome.answer_now == ("w1",) and outcome.refused == ()  # not durable: answered at once
    assert core.cursor.acked.ranges() == [[1, 1], [3, 3], [5, 5]]

    # Cumulative acknowledgement is not allowed on these types.
    with pytest.raises(BadRequestError, match="cumulative"):
        core.acknowledge([0], True, 1_000, "w2")
    # A request mixing a gap-filler (4) and two new ranges (9, 11): 4 is
    # taken, which makes room for 9; 11 is refused, and the error says so.
    outcome = core.acknowledge([11, 9, 4], False, 1_000, "w3")
    assert outcome.refused == (11,)
    message = str(core.refused_error(outcome.refused, 2))
    assert "1 of 3 acknowledgements refused" in message and "offsets 11..11" in message
    assert "offset 0" in message  # the oldest unacknowledged message, always taken
    assert core.cursor.acked.ranges() == [[1, 1], [3, 5], [9, 9]]
    assert core.dispatcher.unacked_count(1) == 12 - 5  # the dispatcher forgot what was taken, not 11
    # The oldest unacknowledged message is taken, and the mark-delete moves.
    core.acknowledge([0], False, 1_000, "w4")
    assert core.cursor.mark_delete == 1
    core.acknowledge([11], False, 1_000, "w5")  # room again
    assert core.cursor.acked.ranges() == [[3, 5], [9, 9], [11, 11]]


def test_below_the_bound_nothing_is_refused():
    core = make_core(ranges_max=10)
    assert core.acknowledge([1, 3, 5, 7, 9], False, 1_000, "w").refused == ()
    assert len(core.cursor.acked) == 5


def test_an_acknowledgement_beyond_the_last_message_takes_nothing():
    core = make_core()
    with pytest.raises(BadRequestError, match="beyond the last message"):
        core.acknowledge([3, 7], False, 5, "w")
    assert not core.cursor.acked


def test_acknowledgements_are_answered_once_a_write_covering_them_is_durable():
    # Two acknowledgements arrive while the first write is in flight: they
    # go into the next write together, and each is answered only by a write
    # that covers it.
    core = make_core(SubscriptionType.EXCLUSIVE, durable=True)
    assert core.acknowledge([0], False, 10, "a").answer_now == ()
    first = core.next_write()
    assert first is not None and first.record["mark_delete"] == 0
    assert core.next_write() is None  # one write at a time
    core.acknowledge([1], False, 10, "b")
    core.acknowledge([3], True, 10, "c")
    assert core.cursor_written(first, 1) == ["a"]
    second = core.next_write()
    assert second.expected_version == 1 and second.record["mark_delete"] == 3
    assert core.cursor_written(second, 2) == ["b", "c"]
    assert core.next_write() is None and not core.unwritten


def test_a_failed_write_answers_every_waiter_and_takes_nothing_more():
    # Another owner may have the cursor now: what waited is answered with
    # the error, and later acknowledgements are refused at once.
    core = make_core(SubscriptionType.FAILOVER, durable=True)
    core.acknowledge([0], False, 10, "a")
    write = core.next_write()
    core.acknowledge([1], False, 10, "b")
    assert core.cursor_write_failed(write) == ["a", "b"]
    with pytest.raises(TopicFencedError):
        core.acknowledge([2], False, 10, "c")


def test_a_graceful_unload_writes_what_was_taken_and_closing_answers_the_rest():
    core = make_core(SubscriptionType.EXCLUSIVE, durable=True)
    core.acknowledge([0], False, 10, "a")
    core.stop()  # no more acknowledgements; what was taken may still be written
    with pytest.raises(TopicFencedError):
        core.acknowledge([3], False, 10, "d")
    assert core.next_write() is None  # the unload writes once, itself
    final = core.force_write()
    assert core.cursor_written(final, 5) == ["a"]
    assert core.close() == []


def test_consumers_of_another_type_are_refused_while_one_is_connected():
    core = make_core(SubscriptionType.EXCLUSIVE)
    assert core.add_consumer(1, "c1", SubscriptionType.EXCLUSIVE, 0) is False
    with pytest.raises(ConsumerBusyError):
        core.add_consumer(2, "c2", SubscriptionType.SHARED, 0)
    with pytest.raises(ConsumerBusyError):
        core.add_consumer(2, "c2", SubscriptionType.EXCLUSIVE, 0)
    core.remove_consumer(1)
    assert core.add_consumer(2, "c2", SubscriptionType.SHARED, 0) is True  # nobody connected: it takes the new type
    assert core.subscription_type is SubscriptionType.SHARED


def test_a_seek_on_a_closed_subscription_is_refused_rather_than_left_waiting():
    core = make_core(SubscriptionType.EXCLUSIVE, durable=True)
    core.close()
    core.seek(50, 10, 30)
    with pytest.raises(TopicFencedError):
        core.when_durable("seek")


def test_it_dispatches_only_within_the_lease_and_until_closed():
    core = make_core()
    assert core.may_dispatch(True) and not core.may_dispatch(False)
    core.close()
    assert not core.may_dispatch(True)


def test_seek_and_retention_are_written_like_acknowledgements():
    core = make_core(SubscriptionType.EXCLUSIVE, durable=True)
    assert core.seek(50, 10, 30) == 31  # clamped to what is stored
    assert core.when_durable("seek") == ()
    write = core.next_write()
    assert write.record["mark_delete"] == 30
    assert core.cursor_written(write, 0) == ["seek"]
    assert core.skip_to(40) is True and core.cursor.mark_delete == 39 and core.unwritten
