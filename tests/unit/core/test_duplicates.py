"""on_duplicate's rules, apart from any store: what a duplicate send makes of a stored message, and of an id twice
in one send."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from airflow_delay_provider.core.delays import UTC
from airflow_delay_provider.core.duplicates import ON_DUPLICATE_MODES, check_natively, check_on_duplicate, fold, resolve
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.message import DelayedMessage

T = datetime(2026, 11, 28, 12, tzinfo=UTC)


def m(seconds: int, body: str, destination: str = "orders", failures: int = 0, message_id: str = "m") -> DelayedMessage:
    return DelayedMessage.trusted(destination, body.encode(), T + timedelta(seconds=seconds), {"b": body}, message_id,
                                  failures)


@pytest.mark.parametrize(("mode", "new_seconds", "expected"), [
    ("skip", 10, None),
    ("replace", 10, (10, "new", "refunds", 0)),
    ("replace", 90, (90, "new", "refunds", 0)),
    ("keep_earliest", 10, (10, "new", "refunds", 0)),
    ("keep_earliest", 60, None),  # a tie keeps the stored one
    ("keep_earliest", 90, None),
    ("replace_body", 10, (60, "new", "orders", 2)),  # the retry count stays with the time
])
def test_resolve_says_what_a_stored_message_becomes(mode, new_seconds, expected):
    stored, new = m(60, "old", failures=2), m(new_seconds, "new", "refunds")
    got = resolve(stored, new, mode)
    if expected is None:
        assert got is None
    else:
        seconds, body, destination, failures = expected
        assert (got.due_at, got.body, got.headers, got.destination, got.failures, got.message_id) == (
            T + timedelta(seconds=seconds), body.encode(), {"b": body}, destination, failures, "m")


def test_an_id_twice_in_one_send_is_two_sends_in_a_row_and_ids_keep_their_first_place():
    batch = [m(60, "a1", message_id="a"), m(30, "b1", message_id="b"), m(30, "a2", message_id="a"),
             m(90, "a3", message_id="a")]
    summary = {mode: [(x.message_id, x.body.decode(), int((x.due_at - T).total_seconds())) for x in fold(batch, mode)]
               for mode in ON_DUPLICATE_MODES}
    assert summary == {"skip": [("a", "a1", 60), ("b", "b1", 30)],
                       "replace": [("a", "a3", 90), ("b", "b1", 30)],
                       "keep_earliest": [("a", "a2", 30), ("b", "b1", 30)],
                       "replace_body": [("a", "a3", 60), ("b", "b1", 30)]}


@pytest.mark.parametrize("bad", ["Replace", "debounce", "", None, 1])
def test_a_mode_not_known_is_refused_naming_the_allowed_ones(bad):
    with pytest.raises(InvalidInputError, match=r"on_duplicate must be one of skip, replace, keep_earliest, "
                                                r"replace_body, got "):
        check_on_duplicate(bad)


def test_native_delays_take_skip_only():
    check_natively("skip", "rabbitmq")
    for mode in ("replace", "keep_earliest", "replace_body"):
        with pytest.raises(InvalidInputError, match=rf"on_duplicate='{mode}' needs the message kept in the store "
                                                    r"\(transport='sql'\): 'sqs' hands it"):
            check_natively(mode, "sqs")
