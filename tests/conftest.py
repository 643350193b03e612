"""Test-run policy shared by every suite: with QUIRE_SLOW_SAMPLE=N (CI sets
it), run the default suite plus at most N of the tests marked slow, chosen
by QUIRE_SLOW_SEED (default: today's date, so a day's runs agree), whose
expected times (`@pytest.mark.slow(seconds=S)`, as measured on a 2-core CI
machine) add up to at most QUIRE_SLOW_BUDGET_S (default: no bound): the
sample is drawn in the seed's order, passing over a test that would go
past the budget."""

from __future__ import annotations

import datetime
import os
import random

SLOW_SECONDS_UNKNOWN = 600.0  # a slow test that does not say how long it takes


def _sample_settings() -> tuple[int, str, float] | None:
    sample = os.environ.get("QUIRE_SLOW_SAMPLE")
    if not sample:
        return None
    seed = os.environ.get("QUIRE_SLOW_SEED") or datetime.date.today().isoformat()
    budget = os.environ.get("QUIRE_SLOW_BUDGET_S")
    return int(sample), seed, float(budget) if budget else float("inf")


def pytest_report_header(config):
    settings = _sample_settings()
    if settings:
        count, seed, budget = settings
        bound = "" if budget == float("inf") else f", at most {budget:g} s of them (QUIRE_SLOW_BUDGET_S)"
        return f"slow tests: a sample of {count}{bound} (QUIRE_SLOW_SEED={seed})"
    return None


def expected_seconds(item) -> float:
    return float(item.get_closest_marker("slow").kwargs.get("seconds", SLOW_SECONDS_UNKNOWN))


def choose_slow(slow: list, count: int, seed: str, budget_s: float) -> list:
    """At most `count` of the slow tests, in the seed's order, whose expected
    seconds add up to at most `budget_s`."""
    chosen, spent = [], 0.0
    for item in random.Random(seed).sample(slow, len(slow)):
        if len(chosen) == count:
            break
        if spent + expected_seconds(item) <= budget_s:
            chosen.append(item)
            spent += expected_seconds(item)
    return chosen


def pytest_collection_modifyitems(config, items):
    settings = _sample_settings()
    if settings is None:
        return
    count, seed, budget_s = settings
    slow = [item for item in items if item.get_closest_marker("slow")]
    chosen = set(choose_slow(slow, count, seed, budget_s))
    deselected = [item for item in slow if item not in chosen]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]
