"""DispatchTrigger on the real PostgreSQL: woken at due times, two copies share the store, a killed
LISTEN connection is reopened (for the trigger and for a pump in a worker)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.pump import Pump
from airflow_delay_provider.triggers.delay_store import DispatchTrigger
from tests.conftest import PG_URL
from tests.helpers import collect, make_store, make_transport, messages, store_connection


@pytest.fixture
def store_conn(pg, monkeypatch):
    """A `delay_store` connection to this test's table on PostgreSQL, its store and the SQL-table transport."""
    url, schema, table = pg
    conn_id = f"store_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(store_connection(PG_URL, schema, table)))
    store = make_store(url, schema, table)
    # The transport's default table prefix, shared by the run's tests: a queue name of this test's own.
    name = f"q{uuid.uuid4().hex[:8]}"
    queue = make_transport(url, schema, "delay", name, "error")
    return conn_id, store, queue, name


def _kill_listeners(store) -> int:
    """pg_terminate_backend on this store's LISTEN connections (a restart or an idle-connection killer)."""
    from sqlalchemy import text

    with store.engine.begin() as conn:
        return conn.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE query = :q"),
                            {"q": f'LISTEN "{store.channel}"'}).scalar()


def _trigger(conn_id: str, seconds: float, **kwargs) -> DispatchTrigger:
    return DispatchTrigger(delay_store_conn_id=conn_id, deadline=(utcnow() + timedelta(seconds=seconds)).isoformat(),
                           **kwargs)


async def _events(*triggers: DispatchTrigger) -> list[dict]:
    async def first(trigger):
        async for event in trigger.run():
            return event.payload

    return await asyncio.gather(*(first(t) for t in triggers))


def _run_while(trigger: DispatchTrigger, meanwhile) -> dict:
    """Run the trigger to its event while `meanwhile()` runs in a thread (after the trigger settled in)."""
    def act():
        time.sleep(1.5)
        meanwhile()

    helper = threading.Thread(target=act)
    helper.start()
    [event] = asyncio.run(_events(trigger))
    helper.join()
    return event


def test_a_sooner_message_stored_while_the_trigger_sleeps_wakes_it(store_conn):
    conn_id, store, queue, Q = store_conn
    store.store(messages(1, Q, delay=3600, start=100))  # the trigger would sleep an hour for this one
    event = _run_while(_trigger(conn_id, 8, poll_interval=60), lambda: store.store(messages(1, Q, delay=1.0)))
    assert event["status"] == "done" and event["summary"]["dispatched"] == 1
    got = collect(queue, Q, 1, timeout=2)
    [(_, message)] = got
    assert message.message_id == "m-0"
    lateness = (message.enqueued_at - message.due_at).total_seconds()
    assert 0 <= lateness < 2.0  # woken by NOTIFY: not after the 60 s poll interval, never early


def test_two_copies_of_a_trigger_share_the_store_and_deliver_each_message_once(store_conn):
    conn_id, store, queue, Q = store_conn
    n = 3000
    for start in range(0, n, 1000):  # due over the next two seconds, and some already due
        store.store(messages(1000, Q, delay=start / 1000 - 0.5, start=start))
    window = (utcnow() + timedelta(seconds=5)).isoformat()
    events = asyncio.run(_events(*(_trigger(conn_id, 60, due_before=window, pump_config={"batch_size": 100})
                                   for _ in range(2))))
    assert [e["status"] for e in events] == ["done", "done"]
    assert sum(e["summary"]["dispatched"] for e in events) == n
    assert all(e["summary"]["dispatched"] > 0 for e in events)  # both took a share
    got = collect(queue, Q, n, timeout=10)
    ids = [m.message_id for _, m in got]
    assert len(ids) == len(set(ids)) == n  # exactly once: a SQL-table queue in the store's database
    assert all(m.enqueued_at >= m.due_at for _, m in got)  # none early
    assert store.count_scheduled() == {}


def test_the_trigger_keeps_dispatching_after_its_listen_connection_is_killed(store_conn):
    conn_id, store, queue, Q = store_conn
    killed = []

    def kill_listener_then_send():
        killed.append(_kill_listeners(store))
        time.sleep(0.5)
        store.store(messages(1, Q, delay=1.0))

    event = _run_while(_trigger(conn_id, 10, poll_interval=60), kill_listener_then_send)
    assert killed[0] >= 1
    assert event["status"] == "done" and event["summary"]["dispatched"] == 1
    [(_, message)] = collect(queue, Q, 1, timeout=2)
    assert (message.enqueued_at - message.due_at).total_seconds() < 3.0  # not after the 60 s poll


def test_a_pump_in_a_worker_survives_its_listen_connection_being_killed(store_conn):
    _, store, queue, Q = store_conn
    pump = Pump(store, queue)
    result = {}

    def run():
        result["r"] = pump.run(deadline=utcnow() + timedelta(seconds=8))

    runner = threading.Thread(target=run)
    runner.start()
    time.sleep(1.5)  # idle, listening
    assert _kill_listeners(store) >= 1
    time.sleep(0.5)
    store.store(messages(2, Q, delay=1.0))
    runner.join()
    assert result["r"].reason == "deadline" and result["r"].stats.dispatched == 2
    assert len(collect(queue, Q, 2, timeout=2)) == 2
