"""What every delay operator shares: the delayed-message store and the transport to the destinations."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow.sdk import BaseOperator

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.ports import Transport
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.hooks.delay_store import DelayStoreMixin
from airflow_delay_provider.hooks.transport import check_transport, transport_hook, transport_options


class DelayOperatorBase(DelayStoreMixin, BaseOperator):
    """Shared arguments: the delayed-message store (see DelayStoreMixin), and the transport that
    reaches the destinations.

    :param transport: `"sql"`: queues as tables, in the store's database unless `transport_conn_id`
        names another `delay_store` connection; `"rabbitmq"`: the broker of the `rabbitmq` connection
        `transport_conn_id` (default `rabbitmq_default`); `"sqs"`: Amazon SQS through the `aws`
        connection `transport_conn_id` (default `aws_default`).
    :param transport_conn_id: the transport's connection (see `transport`).
    :param aws_conn_id: with `transport="sqs"`, the `aws` connection, under the amazon provider's name (the same as
        `transport_conn_id`; give one of the two).
    :param transport_options: SQS's `prefix`, `queue_delay` (Q, default 900), `large_body_bucket` and
        the other options of the transport registry; other transports take none.
    """

    def __init__(
        self,
        *,
        transport: str = "sql",
        transport_conn_id: str | None = None,
        transport_options: dict | None = None,
        aws_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # A template ("{{ params.transport }}") is checked once rendered, where the field is templated.
        templated = "transport" in self.template_fields and "{{" in str(transport)
        self.transport = transport if templated else check_transport(transport)
        self.transport_conn_id = _connection(self.transport, transport_conn_id, aws_conn_id, templated)
        self.transport_options = dict(transport_options or {})
        if not templated:  # options the transport does not take fail the DAG's import, not a run
            self._options()

    def _set_policies(self, delivery_policy: Any, destination_policies: Any) -> None:
        """The default and per-destination delivery policies, checked when the DAG is parsed: a malformed
        one fails the import, not a run."""
        self.delivery_policy = None if delivery_policy is None else DeliveryPolicy.parse(delivery_policy)
        self.destination_policies = DeliveryPolicy.parse_each(destination_policies)

    def _transport_hook(self) -> Any:
        """The hook of the transport's connection (the transport is rendered by now, if it was a template)."""
        return transport_hook(self.transport, self.transport_conn_id, self.hook, self.db_schema)

    def _options(self) -> dict:
        return transport_options(self.transport, self.transport_options)

    def get_transport(self) -> Transport:
        return self._transport_hook().get_transport(**self._options())

    def transport_spec(self) -> dict:
        """The transport as plain data (with its secrets), for a process without Airflow."""
        return self._transport_hook().transport_spec(**self._options())


def _connection(transport: str, transport_conn_id: str | None, aws_conn_id: str | None, templated: bool) -> str | None:
    """The transport's connection id from `transport_conn_id` or, for SQS, the amazon provider's `aws_conn_id`."""
    if aws_conn_id is None:
        return transport_conn_id
    if not templated and transport != "sqs":
        raise InvalidInputError(f"aws_conn_id is the connection of transport='sqs'; with transport={transport!r} name "
                                "the connection with transport_conn_id")
    if transport_conn_id is not None and transport_conn_id != aws_conn_id:
        raise InvalidInputError(f"aws_conn_id={aws_conn_id!r} and transport_conn_id={transport_conn_id!r} name two "
                                "connections for one transport: give aws_conn_id alone")
    return aws_conn_id


def run_time(context: Any) -> datetime | None:
    """The time a task's DAG run was due to run (the same for every try of the task), for message ids that
    sort by it; None when the context has no DAG run (a test calling execute with a bare context)."""
    dag_run = context.get("dag_run") if hasattr(context, "get") else None
    moment = getattr(dag_run, "run_after", None) or getattr(dag_run, "logical_date", None)
    return moment if isinstance(moment, datetime) else None
