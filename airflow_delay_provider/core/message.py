"""The delayed message: what is stored, dispatched and delivered, with the checks every path shares."""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from airflow_delay_provider.core.delays import UTC
from airflow_delay_provider.core.errors import InvalidMessageError

MAX_MESSAGE_ID_LENGTH = 200
MAX_DESTINATION_LENGTH = 255
MAX_HEADER_NAME_LENGTH = 256
MAX_HEADERS_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024

# Headers the provider itself writes on dead-lettered messages.
HEADER_FAILED_DESTINATION = "x-delay-failed-destination"
HEADER_FAILED_AT = "x-delay-failed-at"
HEADER_FAILURE_REASON = "x-delay-failure-reason"
HEADER_FAILURES = "x-delay-failures"
HEADER_DUE_AT = "x-delay-due-at"
HEADER_FIRST_FAILED_AT = "x-delay-first-failed-at"
#: Why the delivery policy gave up on a dead letter: a final failure, or the phase whose retries it used up.
HEADER_GAVE_UP = "x-delay-gave-up"


def new_message_id() -> str:
    """A time-ordered UUID (version 7: Unix milliseconds, then 74 random bits). New ids sort after older
    ones, so the store's unique indexes on message ids grow at their right edge; random ids land on a
    random page of an index of millions, which PostgreSQL writes whole to its WAL once after every
    checkpoint (a third of the store rate lost at 3M stored; bench/bench_scale.py)."""
    return _time_ordered(time.time_ns() // 1_000_000, 7, int.from_bytes(os.urandom(10), "big"))


def stable_message_id(*parts: object, at: datetime | None = None) -> str:
    """A message id derived from its origin, so a retried task stores the same ids again, not new ones.

    With `at` (a time every retry sees alike, such as its DAG run's), the id starts with that time's
    milliseconds, as `new_message_id`'s do, and the rest comes from the origin (a UUID of version 8): the ids
    of one run sit together in the store's indexes instead of on random pages of them."""
    name = "airflow-delay-provider:" + "/".join(map(str, parts))
    if at is None:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, name))
    ms = max(0, int(at.timestamp() * 1000)) & (1 << 48) - 1
    return _time_ordered(ms, 8, int.from_bytes(hashlib.sha1(name.encode()).digest()[:10], "big"))


def _time_ordered(ms: int, version: int, bits: int) -> str:
    """A UUID of 48 bits of Unix milliseconds, the version, and 80 bits (12 before the variant, 62 after)."""
    return str(uuid.UUID(int=ms << 80 | version << 76 | (bits >> 68) << 64 | 0b10 << 62 | bits & (1 << 62) - 1))


def check_destination(destination: object) -> str:
    if not isinstance(destination, str) or not destination.strip():
        raise InvalidMessageError(f"destination must be a non-empty string, got {destination!r}")
    if len(destination) > MAX_DESTINATION_LENGTH or any(ch in destination for ch in "\x00\r\n"):
        raise InvalidMessageError(
            f"destination must be at most {MAX_DESTINATION_LENGTH} characters without NUL or line breaks, "
            f"got {len(destination)} characters: {destination[:40]!r}"
        )
    return destination


def check_headers(headers: object) -> dict[str, str]:
    if headers is None:
        return {}
    if not isinstance(headers, dict):
        raise InvalidMessageError(f"headers must be a dict of str to str, got {type(headers).__name__}")
    for key, value in headers.items():
        if not isinstance(key, str) or not key or len(key) > MAX_HEADER_NAME_LENGTH:
            raise InvalidMessageError(
                f"header names must be non-empty strings of at most {MAX_HEADER_NAME_LENGTH} characters, "
                f"got {key!r:.60}"
            )
        if not isinstance(value, str):
            raise InvalidMessageError(
                f"header {key!r} must have a str value, got {type(value).__name__}; "
                "convert it with str() or json.dumps()"
            )
    size = len(json.dumps(headers).encode())
    if size > MAX_HEADERS_BYTES:
        raise InvalidMessageError(f"headers take {size} bytes encoded; at most {MAX_HEADERS_BYTES} are allowed")
    return dict(headers)


def to_body(body: object) -> bytes:
    """Bytes as they are, text as UTF-8; anything else must be serialised by the caller (no pickle)."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        data = bytes(body)
    elif isinstance(body, str):
        data = body.encode("utf-8")
    else:
        raise InvalidMessageError(
            f"body must be bytes or str, got {type(body).__name__}; serialise it first (for example json.dumps)"
        )
    if len(data) > MAX_BODY_BYTES:
        raise InvalidMessageError(f"body has {len(data)} bytes; at most {MAX_BODY_BYTES} are allowed")
    return data


@dataclass(frozen=True)
class DelayedMessage:
    """One message to deliver at `due_at` (UTC). `message_id` is kept end to end for de-duplication."""

    destination: str
    body: bytes
    due_at: datetime
    headers: dict[str, str] = field(default_factory=dict)
    message_id: str = field(default_factory=new_message_id)
    failures: int = 0

    def __post_init__(self) -> None:
        check_destination(self.destination)
        object.__setattr__(self, "body", to_body(self.body))
        object.__setattr__(self, "headers", check_headers(self.headers))
        mid = self.message_id
        if not isinstance(mid, str) or not mid or len(mid) > MAX_MESSAGE_ID_LENGTH or not mid.isprintable():
            raise InvalidMessageError(
                f"message_id must be a printable string of 1..{MAX_MESSAGE_ID_LENGTH} characters, got {mid!r:.60}"
            )
        if not isinstance(self.due_at, datetime) or self.due_at.tzinfo is None:
            raise InvalidMessageError(f"due_at must be a timezone-aware datetime, got {self.due_at!r}")
        object.__setattr__(self, "due_at", self.due_at.astimezone(UTC))

    @classmethod
    def trusted(
        cls, destination: str, body: bytes, due_at: datetime, headers: dict[str, str], message_id: str, failures: int
    ) -> DelayedMessage:
        """Rebuild a message read back from a store, which checked it when it was stored: no re-validation
        on the dispatch hot path."""
        message = object.__new__(cls)
        # Frozen dataclasses block setattr, not the instance dict: this is the cheap way in.
        message.__dict__.update(
            destination=destination, body=body, due_at=due_at, headers=headers, message_id=message_id, failures=failures
        )
        return message

    def dead_lettered(self, error_queue: str, reason: str, failed_at: datetime) -> DelayedMessage:
        """This message addressed to the error queue, with headers saying where it came from, when and why."""
        headers = dead_letter_headers(self.headers, self.destination, reason, self.failures, failed_at)
        return replace(self, destination=error_queue, headers=headers)


def dead_letter_headers(headers: Mapping[str, str], destination: str, reason: str, failures: int,
                        failed_at: datetime) -> dict[str, str]:
    """A dead letter's headers: the message's own, and where it was going, when it first and last failed, why
    (at most 1,000 characters) and after how many attempts. Every path that dead-letters writes these."""
    failed = failed_at.astimezone(UTC).isoformat()
    out = dict(headers)
    out.setdefault(HEADER_FIRST_FAILED_AT, failed)
    out.update({HEADER_FAILED_DESTINATION: destination, HEADER_FAILED_AT: failed,
                HEADER_FAILURE_REASON: reason[:1000], HEADER_FAILURES: str(failures)})
    return out
