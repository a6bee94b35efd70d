"""What a send does with an id already stored: `on_duplicate`.

A store keeps one message per id. A send of an id it holds, or accepted within its de-duplication window, is a
duplicate, and the mode says what it does while the message is still stored (scheduled, not taken by a pump or a
sweep):

- ``skip`` (the default): nothing; the first send's message stays as it was.
- ``replace``: the new message replaces the stored one (due time, body, headers, destination): a debounce, "30
  minutes after the last activity".
- ``keep_earliest``: the message due first wins, with its body and headers: "at the earliest of these".
- ``replace_body``: the body and headers change, the due time and destination stay.

Once the message was delivered, dead-lettered or cancelled, a duplicate within the window is skipped in every mode
(so a message is never delivered twice within it); after the window a send stores a new message. While a pump's
claim holds the message, the send waits for the claim's outcome (delivered: skipped; written back for a retry:
changed). While a sweep holds it under a live lease it is skipped: the sweep may be sending it. A change counts as
a new acceptance: the window runs again from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace as with_fields

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.message import DelayedMessage

SKIP = "skip"
REPLACE = "replace"
KEEP_EARLIEST = "keep_earliest"
REPLACE_BODY = "replace_body"
ON_DUPLICATE_MODES = (SKIP, REPLACE, KEEP_EARLIEST, REPLACE_BODY)


def check_on_duplicate(mode: object, what: str = "on_duplicate") -> str:
    """The mode, or InvalidInputError naming the allowed ones."""
    if mode not in ON_DUPLICATE_MODES:
        raise InvalidInputError(f"{what} must be one of {', '.join(ON_DUPLICATE_MODES)}, got {mode!r}")
    return str(mode)


def check_natively(mode: str, transport: str) -> None:
    """Refuse a mode other than `skip` for a send through a broker's own delays: a message handed to RabbitMQ's
    delay queues or to SQS cannot be changed or withdrawn until it is delivered."""
    if check_on_duplicate(mode) != SKIP:
        raise InvalidInputError(
            f"on_duplicate={mode!r} needs the message kept in the store (transport='sql'): {transport!r} hands it "
            f"to the broker's own delays, which cannot change or withdraw a message once sent; {transport!r} "
            f"allows on_duplicate='skip' only")


def resolve(stored: DelayedMessage, new: DelayedMessage, mode: str) -> DelayedMessage | None:
    """What a stored message becomes on a duplicate send in `mode`, or None when it stays as it is."""
    if mode == REPLACE:
        return new
    if mode == KEEP_EARLIEST:
        return new if new.due_at < stored.due_at else None
    if mode == REPLACE_BODY:
        return with_fields(stored, body=new.body, headers=dict(new.headers))
    return None


def fold(messages: Sequence[DelayedMessage], mode: str) -> list[DelayedMessage]:
    """One message per id of a send, in the order ids first appear: an id twice in one send is two sends in a
    row (with `skip` the first stays; with `replace` the last; with `keep_earliest` the one due first, the first
    of a tie; with `replace_body` the first's due time and destination, the last's body and headers)."""
    out: dict[str, DelayedMessage] = {}
    for m in messages:
        held = out.get(m.message_id)
        if held is None:
            out[m.message_id] = m
        elif (changed := resolve(held, m, mode)) is not None:
            out[m.message_id] = changed
    return list(out.values())


def applied(pairs: Iterable[tuple[DelayedMessage, DelayedMessage]], mode: str) -> list[DelayedMessage]:
    """Of (stored, new) pairs, the messages to write: those `mode` changes."""
    return [m for stored, new in pairs if (m := resolve(stored, new, mode)) is not None]
