"""Which hook opens which transport: one mapping for operators and triggers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.hooks.delay_store import DelayStoreHook

if TYPE_CHECKING:
    from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook
    from airflow_delay_provider.hooks.sqs import SqsDelayHook

#: Transports a destination can be reached through.
TRANSPORTS = ("sql", "rabbitmq", "sqs")


def check_transport(transport: object) -> str:
    if transport not in TRANSPORTS:
        raise InvalidInputError(f"transport {transport!r} is not supported; choose one of {list(TRANSPORTS)}")
    return transport  # type: ignore[return-value]


def transport_hook(
    transport: str, transport_conn_id: str | None, store: DelayStoreHook, db_schema: str | None = None
) -> DelayStoreHook | RabbitMQDelayHook | SqsDelayHook:
    """The hook of the transport's connection: `sql` without a connection means the store's own database."""
    check_transport(transport)
    if transport == "rabbitmq":
        from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook

        return RabbitMQDelayHook(transport_conn_id or RabbitMQDelayHook.default_conn_name)
    if transport == "sqs":
        from airflow_delay_provider.hooks.sqs import SqsDelayHook

        return SqsDelayHook(aws_conn_id=transport_conn_id or SqsDelayHook.default_conn_name)
    if transport_conn_id is None:
        return store
    return DelayStoreHook(transport_conn_id, db_schema=db_schema)


#: The options SqsTransport takes from `transport_options`.
SQS_OPTIONS = ("body_expiration_days", "large_body_bucket", "max_body_bytes", "max_relay_downtime", "prefix",
               "queue_delay", "unrestricted")


def transport_options(transport: str, options: dict) -> dict:
    """`transport_options` are SQS's (prefix, queue_delay, large_body_bucket, ...); the others take none."""
    if transport != "sqs":
        return {}
    unknown = sorted(set(options) - set(SQS_OPTIONS))
    if unknown:
        raise InvalidInputError(f"transport_options {unknown} are not known for transport='sqs'; "
                                f"allowed: {list(SQS_OPTIONS)}")
    return dict(options)
