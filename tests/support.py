"""Helpers shared by the test suites: free ports and waiting for a condition."""

from __future__ import annotations

import socket
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], T], *, deadline_s: float, what: str, poll_s: float = 0.02) -> T:
    """Poll `condition` until it returns something truthy; fail the test with
    `what` once `deadline_s` has passed. Exceptions from `condition` count as
    "not yet" until the deadline, then are re-raised."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            result = condition()
        except Exception:
            if time.monotonic() >= end:
                raise
            result = None
        if result:
            return result
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(poll_s)
