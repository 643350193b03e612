"""Reconnection of producers and consumers: which errors make one look its
partition up again and reconnect, and the delays between tries, exponential
with jitter, capped, from the same `RetryPolicy` the metadata store uses. A
producer or consumer reconnects for as long as it lives; its caller bounds
an operation with `trio.fail_after`."""

from __future__ import annotations

import random

from broker.errors import (
    ConnectionClosedError,
    NotOwnerError,
    ProducerBusyError,
    RetryLaterError,
    ServiceUnavailableError,
    TopicFencedError,
)
from coordination.retry import RetryPolicy

HEALTHY_CONNECTION_S = 5.0  # a connection that lived this long resets the reconnection backoff
# Errors after which a producer or consumer looks its partition up again and reconnects.
RECONNECT_ERRORS = (ConnectionClosedError, NotOwnerError, TopicFencedError, ServiceUnavailableError, ProducerBusyError,
                    RetryLaterError)
RECONNECT_POLICY = RetryPolicy(tries_max=8, delay_initial_ms=50.0, delay_max_ms=3_000.0, backoff_factor=2.0, jitter_ratio=0.2)


class Backoff:
    def __init__(self, rng: random.Random, policy: RetryPolicy = RECONNECT_POLICY) -> None:
        self._rng = rng
        self._policy = policy
        self.reset()

    def reset(self) -> None:
        self._delays = self._policy.delays_ms(self._rng)
        self._next = 0

    def next_delay_s(self) -> float:
        """The next delay; past the policy's tries, the capped delay again."""
        if self._next >= len(self._delays):
            self._delays = self._policy.delays_ms(self._rng)[-1:]
            self._next = 0
        delay_ms = self._delays[self._next]
        self._next += 1
        return delay_ms / 1000.0


__all__ = ["Backoff", "HEALTHY_CONNECTION_S", "RECONNECT_ERRORS", "RECONNECT_POLICY"]
