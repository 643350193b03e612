"""A process's start-up steps that talk to ZooKeeper, under one deadline.

Each step is tried again, with the backoff and jitter of a `RetryPolicy`, when
ZooKeeper lost the connection, did not answer in time, or ended the session
(kazoo starts a fresh session by itself after an expiry; a failed connect is
tried again with a new client). Start-up as a whole has one deadline; past it
the process gets one line naming the step that did not finish. Any other
ZooKeeper error (no permission, a node that should be there missing, the
store closed) ends start-up at once, also with one line naming the step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import threading
from typing import Awaitable, Callable, Iterator, TypeVar

import trio

from coordination.retry import RetryPolicy
from coordination.store import ConnectionLossError, MetadataError, MetadataStore, SessionExpiredError

log = logging.getLogger(__name__)
T = TypeVar("T")

STARTUP_TIMEOUT_MS_DEFAULT = 60_000
CONNECT_TIMEOUT_MS = 5_000  # one connect try; a ZooKeeper that accepts but never answers is tried again after it
# The errors after which a step is simply tried again. kazoo's time-outs are
# ConnectionLossError too. Anything else (a refused cookie, a bad address) is
# not ZooKeeper being slow or away, and ends start-up at once.
RETRYABLE: tuple[type[Exception], ...] = (ConnectionLossError, SessionExpiredError)
# The deadline is what normally ends the retries; `tries_max` only keeps a
# step that fails at once, again and again, from looping without bound.
STARTUP_RETRY = RetryPolicy(tries_max=1_000, delay_initial_ms=100.0, delay_max_ms=2_000.0)


class StartupFailedError(Exception):
    """Start-up failed; the message is one line for the operator, naming
    the step that failed and why."""


class StartupTimeoutError(StartupFailedError):
    """Start-up did not finish within its deadline; the message names the
    step that was still going."""


def human_ms(duration_ms: float) -> str:
    seconds = duration_ms / 1000
    return f"{seconds:.0f}s" if seconds == int(seconds) else f"{seconds:.1f}s"


class Startup:
    """The deadline and the current step of one process's start-up.

    Make it inside `trio.run`; run the start-up inside `with
    startup.deadline():`, each ZooKeeper step through `step` (or announce a
    step that retries by itself with `begin`), local work that may take long
    (journal replay) inside `with startup.paused():` so that it does not
    count, and call `finish()` once the process serves: from then on the
    deadline is off."""

    def __init__(
        self,
        what: str,
        timeout_ms: int,
        *,
        policy: RetryPolicy = STARTUP_RETRY,
        rng: random.Random | None = None,
    ) -> None:
        if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or timeout_ms <= 0:
            raise ValueError(f"the start-up timeout must be a positive number of milliseconds, got {timeout_ms!r}")
        self.what = what
        self.timeout_ms = timeout_ms
        self.policy = policy
        self.rng = rng if rng is not None else random.Random()
        self.scope = trio.CancelScope(deadline=trio.current_time() + timeout_ms / 1000)
        self.step_name = "start"
        self.last_error: BaseException | None = None
        self._detail: Callable[[], str | None] | None = None
        self.finished = False
        self.failed = False  # a `wait_for` reached the deadline
        self.refusal: str | None = None  # why a step failed for good (`refuse`)

    # --- the deadline -----------------------------------------------------------------------

    @contextlib.contextmanager
    def deadline(self) -> Iterator["Startup"]:
        """Run start-up; raise StartupTimeoutError if the deadline passes
        before `finish()`, StartupFailedError if a step was refused."""
        with self.scope:
            yield self
        if self.refusal is not None:
            raise StartupFailedError(self.refusal)
        if self.scope.cancelled_caught or self.failed:
            raise StartupTimeoutError(self.failure_message())

    def remaining_ms(self) -> float:
        return max(0.0, (self.scope.deadline - trio.current_time()) * 1000)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Local work that does not wait for ZooKeeper (replaying a large
        journal): its time is added to the deadline, so that a slow disk is
        never reported as a ZooKeeper that did not answer."""
        if self.finished:
            yield
            return
        deadline = self.scope.deadline
        started = trio.current_time()
        self.scope.deadline = math.inf
        try:
            yield
        finally:
            if not self.finished:
                self.scope.deadline = deadline + (trio.current_time() - started)

    def finish(self) -> None:
        """Start-up is over: the deadline no longer applies."""
        self.finished = True
        self.scope.deadline = math.inf
        log.debug("%s started", self.what)

    def failure_message(self) -> str:
        reason = self._detail() if self._detail is not None else None
        if reason is None and self.last_error is not None:
            reason = str(self.last_error) or type(self.last_error).__name__
        if reason is None:
            reason = "ZooKeeper did not answer"
        return (
            f"{self.what} did not start within {human_ms(self.timeout_ms)} (--startup-timeout): "
            f"could not {self.step_name}" + (f": {reason}" if reason else "")
        )

    def refused_message(self, error: BaseException, step_name: str | None = None) -> str:
        """One line: start-up failed at the step under way (or `step_name`) for `error`."""
        reason = str(error) or type(error).__name__
        return f"{self.what} did not start: could not {step_name or self.step_name}: {reason}"

    def refuse(self, error: BaseException) -> None:
        """The step under way failed for good, with an error that waiting
        would not cure; for a caller that must first stop what already runs
        (as after `wait_for`). `deadline()` raises StartupFailedError at its
        end; the deadline no longer cuts the clean stop short."""
        self.refusal = self.refused_message(error)
        self.scope.deadline = math.inf

    # --- steps ------------------------------------------------------------------------------

    def begin(self, name: str, *, detail: Callable[[], str | None] | None = None) -> None:
        """Name the step now under way (one that retries by itself).
        `detail`, if given, explains at the deadline why it is not done
        (None: the last error does; "": the step's name says enough)."""
        self.step_name = name
        self.last_error = None
        self._detail = detail

    async def step(
        self,
        name: str,
        call: Callable[[], Awaitable[T]],
        *,
        detail: Callable[[], str | None] | None = None,
        retry_on: tuple[type[Exception], ...] = RETRYABLE,
    ) -> T:
        """`await call()` until it returns, trying again after the errors of
        `retry_on` with backoff and jitter, until the deadline. Any other
        ZooKeeper error ends start-up at once (StartupFailedError naming
        the step); any other error propagates as it is."""
        self.begin(name, detail=detail)
        delays_ms = self.policy.iter_delays_ms(self.rng)
        while True:
            try:
                return await call()
            except retry_on as error:
                self.last_error = error
                delay_ms = next(delays_ms, None)
                if delay_ms is None:
                    raise StartupTimeoutError(
                        f"{self.what} did not start: could not {name} after {self.policy.tries_max} tries: {error}"
                    ) from None
                log.warning("start-up: could not %s (%s); trying again in %.1fs", name, error, delay_ms / 1000)
                await trio.sleep(delay_ms / 1000)
            except MetadataError as error:
                # Not ZooKeeper slow or away: trying again would only wait
                # out the deadline for the same answer.
                raise StartupFailedError(self.refused_message(error, name)) from None

    async def wait_for(
        self, name: str, call: Callable[[], Awaitable[object]], *, detail: Callable[[], str | None] | None = None
    ) -> bool:
        """Run `call` (a wait whose work retries by itself) as a step; True
        once it returns. When the deadline passes first, return False rather
        than cancel the whole start-up, for a caller that must first stop
        what already runs (a bookie server draining its journal); `deadline()`
        then reports the failure at its end. The deadline is off from then on."""
        self.begin(name, detail=detail)
        deadline, self.scope.deadline = self.scope.deadline, math.inf
        with trio.move_on_at(deadline):
            await call()
            self.scope.deadline = deadline
            return True
        self.failed = True
        return False

    async def connect(self, zk_hosts: str, root: str, *, session_timeout_ms: int) -> MetadataStore:
        """A connected kazoo store; each try is a new client (so a new
        session) and waits at most `CONNECT_TIMEOUT_MS`, or what is left of
        the deadline. A malformed address raises ValueError at once."""
        # Imported here, as in async_store: code using the in-memory store
        # only (the simulator) does not load kazoo.
        from coordination.zk_store import KazooMetadataStore

        async def connect_once() -> MetadataStore:
            connect_timeout_ms = max(1, min(CONNECT_TIMEOUT_MS, math.ceil(self.remaining_ms())))
            return await _connect_abandonably(
                functools.partial(
                    KazooMetadataStore.connect, zk_hosts, root,
                    session_timeout_ms=session_timeout_ms, connect_timeout_ms=connect_timeout_ms,
                )
            )

        def detail() -> str | None:
            # The step's name says it all when no server answered in time.
            return "" if isinstance(self.last_error, ConnectionLossError) else None

        return await self.step(f"reach ZooKeeper at {zk_hosts}", connect_once, detail=detail)


async def _connect_abandonably(connect: Callable[[], MetadataStore]) -> MetadataStore:
    """`connect()` on a worker thread that the deadline may abandon.

    Connecting is bounded by its connect timeout, but making the chroot on
    the way is a store call, which kazoo retries for several session
    timeouts while ZooKeeper does not answer: too long to hold the deadline
    up. A store that connects after its caller was cancelled is closed, so
    that no session (and no kazoo thread) is left behind."""
    lock = threading.Lock()
    state: dict[str, object] = {}

    def run() -> MetadataStore:
        store = connect()
        with lock:
            orphan = "abandoned" in state
            state["store"] = store
        if orphan:
            store.close()
        return store

    try:
        return await trio.to_thread.run_sync(run, abandon_on_cancel=True)
    except trio.Cancelled:
        with lock:
            state["abandoned"] = True
            store = state.get("store")
        if store is not None:
            # Connected, but its result never reached us: close it off the loop.
            threading.Thread(target=store.close, name="zk-close-abandoned", daemon=True).start()
        raise


__all__ = [
    "CONNECT_TIMEOUT_MS",
    "RETRYABLE",
    "STARTUP_RETRY",
    "STARTUP_TIMEOUT_MS_DEFAULT",
    "Startup",
    "StartupFailedError",
    "StartupTimeoutError",
]
