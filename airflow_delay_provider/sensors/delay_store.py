"""DelayedMessagesSensor: wait until nothing (for a destination, or at all) is still scheduled before a time."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Sequence

from airflow.sdk import BaseSensorOperator, Context

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import UnavailableError
from airflow_delay_provider.core.requests import parse_moment
from airflow_delay_provider.hooks.delay_store import DelayStoreHook
from airflow_delay_provider.triggers.delay_store import ScheduledMessagesTrigger


class DelayedMessagesSensor(BaseSensorOperator):
    """Succeeds when no message (for `destination`, if given) is scheduled before `before`.

    `before` defaults to no bound: the sensor waits until everything stored has been dispatched.
    In `deferrable=True` mode the waiting happens in the triggerer.
    """

    template_fields: Sequence[str] = ("destination", "before")

    def __init__(
        self,
        *,
        destination: str | None = None,
        before: datetime | str | None = None,
        delay_store_conn_id: str | None = None,
        table: str | None = None,
        db_schema: str | None = None,
        deferrable: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.destination = destination
        self.before = before
        self.delay_store_conn_id = delay_store_conn_id
        self.table = table
        self.db_schema = db_schema
        self.deferrable = deferrable

    def _scheduled(self) -> dict[str, int]:
        store = DelayStoreHook(self.delay_store_conn_id, table=self.table, db_schema=self.db_schema).get_store()
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

            raise AirflowSensorTimeout(f"messages still scheduled after {self.timeout} s: {self._scheduled()}")
        raise UnavailableError(f"waiting on the delay store failed: {event.get('message')}")
