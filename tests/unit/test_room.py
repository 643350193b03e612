"""Room, the pending-adds and in-flight bound: free room is taken without a
scheduling point, waiters are served in order, a cancelled waiter takes no
slot with it."""

import pytest
import trio
import trio.testing

from ledger_client.room import Room


async def test_free_room_is_taken_without_a_scheduling_point_and_then_would_block():
    room = Room(2)
    with trio.testing.assert_no_checkpoints():
        await room.take()
        room.take_nowait()
    with pytest.raises(trio.WouldBlock):
        room.take_nowait()
    room.give(2)
    assert room.free == 2


async def waiter(room: Room, served: list, name, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Take a slot, then note `name` in `served`; started, it hands over a
    cancel scope around the wait."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        await room.take()
        served.append(name)


async def test_waiters_are_served_in_order_and_a_slot_goes_straight_to_the_first():
    room = Room(1)
    room.take_nowait()
    served: list[int] = []
    async with trio.open_nursery() as nursery:
        for number in range(3):
            nursery.start_soon(waiter, room, served, number)
            await trio.testing.wait_all_tasks_blocked()
        room.give()
        # Handed to waiter 0 before anyone else could take it.
        with pytest.raises(trio.WouldBlock):
            room.take_nowait()
        await trio.testing.wait_all_tasks_blocked()
        room.give()
        await trio.testing.wait_all_tasks_blocked()
        assert served == [0, 1]
        room.give(2)  # one for waiter 2, one left free
        await trio.testing.wait_all_tasks_blocked()
    assert served == [0, 1, 2] and room.free == 1
    room.give(2)
    assert room.free == 3


async def test_a_cancelled_waiter_takes_no_slot():
    room = Room(1)
    room.take_nowait()
    got: list[str] = []
    async with trio.open_nursery() as nursery:
        first = await nursery.start(waiter, room, got, "first")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, room, got, "second")
        await trio.testing.wait_all_tasks_blocked()
        first.cancel()
        await trio.testing.wait_all_tasks_blocked()
        room.give()
    assert got == ["second"] and room.free == 0


def test_room_needs_a_slot():
    with pytest.raises(ValueError):
        Room(0)
