"""What a pump is told (`PumpConfig`) and what its run gives back (`PumpResult`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from airflow_delay_provider.core.checks import check_int, check_number
from airflow_delay_provider.core.delays import UTC
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.message import check_destination
from airflow_delay_provider.core.stats import PumpStats

#: Later than any due time: claiming "due by then" claims everything stored.
END_OF_TIME = datetime(9999, 1, 1, tzinfo=UTC)


@dataclass
class PumpConfig:
    batch_size: int = 1000
    #: The first claim after the pump wakes from waiting for a due time takes this many messages, and each
    #: next one twice as many up to batch_size: the head of a burst is delivered within milliseconds of its
    #: due time instead of after a whole batch has been claimed, sent and committed.
    first_batch_size: int = 16
    number_of_retries: int = 0
    error_queue: str = "error"
    #: Longest sleep while idle; a sooner message wakes the pump earlier where the store can tell.
    max_idle_seconds: float = 60.0
    time_to_trigger_fetch_circuit_breaker: float = 30.0
    time_to_trigger_dispatch_circuit_breaker: float = 30.0
    maximum_recovery_failures_per_second: float = 1.0
    progress_interval_seconds: float = 10.0
    #: Each retry's delay is spread by up to +/- this fraction (within the policy's bounds), so a burst
    #: that failed together does not retry together.
    retry_jitter: float = 0.1

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1, 10_000)
        check_int("first_batch_size", self.first_batch_size, 1)
        check_int("number_of_retries", self.number_of_retries, 0, 100)
        try:
            check_destination(self.error_queue)
        except InvalidInputError as exc:
            raise InvalidInputError(f"error_queue: {exc}") from None
        check_number("retry_jitter", self.retry_jitter, 0, 1, what="a fraction")
        for name in ("max_idle_seconds", "time_to_trigger_fetch_circuit_breaker",
                     "time_to_trigger_dispatch_circuit_breaker", "maximum_recovery_failures_per_second"):
            check_number(name, getattr(self, name), above=0)


@dataclass
class PumpResult:
    """Why a run stopped: `deadline`, `max_messages`, `drained` (nothing left in the window), `idle` or
    `stopped` (`Pump.stop()` was called)."""

    stats: PumpStats
    reason: str
    next_due: datetime | None = None
