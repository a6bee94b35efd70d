"""Turning a send request (as a DAG author writes it, possibly rendered from templates) into messages."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Callable, Mapping

from airflow_delay_provider.core.delays import resolve_delay, seconds_until, to_seconds
from airflow_delay_provider.core.errors import DelayError, InvalidInputError
from airflow_delay_provider.core.message import DelayedMessage

#: The keys a message of a batch may have; anything else is a typo worth an error.
MESSAGE_FIELDS = frozenset({"destination", "body", "headers", "delay_seconds", "deliver_at", "message_id"})


def parse_moment(value: Any, field: str = "deliver_at") -> datetime | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise DelayError(f"{field} must be an ISO-8601 timestamp with a timezone, got {value!r}") from None
    if not isinstance(value, datetime):
        raise DelayError(f"{field} must be a datetime or an ISO-8601 string, got {type(value).__name__}")
    if value.tzinfo is None:
        raise DelayError(f"{field} must carry a timezone (for example 2026-01-31T12:00:00+00:00), got {value.isoformat()}")
    return value


def parse_int(value: Any, field: str) -> int | None:
    """Rendered templates are strings: accept "600" for 600, and leave range checks to resolve_delay."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise DelayError(f"{field} must be an integer number of seconds, got {value!r}") from None
    return value


def build_message(
    item: Mapping[str, Any],
    now: datetime,
    queue_delay_seconds: Any = None,
    default_id: Callable[[], str] | None = None,
    where: str = "",
    queue_delays: Mapping[str, int] | None = None,
) -> DelayedMessage:
    """A message from a send request's fields; errors name the field as the user wrote it, prefixed
    by `where` (e.g. "messages[2].") for a message of a batch.

    `queue_delays` are the destinations' queue-level delays set at provisioning: they apply when the
    message has no delay of its own, and a `queue_delay_seconds` that disagrees with one is refused."""
    unknown = set(item) - MESSAGE_FIELDS
    if unknown:
        raise InvalidInputError(f"unknown message field(s) {sorted(unknown)} in {where or 'the message'}; "
                                f"allowed: {sorted(MESSAGE_FIELDS)}")
    delay, deliver_at = item.get("delay_seconds"), parse_moment(item.get("deliver_at"), f"{where}deliver_at")
    if delay not in (None, "") and deliver_at is not None:
        raise DelayError(f"give either {where}delay_seconds or {where}deliver_at, not both")
    if deliver_at is not None:
        message_delay, field = seconds_until(deliver_at, now), f"{where}deliver_at (seconds from now)"
    elif delay not in (None, ""):
        message_delay, field = to_seconds(delay, f"{where}delay_seconds"), f"{where}delay_seconds"
    else:
        message_delay, field = None, f"{where}delay_seconds"
    queue_delay = parse_int(queue_delay_seconds, "queue_delay_seconds")
    provisioned = (queue_delays or {}).get(item.get("destination"))
    if provisioned is not None:
        if queue_delay not in (None, provisioned):
            raise DelayError(
                f"queue_delay_seconds={queue_delay} disagrees with the queue-level delay of {provisioned} s set when "
                f"{item.get('destination')!r} was provisioned; give the message its own {where}delay_seconds, or "
                "provision the destination again with the queue-level delay it should have"
            )
        queue_delay = provisioned
    seconds = resolve_delay(message_delay, queue_delay, message_field=field, queue_field="queue_delay_seconds")
    kwargs = {}
    message_id = item.get("message_id") or (default_id() if default_id else None)
    if message_id:
        kwargs["message_id"] = message_id
    return DelayedMessage(
        destination=item.get("destination"),
        body=item.get("body", b""),
        headers=item.get("headers") or {},
        due_at=now + timedelta(seconds=seconds),
        **kwargs,
    )
