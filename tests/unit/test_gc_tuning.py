"""Bookies and brokers make Python's full garbage collections rare (their
pauses delayed every message in flight): the thresholds they run with, and
the start-up objects frozen out of every scan."""

from __future__ import annotations

import subprocess
import sys


def test_tune_gc_raises_the_thresholds_and_freezes_what_start_up_made():
    code = ("import gc; from quire.gc_tuning import tune_gc, GEN0_ALLOCATIONS, GEN1_COLLECTIONS, GEN2_COLLECTIONS;"
            "tune_gc(); assert gc.get_threshold() == (GEN0_ALLOCATIONS, GEN1_COLLECTIONS, GEN2_COLLECTIONS);"
            "assert gc.get_freeze_count() > 1_000, gc.get_freeze_count(); print('ok')")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert completed.stdout.strip() == "ok", completed.stderr

