"""SqsDelayQueueTrigger: wait in the triggerer until an endpoint's -delay.fifo queue has messages to relay."""

from __future__ import annotations

import asyncio
from typing import Any

from airflow.triggers.base import TriggerEvent

from airflow_delay_provider.extras import check_extra
from airflow_delay_provider.triggers.base import DelayTrigger, parse_time, sleep_until_next_poll

# Found, not imported: the hook (and boto3) load when the trigger first runs.
check_extra("amazon")


class SqsDelayQueueTrigger(DelayTrigger):
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

    serialized_fields = ("endpoint", "aws_conn_id", "transport_options", "deadline", "poll_interval", "carry")

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

    def event(self, status: str, **fields: Any) -> TriggerEvent:
        # The task's state comes back in every event, the error's too: execute_complete resumes from it.
        return super().event(status, carry=self.carry, **fields)

    async def outcome(self) -> TriggerEvent:
        from airflow_delay_provider.hooks.sqs import SqsDelayHook

        transport = await asyncio.to_thread(
            lambda: SqsDelayHook(aws_conn_id=self.aws_conn_id).get_transport(**self.transport_options))
        deadline = parse_time(self.deadline)
        while True:
            counts = await asyncio.to_thread(transport.lifecycle, self.endpoint, True)
            if counts["visible"] > 0:
                return self.event("ready", **counts)
            if not await sleep_until_next_poll(self.poll_interval, deadline):
                return self.event("timeout", **counts)
