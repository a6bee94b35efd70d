"""BackgroundWork: started from a loop on every pass, run at most every interval and never twice at once."""

from __future__ import annotations

import threading

from airflow_delay_provider.stores.background import BackgroundWork


class Counted(BackgroundWork):
    thread_name = "test-background"

    def __init__(self, every: float) -> None:
        super().__init__()
        self.every = every
        self.runs = 0
        self.release = threading.Event()
        self.running = threading.Event()

    def interval(self) -> float:
        return self.every

    def run(self) -> int:
        self.runs += 1
        self.running.set()
        self.release.wait(10)
        return self.runs


def test_a_run_in_progress_is_never_started_again_and_the_caller_never_waits():
    work = Counted(every=0.0)
    work.start()
    assert work.running.wait(10)
    first = work.thread
    for _ in range(100):  # interval 0: only the run in progress holds them back
        work.start()
    assert work.thread is first and work.runs == 1
    assert first is not None and first.name == "test-background" and first.daemon
    work.release.set()
    first.join(10)
    work.start()
    assert work.thread is not first
    work.thread.join(10)
    assert work.runs == 2


def test_the_interval_counts_from_the_last_start_and_is_read_at_each_call():
    work = Counted(every=3600.0)
    work.release.set()
    work.start()
    assert work.thread is not None
    work.thread.join(10)
    work.start()  # finished, but started less than an hour ago
    assert work.runs == 1
    work.every = 0.0  # as a test that shortens the module's constant
    work.start()
    work.thread.join(10)
    assert work.runs == 2
