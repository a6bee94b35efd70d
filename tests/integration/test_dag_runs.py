"""Delayed DAG runs on the real PostgreSQL and under `dag.test()`: the event trigger woken by NOTIFY at the due
time, two producers (a triggerer fail-over) handing each message over once, a producer SIGKILLed with events
pending losing nothing, and the example scheduler DAG scheduling, cancelling and refusing bad targets."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.triggers.asset import DueMessageEventTrigger
from tests.conftest import PG_URL, ROOT
from tests.helpers import make_store, store_connection

DEST = "airflow.asset.it.runs"


@pytest.fixture
def store_conn(pg, monkeypatch):
    """A `delay_store` connection to this test's table on PostgreSQL, and its store."""
    url, schema, table = pg
    conn_id = f"store_{uuid.uuid4().hex[:8]}"
    value = json.dumps(store_connection(PG_URL, schema, table))
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", value)
    return conn_id, make_store(url, schema, table), (f"AIRFLOW_CONN_{conn_id.upper()}", value)


def _messages(n: int, due_in: float, prefix: str = "m") -> list[DelayedMessage]:
    due = utcnow() + timedelta(seconds=due_in)
    return [DelayedMessage(DEST, json.dumps({"n": i}).encode(), due, {}, f"{prefix}-{i}") for i in range(n)]


async def _consume(trigger: DueMessageEventTrigger, n: int, timeout: float, trigger_id: int = 1,
                   confirm: bool = True) -> list[tuple[float, dict]]:
    """What a triggerer does with the trigger: take its events, bind them, and confirm each persisted."""
    manager = SharedStreamManager(ack_timeout=60)
    key = trigger.shared_stream_key()
    stream = trigger.filter_shared_stream(manager.subscribe(trigger_id=trigger_id, trigger=trigger, key=key))
    got = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n:
            try:
                event = await asyncio.wait_for(anext(stream), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
            seq = manager.bind_pending_event(trigger_id=trigger_id, key=key)
            got.append((time.time(), event.payload))
            if confirm:
                manager.confirm_persisted([seq])
        await asyncio.sleep(1.0)  # the last confirmation resolves once the filter is past its event
        if got:
            task = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.5)
            task.cancel()
    finally:
        await manager.unsubscribe(trigger_id, key)
    return got


def test_a_sooner_message_stored_while_the_trigger_sleeps_wakes_it_at_its_due_time(store_conn):
    conn_id, store, _ = store_conn
    store.store(_messages(1, 3600, "later"))  # would sleep an hour (and poll_interval is a minute)
    trigger = DueMessageEventTrigger(destination=DEST, delay_store_conn_id=conn_id, poll_interval=60)

    async def scenario():
        consumer = asyncio.ensure_future(_consume(trigger, 1, timeout=15))
        await asyncio.sleep(2.0)  # the producer is asleep on LISTEN
        store.store(_messages(1, 1.5))
        return await consumer

    [(fired, payload)] = asyncio.run(scenario())
    lateness = fired - _ts(payload["due_at"])
    assert payload["message_id"] == "m-0" and payload["body"] == {"n": 0}
    assert 0 <= lateness < 0.5, lateness  # woken by NOTIFY at the due time: not early, not a poll later
    assert store.get("m-0") is None and store.get("later-0") is not None


def test_two_producers_hand_each_message_over_once(store_conn):
    conn_id, store, _ = store_conn
    n = 60
    store.store(_messages(n, -0.5))

    async def scenario():
        triggers = [DueMessageEventTrigger(destination=DEST, delay_store_conn_id=conn_id, min_event_interval=0,
                                           batch_size=5) for _ in range(2)]
        return await asyncio.gather(*(_consume(t, n, timeout=8, trigger_id=i) for i, t in enumerate(triggers)))

    a, b = asyncio.run(scenario())
    ids = [p["message_id"] for _, p in a + b]
    assert len(ids) == len(set(ids)) == n
    assert a and b  # both took a share
    assert store.count_scheduled() == {}


_CRASHING_PRODUCER = r"""
import asyncio, json, sys
from airflow.triggers.shared_stream import SharedStreamManager
from airflow_delay_provider.triggers.asset import DueMessageEventTrigger

async def main():
    trigger = DueMessageEventTrigger(destination=sys.argv[1], delay_store_conn_id=sys.argv[2], lease_seconds=6,
                                     min_event_interval=0)
    manager = SharedStreamManager(ack_timeout=600)
    key = trigger.shared_stream_key()
    stream = trigger.filter_shared_stream(manager.subscribe(trigger_id=1, trigger=trigger, key=key))
    async for event in stream:  # handed over, never confirmed persisted (the triggerer dies first)
        manager.bind_pending_event(trigger_id=1, key=key)
        print("HANDED", json.dumps(event.payload["message_id"]), flush=True)

asyncio.run(main())
"""


def test_a_producer_killed_with_events_pending_loses_nothing(store_conn):
    conn_id, store, (env_name, env_value) = store_conn
    store.store(_messages(5, -0.1))
    proc = subprocess.Popen([sys.executable, "-c", _CRASHING_PRODUCER, DEST, conn_id], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, env_name: env_value}, cwd=ROOT)
    try:
        handed = []
        for line in proc.stdout:  # the producer's own log lines go to stdout too
            if line.startswith("HANDED "):
                handed.append(json.loads(line.split(" ", 1)[1]))
                if len(handed) == 5:
                    break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert sorted(handed) == [f"m-{i}" for i in range(5)]
    assert store.backlog()["destinations"][DEST]["in_flight"] == 5  # leased to the dead producer
    started = time.monotonic()
    trigger = DueMessageEventTrigger(destination=DEST, delay_store_conn_id=conn_id, min_event_interval=0)
    got = asyncio.run(_consume(trigger, 5, timeout=30))
    assert sorted(p["message_id"] for _, p in got) == sorted(handed)  # handed over again, once the lease ran out
    assert time.monotonic() - started < 12  # the dead producer's lease was 6 s
    assert store.count_scheduled() == {}


# -- the example scheduler DAG under dag.test() -------------------------------------------------------------------
def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dags" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


def _register(*dags) -> None:
    """Make DAGs known to the metadata database, as the dag-processor does (assets included)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(collect_dags=False)
    for dag in dags:
        bag.bag_dag(dag)
    sync_bag_to_db(bag, "dags-folder", None)


def test_the_example_schedules_a_target_run_and_cancels_it_when_paid(run_dag):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    _register(_load("delay_dag_run_target"))
    scheduler = _load("delay_dag_run_scheduler")
    store = DelayStoreHook().get_store()
    state, states, values = run_dag(scheduler, {"order_id": "o-7", "delay_seconds": 600, "paid": False})
    assert state == "success", states
    message = store.get(values["schedule_timeout"])
    assert message.destination == "airflow.asset.delayed_dag_run.delay_dag_run_target"
    assert json.loads(message.body) == {"order_id": "o-7"}
    assert 590 < (message.due_at - utcnow()).total_seconds() <= 600
    state, states, values = run_dag(scheduler, {"order_id": "o-8", "delay_seconds": 600, "paid": True})
    assert state == "success", states
    assert values["cancel_timeout"]["cancelled"] == [values["schedule_timeout"]]
    assert store.get(values["schedule_timeout"]) is None


def test_an_unknown_target_fails_the_task_and_stores_nothing(run_dag):
    from airflow.sdk import DAG

    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.schedule import ScheduleDagRunOperator

    store = DelayStoreHook().get_store()
    store.create_schema()
    before = store.count_scheduled()
    with DAG(f"schedule_unknown_{uuid.uuid4().hex[:6]}", schedule=None) as dag:
        ScheduleDagRunOperator(task_id="schedule", dag_id="no_such_dag", conf={"a": 1}, delay_seconds=5)
    state, states, _ = run_dag(dag)
    assert state == "failed" and states == {"schedule": "failed"}
    assert store.count_scheduled() == before


def _ts(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()
