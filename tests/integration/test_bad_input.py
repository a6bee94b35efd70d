"""Bad input through every public entry point: a clear error naming the field and what is allowed, no
credential in it, and nothing stored or sent.

Only the gaps: operators' run-time and parse-time arguments, connection extras of each hook, the store's
own methods and malformed policies that no other test covers (see test_airflow, test_store, test_retry,
test_sqs, test_rabbitmq*, test_spark and tests/unit for the rest). A SQLite store of each test's own,
the real RabbitMQ and moto's SQS; nothing is mocked.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import select

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import (
    DelayError,
    DelayProviderError,
    InvalidInputError,
    InvalidMessageError,
    InvalidNameError,
)
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.retry_policy import DeliveryPolicy, PolicyError
from tests.helpers import FakeTI

SECRET = "Pw-7c1e-NEVER-SHOWN"
TI = {"ti": FakeTI()}


def _conn(monkeypatch, conn: dict) -> str:
    conn_id = f"bad_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    return conn_id


def _raises(call, error: type[Exception], pattern: str, *secrets: str) -> Exception:
    """The error of `call`: its type, a message matching `pattern` (the field and what is allowed) and
    no secret anywhere in it or in the exceptions it chains."""
    with pytest.raises(Exception) as info:
        call()
    err = info.value
    assert isinstance(err, error), f"{type(err).__name__}: {err}"
    assert re.search(pattern, str(err)), str(err)
    chained = err
    while chained is not None:
        for secret in (SECRET, *secrets):
            assert secret not in str(chained) and secret not in repr(chained)
        chained = chained.__cause__ or (None if chained.__suppress_context__ else chained.__context__)
    return err


def _ops():
    from airflow_delay_provider.operators import delay

    return delay


T = "{{ rendered }}"  # a templated argument: checked when the task runs, once rendered


def _schedule():
    from airflow_delay_provider.operators.schedule import ScheduleDagRunOperator

    return ScheduleDagRunOperator


# -- operators, when the DAG is parsed ------------------------------------------------------------------
PARSE_TIME = [
    ("send_policy_range", lambda o: o.SendDelayedMessageOperator(
        task_id="t", destination="q", delivery_policy='{"healthyRetryPolicy": {"numRetries": 500}}'),
     PolicyError, r"numRetries is 500; allowed: 0\.\.100"),
    ("send_policy_builtin", lambda o: o.SendDelayedMessageOperator(task_id="t", destination="q", delivery_policy="fax"),
     PolicyError, r"no built-in policy 'fax'; choose one of \['sqs', 'lambda', 'smtp', 'sms', 'mobile-push', 'http'\]"),
    # A DAG file is held to the most any store connection allows (ten years); the connection's own longest delay
    # (7 days by default) is checked when the task runs (RUN_TIME).
    ("send_delay_days", lambda o: o.SendDelayedMessageOperator(task_id="t", destination="q",
                                                                delay_seconds=timedelta(days=3700)),
     DelayError, r"^delay_seconds must be in 0\.\.315576000 seconds \(10 years\), got 319680000$"),
    ("send_delay_text", lambda o: o.SendDelayedMessageOperator(task_id="t", destination="q", delay_seconds="soon"),
     DelayError, r"^delay_seconds must be a number of seconds or a timedelta, got 'soon'"),
    ("send_queue_delay", lambda o: o.SendDelayedMessageOperator(task_id="t", destination="q", queue_delay_seconds=-1),
     DelayError, r"^queue_delay_seconds must be in 0\.\.315576000 seconds"),
    ("send_deliver_at", lambda o: o.SendDelayedMessageOperator(task_id="t", destination="q", deliver_at="tomorrow"),
     DelayError, r"^deliver_at must be an ISO-8601 timestamp with a timezone, got 'tomorrow'"),
    ("send_both", lambda o: o.SendDelayedMessageOperator(task_id="t", destination="q", delay_seconds=5,
                                                         deliver_at="2026-01-01T00:00:00+00:00"),
     DelayError, r"^give either delay_seconds or deliver_at, not both"),
    ("send_no_destination", lambda o: o.SendDelayedMessageOperator(task_id="t", delay_seconds=5),
     InvalidMessageError, r"destination must be a non-empty string, got None"),
    ("send_destination_newline", lambda o: o.SendDelayedMessageOperator(task_id="t", destination="a\nb"),
     InvalidMessageError, r"destination must be at most 255 characters without NUL or line breaks"),
    ("send_batch_second_bad", lambda o: o.SendDelayedMessageOperator(
        task_id="t", messages=[{"destination": "q", "delay_seconds": 5}, {"destination": "q", "delay_seconds": 10**9}]),
     DelayError, r"^messages\[1\]\.delay_seconds must be in 0\.\.315576000 seconds \(10 years\), got 1000000000"),
    ("send_policy_native", lambda o: o.SendDelayedMessageOperator(task_id="t", destination="q", transport="rabbitmq",
                                                                  delivery_policy="http"),
     InvalidInputError, r"delivery_policy applies to messages kept in the store \(transport='sql'\)"),
    ("schedule_delay_days", lambda o: _schedule()(task_id="t", dag_id="d", delay_seconds=timedelta(days=3700),
                                                  deliver_at=T),
     DelayError, r"^delay_seconds must be in 0\.\.315576000 seconds \(10 years\), got 319680000$"),
    ("schedule_deliver_at", lambda o: _schedule()(task_id="t", dag_id="d", delay_seconds=T, deliver_at="tomorrow"),
     DelayError, r"^deliver_at must be an ISO-8601 timestamp with a timezone"),
    ("dispatch_due_before", lambda o: o.DispatchDueMessagesOperator(task_id="t", due_before="tomorrow"),
     DelayError, r"^due_before must be an ISO-8601 timestamp with a timezone, got 'tomorrow'"),
    ("dispatch_empty_window", lambda o: o.DispatchDueMessagesOperator(
        task_id="t", due_from="2026-01-01T01:00:00+00:00", due_before="2026-01-01T00:00:00+00:00"),
     InvalidInputError, r"due_from \(2026-01-01T01:00:00\+00:00\) must be before due_before"),
    ("dispatch_destinations", lambda o: o.DispatchDueMessagesOperator(task_id="t", destinations=[1]),
     InvalidInputError, r"destinations must be a list of destination names, got \[1\]"),
    ("dispatch_max_messages", lambda o: o.DispatchDueMessagesOperator(task_id="t", max_messages=0),
     InvalidInputError, r"max_messages must be a whole number >= 1, got 0"),
    ("provision_endpoint", lambda o: o.ProvisionDelayInfrastructureOperator(task_id="t", endpoints=["fresh", "a\nb"]),
     InvalidMessageError, r"destination must be at most 255 characters without NUL or line breaks"),
    ("dispatch_runtime_zero", lambda o: o.DispatchDueMessagesOperator(task_id="t", max_runtime=0),
     InvalidInputError, r"max_runtime must be a timedelta or a number of seconds > 0, got 0"),
    ("dispatch_runtime_text", lambda o: o.DispatchDueMessagesOperator(task_id="t", max_runtime="soon"),
     InvalidInputError, r"max_runtime must be a timedelta or a number of seconds > 0, got 'soon'"),
    ("dispatch_runtime_bool", lambda o: o.DispatchDueMessagesOperator(task_id="t", max_runtime=True),
     InvalidInputError, r"max_runtime must be .* > 0, got True"),
    ("dispatch_runtime_negative", lambda o: o.DispatchDueMessagesOperator(task_id="t", max_runtime=timedelta(-1)),
     InvalidInputError, r"max_runtime must be a timedelta or a number of seconds > 0"),
    ("dispatch_retries", lambda o: o.DispatchDueMessagesOperator(task_id="t", number_of_retries=101),
     InvalidInputError, r"number_of_retries must be an int in 0\.\.100, got 101"),
    ("dispatch_error_queue", lambda o: o.DispatchDueMessagesOperator(task_id="t", error_queue=""),
     InvalidInputError, r"^error_queue: destination must be a non-empty string"),
    ("dispatch_error_queue_newline", lambda o: o.DispatchDueMessagesOperator(task_id="t", error_queue="err\nors"),
     InvalidInputError, r"^error_queue: destination must be at most 255 characters without NUL or line breaks"),
    ("dispatch_breaker", lambda o: o.DispatchDueMessagesOperator(task_id="t", time_to_trigger_fetch_circuit_breaker=0),
     InvalidInputError, r"time_to_trigger_fetch_circuit_breaker must be a number > 0, got 0"),
    ("dispatch_recovery", lambda o: o.DispatchDueMessagesOperator(task_id="t", maximum_recovery_failures_per_second=-1),
     InvalidInputError, r"maximum_recovery_failures_per_second must be a number > 0, got -1"),
    ("dispatch_policy_json", lambda o: o.DispatchDueMessagesOperator(
        task_id="t", destination_policies={"orders": '{"healthyRetryPolicy": '}),
     PolicyError, r"delivery policy is not valid JSON"),
    ("dispatch_policy_list", lambda o: o.DispatchDueMessagesOperator(task_id="t", delivery_policy=[1]),
     PolicyError, r"a delivery policy must be a JSON object, got list"),
    ("dispatch_policy_section", lambda o: o.DispatchDueMessagesOperator(
        task_id="t", delivery_policy={"healthyRetryPolicy": []}),
     PolicyError, r"healthyRetryPolicy and throttlePolicy must be JSON objects"),
    ("dispatch_policy_throttle", lambda o: o.DispatchDueMessagesOperator(
        task_id="t", delivery_policy={"throttlePolicy": {"maxReceivesPerSecond": 0.5}}),
     PolicyError, r"maxReceivesPerSecond must be an integer, got 0\.5"),
    ("provision_policy", lambda o: o.ProvisionDelayInfrastructureOperator(
        task_id="t", destination_policies={"orders": "[]"}),
     PolicyError, r"no built-in policy '\[\]'; choose one of"),
    ("migrate_direction", lambda o: o.MigrateDelayedMessagesOperator(task_id="t", direction="sideways"),
     InvalidInputError,
     r"direction 'sideways' is not supported; choose one of \['store_to_rabbitmq', 'rabbitmq_to_store'\]"),
    ("migrate_transport", lambda o: o.MigrateDelayedMessagesOperator(
        task_id="t", direction="store_to_rabbitmq", transport="sql"),
     InvalidInputError,
     r"holds them until due and can hand them back \(transport='rabbitmq'\); transport='sql' cannot"),
    # SQS delays natively but cannot hand held messages back.
    ("migrate_transport_sqs", lambda o: o.MigrateDelayedMessagesOperator(
        task_id="t", direction="rabbitmq_to_store", transport="sqs"),
     InvalidInputError, r"transport='sqs' cannot"),
    ("send_on_duplicate", lambda o: o.SendDelayedMessageOperator(task_id="t", destination="q", on_duplicate="debounce"),
     InvalidInputError, r"on_duplicate must be one of skip, replace, keep_earliest, replace_body, got 'debounce'"),
    ("send_on_duplicate_native", lambda o: o.SendDelayedMessageOperator(
        task_id="t", destination="q", transport="rabbitmq", on_duplicate="replace"),
     InvalidInputError, r"on_duplicate='replace' needs the message kept in the store \(transport='sql'\): 'rabbitmq' "
                        r"hands it to the broker's own delays.*allows on_duplicate='skip' only"),
    ("schedule_on_duplicate", lambda o: _schedule()(task_id="t", dag_id="target", delay_seconds=5,
                                                    on_duplicate="Replace"),
     InvalidInputError, r"on_duplicate must be one of skip, replace, keep_earliest, replace_body, got 'Replace'"),
    ("relay_transport", lambda o: o.RelayDelayedMessagesOperator(task_id="t", endpoint="orders", transport="rabbitmq"),
     InvalidInputError, r"use transport='sqs'"),
    ("relay_runtime", lambda o: o.RelayDelayedMessagesOperator(task_id="t", endpoint="orders", max_runtime=-5),
     InvalidInputError, r"max_runtime must be a timedelta or a number of seconds > 0, got -5"),
    ("relay_policy", lambda o: o.RelayDelayedMessagesOperator(
        task_id="t", endpoint="orders", delivery_policy={"throttlePolicy": {"maxReceivesPerSecond": 0}}),
     PolicyError, r"maxReceivesPerSecond is 0; allowed: >= 1"),
]


@pytest.mark.parametrize(("build", "error", "pattern"), [pytest.param(*c[1:], id=c[0]) for c in PARSE_TIME])
def test_bad_operator_arguments_fail_the_dag_import(build, error, pattern):
    _raises(lambda: build(_ops()), error, pattern)


# -- operators, when they run: nothing stored, nothing dispatched -----------------------------------------
@pytest.fixture
def sql_store(tmp_path, monkeypatch):
    """A SQLite store of this test's own holding one due message for the provisioned queue `orders`."""
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    conn_id = _conn(monkeypatch, {"conn_type": "delay_store", "schema": str(tmp_path / "store.db"),
                                  "extra": {"driver": "sqlite", "table": "bad_input"}})
    hook = DelayStoreHook(conn_id)
    store = hook.get_store()
    store.create_schema()
    transport = hook.get_transport()
    transport.provision("orders")
    store.store([DelayedMessage("orders", b"due", utcnow() - timedelta(seconds=1), {}, "kept-1")])
    return conn_id, store, transport


def _provisioned(transport, name: str) -> bool:
    with transport.engine.connect() as conn:
        return conn.execute(select(transport.queues.c.name).where(transport.queues.c.name == name)).first() is not None


def _rendered(operator, **values):
    """The operator once its templates rendered: each of `values` was a template when the DAG was parsed (so it is
    checked only now) and rendered to the bad value; literal bad values fail the import (PARSE_TIME)."""
    for name, value in values.items():
        assert name in operator.template_fields, name
        setattr(operator, name, value)
    return operator


RUN_TIME = [
    ("send_no_destination", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, destination=T, delay_seconds=5), destination=None).execute(TI),
     InvalidMessageError, r"destination must be a non-empty string, got None"),
    ("send_delay_text", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, destination="orders", delay_seconds=T), delay_seconds="soon").execute(TI),
     DelayError, r"^delay_seconds must be a number of seconds or a timedelta, got 'soon'"),
    ("send_delay_bool", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, destination="orders", delay_seconds=T), delay_seconds=True).execute(TI),
     DelayError, r"^delay_seconds must be a number of seconds or a timedelta, got bool True"),
    ("send_delay_huge", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, destination="orders", delay_seconds=T), delay_seconds=10**400).execute(TI),
     DelayError, r"^delay_seconds must be in 0\.\.604800 seconds"),
    ("send_queue_delay_text", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, destination="orders", queue_delay_seconds=T),
        queue_delay_seconds="ten").execute(TI),
     DelayError, r"^queue_delay_seconds must be an integer number of seconds, got 'ten'"),
    ("send_message_id", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, destination="orders", message_id=T),
        message_id="id\nwith a break").execute(TI),
     InvalidMessageError, r"message_id must be a printable string of 1\.\.200 characters"),
    ("send_body_dict", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, destination="orders", body=T), body={"a": 1}).execute(TI),
     InvalidMessageError, r"body must be bytes or str, got dict; serialise it first"),
    ("send_messages_dict", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, messages=T), messages={"destination": "orders"}).execute(TI),
     InvalidInputError, r"messages must be a list of dicts, got dict"),
    ("send_batch_second_bad", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, messages=T), messages=[{"destination": "orders", "delay_seconds": 5},
                                                                   {"destination": "orders", "delay_seconds": "x"}])
     .execute(TI),
     DelayError, r"^messages\[1\]\.delay_seconds must be a number of seconds or a timedelta, got 'x'"),
    ("send_on_duplicate", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, destination="orders", message_id="kept-1", on_duplicate=T),
        on_duplicate="overwrite").execute(TI),
     InvalidInputError, r"on_duplicate must be one of skip, replace, keep_earliest, replace_body, got 'overwrite'"),
    ("send_on_duplicate_native", lambda o, c: _rendered(o.SendDelayedMessageOperator(
        task_id="t", delay_store_conn_id=c, destination="orders", transport=T, on_duplicate="keep_earliest"),
        transport="sqs").execute(TI),
     InvalidInputError, r"on_duplicate='keep_earliest' needs the message kept in the store.*'sqs' allows "
                        r"on_duplicate='skip' only"),
    ("dispatch_due_before", lambda o, c: _rendered(o.DispatchDueMessagesOperator(
        task_id="t", delay_store_conn_id=c, due_before=T, max_runtime=2), due_before="tomorrow").execute(TI),
     DelayError, r"^due_before must be an ISO-8601 timestamp with a timezone, got 'tomorrow'"),
    ("dispatch_due_from_naive", lambda o, c: _rendered(o.DispatchDueMessagesOperator(
        task_id="t", delay_store_conn_id=c, due_from=T, max_runtime=2), due_from="2026-01-01T00:00:00").execute(TI),
     DelayError, r"^due_from must carry a timezone"),
    ("dispatch_max_messages", lambda o, c: _rendered(o.DispatchDueMessagesOperator(
        task_id="t", delay_store_conn_id=c, max_messages=T, max_runtime=2), max_messages=0).execute(TI),
     InvalidInputError, r"max_messages must be a whole number >= 1, got 0"),
    ("dispatch_max_messages_fraction", lambda o, c: _rendered(o.DispatchDueMessagesOperator(
        task_id="t", delay_store_conn_id=c, max_messages=T, max_runtime=2), max_messages="1.5").execute(TI),
     InvalidInputError, r"max_messages must be a whole number >= 1, got '1\.5'"),
    ("dispatch_destinations", lambda o, c: _rendered(o.DispatchDueMessagesOperator(
        task_id="t", delay_store_conn_id=c, destinations=T, max_runtime=2), destinations=[1]).execute(TI),
     InvalidInputError, r"destinations must be a list of destination names, got \[1\]"),
    ("dispatch_destinations_empty_name", lambda o, c: _rendered(o.DispatchDueMessagesOperator(
        task_id="t", delay_store_conn_id=c, destinations=T, max_runtime=2), destinations="orders,").execute(TI),
     InvalidMessageError, r"destination must be a non-empty string, got ''"),
    ("provision_endpoint", lambda o, c: _rendered(o.ProvisionDelayInfrastructureOperator(
        task_id="t", delay_store_conn_id=c, endpoints=T), endpoints=["fresh", "a\nb"]).execute(TI),
     InvalidMessageError, r"destination must be at most 255 characters without NUL or line breaks"),
    ("provision_verify_sql", lambda o, c: o.ProvisionDelayInfrastructureOperator(
        task_id="t", delay_store_conn_id=c, endpoints=["fresh"], verify=True).execute(TI),
     DelayProviderError, r"is incomplete: missing \['fresh', 'error'\].*without verify=True to declare it"),
    ("sensor_before", lambda o, c: __import__("airflow_delay_provider.sensors.delay_store", fromlist=["x"])
     .DelayedMessagesSensor(task_id="t", delay_store_conn_id=c, before="tomorrow").poke({}),
     DelayError, r"^before must be an ISO-8601 timestamp with a timezone, got 'tomorrow'"),
    ("sweep_no_window", lambda o, c: __import__("airflow_delay_provider.operators.sweep", fromlist=["x"])
     .BulkSweepOperator(task_id="t", delay_store_conn_id=c, due_before=None).execute(TI),
     InvalidInputError, r"due_before is required: the end of the window to sweep"),
    ("sweep_bad_window", lambda o, c: __import__("airflow_delay_provider.operators.sweep", fromlist=["x"])
     .BulkSweepOperator(task_id="t", delay_store_conn_id=c, due_before="2026-13-01T00:00:00+00:00").execute(TI),
     DelayError, r"^due_before must be an ISO-8601 timestamp with a timezone"),
]


@pytest.mark.parametrize(("run", "error", "pattern"), [pytest.param(*c[1:], id=c[0]) for c in RUN_TIME])
def test_bad_run_time_arguments_store_and_dispatch_nothing(sql_store, run, error, pattern):
    conn_id, store, transport = sql_store
    _raises(lambda: run(_ops(), conn_id), error, pattern)
    assert store.count_scheduled() == {"orders": 1}  # nothing stored, the due message not dispatched
    assert store.get("kept-1").failures == 0
    assert transport.depth("orders") == {"visible": 0, "in_flight": 0}
    assert not _provisioned(transport, "fresh")


@pytest.mark.parametrize("operator", ["provision", "dispatch", "send"])
def test_transport_options_for_a_transport_that_takes_none_fail_the_task_and_change_nothing(sql_store, operator):
    conn_id, store, transport = sql_store
    o = _ops()
    common = {"task_id": "t", "delay_store_conn_id": conn_id, "transport_options": {"prefix": "prod-"}}
    run = {"provision": lambda: o.ProvisionDelayInfrastructureOperator(endpoints=["fresh"], **common).execute(TI),
           "dispatch": lambda: o.DispatchDueMessagesOperator(max_runtime=2, **common).execute(TI),
           # A send kept in the store opens no transport, but the options still say something it will not do.
           "send": lambda: o.SendDelayedMessageOperator(destination="orders", body="x", delay_seconds=60,
                                                        message_id="sent-1", **common).execute(TI)}[operator]
    _raises(run, InvalidInputError, r"^transport='sql' takes no transport_options, got \['prefix'\]; only \[[^]]*'sqs'")
    assert store.count_scheduled() == {"orders": 1} and store.get("kept-1").failures == 0  # not dispatched
    assert transport.depth("orders") == {"visible": 0, "in_flight": 0}
    assert not _provisioned(transport, "fresh")


# -- connection extras ---------------------------------------------------------------------------------
DELAY_STORE, RABBITMQ, SQS = "delay_store", "rabbitmq", "sqs"
EXTRAS = [
    ("store_driver", DELAY_STORE, {"driver": "nosuchdb"}, InvalidInputError,
     r"the driver extra of connection '\w+' names the driver 'nosuchdb', which is not supported; "
     r"allowed: postgresql\+psycopg .* or sqlite"),
    ("store_driver_missing", DELAY_STORE, {"driver": "postgresql+nosuchdriver"}, InvalidInputError,
     r"names the driver 'postgresql\+nosuchdriver', which is not installed; allowed: postgresql\+psycopg"),
    ("store_driver_type", DELAY_STORE, {"driver": 5}, InvalidInputError,
     r"the driver extra of connection '\w+' must be a string; allowed: postgresql\+psycopg"),
    ("store_url_backend", DELAY_STORE, {"url": f"mysql://bob:{SECRET}@db/app"}, InvalidInputError,
     r"the url extra of connection '\w+' names the driver 'mysql', which is not supported; allowed:"),
    ("store_url_malformed", DELAY_STORE, {"url": f"postgresql//bob:{SECRET}@db/app"}, InvalidInputError,
     r"the url extra of connection '\w+' is not an SQLAlchemy URL; allowed: .*postgresql\+psycopg://"),
    ("store_table", DELAY_STORE, {"table": "drop table"}, InvalidNameError,
     r"table name 'drop table' is not allowed: use 1-63 ASCII letters, digits and underscores"),
    ("store_schema", DELAY_STORE, {"db_schema": "bad-schema"}, InvalidNameError,
     r"schema name 'bad-schema' is not allowed: use 1-63 ASCII letters"),
    ("store_schema_sqlite", DELAY_STORE, {"driver": "sqlite", "db_schema": "delays"}, InvalidInputError,
     r"db_schema is only supported on PostgreSQL, not sqlite"),
    ("store_dedup_text", DELAY_STORE, {"dedup_window_seconds": "a day"}, InvalidInputError,
     r"the dedup_window_seconds extra of connection '\w+' must be a number of seconds >= 0, got 'a day'"),
    ("store_dedup_negative", DELAY_STORE, {"dedup_window_seconds": -5}, InvalidInputError,
     r"dedup_window_seconds must be a number of seconds >= 0 \(0 turns de-duplication off\), got -5"),
    ("rabbit_levels_text", RABBITMQ, {"levels": "abc"}, InvalidInputError,
     r"the rabbitmq connection extra levels must be an int in 1\.\.28, got 'abc'"),
    ("rabbit_levels_zero", RABBITMQ, {"levels": 0}, InvalidInputError,
     r"extra levels must be an int in 1\.\.28, got 0"),
    ("rabbit_levels_29", RABBITMQ, {"levels": "29"}, InvalidInputError,
     r"extra levels must be an int in 1\.\.28, got '29'"),
    ("rabbit_levels_bool", RABBITMQ, {"levels": True}, InvalidInputError,
     r"extra levels must be an int in 1\.\.28, got True"),
    ("rabbit_delivery_limit", RABBITMQ, {"delivery_limit": 0}, InvalidInputError,
     r"extra delivery_limit must be an int >= 1, got 0"),
    ("rabbit_delivery_limit_text", RABBITMQ, {"delivery_limit": "many"}, InvalidInputError,
     r"extra delivery_limit must be an int >= 1, got 'many'"),
    ("rabbit_confirm_window", RABBITMQ, {"confirm_window": 0}, InvalidInputError,
     r"extra confirm_window must be an int >= 1, got 0"),
    ("rabbit_heartbeat", RABBITMQ, {"heartbeat": -1}, InvalidInputError,
     r"extra heartbeat must be an int >= 0, got -1"),
    ("rabbit_prefix", RABBITMQ, {"prefix": "a*b"}, InvalidNameError,
     r"prefix 'a\*b' cannot name the delay exchanges and queues: .*no '\*' or '#'"),
    ("sqs_queue_delay", SQS, {"queue_delay": 0}, DelayError, r"queue_delay must be an int in 1\.\.900 seconds"),
    ("sqs_queue_delay_high", SQS, {"queue_delay": 901}, DelayError, r"queue_delay must be an int in 1\.\.900 seconds"),
    ("sqs_relay_downtime", SQS, {"max_relay_downtime": 0}, InvalidInputError,
     r"max_relay_downtime must be a number of seconds > 0, got 0"),
    ("sqs_body_expiration", SQS, {"body_expiration_days": 0}, InvalidInputError,
     r"body_expiration_days must be an int >= 1, got 0"),
    ("sqs_unknown_option", SQS, {"queue_dealy": 5}, InvalidInputError,
     r"transport_options \['queue_dealy'\] are not known for transport='sqs'; allowed: \[.*'queue_delay'"),
]


@pytest.mark.parametrize(("kind", "extra", "error", "pattern"), [pytest.param(*c[1:], id=c[0]) for c in EXTRAS])
def test_bad_connection_extras_say_which_and_what_is_allowed(kind, extra, error, pattern, monkeypatch, tmp_path):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook

    if kind == DELAY_STORE:
        sqlite = str(extra.get("driver", "")).startswith("sqlite")
        conn_id = _conn(monkeypatch, {"conn_type": "delay_store", "host": None if sqlite else "127.0.0.1",
                                      "port": None if sqlite else 5432, "login": "bob", "password": SECRET,
                                      "schema": str(tmp_path / "s.db") if sqlite else "test", "extra": extra})
        _raises(lambda: DelayStoreHook(conn_id).get_store(), error, pattern)
        assert not (tmp_path / "s.db").exists()
    elif kind == RABBITMQ:
        conn_id = _conn(monkeypatch, {"conn_type": "rabbitmq", "host": "127.0.0.1", "port": 1, "login": "bob",
                                      "password": SECRET, "extra": extra})
        _raises(lambda: RabbitMQDelayHook(conn_id).get_transport(), error, pattern)
    else:  # the operators hand `transport_options` to the SQS hook
        conn_id = _conn(monkeypatch, {"conn_type": "aws", "login": "AKIDBADINPUT", "password": SECRET,
                                      "extra": {"region_name": "us-east-1", "endpoint_url": "http://127.0.0.1:1"}})
        # Unknown options fail the operator's construction (the DAG's import), before any connection is read.
        _raises(lambda: _ops().RelayDelayedMessagesOperator(task_id="t", endpoint="orders", transport_conn_id=conn_id,
                                                            transport_options=extra).get_transport(), error, pattern)


# -- the store's own methods -----------------------------------------------------------------------------
def _store_cases():
    from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
    from airflow_delay_provider.transports.sql import SqlTableTransport

    good = DelayedMessage("orders", b"x", utcnow(), {}, "new-1")
    return [
        ("dedup_window_bool",
         lambda url, store: SqlDelayedMessageStore(url, table="bad_input", dedup_window_seconds=True),
         InvalidInputError, r"dedup_window_seconds must be a number of seconds >= 0 .*got True"),
        ("schema_on_sqlite", lambda url, store: SqlDelayedMessageStore(url, table="bad_input", schema="delays"),
         InvalidInputError, r"schema 'delays': a schema \(db_schema\) is only supported on PostgreSQL, not sqlite"),
        ("transport_table_prefix", lambda url, store: SqlTableTransport(url, table_prefix="bad prefix "),
         InvalidNameError, r"table prefix 'bad prefix queues' is not allowed: use 1-63 ASCII letters"),
        ("store_not_a_message", lambda url, store: store.store([good, {"destination": "orders"}]),
         InvalidMessageError, r"messages must be DelayedMessage objects .*got dict"),
        ("policy_out_of_range", lambda url, store: store.set_policies(
            {"orders": {"healthyRetryPolicy": {"numRetries": 500}}}),
         PolicyError, r"the delivery policy of 'orders': numRetries is 500; allowed: 0\.\.100"),
        ("policy_not_an_object", lambda url, store: store.set_policies({"orders": "sqs"}),
         PolicyError, r"the delivery policy of 'orders': a delivery policy must be a JSON object, got str"),
        ("policy_no_destination", lambda url, store: store.set_policies({"": DeliveryPolicy().to_dict()}),
         InvalidMessageError, r"destination must be a non-empty string, got ''"),
        ("sweep_claim_id", lambda url, store: store.start_sweep("bad id!", due_before=utcnow()),
         InvalidInputError, r"claim id 'bad id!' is not allowed: use 1-64 ASCII letters, digits, '-' and '_'"),
        ("sweep_lease", lambda url, store: store.start_sweep("ok-1", due_before=utcnow(), lease_seconds=0),
         InvalidInputError, r"lease_seconds must be > 0, got 0"),
        ("leased_rows_claim_id", lambda url, store: store.leased_rows("x" * 65, []),
         InvalidInputError, r"claim id 'x+' is not allowed: use 1-64"),
    ]


@pytest.mark.parametrize("case", range(10), ids=[c[0] for c in _store_cases()])
def test_bad_store_arguments_store_nothing(sql_store, case):
    _, store, _ = sql_store
    name, call, error, pattern = _store_cases()[case]
    _raises(lambda: call(str(store.url), store), error, pattern)
    assert store.count_scheduled() == {"orders": 1} and store.get("new-1") is None
    assert store.policies() == {}
    assert store.sweep_record("ok-1") is None


# -- brokers: nothing sent ---------------------------------------------------------------------------------
def test_bad_input_sends_nothing_to_rabbitmq(rabbit_vhost, sql_store, monkeypatch):
    from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook
    from airflow_delay_provider.transports.rabbitmq import delay_topology

    store_conn, store, _ = sql_store
    rabbit = _conn(monkeypatch, {"conn_type": "rabbitmq", "host": "127.0.0.1", "port": 5672, "login": "guest",
                                 "password": "guest", "schema": rabbit_vhost,
                                 "extra": {"prefix": f"bad{uuid.uuid4().hex[:6]}"}})
    transport = RabbitMQDelayHook(rabbit).get_transport()
    transport.provision("orders")
    queues = [q.name for q in delay_topology(transport.names).queues] + ["orders"]
    o = _ops()
    common = {"task_id": "t", "transport": "rabbitmq", "transport_conn_id": rabbit, "delay_store_conn_id": store_conn}
    cases = [
        (lambda: o.SendDelayedMessageOperator(destination="a*b", delay_seconds=5, **common).execute(TI),
         InvalidNameError,
         r"RabbitMQ destination 'a\*b' cannot be routed, it contains a topic wildcard .*no '\*' or '#'"),
        (lambda: o.SendDelayedMessageOperator(messages=[{"destination": "orders", "delay_seconds": 1},
                                                        {"destination": "orders..x", "delay_seconds": 1}],
                                              **common).execute(TI),
         InvalidNameError, r"RabbitMQ destination 'orders\.\.x' cannot be routed, it has an empty word"),
        (lambda: o.SendDelayedMessageOperator(destination="orders", delay_seconds=5, delivery_policy="sms",
                                              **common).execute(TI),
         InvalidInputError, r"delivery_policy applies to messages kept in the store \(transport='sql'\)"),
        (lambda: o.SendDelayedMessageOperator(destination="orders", delay_seconds=8 * 86_400, **common).execute(TI),
         DelayError, r"^delay_seconds must be in 0\.\.604800 seconds"),
    ]
    try:
        for call, error, pattern in cases:
            _raises(call, error, pattern, "guest")
            assert {q: transport.depth(q)["visible"] for q in queues} == dict.fromkeys(queues, 0)
        assert store.count_scheduled() == {"orders": 1}
    finally:
        transport.close()


def test_bad_input_sends_nothing_to_sqs(aws_conn, sqs_client, sql_store):
    from airflow_delay_provider.transports.sqs import SqsTransport

    store_conn, store, _ = sql_store
    sqs = SqsTransport(sqs_client)
    sqs.provision("orders")
    queues = sorted(sqs_client.list_queues().get("QueueUrls", []))
    o = _ops()
    common = {"task_id": "t", "transport": "sqs", "transport_conn_id": aws_conn, "delay_store_conn_id": store_conn}
    cases = [
        (lambda: o.SendDelayedMessageOperator(destination="orders", delay_seconds=5, transport_options={"Prefix": "x"},
                                              **common).execute(TI),
         InvalidInputError, r"transport_options \['Prefix'\] are not known for transport='sqs'; allowed: \[.*'prefix'"),
        (lambda: o.SendDelayedMessageOperator(destination="orders", delay_seconds=5,
                                              transport_options={"queue_delay": 901}, **common).execute(TI),
         DelayError, r"queue_delay must be an int in 1\.\.900 seconds \(SQS's limit\), got 901"),
        (lambda: o.SendDelayedMessageOperator(destination="bad name!", delay_seconds=5, **common).execute(TI),
         InvalidNameError, r"SQS queue name 'bad name!' is not allowed: 1-80 characters of A-Z, a-z, 0-9, '-' and '_'"),
        (lambda: o.RelayDelayedMessagesOperator(endpoint="bad name!", max_runtime=2, **common).execute(TI),
         InvalidNameError, r"SQS queue name 'bad name!' is not allowed"),
        (lambda: o.RelayDelayedMessagesOperator(endpoint="orders", max_runtime=2, **common,
                                                transport_options={"max_relay_downtime": -1}).execute(TI),
         InvalidInputError, r"max_relay_downtime must be a number of seconds > 0, got -1"),
    ]
    for call, error, pattern in cases:
        _raises(call, error, pattern, "testing")
        assert sqs.lifecycle("orders") == {"scheduled": 0, "visible": 0, "in_flight": 0}
        assert sqs.lifecycle("orders", delay_queue=True) == {"scheduled": 0, "visible": 0, "in_flight": 0}
        assert sorted(sqs_client.list_queues().get("QueueUrls", [])) == queues  # none made by mistake
    assert store.count_scheduled() == {"orders": 1}


LITERAL_DAG = '''
from datetime import datetime, timedelta
from airflow.sdk import DAG
from airflow_delay_provider.operators.send import SendDelayedMessageOperator

with DAG(dag_id="literal_delay", schedule=None, start_date=datetime(2026, 1, 1)):
    SendDelayedMessageOperator(task_id="send", destination="orders", delay_seconds=timedelta(days=3700))
'''

#: Known only at run time: templates and XCom, everywhere a literal would be checked at import.
RUN_TIME_DAG = '''
from datetime import datetime
from airflow.sdk import DAG, Param, task
from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator
from airflow_delay_provider.operators.provision import ProvisionDelayInfrastructureOperator
from airflow_delay_provider.operators.schedule import ScheduleDagRunOperator
from airflow_delay_provider.operators.send import SendDelayedMessageOperator

with DAG(dag_id="run_time_values", schedule=None, start_date=datetime(2026, 1, 1), params={"d": Param(5)}):
    @task
    def plan() -> list:
        return [{"destination": "orders", "delay_seconds": 5}]

    @task
    def delay() -> int:
        return 5

    SendDelayedMessageOperator(task_id="templated", destination="{{ params.q }}", delay_seconds="{{ params.d }}",
                               deliver_at="{% if false %}x{% endif %}", queue_delay_seconds="{{ params.d }}")
    SendDelayedMessageOperator(task_id="from_xcom", messages=plan(), delay_seconds=delay())
    SendDelayedMessageOperator(task_id="nested", messages=[{"destination": "{{ params.q }}", "delay_seconds": 5}])
    ScheduleDagRunOperator(task_id="schedule", dag_id="target", conf=plan(), delay_seconds=delay())
    DispatchDueMessagesOperator(task_id="dispatch", due_before="{{ data_interval_end }}",
                                destinations="{{ params.q }}", max_messages="{{ params.d }}")
    ProvisionDelayInfrastructureOperator(task_id="provision", endpoints="{{ params.q }}")
'''


def test_a_literal_delay_out_of_range_fails_the_dag_import_and_run_time_values_import(airflow_home, tmp_path):
    from airflow.dag_processing.dagbag import DagBag

    (tmp_path / "literal_delay.py").write_text(LITERAL_DAG)
    (tmp_path / "run_time_values.py").write_text(RUN_TIME_DAG)
    bag = DagBag(dag_folder=str(tmp_path))
    assert set(bag.dag_ids) == {"run_time_values"}, bag.import_errors
    [(path, error)] = bag.import_errors.items()
    assert path.endswith("literal_delay.py")
    assert "delay_seconds must be in 0..315576000 seconds (10 years), got 319680000" in error, error
