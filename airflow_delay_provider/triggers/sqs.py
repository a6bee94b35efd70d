"""SqsDelayQueueTrigger: wait in the triggerer until an endpoint's -delay.fifo queue has messages to relay."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.triggers.base import hold_final_event


class SqsDelayQueueTrigger(BaseTrigger):
    """Fires `ready` when the delay queue has visible messages, `timeout` at `deadline`, `error` on failure.

    `ready` and `timeout` carry the delay queue's counts (scheduled, visible, in_flight).

    :param endpoint: the endpoint whose `-delay.fifo` queue to watch.
    :param aws_conn_id: the `aws` connection (default `aws_default`).
    :param transport_options: the SQS transport options (`prefix`, `queue_delay`, ...), as the operator has
        them.
    :param deadline: ISO time at which to fire `timeout`; default: none.
    :param poll_interval: seconds between looks at the delay queue (default 30).
    :param carry: the deferred task's JSON state; it comes back in every event.
    """

    def __init__(
        self,
        endpoint: str,
        aws_conn_id: str = "aws_default",
        transport_options: dict | None = None,
        deadline: str | None = None,
        poll_interval: float = 30.0,
        carry: dict | None = None,
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.aws_conn_id = aws_conn_id
        self.transport_options = transport_options or {}
        self.deadline = deadline
        self.poll_interval = float(poll_interval)
        self.carry = carry

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "endpoint": self.endpoint,
                "aws_conn_id": self.aws_conn_id,
                "transport_options": self.transport_options,
                "deadline": self.deadline,
                "poll_interval": self.poll_interval,
                "carry": self.carry,
            },
        )

    def _event(self, status: str, **fields: Any) -> TriggerEvent:
        return TriggerEvent({"status": status, "carry": self.carry, **fields})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        try:
            event = await self._wait()
        except Exception as exc:  # reported to execute_complete, which fails the task with it
            event = self._event("error", message=f"{type(exc).__name__}: {exc}")
        await hold_final_event(self, started)
        yield event

    async def _wait(self) -> TriggerEvent:
        from airflow_delay_provider.hooks.sqs import SqsDelayHook

        transport = await asyncio.to_thread(
            lambda: SqsDelayHook(aws_conn_id=self.aws_conn_id).get_transport(**self.transport_options))
        deadline = None if self.deadline is None else datetime.fromisoformat(self.deadline)
        while True:
            counts = await asyncio.to_thread(transport.lifecycle, self.endpoint, True)
            if counts["visible"] > 0:
                return self._event("ready", **counts)
            now = utcnow()
            if deadline is not None and now >= deadline:
                return self._event("timeout", **counts)
            left = self.poll_interval if deadline is None else (deadline - now).total_seconds()
            await asyncio.sleep(max(0.0, min(self.poll_interval, left)))
