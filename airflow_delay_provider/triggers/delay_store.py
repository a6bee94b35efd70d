"""Triggers that wait on the delayed-message store in the triggerer, so no worker slot is held."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_delay_provider.core.delays import utcnow


def _parse(moment: str | None) -> datetime | None:
    return None if moment is None else datetime.fromisoformat(moment)


class _StoreTrigger(BaseTrigger):
    def __init__(
        self,
        delay_store_conn_id: str | None = None,
        table: str | None = None,
        db_schema: str | None = None,
        due_before: str | None = None,
        deadline: str | None = None,
        poll_interval: float = 5.0,
        destination: str | None = None,
        carry: dict | None = None,
    ) -> None:
        super().__init__()
        self.carry = carry
        self.delay_store_conn_id = delay_store_conn_id
        self.table = table
        self.db_schema = db_schema
        self.due_before = due_before
        self.deadline = deadline
        self.poll_interval = float(poll_interval)
        self.destination = destination

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "delay_store_conn_id": self.delay_store_conn_id,
                "table": self.table,
                "db_schema": self.db_schema,
                "due_before": self.due_before,
                "deadline": self.deadline,
                "poll_interval": self.poll_interval,
                "destination": self.destination,
                "carry": self.carry,
            },
        )

    def event(self, status: str, **fields: Any) -> TriggerEvent:
        """An event carrying `carry` back: the deferred task's JSON state, returned to it on resume."""
        return TriggerEvent({"status": status, "carry": self.carry, **fields})

    async def _store(self):
        from airflow_delay_provider.hooks.delay_store import DelayStoreHook

        hook = DelayStoreHook(self.delay_store_conn_id, table=self.table, db_schema=self.db_schema)
        return await hook.aget_store()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            store = await self._store()
            due_before, deadline = _parse(self.due_before), _parse(self.deadline)
            while True:
                event, wake_at = await self._check(store, due_before)
                if event is None and deadline is not None and utcnow() >= deadline:
                    event = self.event("timeout")
                if event is not None:
                    yield event
                    return
                await asyncio.sleep(self._sleep_for(wake_at, deadline))
        except Exception as exc:  # reported to execute_complete, which fails the task with it
            yield self.event("error", message=f"{type(exc).__name__}: {exc}")

    async def _check(self, store, due_before: datetime | None) -> tuple[TriggerEvent | None, datetime | None]:
        """The event to fire now, if any, and when to look again at the latest."""
        raise NotImplementedError

    def _sleep_for(self, wake_at: datetime | None, deadline: datetime | None) -> float:
        now = utcnow()
        limits = [self.poll_interval]
        limits += [(moment - now).total_seconds() for moment in (wake_at, deadline) if moment is not None]
        return max(0.0, min(limits))


class DueTimeoutTrigger(_StoreTrigger):
    """Fires `due` when a stored message (before `due_before`, if given) is due; `drained` when the
    window holds nothing more; `timeout` at `deadline`. Re-reads the store every `poll_interval`
    seconds, so a sooner message stored meanwhile is noticed."""

    async def _check(self, store, due_before):
        next_due = await asyncio.to_thread(store.next_due, self.destination, due_before)
        if next_due is not None and next_due <= utcnow():
            return self.event("due", next_due=next_due.isoformat()), None
        if next_due is None and due_before is not None:
            return self.event("drained"), None
        return None, next_due


class ScheduledMessagesTrigger(_StoreTrigger):
    """Fires `drained` once nothing (for `destination`, if given) is scheduled before `due_before`;
    `timeout` at `deadline`."""

    async def _check(self, store, due_before):
        counts = await asyncio.to_thread(store.count_scheduled, due_before, self.destination)
        return (self.event("drained") if not counts else None), None
