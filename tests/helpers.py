"""Small builders shared by the tests."""

from __future__ import annotations

from datetime import timedelta

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport


def make_store(url, schema, table) -> SqlDelayedMessageStore:
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    return store


def make_transport(url, schema, table, *queues: str) -> SqlTableTransport:
    transport = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    for queue in queues:
        transport.provision(queue)
    return transport


def messages(n: int, destination: str = "orders", delay: float = 0.0, start: int = 0) -> list[DelayedMessage]:
    due = utcnow() + timedelta(seconds=delay)
    return [DelayedMessage(destination, f"body-{i}".encode(), due, {"n": str(i)}, f"m-{i}") for i in range(start, start + n)]


def drain(transport: SqlTableTransport, queue: str) -> list:
    received = []
    while batch := transport.receive(queue, max_messages=1000):
        received.extend(batch)
        transport.ack(queue, [m.receipt for m in batch])
    return received
