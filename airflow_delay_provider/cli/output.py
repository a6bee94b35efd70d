"""How `airflow delayed-messages` prints a report: `--output table|json|yaml|plain`, as Airflow's own commands.

Table and plain go through Airflow's AirflowConsole (its commands' tables); JSON stays the indented report the
commands printed before there was a choice, so scripts reading it keep working, and it is the default when stdout
is not a terminal. A report is a dict: its list of items (a page of messages, the destinations' counts, the dead
letters) is the table, one row per item with nested fields as dotted columns, and its other fields follow as a
second table of field and value.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

FORMATS = ("table", "json", "yaml", "plain")


def default_output() -> str:
    """A table for a person at a terminal, JSON for a program reading a pipe or a file."""
    return "table" if sys.stdout.isatty() else "json"


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A mapping as one level of dotted keys; lists of plain values joined with commas."""
    flat: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, Mapping):  # an empty one (no headers, no selector) has nothing to show
            flat.update(_flat(item, name + "."))
        elif isinstance(item, (list, tuple)):
            flat[name] = ", ".join(json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)
                                   for v in item)
        else:
            flat[name] = "" if item is None else item
    return flat


def _rows(items: Any, key_name: str) -> list[dict[str, Any]]:
    """The table's rows: a list of dicts as they are, or a mapping of name to dict with the name first."""
    if isinstance(items, Mapping):
        rows = [{key_name: name, **_flat(item)} if isinstance(item, Mapping) else {key_name: name, "value": item}
                for name, item in items.items()]
    else:
        rows = [_flat(item) if isinstance(item, Mapping) else {"value": item} for item in items]
    columns: dict[str, None] = {}
    for row in rows:  # every row with every column, in first-seen order (rows may differ: headers, say)
        columns.update(dict.fromkeys(row))
    return [{column: row.get(column, "") for column in columns} for row in rows]


def render(report: Mapping[str, Any], output: str, items: str | None = None, item_name: str = "name",
           hide: tuple[str, ...] = ()) -> None:
    """Print `report` in `output`; `items` names its field holding the table's rows (a list, or a mapping whose
    keys become the `item_name` column); fields in `hide` (for programs, such as labels for a page) are left out
    of tables."""
    if output == "json":
        print(json.dumps(report, indent=2, default=str), flush=True)
        return
    plain = json.loads(json.dumps(report, default=str))  # datetimes and the like as the JSON shows them
    if output == "yaml":
        from airflow.utils import yaml

        print(yaml.dump(plain, sort_keys=False), end="", flush=True)
        return
    from airflow.cli.simple_table import AirflowConsole

    console = AirflowConsole()
    rest = {key: value for key, value in plain.items() if key not in hide}
    if items is not None and items in rest:
        rows = _rows(rest.pop(items), item_name)
        if rows:
            console.print_as(rows, output)
        else:
            print(f"No {items.replace('_', ' ')}.")
    fields = [{"field": key, "value": value} for key, value in _flat(rest).items()]
    if fields:
        console.print_as(fields, output)
    sys.stdout.flush()
