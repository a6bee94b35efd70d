"""Run by `make docs` after sphinx-build: every public hook, operator, sensor and trigger the provider declares has
its entry in the reference, and every link between the built pages leads to a page (and anchor) that exists.
External links are listed, not fetched (nothing may be downloaded here)."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag

from airflow_delay_provider.get_provider_info import get_provider_info

BUILT = Path(__file__).resolve().parent.parent / "docs" / "_build" / "html"
KINDS = ("hooks", "operators", "sensors", "triggers")


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"] or "")
        if tag == "a" and values.get("href"):
            self.links.append(values["href"] or "")


def public_classes() -> list[tuple[str, str]]:
    """(module, class) of each class a declared hook, operator, sensor or trigger module defines and exports."""
    from airflow.sdk import BaseHook, BaseOperator
    from airflow.triggers.base import BaseTrigger

    found = []
    info = get_provider_info()
    for kind in KINDS:
        for module_name in (m for entry in info[kind] for m in entry["python-modules"]):
            module = importlib.import_module(module_name)
            for name, obj in vars(module).items():
                if (inspect.isclass(obj) and obj.__module__ == module_name and not name.startswith("_")
                        and issubclass(obj, (BaseHook, BaseOperator, BaseTrigger))):
                    found.append((module_name, name))
    return found


def main() -> int:
    pages: dict[Path, _Page] = {}
    for path in BUILT.rglob("*.html"):
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = page
    problems = []
    classes = public_classes()
    for module_name, name in classes:
        page = pages.get((BUILT / "reference" / Path(*module_name.split(".")) / "index.html").resolve())
        if page is None or f"{module_name}.{name}" not in page.ids:
            problems.append(f"no reference entry for {module_name}.{name}")
    external = set()
    for path, page in pages.items():
        for href in page.links:
            if re.match(r"^[a-z]+:", href):
                external.add(href)
                continue
            target, anchor = urldefrag(href)
            linked = (path.parent / unquote(target)).resolve() if target else path
            if linked.suffix != ".html":  # images, sources and downloads: the file must be there
                if not linked.exists():
                    problems.append(f"{path.relative_to(BUILT)}: broken link {href}")
                continue
            if linked not in pages:
                problems.append(f"{path.relative_to(BUILT)}: link to a missing page {href}")
            elif anchor and unquote(anchor) not in pages[linked].ids:
                problems.append(f"{path.relative_to(BUILT)}: link to a missing anchor {href}")
    for problem in problems:
        print(problem)
    print(f"docs: {len(pages)} pages, {len(classes)} hooks/operators/sensors/triggers in the reference, "
          f"{sum(len(p.links) for p in pages.values())} links checked, {len(external)} external links not fetched, "
          f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
