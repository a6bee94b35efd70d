"""Delay rules: message-level vs queue-level delays, and turning durations into whole seconds."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

from airflow_delay_provider.core.errors import DelayError

__all__ = ["MAX_DELAY_SECONDS", "DelayError", "resolve_delay", "seconds_until", "to_seconds", "whole_seconds"]

#: `datetime.UTC` is Python 3.11's name for it.
UTC = timezone.utc

#: Both levels accept 0..604,800 seconds (7 days), as SQS-style queue- and message-level delays do.
MAX_DELAY_SECONDS = 604_800


def _check(field: str, value: object) -> int | None:
    if value is None:
        return None
    # bool is an int subclass; True as "1 second" is a bug, not a delay.
    if isinstance(value, bool) or not isinstance(value, int):
        raise DelayError(
            f"{field} must be an int number of seconds in 0..{MAX_DELAY_SECONDS} or None, "
            f"got {type(value).__name__} {value!r}"
        )
    if not 0 <= value <= MAX_DELAY_SECONDS:
        raise DelayError(f"{field} must be in 0..{MAX_DELAY_SECONDS} seconds (7 days), got {value}")
    return value


def resolve_delay(
    message_delay: int | None = None,
    queue_delay: int | None = None,
    message_field: str = "message_delay",
    queue_field: str = "queue_delay",
) -> int:
    """The delay that applies: a message-level delay > 0 wins, else a queue-level delay > 0, else 0.

    Errors name `message_field` and `queue_field`: the arguments the caller's user actually set."""
    message = _check(message_field, message_delay)
    queue = _check(queue_field, queue_delay)
    if message:
        return message
    if queue:
        return queue
    return 0


def to_seconds(delay: int | float | timedelta, field: str = "delay_seconds") -> int:
    """Whole seconds of a delay, fractions rounded up (a message is never delivered early)."""
    if isinstance(delay, bool):
        raise DelayError(f"{field} must be a number of seconds or a timedelta, got bool {delay!r}")
    if isinstance(delay, timedelta):
        delay = delay.total_seconds()
    if isinstance(delay, str):
        try:
            delay = float(delay)  # templated fields render to strings
        except ValueError:
            raise DelayError(f"{field} must be a number of seconds or a timedelta, got {delay!r}") from None
    # No float conversion of an int: math.isnan(10**400) raises OverflowError.
    if not isinstance(delay, (int, float)) or isinstance(delay, float) and not math.isfinite(delay):
        raise DelayError(f"{field} must be a finite number of seconds or a timedelta, got {delay!r}")
    if delay < 0:
        raise DelayError(f"{field} must be in 0..{MAX_DELAY_SECONDS} seconds, got {delay}")
    return math.ceil(delay)


def whole_seconds(delay: object, field: str = "delay_seconds", negative_is_now: bool = False) -> int:
    """A broker's delay in whole seconds, rounded up (never early): a finite int or float; a negative
    one is now (0) where `negative_is_now` (a due time already past), else an error."""
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) \
            or isinstance(delay, float) and not math.isfinite(delay):
        raise DelayError(f"{field} must be a finite number of seconds, got {delay!r}")
    if delay < 0:
        if negative_is_now:
            return 0
        raise DelayError(f"{field} must be >= 0, got {delay}")
    return math.ceil(delay)


def seconds_until(deliver_at: datetime, now: datetime) -> int:
    """Whole seconds from now until deliver_at, rounded up; a time in the past means 0 (deliver now)."""
    if deliver_at.tzinfo is None:
        raise DelayError(f"deliver_at must be timezone-aware (UTC), got naive {deliver_at.isoformat()}")
    return max(0, math.ceil((deliver_at - now).total_seconds()))


def utcnow() -> datetime:
    return datetime.now(UTC)
