"""A costly resource (an Airflow deployment, an api-server) that the tests of more than one file share.

The files of a group (FILE_GROUPS) go to one xdist worker together, one after another in the order given
(tests/conftest.py schedules them so). The resource starts when a test first asks for it and stops right after the
last test of its group that the worker runs: not at the end of the session, where an idle Airflow would go on taking
CPU from the rest of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any, ClassVar

#: group -> its files (under tests/), in the order their tests run. Each group's tests get one resource.
FILE_GROUPS: dict[str, tuple[str, ...]] = {
    # The example DAGs' deployment: first as a first-time user meets it (only the store's connection), then with
    # every service's connection added.
    "examples_deployment": ("deployment/test_first_run.py", "deployment/test_delivery.py"),
    # `airflow api-server` for the backlog page: its behaviour, then its looks.
    "page_api_server": ("integration/test_ui_plugin.py", "integration/test_ui_looks.py"),
}


def group_of(path: str) -> str | None:
    """The group of a test file (a path or a node id ending in one of FILE_GROUPS' files), or None."""
    path = path.split("::", 1)[0]
    for group, files in FILE_GROUPS.items():
        if any(path == f"tests/{file}" or path.endswith(f"/tests/{file}") for file in files):
            return group
    return None


class Shared:
    """The resource of one group of FILE_GROUPS: `get(start)` enters `start()` (a context manager) once and returns
    what it gives; `close()` exits it. The test rig closes it after the last test of the group in a row."""

    _open: ClassVar[dict[str, Shared]] = {}

    def __init__(self, group: str):
        if group not in FILE_GROUPS:
            raise ValueError(f"{group!r} is not one of FILE_GROUPS: {sorted(FILE_GROUPS)}")
        self.group = group
        self._stack: ExitStack | None = None
        self._value: Any = None

    def get(self, start: Callable[[], AbstractContextManager[Any]]) -> Any:
        if self._stack is None:
            stack = ExitStack()
            self._value = stack.enter_context(start())  # a failed start leaves nothing to close
            self._stack = stack
            Shared._open[self.group] = self
        return self._value

    def close(self) -> None:
        stack, self._stack, self._value = self._stack, None, None
        Shared._open.pop(self.group, None)
        if stack is not None:
            stack.close()

    @classmethod
    def close_unless_next(cls, nextitem_path: str | None) -> None:
        """Close every open resource whose group the next test (None: none) is not of."""
        keep = group_of(nextitem_path) if nextitem_path else None
        for group, shared in list(cls._open.items()):
            if group != keep:
                shared.close()
