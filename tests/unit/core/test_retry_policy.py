import random

import pytest

from airflow_delay_provider.core.retry_policy import BACKOFF_FUNCTIONS, DeliveryPolicy, PolicyError
from airflow_delay_provider.core.throttle import TokenBucket

SEED_EXAMPLE = {
    "healthyRetryPolicy": {"minDelayTarget": 1, "maxDelayTarget": 60, "numRetries": 50, "numNoDelayRetries": 3,
                           "numMinDelayRetries": 2, "numMaxDelayRetries": 35, "backoffFunction": "exponential"},
    "throttlePolicy": {"maxReceivesPerSecond": 10},
}


def test_documented_example_phases():
    p = DeliveryPolicy.from_dict(SEED_EXAMPLE)
    d = p.retry_delays()
    assert len(d) == p.total_attempts == 50
    assert d[:3] == [0, 0, 0] and d[3:5] == [1, 1]
    assert d[5] == 1 and d[14] == 60 and len(d[5:15]) == 10
    assert d[15:] == [60] * 35
    assert [p.delay_before(i + 1) for i in range(50)] == d
    assert p.max_receives_per_second == 10
    assert DeliveryPolicy.from_dict(p.to_dict()) == p and p.to_dict() == SEED_EXAMPLE
    assert "backoff" in p.phase_table() and "10/s" in p.phase_table()


def test_defaults_for_missing_attributes():
    p = DeliveryPolicy.from_dict({})
    assert (p.min_delay_target, p.max_delay_target, p.num_retries, p.backoff_function) == (20, 20, 3, "linear")
    assert p.retry_delays() == [20, 20, 20] and p.max_receives_per_second is None
    assert DeliveryPolicy.from_dict({"healthyRetryPolicy": {"numRetries": 5}}).retry_delays() == [20] * 5


def test_builtin_policies():
    sqs = DeliveryPolicy.for_endpoint("sqs")
    assert sqs.total_attempts == 100_015 and sqs.num_backoff_retries == 10
    assert 23 * 86400 < sqs.total_duration() < 24 * 86400
    assert DeliveryPolicy.for_endpoint("lambda") == sqs
    smtp = DeliveryPolicy.for_endpoint("smtp")
    assert smtp.total_attempts == 50 and 6 * 3600 < smtp.total_duration() < 7 * 3600
    assert smtp.retry_delays()[:2] == [10, 10] and smtp.retry_delays()[-38:] == [600] * 38
    assert DeliveryPolicy.for_endpoint("http") == DeliveryPolicy()
    with pytest.raises(PolicyError, match="no built-in policy 'fax'"):
        DeliveryPolicy.for_endpoint("fax")


@pytest.mark.parametrize(("retry", "fragment"), [
    ({"numRetries": 101}, "numRetries is 101; allowed: 0..100"),
    ({"numRetries": -1}, "numRetries is -1"),
    ({"minDelayTarget": 30, "maxDelayTarget": 20}, r"minDelayTarget \(30\) is above maxDelayTarget \(20\)"),
    ({"maxDelayTarget": 10}, r"minDelayTarget \(20\) is above maxDelayTarget \(10\).*either one left out is 20 s"),
    ({"minDelayTarget": -1}, "minDelayTarget is -1"),
    ({"maxDelayTarget": 3601}, "maxDelayTarget is 3601; allowed: 0..3600"),
    ({"numNoDelayRetries": -1}, "numNoDelayRetries is -1; allowed: >= 0"),
    ({"numMinDelayRetries": 2, "numMaxDelayRetries": 2}, "is 4; allowed: at most numRetries \\(3\\)"),
    ({"backoffFunction": "cubic"}, "backoffFunction is 'cubic'"),
    ({"numRetries": "3"}, "numRetries must be an integer"),
    ({"delay": 3}, "unknown delivery policy attribute"),
])
def test_each_constraint(retry, fragment):
    with pytest.raises(PolicyError, match=fragment) as err:
        DeliveryPolicy.from_dict({"healthyRetryPolicy": retry})
    assert isinstance(err.value, ValueError)


def test_throttle_constraint_and_shapes_of_input():
    with pytest.raises(PolicyError, match="maxReceivesPerSecond is 0; allowed: >= 1"):
        DeliveryPolicy.from_dict({"throttlePolicy": {"maxReceivesPerSecond": 0}})
    with pytest.raises(PolicyError, match="JSON object"):
        DeliveryPolicy.from_dict([1])
    assert DeliveryPolicy.parse("sms") == DeliveryPolicy.for_endpoint("sms")
    assert DeliveryPolicy.parse('{"healthyRetryPolicy": {"numRetries": 1}}').num_retries == 1
    with pytest.raises(PolicyError, match="not valid JSON"):
        DeliveryPolicy.parse("{nope")
    assert DeliveryPolicy.immediate(2).retry_delays() == [0, 0]


@pytest.mark.parametrize("function", BACKOFF_FUNCTIONS)
def test_backoff_functions_start_at_min_end_at_max_never_decrease(function):
    p = DeliveryPolicy(5, 260, 10, backoff_function=function)
    d = p.retry_delays()
    assert d[0] == 5 and d[-1] == 260
    assert all(a <= b for a, b in zip(d, d[1:], strict=False))
    steps = [b - a for a, b in zip(d, d[1:], strict=False)]
    if function == "linear":
        assert max(steps) - min(steps) < 1e-9
    if function == "exponential":
        ratios = [b / a for a, b in zip(d, d[1:], strict=False)]
        assert max(ratios) - min(ratios) < 1e-9
    if function == "arithmetic":
        second = [b - a for a, b in zip(steps, steps[1:], strict=False)]
        assert max(second) - min(second) < 1e-9 and second[0] > 0  # steps grow by a constant
    if function == "geometric":
        assert all(abs(b / a - 0.5) < 1e-9 for a, b in zip(steps, steps[1:], strict=False))  # each step half the last
    zero_min = DeliveryPolicy(0, 100, 5, backoff_function=function).retry_delays()
    assert zero_min[0] == 0 and zero_min[-1] == 100 and zero_min == sorted(zero_min)


def test_jitter_is_reproducible_and_bounded():
    p = DeliveryPolicy(5, 260, 10, num_no_delay_retries=2, backoff_function="exponential")
    a, b = p.retry_delays(jitter=0.5, seed=7), p.retry_delays(jitter=0.5, seed=7)
    assert a == b and a != p.retry_delays()
    assert a[:2] == [0, 0] and all(5 <= x <= 260 for x in a[2:])
    rng = random.Random(1)
    assert all(5 <= p.jittered(260, 0.9, rng) <= 260 for _ in range(200))


def test_token_bucket_paces_without_blocking():
    now = [0.0]
    bucket = TokenBucket(10, clock=lambda: now[0])
    assert bucket.take_up_to(5) == 1 and bucket.empty()  # starts nearly empty: no opening burst
    now[0] += 0.5
    assert bucket.take_up_to(100) == 5
    now[0] += 10
    assert bucket.take_up_to(100) == 10  # never more than one second's worth
