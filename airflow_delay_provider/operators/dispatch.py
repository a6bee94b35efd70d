"""DispatchDueMessagesOperator: the pump, in the triggerer (deferrable) or in the worker."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import Context, conf

from airflow_delay_provider import metrics
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError, UnavailableError
from airflow_delay_provider.core.pump import PumpConfig
from airflow_delay_provider.core.requests import (
    parse_count,
    parse_destinations,
    parse_moment,
    parse_runtime,
    resolved_at_run_time,
)
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.hooks.transport import check_transport
from airflow_delay_provider.links import DestinationsLink
from airflow_delay_provider.operators.base import DelayOperatorBase
from airflow_delay_provider.triggers.delay_store import DispatchTrigger, provisioned


class DispatchDueMessagesOperator(DelayOperatorBase):
    """Run the dispatch pump: send due messages to their destinations and remove them from the store.

    Stops after `max_runtime`, after `max_messages`, or, with `due_before`, once nothing due before it
    is left. With `deferrable=True` the task defers at once and the pump runs in the triggerer, which
    sleeps until each due time (woken early on PostgreSQL when a sooner message is stored) and delivers
    it then: no worker slot is held while waiting, and no message waits for the task to be resumed. The
    task resumes once, at the end, to report. Without deferral the pump runs in the worker for the whole
    `max_runtime`. Returns counts: dispatched, failed, dead_lettered, released, lateness p50/p99/max,
    per destination, and why it stopped.

    Failed dispatches are retried by the destination's delivery policy, each retry stored as a delayed
    message. A policy's `throttlePolicy.maxReceivesPerSecond` caps deliveries per destination.

    :param due_before: dispatch only messages due before this time (templated), and stop once none is left.
    :param due_from: dispatch only messages due at or after this time (templated): with `due_before`, a
        window such as a run's data interval.
    :param destinations: dispatch only these destinations (templated), so one store can serve several teams.
    :param destination_prefix: dispatch only destinations starting with this (with `destinations`: either).
    :param max_messages: stop after this many messages (templated).
    :param max_runtime: stop after this long (timedelta or seconds; templated, e.g. from a param).
    :param batch_size: messages claimed per batch (1..10,000).
    :param number_of_retries: the shorthand for a policy of that many immediate retries (0..100), used when
        no delivery policy applies to a destination.
    :param error_queue: where exhausted messages go.
    :param deferrable: run the pump in the triggerer (see above); default: `[operators] default_deferrable`.
    :param poll_interval: in the triggerer, the longest sleep without a wake-up signal (seconds).
    :param time_to_trigger_fetch_circuit_breaker: how long (seconds, > 0) claiming due messages from the
        store may keep failing before the task fails.
    :param time_to_trigger_dispatch_circuit_breaker: how long (seconds, > 0) the transport may keep failing
        (an outage: the messages stay stored as they were) before the task fails.
    :param maximum_recovery_failures_per_second: how many messages per second (> 0, counted over 30 s) may
        fail to reach the error queue before the task fails; such a message stays stored and is due again.
    :param delivery_policy: the default delivery policy: a delivery-policy JSON with four retry phases and a
        throttle, a dict, or a built-in name ("sqs", "lambda", "smtp", "sms", "mobile-push", "http");
        default: `number_of_retries` immediate retries.
    :param destination_policies: `{destination: policy}` in the same forms; a destination's policy here comes
        first, then the one stored for it (by provisioning or a send), then `delivery_policy`.
    """

    operator_extra_links = (DestinationsLink(),)
    template_fields: Sequence[str] = (
        "due_before", "due_from", "destinations", "destination_prefix", "max_messages", "max_runtime",
    )

    def __init__(
        self,
        *,
        due_before: datetime | str | None = None,
        due_from: datetime | str | None = None,
        destinations: Sequence[str] | str | None = None,
        destination_prefix: str | None = None,
        max_messages: int | str | None = None,
        max_runtime: timedelta | float | str = timedelta(minutes=10),
        batch_size: int = 1000,
        number_of_retries: int = 0,
        error_queue: str = "error",
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        poll_interval: float = 30.0,
        time_to_trigger_fetch_circuit_breaker: float = 30.0,
        time_to_trigger_dispatch_circuit_breaker: float = 30.0,
        maximum_recovery_failures_per_second: float = 1.0,
        delivery_policy: DeliveryPolicy | dict | str | None = None,
        destination_policies: dict[str, DeliveryPolicy | dict | str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._set_policies(delivery_policy, destination_policies)
        self.due_before = due_before
        self.due_from = due_from
        self.destinations = destinations
        self.destination_prefix = destination_prefix
        self.max_messages = max_messages
        self.max_runtime = parse_runtime(max_runtime)
        # The window, destinations and count the DAG file gives literally fail its import; templated ones, the task.
        _window(*(None if resolved_at_run_time(v) else v for v in (due_from, due_before)))
        if not resolved_at_run_time(destinations):
            parse_destinations(destinations)
        if not resolved_at_run_time(max_messages):
            parse_count("max_messages", max_messages)
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        # Checked here so a bad value fails when the DAG is parsed, not at run time.
        self.pump_config = PumpConfig(
            batch_size=batch_size,
            number_of_retries=number_of_retries,
            error_queue=error_queue,
            time_to_trigger_fetch_circuit_breaker=time_to_trigger_fetch_circuit_breaker,
            time_to_trigger_dispatch_circuit_breaker=time_to_trigger_dispatch_circuit_breaker,
            maximum_recovery_failures_per_second=maximum_recovery_failures_per_second,
        )

    def _trigger(self, deadline: datetime) -> DispatchTrigger:
        """Everything the pump needs, as plain data: run in the triggerer, or opened here."""
        check_transport(self.transport)
        due_from, due_before = _window(self.due_from, self.due_before)
        return DispatchTrigger(
            delay_store_conn_id=self.delay_store_conn_id, table=self.table, db_schema=self.db_schema,
            transport=self.transport, transport_conn_id=self.transport_conn_id,
            transport_options=self.transport_options, pump_config=asdict(self.pump_config),
            delivery_policy=None if self.delivery_policy is None else self.delivery_policy.to_dict(),
            destination_policies={d: p.to_dict() for d, p in self.destination_policies.items()},
            due_before=None if due_before is None else due_before.isoformat(),
            due_from=None if due_from is None else due_from.isoformat(),
            destinations=parse_destinations(self.destinations), destination_prefix=self.destination_prefix or None,
            deadline=deadline.isoformat(), max_messages=parse_count("max_messages", self.max_messages),
            poll_interval=self.poll_interval,
        )

    def execute(self, context: Context) -> dict:
        trigger = self._trigger(utcnow() + parse_runtime(self.max_runtime))
        for destination, p in self.destination_policies.items():
            self.log.info("Delivery policy for %s %s:\n%s", destination, json.dumps(p.to_dict()), p.phase_table())
        if self.delivery_policy is not None:
            self.log.info("Delivery policy %s:\n%s", json.dumps(self.delivery_policy.to_dict()),
                          self.delivery_policy.phase_table())
        scope = {k: v for k, v in (("due_from", trigger.due_from), ("due_before", trigger.due_before),
                                   ("destinations", trigger.destinations), ("prefix", trigger.destination_prefix))
                 if v is not None}
        if self.deferrable:
            self.log.info("Dispatching from the triggerer until %s (%s)", trigger.deadline,
                          scope or "every due message")
            self.defer(trigger=trigger, method_name="execute_complete")
        pump = trigger.open_pump()
        self.log.info("Dispatching from %r through %s (%s) until %s (%s)", pump.store, pump.transport.name,
                      "exactly once" if pump.exactly_once else "at least once", trigger.deadline,
                      scope or "every due message")
        try:
            deadline = pump.from_host_time(datetime.fromisoformat(trigger.deadline))
            # Started before provisioning ended: wait for it (said once a minute), not against the breakers.
            while pump.store.clock() < deadline and not provisioned(pump):
                pass
            result = pump.run(deadline=deadline, max_messages=trigger.max_messages,
                              due_before=_optional(trigger.due_before))
        finally:
            pump.store.close()
            pump.transport.close()
        metrics.count_dispatch(result.stats.summary())
        return self._finish({**result.stats.to_dict(), "stopped_because": result.reason,
                             "next_due": None if result.next_due is None else result.next_due.isoformat(),
                             "exactly_once": pump.exactly_once}, "worker")

    def execute_complete(self, context: Context, event: dict) -> dict:
        if event.get("status") == "error":
            self.log.error("Dispatched before the failure: %s", json.dumps(_public(event.get("summary") or {})))
            raise UnavailableError(f"dispatching in the triggerer failed: {event.get('message')}")
        return self._finish(event["summary"], "triggerer")

    def _finish(self, summary: dict, where: str) -> dict:
        result = {**_public(summary), "dispatched_in": where}
        self.log.info("Dispatch finished (%s): %s", result["stopped_because"], json.dumps(result))
        return result


def _window(due_from: Any, due_before: Any) -> tuple[datetime | None, datetime | None]:
    """The window's bounds, each an aware time or None; from before to."""
    due_before, due_from = parse_moment(due_before, "due_before"), parse_moment(due_from, "due_from")
    if due_before is not None and due_from is not None and due_from >= due_before:
        raise InvalidInputError(f"due_from ({due_from.isoformat()}) must be before due_before "
                                f"({due_before.isoformat()}): the window would be empty")
    return due_from, due_before


def _public(summary: dict) -> dict:
    """A summary without the lateness histogram's buckets: what XCom and the log get."""
    return {k: v for k, v in summary.items() if k != "lateness"}


def _optional(moment: str | None) -> datetime | None:
    return None if moment is None else datetime.fromisoformat(moment)
