"""Keeping trio's exception groups away from callers of our context managers.

A client's `async with X.connect(...) as client:` body runs inside the
client's nursery, so trio wraps whatever the body raises in an
ExceptionGroup. The client's own tasks never raise, so a group of one is
just the body's exception: hand it back unwrapped."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def unwrap_single_exception() -> Iterator[None]:
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
