"""Test-run policy shared by every suite: with QUIRE_SLOW_SAMPLE=N (CI sets
it), run the default suite plus N of the tests marked slow, chosen by
QUIRE_SLOW_SEED (default: today's date, so a day's runs agree)."""

from __future__ import annotations

import datetime
import os
import random


def _sample_settings() -> tuple[int, str] | None:
    sample = os.environ.get("QUIRE_SLOW_SAMPLE")
    if not sample:
        return None
    seed = os.environ.get("QUIRE_SLOW_SEED") or datetime.date.today().isoformat()
    return int(sample), seed


def pytest_report_header(config):
    settings = _sample_settings()
    if settings:
        return f"slow tests: a sample of {settings[0]} (QUIRE_SLOW_SEED={settings[1]})"
    return None


def pytest_collection_modifyitems(config, items):
    settings = _sample_settings()
    if settings is None:
        return
    count, seed = settings
    slow = [item for item in items if item.get_closest_marker("slow")]
    chosen = set(random.Random(seed).sample(slow, min(count, len(slow))))
    deselected = [item for item in slow if item not in chosen]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]
