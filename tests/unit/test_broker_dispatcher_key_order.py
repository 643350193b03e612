"""Key-shared dispatching keeps a key's order when the key moves to a consumer
that joins: a message of the key never goes to the new consumer while an
earlier message of it is still out at the old one, whether the message was
held back (no permits) or given back (a negative acknowledgement). The
broker simulation shows the same with this rule broken
(`key-shared-overtakes-on-join` in sim.broker_mistakes)."""

from __future__ import annotations

from broker.cursor import Cursor
from broker.dispatcher import Dispatcher, EntryRef, SubscriptionType


def key_moving_to(consumer_id: int) -> str:
    """A key that goes to consumer 1 alone and to `consumer_id` once it joins."""
    for number in range(1000):
        key = f"key-{number}"
        probe = Dispatcher(SubscriptionType.KEY_SHARED, Cursor.at(0))
        probe.add_consumer(1, "c1")
        probe.add_consumer(consumer_id, f"c{consumer_id}")
        if probe._key_consumer(key) == consumer_id:
            return key
    raise AssertionError("no key moves")


def entry(offset: int, key: str) -> EntryRef:
    return EntryRef(1, offset, offset, 1, (key,))


def delivered(deliveries) -> list[tuple[int, int]]:
    return [(delivery.consumer_id, delivery.entry.first_offset + index)
            for delivery in deliveries for index in delivery.batch_indexes]


def test_a_held_message_waits_for_an_earlier_one_out_at_the_consumer_its_key_left():
    key = key_moving_to(2)
    cursor = Cursor.at(0)
    dispatcher = Dispatcher(SubscriptionType.KEY_SHARED, cursor)
    dispatcher.add_consumer(1, "c1")
    dispatcher.flow(1, 1)
    assert delivered(dispatcher.entry_read(entry(0, key))) == [(1, 0)]
    assert delivered(dispatcher.entry_read(entry(1, key))) == []  # held: no permits
    dispatcher.add_consumer(2, "c2")
    dispatcher.flow(2, 10)
    assert dispatcher.dispatch_replay() == []  # 0 is still out at consumer 1
    cursor.acknowledge([0])
    dispatcher.acknowledged([0])
    assert delivered(dispatcher.dispatch_replay()) == [(2, 1)]


def test_a_message_given_back_waits_for_an_earlier_one_out_at_the_consumer_its_key_left():
    key = key_moving_to(2)
    cursor = Cursor.at(0)
    dispatcher = Dispatcher(SubscriptionType.KEY_SHARED, cursor)
    dispatcher.add_consumer(1, "c1")
    dispatcher.flow(1, 10)
    assert delivered(dispatcher.entry_read(entry(0, key)) + dispatcher.entry_read(entry(1, key))) == [(1, 0), (1, 1)]
    dispatcher.redeliver(1, [1])  # a negative acknowledgement of 1; 0 stays out
    dispatcher.add_consumer(2, "c2")
    dispatcher.flow(2, 10)
    assert dispatcher.dispatch_replay() == []
    dispatcher.redeliver(1, [0])  # given back too: both go to consumer 2, in order
    assert delivered(dispatcher.dispatch_replay()) == [(2, 0), (2, 1)]


def test_a_consumer_that_leaves_hands_its_keys_over_at_once():
    key = key_moving_to(2)
    dispatcher = Dispatcher(SubscriptionType.KEY_SHARED, Cursor.at(0))
    dispatcher.add_consumer(2, "c2")
    dispatcher.add_consumer(1, "c1")
    dispatcher.flow(1, 10)
    dispatcher.flow(2, 10)
    assert delivered(dispatcher.entry_read(entry(0, key))) == [(2, 0)]
    dispatcher.remove_consumer(2)
    assert delivered(dispatcher.dispatch_replay() + dispatcher.entry_read(entry(1, key))) == [(1, 0), (1, 1)]


def test_a_delivery_given_back_is_no_longer_out_at_its_consumer():
    # The driver could not send it: it is as if never delivered, and holds
    # up no other consumer the key moves to.
    key = key_moving_to(2)
    dispatcher = Dispatcher(SubscriptionType.KEY_SHARED, Cursor.at(0))
    dispatcher.add_consumer(1, "c1")
    dispatcher.flow(1, 10)
    [delivery] = dispatcher.entry_read(entry(0, key))
    dispatcher.give_back(delivery)
    dispatcher.add_consumer(2, "c2")
    dispatcher.flow(2, 10)
    assert delivered(dispatcher.dispatch_replay()) == [(2, 0)]
    dispatcher.cursor.acknowledge([0])
    dispatcher.acknowledged([0])
    assert delivered(dispatcher.entry_read(entry(1, key))) == [(2, 1)]
