"""A dispatcher started before provisioning waits for it: one clear line a minute that says what to run (never a
statement's text), no breaker counting the wait, and delivery once the store and its queues are there. The pump
on simulated time (its breakers' clock and sleep), the deferrable trigger and the asset-event producer on real
time; SQLite and the real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import inspect

from airflow_delay_provider.core.breakers import CircuitBreaker
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.conftest import PG_URL
from tests.helpers import drain, messages, store_connection
from tests.waiting import wait_for

NO_STORE = "has no tables yet: run the provisioning DAG or `airflow delayed-messages db upgrade"
NO_QUEUES = "have no tables yet: run the provisioning DAG"


class GaveUp(BaseException):
    """Simulated time ran out: not an Exception, so no breaker or retry of the pump takes it for a failure."""


class SimulatedTime:
    """Seconds that pass only when the pump sleeps (its breakers' waits); `then(at, action)` runs `action` once
    that much time has passed."""

    def __init__(self, limit: float) -> None:
        self.now = 0.0
        self.limit = limit
        self.actions: list[tuple[float, object]] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        due = [a for a in self.actions if a[0] <= self.now]
        self.actions = [a for a in self.actions if a[0] > self.now]
        for _, action in due:
            action()
        if self.now > self.limit:
            raise GaveUp(f"nothing was delivered within {self.limit} s of simulated time")


def _said(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _no_statement_text(caplog) -> None:
    for record in caplog.records:
        line = record.getMessage() + (record.exc_text or "")
        assert "[SQL" not in line and "SELECT" not in line and "does not exist" not in line, line


@pytest.mark.parametrize("missing", ["store", "queues"])
def test_a_pump_before_provisioning_says_so_once_a_minute_trips_no_breaker_and_delivers_after(db, caplog, missing):
    url, schema, table = db
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    queues = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    simulated = SimulatedTime(limit=300)
    pump = Pump(store, queues, PumpConfig(), sleep=simulated.sleep)
    # The breakers on simulated time: 30 s of failures would trip them, and 95 s pass before provisioning ends.
    pump.fetch_breaker = CircuitBreaker("fetching due messages", 30, clock=simulated.monotonic, sleep=simulated.sleep)
    pump.dispatch_breaker = CircuitBreaker("dispatching", 30, clock=simulated.monotonic, sleep=simulated.sleep)
    if missing == "queues":
        store.create_schema()
        store.store(messages(5))

    def provision():
        store.create_schema()
        queues.provision("orders")
        queues.provision("error")
        if missing == "store":
            store.store(messages(5))

    simulated.actions.append((95, provision))
    caplog.set_level(logging.INFO, logger="airflow_delay_provider")
    result = pump.run(max_messages=5)
    assert result.stats.dispatched == 5, result
    assert sorted(m.message_id for m in drain(queues, "orders")) == [f"m-{i}" for i in range(5)]
    assert 95 <= simulated.now < 100, simulated.now
    said = _said(caplog, NO_STORE if missing == "store" else NO_QUEUES)
    assert len(said) == 2, said  # at 0 s and at 60 s of the 95
    assert f"table {table!r}" in said[0] if missing == "store" else f"{table}_queues" in said[0], said
    assert pump.fetch_breaker.armed_at is None and pump.dispatch_breaker.armed_at is None
    _no_statement_text(caplog)


@pytest.fixture
def pg_conn(pg, monkeypatch):
    """A `delay_store` connection (no auto_migrate: PostgreSQL's default) to a schema nobody provisioned yet."""
    url, schema, table = pg
    schema = f"{schema}_{uuid.uuid4().hex[:6]}"
    conn_id = f"early_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(store_connection(PG_URL, schema, table)))
    yield conn_id, SqlDelayedMessageStore(url, table=table, schema=schema), SqlTableTransport(url, schema=schema)
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    engine.dispose()


def _schema_exists(store: SqlDelayedMessageStore) -> bool:
    with store.engine.connect() as conn:
        return store.schema in inspect(conn).get_schema_names()


def test_a_deferred_dispatcher_before_provisioning_waits_creating_nothing_then_delivers(pg_conn, caplog):
    from airflow_delay_provider.triggers.delay_store import DispatchTrigger

    conn_id, store, queues = pg_conn
    trigger = DispatchTrigger(delay_store_conn_id=conn_id, deadline=(utcnow() + timedelta(seconds=60)).isoformat(),
                              max_messages=3)
    caplog.set_level(logging.INFO, logger="airflow_delay_provider")
    failed: list[BaseException] = []

    def provision_once_it_waits():
        try:
            wait_for(lambda: _said(caplog, NO_STORE), 30, "the dispatcher to say the store is not there")
            assert not _schema_exists(store)  # the dispatcher created nothing
            store.create_schema()
            queues.provision("orders")
            queues.provision("error")
            store.store(messages(3))
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread below
            failed.append(exc)

    helper = threading.Thread(target=provision_once_it_waits)
    helper.start()

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    helper.join()
    assert not failed, failed
    assert event["status"] == "done", event
    assert event["summary"]["dispatched"] == 3 and event["summary"]["stopped_because"] == "max_messages", event
    assert len(_said(caplog, NO_STORE)) == 1  # the wait took less than a minute
    assert f"connection {conn_id!r}" in _said(caplog, NO_STORE)[0]
    assert len(drain(queues, "orders")) == 3
    _no_statement_text(caplog)


def test_an_asset_event_producer_before_provisioning_waits_then_hands_the_message_over(pg_conn, caplog):
    from airflow_delay_provider.compat import shared_stream

    if shared_stream is None:
        pytest.skip("delayed DAG runs need Airflow 3.3's shared streams")
    from airflow_delay_provider.triggers.asset import DueMessageEventTrigger, DueMessageProducer

    conn_id, store, _ = pg_conn
    destination = "airflow.asset.early.runs"
    producer = DueMessageProducer(DueMessageEventTrigger(destination=destination, delay_store_conn_id=conn_id,
                                                         min_event_interval=0, poll_interval=0.2, lease_seconds=5))
    waits: list[float] = []  # the waits of its breaker: each a look at the store that found no tables

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        time.sleep(seconds)

    producer.breaker = CircuitBreaker(producer.breaker.name, 30, sleep=sleep)
    caplog.set_level(logging.INFO, logger="airflow_delay_provider")

    async def scenario():
        stream = producer.open_stream().__aiter__()
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.to_thread(wait_for, lambda: len(waits) >= 3, 30, "the producer to look three times")
        assert len(_said(caplog, NO_STORE)) == 1 and producer.breaker.armed_at is None
        assert not await asyncio.to_thread(_schema_exists, store)
        await asyncio.to_thread(store.create_schema)
        await asyncio.to_thread(store.store, [DelayedMessage(destination, b"{}", utcnow(), {}, "early-1")])
        payload, _ = await asyncio.wait_for(first, 30)
        await producer.aclose()
        return payload

    assert asyncio.run(scenario())["message_id"] == "early-1"
    assert len(_said(caplog, NO_STORE)) == 1
    _no_statement_text(caplog)
