"""RelayDelayedMessagesOperator: the SQS relay of an endpoint's -delay.fifo queue, for a bounded time."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from airflow.exceptions import AirflowProviderDeprecationWarning
from airflow.sdk import Context

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import check_destination
from airflow_delay_provider.core.requests import parse_runtime
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.hooks.sqs import SqsDelayHook
from airflow_delay_provider.operators.base import DelayOperatorBase
from airflow_delay_provider.transports.sqs import RelayCounts, SqsTransport
from airflow_delay_provider.triggers.sqs import SqsDelayQueueTrigger


class RelayDelayedMessagesOperator(DelayOperatorBase):
    """Run the SQS relay of one endpoint for a bounded time (the consumer of its -delay.fifo queue).

    Checks the delay queue first (present, delay >= Q, retention longer than Q, no redrive policy; a
    warning when retention leaves less than the `max_relay_downtime` transport option for the relay to
    be down), then long-polls it, sending each message back for another cycle or on to the endpoint
    with the rest of its delay. The transport must be SQS (`transport="sqs"`, the default here), reached
    through the `aws` connection `aws_conn_id`. Returns counts: relayed, handed_over, failed, held (by the
    throttle, for a later receive), dead_lettered (refused by SQS for good).

    :param endpoint: the endpoint whose `-delay.fifo` queue to relay (templated).
    :param aws_conn_id: the `aws` connection (default `aws_default`; templated), as the amazon provider's
        operators name it. `transport_conn_id`, its earlier name here, still works and warns
        (AirflowProviderDeprecationWarning).
    :param max_runtime: how long to relay (timedelta or seconds; default 5 minutes; templated).
    :param wait_time_seconds: how long each long poll waits for messages (seconds, 0..20 as SQS allows;
        default 20); shortened near the end of `max_runtime`.
    :param deferrable: while the delay queue has nothing to relay, wait on SqsDelayQueueTrigger in the
        triggerer instead of a worker (and pay for no empty polls); default False.
    :param poll_interval: when deferred, how often (seconds) the trigger checks the delay queue.
    :param delivery_policy: only its `throttlePolicy.maxReceivesPerSecond` applies: it caps the hand-overs
        to the endpoint (SQS itself redelivers what the relay fails to move). A delivery-policy JSON, a
        dict or a built-in name; default: no cap.
    :param error_queue: where a message SQS refuses for good (larger than its destination takes, say) goes,
        as the dispatch's dead letters do (default `error`); while that fails too, it waits in the delay queue.
    """

    template_fields: Sequence[str] = ("endpoint", "max_runtime", "aws_conn_id")

    def __init__(
        self,
        *,
        endpoint: str,
        aws_conn_id: str | None = None,
        max_runtime: timedelta | float | str = timedelta(minutes=5),
        wait_time_seconds: int = 20,
        deferrable: bool = False,
        poll_interval: float = 30.0,
        delivery_policy: DeliveryPolicy | dict | str | None = None,
        error_queue: str = "error",
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("transport", "sqs")
        if kwargs.get("transport_conn_id") is not None:
            warnings.warn("RelayDelayedMessagesOperator(transport_conn_id=...) is deprecated: name the aws connection "
                          "with aws_conn_id, as the amazon provider's operators do",
                          AirflowProviderDeprecationWarning, stacklevel=2)
        super().__init__(aws_conn_id=aws_conn_id, **kwargs)
        # Only its throttlePolicy applies here: SQS itself redelivers what the relay fails to move.
        self.delivery_policy = None if delivery_policy is None else DeliveryPolicy.parse(delivery_policy)
        if self.transport != "sqs":
            raise InvalidInputError("the relay serves SQS delay queues: use transport='sqs'")
        self.endpoint = endpoint
        self.max_runtime = parse_runtime(max_runtime)
        self.wait_time_seconds = wait_time_seconds
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.error_queue = check_destination(error_queue)

    # One attribute under both names: aws_conn_id is the templated field, and the base class reads transport_conn_id.
    @property
    def transport_conn_id(self) -> str | None:
        return self.aws_conn_id

    @transport_conn_id.setter
    def transport_conn_id(self, value: str | None) -> None:
        self.aws_conn_id = value

    def execute(self, context: Context) -> dict:
        transport = self.get_transport()
        self.log.info("Delay queue checked: %s", transport.check_delay_queue(self.endpoint))
        return self._relay(transport, RelayCounts(), utcnow() + parse_runtime(self.max_runtime))

    def execute_complete(self, context: Context, event: dict) -> dict:
        if event.get("status") == "error":
            raise UnavailableError(f"waiting on the delay queue failed: {event.get('message')}")
        state = event["carry"]
        return self._relay(self.get_transport(), RelayCounts(**state["counts"]),
                           datetime.fromisoformat(state["deadline"]))

    def _relay(self, transport: SqsTransport, totals: RelayCounts, deadline: datetime) -> dict:
        rate = self.delivery_policy.max_receives_per_second if self.delivery_policy else None
        stopped = transport.relay_until(self.endpoint, deadline, totals, wait_time_seconds=self.wait_time_seconds,
                                        max_per_second=rate, until_idle=self.deferrable,
                                        error_queue=self.error_queue)
        if stopped == "idle":
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
        self.log.info("Relay finished: %s", json.dumps(asdict(totals)))
        return asdict(totals)
