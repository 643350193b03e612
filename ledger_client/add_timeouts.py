"""One timer for the add timeouts of every ledger a client writes, as
BookKeeper's timeout monitor: a task that wakes every `interval_s` while
some write handle has adds pending, and lets each such handle's core see
the time (`WriteCore.tick`), which replaces the bookies that left its
oldest add unanswered past the add timeout.

A handle asks to be watched when it hands its core an add; the monitor
lets go of it at a look that finds nothing pending (or the handle done),
and the handle asks again at its next add. So a timeout is seen up to one
interval late; the interval is a tenth of the add timeout (at most a
second), as BookKeeper checks at a fraction of its timeouts.

(One timer task per ledger would cost every open ledger a trio task with
its frame, cancel scopes and events, some twenty objects that each full
garbage collection walks, and a look at that timer on every add.)
"""

from __future__ import annotations

from typing import Protocol

import trio

INTERVAL_S_MAX = 1.0
INTERVAL_S_MIN = 0.001


class Watched(Protocol):
    def check_add_timeouts(self, now_ms: float) -> bool:
        """Tick the core if its deadline passed; False once nothing is
        pending (or the handle is done): the monitor then lets go of it."""


def interval_for(add_timeout_ms: float) -> float:
    return min(INTERVAL_S_MAX, max(INTERVAL_S_MIN, add_timeout_ms / 10_000.0))


class AddTimeoutMonitor:
    def __init__(self, add_timeout_ms: float) -> None:
        self.interval_s = interval_for(add_timeout_ms)
        # The run's clock, in seconds: handles stamp their sends with it (one
        # shared bound method, not one per handle, on the path of every add).
        self.clock_s = trio.lowlevel.current_clock().current_time
        self._watched: list[Watched] = []
        self._wakeup = trio.Event()

    @property
    def watched(self) -> int:
        return len(self._watched)

    def watch(self, handle: Watched) -> None:
        """Look at `handle` every interval until it has nothing pending. A
        handle asks once (it keeps a flag until `check_add_timeouts` says
        False)."""
        self._watched.append(handle)
        if not self._wakeup.is_set():
            self._wakeup.set()

    async def run(self) -> None:
        while True:
            if not self._watched:
                self._wakeup = trio.Event()
                await self._wakeup.wait()
            await trio.sleep(self.interval_s)
            now_ms = self.clock_s() * 1000.0
            # Handles watched while these are looked at (a completion's
            # callback that adds to another ledger) go to the new list.
            watched, self._watched = self._watched, []
            for handle in watched:
                if handle.check_add_timeouts(now_ms):
                    self._watched.append(handle)


__all__ = ["AddTimeoutMonitor", "interval_for"]
