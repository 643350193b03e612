"""How the long-running processes (bookies and brokers) set Python's
garbage collector. With its defaults, a full collection runs every few
seconds once a process holds many long-lived objects (a broker's delayed
index, its entry cache, its cursors), and each one scans all of them: pauses
of 100-250 ms at 100,000 delayed messages, which delay every message in
flight. Raised thresholds make full collections minutes apart; young
cycles (trio's exceptions and cancel scopes) are still collected by the
young generations, as often as before in time.
"""

from __future__ import annotations

import gc

GEN0_ALLOCATIONS = 50_000  # net allocations between young collections (default 700)
GEN1_COLLECTIONS = 20  # young collections between middle ones (default 10)
GEN2_COLLECTIONS = 100  # middle collections between full ones (default 10), besides CPython's own 25% rule


def tune_gc() -> None:
    """Call once start-up is done: what it made (modules, classes, settings)
    moves to the permanent generation, never scanned again."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_ALLOCATIONS, GEN1_COLLECTIONS, GEN2_COLLECTIONS)


__all__ = ["tune_gc"]
