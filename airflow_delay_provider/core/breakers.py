"""Circuit breakers of the external store's poller: keep going through short outages, stop loudly when they last."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from airflow_delay_provider.core.errors import CriticalError

log = logging.getLogger(__name__)
T = TypeVar("T")
#: How often a breaker waiting for something to be created (`not_ready`) says so again.
NOT_READY_EVERY_SECONDS = 60.0


class CircuitBreaker:
    """The first failure arms a timer, a success disarms it, each failure waits; past the timer: CriticalError."""

    def __init__(
        self,
        name: str,
        time_to_trigger: float = 30.0,
        wait_after_failure: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.name = name
        self.time_to_trigger = time_to_trigger
        self.wait_after_failure = wait_after_failure
        self._clock = clock
        self._sleep = sleep
        self.armed_at: float | None = None
        self._failed_at = -math.inf  # when the wait after the last failure ended
        self._waiting: tuple[float, str] | None = None  # when `not_ready` last said what, while it waits

    def like(self, name: str) -> CircuitBreaker:
        """A breaker of its own with the same timings, for a second thing that can fail (a store and a broker:
        one's success must not disarm the other's outage)."""
        return CircuitBreaker(name, self.time_to_trigger, self.wait_after_failure, self._clock, self._sleep)

    def attempt(self) -> None:
        """Before each try: failures are an outage while they follow each other. One after nothing was tried for as
        long as the breaker allows (a pump that waited for a due time, a caller back much later) arms it afresh; a
        slow try that starts right after a failure is measured from the first."""
        if self.armed_at is not None and self._clock() - self._failed_at >= self.time_to_trigger:
            self.armed_at = None

    def success(self) -> None:
        if self.armed_at is not None:
            log.info("%s circuit breaker disarmed", self.name)
        self.armed_at = None
        self._waiting = None

    def not_ready(self, error: BaseException) -> None:
        """Not a failure: what is needed is not created yet (a store before its provisioning ran). Waits as after
        a failure and says why at most once a minute (and when the reason changes), but neither arms nor disarms
        the breaker: provisioning may take longer than the breaker allows, and nothing is down."""
        now, said = self._clock(), str(error)
        if self._waiting is None or self._waiting[1] != said or now - self._waiting[0] >= NOT_READY_EVERY_SECONDS:
            self._waiting = (now, said)
            log.warning("%s; %s waits for it (said again each minute)", said, self.name)
        self._sleep(self.wait_after_failure)

    def failure(self, error: BaseException) -> None:
        now = self._clock()
        if self.armed_at is None:
            self.armed_at = now
            log.warning("%s circuit breaker armed (trips after %.0f s of failures): %s",
                        self.name, self.time_to_trigger, error)
        elif now - self.armed_at >= self.time_to_trigger:
            raise CriticalError(
                f"{self.name} kept failing for {now - self.armed_at:.0f} s (allowed: {self.time_to_trigger:.0f} s); "
                f"last error: {type(error).__name__}: {error}"
            ) from error
        self._sleep(self.wait_after_failure)
        self._failed_at = self._clock()  # the next try follows this failure from the end of its wait


class RateBreaker:
    """Trips when more than `max_per_second * window` failures happen within `window` seconds."""

    def __init__(
        self,
        name: str,
        max_per_second: float = 1.0,
        window: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_per_second <= 0:
            raise ValueError(f"maximum failures per second must be > 0, got {max_per_second}")
        self.name = name
        self.limit = max_per_second * window
        self.window = window
        self._clock = clock
        self._failures: deque[float] = deque()

    def failure(self, error: BaseException | str) -> None:
        now = self._clock()
        self._failures.append(now)
        while self._failures and self._failures[0] <= now - self.window:
            self._failures.popleft()
        if len(self._failures) > self.limit:
            raise CriticalError(
                f"{self.name}: {len(self._failures)} failures within {self.window:.0f} s "
                f"(allowed: {self.limit:.0f}); last error: {error}"
            )


def call_with_breaker(breaker: CircuitBreaker, fn: Callable[[], T], retry_on: tuple[type[BaseException], ...]) -> T:
    """Call `fn`, retrying the errors in `retry_on` under the breaker until it succeeds or the breaker trips."""
    while True:
        try:
            result = fn()
        except retry_on as exc:
            breaker.failure(exc)
            continue
        breaker.success()
        return result
