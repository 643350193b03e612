"""CI's sample of the slow tests stays within its number and its time."""

from types import SimpleNamespace

import pytest

from tests.conftest import SLOW_SECONDS_UNKNOWN, choose_slow, expected_seconds


def slow_test(name: str, **kwargs):
    marker = SimpleNamespace(kwargs=kwargs)
    return SimpleNamespace(name=name, get_closest_marker=lambda mark: marker if mark == "slow" else None)


TESTS = [slow_test("fuzz", seconds=380), slow_test("jepsen", seconds=220), slow_test("sim", seconds=110),
         slow_test("disk", seconds=230), slow_test("unsaid")]


@pytest.mark.parametrize("seed", [f"2026-12-{day:02}" for day in range(1, 29)])
def test_a_sample_keeps_to_its_number_and_its_budget(seed):
    chosen = choose_slow(TESTS, 2, seed, 400)
    assert 1 <= len(chosen) <= 2 and sum(map(expected_seconds, chosen)) <= 400
    assert all(test.name != "unsaid" for test in chosen)  # an unknown time counts as SLOW_SECONDS_UNKNOWN
    assert choose_slow(TESTS, 2, seed, 400) == chosen  # the seed decides


def test_without_a_budget_the_number_alone_bounds_the_sample():
    assert len(choose_slow(TESTS, 3, "any", float("inf"))) == 3
    assert expected_seconds(slow_test("unsaid")) == SLOW_SECONDS_UNKNOWN


def test_every_test_is_drawn_on_some_day():
    drawn = {test.name for day in range(1, 29) for test in choose_slow(TESTS, 2, f"2026-12-{day:02}", 400)}
    assert drawn == {"fuzz", "jepsen", "sim", "disk"}
