"""Bounded retries with exponential backoff and jitter, like kazoo's KazooRetry.

`RetryPolicy` is pure: it turns an injected `random.Random` into the delays to
wait between tries. `call_with_retry` runs a synchronous call under a policy.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently to retry.

    Try k (counting from 1) is followed, if it fails and is not the last, by a
    delay of `delay_initial_ms * backoff_factor**(k-1)`, capped at
    `delay_max_ms`, then scaled by a random factor in
    `[1 - jitter_ratio, 1 + jitter_ratio]` and capped again, so no delay ever
    exceeds `delay_max_ms`.
    """

    tries_max: int = 5
    delay_initial_ms: float = 100.0
    delay_max_ms: float = 2_000.0
    backoff_factor: float = 2.0
    jitter_ratio: float = 0.2

    def __post_init__(self) -> None:
        if not isinstance(self.tries_max, int) or isinstance(self.tries_max, bool):
            raise TypeError(f"tries_max must be an int, got {self.tries_max!r}")
        if self.tries_max < 1:
            raise ValueError(f"tries_max must be at least 1, got {self.tries_max}")
        if self.delay_initial_ms < 0:
            raise ValueError(f"delay_initial_ms must not be negative, got {self.delay_initial_ms}")
        if self.delay_max_ms < self.delay_initial_ms:
            raise ValueError(
                f"delay_max_ms ({self.delay_max_ms}) must be at least delay_initial_ms ({self.delay_initial_ms})"
            )
        if self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be at least 1, got {self.backoff_factor}")
        if not 0 <= self.jitter_ratio <= 1:
            raise ValueError(f"jitter_ratio must be within [0, 1], got {self.jitter_ratio}")

    def delays_ms(self, rng: random.Random) -> list[float]:
        """The `tries_max - 1` delays to wait between consecutive tries."""
        return list(self.iter_delays_ms(rng))

    def iter_delays_ms(self, rng: random.Random) -> Iterator[float]:
        """The same delays as `delays_ms`, drawn one at a time: for a loop
        that a deadline usually ends long before `tries_max`."""
        base_ms = float(self.delay_initial_ms)
        for _ in range(self.tries_max - 1):
            jitter = rng.uniform(1.0 - self.jitter_ratio, 1.0 + self.jitter_ratio)
            yield min(base_ms * jitter, float(self.delay_max_ms))
            base_ms = min(base_ms * self.backoff_factor, float(self.delay_max_ms))


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    retry_on: tuple[type[BaseException], ...],
    sleep: Callable[[float], object] = time.sleep,
    rng: random.Random | None = None,
) -> T:
    """Call `fn` until it returns, retrying errors of the types in `retry_on`
    at most `policy.tries_max` times in all; the last error is re-raised.
    Any other error propagates at once. `sleep` takes seconds."""
    if not retry_on:
        raise ValueError("retry_on must name at least one error type")
    delays_ms = policy.delays_ms(rng if rng is not None else random.Random())
    for delay_ms in delays_ms:
        try:
            return fn()
        except retry_on:
            sleep(delay_ms / 1000.0)
    # The last try: its error, if any, goes to the caller.
    return fn()
