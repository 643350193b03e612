"""FifoSemaphore, the pending-adds and in-flight bound: an available slot is
acquired without a scheduling point, waiters are served in order, a
cancelled waiter takes no slot with it."""

import pytest
import trio
import trio.testing

from ledger_client.fifo_semaphore import FifoSemaphore


async def test_an_available_slot_is_acquired_without_a_scheduling_point_and_then_would_block():
    semaphore = FifoSemaphore(2)
    with trio.testing.assert_no_checkpoints():
        await semaphore.acquire()
        semaphore.acquire_nowait()
    with pytest.raises(trio.WouldBlock):
        semaphore.acquire_nowait()
    semaphore.release(2)
    assert semaphore.available == 2


async def waiter(semaphore: FifoSemaphore, served: list, name, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Acquire a slot, then note `name` in `served`; started, it hands over a
    cancel scope around the wait."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        await semaphore.acquire()
        served.append(name)


async def test_waiters_are_served_in_order_and_a_slot_goes_straight_to_the_first():
    semaphore = FifoSemaphore(1)
    semaphore.acquire_nowait()
    served: list[int] = []
    async with trio.open_nursery() as nursery:
        for number in range(3):
            nursery.start_soon(waiter, semaphore, served, number)
            await trio.testing.wait_all_tasks_blocked()
        semaphore.release()
        # Handed to waiter 0 before anyone else could take it.
        with pytest.raises(trio.WouldBlock):
            semaphore.acquire_nowait()
        await trio.testing.wait_all_tasks_blocked()
        semaphore.release()
        await trio.testing.wait_all_tasks_blocked()
        assert served == [0, 1]
        semaphore.release(2)  # one for waiter 2, one left available
        await trio.testing.wait_all_tasks_blocked()
    assert served == [0, 1, 2] and semaphore.available == 1
    semaphore.release(2)
    assert semaphore.available == 3


async def test_a_cancelled_waiter_takes_no_slot():
    semaphore = FifoSemaphore(1)
    semaphore.acquire_nowait()
    got: list[str] = []
    async with trio.open_nursery() as nursery:
        first = await nursery.start(waiter, semaphore, got, "first")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, semaphore, got, "second")
        await trio.testing.wait_all_tasks_blocked()
        first.cancel()
        await trio.testing.wait_all_tasks_blocked()
        semaphore.release()
    assert got == ["second"] and semaphore.available == 0


def test_a_semaphore_needs_a_slot():
    with pytest.raises(ValueError):
        FifoSemaphore(0)
