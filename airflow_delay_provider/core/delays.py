"""Delay rules: message-level vs queue-level delays, and turning durations into whole seconds."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_delay_provider.core.errors import DelayError

__all__ = ["LONGEST_MAX_DELAY_SECONDS", "MAX_DELAY_SECONDS", "DelayError", "DelayLimits", "check_max_delay",
           "resolve_delay", "seconds_until", "to_seconds", "whole_seconds"]

#: `datetime.UTC` is Python 3.11's name for it.
UTC = timezone.utc

#: The longest delay unless a connection says otherwise: 0..604,800 seconds (7 days), as SQS-style queue- and
#: message-level delays take.
MAX_DELAY_SECONDS = 604_800
#: The most a connection's `max_delay_seconds` may allow: ten years of 365.25 days.
LONGEST_MAX_DELAY_SECONDS = 315_576_000


def describe_seconds(seconds: int) -> str:
    """A limit as people say it: "7 days", "365 days", "10 years"."""
    days = seconds / 86_400
    if seconds % 31_557_600 == 0:
        return f"{seconds // 31_557_600} year{'s' if seconds != 31_557_600 else ''}"
    return f"{days:g} days" if days >= 1 else f"{seconds} s"


def check_max_delay(value: object, field: str = "max_delay_seconds") -> int:
    """A longest delay: a whole number of seconds in 1..LONGEST_MAX_DELAY_SECONDS (ten years)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LONGEST_MAX_DELAY_SECONDS:
        raise DelayError(f"{field} must be a whole number of seconds in 1..{LONGEST_MAX_DELAY_SECONDS} (ten years), "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class DelayLimits:
    """The longest delay of each destination: `default`, or the destination's own in `destinations`."""

    default: int = MAX_DELAY_SECONDS
    destinations: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, default: object = None, destinations: object = None, where: str = "") -> DelayLimits:
        """From a connection's extras: `max_delay_seconds` and `max_delay_seconds_per_destination` (an object of
        destination names to seconds); errors name them, prefixed by `where`."""
        longest = MAX_DELAY_SECONDS if default in (None, "") else check_max_delay(default, f"{where}max_delay_seconds")
        if destinations in (None, ""):
            return cls(longest)
        if isinstance(destinations, str):
            import json

            try:
                destinations = json.loads(destinations)
            except ValueError:
                destinations = None
        name = f"{where}max_delay_seconds_per_destination"
        if not isinstance(destinations, Mapping) or not all(isinstance(k, str) and k for k in destinations):
            raise DelayError(f"{name} must be an object of destination names to seconds, got {destinations!r}")
        return cls(longest, {k: check_max_delay(v, f"{name}[{k!r}]") for k, v in destinations.items()})

    def of(self, destination: object) -> int:
        return self.destinations.get(destination, self.default) if isinstance(destination, str) else self.default

    @property
    def longest(self) -> int:
        return max([self.default, *self.destinations.values()])

    def to_dict(self) -> dict[str, Any]:
        return {"max_delay_seconds": self.default, "max_delay_seconds_per_destination": dict(self.destinations)}


def _check(field: str, value: object, limit: int = MAX_DELAY_SECONDS) -> int | None:
    if value is None:
        return None
    # bool is an int subclass; True as "1 second" is a bug, not a delay.
    if isinstance(value, bool) or not isinstance(value, int):
        raise DelayError(
            f"{field} must be an int number of seconds in 0..{limit} or None, "
            f"got {type(value).__name__} {value!r}"
        )
    if not 0 <= value <= limit:
        raise DelayError(f"{field} must be in 0..{limit} seconds ({describe_seconds(limit)}), got {value}"
                         + (_RAISE_IT if limit < LONGEST_MAX_DELAY_SECONDS and value <= LONGEST_MAX_DELAY_SECONDS
                            else ""))
    return value


#: How a delay longer than the limit may be allowed, said where the limit is the connection's.
_RAISE_IT = ("; the store connection's max_delay_seconds (or max_delay_seconds_per_destination) extra allows up to "
             f"{LONGEST_MAX_DELAY_SECONDS} s (ten years)")


def resolve_delay(
    message_delay: int | None = None,
    queue_delay: int | None = None,
    message_field: str = "message_delay",
    queue_field: str = "queue_delay",
    limit: int = MAX_DELAY_SECONDS,
) -> int:
    """The delay that applies: a message-level delay > 0 wins, else a queue-level delay > 0, else 0; each at most
    `limit` seconds (the destination's longest delay, see DelayLimits).

    Errors name `message_field` and `queue_field`: the arguments the caller's user actually set."""
    message = _check(message_field, message_delay, limit)
    queue = _check(queue_field, queue_delay, limit)
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
        raise DelayError(f"{field} must be >= 0 seconds, got {delay}")
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


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def to_us(moment: datetime) -> int:
    """Microseconds since the epoch (UTC), as the store keeps times."""
    return (moment - EPOCH) // _US  # integer arithmetic: exact, unlike timestamp() floats


def from_us(us: int) -> datetime:
    return EPOCH + us * _US


def utcnow() -> datetime:
    return datetime.now(UTC)
