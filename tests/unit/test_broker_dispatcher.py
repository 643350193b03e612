"""The dispatcher core: which consumer of a subscription gets which message,
for the four subscription types, with permits, redelivery, held-back
messages and seeks. Scenario tests first, then random sequences of
consumer, flow, read, acknowledgement and redelivery events checked
against a model (hypothesis)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cursor import Cursor
from broker.dispatcher import (
    ConsumerRefusedError,
    Delivery,
    Dispatcher,
    EntryRef,
    SubscriptionType,
)

EXCLUSIVE, FAILOVER, SHARED, KEY_SHARED = (
    SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER, SubscriptionType.SHARED, SubscriptionType.KEY_SHARED,
)


def make_entries(*batches: int | tuple[str | None, ...], first_offset: int = 0) -> list[EntryRef]:
    """Entries in partition order: a message count (no keys) or the keys of
    its messages."""
    entries = []
    for entry_id, batch in enumerate(batches):
        keys = None if isinstance(batch, int) else tuple(batch)
        count = batch if isinstance(batch, int) else len(batch)
        entries.append(EntryRef(1, entry_id, first_offset, count, keys))
        first_offset += count
    return entries


def offsets_of(deliveries: list[Delivery]) -> list[tuple[int, int]]:
    """(consumer, offset) of every delivered message, in order."""
    return [(delivery.consumer_id, delivery.entry.first_offset + index)
            for delivery in deliveries for index in delivery.batch_indexes]


def make_dispatcher(kind: SubscriptionType, consumers: dict[int, int], **options) -> Dispatcher:
    """A dispatcher with consumers (id -> permits), named c<id>, joined in order."""
    dispatcher = Dispatcher(kind, Cursor.at(0), **options)
    for consumer_id, permits in consumers.items():
        dispatcher.add_consumer(consumer_id, f"c{consumer_id}")
        dispatcher.flow(consumer_id, permits)
    return dispatcher


def read_all(dispatcher: Dispatcher, entries: list[EntryRef]) -> list[tuple[int, int]]:
    delivered = []
    for entry in entries:
        delivered += offsets_of(dispatcher.entry_read(entry))
    return delivered


def acknowledge(dispatcher: Dispatcher, offsets: list[int]) -> None:
    """What the subscription does with an individual acknowledgement."""
    dispatcher.cursor.acknowledge(offsets)
    dispatcher.acknowledged(offsets)


def key_for(consumer_id: int, consumer_ids: list[int]) -> str:
    """A key that a key-shared subscription with these consumers sends to
    `consumer_id` (found by asking a throwaway dispatcher)."""
    for number in range(1000):
        key = f"key-{number}"
        probe = make_dispatcher(KEY_SHARED, {other: 1 for other in consumer_ids})
        if offsets_of(probe.entry_read(EntryRef(1, 0, 0, 1, (key,)))) == [(consumer_id, 0)]:
            return key
    raise AssertionError(f"no key goes to consumer {consumer_id}")


# --- shared ---------------------------------------------------------------------------


def test_shared_round_robin_keeps_an_entry_together():
    # Entries go to consumers in turn; the three messages of an entry go
    # together to one consumer.
    dispatcher = make_dispatcher(SHARED, {1: 10, 2: 10})
    delivered = read_all(dispatcher, make_entries(3, 1, 2))
    assert delivered == [(1, 0), (1, 1), (1, 2), (2, 3), (1, 4), (1, 5)]
    assert dispatcher.permits(1) == 5 and dispatcher.unacked_count(1) == 5


def test_shared_permits_may_be_exceeded_only_by_the_rest_of_one_entry():
    # One permit takes a whole entry of three; then the consumer, below
    # zero, gets nothing until it sends more permits.
    dispatcher = make_dispatcher(SHARED, {1: 1})
    entries = make_entries(3, 1)
    assert read_all(dispatcher, entries[:1]) == [(1, 0), (1, 1), (1, 2)]
    assert dispatcher.permits(1) == -2 and not dispatcher.wants_read()
    assert read_all(dispatcher, entries[1:]) == []  # held back in the replay set
    assert dispatcher.replay_count == 1
    dispatcher.flow(1, 2)
    assert dispatcher.dispatch_replay() == []  # -2 + 2: still no permit
    dispatcher.flow(1, 1)
    assert offsets_of(dispatcher.dispatch_replay()) == [(1, 3)]


def test_shared_a_consumer_without_permits_is_passed_over():
    dispatcher = make_dispatcher(SHARED, {1: 0, 2: 2})
    assert read_all(dispatcher, make_entries(1, 1)) == [(2, 0), (2, 1)]


def test_new_messages_wait_behind_held_ones():
    # While message 0 waits in the replay set, message 1 read later waits
    # too: a consumer's messages go out in offset order.
    dispatcher = make_dispatcher(SHARED, {1: 0})
    entries = make_entries(1, 1)
    read_all(dispatcher, entries[:1])
    dispatcher.flow(1, 5)
    assert read_all(dispatcher, entries[1:]) == []
    assert offsets_of(dispatcher.dispatch_replay()) == [(1, 0), (1, 1)]


def test_individually_acknowledged_messages_are_not_read_again():
    # After a restart the cursor has 1 and 3 of the entry 0..3 acknowledged:
    # only 0 and 2 go out, as batch indexes of that entry.
    cursor = Cursor.at(0)
    cursor.acknowledge([1, 3])
    dispatcher = Dispatcher(SHARED, cursor)
    dispatcher.add_consumer(1, "c1")
    dispatcher.flow(1, 10)
    [delivery] = dispatcher.entry_read(make_entries(4)[0])
    assert delivery.batch_indexes == [0, 2] and dispatcher.permits(1) == 8


def test_a_dispatcher_reads_from_the_cursor_position():
    cursor = Cursor.at(0)
    cursor.acknowledge_cumulative(9)
    assert Dispatcher(SHARED, cursor).read_offset == 10


# --- redelivery and acknowledgements ----------------------------------------------------


def test_negative_ack_delivers_again_with_a_redelivery_count():
    # 1 and 2 are negatively acknowledged, then everything the consumer
    # holds: each delivery says how often its messages came back.
    dispatcher = make_dispatcher(SHARED, {1: 10})
    read_all(dispatcher, make_entries(1, 1, 1))
    dispatcher.redeliver(1, [1, 2])
    assert dispatcher.unacked_count(1) == 1 and dispatcher.replay_count == 2
    redelivered = dispatcher.dispatch_replay()
    assert offsets_of(redelivered) == [(1, 1), (1, 2)]
    assert [delivery.redelivery_count for delivery in redelivered] == [1, 1]
    dispatcher.redeliver(1)
    assert [delivery.redelivery_count for delivery in dispatcher.dispatch_replay()] == [1, 2, 2]


def test_redelivering_an_offset_named_twice_delivers_it_once():
    # A client's REDELIVER may name an offset twice (or one it does not
    # hold): each message it holds goes back once, the rest is ignored.
    dispatcher = make_dispatcher(SHARED, {1: 10})
    read_all(dispatcher, make_entries(3))
    dispatcher.redeliver(1, [1, 1, 2, 7])
    assert dispatcher.unacked_count(1) == 1 and dispatcher.replay_count == 2
    assert offsets_of(dispatcher.dispatch_replay()) == [(1, 1), (1, 2)]
    dispatcher.redeliver(99, [0])  # an unknown consumer: nothing happens


def test_an_acknowledged_message_is_never_delivered_again():
    # The consumer acknowledges 1 after asking for its redelivery (a late
    # acknowledgement): it is dropped from the replay set.
    dispatcher = make_dispatcher(SHARED, {1: 10})
    read_all(dispatcher, make_entries(3))
    dispatcher.redeliver(1)
    acknowledge(dispatcher, [1])
    assert offsets_of(dispatcher.dispatch_replay()) == [(1, 0), (1, 2)]


def test_cumulative_ack_forgets_deliveries_and_held_messages():
    dispatcher = make_dispatcher(SHARED, {1: 2})
    read_all(dispatcher, make_entries(2, 1, 1))  # 0, 1 out; 2, 3 held
    dispatcher.cursor.acknowledge_cumulative(2)
    dispatcher.acknowledged_through(2)
    assert dispatcher.unacked_count(1) == 0 and dispatcher.replay_count == 1
    dispatcher.flow(1, 5)
    assert offsets_of(dispatcher.dispatch_replay()) == [(1, 3)]


def test_a_consumer_that_leaves_gives_its_messages_to_the_others():
    dispatcher = make_dispatcher(SHARED, {1: 10, 2: 0})
    read_all(dispatcher, make_entries(2))
    acknowledge(dispatcher, [0])
    dispatcher.remove_consumer(1)
    dispatcher.remove_consumer(1)  # twice: nothing more happens
    dispatcher.flow(2, 5)
    [delivery] = dispatcher.dispatch_replay()
    assert offsets_of([delivery]) == [(2, 1)] and delivery.redelivery_count == 1


def test_seek_forgets_deliveries_and_reads_again_from_the_new_position():
    # Messages 0..3 went out, 4 and 5 are held; a seek back to 2 makes 2..5
    # new again (redelivery count 0), read from 2 on.
    dispatcher = make_dispatcher(SHARED, {1: 4})
    entries = make_entries(2, 2, 2)
    read_all(dispatcher, entries)
    dispatcher.redeliver(1, [3])
    dispatcher.cursor.reset(2)
    dispatcher.reset(2)
    assert dispatcher.read_offset == 2 and dispatcher.replay_count == 0 and dispatcher.unacked_count(1) == 0
    dispatcher.flow(1, 10)
    deliveries = [delivery for entry in entries[1:] for delivery in dispatcher.entry_read(entry)]
    assert offsets_of(deliveries) == [(1, 2), (1, 3), (1, 4), (1, 5)]
    assert all(delivery.redelivery_count == 0 for delivery in deliveries)


# --- bounds ---------------------------------------------------------------------------


def test_a_full_replay_set_stops_reading():
    dispatcher = make_dispatcher(SHARED, {1: 0}, replay_max=2)
    dispatcher.add_consumer(2, "c2")
    read_all(dispatcher, make_entries(1, 1))
    dispatcher.flow(2, 1)  # someone has permits, but the replay set is full
    assert dispatcher.replay_count == 2 and not dispatcher.wants_read()
    dispatcher.dispatch_replay()
    assert dispatcher.replay_count == 1 and not dispatcher.wants_read()  # no permits left
    dispatcher.flow(2, 1)
    assert dispatcher.wants_read()


def test_a_consumer_with_too_many_unacknowledged_messages_gets_nothing_more():
    dispatcher = make_dispatcher(SHARED, {1: 100}, unacked_per_consumer_max=2)
    assert read_all(dispatcher, make_entries(1, 1, 1)) == [(1, 0), (1, 1)]
    assert not dispatcher.wants_read()
    acknowledge(dispatcher, [0])
    assert dispatcher.wants_read() and offsets_of(dispatcher.dispatch_replay()) == [(1, 2)]


@pytest.mark.parametrize("kind", [SHARED, KEY_SHARED])
def test_a_subscription_with_too_many_unacknowledged_messages_delivers_nothing_more(kind):
    # Many consumers, each under its own bound: the subscription's bound
    # holds what all of them have out together (and what the broker keeps
    # in memory for them).
    dispatcher = make_dispatcher(kind, {1: 100, 2: 100, 3: 100}, unacked_per_consumer_max=10, unacked_per_subscription_max=4)
    assert len(read_all(dispatcher, make_entries(*[(f"k{n}",) for n in range(6)]))) == 4
    assert dispatcher.unacked_total == 4 and not dispatcher.wants_read()
    assert dispatcher.dispatch_replay() == []
    acknowledge(dispatcher, [0, 1])
    assert offsets_of(dispatcher.dispatch_replay())  # held messages go first
    assert dispatcher.unacked_total <= 4


def test_a_given_back_delivery_of_acknowledged_messages_keeps_no_redelivery_count():
    dispatcher = make_dispatcher(SHARED, {1: 10})
    read_all(dispatcher, make_entries(1))
    dispatcher.redeliver(1)
    [delivery] = dispatcher.dispatch_replay()
    assert delivery.redelivery_count == 1
    dispatcher.cursor.acknowledge([0])  # acknowledged while the delivery could not be sent
    dispatcher.give_back(delivery)
    assert dispatcher.replay_count == 0 and dispatcher._redeliveries == {}


def acknowledge_within(dispatcher: Dispatcher, offsets: list[int], ranges_max: int) -> list[int]:
    """What the subscription does with an individual acknowledgement once
    its cursor is near its bound of ranges: returns the offsets refused."""
    refused = dispatcher.cursor.acknowledge_within(offsets, ranges_max)
    dispatcher.acknowledged([offset for offset in offsets if offset not in refused])
    return refused


@pytest.mark.parametrize("kind", [SHARED, KEY_SHARED])
def test_a_cursor_at_its_bound_of_ranges_still_moves_and_delivery_goes_on(kind):
    # A consumer acknowledges every other message: the cursor reaches its
    # bound of 3 ranges ([1], [3], [5]) while 0, 2 and 4 are still out, and
    # the subscription reaches its bound of 6 messages out. Cumulative
    # acknowledgement is not allowed on these types, so only individual
    # ones can move it: a new range (7) is refused, but acknowledging the
    # oldest message (0) moves the mark-delete, frees a range and a place,
    # and delivery goes on; then 7 is taken.
    dispatcher = make_dispatcher(kind, {1: 100}, unacked_per_subscription_max=6)
    assert len(read_all(dispatcher, make_entries(*[1] * 6))) == 6
    assert acknowledge_within(dispatcher, [1, 3, 5], ranges_max=3) == []
    assert len(read_all(dispatcher, make_entries(*[1] * 3, first_offset=6))) == 3
    assert dispatcher.unacked_total == 6 and not dispatcher.wants_read()
    assert acknowledge_within(dispatcher, [7], ranges_max=3) == [7]
    assert dispatcher.unacked_total == 6 and not dispatcher.wants_read()
    assert acknowledge_within(dispatcher, [0], ranges_max=3) == []
    assert dispatcher.cursor.mark_delete == 1 and dispatcher.wants_read()
    assert read_all(dispatcher, make_entries(1, first_offset=9)) == [(1, 9)]
    assert acknowledge_within(dispatcher, [7, 2], ranges_max=3) == []  # 2 folds, 7 fits
    assert dispatcher.cursor.mark_delete == 3 and dispatcher.cursor.acked.ranges() == [[5, 5], [7, 7]]


def test_key_shared_a_joined_consumer_is_not_held_for_ever_by_a_cursor_at_its_bound():
    # Consumer 2 joins after offsets 0..5 were read; its key waits until
    # everything before is acknowledged. The cursor holds its bound of
    # ranges ([1], [3]) with 0, 2 and 4 out: acknowledging them, oldest
    # first, is always taken, so the mark-delete reaches the joining point.
    moving = key_for(2, [1, 2])
    dispatcher = make_dispatcher(KEY_SHARED, {1: 10})
    assert len(read_all(dispatcher, make_entries(*[(moving,)] * 5))) == 5
    dispatcher.add_consumer(2, "c2")
    dispatcher.flow(2, 10)
    assert read_all(dispatcher, make_entries((moving,), first_offset=5)) == []
    assert acknowledge_within(dispatcher, [1, 3], ranges_max=2) == []
    for oldest in (0, 2):
        assert acknowledge_within(dispatcher, [oldest], ranges_max=2) == []
        assert dispatcher.dispatch_replay() == []  # 4 is still out
    assert acknowledge_within(dispatcher, [4], ranges_max=2) == []
    assert dispatcher.cursor.mark_delete == 4
    assert offsets_of(dispatcher.dispatch_replay()) == [(2, 5)]


def test_bounds_must_be_positive():
    with pytest.raises(ValueError):
        Dispatcher(SHARED, Cursor.at(0), replay_max=0)
    with pytest.raises(ValueError):
        Dispatcher(SHARED, Cursor.at(0), unacked_per_consumer_max=0)
    with pytest.raises(ValueError):
        Dispatcher(SHARED, Cursor.at(0), unacked_per_subscription_max=0)


def test_unknown_subscription_types_are_refused():
    assert SubscriptionType.parse("key_shared") is KEY_SHARED
    with pytest.raises(ValueError, match="known: exclusive"):
        SubscriptionType.parse("fan-out")


# --- exclusive and failover -------------------------------------------------------------


def test_exclusive_refuses_a_second_consumer_until_the_first_leaves():
    # The second consumer is refused; once the first leaves, a new one gets
    # what it had not acknowledged.
    dispatcher = make_dispatcher(EXCLUSIVE, {1: 10})
    read_all(dispatcher, make_entries(2))
    with pytest.raises(ConsumerRefusedError):
        dispatcher.add_consumer(2, "c2")
    assert dispatcher.consumer_ids == [1] and dispatcher.active_consumer_id == 1
    dispatcher.remove_consumer(1)
    assert dispatcher.active_consumer_id is None
    dispatcher.add_consumer(2, "c2")
    dispatcher.flow(2, 10)
    [delivery] = dispatcher.dispatch_replay()
    assert offsets_of([delivery]) == [(2, 0), (2, 1)] and delivery.redelivery_count == 1


def test_exclusive_delivers_a_started_entry_whole():
    dispatcher = make_dispatcher(EXCLUSIVE, {1: 1})
    assert read_all(dispatcher, make_entries(3, 1)) == [(1, 0), (1, 1), (1, 2)]


def test_failover_active_consumer_is_the_lowest_priority_then_name():
    # b (priority 0) is active over a (priority 1); a consumer "a0" with
    # priority 0 takes over and gets what b had not acknowledged.
    dispatcher = Dispatcher(FAILOVER, Cursor.at(0))
    dispatcher.add_consumer(1, "a", priority=1)
    dispatcher.add_consumer(2, "b", priority=0)
    for consumer_id in (1, 2):
        dispatcher.flow(consumer_id, 10)
    assert dispatcher.active_consumer_id == 2
    assert read_all(dispatcher, make_entries(1, 1)) == [(2, 0), (2, 1)]
    acknowledge(dispatcher, [0])
    dispatcher.add_consumer(3, "a0", priority=0)
    dispatcher.flow(3, 10)
    assert dispatcher.active_consumer_id == 3 and dispatcher.unacked_count(2) == 0
    [delivery] = dispatcher.dispatch_replay()
    assert offsets_of([delivery]) == [(3, 1)] and delivery.redelivery_count == 1
    assert read_all(dispatcher, make_entries(1, first_offset=2)) == [(3, 2)]


def test_failover_partitions_spread_over_the_consumers():
    # Partition i of a partitioned topic is served by consumer i mod n, in
    # the order of (priority, name).
    active = []
    for partition_index in range(4):
        dispatcher = Dispatcher(FAILOVER, Cursor.at(0), partition_index=partition_index)
        for consumer_id, name in ((1, "x"), (2, "y"), (3, "w")):
            dispatcher.add_consumer(consumer_id, name)
        active.append(dispatcher.active_consumer_id)
    assert active == [3, 1, 2, 3]


def test_failover_standby_gets_nothing_even_with_permits():
    dispatcher = make_dispatcher(FAILOVER, {1: 0, 2: 10})
    assert read_all(dispatcher, make_entries(1)) == []
    assert dispatcher.replay_count == 1


# --- key_shared -------------------------------------------------------------------------


def test_key_shared_sends_a_key_to_one_consumer_in_order():
    # Keys a1 (consumer 1) and a2 (consumer 2) interleave; each consumer gets
    # its key's messages in offset order, and no key counts as the empty key.
    a1, a2 = key_for(1, [1, 2]), key_for(2, [1, 2])
    dispatcher = make_dispatcher(KEY_SHARED, {1: 10, 2: 10})
    delivered = read_all(dispatcher, make_entries((a1, a2, a1), (a2,), (a1, a1)))
    assert sorted(delivered, key=lambda pair: pair[1]) == [(1, 0), (2, 1), (1, 2), (2, 3), (1, 4), (1, 5)]
    [(keyless, _), (empty, _)] = offsets_of(dispatcher.entry_read(make_entries((None, ""), first_offset=6)[0]))
    assert keyless == empty


def test_key_shared_permits_count_per_message_and_a_blocked_key_waits():
    # Consumer 1 has one permit: the first a1 message goes, the second waits
    # with the later a1 message; consumer 2's key flows meanwhile.
    a1, a2 = key_for(1, [1, 2]), key_for(2, [1, 2])
    dispatcher = make_dispatcher(KEY_SHARED, {1: 1, 2: 10})
    assert read_all(dispatcher, make_entries((a1, a1, a2), (a2, a1), (a2,))) == [(1, 0), (2, 2), (2, 3), (2, 5)]
    assert dispatcher.permits(1) == 0 and dispatcher.replay_count == 2
    dispatcher.flow(1, 5)
    assert offsets_of(dispatcher.dispatch_replay()) == [(1, 1), (1, 4)]


def test_key_shared_recently_joined_consumer_waits_for_earlier_messages():
    # Consumer 2 joins when messages 0..1 were read: the key that moves to it
    # waits (from offset 2 on) until 0 and 1 are acknowledged, so it cannot
    # overtake message 1 of that key still out at consumer 1.
    moving = key_for(2, [1, 2])
    dispatcher = make_dispatcher(KEY_SHARED, {1: 10})
    assert read_all(dispatcher, make_entries((moving, moving))) == [(1, 0), (1, 1)]
    dispatcher.add_consumer(2, "c2")
    dispatcher.flow(2, 10)
    assert read_all(dispatcher, make_entries((moving,), first_offset=2)) == []
    acknowledge(dispatcher, [1])
    assert dispatcher.dispatch_replay() == []  # 0 is still out
    acknowledge(dispatcher, [0])
    assert offsets_of(dispatcher.dispatch_replay()) == [(2, 2)]


def test_key_shared_a_held_message_does_not_overtake_its_key_at_another_consumer():
    # Message 0 of key k is out at consumer 1; message 1 of k waits (no
    # permits). Consumer 2 joins and k moves to it: message 1 must wait until
    # 0 is acknowledged, or the key's messages are processed out of order.
    moving = key_for(2, [1, 2])
    dispatcher = make_dispatcher(KEY_SHARED, {1: 1})
    assert read_all(dispatcher, make_entries((moving,), (moving,))) == [(1, 0)]
    dispatcher.add_consumer(2, "c2")
    dispatcher.flow(2, 10)
    assert dispatcher.dispatch_replay() == []
    acknowledge(dispatcher, [0])
    assert offsets_of(dispatcher.dispatch_replay()) == [(2, 1)]


def test_key_shared_consumer_leaving_hands_its_keys_over():
    a1 = key_for(1, [1, 2])
    dispatcher = make_dispatcher(KEY_SHARED, {1: 10, 2: 10})
    assert read_all(dispatcher, make_entries((a1, a1))) == [(1, 0), (1, 1)]
    dispatcher.remove_consumer(1)
    deliveries = dispatcher.dispatch_replay()
    assert offsets_of(deliveries) == [(2, 0), (2, 1)] and deliveries[0].redelivery_count == 1
    assert read_all(dispatcher, make_entries((a1,), first_offset=2)) == [(2, 2)]


# --- properties -----------------------------------------------------------------------

CONSUMER_IDS = (1, 2, 3, 4)
KEYS = ("k0", "k1", "k2", "k3", "k4", None)

entry_batches = st.lists(
    st.one_of(st.integers(1, 3), st.lists(st.sampled_from(KEYS), min_size=1, max_size=3).map(tuple)),
    min_size=3,
    max_size=12,
)
# Reads, replays and permits come more often than the rest, so that
# messages flow between the changes.
flowing = st.one_of(
    st.tuples(st.just("flow"), st.integers(0, 3), st.integers(1, 4)),
    st.tuples(st.just("read"), st.just(0), st.just(0)),
    st.tuples(st.just("replay"), st.just(0), st.just(0)),
    st.tuples(st.just("ack"), st.integers(0, 99), st.integers(0, 2)),
)
changes = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(CONSUMER_IDS), st.integers(0, 2)),
    st.tuples(st.just("remove"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("ack_cumulative"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("ack_any"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("reread"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("redeliver"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("seek"), st.integers(0, 30), st.just(0)),
)
first_consumers = st.lists(
    st.tuples(st.just("add"), st.sampled_from(CONSUMER_IDS), st.integers(0, 2)), min_size=1, max_size=3
)
# Flow, remove and redeliver name a connected consumer by its place; seeks
# and cumulative acks name an offset modulo the partition's size. One event
# in five is a change.
events = st.lists(
    st.tuples(st.integers(0, 4), flowing, changes).map(lambda choice: choice[2] if choice[0] == 0 else choice[1]),
    min_size=20,
    max_size=80,
)


@dataclass
class Model:
    """What the dispatcher's outputs must agree with, kept independently."""

    kind: SubscriptionType
    partition_index: int
    unacked_per_consumer_max: int
    unacked_per_subscription_max: int
    entries: list[EntryRef]
    consumers: dict[int, tuple[str, int]] = field(default_factory=dict)  # id -> (name, priority), joining order
    permits: dict[int, int] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)
    out: dict[int, int] = field(default_factory=dict)  # offset -> consumer holding it
    returned: dict[int, int] = field(default_factory=dict)  # offset -> times given back for redelivery
    read_offset: int = 0
    join_offset: dict[int, int] = field(default_factory=dict)  # key-shared consumers that joined late
    epoch: int = 0  # bumped whenever consumers change, a seek, or a redelivery
    last_of_key: dict = field(default_factory=dict)  # key -> (epoch, consumer, offset)
    last_of_consumer: dict[int, tuple[int, int]] = field(default_factory=dict)  # consumer -> (epoch, offset)

    @property
    def total(self) -> int:
        return self.entries[-1].last_offset + 1

    def mark_delete(self) -> int:
        mark = -1
        while mark + 1 in self.acked:
            mark += 1
        return mark

    def active(self) -> int | None:
        ordered = sorted(self.consumers, key=lambda consumer_id: (self.consumers[consumer_id][1], self.consumers[consumer_id][0], consumer_id))
        if not ordered:
            return None
        if self.kind is FAILOVER and self.partition_index >= 0:
            return ordered[self.partition_index % len(ordered)]
        return ordered[0]

    def give_back(self, consumer_id: int) -> None:
        for offset in [offset for offset, holder in self.out.items() if holder == consumer_id]:
            self.give_back_offset(offset)

    def give_back_offset(self, offset: int) -> None:
        del self.out[offset]
        self.returned[offset] = self.returned.get(offset, 0) + 1

    def acknowledge(self, offsets) -> None:
        for offset in offsets:
            self.acked.add(offset)
            self.out.pop(offset, None)
            self.returned.pop(offset, None)

    def check(self, deliveries: list[Delivery]) -> None:
        """Every rule a batch of deliveries must keep."""
        entries_in_call: set[tuple[int, int]] = set()
        mark_delete = self.mark_delete()
        for delivery in deliveries:
            consumer_id, entry = delivery.consumer_id, delivery.entry
            offsets = [entry.first_offset + index for index in delivery.batch_indexes]
            assert consumer_id in self.consumers, "delivery to a consumer that is not connected"
            assert offsets and offsets == sorted(set(offsets))
            if self.kind in (EXCLUSIVE, FAILOVER):
                assert consumer_id == self.active(), "delivery to a consumer that is not the active one"
            held = sum(1 for holder in self.out.values() if holder == consumer_id)
            if self.kind is KEY_SHARED:
                # Each message needs a permit and room of its own.
                assert self.permits[consumer_id] >= len(offsets), "key-shared delivery past the permits"
                assert held + len(offsets) <= self.unacked_per_consumer_max
                assert len(self.out) + len(offsets) <= self.unacked_per_subscription_max
            else:
                # A delivery starts only with a permit and room; the rest of
                # its entry may follow past them; an entry's messages go out
                # together.
                assert self.permits[consumer_id] > 0, "delivery started without a permit"
                assert held < self.unacked_per_consumer_max
                assert len(self.out) < self.unacked_per_subscription_max
                assert (entry.ledger_id, entry.entry_id) not in entries_in_call, "an entry split in one pass"
                entries_in_call.add((entry.ledger_id, entry.entry_id))
            assert delivery.redelivery_count == max(self.returned.get(offset, 0) for offset in offsets)
            for offset in offsets:
                assert offset not in self.acked, f"acknowledged message {offset} delivered"
                assert offset not in self.out, f"message {offset} out at consumer {self.out.get(offset)} and {consumer_id}"
                assert offset < self.read_offset, "delivery of a message never read"
                join = self.join_offset.get(consumer_id)
                if join is not None and offset >= join:
                    assert mark_delete >= join - 1, "a recently joined consumer overtook earlier messages"
                last = self.last_of_consumer.get(consumer_id)
                if last is not None and last[0] == self.epoch:
                    assert offset > last[1], "a consumer's messages out of offset order"
                self.last_of_consumer[consumer_id] = (self.epoch, offset)
                if self.kind is KEY_SHARED:
                    key = entry.key_of(offset)
                    last = self.last_of_key.get(key)
                    if last is not None and last[0] == self.epoch:
                        assert last[1] == consumer_id, f"key {key!r} at two consumers"
                        assert offset > last[2], f"key {key!r} out of offset order"
                    self.last_of_key[key] = (self.epoch, consumer_id, offset)
                self.out[offset] = consumer_id
                self.permits[consumer_id] -= 1


class Harness:
    """Drives a dispatcher as the subscription does, checking it against the model."""

    def __init__(self, kind: SubscriptionType, batches, partition_index: int, replay_max: int, unacked_max: int,
                 unacked_subscription_max: int = 10**6) -> None:
        entries = make_entries(*batches)
        self.cursor = Cursor.at(0)
        self.dispatcher = Dispatcher(kind, self.cursor, partition_index=partition_index, replay_max=replay_max,
                                     unacked_per_consumer_max=unacked_max, unacked_per_subscription_max=unacked_subscription_max)
        self.model = Model(kind, partition_index, unacked_max, unacked_subscription_max, entries)

    def deliver(self, deliveries: list[Delivery]) -> None:
        self.model.check(deliveries)

    def next_entry(self) -> EntryRef | None:
        for entry in self.model.entries:
            if entry.last_offset >= self.dispatcher.read_offset:
                return entry
        return None

    def add(self, consumer_id: int, priority: int) -> None:
        model, dispatcher = self.model, self.dispatcher
        if consumer_id in model.consumers:
            return
        before = model.active()
        name = f"n{(consumer_id * 7) % 5}{consumer_id}"  # names do not sort as ids do
        if model.kind is EXCLUSIVE and model.consumers:
            with pytest.raises(ConsumerRefusedError):
                dispatcher.add_consumer(consumer_id, name, priority=priority)
            return
        dispatcher.add_consumer(consumer_id, name, priority=priority)
        if model.kind is KEY_SHARED and model.consumers:
            model.join_offset[consumer_id] = model.read_offset
        model.consumers[consumer_id] = (name, priority)
        model.permits[consumer_id] = 0
        self.membership_changed(before)

    def remove(self, consumer_id: int) -> None:
        model = self.model
        before = model.active()
        self.dispatcher.remove_consumer(consumer_id)
        if consumer_id in model.consumers:
            model.give_back(consumer_id)
            del model.consumers[consumer_id], model.permits[consumer_id]
            model.join_offset.pop(consumer_id, None)
            self.membership_changed(before)

    def membership_changed(self, active_before: int | None) -> None:
        model = self.model
        model.epoch += 1
        if model.kind in (EXCLUSIVE, FAILOVER):
            active = model.active()
            assert self.dispatcher.active_consumer_id == active
            if active != active_before:
                # The new active consumer takes over what the others hold.
                for consumer_id in model.consumers:
                    if consumer_id != active:
                        model.give_back(consumer_id)

    def consumer_at(self, place: int) -> int:
        """The connected consumer at `place` (an unknown id when none is)."""
        connected = list(self.model.consumers)
        return connected[place % len(connected)] if connected else 99

    def flow(self, consumer_id: int, permits: int) -> None:
        self.dispatcher.flow(consumer_id, permits)
        if consumer_id in self.model.consumers:
            self.model.permits[consumer_id] += permits

    def acknowledge(self, offsets: list[int]) -> None:
        self.cursor.acknowledge(offsets)
        self.dispatcher.acknowledged(offsets)
        self.model.acknowledge(offsets)

    def read(self) -> None:
        """As the subscription's loop: read the next entry only when the
        dispatcher wants one."""
        entry = self.next_entry()
        if entry is not None and self.dispatcher.wants_read():
            self.model.read_offset = max(self.model.read_offset, entry.last_offset + 1)
            self.deliver(self.dispatcher.entry_read(entry))

    def redeliver(self, consumer_id: int, step: int) -> None:
        model = self.model
        held = sorted(offset for offset, holder in model.out.items() if holder == consumer_id)
        chosen = None if step == 0 else held[::step]
        self.dispatcher.redeliver(consumer_id, chosen)
        for offset in held if chosen is None else chosen:
            model.give_back_offset(offset)
        model.epoch += 1

    def seek(self, offset: int) -> None:
        model = self.model
        self.cursor.reset(offset)
        self.dispatcher.reset(offset)
        model.acked = set(range(0, offset))
        model.out.clear()
        model.returned.clear()
        model.read_offset = offset
        for consumer_id in model.join_offset:
            model.join_offset[consumer_id] = offset
        model.epoch += 1

    def step(self, event) -> None:
        name, first, second = event
        model = self.model
        if name == "add":
            self.add(first, second)
        elif name == "remove":
            self.remove(self.consumer_at(first))
        elif name == "flow":
            self.flow(self.consumer_at(first), second)
        elif name == "read":
            self.read()
        elif name == "replay":
            self.deliver(self.dispatcher.dispatch_replay())
        elif name == "ack" and model.out:
            out = sorted(model.out)
            self.acknowledge([out[(first + index) % len(out)] for index in range(second + 1)])
        elif name == "ack_any":
            # Any message: one never read, held, or given back meanwhile.
            self.acknowledge([first % model.total])
        elif name == "ack_cumulative":
            offset = first % (model.total + 1) - 1
            self.cursor.acknowledge_cumulative(offset)
            self.dispatcher.acknowledged_through(offset)
            model.acknowledge(range(0, offset + 1))
        elif name == "redeliver":
            self.redeliver(self.consumer_at(first), second)
        elif name == "seek":
            self.seek(first % (model.total + 1))
        elif name == "reread":
            # An entry read before (a driver that reads it again): every
            # message of it is acknowledged, out or held, so nothing goes.
            read = [entry for entry in model.entries if entry.last_offset < model.read_offset]
            if read:
                assert self.dispatcher.entry_read(read[first % len(read)]) == []
        self.check_state()

    def check_state(self) -> None:
        model, dispatcher = self.model, self.dispatcher
        assert dispatcher.read_offset == model.read_offset
        assert dispatcher.consumer_ids == list(model.consumers)
        # Nothing is lost: every message read is acknowledged, out at a
        # consumer or held for (re)delivery.
        held = [offset for offset in range(model.read_offset) if offset not in model.acked and offset not in model.out]
        assert dispatcher.replay_count == len(held), f"held {dispatcher.replay_count}, expected {held}"
        for consumer_id in model.consumers:
            assert dispatcher.permits(consumer_id) == model.permits[consumer_id]
            assert dispatcher.unacked_count(consumer_id) == sum(1 for holder in model.out.values() if holder == consumer_id)

    def drain(self) -> None:
        """Liveness: with permits and a consumer that acknowledges everything
        it gets, every message of the partition is delivered and acknowledged."""
        model, dispatcher = self.model, self.dispatcher
        if not model.consumers:
            self.add(CONSUMER_IDS[0], 0)
        for _ in range(4 * model.total + 10):
            if model.mark_delete() == model.total - 1:
                return
            for consumer_id in model.consumers:
                self.flow(consumer_id, 3)
            self.deliver(dispatcher.dispatch_replay())
            self.read()
            self.acknowledge(sorted(model.out))
            self.check_state()
        raise AssertionError(
            f"stuck: acknowledged through {model.mark_delete()} of {model.total - 1}, "
            f"{dispatcher.replay_count} held, read up to {dispatcher.read_offset}"
        )


@pytest.mark.parametrize("kind", list(SubscriptionType))
@settings(max_examples=120, deadline=None)
@given(
    batches=entry_batches,
    start=first_consumers,
    script=events,
    partition_index=st.sampled_from([-1, 0, 1, 2]),
    replay_max=st.integers(1, 8),
    unacked_max=st.integers(1, 6),
    unacked_subscription_max=st.integers(1, 12),
)
def test_random_events_keep_every_dispatch_rule(kind, batches, start, script, partition_index, replay_max, unacked_max,
                                                unacked_subscription_max):
    harness = Harness(kind, batches, partition_index, replay_max, unacked_max, unacked_subscription_max)
    for event in start + script:
        harness.step(event)
    harness.drain()
    assert harness.cursor.backlog(harness.model.total - 1) == 0
