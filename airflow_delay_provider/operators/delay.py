"""Operators: send delayed messages, dispatch due ones, provision the delay infrastructure."""

from __future__ import annotations

import ast
import json
import math
from collections import Counter
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any, Sequence

from airflow.sdk import BaseOperator, Context, conf

from airflow_delay_provider import metrics
from airflow_delay_provider.core.breakers import CircuitBreaker, call_with_breaker
from airflow_delay_provider.core.delays import resolve_delay, utcnow
from airflow_delay_provider.core.errors import DelayProviderError, InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import DelayedMessage, check_destination, stable_message_id
from airflow_delay_provider.core.ports import Transport
from airflow_delay_provider.core.pump import PumpConfig, hand_over
from airflow_delay_provider.core.requests import build_message, parse_moment
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.core.throttle import TokenBucket
from airflow_delay_provider.hooks.delay_store import DEFAULT_CONN_ID, DelayStoreHook
from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook
from airflow_delay_provider.hooks.sqs import SqsDelayHook
from airflow_delay_provider.hooks.transport import check_transport, transport_hook, transport_options
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport
from airflow_delay_provider.transports.sqs import (
    NATIVE_MAX_DELAY,
    RelayCounts,
    SqsTransport,
    delay_plan,
    estimate_cost,
)
from airflow_delay_provider.triggers.delay_store import DispatchTrigger
from airflow_delay_provider.triggers.sqs import SqsDelayQueueTrigger


class DelayOperatorBase(BaseOperator):
    """Shared arguments: the delayed-message store, and the transport that reaches the destinations.

    `transport="sql"`: queues as tables, in the store's database unless `transport_conn_id` names
    another `delay_store` connection. `transport="rabbitmq"`: the broker of the `rabbitmq`
    connection `transport_conn_id` (default `rabbitmq_default`). `transport="sqs"`: Amazon SQS
    through the `aws` connection `transport_conn_id` (default `aws_default`), with
    `transport_options` such as `prefix`, `queue_delay` (Q, default 900) and `large_body_bucket`.
    """

    def __init__(
        self,
        *,
        delay_store_conn_id: str = DEFAULT_CONN_ID,
        table: str | None = None,
        db_schema: str | None = None,
        transport: str = "sql",
        transport_conn_id: str | None = None,
        transport_options: dict | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.delay_store_conn_id = delay_store_conn_id
        self.table = table
        self.db_schema = db_schema
        # A template ("{{ params.transport }}") is checked once rendered, where the field is templated.
        templated = "transport" in self.template_fields and "{{" in str(transport)
        self.transport = transport if templated else check_transport(transport)
        self.transport_conn_id = transport_conn_id
        self.transport_options = dict(transport_options or {})

    @property
    def hook(self) -> DelayStoreHook:
        return DelayStoreHook(self.delay_store_conn_id, table=self.table, db_schema=self.db_schema)

    def _transport_hook(self) -> DelayStoreHook | RabbitMQDelayHook | SqsDelayHook:
        """The hook of the transport's connection (the transport is rendered by now, if it was a template)."""
        return transport_hook(self.transport, self.transport_conn_id, self.hook, self.db_schema)

    def _options(self) -> dict:
        return transport_options(self.transport, self.transport_options)

    def get_transport(self) -> Transport:
        return self._transport_hook().get_transport(**self._options())

    def transport_spec(self) -> dict:
        """The transport as plain data (with its secrets), for a process without Airflow."""
        return self._transport_hook().transport_spec(**self._options())


class ProvisionDelayInfrastructureOperator(DelayOperatorBase):
    """Create the delayed-message store and the transport's destination queues (idempotent).

    With RabbitMQ this declares the 28 delay levels, the delivery exchange with its `unroutable`
    safety net, and each endpoint's queue and binding. `verify=True` changes nothing: it reports
    what is missing or declared with other arguments, and fails the task when anything is.
    Returns a JSON summary.
    """

    template_fields: Sequence[str] = ("endpoints",)

    def __init__(
        self,
        *,
        endpoints: Sequence[str] = (),
        error_queue: str = "error",
        create_store: bool = True,
        verify: bool = False,
        endpoint_options: dict | None = None,
        destination_policies: dict[str, DeliveryPolicy | dict | str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # Stored with the messages: every dispatch task then retries these destinations this way.
        self.destination_policies = DeliveryPolicy.parse_each(destination_policies)
        self.endpoints = endpoints
        #: For each endpoint (not the error queue): `queue_delay_seconds` (0..604800, stored with the
        #: destination and applied by every send to messages without a delay of their own; on SQS, up to
        #: 900 s, also the queue's DelaySeconds) and, on SQS, `unrestricted`.
        self.endpoint_options = dict(endpoint_options or {})
        allowed = {"queue_delay_seconds", "unrestricted"} if self.transport == "sqs" else {"queue_delay_seconds"}
        if self.transport in ("sql", "rabbitmq", "sqs") and set(self.endpoint_options) - allowed:
            raise InvalidInputError(
                f"endpoint_options {sorted(set(self.endpoint_options) - allowed)} are not known for "
                f"transport={self.transport!r}; allowed: {sorted(allowed)}"
            )
        queue_delay = self.endpoint_options.get("queue_delay_seconds")
        resolve_delay(queue_delay=queue_delay, queue_field="endpoint_options.queue_delay_seconds")
        if self.transport == "sqs" and queue_delay is not None and queue_delay > NATIVE_MAX_DELAY:
            raise InvalidInputError(f"endpoint_options.queue_delay_seconds is {queue_delay}, but an SQS queue's "
                                    f"delay is at most {NATIVE_MAX_DELAY} s; allowed: 0..{NATIVE_MAX_DELAY}")
        self.error_queue = error_queue
        self.create_store = create_store
        self.verify = verify

    def execute(self, context: Context) -> dict:
        endpoints = list(dict.fromkeys(check_destination(e) for e in [*self.endpoints, self.error_queue]))
        transport = self.get_transport()
        # Only SQS queues take a queue-level delay (up to 15 minutes) as an attribute of their own.
        native = self.endpoint_options if self.transport == "sqs" else {}
        queue_delay = self.endpoint_options.get("queue_delay_seconds")
        try:
            for endpoint in endpoints:  # every name is checked before anything is created
                transport.check_endpoint(endpoint, **(native if endpoint != self.error_queue else {}))
            if self.verify:
                return self._verify(transport, endpoints)
            summary: dict[str, Any] = {"transport": self.transport}
            if self.create_store or self.destination_policies or queue_delay is not None:
                store = self.hook.get_store()
                store.create_schema()
                store.set_policies({d: p.to_dict() for d, p in self.destination_policies.items()})
                summary["store"] = repr(store)
                summary["policies"] = sorted(self.destination_policies)
                if queue_delay is not None:
                    store.set_queue_delays(dict.fromkeys([e for e in endpoints if e != self.error_queue], queue_delay))
                    summary["queue_delay_seconds"] = queue_delay
            summary["queues"] = [transport.provision(e, **(native if e != self.error_queue else {})) for e in endpoints]
        finally:
            transport.close()
        self.log.info("Provisioned: %s", json.dumps(summary))
        return summary

    def _verify(self, transport: Transport, endpoints: list[str]) -> dict:
        if not isinstance(transport, RabbitMQTransport):
            raise InvalidInputError(f"verify=True is supported for transport='rabbitmq', not {self.transport!r}")
        report = transport.verify(endpoints)
        self.log.info("Verified %s: %s", transport.where, json.dumps(report))
        if not report["complete"]:
            raise DelayProviderError(
                f"the delay infrastructure on {transport.where} is incomplete: missing {report['missing']}, "
                f"declared with other arguments {report['different']}; run this task without verify=True to declare it"
            )
        return report


class SendDelayedMessageOperator(DelayOperatorBase):
    """Schedule one message (or a batch) for delivery after a delay; returns the message id(s).

    `transport="sql"` keeps the message in the delayed-message store until a dispatch task sends
    it; `transport="rabbitmq"` hands it to the broker's delay levels at once (nothing to dispatch).

    Give `delay_seconds` (int, float or timedelta; fractions round up) or `deliver_at` (an aware
    datetime or ISO string; a time in the past means now). A message without a delay of its own takes
    its destination's queue-level delay, set when the destination was provisioned
    (`endpoint_options={"queue_delay_seconds": N}`); `queue_delay_seconds` gives one for destinations
    provisioned without it, and must agree with a provisioned one. For a batch,
    pass `messages`: dicts with destination, body, headers, delay_seconds, deliver_at, message_id;
    missing keys take the operator's values. Ids not given are derived from the task instance, so
    a retried task stores the same messages again instead of duplicates.

    `delivery_policy` (delivery-policy JSON, a dict or a built-in name; templated) is stored as the
    destinations' policy beside the messages (`transport="sql"`), so whichever dispatch task or
    sweep sends them retries them that way.
    """

    template_fields: Sequence[str] = (
        "transport",
        "destination",
        "body",
        "headers",
        "delay_seconds",
        "deliver_at",
        "queue_delay_seconds",
        "messages",
        "message_id",
        "delivery_policy",
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
        delivery_policy: DeliveryPolicy | dict | str | None = None,
        time_to_trigger_store_circuit_breaker: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # A template is checked once rendered; anything else when the DAG is parsed.
        if delivery_policy not in (None, "") and "{{" not in str(delivery_policy):
            DeliveryPolicy.parse(delivery_policy)
        self.delivery_policy = delivery_policy
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
        check_transport(self.transport)
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
            items = _literal("messages", items)
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise InvalidInputError(f"messages must be a list of dicts, got {type(items).__name__}")
        breaker = CircuitBreaker("storing delayed messages", self.time_to_trigger_store_circuit_breaker)
        store = self.hook.get_store()
        # Idempotent and cheap; a missing table would otherwise look like an unreachable database.
        call_with_breaker(breaker, store.create_schema, retry_on=(UnavailableError,))
        destinations = {d for i in items if isinstance(d := {**defaults, **i}.get("destination"), str)}
        queue_delays = call_with_breaker(breaker, lambda: store.queue_delays(destinations), retry_on=(UnavailableError,))
        # Relative delays count from the store's clock (the database's), which its dispatchers compare
        # due times on; a broker's own delays count from this host's, as the broker's TTLs do.
        now = utcnow() if self.transport != "sql" else call_with_breaker(
            CircuitBreaker("reading the store's clock", self.time_to_trigger_store_circuit_breaker), store.clock,
            retry_on=(UnavailableError,))
        # Every message is checked before anything is stored: a bad one stores none.
        batch = [
            build_message(
                {**defaults, **item},
                now,
                self.queue_delay_seconds,
                default_id=lambda n=n: stable_message_id(*origin, n),
                where=f"messages[{n}]." if self.messages is not None else "",
                queue_delays=queue_delays,
            )
            for n, item in enumerate(items)
        ]
        policy = None if self.delivery_policy in (None, "") else DeliveryPolicy.parse(self.delivery_policy)
        if policy is not None and self.transport != "sql":
            raise InvalidInputError(
                f"delivery_policy applies to messages kept in the store (transport='sql'); {self.transport!r} "
                "delivers through the broker's own delays"
            )
        if self.transport == "sql":
            stored = call_with_breaker(breaker, lambda: store.store(batch), retry_on=(UnavailableError,))
            if stored == len(batch):
                self.log.info("Stored %d message(s)", stored)
            else:  # the same ids again: a retried task, or a batch that names ids already stored
                self.log.info("Stored %d new message(s); %d were already stored with the same ids", stored,
                              len(batch) - stored)
            if policy is not None:
                store.set_policies(dict.fromkeys({m.destination for m in batch}, policy.to_dict()))
                self.log.info("Delivery policy of %s:\n%s", sorted({m.destination for m in batch}), policy.phase_table())
        else:
            self._send_native(store, batch, breaker)
        for m in batch[:20]:
            self.log.info("Scheduled %s for %s at %s", m.message_id, m.destination, m.due_at.isoformat())
        metrics.count_sent(Counter(m.destination for m in batch))
        ids = [m.message_id for m in batch]
        return ids if self.messages is not None else ids[0]

    def _send_native(self, store: SqlDelayedMessageStore, batch: list[DelayedMessage], breaker: CircuitBreaker) -> None:
        """Hand the batch to the broker's own delay mechanism; retry what an outage kept from it.

        Ids the store accepted within its de-duplication window are skipped, and each id the broker
        confirms is recorded there at once: a retried task sends none of them twice."""
        fresh = set(call_with_breaker(breaker, lambda: store.unseen([m.message_id for m in batch]),
                                      retry_on=(UnavailableError,)))
        if len(fresh) < len(batch):
            self.log.info("%d message(s) were already sent with the same ids: not sent again", len(batch) - len(fresh))
        transport = self.get_transport()
        try:
            # A missing queue is found before anything is sent, so a typo sends nothing.
            for destination in sorted({m.destination for m in batch}):
                call_with_breaker(breaker, lambda d=destination: transport.depth(d), retry_on=(UnavailableError,))
            pending = [m for m in batch if m.message_id in fresh]
            while pending:
                try:
                    failures = transport.send(pending)
                except UnavailableError as exc:
                    failures = {m.message_id: exc for m in pending}
                sent = [m.message_id for m in pending if m.message_id not in failures]
                call_with_breaker(breaker, lambda: store.remember_sent(sent), retry_on=(UnavailableError,))
                lost = {mid: e for mid, e in failures.items() if not isinstance(e, UnavailableError)}
                if lost:
                    raise DelayProviderError(
                        f"{len(lost)} of {len(batch)} message(s) were refused by {self.transport} (the "
                        f"{len(sent)} confirmed ones are recorded and a retry will not send them again): "
                        + "; ".join(f"{mid}: {e}" for mid, e in list(lost.items())[:5])
                    )
                pending = [m for m in pending if m.message_id in failures]
                if pending:
                    breaker.failure(next(iter(failures.values())))
            if isinstance(transport, SqsTransport):
                self._log_sqs_plans(transport, batch)
            self.log.info("Sent %d message(s) natively through %s", len(fresh), transport)
        finally:
            transport.close()

    def _log_sqs_plans(self, transport: SqsTransport, batch: list[DelayedMessage]) -> None:
        now = utcnow()
        for m in batch[:20]:
            seconds = max(0, math.ceil((m.due_at - now).total_seconds()))
            plan = delay_plan(seconds, transport.queue_delay)
            how = "native DelaySeconds" if plan.native else f"{plan.fifo_cycles} cycle(s) through the delay queue, then {plan.final_delay} s"
            self.log.info("%s: %d s = %s; relay cost about $%.6f", m.message_id, seconds, how,
                          estimate_cost(seconds, queue_delay=transport.queue_delay))


class DispatchDueMessagesOperator(DelayOperatorBase):
    """Run the dispatch pump: send due messages to their destinations and remove them from the store.

    Stops after `max_runtime`, after `max_messages`, or, with `due_before`, once nothing due before it
    is left. With `deferrable=True` (default: `[operators] default_deferrable`) the task defers at once
    and the pump runs in the triggerer, which sleeps until each due time (woken early on PostgreSQL when
    a sooner message is stored) and delivers it then: no worker slot is held while waiting, and no
    message waits for the task to be resumed. The task resumes once, at the end, to report. Without
    deferral the pump runs in the worker for the whole `max_runtime`. Returns counts: dispatched,
    failed, dead_lettered, released, lateness p50/p99/max, per destination, and why it stopped.

    Failed dispatches are retried by `delivery_policy` (a delivery-policy JSON with four retry phases
    and a throttle, a dict, or a built-in name such as "sqs" or "smtp"; `destination_policies` sets
    one per destination), each retry stored as a delayed message; `number_of_retries` is the shorthand
    for that many immediate retries. A policy's `throttlePolicy.maxReceivesPerSecond` caps deliveries
    per destination.

    :param due_before: dispatch only messages due before this time (templated), and stop once none is left.
    :param due_from: dispatch only messages due at or after this time (templated): with `due_before`, a
        window such as a run's data interval.
    :param destinations: dispatch only these destinations (templated), so one store can serve several teams.
    :param destination_prefix: dispatch only destinations starting with this (with `destinations`: either).
    :param max_messages: stop after this many messages (templated).
    :param max_runtime: stop after this long (timedelta or seconds; templated, e.g. from a param).
    :param batch_size: messages claimed per batch (1..10,000).
    :param number_of_retries: immediate retries when no delivery policy is given.
    :param error_queue: where exhausted messages go.
    :param deferrable: run the pump in the triggerer (see above).
    :param poll_interval: in the triggerer, the longest sleep without a wake-up signal (seconds).
    :param delivery_policy: the default delivery policy; `destination_policies` per destination.
    """

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
        # Checked at parse time: a malformed policy fails the DAG import, not a run.
        self.delivery_policy = None if delivery_policy is None else DeliveryPolicy.parse(delivery_policy)
        self.destination_policies = DeliveryPolicy.parse_each(destination_policies)
        self.due_before = due_before
        self.due_from = due_from
        self.destinations = destinations
        self.destination_prefix = destination_prefix
        self.max_messages = max_messages
        self.max_runtime = _runtime(max_runtime)
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
        due_before = parse_moment(self.due_before, "due_before")
        due_from = parse_moment(self.due_from, "due_from")
        if due_before is not None and due_from is not None and due_from >= due_before:
            raise InvalidInputError(f"due_from ({due_from.isoformat()}) must be before due_before "
                                    f"({due_before.isoformat()}): the window would be empty")
        return DispatchTrigger(
            delay_store_conn_id=self.delay_store_conn_id, table=self.table, db_schema=self.db_schema,
            transport=self.transport, transport_conn_id=self.transport_conn_id,
            transport_options=self.transport_options, pump_config=asdict(self.pump_config),
            delivery_policy=None if self.delivery_policy is None else self.delivery_policy.to_dict(),
            destination_policies={d: p.to_dict() for d, p in self.destination_policies.items()},
            due_before=None if due_before is None else due_before.isoformat(),
            due_from=None if due_from is None else due_from.isoformat(),
            destinations=_destinations(self.destinations), destination_prefix=self.destination_prefix or None,
            deadline=deadline.isoformat(), max_messages=_count("max_messages", self.max_messages),
            poll_interval=self.poll_interval,
        )

    def execute(self, context: Context) -> dict:
        trigger = self._trigger(utcnow() + _runtime(self.max_runtime))
        for destination, p in self.destination_policies.items():
            self.log.info("Delivery policy for %s %s:\n%s", destination, json.dumps(p.to_dict()), p.phase_table())
        if self.delivery_policy is not None:
            self.log.info("Delivery policy %s:\n%s", json.dumps(self.delivery_policy.to_dict()),
                          self.delivery_policy.phase_table())
        scope = {k: v for k, v in (("due_from", trigger.due_from), ("due_before", trigger.due_before),
                                   ("destinations", trigger.destinations), ("prefix", trigger.destination_prefix))
                 if v is not None}
        if self.deferrable:
            self.log.info("Dispatching from the triggerer until %s (%s)", trigger.deadline, scope or "every due message")
            self.defer(trigger=trigger, method_name="execute_complete")
        pump = trigger.open_pump()
        self.log.info("Dispatching from %r through %s (%s) until %s (%s)", pump.store, pump.transport.name,
                      "exactly once" if pump.exactly_once else "at least once", trigger.deadline,
                      scope or "every due message")
        try:
            result = pump.run(deadline=pump.from_host_time(datetime.fromisoformat(trigger.deadline)),
                              max_messages=trigger.max_messages, due_before=_optional(trigger.due_before))
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


def _literal(name: str, text: str) -> Any:
    """A rendered template: JSON, or the Python literal a list of dicts renders to (never code)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise InvalidInputError(f"{name} must render to a JSON list of objects (or a Python list of dicts), "
                                f"got {text[:200]!r}") from None


def _public(summary: dict) -> dict:
    """A summary without the lateness histogram's buckets: what XCom and the log get."""
    return {k: v for k, v in summary.items() if k != "lateness"}


def _optional(moment: str | None) -> datetime | None:
    return None if moment is None else datetime.fromisoformat(moment)


def _runtime(value: Any) -> timedelta | str:
    """`max_runtime` as a timedelta: a timedelta, or seconds (a number or a rendered number > 0); a
    template is left for rendering."""
    if isinstance(value, str) and "{{" in value:
        return value
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    else:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = -1.0
        if isinstance(value, bool):
            seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise InvalidInputError(f"max_runtime must be a timedelta or a number of seconds > 0, got {value!r}")
    return timedelta(seconds=seconds)


def _count(name: str, value: Any) -> int | None:
    """A rendered count: an int >= 1, or nothing."""
    if value in (None, ""):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or str(n) != str(value).strip():
        raise InvalidInputError(f"{name} must be a whole number >= 1, got {value!r}")
    return n


def _destinations(value: Any) -> list[str] | None:
    """A rendered destination list: a list of names or a comma-separated string; each name is checked."""
    if value in (None, "", []):
        return None
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise InvalidInputError(f"destinations must be a list of destination names, got {value!r}")
    return [check_destination(n) for n in names]


class MigrateDelayedMessagesOperator(DelayOperatorBase):
    """Move pending delayed messages between the SQL store and RabbitMQ's delay levels, keeping due times.

    `direction="store_to_rabbitmq"` hands every stored message (due or not) to the levels with its
    remaining delay; `direction="rabbitmq_to_store"` drains the levels into the store (messages
    without the needed headers go to the `<prefix>.poison` queue). Returns the counts.
    """

    DIRECTIONS = ("store_to_rabbitmq", "rabbitmq_to_store")

    def __init__(self, *, direction: str, batch_size: int = 500, **kwargs: Any) -> None:
        kwargs.setdefault("transport", "rabbitmq")
        super().__init__(**kwargs)
        if direction not in self.DIRECTIONS:
            raise InvalidInputError(f"direction {direction!r} is not supported; choose one of {list(self.DIRECTIONS)}")
        if self.transport != "rabbitmq":
            raise InvalidInputError("migration moves messages to or from RabbitMQ: use transport='rabbitmq'")
        self.direction = direction
        self.batch_size = batch_size

    def execute(self, context: Context) -> dict:
        store = self.hook.get_store()
        store.create_schema()
        transport = self.get_transport()
        try:
            if self.direction == "store_to_rabbitmq":
                result = hand_over(store, transport, self.batch_size)
            else:
                result = transport.drain_levels(store, self.batch_size)
        finally:
            transport.close()
        self.log.info("Migrated (%s): %s", self.direction, json.dumps(result))
        return {"direction": self.direction, **result}


class RelayDelayedMessagesOperator(DelayOperatorBase):
    """Run the SQS relay of one endpoint for a bounded time (the consumer of its -delay.fifo queue).

    Checks the delay queue first (present, delay >= Q, retention longer than Q, no redrive policy; a
    warning when retention leaves less than `max_relay_downtime` for the relay to be down), then
    long-polls it, sending each message back for another cycle or on to the endpoint with the rest
    of its delay. With `deferrable=True`, while the delay queue has nothing to relay the task waits
    on SqsDelayQueueTrigger instead of a worker (and pays for no empty polls). A `delivery_policy`
    with `throttlePolicy.maxReceivesPerSecond` caps the hand-overs to the endpoint. Returns counts:
    relayed, handed_over, failed, held (by the throttle, for a later receive).
    """

    template_fields: Sequence[str] = ("endpoint", "max_runtime")

    def __init__(
        self,
        *,
        endpoint: str,
        max_runtime: timedelta | float | str = timedelta(minutes=5),
        wait_time_seconds: int = 20,
        deferrable: bool = False,
        poll_interval: float = 30.0,
        delivery_policy: DeliveryPolicy | dict | str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("transport", "sqs")
        super().__init__(**kwargs)
        # Only its throttlePolicy applies here: SQS itself redelivers what the relay fails to move.
        self.delivery_policy = None if delivery_policy is None else DeliveryPolicy.parse(delivery_policy)
        if self.transport != "sqs":
            raise InvalidInputError("the relay serves SQS delay queues: use transport='sqs'")
        self.endpoint = endpoint
        self.max_runtime = _runtime(max_runtime)
        self.wait_time_seconds = wait_time_seconds
        self.deferrable = deferrable
        self.poll_interval = poll_interval

    def execute(self, context: Context) -> dict:
        transport = self.get_transport()
        self.log.info("Delay queue checked: %s", transport.verify(self.endpoint))
        return self._relay(transport, RelayCounts(), utcnow() + _runtime(self.max_runtime))

    def execute_complete(self, context: Context, event: dict) -> dict:
        if event.get("status") == "error":
            raise UnavailableError(f"waiting on the delay queue failed: {event.get('message')}")
        state = event["carry"]
        return self._relay(self.get_transport(), RelayCounts(**state["counts"]), datetime.fromisoformat(state["deadline"]))

    def _relay(self, transport: SqsTransport, totals: RelayCounts, deadline: datetime) -> dict:
        rate = self.delivery_policy.max_receives_per_second if self.delivery_policy else None
        throttle = TokenBucket(rate) if rate else None
        while (left := (deadline - utcnow()).total_seconds()) > 0:
            if self.deferrable and transport.lifecycle(self.endpoint, delay_queue=True)["visible"] == 0:
                self.log.info("Nothing to relay now (%s so far): deferring", totals)
                self.defer(
                    trigger=SqsDelayQueueTrigger(
                        endpoint=self.endpoint,
                        aws_conn_id=self.transport_conn_id or SqsDelayHook.default_conn_name,
                        transport_options=self.transport_options,
                        deadline=deadline.isoformat(),
                        poll_interval=self.poll_interval,
                        carry={"counts": asdict(totals), "deadline": deadline.isoformat()},
                    ),
                    method_name="execute_complete",
                )
            totals.add(transport.relay_once(self.endpoint, min(self.wait_time_seconds, max(0, int(left))), throttle=throttle))
        self.log.info("Relay finished: %s", json.dumps(asdict(totals)))
        return asdict(totals)
