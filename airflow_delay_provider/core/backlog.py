"""Operating the backlog: which scheduled messages an action applies to, and what it reports.

Every control (browse, count, cancel, reschedule, run now, purge) takes a `Selector`. A selector that changes
messages must name something: message ids, a destination, a header match, a body text or a due window, so that
an empty form or a missing template value never means "every message". A change by a filter (no ids) can be
counted first (a dry run) and works in batches, each its own short transaction. Results are plain dicts of lists
and counts (XCom and JSON friendly).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from airflow_delay_provider.core.checks import check_number
from airflow_delay_provider.core.delays import MAX_DELAY_SECONDS, UTC, describe_seconds
from airflow_delay_provider.core.errors import InvalidInputError, UnknownDestinationError
from airflow_delay_provider.core.message import MAX_MESSAGE_ID_LENGTH, DelayedMessage, check_destination, check_headers
from airflow_delay_provider.core.requests import parse_int, parse_moment

#: The most ids one action takes (a larger list is split by the caller).
MAX_IDS = 10_000
#: The most messages one page of a browse returns.
MAX_PAGE = 1_000
#: Bodies in a browse are cut to this many bytes unless asked otherwise.
BODY_PREVIEW_BYTES = 200
#: Ids a report lists at most (its counts are always complete).
LISTED = 1_000
#: The longest text a body search takes (UTF-8 characters).
MAX_BODY_SEARCH = 200
#: Messages a change by a filter changes per transaction: a million-message cancel never holds a long one.
BULK_BATCH = 10_000
#: A change by a filter that would touch more than this many messages asks first: the CLI wants --yes (or a "y" on
#: a terminal), the page shows the count on its confirm button.
CONFIRM_ABOVE = 1_000
#: The backlog histogram's buckets: messages due at most this far ahead (seconds), then "later".
BUCKETS: tuple[tuple[str, int], ...] = (("due", 0), ("next_minute", 60), ("next_hour", 3_600),
                                        ("next_day", 86_400))
#: What each histogram key means, in the words the CLI, the API and the page all show (each report carries them,
#: as `buckets`, and the page draws its bars from them).
BUCKET_LABELS: dict[str, str] = {"due": "Due now", "next_minute": "< 1 minute", "next_hour": "< 1 hour",
                                 "next_day": "< 1 day", "later": "Later"}


@dataclass(frozen=True)
class Selector:
    """Which scheduled messages an action applies to: all conditions given must hold.

    :param message_ids: the ids a send task returned.
    :param destination: one destination's messages.
    :param headers: messages whose headers include all of these (e.g. ``{"order-id": "42"}``).
    :param due_from: due at or after (aware datetime).
    :param due_before: due before (aware datetime).
    :param body_contains: messages whose body contains this text (as UTF-8 bytes; case matters).
    """

    message_ids: tuple[str, ...] = ()
    destination: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    due_from: datetime | None = None
    due_before: datetime | None = None
    body_contains: str | None = None

    @classmethod
    def build(cls, message_ids: object = None, destination: object = None, headers: object = None,
              due_from: object = None, due_before: object = None, allow_everything: bool = False,
              body_contains: object = None) -> Selector:
        """A checked selector; `allow_everything` only for reads (a browse of the whole store)."""
        ids = _ids(message_ids)
        dest = None if destination in (None, "") else check_destination(destination)
        try:
            match = check_headers(headers or {})
        except Exception as exc:
            raise InvalidInputError(f"headers (the header match): {exc}") from None
        selector = cls(ids, dest, match, utc_moment("due_from", due_from), utc_moment("due_before", due_before),
                       _body_search(body_contains))
        if not allow_everything:
            selector.require_something()
        if selector.due_from and selector.due_before and selector.due_from >= selector.due_before:
            raise InvalidInputError(f"due_from ({selector.due_from.isoformat()}) must be before due_before "
                                    f"({selector.due_before.isoformat()})")
        return selector

    def require_something(self) -> None:
        """Refuse a selector that names nothing: every action that changes messages calls this."""
        if not (self.message_ids or self.destination or self.headers or self.body_contains or self.due_from
                or self.due_before):
            raise InvalidInputError(
                "select messages by message_ids, destination, headers (e.g. {'order-id': '42'}), body_contains "
                "or a due window (due_from, due_before); an action with none of them would apply to every "
                "message, which is refused"
            )

    def check_for_change(self, check_known: Callable[[Collection[str]], None]) -> None:
        """What every count and change of a store checks first: the selector names something, and its destination
        (if any) is one the store knows (`check_known`, the store's, refuses it by name)."""
        self.require_something()
        if self.destination is not None:
            check_known([self.destination])

    @property
    def is_filter(self) -> bool:
        """Whether this selects by a filter rather than by ids: a change then counts first and works in batches."""
        return not self.message_ids

    @cached_property
    def body_bytes(self) -> bytes | None:
        """The body search as the bytes a stored body must contain."""
        return None if self.body_contains is None else self.body_contains.encode("utf-8")

    def header_patterns(self) -> list[str]:
        """Substrings every matching row's stored header JSON contains (stored as compact JSON, ASCII)."""
        return [json.dumps(k) + ":" + json.dumps(v) for k, v in sorted(self.headers.items())]

    def matches_headers(self, headers: Mapping[str, str]) -> bool:
        return all(headers.get(k) == v for k, v in self.headers.items())

    @cached_property
    def _id_set(self) -> frozenset[str]:
        return frozenset(self.message_ids)

    def matches(self, message: DelayedMessage) -> bool:
        """Whether `message` is selected (what a SQL store's WHERE clause says for a row)."""
        return ((not self.message_ids or message.message_id in self._id_set)
                and (self.destination is None or message.destination == self.destination)
                and self.matches_headers(message.headers)
                and (self.due_from is None or message.due_at >= self.due_from)
                and (self.due_before is None or message.due_at < self.due_before)
                and (self.body_bytes is None or self.body_bytes in message.body))

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in (
            ("message_ids", len(self.message_ids) or None), ("destination", self.destination),
            ("headers", dict(self.headers) or None),
            ("due_from", self.due_from and self.due_from.isoformat()),
            ("due_before", self.due_before and self.due_before.isoformat()),
            ("body_contains", self.body_contains),
        ) if v is not None}


def _ids(value: object) -> tuple[str, ...]:
    if value in (None, "", [], ()):
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise InvalidInputError(f"message_ids must be a list of message ids, got {type(value).__name__}")
    ids = tuple(dict.fromkeys(value))  # keeps order, drops repeats
    if len(ids) > MAX_IDS:
        raise InvalidInputError(f"at most {MAX_IDS} message_ids per action, got {len(ids)}: split the list")
    for mid in ids:
        if not isinstance(mid, str) or not mid or len(mid) > MAX_MESSAGE_ID_LENGTH:
            raise InvalidInputError(f"message ids are non-empty strings of at most {MAX_MESSAGE_ID_LENGTH} "
                                    f"characters, got {mid!r:.60}")
    return ids


def _body_search(value: object) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise InvalidInputError(f"body_contains must be text, got {type(value).__name__}")
    if len(value) > MAX_BODY_SEARCH:
        raise InvalidInputError(f"body_contains is at most {MAX_BODY_SEARCH} characters, got {len(value)}")
    return value


def utc_moment(name: str, value: object) -> datetime | None:
    """A time a form or a command line gave (ISO 8601 with a zone, or a datetime), in UTC; None when empty."""
    moment = parse_moment(value, name)
    return None if moment is None else moment.astimezone(UTC)


def check_known(destinations: Collection[str], known: Collection[str]) -> None:
    """Refuse destinations not in `known` (those a store has provisioned or taken messages for), naming them."""
    for destination in destinations:
        check_destination(destination)
    unknown = sorted(set(destinations) - set(known))
    if unknown:
        listed = ", ".join(repr(k) for k in list(known)[:20]) or "none yet"
        raise UnknownDestinationError(
            f"unknown destination(s) {unknown}: this store has never provisioned them nor taken messages for "
            f"them; known destinations: {listed}{' ...' if len(known) > 20 else ''}")


def new_due_time(now: datetime, deliver_at: object = None, delay_seconds: object = None,
                 limit: int = MAX_DELAY_SECONDS) -> datetime:
    """When a rescheduled message becomes due: exactly one of `deliver_at` (not before now) or
    `delay_seconds` (0 = run now), at most `limit` seconds ahead (the destination's longest delay, 7 days unless
    its store connection says otherwise)."""
    if (deliver_at in (None, "")) == (delay_seconds in (None, "")):
        raise InvalidInputError("give exactly one of deliver_at (a time) or delay_seconds (0 runs it now)")
    if delay_seconds not in (None, ""):
        if isinstance(delay_seconds, str):  # a rendered template
            delay_seconds = parse_int(delay_seconds, "delay_seconds")
        return now + timedelta(seconds=check_number("delay_seconds", delay_seconds, 0, limit,
                                                    hint=describe_seconds(limit)))
    at = utc_moment("deliver_at", deliver_at)
    assert at is not None
    if at < now - timedelta(seconds=1):  # a second of grace for clocks and form round trips
        raise InvalidInputError(f"deliver_at {at.isoformat()} is in the past (now {now.isoformat()}); a message "
                                "cannot be made due earlier than now: use delay_seconds=0 to run it now")
    if at > now + timedelta(seconds=limit):
        raise InvalidInputError(f"deliver_at {at.isoformat()} is more than {describe_seconds(limit)} ahead (the "
                                f"longest delay, {limit} s)")
    return max(at, now)


def bucket_of(due_in_seconds: float) -> str:
    """The histogram bucket of a message due this many seconds from now."""
    for name, limit in BUCKETS:
        if due_in_seconds <= limit:
            return name
    return "later"


def empty_histogram() -> dict[str, int]:
    return {name: 0 for name, _ in BUCKETS} | {"later": 0}


def preview(body: bytes, limit: int = BODY_PREVIEW_BYTES) -> dict[str, Any]:
    """A body as a browse shows it: text (invalid UTF-8 replaced), cut to `limit` bytes."""
    return {"body": body[:limit].decode("utf-8", errors="replace"), "body_bytes": len(body),
            "body_truncated": len(body) > limit}


def parse_cursor(value: str) -> tuple[int, int]:
    """The position a browse's `next` cursor names: `<due time in µs>:<order of storing>`."""
    try:
        due_us, order = (int(part) for part in value.split(":"))
    except (ValueError, AttributeError):
        raise InvalidInputError(f"after must be the `next` cursor of a previous page, got {value!r}") from None
    return due_us, order


def cancel_report(requested: Sequence[str], cancelled: Sequence[str], in_flight: Sequence[str],
                  accepted_before: Sequence[str]) -> dict[str, Any]:
    """What a cancel by ids did to each id: cancelled now; in flight (a sweep or the relay holds it and
    may deliver it: not cancelled); gone (accepted earlier and no longer scheduled: delivered, moved to
    the error queue, or cancelled before); unknown (never accepted here, or longer ago than the
    de-duplication window)."""
    done, busy, seen = set(cancelled), set(in_flight), set(accepted_before)
    gone = [m for m in requested if m not in done and m not in busy and m in seen]
    unknown = [m for m in requested if m not in done and m not in busy and m not in seen]
    return {"cancelled": list(cancelled), "in_flight": list(in_flight), "gone": gone, "unknown": unknown,
            "counts": {"cancelled": len(cancelled), "in_flight": len(in_flight), "gone": len(gone),
                       "unknown": len(unknown)}}


def change_report(selector: Selector, changed: Sequence[str], in_flight: Sequence[str],
                  accepted: Callable[[Sequence[str]], Sequence[str]]) -> dict[str, Any]:
    """What a cancel (or a reschedule) did: by ids, each id's fate (`cancel_report`; `accepted` gives, of
    the ids neither changed nor in flight, those the store accepted within its de-duplication window);
    otherwise the first LISTED ids of each kind and complete counts."""
    if not selector.message_ids:
        return bulk_report(selector, changed, len(changed), in_flight, len(in_flight), 1)
    done = set(changed) | set(in_flight)
    missing = [m for m in selector.message_ids if m not in done]
    return {**cancel_report(selector.message_ids, changed, in_flight, accepted(missing)),
            "selector": selector.describe()}


def count_report(selector: Selector, action: str, matching: int, in_flight: int) -> dict[str, Any]:
    """What a change by `selector` would touch (a dry run): `would_<action>` (the messages it would change now) and
    `in_flight` (held by a sweep: it would leave them), and whether it asks for confirmation first."""
    return {"dry_run": True, f"would_{action}": matching, "in_flight": in_flight,
            "confirm": matching > CONFIRM_ABOVE, "selector": selector.describe()}


def bulk_report(selector: Selector, changed: Sequence[str], changed_count: int, in_flight: Sequence[str],
                in_flight_count: int, batches: int) -> dict[str, Any]:
    """What a change by a filter did, in the words of `change_report` (the first LISTED ids of each kind, complete
    counts), with the number of batches (transactions) it took."""
    return {"cancelled": list(changed[:LISTED]), "in_flight": list(in_flight[:LISTED]),
            "counts": {"cancelled": changed_count, "in_flight": in_flight_count},
            "truncated": changed_count > LISTED or in_flight_count > LISTED, "batches": batches,
            "selector": selector.describe()}


def edited_values(message_id: object, body: object = None, headers: object = None) -> tuple[str, dict[str, Any]]:
    """(the id, the columns to write) of an edit of a scheduled message: a new body (bytes, or str as UTF-8) and/or
    new headers (replacing them all), each checked as a send checks it."""
    if body is None and headers is None:
        raise InvalidInputError("an edit needs a new body and/or new headers")
    given: Any = (b"" if body is None else body, {} if headers is None else headers, message_id)
    checked = DelayedMessage("edited", given[0], datetime(2000, 1, 1, tzinfo=UTC), given[1], given[2])
    values: dict[str, Any] = {}
    if body is not None:
        values["body"] = checked.body
    if headers is not None:
        values["headers"] = json.dumps(checked.headers, separators=(",", ":"))
    return checked.message_id, values


def edited_report(report: dict[str, Any]) -> dict[str, Any]:
    """A change report as an edit words it: `edited` instead of `cancelled`."""
    report["edited"] = report.pop("cancelled")
    report["counts"]["edited"] = report["counts"].pop("cancelled")
    return report


def held_report(report: dict[str, Any], key: str, already: int | None = None) -> dict[str, Any]:
    """A change report as a pause or a resume words it: `paused` or `resumed` (`key`) instead of `cancelled`; a
    pause by a filter also counts the selected messages that were paused already (`already_paused`)."""
    report[key] = report.pop("cancelled")
    report["counts"][key] = report["counts"].pop("cancelled")
    if already is not None and key == "paused":
        report["counts"]["already_paused"] = already
    return report


def rescheduled_report(report: dict[str, Any], due_at: datetime) -> dict[str, Any]:
    """A change report as a reschedule words it: `rescheduled` instead of `cancelled`, and the new due time."""
    report["rescheduled"] = report.pop("cancelled")
    report["counts"]["rescheduled"] = report["counts"].pop("cancelled")
    report["due_at"] = due_at.astimezone(UTC).isoformat()
    return report


def destination_counts(paused: bool) -> dict[str, Any]:
    """One destination's entry of a backlog report, before counting."""
    return {"scheduled": 0, "due": 0, "in_flight": 0, "held": 0, "paused": paused, "histogram": empty_histogram()}


def backlog_report(now: datetime, destinations: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The backlog report of counted destination entries: each one's `due` from its histogram, and totals."""
    for entry in destinations.values():
        entry["due"] = entry["histogram"]["due"]
    totals = {k: sum(e[k] for e in destinations.values()) for k in ("scheduled", "due", "in_flight", "held")}
    totals["paused_due"] = sum(e["due"] for e in destinations.values() if e["paused"])
    return {"at": now.astimezone(UTC).isoformat(), "destinations": destinations, "totals": totals,
            "buckets": [{"key": key, "label": label} for key, label in BUCKET_LABELS.items()]}


def pause_names(destinations: Collection[str], action: str = "pause or resume") -> list[str]:
    """The destinations a pause or resume (or another `action`) names, sorted once each; at least one."""
    names = sorted(set(destinations))
    if not names:
        raise InvalidInputError(f"name the destination(s) to {action}")
    return names


def pause_report(names: Sequence[str], changed: Collection[str]) -> dict[str, list[str]]:
    """What a pause or resume did: `changed` (now paused, or resumed) and `unchanged` (were so already)."""
    return {"changed": sorted(changed), "unchanged": [n for n in names if n not in changed]}


def forget_check(names: Sequence[str], scheduled: Mapping[str, int], in_flight: Mapping[str, int],
                 force: bool) -> None:
    """Refuse to forget destinations that still have scheduled messages (unless `force`, which purges them), or
    rows a running sweep holds (never: the sweep may be sending them)."""
    held = {n: in_flight[n] for n in names if in_flight.get(n)}
    if held:
        raise InvalidInputError(f"cannot forget {sorted(held)}: a running sweep holds {held} of their messages; "
                                "try again when it has finished")
    left = {n: scheduled[n] for n in names if scheduled.get(n)}
    if left and not force:
        raise InvalidInputError(f"cannot forget {sorted(left)}: they still have scheduled messages {left}; "
                                "cancel or purge them first, or forget with force, which purges them")


def forget_report(names: Sequence[str], purged: Mapping[str, int]) -> dict[str, Any]:
    """What a forget did: the destinations no longer known (their pause, policy, queue delay and throttle
    gone), and how many scheduled messages of each a forced forget purged."""
    return {"forgotten": list(names), "purged": {n: purged.get(n, 0) for n in names}}


def purge_report(destination: str, dry_run: bool, count: int, in_flight: int) -> dict[str, Any]:
    """What a purge removed (or, as a dry run, would remove); messages a sweep holds stay, as `in_flight`."""
    return {"destination": destination, "dry_run": dry_run, "would_purge" if dry_run else "purged": count,
            "in_flight": in_flight}
