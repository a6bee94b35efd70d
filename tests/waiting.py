"""Waiting on what a test means instead of sleeping for a while: `wait_for` polls a condition until it holds
(and fails the test, saying what it waited for, when it does not in time); `SleepLog` records a store's
sleeps (a pump's or a trigger's wait for the next due time), so a test acts while the pump really sleeps
and can then check that the sleep was cut short."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll `condition` until it returns something truthy, and return that; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"gave up after {timeout} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Sleep:
    """One wait of a store that a stored (or rescheduled, resumed) message can cut short."""

    until: datetime  # the time it was asked to sleep until, on the store's clock
    listener: Any  # the LISTEN connection it sleeps on (PostgreSQL); None on SQLite, which polls
    began: datetime  # on the store's clock
    ended: datetime | None = None  # on the store's clock; None while it sleeps


class SleepLog:
    """Records the sleeps of a SqlDelayedMessageStore's `wait` and `wait_async` (attach() wraps the methods of
    that one store object; nothing else changes).

    On PostgreSQL a call made before the store's LISTEN connection is open only opens it and returns (so that
    the caller reads the store again): that is no sleep, and is not recorded. Every other call is one sleep,
    woken by a notification of a sooner message; on SQLite, a poll of at most half a second."""

    def __init__(self, store: Any = None) -> None:
        self.sleeps: list[Sleep] = []
        self._changed = threading.Condition()
        if store is not None:
            self.attach(store)

    def attach(self, store: Any) -> SleepLog:
        wait, wait_async = store.wait, store.wait_async

        def watched_wait(until: datetime) -> None:
            sleep = self._begin(store, until, store.waiting.listener)
            try:
                wait(until)
            finally:
                self._end(store, sleep)

        async def watched_wait_async(until: datetime) -> None:
            sleep = self._begin(store, until, store.waiting.subscription)
            try:
                await wait_async(until)
            finally:
                self._end(store, sleep)

        store.wait, store.wait_async = watched_wait, watched_wait_async
        return self

    def _begin(self, store: Any, until: datetime, listener: Any) -> Sleep | None:
        if store.is_postgres and (listener is None or listener.closed):
            return None  # this call opens the listener and returns at once
        sleep = Sleep(until, listener, store.clock())
        with self._changed:
            self.sleeps.append(sleep)
            self._changed.notify_all()
        return sleep

    def _end(self, store: Any, sleep: Sleep | None) -> None:
        if sleep is None:
            return
        ended = store.clock()
        with self._changed:
            sleep.ended = ended
            self._changed.notify_all()

    def asleep(self, timeout: float, what: str, matching: Callable[[Sleep], bool] = lambda s: True) -> Sleep:
        """Wait until the store sleeps in a wait that `matching` accepts, and return that sleep."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((s for s in self.sleeps if s.ended is None and matching(s)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"gave up after {timeout} s waiting for the store to sleep {what}; "
                                         f"its sleeps: {self.sleeps}")
                self._changed.wait(left)
