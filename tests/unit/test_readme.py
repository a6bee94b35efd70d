"""The README stays a five-minute read: at most MAX_LINES lines, every figure of its benchmark summary found in the
benchmark page the row links to, and every relative link (of the README and the pages it summarises) leading to a
file, and a heading, that exist. The in-memory fakes' example in docs/development.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 300
#: The pages whose relative links are checked here, beside the README (the built site's are checked by
#: scripts/check_docs.py after `make docs`, which rewrites links to the README).
PAGES = [README, *sorted((ROOT / "docs" / "benchmarks").glob("*.md")),
         *(ROOT / "docs" / name for name in ("installing.md", "using.md", "development.md"))]

LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
# A figure as written: 80,110 / 9.4 / 0.000095; not the digits of a word such as p99 or a version such as 3.3.2.
FIGURE = re.compile(r"(?<![\w.,$])\$?(?P<figure>\d+(?:,\d{3})*(?:\.\d+)?)(?![\w.]\d)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links inside code are code)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading, which the docs site uses too (myst_heading_anchors)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", _prose(page.read_text()), re.M)}


def benchmark_rows() -> list[tuple[str, Path, list[str]]]:
    """(row, the benchmark page it links to, the figures it shows) for each row of the README's summary table."""
    rows = []
    for line in _section(README.read_text(), "Benchmarks").splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        links = [m["target"] for m in LINK.finditer(line) if m["target"].startswith("docs/benchmarks/")]
        if not links and line.startswith("| benchmark |"):
            continue  # the header
        assert len(links) == 1, f"README benchmark row links to {len(links)} benchmark pages, not 1: {line}"
        cells = re.sub(r"\[[^\]]*\]\([^)]*\)", "", line)  # the figures, not the link's text or path
        figures = [m["figure"] for m in FIGURE.finditer(cells)]
        rows.append((line, ROOT / links[0].split("#")[0], figures))
    return rows


def test_the_readme_is_read_in_five_minutes():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {MAX_LINES}: move the detail into a page under docs/ and link it")


def test_the_benchmark_summary_has_rows_with_figures():
    rows = benchmark_rows()
    assert len(rows) >= 5, f"the README's benchmark summary has {len(rows)} rows"
    for line, _page, figures in rows:
        assert figures, f"README benchmark row shows no figure: {line}"


@pytest.mark.parametrize("row", benchmark_rows(), ids=lambda row: row[1].stem + ":" + row[0][2:30])
def test_every_figure_of_the_benchmark_summary_is_on_its_page(row):
    line, page, figures = row
    assert page.is_file(), f"README benchmark row links to {page.relative_to(ROOT)}, which does not exist"
    text = page.read_text()
    missing = [f for f in figures
               if not re.search(rf"(?<![\d,.]){re.escape(f)}(?!\d|[.,]\d)", text)]
    assert not missing, (f"README benchmark row shows {', '.join(missing)}, not found in "
                         f"{page.relative_to(ROOT)} (copy figures from the page as it prints them): {line}")


def test_figures_are_read_as_written():
    """The figure pattern itself: what a row's cell holds is what is looked for on the page."""
    cells = "| 80,110 msg/s (48%); p99 26.9 ms; 1.17x; $0.000095; local[2]; 3.3.2; 28,111,700; 7.5-9.4 ms |"
    assert [m["figure"] for m in FIGURE.finditer(cells)] == ["80,110", "48", "26.9", "1.17", "0.000095", "2",
                                                              "28,111,700", "7.5", "9.4"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_and_headings_that_exist(page: Path):
    broken = []
    for match in LINK.finditer(_prose(page.read_text())):
        target = match["target"]
        if re.match(r"^[a-z]+:", target):
            continue  # external: not fetched
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no file {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked})")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no heading with anchor #{anchor} in {linked.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {'; '.join(broken)}"


def test_the_fakes_example_delivers_its_message():
    text = (ROOT / "docs" / "development.md").read_text()
    section = text[text.index("## Extending and testing with the fakes"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/development.md", "exec"), scope)  # noqa: S102 - our own documentation
    assert scope["message"].body == b"x" and scope["message"].destination == "orders"
