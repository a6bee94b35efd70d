"""SendDelayedMessageOperator: schedule messages, in the store or through a broker's own delays."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import Context

from airflow_delay_provider import metrics
from airflow_delay_provider.core.breakers import CircuitBreaker, call_with_breaker
from airflow_delay_provider.core.duplicates import SKIP, check_natively, check_on_duplicate
from airflow_delay_provider.core.errors import InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import stable_message_id
from airflow_delay_provider.core.requests import (
    PARSE_TIME_LIMITS,
    PARSE_TIME_NOW,
    build_batch,
    destinations_of,
    parse_messages,
    resolved_at_run_time,
)
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.core.sending import send_natively
from airflow_delay_provider.hooks.transport import check_transport
from airflow_delay_provider.links import SentMessagesLink
from airflow_delay_provider.operators.base import DelayOperatorBase, run_time
from airflow_delay_provider.transports.registry import transport_class

#: What a value known only at run time stands as when the DAG is parsed: valid, so only the literals are judged.
_STAND_INS: dict[str, Any] = {"destination": "stand-in", "body": "", "headers": None, "delay_seconds": None,
                              "deliver_at": None}


class SendDelayedMessageOperator(DelayOperatorBase):
    """Schedule one message (or a batch) for delivery after a delay; returns the message id(s), and pushes the
    XCom `due_before`: just past the last due time it scheduled, the window of a dispatcher of these messages
    (`due_before="{{ ti.xcom_pull(task_ids='send', key='due_before') }}"`).

    `transport="sql"` keeps the message in the delayed-message store until a dispatch task sends
    it; `transport="rabbitmq"` or `"sqs"` hands it to the broker's own delays at once (nothing to
    dispatch). Ids not given are derived from the task instance, and every id is remembered for the
    store's de-duplication window, so a retried task sends nothing twice.

    :param destination: where the message goes (templated).
    :param body: the message body, str or bytes (templated).
    :param headers: `str -> str` headers (templated).
    :param delay_seconds: int, float or timedelta (fractions round up; templated): 0..604,800 (7 days), or up to
        the store connection's `max_delay_seconds` (at most ten years).
    :param deliver_at: an aware datetime or ISO string; a time in the past means now (templated).
    :param queue_delay_seconds: the queue-level delay for a destination provisioned without one; a
        destination provisioned with `endpoint_options={"queue_delay_seconds": N}` keeps N, and a
        value that disagrees is refused (templated).
    :param messages: a batch: dicts with destination, body, headers, delay_seconds, deliver_at,
        message_id; missing keys take the operator's values (templated; JSON or a Python literal).
    :param message_id: the id of a single message (default: derived from the task instance).
    :param delivery_policy: delivery-policy JSON, a dict or a built-in name, stored as the
        destinations' policy beside the messages (`transport="sql"`; templated).
    :param message_group_id: the SQS message group of every message without an `x-message-group-id`
        header of its own, as the amazon provider's SqsPublishOperator takes it: it orders the messages
        of a FIFO destination (sent natively, or dispatched from the store; default group `default`).
        It travels as that header (templated).
    :param on_duplicate: what a send of an id the store holds does (templated): ``skip`` (the default:
        the stored message stays), ``replace`` (the new due time, body and headers replace it: a debounce),
        ``keep_earliest`` (the one due first wins) or ``replace_body`` (the body and headers change, the due
        time stays). Once delivered, a duplicate within the de-duplication window is skipped in every mode.
        Modes other than ``skip`` need ``transport="sql"``: a broker's own delays cannot change a message.
    :param time_to_trigger_store_circuit_breaker: how long (s) the store may be unreachable before the
        task fails.
    """

    operator_extra_links = (SentMessagesLink(),)
    template_fields: Sequence[str] = (
        "transport", "destination", "body", "headers", "delay_seconds", "deliver_at", "queue_delay_seconds",
        "messages", "message_id", "delivery_policy", "message_group_id", "on_duplicate",
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
        message_group_id: str | None = None,
        on_duplicate: str = SKIP,
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
        self.message_group_id = message_group_id
        self.on_duplicate = on_duplicate
        self.time_to_trigger_store_circuit_breaker = time_to_trigger_store_circuit_breaker
        self._check_literals()

    def _check_literals(self) -> None:
        """Check what the DAG file gives literally, as execute() does, when the DAG is parsed (a delay out of range
        fails the import, naming the argument and the range); what is templated or comes from XCom is checked once
        rendered. Stand-ins take the place of those, and of the store's clock and queue-level delays."""
        fields = {"destination": self.destination, "body": self.body, "headers": self.headers,
                  "delay_seconds": self.delay_seconds, "deliver_at": self.deliver_at}
        defaults = {k: _STAND_INS[k] if resolved_at_run_time(v) else v for k, v in fields.items()}
        later_batch = self.messages is not None and resolved_at_run_time(self.messages)
        if later_batch and defaults["destination"] is None:  # each message may name its own
            defaults["destination"] = _STAND_INS["destination"]
        if self.messages is None or later_batch:
            items = [{"message_id": None if resolved_at_run_time(self.message_id) else self.message_id}]
        else:
            items = parse_messages(self.messages)
        queue_delay = None if resolved_at_run_time(self.queue_delay_seconds) else self.queue_delay_seconds
        build_batch(items, defaults, PARSE_TIME_NOW, queue_delay, batch=self.messages is not None and not later_batch,
                    limits=PARSE_TIME_LIMITS)
        if not resolved_at_run_time(self.on_duplicate):
            check_on_duplicate(self.on_duplicate)
            if not resolved_at_run_time(self.transport) and transport_class(self.transport).delays_natively:
                check_natively(self.on_duplicate, self.transport)
        literal = [not resolved_at_run_time(v) for v in (self.delivery_policy, self.transport)]
        if self.delivery_policy not in (None, "") and all(literal) and transport_class(self.transport).delays_natively:
            raise InvalidInputError(f"delivery_policy applies to messages kept in the store (transport='sql'); "
                                    f"{self.transport!r} delivers through the broker's own delays")

    def execute(self, context: Context) -> str | list[str]:
        check_transport(self.transport)
        self._options()  # a send kept in the store opens no transport: options it would ignore are refused here
        ti = context["ti"]
        origin = (ti.dag_id, ti.run_id, ti.task_id, getattr(ti, "map_index", -1))
        defaults = {"destination": self.destination, "body": self.body, "headers": self.headers,
                    "delay_seconds": self.delay_seconds, "deliver_at": self.deliver_at}
        items = parse_messages(self.messages if self.messages is not None
                               else [{**defaults, "message_id": self.message_id}])
        policy = None if self.delivery_policy in (None, "") else DeliveryPolicy.parse(self.delivery_policy)
        native = transport_class(self.transport).delays_natively
        on_duplicate = check_on_duplicate(self.on_duplicate or SKIP)
        if native:  # refused before anything is sent
            check_natively(on_duplicate, self.transport)
        if policy is not None and native:
            raise InvalidInputError(f"delivery_policy applies to messages kept in the store (transport='sql'); "
                                    f"{self.transport!r} delivers through the broker's own delays")
        breaker = CircuitBreaker("storing delayed messages", self.time_to_trigger_store_circuit_breaker)
        store = self.hook.get_store()

        def guarded(call):
            return call_with_breaker(breaker, call, retry_on=(UnavailableError,))

        # Created or upgraded only where the connection's auto_migrate allows it; otherwise a store not there (or
        # older than this release) fails the task at once, saying what to run, with nothing stored.
        guarded(lambda: self.hook.prepare_for_writes(store))
        queue_delays = guarded(lambda: store.queue_delays(destinations_of(items, defaults)))
        # Relative delays count from the store's clock (the database's), which its dispatchers compare due
        # times on; a broker's own delays are the due time minus now on that same clock (use_clock below).
        now = guarded(store.clock)
        ran = run_time(context)
        batch = build_batch(items, defaults, now, self.queue_delay_seconds,
                            lambda n: stable_message_id(*origin, n, at=ran), queue_delays,
                            batch=self.messages is not None, limits=self.hook.delay_limits)
        if self.message_group_id not in (None, ""):
            # Only a group needs the SQS module (and botocore).
            from airflow_delay_provider.transports.sqs import HEADER_MESSAGE_GROUP, check_message_group_id

            group = {HEADER_MESSAGE_GROUP: check_message_group_id(self.message_group_id, "message_group_id")}
            batch = [m if HEADER_MESSAGE_GROUP in m.headers else replace(m, headers={**group, **m.headers})
                     for m in batch]
        if not native:
            stored = guarded(lambda: store.store(batch, on_duplicate=on_duplicate))
            # Fewer: the same ids again (a retried task, or a batch naming ids already accepted).
            if on_duplicate == SKIP:
                self.log.info("Stored %d new message(s); %d were already accepted with the same ids", stored,
                              len(batch) - stored)
            else:
                self.log.info("Stored or changed (on_duplicate=%s) %d message(s); %d left as they were (delivered "
                              "within the de-duplication window, held by a sweep, or kept by the mode)",
                              on_duplicate, stored, len({m.message_id for m in batch}) - stored)
            if policy is not None:
                store.set_policies(dict.fromkeys({m.destination for m in batch}, policy.to_dict()))
                self.log.info("Delivery policy of %s:\n%s", sorted({m.destination for m in batch}),
                              policy.phase_table())
        else:
            transport = self.get_transport().use_clock(store.clock)
            try:
                sent = send_natively(store, transport, batch, breaker, on_duplicate)
            finally:
                transport.close()
            self.log.info("Sent %d message(s) natively through %s", sent, transport)
        for m in batch[:20]:
            self.log.info("Scheduled %s for %s at %s", m.message_id, m.destination, m.due_at.isoformat())
        metrics.count_sent(Counter(m.destination for m in batch))
        # The window of a dispatcher of this task's own messages: due_before is exclusive, so just past the last
        # due time, on the store's clock (a window counted from the run's start closes early when tasks queue).
        ti.xcom_push(key="due_before", value=(max(m.due_at for m in batch) + timedelta(microseconds=1)).isoformat())
        ids = [m.message_id for m in batch]
        return ids if self.messages is not None else ids[0]
