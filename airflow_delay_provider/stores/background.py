"""Store work that runs beside the pumps: started from their loop, done in a thread, never waited for."""

from __future__ import annotations

import threading
import time


class BackgroundWork:
    """Work a pump's loop starts on each pass (`start()`), done in a daemon thread at most every `interval()`
    seconds and never twice at once in a process, so a slow pass (a vacuum, a move of millions) never blocks a
    claim. Subclasses give `run` and `interval`, read at each call so that tests can shorten it."""

    thread_name = "delay-store-background"

    def __init__(self) -> None:
        self.checked = -float("inf")
        self.thread: threading.Thread | None = None

    def interval(self) -> float:
        raise NotImplementedError

    def run(self) -> object:
        raise NotImplementedError

    def start(self) -> None:
        """Start `run` in a background thread when it is time (never blocks)."""
        if time.monotonic() - self.checked < self.interval():
            return
        if self.thread is not None and self.thread.is_alive():
            return
        self.checked = time.monotonic()
        self.thread = threading.Thread(target=self.run, name=self.thread_name, daemon=True)
        self.thread.start()
