"""Sensors on the delay store: nothing left scheduled before a time, or a backlog past a threshold."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, Context, conf

from airflow_delay_provider import metrics
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError, UnavailableError
from airflow_delay_provider.core.requests import parse_moment
from airflow_delay_provider.hooks.delay_store import DelayStoreMixin
from airflow_delay_provider.triggers.delay_store import ScheduledMessagesTrigger


class DelayedMessagesSensor(DelayStoreMixin, BaseSensorOperator):
    """Succeeds when no message (for `destination`, if given) is scheduled before `before`.

    Counts every `poke_interval` and fails after `timeout`, as any sensor.

    :param destination: count only this destination (templated); default: every destination.
    :param before: an aware datetime or ISO string (templated); default: no bound, so the sensor waits
        until everything stored has been dispatched.
    :param deferrable: wait in the triggerer (ScheduledMessagesTrigger) instead of a worker slot; default:
        `[operators] default_deferrable`.
    """

    template_fields: Sequence[str] = ("destination", "before")

    def __init__(
        self,
        *,
        destination: str | None = None,
        before: datetime | str | None = None,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.destination = destination
        self.before = before
        self.deferrable = deferrable

    def _scheduled(self) -> dict[str, int]:
        store = self.hook.checked_store()  # never created by a sensor
        return store.count_scheduled(parse_moment(self.before, "before"), self.destination)

    def poke(self, context: Context) -> bool:
        counts = self._scheduled()
        if counts:
            self.log.info("Still scheduled: %s", counts)
        return not counts

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        if self.poke(context):
            return None
        self.defer(
            trigger=ScheduledMessagesTrigger(
                delay_store_conn_id=self.delay_store_conn_id,
                table=self.table,
                db_schema=self.db_schema,
                due_before=None if self.before is None else parse_moment(self.before, "before").isoformat(),
                deadline=(utcnow() + timedelta(seconds=self.timeout)).isoformat(),
                poll_interval=self.poke_interval,
                destination=self.destination,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict) -> None:
        status = event.get("status")
        if status == "drained":
            return None
        if status == "timeout":
            from airflow.sdk.exceptions import AirflowSensorTimeout

            raise AirflowSensorTimeout(f"messages still scheduled after {self.timeout} s: {event.get('scheduled')}")
        raise UnavailableError(f"waiting on the delay store failed: {event.get('message')}")


class DelayBacklogSensor(DelayStoreMixin, BaseSensorOperator):
    """Succeeds when the store's backlog crosses a threshold.

    Each poke sets the `delay_provider.store.<destination>.<measure>` gauges; the task returns the
    counts (measure, total, and per destination).

    :param threshold: the number of messages to cross (an int >= 0; templated).
    :param comparison: `"below"` (default): succeed at `threshold` messages or fewer (e.g. wait for a
        sweep to catch up); `"above"`: at `threshold` or more (e.g. start a bulk sweep only when one
        pump is not enough).
    :param measure: `"due"` (default): count messages already due (the dispatch backlog);
        `"scheduled"`: every stored message (a queue's NumberOfMessagesDelayed).
    :param destination: count only this destination (templated); default: all.
    """

    template_fields: Sequence[str] = ("destination", "threshold")
    MEASURES = ("due", "scheduled")
    COMPARISONS = ("below", "above")

    def __init__(
        self,
        *,
        threshold: int | str,
        comparison: str = "below",
        measure: str = "due",
        destination: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if comparison not in self.COMPARISONS:
            raise InvalidInputError(
                f"comparison {comparison!r} is not supported; choose one of {list(self.COMPARISONS)}")
        if measure not in self.MEASURES:
            raise InvalidInputError(f"measure {measure!r} is not supported; choose one of {list(self.MEASURES)}")
        if "{{" not in str(threshold):
            _threshold(threshold)
        self.threshold = threshold
        self.comparison = comparison
        self.measure = measure
        self.destination = destination
        self.counts: dict[str, int] = {}

    def poke(self, context: Context) -> bool:
        store = self.hook.checked_store()  # never created by a sensor
        before = utcnow() if self.measure == "due" else None
        self.counts = store.count_scheduled(before, self.destination)
        metrics.gauge_backlog(self.measure, self.counts or {self.destination or "all": 0})
        total = sum(self.counts.values())
        limit = _threshold(self.threshold)
        crossed = total <= limit if self.comparison == "below" else total >= limit
        self.log.info("%d message(s) %s (%s); waiting for %s %d: %s", total, self.measure, self.counts,
                      "at most" if self.comparison == "below" else "at least", limit,
                      "reached" if crossed else "not yet")
        return crossed

    def execute(self, context: Context) -> dict:
        super().execute(context)
        return {"measure": self.measure, "total": sum(self.counts.values()), "counts": self.counts}


def _threshold(value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if isinstance(value, bool) or n < 0:
        raise InvalidInputError(f"threshold must be an int >= 0, got {value!r}")
    return n
