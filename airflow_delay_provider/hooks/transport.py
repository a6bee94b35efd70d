"""Which hook opens which transport, read from the transport registry: one mapping for operators and triggers."""

from __future__ import annotations

from typing import Any

from airflow_delay_provider.hooks.delay_store import DelayStoreHook
from airflow_delay_provider.transports.registry import TRANSPORTS, check_options, check_transport, load, transport_kind

__all__ = ["TRANSPORTS", "check_transport", "transport_hook", "transport_options"]


def transport_hook(transport: str, transport_conn_id: str | None, store: DelayStoreHook,
                   db_schema: str | None = None) -> Any:
    """The hook of the transport's connection; a transport without a default connection (`sql`) and no
    `transport_conn_id` is the store's own database."""
    kind = transport_kind(transport)
    if transport_conn_id is None and kind.default_conn_id is None:
        return store
    return load(kind.hook).for_transport(transport_conn_id or kind.default_conn_id, db_schema=db_schema)


def transport_options(transport: str, options: dict) -> dict:
    """The `transport_options` the transport's hook takes (e.g. SQS's prefix, queue_delay, large_body_bucket)."""
    return check_options(transport, options)
