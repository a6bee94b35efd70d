from datetime import UTC, datetime, timedelta

import pytest

from airflow_delay_provider.core.delays import MAX_DELAY_SECONDS, DelayError, resolve_delay, seconds_until, to_seconds


@pytest.mark.parametrize(
    ("message", "queue", "expected"),
    [
        (30, 600, 30),  # Message1 of the queue-level example: the message-level delay wins
        (1200, 600, 1200),  # Message2
        (None, 600, 600),  # Message3: the queue-level delay applies
        (0, 600, 600),
        (0, 0, 0),
        (None, None, 0),
        (5, None, 5),
        (MAX_DELAY_SECONDS, 0, MAX_DELAY_SECONDS),
        (0, MAX_DELAY_SECONDS, MAX_DELAY_SECONDS),
    ],
)
def test_resolve_delay_message_level_wins_over_queue_level(message, queue, expected):
    assert resolve_delay(message, queue) == expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"message_delay": -1}, "message_delay"),
        ({"message_delay": MAX_DELAY_SECONDS + 1}, "message_delay"),
        ({"message_delay": True}, "message_delay"),
        ({"message_delay": 1.5}, "message_delay"),
        ({"message_delay": "10"}, "message_delay"),
        ({"queue_delay": -5}, "queue_delay"),
        ({"queue_delay": 10**9}, "queue_delay"),
        ({"queue_delay": False}, "queue_delay"),
        ({"message_delay": 10, "queue_delay": 2.0}, "queue_delay"),
    ],
)
def test_resolve_delay_rejects_bad_values_naming_field_and_range(kwargs, field):
    with pytest.raises(DelayError) as err:
        resolve_delay(**kwargs)
    assert isinstance(err.value, ValueError)
    assert field in str(err.value)
    assert "604800" in str(err.value)


def test_to_seconds_rounds_fractions_up():
    assert to_seconds(timedelta(seconds=1, microseconds=1)) == 2
    assert to_seconds(0.2) == 1
    assert to_seconds(3) == 3
    assert to_seconds("2.5") == 3
    assert to_seconds(timedelta(0)) == 0


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), "soon", True, [1]])
def test_to_seconds_rejects(bad):
    with pytest.raises(DelayError):
        to_seconds(bad)


def test_seconds_until_rounds_up_and_past_means_now():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert seconds_until(now + timedelta(seconds=10, milliseconds=1), now) == 11
    assert seconds_until(now - timedelta(hours=3), now) == 0
    with pytest.raises(DelayError, match="timezone"):
        seconds_until(datetime(2026, 1, 1), now)
