"""Dispatch counters and a small mergeable lateness histogram (JSON-able, so it survives a deferral)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

# Log-spaced buckets: bucket k holds lateness in [R**(k-1), R**k) milliseconds; 1% resolution
# keeps p99 honest while the state stays a few hundred integers whatever the message count.
_RATIO = 1.01


def _bucket(seconds: float) -> int:
    ms = max(seconds, 0.0) * 1000.0
    return 0 if ms < 1.0 else int(math.log(ms, _RATIO)) + 1


def _bucket_upper_seconds(k: int) -> float:
    return 0.001 if k == 0 else _RATIO**k / 1000.0


@dataclass
class LatenessHistogram:
    buckets: dict[int, int] = field(default_factory=dict)
    count: int = 0
    max_seconds: float = 0.0

    def add(self, seconds: float, n: int = 1) -> None:
        """Record `n` messages `seconds` late."""
        k = _bucket(seconds)
        self.buckets[k] = self.buckets.get(k, 0) + n
        self.count += n
        self.max_seconds = max(self.max_seconds, seconds)

    def merge(self, other: LatenessHistogram) -> None:
        for k, n in other.buckets.items():
            self.buckets[k] = self.buckets.get(k, 0) + n
        self.count += other.count
        self.max_seconds = max(self.max_seconds, other.max_seconds)

    def percentile(self, p: float) -> float | None:
        """Upper bound of the bucket holding the p-th percentile (never above the true maximum)."""
        if not self.count:
            return None
        rank = math.ceil(p / 100.0 * self.count)
        seen = 0
        for k in sorted(self.buckets):
            seen += self.buckets[k]
            if seen >= rank:
                return min(_bucket_upper_seconds(k), self.max_seconds)
        return self.max_seconds

    def to_dict(self) -> dict[str, Any]:
        return {"buckets": {str(k): n for k, n in self.buckets.items()}, "count": self.count, "max": self.max_seconds}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> LatenessHistogram:
        if not data:
            return cls()
        return cls({int(k): int(n) for k, n in data["buckets"].items()}, int(data["count"]), float(data["max"]))


@dataclass
class PumpStats:
    dispatched: int = 0
    retried: int = 0
    dead_lettered: int = 0
    #: Claimed but handed back untouched because the transport was unavailable.
    released: int = 0
    batches: int = 0
    lateness: LatenessHistogram = field(default_factory=LatenessHistogram)
    #: Per destination: outcome -> count (outcomes: dispatched, failed, dead_lettered, released).
    destinations: dict[str, dict[str, int]] = field(default_factory=dict)

    def count(self, destination: str, outcome: str, n: int = 1) -> None:
        outcomes = self.destinations.get(destination)
        if outcomes is None:
            outcomes = self.destinations[destination] = {}
        outcomes[outcome] = outcomes.get(outcome, 0) + n

    def merge(self, other: PumpStats) -> None:
        for destination, outcomes in other.destinations.items():
            for outcome, n in outcomes.items():
                self.count(destination, outcome, n)
        self.dispatched += other.dispatched
        self.retried += other.retried
        self.dead_lettered += other.dead_lettered
        self.released += other.released
        self.batches += other.batches
        self.lateness.merge(other.lateness)

    def summary(self) -> dict[str, Any]:
        """What a task returns to XCom: plain numbers, lateness in seconds."""
        p50, p99 = self.lateness.percentile(50), self.lateness.percentile(99)
        return {
            "dispatched": self.dispatched,
            "failed": self.retried,
            "dead_lettered": self.dead_lettered,
            "released": self.released,
            "batches": self.batches,
            "lateness_p50_seconds": None if p50 is None else round(p50, 4),
            "lateness_p99_seconds": None if p99 is None else round(p99, 4),
            "lateness_max_seconds": round(self.lateness.max_seconds, 4) if self.lateness.count else None,
            "destinations": {d: dict(o) for d, o in sorted(self.destinations.items())},
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary(), "lateness": self.lateness.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> PumpStats:
        if not data:
            return cls()
        return cls(
            dispatched=int(data["dispatched"]),
            retried=int(data["failed"]),
            dead_lettered=int(data["dead_lettered"]),
            released=int(data.get("released", 0)),
            batches=int(data["batches"]),
            lateness=LatenessHistogram.from_dict(data.get("lateness")),
            destinations={d: dict(o) for d, o in (data.get("destinations") or {}).items()},
        )


def moved_stats(moved: list[tuple[str, datetime, int]], sent_at: datetime) -> PumpStats:
    """The counts of a batch a transport moved itself ((destination, due time, how many) per group)."""
    stats = PumpStats(batches=1 if moved else 0)
    for destination, due_at, n in moved:
        stats.dispatched += n
        stats.count(destination, "dispatched", n)
        stats.lateness.add((sent_at - due_at).total_seconds(), n)
    return stats
