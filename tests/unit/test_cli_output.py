"""How the command line prints a report in each `--output` format, and says a hook's errors with the flags."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import yaml

from airflow_delay_provider.cli.commands import flag_message
from airflow_delay_provider.cli.output import render

PAGE = {
    "messages": [
        {"message_id": "a", "due_at": "2026-01-01T00:00:00+00:00", "headers": {"order-id": "1"}, "paused": False},
        {"message_id": "b", "due_at": "2026-01-02T00:00:00+00:00", "headers": {"tenant": "x"}, "paused": None},
    ],
    "next": "1767312000000000:2",
    "selector": {},
}


def test_json_is_the_whole_report_as_before(capsys):
    render(PAGE, "json", "messages")
    assert capsys.readouterr().out == json.dumps(PAGE, indent=2, default=str) + "\n"


def test_yaml_is_the_whole_report(capsys):
    render({**PAGE, "at": datetime(2026, 1, 1, tzinfo=UTC)}, "yaml", "messages")
    assert yaml.safe_load(capsys.readouterr().out) == {**PAGE, "at": "2026-01-01 00:00:00+00:00"}  # as JSON has it


@pytest.mark.parametrize("output", ["table", "plain"])
def test_a_table_has_a_row_per_item_with_every_column_and_the_other_fields_below(capsys, output):
    render(PAGE, output, "messages")
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines() if line.strip()]
    split = (lambda line: [c.strip() for c in line.split("|")]) if output == "table" else str.split
    # Rows with different headers: every header a column, in first-seen order; empty where a row has none.
    assert split(lines[0]) == ["message_id", "due_at", "headers.order-id", "paused", "headers.tenant"]
    rows = lines[2:4] if output == "table" else lines[1:3]
    assert split(rows[0]) == ["a", "2026-01-01T00:00:00+00:00", "1", "False"] + ([""] if output == "table" else [])
    assert split(rows[1])[0] == "b" and split(rows[1])[-1] == "x"
    assert split(lines[-1]) == ["next", "1767312000000000:2"]
    assert not any(line.startswith("selector") for line in lines)  # an empty mapping: nothing to show


def test_an_empty_page_says_so(capsys):
    render({"messages": [], "next": None}, "plain", "messages")
    assert capsys.readouterr().out.splitlines()[0] == "No messages."


def _refusal() -> str:
    """What the store says of a selector that names nothing."""
    from airflow_delay_provider.core.backlog import Selector
    from airflow_delay_provider.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError) as refused:
        Selector.build()
    return str(refused.value)


@pytest.mark.parametrize(("said", "shown"), [
    (_refusal(),  # the store's own words, as they are now
     "select messages with --id, --destination, --header KEY=VALUE, --body-contains or a due window (--due-from, "
     "--due-before); an action with none of them would apply to every message, which is refused"),
    ("limit must be an int in 1..1000, got 0", "--limit must be an int in 1..1000, got 0"),
    ("deliver_at 2026-01-01T00:00:00+00:00 is in the past (now 2026-01-02T00:00:00+00:00); a message cannot be made "
     "due earlier than now: use delay_seconds=0 to run it now",
     "--deliver-at 2026-01-01T00:00:00+00:00 is in the past (now 2026-01-02T00:00:00+00:00); a message cannot be "
     "made due earlier than now: use --delay-seconds 0 to run it now"),
    ("headers (the header match): header names must be strings", "--header: header names must be strings"),
    ("unknown destination(s) ['ordres']: this store has never provisioned them", "unknown destination(s) ['ordres']: "
     "this store has never provisioned them"),  # prose about destinations stays as it is
])
def test_errors_name_the_flags(said, shown):
    assert flag_message(said) == shown
