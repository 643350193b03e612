"""The simulator's world: one virtual clock, one event queue, one seeded
random generator, and the digest of the event log. Nothing else in a
simulated run reads a clock or draws randomness: everything goes through it.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from typing import Any, Callable

# Events kept for `--trace` (the last ones of a failing run say most).
TRACE_EVENTS_MAX = 200_000
# Events that may run at one virtual instant before the run counts as a
# livelock (something rescheduling itself with no delay, so that time never
# moves on). The busiest instants of correct runs hold a few thousand
# (4,620 at most over seeds 0-149).
EVENTS_AT_ONE_INSTANT_MAX = 100_000


class LivelockError(Exception):
    """Time stopped: too many events ran at one virtual instant."""


class World:
    def __init__(self, seed: int, *, trace: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now_ms = 0.0
        self._queue: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._sequence = 0
        self._digest = hashlib.sha256()
        self.events_run = 0
        self._instant_ms = -1.0
        self._events_at_instant = 0
        self.trace: list[str] | None = [] if trace else None

    # --- scheduling -------------------------------------------------------------

    def at(self, time_ms: float, callback: Callable[..., Any], *args: Any) -> None:
        """Run `callback(*args)` at virtual time `time_ms` (never earlier
        than now). Events at the same time run in the order scheduled."""
        self._sequence += 1
        heapq.heappush(self._queue, (max(time_ms, self.now_ms), self._sequence, callback, args))

    def after(self, delay_ms: float, callback: Callable[..., Any], *args: Any) -> None:
        self.at(self.now_ms + delay_ms, callback, *args)

    def run_until(self, time_ms: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Run events in time order up to `time_ms` (or until `stop()`),
        then leave the clock at `time_ms`. Raises LivelockError when more
        than EVENTS_AT_ONE_INSTANT_MAX events run at one instant."""
        queue = self._queue
        while queue and queue[0][0] <= time_ms and not stop():
            event_time_ms, _, callback, args = heapq.heappop(queue)
            if event_time_ms != self._instant_ms:
                self._instant_ms = event_time_ms
                self._events_at_instant = 0
            self._events_at_instant += 1
            if self._events_at_instant > EVENTS_AT_ONE_INSTANT_MAX:
                name = getattr(callback, "__qualname__", repr(callback))
                raise LivelockError(
                    f"{self._events_at_instant - 1} events ran at {event_time_ms:.3f} ms and time does not move on "
                    f"(the next one: {name})"
                )
            self.now_ms = event_time_ms
            self.events_run += 1
            callback(*args)
        if not stop():
            self.now_ms = max(self.now_ms, time_ms)

    # --- the event log ------------------------------------------------------------

    def log(self, text: str) -> None:
        """Record an event in the digest (and the trace, when kept). Two runs
        of one seed must log the same lines in the same order."""
        line = f"{self.now_ms:.3f} {text}"
        self._digest.update(line.encode())
        self._digest.update(b"\n")
        if self.trace is not None and len(self.trace) < TRACE_EVENTS_MAX:
            self.trace.append(line)

    def digest(self) -> str:
        return self._digest.hexdigest()

    # --- randomness -------------------------------------------------------------------

    def chance(self, probability: float) -> bool:
        return probability > 0 and self.rng.random() < probability

    def uniform(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high)

    def exponential(self, mean: float) -> float:
        return self.rng.expovariate(1.0 / mean) if mean > 0 else 0.0
