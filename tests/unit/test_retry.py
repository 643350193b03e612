"""RetryPolicy delays and call_with_retry, driven with a seeded rng and a fake sleep."""

from __future__ import annotations

import random

import pytest

from coordination.retry import RetryPolicy, call_with_retry


class Flaky:
    """Fails with `error` the first `failures` calls, then returns "done"."""

    def __init__(self, failures: int, error: BaseException | None = None) -> None:
        self.failures = failures
        self.error = error if error is not None else ConnectionError("flaky")
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "done"


def test_delays_grow_by_the_backoff_factor_without_jitter():
    policy = RetryPolicy(tries_max=5, delay_initial_ms=100, delay_max_ms=10_000, backoff_factor=2, jitter_ratio=0)
    assert policy.delays_ms(random.Random(1)) == [100, 200, 400, 800]


def test_delays_are_capped_at_delay_max_even_with_jitter():
    policy = RetryPolicy(tries_max=12, delay_initial_ms=100, delay_max_ms=1_000, backoff_factor=3, jitter_ratio=0.5)
    delays = policy.delays_ms(random.Random(7))
    assert len(delays) == 11
    assert max(delays) <= 1_000
    assert delays[-1] >= 500  # the capped base, jittered down by at most half


def test_jitter_stays_within_its_ratio_of_the_base_delay():
    policy = RetryPolicy(tries_max=6, delay_initial_ms=100, delay_max_ms=100_000, backoff_factor=2, jitter_ratio=0.25)
    for seed in range(50):
        delays = policy.delays_ms(random.Random(seed))
        for index, delay in enumerate(delays):
            base = 100 * 2**index
            assert base * 0.75 <= delay <= base * 1.25


def test_delays_are_deterministic_for_a_seed_and_vary_between_seeds():
    policy = RetryPolicy(tries_max=6, jitter_ratio=0.3)
    assert policy.delays_ms(random.Random(42)) == policy.delays_ms(random.Random(42))
    assert policy.delays_ms(random.Random(42)) != policy.delays_ms(random.Random(43))


def test_success_after_failures_sleeps_the_policy_delays():
    policy = RetryPolicy(tries_max=4, delay_initial_ms=100, delay_max_ms=1_000, jitter_ratio=0.2)
    slept: list[float] = []
    flaky = Flaky(failures=2)
    result = call_with_retry(flaky, policy, retry_on=(ConnectionError,), sleep=slept.append, rng=random.Random(3))
    assert result == "done"
    assert flaky.calls == 3
    assert slept == [delay_ms / 1000 for delay_ms in policy.delays_ms(random.Random(3))[:2]]


def test_tries_are_bounded_and_the_last_error_is_raised():
    policy = RetryPolicy(tries_max=3, delay_initial_ms=1, delay_max_ms=1)
    errors = iter([ConnectionError("first"), ConnectionError("second"), ConnectionError("third")])

    def always_fails():
        raise next(errors)

    slept: list[float] = []
    with pytest.raises(ConnectionError, match="third"):
        call_with_retry(always_fails, policy, retry_on=(ConnectionError,), sleep=slept.append, rng=random.Random(0))
    assert len(slept) == 2


def test_other_errors_are_not_retried():
    flaky = Flaky(failures=5, error=KeyError("not retryable"))
    slept: list[float] = []
    with pytest.raises(KeyError):
        call_with_retry(flaky, RetryPolicy(), retry_on=(ConnectionError,), sleep=slept.append)
    assert flaky.calls == 1 and slept == []


def test_a_single_try_policy_never_sleeps():
    flaky = Flaky(failures=1)
    with pytest.raises(ConnectionError):
        call_with_retry(flaky, RetryPolicy(tries_max=1), retry_on=(ConnectionError,), sleep=pytest.fail)
    assert flaky.calls == 1


@pytest.mark.parametrize(
    "arguments",
    [
        {"tries_max": 0},
        {"delay_initial_ms": -1},
        {"delay_initial_ms": 500, "delay_max_ms": 100},
        {"backoff_factor": 0.5},
        {"jitter_ratio": 1.5},
    ],
)
def test_nonsense_policies_are_refused(arguments):
    with pytest.raises(ValueError):
        RetryPolicy(**arguments)


def test_retry_on_must_name_something():
    with pytest.raises(ValueError):
        call_with_retry(lambda: 1, RetryPolicy(), retry_on=())
