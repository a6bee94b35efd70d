"""Token buckets: at most `rate` deliveries per second per destination (a delivery policy's maxReceivesPerSecond)."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """Up to `rate` tokens (one second's worth), refilled continuously, starting with one: any window
    of T seconds sees at most max(rate, 1) + rate x T deliveries (a burst of one second's worth after
    an idle spell, then the rate). Never blocks: the pump holds back what it may not send yet and
    claims it again later."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 deliveries per second, got {rate}")
        self.rate = float(rate)
        self._clock = clock
        self._tokens = 1.0 if rate >= 1 else rate
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(max(self.rate, 1.0), self._tokens + (now - self._last) * self.rate)
        self._last = now

    def take_up_to(self, n: int) -> int:
        """Take as many whole tokens as are there, at most `n`; returns how many were taken."""
        self._refill()
        taken = min(n, int(self._tokens))
        self._tokens -= taken
        return taken

    def empty(self) -> bool:
        self._refill()
        return self._tokens < 1


class SharedBucket:
    """A token bucket kept where every pump of a store sees it (a row per destination), so N pumps
    together deliver at most `rate` per second, not N times it. `take(n)` takes up to `n` tokens from
    the shared bucket and returns (taken, tokens left); `empty()` answers from the last take without
    asking again (the bucket holds at most what refilled since, as other pumps only take from it)."""

    def __init__(self, rate: float, take: Callable[[int], tuple[int, float]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 deliveries per second, got {rate}")
        self.rate = float(rate)
        self._take = take
        self._clock = clock
        self._left: tuple[float, float] | None = None  # (tokens left, when)

    def take_up_to(self, n: int) -> int:
        taken, left = self._take(n)
        self._left = (left, self._clock())
        return taken

    def empty(self) -> bool:
        if self._left is None:
            return False
        left, at = self._left
        return left + (self._clock() - at) * self.rate < 1
