"""What every trigger of this provider shares."""

from __future__ import annotations

import asyncio
import time

from airflow.triggers.base import BaseTrigger

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
