"""One clock for the housekeeping of every partition a broker serves.

Each partition samples its rates, drops idle readers' subscriptions, rolls
its ledger over by age and checks its policies, TTL and retention. With a
timer of its own per partition, a broker serving thousands of idle
partitions woke thousands of times a second to find nothing to do. The
clock wakes once per interval and calls each partition's synchronous
`tick(now)`, which does the cheap part at once and wakes the partition's
own task only when there is work that waits on ZooKeeper or the bookies
(so a partition's failure stays in its own task).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import trio

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 1.0
TICKS_BETWEEN_CHECKPOINTS = 256  # partitions ticked before other tasks get a turn


class HousekeepingClock:
    def __init__(self, interval_s: float = HOUSEKEEPING_INTERVAL_S) -> None:
        self.interval_s = interval_s
        # Bound methods, one per partition served: added when it starts
        # serving, removed when it stops.
        self._ticks: dict[Callable[[float], None], None] = {}
        self.ticks_failed = 0

    def join(self, tick: Callable[[float], None]) -> None:
        self._ticks[tick] = None

    def leave(self, tick: Callable[[float], None]) -> None:
        self._ticks.pop(tick, None)

    def __len__(self) -> int:
        return len(self._ticks)

    async def run(self) -> None:
        """Tick every member once per interval, until cancelled."""
        while True:
            await trio.sleep(self.interval_s)
            await self.tick_all(time.monotonic())

    async def tick_all(self, now: float) -> None:
        for index, tick in enumerate(list(self._ticks)):
            if index and index % TICKS_BETWEEN_CHECKPOINTS == 0:
                await trio.lowlevel.checkpoint()
            if tick not in self._ticks:
                continue  # left meanwhile
            try:
                tick(now)
            except Exception:  # one partition's bug must not stop every partition's housekeeping
                self.ticks_failed += 1
                log.exception("housekeeping tick of %r failed", getattr(tick, "__self__", tick))


__all__ = ["HOUSEKEEPING_INTERVAL_S", "HousekeepingClock"]
