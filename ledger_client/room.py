"""A counting semaphore for bounds that every add passes twice.

trio.Semaphore costs ~1.5 µs per take and give here (its KeyboardInterrupt
protection wraps each call, and it asserts on its parking lot); a writer
takes and gives a slot per entry in the handle and one per entry and bookie
in each connection. `Room` keeps what those callers rely on: waiters are
served in arrival order, a slot given back goes straight to the first
waiter, and taking free room is not a scheduling point (requests queued back
to back then leave in one send).
"""

from __future__ import annotations

import trio


class Room:
    __slots__ = ("free", "_waiting", "_lot")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"room for at least one is needed, got {size}")
        self.free = size
        self._waiting = 0
        self._lot = trio.lowlevel.ParkingLot()

    def take_nowait(self) -> None:
        """Take a slot, or raise trio.WouldBlock when there is none."""
        if not self.free:
            raise trio.WouldBlock
        self.free -= 1

    async def take(self) -> None:
        """Take a slot, waiting for one (behind earlier waiters) if none is free."""
        if self.free:
            self.free -= 1
            return
        self._waiting += 1
        try:
            await self._lot.park()
        except BaseException:
            # Cancelled while parked: no slot was handed over (a task that
            # was unparked is rescheduled and cannot be cancelled in park).
            self._waiting -= 1
            raise

    def give(self, count: int = 1) -> None:
        """Give `count` slots back: to waiters first, in order."""
        while count and self._waiting:
            self._waiting -= 1
            self._lot.unpark()
            count -= 1
        self.free += count
