"""Triggers on the delayed-message store.

`DispatchTrigger` runs the dispatch pump inside the triggerer, the always-on process of a
deployment: it sleeps until the next due time (woken early by LISTEN/NOTIFY on PostgreSQL when a
sooner message is stored) and sends each message at its due time, so delivery never waits for a
deferred task to be queued and resumed by the scheduler and a worker. The task resumes once, to
report. `ScheduledMessagesTrigger` waits until nothing is scheduled before a time.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from airflow.triggers.base import TriggerEvent

from airflow_delay_provider import metrics
from airflow_delay_provider.core.errors import DelayProviderError, StoreNotReadyError
from airflow_delay_provider.core.pump import (
    MAX_HELD_BACKOFF_SECONDS,
    MIN_HELD_BACKOFF_SECONDS,
    REHEARSAL_SECONDS,
    Pump,
    PumpConfig,
    PumpResult,
)
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.core.stats import PumpStats
from airflow_delay_provider.hooks.delay_store import DEFAULT_CONN_ID, DelayStoreMixin
from airflow_delay_provider.hooks.transport import transport_hook, transport_options
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.triggers.base import DelayTrigger, parse_time, sleep_until_next_poll

log = logging.getLogger(__name__)

#: The longest stretch of pump work handed to a thread at once, so a cancelled trigger stops soon.
STRETCH_SECONDS = 10.0
REHEARSAL = timedelta(seconds=REHEARSAL_SECONDS)


class _StoreTrigger(DelayStoreMixin, DelayTrigger):
    """A trigger on the store: its arguments and hook are DelayStoreMixin's, as on the operators and sensors."""

    serialized_fields = ("delay_store_conn_id", "table", "db_schema")


class DispatchTrigger(_StoreTrigger):
    """Dispatch due messages from the triggerer until `deadline`, `max_messages`, or (with
    `due_before`) nothing left in the window; then fire one `done` event with the counts.

    Every guarantee is the pump's: a batch is claimed in a store transaction (rows locked, others'
    locks skipped) and removed only after the transport confirmed it, failures follow the delivery
    policies, breakers and throttles apply. Two copies of this trigger (a triggerer fail-over) share
    the store like two pumps: nothing is handed out twice.

    :param delay_store_conn_id: the `delay_store` connection (default `delay_store_default`).
    :param table: the store's table, if not the connection's.
    :param db_schema: the store's PostgreSQL schema, if not the connection's.
    :param transport: `sql`, `rabbitmq` or `sqs`: where due messages go.
    :param transport_conn_id: the transport's connection (default: the store's database, `rabbitmq_default`,
        `aws_default`).
    :param transport_options: SQS options (prefix, queue_delay, large_body_bucket).
    :param pump_config: the `PumpConfig` fields (batch size, retries, error queue, breakers).
    :param delivery_policy: the default delivery policy, as a dict.
    :param destination_policies: `{destination: policy as a dict}`; a destination's policy here comes
        first, then the one stored for it, then `delivery_policy`.
    :param due_before: ISO time: dispatch only messages due before it, and stop when none is left.
    :param due_from: ISO time: dispatch only messages due at or after it.
    :param destinations: dispatch only these destinations.
    :param destination_prefix: dispatch only destinations starting with this (with `destinations`: either).
    :param deadline: ISO time at which to stop.
    :param max_messages: stop after this many messages were handled.
    :param poll_interval: longest sleep without a wake-up signal (seconds); on SQLite, which has no
        LISTEN/NOTIFY, new messages are noticed within half a second anyway.
    """

    serialized_fields = _StoreTrigger.serialized_fields + (
        "transport", "transport_conn_id", "transport_options", "pump_config", "delivery_policy",
        "destination_policies", "due_before", "due_from", "destinations", "destination_prefix", "deadline",
        "max_messages", "poll_interval",
    )

    def __init__(
        self,
        *,
        deadline: str,
        delay_store_conn_id: str = DEFAULT_CONN_ID,
        table: str | None = None,
        db_schema: str | None = None,
        transport: str = "sql",
        transport_conn_id: str | None = None,
        transport_options: dict | None = None,
        pump_config: dict | None = None,
        delivery_policy: dict | None = None,
        destination_policies: dict[str, dict] | None = None,
        due_before: str | None = None,
        due_from: str | None = None,
        destinations: list[str] | None = None,
        destination_prefix: str | None = None,
        max_messages: int | None = None,
        poll_interval: float = 30.0,
    ) -> None:
        super().__init__(delay_store_conn_id=delay_store_conn_id, table=table, db_schema=db_schema)
        self.transport = transport
        self.transport_conn_id = transport_conn_id
        self.transport_options = dict(transport_options or {})
        self.pump_config = dict(pump_config or {})
        self.delivery_policy = delivery_policy
        self.destination_policies = dict(destination_policies or {})
        self.due_before = due_before
        self.due_from = due_from
        self.destinations = list(destinations) if destinations else None
        self.destination_prefix = destination_prefix or None
        self.deadline = deadline
        self.max_messages = max_messages
        self.poll_interval = float(poll_interval)
        self._running: asyncio.Future | None = None
        # What the running outcome() opened and counted: error_event() reports the counts, release() closes.
        self._pump: Pump | None = None
        self._stats = PumpStats()

    def open_pump(self) -> Pump:
        """The pump this trigger runs (also what a task that does not defer runs in its worker)."""
        store_hook = self.hook
        store = store_hook.get_store().restrict(self.destinations, self.destination_prefix, parse_time(self.due_from))
        if store_hook.auto_migrate:
            store.create_schema()
        else:  # a store not there yet is waited for (`provisioned`); an unreachable one fails here, as it did
            store.migrations.state()
        hook = transport_hook(self.transport, self.transport_conn_id, store_hook, self.db_schema)
        transport = hook.get_transport(**transport_options(self.transport, self.transport_options))
        policies = {d: DeliveryPolicy.from_dict(p) for d, p in self.destination_policies.items()}
        policy = None if self.delivery_policy is None else DeliveryPolicy.from_dict(self.delivery_policy)
        config = PumpConfig(**self.pump_config)
        self._record_route(store, config.error_queue)
        return Pump(store, transport, config, policy=policy, policies=policies)

    def _record_route(self, store: SqlDelayedMessageStore, error_queue: str) -> None:
        """Say where this dispatcher sends (stores/routes.py), for the page's dead letters. Never in its way: a
        store not there yet, or older than the routes, records nothing, and a failure only logs."""
        scope = {"destinations": self.destinations, "prefix": self.destination_prefix}
        try:
            store.routes.record(self.transport, self.transport_conn_id, error_queue, scope)
        except DelayProviderError as exc:
            log.info("could not record where this dispatcher sends (the page's dead letters need it): %s", exc)

    async def _in_thread(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Blocking store and broker calls run in a thread; the one running is remembered, so cleanup
        never closes connections under it."""
        context = contextvars.copy_context()  # keeps the trigger's log routing in the thread
        self._running = asyncio.get_running_loop().run_in_executor(None, lambda: context.run(fn, *args, **kwargs))
        return await self._running

    async def outcome(self) -> TriggerEvent:
        self._stats = PumpStats()
        self._pump = await self._in_thread(self.open_pump)
        reason, next_due = await self._dispatch(self._pump, self._stats)
        return self.event("done", summary=self._summary(reason, next_due))

    def error_event(self, exc: Exception, **fields: Any) -> TriggerEvent:
        # With the counts of what was dispatched before the failure.
        return super().error_event(exc, summary=self._summary("error", None), **fields)

    async def release(self) -> None:
        if self._pump is not None:
            await self._close(self._pump)

    async def _dispatch(self, pump: Pump, stats: PumpStats) -> tuple[str, datetime | None]:
        """The loop, on the store's clock (due times are kept on it; the deadline is the task's)."""
        deadline = await self._in_thread(pump.from_host_time, parse_time(self.deadline))
        due_before = parse_time(self.due_before)
        backoff = MIN_HELD_BACKOFF_SECONDS
        next_due: datetime | None = None
        ready = False
        woken = False  # by a wait below: the stretch starts as the pump does after its own waits
        while True:
            now = await self._in_thread(pump.store.clock)
            if now >= deadline:
                return "deadline", next_due
            ready = ready or await self._in_thread(provisioned, pump)
            if not ready:
                continue
            left = None if self.max_messages is None else self.max_messages - stats.dispatched - stats.dead_lettered
            if left is not None and left <= 0:
                return "max_messages", next_due
            if next_due is not None and next_due - REHEARSAL <= now < next_due:  # woken for the rehearsal below
                await self._in_thread(pump.ready_for, next_due)
            started = time.monotonic()
            result: PumpResult = await self._in_thread(
                pump.run, deadline=min(deadline, now + timedelta(seconds=STRETCH_SECONDS)), max_messages=left,
                due_before=due_before, stop_when_idle=True, woken=woken,
            )
            stats.merge(result.stats)
            next_due = result.next_due
            self._report(result, time.monotonic() - started)
            if result.reason == "drained" and due_before is not None:
                return "drained", None
            woken = result.reason not in ("deadline", "max_messages")  # every other way on waits first
            if not woken:
                continue  # a stretch ended; the checks above decide whether the whole run has
            now = await self._in_thread(pump.store.clock)
            if next_due is not None and next_due <= now:
                await asyncio.sleep(backoff)  # due, but held elsewhere for now
                backoff = min(backoff * 2, MAX_HELD_BACKOFF_SECONDS)
                continue
            backoff = MIN_HELD_BACKOFF_SECONDS
            wake = min(deadline, now + timedelta(seconds=self.poll_interval))
            if next_due is not None and next_due < wake and next_due - now >= 2 * REHEARSAL:
                # The pump's rehearsal, with the wait on the loop's shared LISTEN connection: woken REHEARSAL
                # early, the stretch above runs once more and finds nothing due yet, so that at the due time its
                # claim is a statement prepared on a connection just used, its scan's start just read.
                await pump.store.wait_async(next_due - REHEARSAL)
                continue
            await pump.store.wait_async(wake if next_due is None else min(wake, next_due))

    def _report(self, result: PumpResult, seconds: float) -> None:
        """One line per stretch that moved messages: counts, rate, lateness, and what comes next."""
        done = result.stats
        if not (done.dispatched or done.dead_lettered or done.retried or done.released):
            return
        metrics.count_dispatch(done.summary())
        summary = done.summary()
        upcoming = "store empty" if result.next_due is None else f"next due {result.next_due.isoformat()}"
        self.log.info(
            "dispatched %d, retrying %d, dead-lettered %d, released %d in %.2f s (%.0f msg/s); lateness p50 %s s, "
            "p99 %s s; %s", done.dispatched, done.retried, done.dead_lettered, done.released, seconds,
            done.dispatched / max(seconds, 1e-6), summary["lateness_p50_seconds"], summary["lateness_p99_seconds"],
            upcoming,
        )

    def _summary(self, reason: str, next_due: datetime | None) -> dict:
        return {
            **self._stats.to_dict(),
            "stopped_because": reason,
            "next_due": None if next_due is None else next_due.isoformat(),
            "exactly_once": None if self._pump is None else self._pump.exactly_once,
        }

    async def _close(self, pump: Pump) -> None:
        def close() -> None:
            pump.store.close()
            pump.transport.close()

        await pump.store.aclose()
        running = self._running
        if running is not None and not running.done():
            # Cancelled mid-stretch: the thread settles the batch in hand, claims no other and commits; close after.
            pump.stop()
            running.add_done_callback(lambda _: close())
        else:
            close()


def provisioned(pump: Pump) -> bool:
    """Whether the pump's store and queues are there, the store at this release's version (a dispatcher runs its
    pump only then, so that it reads the stored delivery policies of a store that exists); if not, waits a moment,
    saying why once a minute, counted against no breaker: a dispatcher may start before provisioning ends."""
    try:
        if isinstance(pump.store, SqlDelayedMessageStore):
            pump.store.check_ready(current=True)
        else:
            pump.store.check_ready()
        pump.transport.check_ready()
    except StoreNotReadyError as exc:
        pump.fetch_breaker.not_ready(exc)
        return False
    return True


class ScheduledMessagesTrigger(_StoreTrigger):
    """Fires `drained` once nothing (for `destination`, if given) is scheduled before `due_before`;
    `timeout` at `deadline`; `error` when the store cannot be read.

    :param delay_store_conn_id: the `delay_store` connection (default `delay_store_default`).
    :param table: the store's table, if not the connection's.
    :param db_schema: the store's PostgreSQL schema, if not the connection's.
    :param due_before: ISO time: count only messages due before it; default: every stored message.
    :param deadline: ISO time at which to fire `timeout`; default: none (wait until drained).
    :param poll_interval: seconds between counts (default 5).
    :param destination: count only this destination; default: all.
    """

    serialized_fields = _StoreTrigger.serialized_fields + ("due_before", "deadline", "poll_interval", "destination")

    def __init__(
        self,
        delay_store_conn_id: str = DEFAULT_CONN_ID,
        table: str | None = None,
        db_schema: str | None = None,
        due_before: str | None = None,
        deadline: str | None = None,
        poll_interval: float = 5.0,
        destination: str | None = None,
    ) -> None:
        super().__init__(delay_store_conn_id=delay_store_conn_id, table=table, db_schema=db_schema)
        self.due_before = due_before
        self.deadline = deadline
        self.poll_interval = float(poll_interval)
        self.destination = destination

    async def outcome(self) -> TriggerEvent:
        store = await self.hook.aget_store()
        await asyncio.to_thread(store.check_ready)  # a store not there is an error, never created by waiting on it
        due_before, deadline = parse_time(self.due_before), parse_time(self.deadline)
        while True:
            counts = await asyncio.to_thread(store.count_scheduled, due_before, self.destination)
            if not counts:
                return self.event("drained")
            if not await sleep_until_next_poll(self.poll_interval, deadline):
                return self.event("timeout", scheduled=counts)
