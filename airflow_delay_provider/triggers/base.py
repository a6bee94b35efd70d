"""What every trigger of this provider shares: `DelayTrigger`, the one shape they all have.

A trigger declares the constructor arguments it serialises (`serialized_fields`, each also an attribute
of the same name) and implements `outcome()`, which returns its one final event; `run()` turns a failure
into an `error` event (whose message never carries a connection's secret), holds the final event (see
`hold_final_event`) and releases what `outcome()` opened through `release()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any, ClassVar

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_delay_provider.core.delays import utcnow

#: Airflow 3.3 fails a deferred task whose trigger fires before the scheduler has processed the
#: worker's exit from the deferral (the stale executor event; apache/airflow#67287, #71580, #72716).
#: In a triggerer, the final event is therefore held until this long after the trigger started.
#: Only the task's resume waits; messages are still delivered at their due times.
MIN_SECONDS_BEFORE_EVENT = 10.0


async def hold_final_event(trigger: BaseTrigger, started: float) -> None:
    """Sleep until `MIN_SECONDS_BEFORE_EVENT` after `started` (time.monotonic()); not when the trigger runs
    in line under `dag.test()`, where no scheduler races it (Airflow sets trigger_id only in a triggerer)."""
    if getattr(trigger, "trigger_id", None) is None:
        return
    left = started + MIN_SECONDS_BEFORE_EVENT - time.monotonic()
    if left > 0:
        await asyncio.sleep(left)


def error_message(exc: BaseException) -> str:
    """`Type: message` of an exception, for an event (kept in the metadata database and shown in the task's
    log): the provider's own errors never name a password, and what a library put in its text is redacted
    with Airflow's secrets masker, which knows every connection secret this process has read."""
    message = f"{type(exc).__name__}: {exc}"
    try:
        from airflow.sdk._shared.secrets_masker import redact
    except ImportError:  # another Airflow layout: the provider's messages carry no secret anyway
        return message
    return str(redact(message))


def parse_time(moment: str | None) -> datetime | None:
    """An ISO time as serialised in a trigger's kwargs; None or "" for none."""
    return None if moment in (None, "") else datetime.fromisoformat(moment)


async def sleep_until_next_poll(poll_interval: float, deadline: datetime | None) -> bool:
    """Sleep `poll_interval` seconds, or less up to `deadline`; False at once when `deadline` has passed."""
    now = utcnow()
    if deadline is not None and now >= deadline:
        return False
    left = poll_interval if deadline is None else (deadline - now).total_seconds()
    await asyncio.sleep(max(0.0, min(poll_interval, left)))
    return True


class SerializedFields:
    """A trigger serialised from `serialized_fields` (for task triggers and asset watchers' event triggers)."""

    #: The constructor arguments `serialize()` returns, each also an attribute of the same name. Triggers
    #: serialised by an older version are rebuilt from these kwargs: add fields with defaults only.
    serialized_fields: ClassVar[tuple[str, ...]] = ()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        classpath = f"{type(self).__module__}.{type(self).__qualname__}"
        return classpath, {f: getattr(self, f) for f in self.serialized_fields}


class DelayTrigger(SerializedFields, BaseTrigger):
    """The base of this provider's triggers: serialised from `serialized_fields`, one final event built by
    `event()` from a status and fields, `error_event()` for a failure, held by `hold_final_event`."""

    def event(self, status: str, **fields: Any) -> TriggerEvent:
        """The event with `status` (what the task's execute_complete looks at first) and `fields`."""
        return TriggerEvent({"status": status, **fields})

    def error_event(self, exc: Exception, **fields: Any) -> TriggerEvent:
        """The `error` event of a failure, reported to execute_complete, which fails the task with it."""
        return self.event("error", message=error_message(exc), **fields)

    async def outcome(self) -> TriggerEvent:
        """Wait, work, and return the final event; an exception becomes `error_event(exc)`."""
        raise NotImplementedError

    async def release(self) -> None:
        """Close what `outcome()` opened: after the event was taken, or when the trigger is cancelled."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        try:
            try:
                event = await self.outcome()
            except Exception as exc:
                event = self.error_event(exc)
            await hold_final_event(self, started)
            yield event
        finally:
            await self.release()
