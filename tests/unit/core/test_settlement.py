"""The one settlement rule for a failed delivery: retry when, dead-letter when, with which headers."""

from datetime import UTC, datetime, timedelta

import pytest

from airflow_delay_provider.core.message import (
    HEADER_FAILED_DESTINATION,
    HEADER_FAILURE_REASON,
    HEADER_FAILURES,
    HEADER_FIRST_FAILED_AT,
    HEADER_GAVE_UP,
    DelayedMessage,
)
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.core.settlement import DeadLetter, Retry, settle_failure

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
POLICY = DeliveryPolicy(min_delay_target=10, max_delay_target=100, num_retries=3, backoff_function="exponential")


def message(failures: int = 0, headers: dict | None = None) -> DelayedMessage:
    return DelayedMessage("orders", b"x", NOW - timedelta(seconds=5), headers or {"k": "v"}, "m-1", failures)


def test_a_failure_within_the_retries_is_stored_again_after_the_policys_backoff():
    for failures in range(POLICY.num_retries):
        outcome = settle_failure(message(failures), "boom", POLICY, "error", NOW, jitter=0.0)
        assert isinstance(outcome, Retry)
        assert outcome.at == NOW + timedelta(seconds=POLICY.delay_before(failures + 1))


def test_the_first_failure_records_its_time_and_later_ones_keep_it():
    first = settle_failure(message(0), "boom", POLICY, "error", NOW, jitter=0.0)
    assert first.headers == {"k": "v", HEADER_FIRST_FAILED_AT: NOW.isoformat()}
    earlier = (NOW - timedelta(minutes=3)).isoformat()
    later = settle_failure(message(1, {"k": "v", HEADER_FIRST_FAILED_AT: earlier}), "boom", POLICY, "error", NOW,
                           jitter=0.0)
    assert isinstance(later, Retry) and later.headers is None  # the stored headers stay as they are


def test_the_attempt_after_the_last_retry_is_dead_lettered_with_where_when_and_why():
    outcome = settle_failure(message(POLICY.num_retries), "ValueError: boom", POLICY, "error", NOW, jitter=0.0)
    assert isinstance(outcome, DeadLetter)
    dead = outcome.message
    assert (dead.destination, dead.message_id, dead.body, dead.failures) == ("error", "m-1", b"x", 4)
    assert dead.headers[HEADER_FAILED_DESTINATION] == "orders"
    assert dead.headers[HEADER_FAILURE_REASON] == "ValueError: boom (after 4 attempt(s))"
    assert dead.headers[HEADER_FAILURES] == "4"
    assert dead.headers[HEADER_GAVE_UP] == "backoff phase: all 3 retries used (4 attempts)"
    assert dead.headers["k"] == "v"


def test_a_final_failure_is_dead_lettered_at_once_whatever_the_policy():
    outcome = settle_failure(message(0), "destination not found: gone", POLICY, "dlq", NOW, jitter=0.1, final=True)
    assert isinstance(outcome, DeadLetter)
    assert outcome.message.destination == "dlq"
    assert outcome.message.headers[HEADER_FAILURE_REASON] == "destination not found: gone (after 1 attempt(s))"
    assert outcome.message.headers[HEADER_GAVE_UP] == "final failure: not retried"


@pytest.mark.parametrize(("policy", "phases", "gave_up"), [
    (dict(num_retries=0), [], "the policy allows no retries"),
    (dict(num_retries=7, num_no_delay_retries=1, num_min_delay_retries=2, num_max_delay_retries=2),
     ["immediate", "pre-backoff", "pre-backoff", "backoff", "backoff", "post-backoff", "post-backoff"],
     "post-backoff phase: all 7 retries used (8 attempts)"),
    (dict(num_retries=2, num_no_delay_retries=2), ["immediate", "immediate"],
     "immediate phase: all 2 retries used (3 attempts)"),
])
def test_a_dead_letter_says_which_phase_of_its_policy_gave_up(policy, phases, gave_up):
    p = DeliveryPolicy(min_delay_target=1, max_delay_target=60, **policy)
    assert [p.phase_of(n) for n in range(1, p.num_retries + 1)] == phases
    outcome = settle_failure(message(p.num_retries), "boom", p, "error", NOW, jitter=0.0)
    assert outcome.message.headers[HEADER_GAVE_UP] == gave_up


def test_the_jitter_is_the_same_for_the_same_message_and_attempt():
    def at(mid: str, failures: int) -> datetime:
        m = DelayedMessage("orders", b"x", NOW, {}, mid, failures)
        outcome = settle_failure(m, "boom", POLICY, "error", NOW, jitter=0.5)
        assert isinstance(outcome, Retry)
        return outcome.at

    assert at("m-1", 1) == at("m-1", 1)  # a batch settled again retries at the same time
    spread = {at(f"m-{i}", 1) for i in range(20)}
    assert len(spread) > 10  # different messages are spread out
    base = NOW + timedelta(seconds=POLICY.delay_before(2))
    assert all(abs((t - base).total_seconds()) <= 0.5 * POLICY.delay_before(2) + 1e-6 for t in spread)
