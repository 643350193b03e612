"""What a partition's producer or consumer uses of the `Client` that made it,
passed in as one small object (`ClientServices`): a handle number, the
connection to the broker that serves a partition, a way to start tasks and
the random source. A partition never sees the `Client` itself, so the client
imports its producers and consumers and not the reverse."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from broker.client.connection import BrokerConnection


class TaskSpawner(Protocol):
    """Starts a task in the client's nursery (`trio.Nursery.start_soon`)."""

    def __call__(self, async_fn: Callable[..., Awaitable[object]], *args: Any) -> None: ...


@dataclass(frozen=True)
class ClientServices:
    # A number for a new producer or consumer, unique within the client
    # (the broker protocol names each by it).
    new_handle: Callable[[], int]
    # The connection to the broker serving a partition (looked up, redirects followed).
    connection_for: Callable[[str], Awaitable[BrokerConnection]]
    # Tasks that outlive one call (acks sent in groups, redeliveries, resends).
    spawn: TaskSpawner
    rng: random.Random


__all__ = ["ClientServices", "TaskSpawner"]
