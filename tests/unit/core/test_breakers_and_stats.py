import random

import pytest

from airflow_delay_provider.core.breakers import CircuitBreaker, RateBreaker, call_with_breaker
from airflow_delay_provider.core.errors import CriticalError, UnavailableError
from airflow_delay_provider.core.stats import LatenessHistogram, PumpStats


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_breaker_waits_each_failure_and_trips_after_time_to_trigger():
    clock = FakeClock()
    breaker = CircuitBreaker("fetch", time_to_trigger=30, clock=clock, sleep=clock.sleep)
    for _ in range(30):
        breaker.failure(OSError("down"))
    assert clock.slept == [1.0] * 30
    with pytest.raises(CriticalError, match=r"fetch kept failing for 30 s \(allowed: 30 s\).*OSError: down"):
        breaker.failure(OSError("down"))


def test_a_try_after_nothing_was_tried_for_as_long_as_the_breaker_allows_arms_it_afresh():
    """Failures an hour apart are two failures, not an hour of them; a slow try that starts right after a failure
    (a connection that takes 40 s to time out) still counts from the first."""
    clock = FakeClock()
    breaker = CircuitBreaker("dispatch", time_to_trigger=30, clock=clock, sleep=clock.sleep)
    breaker.failure(OSError("refused"))
    clock.now += 3_600
    breaker.attempt()
    failed_at = clock.now
    breaker.failure(OSError("refused"))  # armed afresh: no CriticalError
    assert breaker.armed_at == failed_at
    breaker.attempt()  # right after the failure's wait
    clock.now += 40  # the try itself takes 40 s
    with pytest.raises(CriticalError, match="kept failing for 41 s"):
        breaker.failure(OSError("timed out"))


def test_breaker_success_disarms():
    clock = FakeClock()
    breaker = CircuitBreaker("dispatch", time_to_trigger=5, clock=clock, sleep=clock.sleep)
    for _ in range(100):
        breaker.failure(OSError())
        breaker.failure(OSError())
        breaker.success()
    assert breaker.armed_at is None


def test_call_with_breaker_retries_only_unavailable():
    clock = FakeClock()
    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) < 3:
            raise UnavailableError("db down")
        return "ok"

    breaker = CircuitBreaker("store", 30, clock=clock, sleep=clock.sleep)
    assert call_with_breaker(breaker, flaky, (UnavailableError,)) == "ok"
    assert len(attempts) == 3
    with pytest.raises(ValueError):
        call_with_breaker(breaker, lambda: int("x"), (UnavailableError,))


def test_rate_breaker_trips_above_max_per_second_times_window():
    clock = FakeClock()
    breaker = RateBreaker("recovery", max_per_second=1, window=30, clock=clock)
    for _ in range(30):
        breaker.failure("x")
    with pytest.raises(CriticalError, match="31 failures within 30 s"):
        breaker.failure("x")
    clock.now += 31  # old failures fall out of the window
    breaker.failure("x")


def test_histogram_percentiles_within_one_percent():
    rng = random.Random(7)
    values = [rng.expovariate(1 / 0.2) for _ in range(5000)]
    h = LatenessHistogram()
    for v in values:
        h.add(v)
    values.sort()
    for p in (50, 90, 99):
        exact = values[int(p / 100 * len(values)) - 1]
        assert exact <= h.percentile(p) * 1.0001 and h.percentile(p) <= exact * 1.0101 + 0.001
    assert h.percentile(100) == max(values)
    assert LatenessHistogram().percentile(50) is None


def test_stats_round_trip_and_merge():
    a, b = PumpStats(dispatched=3, retried=1), PumpStats(dispatched=2, dead_lettered=1, batches=1)
    a.lateness.add(0.5)
    b.lateness.add(1.5)
    a.merge(PumpStats.from_dict(b.to_dict()))
    assert (a.dispatched, a.retried, a.dead_lettered, a.batches, a.lateness.count) == (5, 1, 1, 1, 2)
    assert a.summary()["lateness_max_seconds"] == 1.5
