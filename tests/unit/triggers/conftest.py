"""What the asset triggers' tests share: a store behind a `delay_store` connection, and the shared-stream manager's
steps as the triggerer takes them."""

from __future__ import annotations

import asyncio
import json

import pytest

from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport


@pytest.fixture
def store_conn(tmp_path, monkeypatch):
    """A `delay_store` connection to a SQLite file of this test's own, its store and its error queue."""
    path = tmp_path / "store.db"
    monkeypatch.setenv("AIRFLOW_CONN_ASSET_UNIT_STORE", json.dumps(
        {"conn_type": "delay_store", "schema": str(path), "extra": {"driver": "sqlite"}}))
    store = SqlDelayedMessageStore(f"sqlite:///{path}")
    store.create_schema()
    queues = SqlTableTransport(f"sqlite:///{path}")
    queues.provision("error")
    return "asset_unit_store", store, queues


async def _subscribe(manager, trigger, trigger_id: int = 1):
    """The trigger's events as a SharedStreamManager (Airflow 3.3) hands them to it."""
    key = trigger.shared_stream_key()
    return key, trigger.filter_shared_stream(manager.subscribe(trigger_id=trigger_id, trigger=trigger, key=key))


async def _next_event(stream, manager, key, trigger_id: int = 1, timeout: float = 10.0):
    """What the triggerer does: take the trigger's next event and bind it to the raw event it came from."""
    event = await asyncio.wait_for(anext(stream), timeout)
    return event, manager.bind_pending_event(trigger_id=trigger_id, key=key)
