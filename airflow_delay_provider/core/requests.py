"""Turning a send request (as a DAG author writes it, possibly rendered from templates) into messages."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any, cast

from airflow_delay_provider.core.delays import (
    LONGEST_MAX_DELAY_SECONDS,
    DelayLimits,
    resolve_delay,
    seconds_until,
    to_seconds,
)
from airflow_delay_provider.core.errors import DelayError, InvalidInputError
from airflow_delay_provider.core.message import DelayedMessage, check_destination, new_message_id

#: What stands for now when a send request is checked as the DAG is parsed (relative delays need a "now").
PARSE_TIME_NOW = datetime(2000, 1, 1, tzinfo=timezone.utc)

#: The longest delays a literal of a DAG file is held to when it is parsed: the most any store connection allows (its
#: own `max_delay_seconds` is read when the task runs).
PARSE_TIME_LIMITS = DelayLimits(LONGEST_MAX_DELAY_SECONDS)
_DEFAULT_LIMITS = DelayLimits()

#: The keys a message of a batch may have; anything else is a typo worth an error.
MESSAGE_FIELDS = frozenset({"destination", "body", "headers", "delay_seconds", "deliver_at", "message_id"})


def resolved_at_run_time(value: Any) -> bool:
    """Whether an operator argument is known only when the task runs: Jinja text (rendered then), anything that is
    not plain data (an XComArg, an upstream task's output), or plain data holding either. Everything else is a
    literal of the DAG file, checked when the DAG is parsed."""
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if value is None or isinstance(value, (bytes, int, float, datetime, timedelta)):
        return False
    if isinstance(value, Mapping):
        return any(resolved_at_run_time(k) or resolved_at_run_time(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(resolved_at_run_time(v) for v in value)
    return True


def parse_moment(value: Any, field: str = "deliver_at") -> datetime | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            # Python 3.10's fromisoformat reads only what isoformat() writes: not the "Z" of UTC.
            value = datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value)
        except ValueError:
            raise DelayError(f"{field} must be an ISO-8601 timestamp with a timezone, got {value!r}") from None
    if not isinstance(value, datetime):
        raise DelayError(f"{field} must be a datetime or an ISO-8601 string, got {type(value).__name__}")
    if value.tzinfo is None:
        raise DelayError(f"{field} must carry a timezone (for example 2026-01-31T12:00:00+00:00), "
                         f"got {value.isoformat()}")
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
    return cast("int | None", value)  # not checked here: resolve_delay refuses anything but an int


def build_message(
    item: Mapping[str, Any],
    now: datetime,
    queue_delay_seconds: Any = None,
    default_id: Callable[[], str] | None = None,
    where: str = "",
    queue_delays: Mapping[str, int] | None = None,
    limits: DelayLimits | None = None,
) -> DelayedMessage:
    """A message from a send request's fields; errors name the field as the user wrote it, prefixed
    by `where` (e.g. "messages[2].") for a message of a batch.

    `limits` are the store connection's longest delays (default: 7 days for every destination); a DAG being parsed,
    before any connection is read, gives PARSE_TIME_LIMITS, the most any connection may allow.

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
    destination: Any = item.get("destination")  # as the user wrote it: DelayedMessage checks it
    provisioned = (queue_delays or {}).get(destination)
    if provisioned is not None:
        if queue_delay not in (None, provisioned):
            raise DelayError(
                f"queue_delay_seconds={queue_delay} disagrees with the queue-level delay of {provisioned} s set when "
                f"{item.get('destination')!r} was provisioned; give the message its own {where}delay_seconds, or "
                "provision the destination again with the queue-level delay it should have"
            )
        queue_delay = provisioned
    limit = (limits or _DEFAULT_LIMITS).of(destination)
    seconds = resolve_delay(message_delay, queue_delay, message_field=field, queue_field="queue_delay_seconds",
                            limit=limit)
    message_id = item.get("message_id") or (default_id() if default_id else None) or new_message_id()
    return DelayedMessage(
        destination=destination,
        body=item.get("body", b""),
        headers=item.get("headers") or {},
        due_at=now + timedelta(seconds=seconds),
        message_id=message_id,
    )


def parse_literal(name: str, text: str) -> Any:
    """A rendered template: JSON, or the Python literal a list of dicts renders to (never code)."""
    import ast
    import json

    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise InvalidInputError(f"{name} must render to a JSON list of objects (or a Python list of dicts), "
                                f"got {text[:200]!r}") from None


def parse_runtime(value: Any, field: str = "max_runtime") -> timedelta | str:
    """A run time as a timedelta: a timedelta, or seconds (a number or a rendered number > 0); a
    template is left for rendering."""
    if isinstance(value, str) and "{{" in value:
        return value
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    else:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = -1.0
        if isinstance(value, bool):
            seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise InvalidInputError(f"{field} must be a timedelta or a number of seconds > 0, got {value!r}")
    return timedelta(seconds=seconds)


def parse_count(name: str, value: Any) -> int | None:
    """A rendered count: an int >= 1, or nothing."""
    if value in (None, ""):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or str(n) != str(value).strip():
        raise InvalidInputError(f"{name} must be a whole number >= 1, got {value!r}")
    return n


def parse_destinations(value: Any) -> list[str] | None:
    """A rendered destination list: a list of names or a comma-separated string; each name is checked."""
    if value in (None, "", []):
        return None
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise InvalidInputError(f"destinations must be a list of destination names, got {value!r}")
    return [check_destination(n) for n in names]


def parse_messages(items: Any) -> list[dict[str, Any]]:
    """A send request's `messages`: a list of dicts, or its rendered JSON / Python-literal text."""
    if isinstance(items, str):
        items = parse_literal("messages", items)
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise InvalidInputError(f"messages must be a list of dicts, got {type(items).__name__}")
    return items


def build_batch(
    items: list[dict[str, Any]],
    defaults: Mapping[str, Any],
    now: datetime,
    queue_delay_seconds: Any = None,
    default_id: Callable[[int], str] | None = None,
    queue_delays: Mapping[str, int] | None = None,
    batch: bool = True,
    limits: DelayLimits | None = None,
) -> list[DelayedMessage]:
    """Every message of a send request, each checked before any is returned (one bad message: none).

    `items` come from parse_messages; missing keys take `defaults`. Errors of a batch name the
    message ("messages[2].delay_seconds")."""
    return [
        build_message({**defaults, **item}, now, queue_delay_seconds,
                      default_id=None if default_id is None else partial(default_id, n),
                      where=f"messages[{n}]." if batch else "", queue_delays=queue_delays, limits=limits)
        for n, item in enumerate(items)
    ]


def destinations_of(items: list[dict[str, Any]], defaults: Mapping[str, Any]) -> set[str]:
    """The destination names a send request mentions (before they are checked)."""
    return {d for i in items if isinstance(d := {**defaults, **i}.get("destination"), str)}


#: The largest conf (as JSON) a delayed DAG run carries: it becomes an asset event's extra in Airflow's database.
MAX_CONF_BYTES = 64 * 1024


def check_conf(conf: Any) -> dict[str, Any]:
    """The run's conf: a dict (or its rendered JSON text) whose JSON is at most MAX_CONF_BYTES."""
    if conf is None or conf == "":
        return {}
    if isinstance(conf, str):
        try:
            conf = json.loads(conf)
        except ValueError:
            raise InvalidInputError(f"conf must be a dict or JSON text of an object, got {conf[:80]!r}") from None
    if not isinstance(conf, dict):
        raise InvalidInputError(f"conf must be a dict (a JSON object), got {type(conf).__name__}")
    try:
        text = json.dumps(conf, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"conf must be JSON-serialisable (str, numbers, bools, None, lists and dicts with "
                                f"str keys); {exc}") from None
    if len(text.encode()) > MAX_CONF_BYTES:
        raise InvalidInputError(f"conf takes {len(text.encode())} bytes as JSON; at most {MAX_CONF_BYTES} are allowed "
                                "(it is stored in Airflow's metadata database): pass a reference instead")
    return conf
