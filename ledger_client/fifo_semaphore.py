"""A FIFO counting semaphore for bounds that every add passes twice.

trio.Semaphore costs ~1.5 µs per acquire and release here (its
KeyboardInterrupt protection wraps each call, and it asserts on its parking
lot); a writer acquires and releases a slot per entry in the handle and one
per entry and bookie in each connection. `FifoSemaphore` keeps what those
callers rely on: waiters are served in arrival order, a released slot goes
straight to the first waiter, and acquiring an available slot is not a
scheduling point (requests queued back to back then leave in one send).
"""

from __future__ import annotations

import trio


class FifoSemaphore:
    __slots__ = ("available", "_waiting", "_lot")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a semaphore needs at least one slot, got {size}")
        self.available = size
        self._waiting = 0
        self._lot = trio.lowlevel.ParkingLot()

    def acquire_nowait(self) -> None:
        """Take a slot, or raise trio.WouldBlock when none is available."""
        if not self.available:
            raise trio.WouldBlock
        self.available -= 1

    async def acquire(self) -> None:
        """Take a slot, waiting for one (behind earlier waiters) if none is available."""
        if self.available:
            self.available -= 1
            return
        self._waiting += 1
        try:
            await self._lot.park()
        except BaseException:
            # Cancelled while parked: no slot was handed over (a task that
            # was unparked is rescheduled and cannot be cancelled in park).
            self._waiting -= 1
            raise

    def release(self, count: int = 1) -> None:
        """Give `count` slots back: to waiters first, in order."""
        while count and self._waiting:
            self._waiting -= 1
            self._lot.unpark()
            count -= 1
        self.available += count
