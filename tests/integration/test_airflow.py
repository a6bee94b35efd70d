"""The Airflow layer: provider registration, the demo DAG, deferral, the sensor, connections, bad input."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.conftest import PG_URL, ROOT
from tests.helpers import FakeTI

START = datetime(2026, 1, 1)


def _pg_conn(monkeypatch, schema: str, table: str, password: str | None = None) -> str:
    conn_id = f"delay_pg_{uuid.uuid4().hex[:8]}"
    url = PG_URL.replace("postgresql+psycopg://", "")
    login, hostport_db = url.split("@")
    hostport, database = hostport_db.split("/")
    host, port = hostport.split(":")
    conn = {"conn_type": "delay_store", "host": host, "port": int(port), "login": login, "schema": database,
            "extra": {"db_schema": schema, "table": table}}
    if password:
        conn["password"] = password
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    return conn_id


def test_provider_info_matches_airflow_schema_and_is_registered(airflow_home):
    import airflow
    import jsonschema

    from airflow_delay_provider.get_provider_info import get_provider_info

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    jsonschema.validate(info, schema)
    for group in ("hooks", "operators", "sensors", "triggers"):
        for module in info[group][0]["python-modules"]:
            assert importlib.util.find_spec(module), module
    for conn_type in info["connection-types"]:
        module, _, name = conn_type["hook-class-name"].rpartition(".")
        assert getattr(importlib.import_module(module), name).conn_type == conn_type["connection-type"]
    listing = subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), "providers", "list", "-o", "json"],
        capture_output=True, text=True, check=True, env=os.environ.copy(),
    )
    names = {p["package_name"] for p in json.loads(listing.stdout)}
    assert "airflow-delay-provider" in names
    hooks = subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), "providers", "hooks", "-o", "json"],
        capture_output=True, text=True, check=True, env=os.environ.copy(),
    )
    declared = {h.get("connection_type") for h in json.loads(hooks.stdout)}
    assert {"delay_store", "rabbitmq"} <= declared


def test_demo_dag_delivers_every_message_exactly_once(run_dag):
    spec = importlib.util.spec_from_file_location("demo_delayed_delivery", ROOT / "dags" / "demo_delayed_delivery.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.dag.doc_md
    state, states, values = run_dag(module.dag, {"count": 60, "max_delay": 3})
    assert state == "success", states
    report = values["verify"]
    assert report["sent"] == report["delivered"] == 60
    assert report["duplicates"] == report["missing"] == report["early"] == 0
    assert values["dispatch"]["dispatched"] == 60 and values["dispatch"]["exactly_once"] is True


def test_dispatch_runs_in_the_trigger_and_delivers_at_due_times_on_postgres(run_dag, pg, monkeypatch):
    from airflow.sdk import DAG

    from airflow_delay_provider.operators.delay import (
        DispatchDueMessagesOperator,
        ProvisionDelayInfrastructureOperator,
        SendDelayedMessageOperator,
    )
    from tests.helpers import drain

    url, schema, table = pg
    conn_id = _pg_conn(monkeypatch, schema, table)
    common = {"delay_store_conn_id": conn_id}
    with DAG("t_defer", schedule=None, start_date=START) as dag:
        provision = ProvisionDelayInfrastructureOperator(task_id="provision", endpoints=["q", "other"], **common)
        send = SendDelayedMessageOperator(
            task_id="send", destination="q",
            messages=[{"body": "a", "delay_seconds": 2}, {"body": "b", "delay_seconds": timedelta(seconds=4.2)},
                      {"body": "c", "destination": "other", "delay_seconds": 1}],
            **common,
        )
        dispatch = DispatchDueMessagesOperator(
            task_id="dispatch", destinations=["q"],
            due_before="{{ macros.datetime.now(macros.dateutil.tz.UTC) + macros.timedelta(seconds=30) }}",
            deferrable=True, **common,
        )
        provision >> send >> dispatch
    state, states, values = run_dag(dag)
    assert state == "success", states
    result = values["dispatch"]
    assert result["dispatched"] == 2 and result["stopped_because"] == "drained"
    assert result["dispatched_in"] == "triggerer" and result["destinations"] == {"q": {"dispatched": 2}}
    assert result["lateness_max_seconds"] >= 0
    assert len(values["send"]) == 3
    from airflow_delay_provider.transports.sql import SqlTableTransport

    queue = SqlTableTransport(url, schema=schema)
    got = {m.body: m for m in drain(queue, "q")}
    assert sorted(got) == [b"a", b"b"]
    a, b = got[b"a"], got[b"b"]
    assert a.enqueued_at >= a.due_at and b.enqueued_at >= b.due_at  # none early
    if a.enqueued_at < b.due_at:
        # The trigger was dispatching before "b" was due: it sends "b" at its due time, not after a task resume.
        # (On a machine so busy that the dispatcher started after both were due, only the order is checked.)
        assert (b.enqueued_at - b.due_at).total_seconds() < 1.0, (a, b)
    assert drain(queue, "other") == []  # not in this dispatcher's destinations: still stored


def test_scheduled_window_dispatches_only_its_interval(pg, monkeypatch):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.delay import DispatchDueMessagesOperator
    from tests.helpers import make_transport, messages

    url, schema, table = pg
    conn_id = _pg_conn(monkeypatch, schema, table)
    store = DelayStoreHook(conn_id).get_store()
    store.create_schema()
    make_transport(url, schema, "delay", "orders", "error")
    store.store(messages(5, delay=-60) + messages(3, delay=-10, start=5))
    window_end = (datetime.now().astimezone() - timedelta(seconds=30)).isoformat()
    op = DispatchDueMessagesOperator(task_id="window", delay_store_conn_id=conn_id, due_before=window_end)
    op.render_template_fields({})
    result = op.execute({})
    assert result["dispatched"] == 5 and result["stopped_because"] == "drained"
    assert store.count_scheduled() == {"orders": 3}


def test_sensor_poke_and_deferrable(run_dag, pg, monkeypatch):
    from airflow.sdk import DAG

    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.delay import DispatchDueMessagesOperator, SendDelayedMessageOperator
    from airflow_delay_provider.sensors.delay_store import DelayedMessagesSensor
    from tests.helpers import make_transport, messages

    url, schema, table = pg
    conn_id = _pg_conn(monkeypatch, schema, table)
    DelayStoreHook(conn_id).get_store().create_schema()
    make_transport(url, schema, "delay", "q", "error")
    common = {"delay_store_conn_id": conn_id}
    with DAG("t_sensor", schedule=None, start_date=START) as dag:
        send = SendDelayedMessageOperator(task_id="send", destination="q", delay_seconds=2, **common)
        poke = DelayedMessagesSensor(task_id="poke", destination="q", poke_interval=0.5, timeout=30, **common)
        deferred = DelayedMessagesSensor(task_id="deferred", destination="q", deferrable=True, poke_interval=0.5,
                                         timeout=30, **common)
        dispatch = DispatchDueMessagesOperator(task_id="dispatch", max_runtime=20, max_messages=1, **common)
        # the sensors can only succeed once dispatch has emptied the store
        send >> dispatch >> [poke, deferred]
    state, states, values = run_dag(dag)
    assert state == "success", states
    assert values["dispatch"]["dispatched"] == 1
    sensor = DelayedMessagesSensor(task_id="s", destination="q", **common)
    assert sensor.poke({}) is True
    DelayStoreHook(conn_id).get_store().store(messages(1, "q", delay=100))
    assert sensor.poke({}) is False
    assert DelayedMessagesSensor(task_id="s2", destination="other", **common).poke({}) is True
    soon = (datetime.now().astimezone() + timedelta(seconds=50)).isoformat()
    assert DelayedMessagesSensor(task_id="s3", destination="q", before=soon, **common).poke({}) is True


def test_bad_batch_stores_nothing_and_says_why(run_dag, pg, monkeypatch):
    from airflow.sdk import DAG

    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.delay import SendDelayedMessageOperator

    _, schema, table = pg
    conn_id = _pg_conn(monkeypatch, schema, table)
    store = DelayStoreHook(conn_id).get_store()
    store.create_schema()
    ok = {"destination": "q", "body": "fine", "delay_seconds": 5}
    batch = [ok, ok | {"message_id": "x2"}, {"destination": "q", "delay_seconds": 700_000}]  # past the 7 days
    # From the run's conf, the batch is known (and checked) only when the task runs.
    with DAG("t_bad", schedule=None, start_date=START, params={"batch": batch}) as dag:
        SendDelayedMessageOperator(task_id="send", delay_store_conn_id=conn_id, messages="{{ params.batch | tojson }}")
    state, states, _ = run_dag(dag)
    assert state == "failed" and states["send"] == "failed"
    assert store.count_scheduled() == {}
    # Written in the DAG file, a batch past the ten years any connection may allow fails its import, as does a
    # header that is not text (the connection's own 7 days are read when the task runs).
    with pytest.raises(ValueError, match=r"messages\[2\]\.delay_seconds must be in 0\.\.315576000 seconds"):
        SendDelayedMessageOperator(task_id="x", delay_store_conn_id=conn_id,
                                   messages=[*batch[:2], {"destination": "q", "delay_seconds": 10**9}])
    with pytest.raises(ValueError, match="header 'n' must have a str value"):
        SendDelayedMessageOperator(task_id="x", delay_store_conn_id=conn_id, destination="q", headers={"n": 5})
    assert store.count_scheduled() == {}


def test_a_templated_on_duplicate_replaces_a_scheduled_message_by_id(run_dag, pg, monkeypatch):
    """The manual-send form's two fields: a message id and what a send of it does while it is scheduled."""
    from airflow.sdk import DAG

    from airflow_delay_provider.core.delays import utcnow
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.delay import SendDelayedMessageOperator

    _, schema, table = pg
    conn_id = _pg_conn(monkeypatch, schema, table)
    store = DelayStoreHook(conn_id).get_store()
    store.create_schema()
    for n, (mode, delay) in enumerate([("skip", 600), ("keep_earliest", 900), ("replace", 1200)]):
        with DAG(f"t_dup_{n}", schedule=None, start_date=START,
                 params={"on_duplicate": mode, "body": f"change {n}", "delay": delay}) as dag:
            SendDelayedMessageOperator(task_id="send", delay_store_conn_id=conn_id, destination="q",
                                       message_id="order-42-reminder", body="{{ params.body }}",
                                       delay_seconds="{{ params.delay }}", on_duplicate="{{ params.on_duplicate }}")
        sent_at = utcnow()
        state, _, _ = run_dag(dag)
        assert state == "success"
        stored = store.get("order-42-reminder")
        if n < 2:  # kept: the first send's body and time
            assert stored.body == b"change 0"
        else:
            assert stored.body == b"change 2" and 1199 <= (stored.due_at - sent_at).total_seconds() <= 1260
    assert store.count_scheduled() == {"q": 1}


def test_unknown_transport_and_bad_table_fail_at_parse_time():
    from airflow_delay_provider.core.errors import InvalidInputError, InvalidNameError
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.delay import DispatchDueMessagesOperator, SendDelayedMessageOperator

    with pytest.raises(InvalidInputError,
                       match=r"transport 'kafka' is not supported; choose one of \['sql', 'rabbitmq', 'sqs'\]"):
        SendDelayedMessageOperator(task_id="a", destination="q", transport="kafka")
    with pytest.raises(InvalidInputError, match="batch_size must be an int in 1..10000"):
        DispatchDueMessagesOperator(task_id="b", batch_size=0)
    with pytest.raises(InvalidNameError):
        DelayStoreHook(table="x; drop table y").get_store()


def test_hook_connection_never_shows_password(pg, monkeypatch):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    _, schema, table = pg
    good = DelayStoreHook(_pg_conn(monkeypatch, schema, table, password="pw-unused-by-trust"))
    ok, message = good.test_connection()
    assert ok, message
    assert "pw-unused-by-trust" not in message and "pw-unused-by-trust" not in repr(good.get_store())
    monkeypatch.setenv("AIRFLOW_CONN_DELAY_BROKEN", json.dumps(
        {"conn_type": "delay_store", "host": "127.0.0.1", "port": 1, "login": "u", "password": "TopSecret9",
         "schema": "x"}))
    ok, message = DelayStoreHook("delay_broken").test_connection()
    assert not ok and "not reachable" in message and "TopSecret9" not in message


def test_a_missing_store_connection_says_how_to_define_it(monkeypatch):
    from airflow_delay_provider.core.errors import InvalidInputError
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.delay import DispatchDueMessagesOperator

    monkeypatch.delenv("AIRFLOW_CONN_DELAY_STORE_DEFAULT")
    with pytest.raises(InvalidInputError,
                       match="'delay_store_default' is not defined.*AIRFLOW_CONN_DELAY_STORE_DEFAULT"):
        DelayStoreHook().get_store()
    with pytest.raises(InvalidInputError, match="'delay_store_default' is not defined"):
        DispatchDueMessagesOperator(task_id="d", max_runtime=1).execute({})
    monkeypatch.setenv("AIRFLOW_CONN_RELATIVE", json.dumps(
        {"conn_type": "delay_store", "schema": "store.db", "extra": {"driver": "sqlite"}}))
    with pytest.raises(InvalidInputError, match="needs an absolute file path"):
        DelayStoreHook("relative").get_store()


def test_triggers_serialize_to_their_class_path_and_fire(monkeypatch):
    import asyncio

    from airflow.sdk.module_loading import import_string

    from airflow_delay_provider.triggers.delay_store import DispatchTrigger, ScheduledMessagesTrigger

    future = (datetime.now().astimezone() + timedelta(seconds=30)).isoformat()
    monkeypatch.setenv("AIRFLOW_CONN_DELAY_DOWN", json.dumps(
        {"conn_type": "delay_store", "host": "127.0.0.1", "port": 1, "login": "u", "password": "Hush42",
         "schema": "x"}))
    trigger = DispatchTrigger(delay_store_conn_id="delay_down", deadline=future, destinations=["q"],
                              pump_config={"batch_size": 5},
                              delivery_policy={"healthyRetryPolicy": {"numRetries": 1}})
    path, kwargs = trigger.serialize()
    assert path == "airflow_delay_provider.triggers.delay_store.DispatchTrigger"
    rebuilt = import_string(path)(**kwargs)
    assert rebuilt.serialize() == (path, kwargs)
    assert json.loads(json.dumps(kwargs)) == kwargs  # plain JSON: what the metadata database keeps
    assert ScheduledMessagesTrigger().serialize()[0].endswith("delay_store.ScheduledMessagesTrigger")

    async def first_event(t):
        async for event in t.run():
            return event.payload

    # The store is down: the trigger reports it (execute_complete then fails the task with it).
    event = asyncio.run(first_event(rebuilt))
    assert event["status"] == "error" and "not reachable" in event["message"] and "Hush42" not in event["message"]
    assert event["summary"]["dispatched"] == 0


def _rabbit_conn(monkeypatch, vhost: str, prefix: str) -> str:
    conn_id = f"rabbit_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({
        "conn_type": "rabbitmq", "host": "127.0.0.1", "port": 5672, "login": "guest", "password": "guest",
        "schema": vhost, "extra": {"prefix": prefix, "heartbeat": "30"}}))
    return conn_id


def test_rabbitmq_operators_provision_verify_send_dispatch_migrate(run_dag, rabbit_vhost, monkeypatch, tmp_path):
    from airflow.sdk import DAG

    from airflow_delay_provider.core.errors import DelayProviderError
    from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook
    from airflow_delay_provider.operators.delay import (
        DispatchDueMessagesOperator,
        MigrateDelayedMessagesOperator,
        ProvisionDelayInfrastructureOperator,
        SendDelayedMessageOperator,
    )
    from tests.integration.test_rabbitmq import collect

    conn_id = _rabbit_conn(monkeypatch, rabbit_vhost, "dly")
    monkeypatch.setenv("AIRFLOW_CONN_STORE_X", json.dumps(
        {"conn_type": "delay_store", "schema": str(tmp_path / "store.db"), "extra": {"driver": "sqlite"}}))
    rabbit = {"transport": "rabbitmq", "transport_conn_id": conn_id, "delay_store_conn_id": "store_x"}
    hook = RabbitMQDelayHook(conn_id)
    ok, message = hook.test_connection()
    assert ok and "incomplete" in message and "guest" not in message
    with pytest.raises(DelayProviderError, match="incomplete"):
        ProvisionDelayInfrastructureOperator(task_id="v0", endpoints=["orders"], verify=True, **rabbit).execute({})
    with DAG("t_rabbit", schedule=None, start_date=START) as dag:
        provision = ProvisionDelayInfrastructureOperator(task_id="provision", endpoints=["orders"], **rabbit)
        verify = ProvisionDelayInfrastructureOperator(task_id="verify", endpoints=["orders"], verify=True, **rabbit)
        native = SendDelayedMessageOperator(task_id="native", destination="orders", body="n", delay_seconds=1, **rabbit)
        stored = SendDelayedMessageOperator(task_id="stored", destination="orders", body="s", delay_seconds=1,
                                            delay_store_conn_id="store_x")
        dispatch = DispatchDueMessagesOperator(
            task_id="dispatch",
            due_before="{{ macros.datetime.now(macros.dateutil.tz.UTC) + macros.timedelta(seconds=30) }}",
            deferrable=True, **rabbit)
        later = SendDelayedMessageOperator(task_id="later", destination="orders", body="l", delay_seconds=2,
                                           delay_store_conn_id="store_x")
        migrate = MigrateDelayedMessagesOperator(task_id="migrate", direction="store_to_rabbitmq", **rabbit)
        provision >> verify >> [native, stored] >> dispatch >> later >> migrate
    state, states, values = run_dag(dag)
    assert state == "success", states
    assert values["verify"]["complete"] is True
    assert values["dispatch"]["dispatched"] == 1 and values["dispatch"]["exactly_once"] is False
    assert values["migrate"]["moved"] == 1
    transport = hook.get_transport()
    got = collect(transport, "orders", 3, timeout=10)
    assert sorted(m.body for _, m in got) == [b"l", b"n", b"s"]
    assert {m.message_id for _, m in got} == {values["native"], values["stored"], values["later"]}
    transport.close()
    bad = SendDelayedMessageOperator(task_id="bad", destination="nowhere", delay_seconds=5, **rabbit)
    with pytest.raises(Exception, match="nowhere"):
        bad.execute({"ti": FakeTI(task_id="bad")})


def test_rendered_arguments_are_checked_and_errors_name_them(airflow_home):
    from airflow_delay_provider.core.errors import InvalidInputError
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.delay import DispatchDueMessagesOperator, SendDelayedMessageOperator

    ti = {"ti": FakeTI(run_id=f"r{uuid.uuid4().hex[:6]}", task_id="x")}
    # A list of dicts rendered by Jinja is a Python literal, not JSON: accepted (never evaluated as code).
    op = SendDelayedMessageOperator(task_id="x",
                                    messages="[{'destination': 'lit.q', 'body': 'b', 'delay_seconds': 604800}]")
    [message_id] = op.execute(ti)
    stored = DelayStoreHook().get_store().get(message_id)
    assert stored.destination == "lit.q"
    # The window of a dispatcher of what the task sent: just past its last due time (due_before is exclusive).
    assert ti["ti"].pushed["due_before"] == (stored.due_at + timedelta(microseconds=1)).isoformat()
    with pytest.raises(InvalidInputError, match="messages must render to a JSON list"):
        SendDelayedMessageOperator(task_id="x", messages="__import__('os').getcwd()").execute(ti)
    with pytest.raises(InvalidInputError, match=r"max_messages must be a whole number >= 1, got 'abc'"):
        DispatchDueMessagesOperator(task_id="d", max_messages="abc").execute({})
    with pytest.raises(InvalidInputError, match="due_from .* must be before due_before"):
        DispatchDueMessagesOperator(task_id="d", due_from="2026-01-01T10:00:00+00:00",
                                    due_before="2026-01-01T10:00:00+00:00").execute({})


def test_a_retried_native_send_sends_nothing_twice(rabbit_vhost, monkeypatch):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook
    from airflow_delay_provider.operators.delay import (
        MigrateDelayedMessagesOperator,
        ProvisionDelayInfrastructureOperator,
        SendDelayedMessageOperator,
    )
    from tests.integration.test_rabbitmq import collect

    conn_id = _rabbit_conn(monkeypatch, rabbit_vhost, "dd")
    rabbit = {"transport": "rabbitmq", "transport_conn_id": conn_id}
    ProvisionDelayInfrastructureOperator(task_id="p", endpoints=["orders"], create_store=False, **rabbit).execute({})
    ti = {"ti": FakeTI(run_id=f"r{uuid.uuid4().hex[:6]}", task_id="n")}
    op = SendDelayedMessageOperator(task_id="n", destination="orders", messages=[{"body": "a"}, {"body": "b"}],
                                    **rabbit)
    first = op.execute(ti)
    assert op.execute(ti) == first  # the task retried after its messages were sent: the same ids, nothing sent
    transport = RabbitMQDelayHook(conn_id).get_transport()
    got = collect(transport, "orders", 2, timeout=5)
    transport.close()
    assert sorted(m.body for _, m in got) == [b"a", b"b"]  # once each
    # Messages sent natively and then migrated into the store are not taken for duplicates.
    later = SendDelayedMessageOperator(task_id="later", destination="orders", body="l", delay_seconds=120, **rabbit)
    message_id = later.execute({"ti": FakeTI(run_id=ti["ti"].run_id, task_id="later")})
    moved = MigrateDelayedMessagesOperator(task_id="m", direction="rabbitmq_to_store", **rabbit).execute({})
    assert moved["moved"] == 1 and DelayStoreHook().get_store().get(message_id).body == b"l"


def test_in_a_triggerer_the_final_event_waits_out_airflows_stale_executor_event_race(monkeypatch):
    import asyncio
    import time

    from airflow_delay_provider.triggers import base
    from airflow_delay_provider.triggers.delay_store import DispatchTrigger

    monkeypatch.setattr(base, "MIN_SECONDS_BEFORE_EVENT", 1.5)
    monkeypatch.setenv("AIRFLOW_CONN_DELAY_DOWN", json.dumps(
        {"conn_type": "delay_store", "host": "127.0.0.1", "port": 1, "login": "u", "schema": "x"}))

    def seconds_to_event(trigger_id):
        trigger = DispatchTrigger(delay_store_conn_id="delay_down", deadline=datetime.now().astimezone().isoformat())
        trigger.trigger_id = trigger_id  # set by a real triggerer; None when run in line by dag.test()

        async def first():
            async for event in trigger.run():
                return event.payload

        started = time.monotonic()
        assert asyncio.run(first())["status"] == "error"  # the store is down: an immediate outcome
        return time.monotonic() - started

    assert seconds_to_event(7) >= 1.5
    # Not held in line: with a hold of a minute, no machine is slow enough to take that long otherwise (the
    # unheld outcome took 0.1-1.4 s, and a bound of 1 s failed on a busy machine).
    monkeypatch.setattr(base, "MIN_SECONDS_BEFORE_EVENT", 60.0)
    assert seconds_to_event(None) < 60.0
