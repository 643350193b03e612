"""Waiting helpers shared by the auditor and the replication worker: the
first of several conditions, the cluster-wide on/off switch, and going on
after metadata store failures."""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from typing import Awaitable, Callable

import trio

from coordination.async_store import AsyncMetadataStore
from coordination.cluster_layout import ClusterLayout
from coordination.store import MetadataError

log = logging.getLogger(__name__)
STORE_RETRY_DELAY_S_INITIAL = 0.2
STORE_RETRY_DELAY_S_MAX = 10.0
JITTER_RATIO = 0.2


def wall_ms() -> float:
    """Wall-clock milliseconds: marker times are compared across processes."""
    return time.time() * 1000.0


async def wait_any(*waits: Callable[[], Awaitable[object]], deadline_ms: float = math.inf) -> None:
    """Return once any of `waits` returns, or at `deadline_ms` (wall clock)."""
    async with trio.open_nursery() as nursery:
        async def run(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        for wait in waits:
            nursery.start_soon(run, wait)
        if deadline_ms != math.inf:
            nursery.start_soon(run, lambda: trio.sleep(max(0.0, (deadline_ms - wall_ms()) / 1000.0)))


async def wait_enabled(store: AsyncMetadataStore, layout: ClusterLayout) -> bool:
    """Return once auto-recovery is switched on; True if it was off at first."""
    waited = False
    while True:
        stat, changed = await store.exists_watch(layout.autorecovery_disabled)
        if stat is None:
            return waited
        waited = True
        await changed.wait()


async def wait_disabled(store: AsyncMetadataStore, layout: ClusterLayout) -> None:
    """Return once auto-recovery is switched off."""
    while True:
        stat, changed = await store.exists_watch(layout.autorecovery_disabled)
        if stat is not None:
            return
        await changed.wait()


def jittered(delay_s: float, rng: random.Random) -> float:
    """`delay_s` scaled by a random factor in [1 - JITTER_RATIO, 1 + JITTER_RATIO],
    so that the daemons of every bookie, failing together, retry apart."""
    return delay_s * rng.uniform(1 - JITTER_RATIO, 1 + JITTER_RATIO)


async def repeat_after_store_errors(
    name: str, step: Callable[[], Awaitable[object]], rng: random.Random | None = None
) -> None:
    """Run `step` over and over until cancelled; after a metadata store
    failure (session lost, ZooKeeper unreachable) wait first, doubling the
    wait up to STORE_RETRY_DELAY_S_MAX while failures keep coming (with
    jitter)."""
    rng = rng or random.Random()
    delay_s = STORE_RETRY_DELAY_S_INITIAL
    while True:
        failure: BaseException | None = None
        try:
            await step()
        except* MetadataError as group:
            # Raised inside a nursery (wait_any, the worker's attempts) the
            # error comes wrapped in exception groups.
            failure = group
            while isinstance(failure, BaseExceptionGroup):
                failure = failure.exceptions[0]
        if failure is None:
            delay_s = STORE_RETRY_DELAY_S_INITIAL
            continue
        wait_s = jittered(delay_s, rng)
        log.warning("%s: %s; again in %.1fs", name, failure, wait_s)
        await trio.sleep(wait_s)
        delay_s = min(delay_s * 2, STORE_RETRY_DELAY_S_MAX)


async def run_while_enabled(name: str, store: AsyncMetadataStore, layout: ClusterLayout, duty: Callable[[], Awaitable[object]]) -> None:
    """Run `duty` while auto-recovery is switched on: cancelled when it is
    switched off, started again when it is switched back on."""
    async def step() -> None:
        if await wait_enabled(store, layout):
            log.info("%s: auto-recovery switched on again", name)
        await wait_any(duty, functools.partial(wait_disabled, store, layout))
        log.info("%s pauses: auto-recovery switched off", name)

    await repeat_after_store_errors(name, step)


__all__ = ["jittered", "repeat_after_store_errors", "run_while_enabled", "wait_any", "wait_disabled", "wait_enabled", "wall_ms"]
