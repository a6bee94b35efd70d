import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest

from airflow_delay_provider.core.errors import DelayError, InvalidInputError, InvalidMessageError
from airflow_delay_provider.core.message import MAX_HEADERS_BYTES, DelayedMessage, new_message_id, stable_message_id
from airflow_delay_provider.core.requests import build_message

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def test_message_defaults_and_normalisation():
    m = DelayedMessage("orders", "hé", NOW.astimezone(timezone(timedelta(hours=2))))
    assert m.body == "hé".encode()
    assert m.due_at.utcoffset() == timedelta(0) and m.due_at == NOW
    assert len(m.message_id) == 36 and m.message_id != DelayedMessage("orders", b"", NOW).message_id


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"destination": ""}, "destination"),
        ({"destination": "x" * 256}, "at most 255"),
        ({"destination": "a\nb"}, "line breaks"),
        ({"headers": {"n": 1}}, "str value"),
        ({"headers": {1: "a"}}, "header names"),
        ({"headers": {"big": "x" * (MAX_HEADERS_BYTES + 1)}}, "at most"),
        ({"headers": ["a"]}, "dict"),
        ({"body": {"a": 1}}, "serialise"),
        ({"message_id": ""}, "message_id"),
        ({"message_id": "x" * 201}, "message_id"),
        ({"due_at": datetime(2026, 1, 1)}, "timezone-aware"),
    ],
)
def test_message_rejects_bad_fields(kwargs, fragment):
    args = {"destination": "orders", "body": b"x", "due_at": NOW, **kwargs}
    with pytest.raises(InvalidMessageError, match=fragment):
        DelayedMessage(**args)


def test_dead_lettered_keeps_id_and_says_where_when_why():
    m = DelayedMessage("orders", b"x", NOW, {"a": "b"}, "id-1", failures=2)
    d = m.dead_lettered("error", "boom", NOW)
    assert (d.destination, d.message_id, d.body) == ("error", "id-1", b"x")
    assert d.headers["a"] == "b"
    assert d.headers["x-delay-failed-destination"] == "orders"
    assert d.headers["x-delay-failure-reason"] == "boom"
    assert d.headers["x-delay-failures"] == "2"
    assert d.headers["x-delay-failed-at"].startswith("2026-05-01T12:00")


def test_stable_ids_are_stable_and_distinct():
    assert stable_message_id("d", "r", "t", -1, 0) == stable_message_id("d", "r", "t", -1, 0)
    assert stable_message_id("d", "r", "t", -1, 0) != stable_message_id("d", "r", "t", -1, 1)


def test_build_message_delay_forms():
    assert build_message({"destination": "q", "delay_seconds": 1.2}, NOW).due_at == NOW + timedelta(seconds=2)
    assert (build_message({"destination": "q", "delay_seconds": timedelta(minutes=1)}, NOW).due_at
            == NOW + timedelta(seconds=60))
    at = (NOW + timedelta(seconds=9.5)).isoformat()
    assert build_message({"destination": "q", "deliver_at": at}, NOW).due_at == NOW + timedelta(seconds=10)
    # A UTC time written with "Z" (which Python 3.10's fromisoformat alone would refuse).
    zulu = (NOW + timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert build_message({"destination": "q", "deliver_at": zulu}, NOW).due_at == NOW + timedelta(seconds=30)
    past = build_message({"destination": "q", "deliver_at": NOW - timedelta(days=2)}, NOW)
    assert past.due_at == NOW
    # No message delay: the queue-level delay applies; "600" as a rendered template.
    assert build_message({"destination": "q"}, NOW, queue_delay_seconds="600").due_at == NOW + timedelta(seconds=600)
    assert build_message({"destination": "q", "delay_seconds": 5}, NOW, 600).due_at == NOW + timedelta(seconds=5)


@pytest.mark.parametrize(
    ("item", "error", "fragment"),
    [
        ({"destination": "q", "delay_seconds": 8 * 86400}, DelayError, "604800"),
        ({"destination": "q", "delay_seconds": -3}, DelayError, "delay_seconds"),
        ({"destination": "q", "delay_seconds": 1, "deliver_at": NOW}, DelayError, "not both"),
        ({"destination": "q", "deliver_at": "tomorrow"}, DelayError, "ISO-8601"),
        ({"destination": "q", "deliver_at": "2026-05-01T12:00:00"}, DelayError, "timezone"),
        ({"destination": "q", "delay": 5}, InvalidInputError, "unknown message field"),
        ({"destination": "q", "deliver_at": NOW + timedelta(days=8)}, DelayError, "604800"),
    ],
)
def test_build_message_rejects(item, error, fragment):
    with pytest.raises(error, match=fragment):
        build_message(item, NOW)


@pytest.mark.parametrize(
    ("item", "where", "named"),
    [
        ({"destination": "q", "delay_seconds": 8 * 86400}, "", "delay_seconds must be in 0..604800"),
        ({"destination": "q", "delay_seconds": timedelta(days=8)}, "", "delay_seconds must be in 0..604800"),
        ({"destination": "q", "deliver_at": NOW + timedelta(days=8)}, "",
         r"deliver_at \(seconds from now\) must be in"),
        ({"destination": "q", "delay_seconds": 8 * 86400}, "messages[2].", r"messages\[2\]\.delay_seconds must be in"),
        ({"destination": "q", "deliver_at": "soon"}, "messages[0].", r"messages\[0\]\.deliver_at must be an ISO"),
    ],
)
def test_delay_errors_name_the_argument_the_user_set(item, where, named):
    with pytest.raises(DelayError, match=named) as err:
        build_message(item, NOW, where=where)
    assert "message_delay" not in str(err.value)


def test_queue_delay_errors_name_queue_delay_seconds():
    with pytest.raises(DelayError, match="queue_delay_seconds must be in 0..604800"):
        build_message({"destination": "q"}, NOW, queue_delay_seconds=10**7)


def test_ids_sort_by_time_so_the_store_indexes_grow_at_their_edge():
    first = new_message_id()
    assert uuid.UUID(first).version == 7 and uuid.UUID(first).variant == uuid.RFC_4122
    later = [new_message_id() for _ in range(100)]
    assert all(first[:13] <= m[:13] for m in later)  # the millisecond prefix never goes back
    assert len(set(later)) == 100
    run = datetime(2026, 11, 25, 4, 0, tzinfo=UTC)
    mid = stable_message_id("d", "r", "t", -1, 0, at=run)
    assert mid == stable_message_id("d", "r", "t", -1, 0, at=run)  # a retried task stores the same id
    assert mid != stable_message_id("d", "r", "t", -1, 1, at=run)
    assert uuid.UUID(mid).version == 8 and uuid.UUID(mid).variant == uuid.RFC_4122
    assert mid < stable_message_id("d", "r2", "t", -1, 0, at=run + timedelta(milliseconds=1))
    assert int(mid.replace("-", "")[:12], 16) == int(run.timestamp() * 1000)
    assert stable_message_id("d", "r", "t", -1, 0) == str(uuid.uuid5(
        uuid.NAMESPACE_URL, "airflow-delay-provider:d/r/t/-1/0"))  # without a time: the ids of before


def test_what_is_known_only_at_run_time_is_told_from_literals():
    from datetime import datetime, timedelta

    from airflow_delay_provider.core.requests import resolved_at_run_time

    class Output:  # an XComArg or any value resolved when the task runs
        pass

    for value in ("{{ params.d }}", "{% if x %}1{% endif %}", Output(), [1, "{{ x }}"], {"k": {"d": "{{ x }}"}},
                  ({"a": Output()},)):
        assert resolved_at_run_time(value), value
    for value in (None, "", "orders", b"{{", 5, 1.5, True, timedelta(days=8), datetime(2026, 1, 1), [1, "a"],
                  {"destination": "q", "delay_seconds": 5}, ()):
        assert not resolved_at_run_time(value), value
