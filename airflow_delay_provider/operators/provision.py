"""ProvisionDelayInfrastructureOperator: create (or verify) the store and the destinations' queues."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from airflow.sdk import Context

from airflow_delay_provider.core.delays import LONGEST_MAX_DELAY_SECONDS, resolve_delay
from airflow_delay_provider.core.errors import DelayProviderError, InvalidInputError
from airflow_delay_provider.core.message import check_destination
from airflow_delay_provider.core.ports import Transport
from airflow_delay_provider.core.requests import resolved_at_run_time
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.operators.base import DelayOperatorBase
from airflow_delay_provider.transports.registry import check_options, transport_kind


class ProvisionDelayInfrastructureOperator(DelayOperatorBase):
    """Create the delayed-message store and the transport's destination queues (idempotent).

    With RabbitMQ this declares the 28 delay levels, the delivery exchange with its `unroutable`
    safety net, and each endpoint's queue and binding. Every endpoint name is checked before anything
    is created. Returns a JSON summary.

    :param endpoints: the destinations to create (templated); the `error_queue` is added.
    :param error_queue: where exhausted messages go.
    :param create_store: also create the store's tables.
    :param verify: change nothing: report what is missing or declared with other arguments, and fail
        the task when anything is.
    :param endpoint_options: for each endpoint (not the error queue): `queue_delay_seconds`
        (0..604800, or up to the store connection's `max_delay_seconds`; stored with the destination and applied
        by every send to messages without a delay of their own; on SQS, up to 900 s, also the queue's
        DelaySeconds) and, on SQS, `unrestricted`.
    :param destination_policies: delivery policies stored per destination, so every dispatch task and
        sweep retries those destinations the same way.
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
        self.destination_policies = DeliveryPolicy.parse_each(destination_policies)
        self.endpoints = endpoints
        self.endpoint_options = dict(endpoint_options or {})
        check_options(self.transport, self.endpoint_options, "endpoint_options")
        queue_delay = self.endpoint_options.get("queue_delay_seconds")
        # The store connection's longest delay is read when the task runs; a DAG file is held to ten years.
        resolve_delay(queue_delay=queue_delay, queue_field="endpoint_options.queue_delay_seconds",
                      limit=LONGEST_MAX_DELAY_SECONDS)
        # A broker whose queues hold their own delay (SQS) gets it too, within the broker's limit.
        self._attribute_limit = transport_kind(self.transport).queue_attribute_delay
        if queue_delay is not None and self._attribute_limit is not None and queue_delay > self._attribute_limit:
            raise InvalidInputError(
                f"endpoint_options.queue_delay_seconds is {queue_delay}, but a {self.transport} queue's delay is at "
                f"most {self._attribute_limit} s; allowed: 0..{self._attribute_limit}")
        self.error_queue = error_queue
        if not resolved_at_run_time(endpoints):  # templated endpoints are checked when the task runs
            for endpoint in [*endpoints, error_queue]:
                check_destination(endpoint)
        self.create_store = create_store
        self.verify = verify

    def execute(self, context: Context) -> dict:
        endpoints = list(dict.fromkeys(check_destination(e) for e in [*self.endpoints, self.error_queue]))
        # The queue-level delay is kept in the store; a transport's own options go to its queues.
        native = {k: v for k, v in self.endpoint_options.items()
                  if k != "queue_delay_seconds" or self._attribute_limit is not None}
        queue_delay = self.endpoint_options.get("queue_delay_seconds")
        if queue_delay is not None:
            limits = self.hook.delay_limits
            for endpoint in endpoints:
                resolve_delay(queue_delay=queue_delay, queue_field=f"endpoint_options.queue_delay_seconds of "
                              f"{endpoint!r}", limit=limits.of(endpoint))
        transport = self.get_transport()
        try:
            for endpoint in endpoints:  # every name is checked before anything is created
                transport.check_endpoint(endpoint, **(native if endpoint != self.error_queue else {}))
            if self.verify:
                return self._verify(transport.verify(endpoints), transport)
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
                # Where these endpoints' dead letters are: the page's dead letters find them here.
                store.routes.record(self.transport, self.transport_conn_id, self.error_queue,
                                    {"endpoints": [e for e in endpoints if e != self.error_queue]})
            summary["queues"] = [transport.provision(e, **(native if e != self.error_queue else {})) for e in endpoints]
        finally:
            transport.close()
        self.log.info("Provisioned: %s", json.dumps(summary))
        return summary

    def _verify(self, report: dict, transport: Transport) -> dict:
        self.log.info("Verified %s: %s", transport.where, json.dumps(report))
        if not report["complete"]:
            raise DelayProviderError(
                f"the delay infrastructure on {transport.where} is incomplete: missing "
                f"{report['missing']}, declared with other arguments {report['different']}; run this task without "
                "verify=True to declare it"
            )
        return report
