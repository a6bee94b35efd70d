"""The how-to pages (docs/howto/) quote the example DAGs verbatim and cover every operator and sensor.

A page quotes a file with a marker line directly followed by a fenced code block:

    <!-- include dags/delay_order_timeout.py lines "check = SendDelayedMessageOperator(" .. ")" -->
    ```python
    check = SendDelayedMessageOperator(
        ...
    )
    ```

The path is relative to the repository root. The excerpt starts at the first line of that file whose text,
leading and trailing whitespace removed, equals the first string, and ends at the first line from there on
(the start line included) whose text equals the second. The block must equal the excerpt with its common
indentation removed. Both strings are JSON strings: write `\\"` for a double quote.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOWTO = ROOT / "docs" / "howto"
PAGES = sorted(HOWTO.glob("*.md"))

_STRING = r'"(?:[^"\\]|\\.)*"'
MARKER = re.compile(rf"^<!-- include (?P<path>\S+) lines (?P<first>{_STRING}) \.\. (?P<last>{_STRING}) -->$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)$")
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    include: re.Match | None  # the marker line before it, if any


def _blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, each with the include marker on the line before it (if any)."""
    lines = page.read_text().splitlines()
    blocks, n = [], 0
    while n < len(lines):
        fence = FENCE.match(lines[n])
        if not fence:
            n += 1
            continue
        end = next((k for k in range(n + 1, len(lines)) if lines[k] == "```"), None)
        assert end is not None, f"{page.name}:{n + 1}: code block is never closed"
        marker = MARKER.match(lines[n - 1]) if n else None
        blocks.append(Block(page, n + 1, fence["lang"], "\n".join(lines[n + 1:end]), marker))
        n = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in _blocks(page)]
INCLUDED = [block for block in BLOCKS if block.include]


def _excerpt(path: str, first: str, last: str) -> str:
    source = ROOT / path
    assert source.is_file(), f"{path} does not exist"
    lines = source.read_text().splitlines()
    stripped = [line.strip() for line in lines]
    assert first in stripped, f"{path} has no line {first!r}"
    start = stripped.index(first)
    assert last in stripped[start:], f"{path} has no line {last!r} at or after {first!r}"
    end = stripped.index(last, start)
    return textwrap.dedent("\n".join(lines[start:end + 1]))


def test_the_pages_exist_and_quote_the_example_dags():
    assert HOWTO.joinpath("index.md").is_file()
    assert any(block.include["path"].startswith("dags/") for block in INCLUDED)


def test_every_include_marker_is_well_formed_and_followed_by_its_block():
    """A misspelt marker would otherwise go unchecked: every `<!-- include` line must parse and open a block."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            if line.startswith("<!-- include"):
                assert MARKER.match(line), f"{page.name}:{n + 1}: malformed include marker: {line}"
                assert n + 1 < len(lines) and FENCE.match(lines[n + 1]), (
                    f"{page.name}:{n + 1}: an include marker must be followed at once by a fenced code block")


@pytest.mark.parametrize("block", INCLUDED, ids=[f"{b.page.name}:{b.line}" for b in INCLUDED])
def test_an_included_block_is_the_text_of_its_source(block: Block):
    path, first, last = block.include["path"], json.loads(block.include["first"]), json.loads(block.include["last"])
    expected = _excerpt(path, first, last)
    assert block.text == expected, (
        f"{block.page.name}:{block.line} no longer matches {path} from {first!r} to {last!r}; "
        f"the excerpt is now:\n{expected}")


def _exported_classes() -> dict[str, type]:
    """Every operator and sensor class defined in the modules get_provider_info() lists."""
    from airflow.sdk import BaseOperator

    from airflow_delay_provider.get_provider_info import get_provider_info

    info = get_provider_info()
    classes = {}
    for section in ("operators", "sensors"):
        for entry in info[section]:
            for name in entry["python-modules"]:
                module = importlib.import_module(name)
                for attr, value in vars(module).items():
                    public = not attr.startswith("_") and inspect.isclass(value) and value.__module__ == name
                    if public and issubclass(value, BaseOperator):
                        classes[attr] = value
    return classes


def test_every_operator_and_sensor_has_a_howto():
    classes = _exported_classes()
    assert {"DispatchDueMessagesOperator", "DelayedMessagesSensor"} <= set(classes)
    text = "\n".join(page.read_text() for page in PAGES if page.name != "index.md")
    missing = sorted(name for name in classes if not re.search(rf"\b{name}\b", text))
    assert not missing, f"no how-to page in docs/howto/ mentions {missing}"


def test_every_connection_type_and_form_field_is_documented():
    from airflow_delay_provider.get_provider_info import get_provider_info

    text = (HOWTO / "connections.md").read_text()
    missing = []
    for kind in get_provider_info()["connection-types"]:
        names = [kind["connection-type"], *kind.get("conn-fields", {})]
        missing += [f"{kind['connection-type']}: {name}" for name in names if f"`{name}`" not in text]
    assert not missing, f"docs/howto/connections.md does not mention (in backticks) {missing}"


def _accepted_arguments(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None:
            names |= {p.name for p in inspect.signature(init).parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names - {"self"}


def test_operator_arguments_shown_on_the_pages_exist():
    """Code written for a page (not quoted from a file) must parse, and name only arguments the classes take."""
    classes = _exported_classes()
    wrong = []
    for block in BLOCKS:
        if block.lang != "python":
            continue
        try:
            tree = ast.parse(block.text)
        except SyntaxError as exc:
            if block.include:
                continue  # a quoted excerpt may be a fragment; its source is checked by the include test
            pytest.fail(f"{block.page.name}:{block.line}: the python block does not parse: {exc}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in classes:
                accepted = _accepted_arguments(classes[node.func.id])
                wrong += [f"{block.page.name}:{block.line}: {node.func.id}({kw.arg}=...)"
                          for kw in node.keywords if kw.arg is not None and kw.arg not in accepted]
    assert not wrong, f"arguments the classes do not take: {wrong}"


def test_the_index_lists_every_page_and_links_resolve():
    index = (HOWTO / "index.md").read_text()
    unlisted = [page.name for page in PAGES if page.name != "index.md" and f"({page.name})" not in index]
    assert not unlisted, f"docs/howto/index.md does not link to {unlisted}"
    broken = []
    for page in PAGES:
        for match in LINK.finditer(page.read_text()):
            target = match["target"].split("#", 1)[0]
            if target and "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.name}: {match['target']}")
    assert not broken, f"links to files that do not exist: {broken}"


def _command_lines() -> list[tuple[str, str]]:
    """(where, command) of every `airflow delayed-messages ...` line in the pages' shell blocks."""
    found = []
    pages = [*PAGES, *sorted((ROOT / "docs" / "how-it-works").glob("*.md"))]
    for block in (b for page in pages for b in _blocks(page)):
        if block.lang not in ("sh", "bash", "shell", "console", ""):
            continue
        for n, line in enumerate(block.text.splitlines()):
            command = line.removeprefix("$ ").split(" #")[0].split(" |")[0].strip()
            if command.startswith("airflow delayed-messages"):
                found.append((f"{block.page.relative_to(ROOT)}:{block.line + n + 1}", command))
    return found


def test_every_command_line_shown_on_the_pages_parses():
    """The commands a reader copies are taken by Airflow's parser as written (flags, choices, positionals)."""
    import shlex

    from airflow.cli.cli_parser import get_parser

    lines = _command_lines()
    assert len(lines) >= 10, lines
    parser, wrong = get_parser(), []
    for where, command in lines:
        try:
            parser.parse_args(shlex.split(command)[1:])
        except SystemExit:
            wrong.append(f"{where}: {command}")
    assert not wrong, f"commands Airflow's parser refuses: {wrong}"
