"""A subscription's acknowledgements near its bound of individually
acknowledged ranges (ACKED_RANGES_MAX): what would start a new range past it
is refused with an error naming it, the rest of the request is taken, and
the oldest unacknowledged message is always taken. Driven through
`Subscription.acknowledge` (non-durable, so no cursor write) over a stand-in
partition."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from broker.cursor import Cursor
from broker.dispatcher import EntryRef, SubscriptionType
from broker.errors import BadRequestError
from broker.subscription import ACKED_RANGES_MAX, Subscription


def make_subscription(kind: SubscriptionType, ranges_max: int, *, confirmed_offset: int = 1_000) -> Subscription:
    partition = SimpleNamespace(name="t-partition-0", partition_index=0,
                                managed_ledger=SimpleNamespace(confirmed_offset=confirmed_offset))
    subscription = Subscription(partition, "s", kind, Cursor.at(0), durable=False, important=False,
                                cursor_version=None, created_ms=0)
    subscription.acked_ranges_max = ranges_max
    return subscription


def test_the_bound_is_a_large_one_by_default():
    assert make_subscription(SubscriptionType.SHARED, ACKED_RANGES_MAX).acked_ranges_max == ACKED_RANGES_MAX == 100_000


@pytest.mark.parametrize("kind", [SubscriptionType.SHARED, SubscriptionType.KEY_SHARED])
async def test_at_the_bound_new_ranges_are_refused_and_the_oldest_message_is_taken(kind):
    subscription = make_subscription(kind, ranges_max=3)
    dispatcher = subscription.dispatcher
    dispatcher.add_consumer(1, "c1")
    dispatcher.flow(1, 100)
    for offset in range(12):
        dispatcher.entry_read(EntryRef(1, offset, offset, 1))
    await subscription.acknowledge([1, 3, 5], cumulative=False)
    assert subscription.cursor.acked.ranges() == [[1, 1], [3, 3], [5, 5]]

    # Cumulative acknowledgement is not allowed on these types.
    with pytest.raises(BadRequestError, match="cumulative"):
        await subscription.acknowledge([0], cumulative=True)
    # A request mixing a gap-filler (4) and two new ranges (9, 11): 4 is
    # taken, which makes room for 9; 11 is refused, and the error says so.
    with pytest.raises(BadRequestError) as refused:
        await subscription.acknowledge([11, 9, 4], cumulative=False)
    message = str(refused.value)
    assert "1 of 3 acknowledgements refused" in message and "offsets 11..11" in message
    assert "offset 0" in message  # the oldest unacknowledged message, always taken
    assert subscription.cursor.acked.ranges() == [[1, 1], [3, 5], [9, 9]]
    assert dispatcher.unacked_count(1) == 12 - 5  # the dispatcher forgot what was taken, not 11
    # The oldest unacknowledged message is taken, and the mark-delete moves.
    await subscription.acknowledge([0], cumulative=False)
    assert subscription.cursor.mark_delete == 1
    await subscription.acknowledge([11], cumulative=False)  # room again
    assert subscription.cursor.acked.ranges() == [[3, 5], [9, 9], [11, 11]]


async def test_below_the_bound_nothing_is_refused():
    subscription = make_subscription(SubscriptionType.SHARED, ranges_max=10)
    await subscription.acknowledge([1, 3, 5, 7, 9], cumulative=False)
    assert len(subscription.cursor.acked) == 5
