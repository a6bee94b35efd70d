"""Operators: send delayed messages, dispatch due ones, provision the delay infrastructure."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any, Sequence

from airflow.sdk import BaseOperator, Context

from airflow_delay_provider.core.breakers import CircuitBreaker, call_with_breaker
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import check_destination, stable_message_id
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.core.requests import build_message, parse_moment
from airflow_delay_provider.core.stats import PumpStats
from airflow_delay_provider.hooks.delay_store import DelayStoreHook
from airflow_delay_provider.triggers.delay_store import DueTimeoutTrigger

#: Transports a destination can be reached through. RabbitMQ and SQS join this list in their issues.
TRANSPORTS = ("sql",)


def _check_transport(transport: str) -> str:
    if transport not in TRANSPORTS:
        raise InvalidInputError(f"transport {transport!r} is not supported; choose one of {list(TRANSPORTS)}")
    return transport


class _StoreOperator(BaseOperator):
    def __init__(
        self,
        *,
        delay_store_conn_id: str | None = None,
        table: str | None = None,
        db_schema: str | None = None,
        transport: str = "sql",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.delay_store_conn_id = delay_store_conn_id
        self.table = table
        self.db_schema = db_schema
        self.transport = _check_transport(transport)

    @property
    def hook(self) -> DelayStoreHook:
        return DelayStoreHook(self.delay_store_conn_id, table=self.table, db_schema=self.db_schema)


class ProvisionDelayInfrastructureOperator(_StoreOperator):
    """Create the delayed-message store and the destination queues (idempotent). Returns a JSON summary."""

    template_fields: Sequence[str] = ("endpoints",)

    def __init__(self, *, endpoints: Sequence[str] = (), error_queue: str = "error", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.endpoints = endpoints
        self.error_queue = error_queue

    def execute(self, context: Context) -> dict:
        endpoints = [check_destination(e) for e in [*self.endpoints, self.error_queue]]
        store = self.hook.get_store()
        store.create_schema()
        transport = self.hook.get_transport()
        declared = [transport.provision(e) for e in dict.fromkeys(endpoints)]
        summary = {"store": repr(store), "transport": self.transport, "queues": declared}
        self.log.info("Provisioned: %s", json.dumps(summary))
        return summary


class SendDelayedMessageOperator(_StoreOperator):
    """Store one message (or a batch) for delivery after a delay; returns the message id(s).

    Give `delay_seconds` (int, float or timedelta; fractions round up) or `deliver_at` (an aware
    datetime or ISO string; a time in the past means now), and optionally `queue_delay_seconds`, the
    destination's queue-level delay that applies when the message has none (seed 004). For a batch,
    pass `messages`: dicts with destination, body, headers, delay_seconds, deliver_at, message_id;
    missing keys take the operator's values. Ids not given are derived from the task instance, so
    a retried task stores the same messages again instead of duplicates.
    """

    template_fields: Sequence[str] = (
        "destination",
        "body",
        "headers",
        "delay_seconds",
        "deliver_at",
        "queue_delay_seconds",
        "messages",
        "message_id",
    )

    def __init__(
        self,
        *,
        destination: str | None = None,
        body: str | bytes = "",
        headers: dict[str, str] | None = None,
        delay_seconds: int | float | timedelta | str | None = None,
        deliver_at: datetime | str | None = None,
        queue_delay_seconds: int | str | None = None,
        messages: list[dict] | None = None,
        message_id: str | None = None,
        time_to_trigger_store_circuit_breaker: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.destination = destination
        self.body = body
        self.headers = headers
        self.delay_seconds = delay_seconds
        self.deliver_at = deliver_at
        self.queue_delay_seconds = queue_delay_seconds
        self.messages = messages
        self.message_id = message_id
        self.time_to_trigger_store_circuit_breaker = time_to_trigger_store_circuit_breaker

    def execute(self, context: Context) -> str | list[str]:
        ti = context["ti"]
        origin = (ti.dag_id, ti.run_id, ti.task_id, getattr(ti, "map_index", -1))
        defaults = {
            "destination": self.destination,
            "body": self.body,
            "headers": self.headers,
            "delay_seconds": self.delay_seconds,
            "deliver_at": self.deliver_at,
        }
        items = self.messages if self.messages is not None else [{**defaults, "message_id": self.message_id}]
        if isinstance(items, str):
            items = json.loads(items)
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise InvalidInputError("messages must be a list of dicts")
        now = utcnow()
        # Every message is checked before anything is stored: a bad one stores none.
        batch = [
            build_message(
                {**defaults, **item},
                now,
                self.queue_delay_seconds,
                default_id=lambda n=n: stable_message_id(*origin, n),
            )
            for n, item in enumerate(items)
        ]
        store = self.hook.get_store()
        breaker = CircuitBreaker("storing delayed messages", self.time_to_trigger_store_circuit_breaker)
        stored = call_with_breaker(breaker, lambda: store.store(batch), retry_on=(UnavailableError,))
        for m in batch[:20]:
            self.log.info("Scheduled %s for %s at %s", m.message_id, m.destination, m.due_at.isoformat())
        self.log.info("Stored %d new message(s) of %d (the rest were stored by an earlier try)", stored, len(batch))
        ids = [m.message_id for m in batch]
        return ids if self.messages is not None else ids[0]


class DispatchDueMessagesOperator(_StoreOperator):
    """Run the dispatch pump: send due messages to their destinations and remove them from the store.

    Stops after `max_runtime`, after `max_messages`, or, with `due_before`, once nothing due before it
    is left (a scheduled run or a backfill sweeps only its data interval). With `deferrable=True`,
    gaps longer than `defer_threshold_seconds` until the next due time are spent deferred on a
    DueTimeoutTrigger instead of holding a worker slot; shorter gaps are slept through, which keeps
    lateness low. Returns counts: dispatched, failed, dead_lettered and lateness p50/p99.
    """

    template_fields: Sequence[str] = ("due_before", "max_messages")

    def __init__(
        self,
        *,
        due_before: datetime | str | None = None,
        max_messages: int | None = None,
        max_runtime: timedelta | float = timedelta(minutes=10),
        batch_size: int = 1000,
        number_of_retries: int = 0,
        error_queue: str = "error",
        deferrable: bool = False,
        defer_threshold_seconds: float = 30.0,
        poll_interval: float = 5.0,
        destination_conn_id: str | None = None,
        time_to_trigger_fetch_circuit_breaker: float = 30.0,
        time_to_trigger_dispatch_circuit_breaker: float = 30.0,
        maximum_recovery_failures_per_second: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.due_before = due_before
        self.max_messages = max_messages
        self.max_runtime = max_runtime if isinstance(max_runtime, timedelta) else timedelta(seconds=max_runtime)
        self.deferrable = deferrable
        self.defer_threshold_seconds = defer_threshold_seconds
        self.poll_interval = poll_interval
        self.destination_conn_id = destination_conn_id
        # Checked here so a bad value fails when the DAG is parsed, not at run time.
        self.pump_config = PumpConfig(
            batch_size=batch_size,
            number_of_retries=number_of_retries,
            error_queue=error_queue,
            time_to_trigger_fetch_circuit_breaker=time_to_trigger_fetch_circuit_breaker,
            time_to_trigger_dispatch_circuit_breaker=time_to_trigger_dispatch_circuit_breaker,
            maximum_recovery_failures_per_second=maximum_recovery_failures_per_second,
        )

    def _pump(self) -> Pump:
        store = self.hook.get_store()
        if self.destination_conn_id is None:
            transport = self.hook.get_transport()
        else:
            transport = DelayStoreHook(self.destination_conn_id, db_schema=self.db_schema).get_transport()
        return Pump(store, transport, self.pump_config)

    def execute(self, context: Context) -> dict:
        deadline = utcnow() + self.max_runtime
        return self._run(PumpStats(), deadline, deferrals=0)

    def execute_complete(self, context: Context, event: dict) -> dict:
        if event.get("status") == "error":
            raise UnavailableError(f"waiting for due messages failed: {event.get('message')}")
        # The run's state travels in the event (see DueTimeoutTrigger.carry): dag.test() drops defer kwargs.
        state = event["carry"]
        self.log.info("Resumed after deferral: %s", event.get("status"))
        return self._run(PumpStats.from_dict(state["stats"]), datetime.fromisoformat(state["deadline"]), state["deferrals"])

    def _run(self, stats: PumpStats, deadline: datetime, deferrals: int) -> dict:
        due_before = parse_moment(self.due_before, "due_before")
        max_messages = None if self.max_messages in (None, "") else int(self.max_messages)
        if max_messages is not None:
            max_messages -= stats.dispatched + stats.dead_lettered
        pump = self._pump()
        self.log.info(
            "Dispatching from %r through %s (%s); due_before=%s, deadline=%s",
            pump.store, pump.transport.name, "exactly once" if pump.exactly_once else "at least once",
            due_before, deadline.isoformat(),
        )
        try:
            result = pump.run(
                deadline=deadline,
                max_messages=max_messages,
                due_before=due_before,
                max_wait=self.defer_threshold_seconds if self.deferrable else None,
            )
        finally:
            pump.store.close()
        stats.merge(result.stats)
        if result.reason == "idle" and self.deferrable:
            self.log.info("Next message due at %s: deferring (%s so far)", result.next_due, stats.summary())
            self.defer(
                trigger=DueTimeoutTrigger(
                    delay_store_conn_id=self.delay_store_conn_id,
                    table=self.table,
                    db_schema=self.db_schema,
                    due_before=None if due_before is None else due_before.isoformat(),
                    deadline=deadline.isoformat(),
                    poll_interval=self.poll_interval,
                    carry={"stats": stats.to_dict(), "deadline": deadline.isoformat(), "deferrals": deferrals + 1},
                ),
                method_name="execute_complete",
            )
        summary = {
            **stats.summary(),
            "stopped_because": result.reason,
            "next_due": None if result.next_due is None else result.next_due.isoformat(),
            "exactly_once": pump.exactly_once,
            "deferrals": deferrals,
        }
        self.log.info("Dispatch finished: %s", json.dumps(summary))
        return summary
