"""When a process reads again where its scans start (engine.IndexStart), with a clock the test moves."""

from __future__ import annotations

import pytest

from airflow_delay_provider.stores.engine import START_SECONDS, IndexStart
from tests.helpers import EngineClock


@pytest.fixture
def clock(monkeypatch) -> EngineClock:
    return EngineClock.install(monkeypatch)


class Readings:
    """A read function: the first wanted key and the mark, both moving on with each reading; records each call."""

    def __init__(self) -> None:
        self.walks: list[int] = []

    def __call__(self, walk_from: int, _look_ahead: float) -> tuple[int | None, int]:
        self.walks.append(walk_from)
        return 100 * len(self.walks), 100 * len(self.walks) + 50


def test_the_first_call_after_a_wait_keeps_the_start_and_the_next_call_reads(clock):
    start, read = IndexStart(), Readings()
    start.current(read)  # the first reading (full): nothing to keep yet
    clock.now += START_SECONDS
    kept = start.current(read)
    assert len(read.walks) == 2
    clock.now += 30 * START_SECONDS  # a pump asleep until a due time
    assert start.current(read) == kept and len(read.walks) == 2  # woken: no reading before its claim
    assert start.current(read) != kept and len(read.walks) == 3  # its next claim reads
    assert read.walks[-1] == 0  # a full one, as was due


def test_a_caller_that_always_waits_still_reads_at_every_other_call(clock):
    start, read = IndexStart(), Readings()
    start.current(read)
    for _ in range(10):
        clock.now += 5 * START_SECONDS
        start.current(read)
    assert len(read.walks) == 1 + 5


def test_a_start_lowered_during_a_wait_is_what_the_first_call_after_it_uses(clock):
    start, read = IndexStart(), Readings()
    start.current(read)
    clock.now += START_SECONDS
    start.current(read)
    start.lower(7)  # the pump's read of the next due time, before it sleeps
    clock.now += 30 * START_SECONDS
    assert start.current(read) == 7


def test_calls_without_waits_read_once_a_second(clock):
    start, read = IndexStart(), Readings()
    for _ in range(100):
        start.current(read)
        clock.now += START_SECONDS / 10
    assert len(read.walks) == 10
