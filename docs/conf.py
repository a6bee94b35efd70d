"""Sphinx configuration: the reference from the docstrings (sphinx-autoapi, which reads the source without
importing it), and the how-to and how-it-works pages and the README as Markdown (MyST). `make docs` builds it
with warnings as errors."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_version = re.search(r'__version__ = "([^"]+)"', (ROOT / "airflow_delay_provider" / "__init__.py").read_text())

project = "airflow-delay-provider"
author = "The airflow-delay-provider authors"
copyright = "2026, The airflow-delay-provider authors"  # noqa: A001 - Sphinx's name
release = version = _version[1] if _version else "0"

extensions = ["myst_parser", "autoapi.extension"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "pypi.md"]

myst_heading_anchors = 4  # the pages link to each other's sections by their GitHub anchors
myst_enable_extensions = ["colon_fence"]

autoapi_type = "python"
autoapi_dirs = [str(ROOT / "airflow_delay_provider")]
autoapi_root = "reference"
autoapi_options = ["members", "show-inheritance", "show-module-summary", "imported-members"]
autoapi_ignore = ["*/ui/static/*"]
autoapi_keep_files = False
autodoc_typehints = "description"

html_theme = "alabaster"
html_title = f"airflow-delay-provider {release}"

#: The repository, for links to files outside the docs (the example DAGs, the source).
REPOSITORY = "https://github.com/airflow-delay-provider/airflow-delay-provider/blob/main/"
# Pages link to the README (and the README to the changelog) as files in the repository; here the README is
# the overview page and the changelog a page of its own. Links to other files of the repository go to it.
_LINKS = [
    (re.compile(r"\]\((?:\.\./)+README\.md"), "](/overview.md"),
    (re.compile(r"\]\(CHANGELOG\.md\)"), "](/changelog.md)"),
    (re.compile(r"\]\((?:\.\./)+((?:dags|bench|tests|airflow_delay_provider|scripts)[^)]*)\)"),
     "](" + REPOSITORY + r"\1)"),
]


def _rewrite(text: str) -> str:
    for pattern, replacement in _LINKS:
        text = pattern.sub(replacement, text)
    return text


def _source_read(_app, _docname, source) -> None:
    source[0] = _rewrite(source[0])


def _include_read(_app, _path, _docname, content) -> None:
    content[0] = _rewrite(content[0])


def setup(app):
    from pygments.lexers.special import TextLexer

    app.add_lexer("mermaid", TextLexer)  # the diagrams' source, shown as text (GitHub draws them)
    app.connect("source-read", _source_read)
    app.connect("include-read", _include_read)
