"""The README's example of the in-memory fakes runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_fakes_example_delivers_its_message():
    text = README.read_text()
    section = text[text.index("## Extending and testing with the fakes"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
    assert scope["message"].body == b"x" and scope["message"].destination == "orders"
