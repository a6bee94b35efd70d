"""The example DAGs in a real deployment: api-server, scheduler, dag-processor and triggerer as separate
processes with homes of their own, LocalExecutor, a PostgreSQL metadata database, runs triggered through
the REST API; the store (`delay_store_default`) on PostgreSQL, RabbitMQ in a vhost of this module's, SQS on
moto, their connections defined through the REST API in the deployment test_first_run ran on first. Time bounds
are loose: the figures are the deployment benchmark's (bench/bench_deployment.py)."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.conftest import PG_URL, _rabbitmqctl
from tests.helpers import receive_until

EXAMPLE_RUNS = {  # a manual run of each example DAG, as a user would trigger it
    "demo_delayed_delivery": {"count": 40, "max_delay": 3},
    "delay_manual_send": {"transport": "sql", "destination": "dep.manual", "delay_seconds": 2},
    "delay_continuous_dispatch": {"dispatch_seconds": 15},
    "delay_scheduled_sweep": {},
    "delay_sqs_relay": {"relay_seconds": 5},
    "delay_order_timeout": {"timeout_seconds": 2, "pay": False},
    "delay_provision_all": {},
    "spark_bulk_sweep": {},
}


@pytest.fixture(scope="module")
def services(moto_server, rabbit_available):
    """The connections of the brokers and of Spark: a vhost of this module's own, moto, a local Spark."""
    vhost = f"adp_dep_{uuid.uuid4().hex[:8]}"
    _rabbitmqctl("add_vhost", vhost)
    _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    yield {
        "rabbitmq_default": {"conn_type": "rabbitmq", "host": "127.0.0.1", "port": 5672, "login": "guest",
                             "password": "guest", "schema": vhost},
        "aws_default": {"conn_type": "aws", "login": "testing", "password": "testing",
                        "extra": {"endpoint_url": moto_server, "region_name": "us-east-1"}},
        "spark_default": {"conn_type": "spark", "host": "local[2]"},
    }
    _rabbitmqctl("delete_vhost", vhost)


@pytest.fixture(scope="module")
def airflow(examples_deployment, services):
    """The deployment test_first_run ran on first (tests/deployment/conftest.py), its runs ended (a continuous
    dispatcher's would dispatch what these tests store), and the brokers' and Spark's connections added."""
    airflow, _ = examples_deployment
    for dag in airflow.dags():
        _stop(airflow, dag["dag_id"])
    # test_first_run has the DAG files parsed again every 5 s (an asset watcher starts at its file's next parse
    # after unpausing); this module never needed that: Airflow's 30 s, as it had before the two shared.
    print(f"\n[delivery] the dag-processor used {airflow.cpu_seconds('dag-processor'):.0f} s of CPU in "
          f"{(utcnow() - airflow.started_at['dag-processor']).total_seconds():.0f} s")
    airflow.restart("dag-processor", env={"AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "30"})
    for conn_id, connection in services.items():
        airflow.add_connection(conn_id, connection)
    yield airflow
    print(f"\n[delivery] then {airflow.cpu_seconds('dag-processor'):.0f} s of CPU in "
          f"{(utcnow() - airflow.started_at['dag-processor']).total_seconds():.0f} s")


@pytest.fixture(scope="module")
def store(examples_deployment):
    """The store of the deployment's `delay_store_default` connection."""
    return examples_deployment[1]


@pytest.fixture(scope="module")
def queues(pg_schema):
    return SqlTableTransport(PG_URL, schema=pg_schema)


def _check_once_and_on_time(got: list, expected: set[str]) -> list[float]:
    ids = [m.message_id for m in got]
    assert set(ids) == expected, f"missing {sorted(expected - set(ids))[:10]}"
    assert len(ids) == len(expected), f"delivered twice: {sorted({i for i in ids if ids.count(i) > 1})[:10]}"
    early = [m.message_id for m in got if m.enqueued_at < m.due_at]
    assert not early, f"delivered before their due time: {early[:10]}"
    return sorted((m.enqueued_at - m.due_at).total_seconds() for m in got)


def _stop(airflow, dag_id: str) -> None:
    """Pause the DAG, end its runs still queued or running (the scheduled run unpausing started), and wait until
    the triggerer has cancelled their deferred tasks' triggers: it does so seconds after the run ended, and until
    then a dispatcher of the store delivers what the next test stores (seen in a CI run: a continuous dispatcher
    ended by the first test delivered the backfill test's messages due outside its windows)."""
    airflow.pause(dag_id)
    deferred = []
    for run in airflow.dag_runs(dag_id):
        if run["state"] in ("queued", "running"):
            run_id = run["dag_run_id"]
            deferred += [ti for ti in airflow.task_instances(dag_id, run_id) if ti["state"] == "deferred"]
            airflow.api("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed"})
    for ti in deferred:
        airflow.wait_trigger_completed(dag_id, ti["dag_run_id"], ti["task_id"], ti["try_number"])


def test_every_example_dag_runs_when_triggered_by_hand(airflow):
    started = utcnow()
    runs = {}
    try:
        for dag_id, conf in EXAMPLE_RUNS.items():
            airflow.unpause(dag_id)
            runs[dag_id] = airflow.trigger(dag_id, conf)
        states = {dag_id: airflow.wait_run(dag_id, run_id, timeout=420) for dag_id, run_id in runs.items()}
        failed = {d: airflow.task_states(d, runs[d]) for d, s in states.items() if s != "success"}
        assert not failed, f"failed runs: {failed}\n{airflow.logs_tail()}"
        demo = airflow.xcom("demo_delayed_delivery", runs["demo_delayed_delivery"], "verify")
        assert demo["delivered"] == demo["sent"] == 40 and demo["duplicates"] == demo["early"] == 0
        order = airflow.xcom("delay_order_timeout", runs["delay_order_timeout"], "cancel_if_unpaid")
        assert order["status"] == "cancelled"
        continuous = airflow.xcom("delay_continuous_dispatch", runs["delay_continuous_dispatch"], "dispatch")
        assert continuous["dispatched_in"] == "triggerer" and continuous["stopped_because"] == "deadline"
        # Unpausing never started a catch-up from the start date (2026-01-01): only the latest intervals ran.
        for dag_id in EXAMPLE_RUNS:
            scheduled = [r["logical_date"] for r in airflow.dag_runs(dag_id) if r["run_type"] == "scheduled"]
            assert all(datetime.fromisoformat(d) > started - timedelta(hours=2) for d in scheduled), (dag_id, scheduled)
    finally:
        for dag_id in runs:
            _stop(airflow, dag_id)


def test_a_misspelt_conf_key_fails_the_run_before_anything_is_sent(airflow, store):
    before = store.count_scheduled()
    airflow.unpause("delay_manual_send")
    run_id = airflow.trigger("delay_manual_send", {"destination": "dep.typo", "delay": 5})
    assert airflow.wait_run("delay_manual_send", run_id, timeout=120) == "failed"
    airflow.pause("delay_manual_send")
    assert store.count_scheduled() == before


def test_backfilled_windows_dispatch_each_message_once(airflow, store, queues):
    """A window sweep over past intervals: each interval's messages once, nothing outside the range."""
    queue = f"dep.backfill.{uuid.uuid4().hex[:6]}"
    queues.provision(queue)
    now = utcnow()
    start = (now - timedelta(minutes=60)).replace(second=0, microsecond=0)
    start -= timedelta(minutes=start.minute % 5)
    end = start + timedelta(minutes=20)  # four 5-minute windows
    inside = [DelayedMessage(queue, b"w", start + timedelta(seconds=37 * i + 1), {}, f"bf-{i}") for i in range(30)]
    before = [DelayedMessage(queue, b"old", start - timedelta(minutes=30), {}, f"old-{i}") for i in range(3)]
    store.store(inside + before)
    airflow.unpause("delay_scheduled_sweep")
    backfill = airflow.backfill("delay_scheduled_sweep", start, end - timedelta(minutes=5), max_active_runs=2)
    runs = airflow.wait_backfill(backfill["id"], timeout=300)
    _stop(airflow, "delay_scheduled_sweep")
    assert [r["state"] for r in runs] == ["success"] * 4, runs
    windows = [(datetime.fromisoformat(r["data_interval_start"]), datetime.fromisoformat(r["data_interval_end"]))
               for r in runs]
    assert all(b - a == timedelta(minutes=5) for a, b in windows)  # real windows, not start == end
    got = receive_until(queues, queue, {m.message_id for m in inside}, timeout=30)
    _check_once_and_on_time(got, {m.message_id for m in inside})
    dispatched = sum(airflow.xcom("delay_scheduled_sweep", r["dag_run_id"], "dispatch")["dispatched"] for r in runs)
    assert dispatched == len(inside)
    assert store.count_scheduled(destination=queue) == {queue: 3}  # due before the range: not this backfill's


def test_continuous_dispatch_delivers_at_due_times_and_survives_a_triggerer_kill(airflow, store, queues):
    queue = f"dep.timing.{uuid.uuid4().hex[:6]}"
    queues.provision(queue)
    airflow.unpause("delay_continuous_dispatch")
    run_id = airflow.trigger("delay_continuous_dispatch", {"dispatch_seconds": 80})
    airflow.wait_trigger_assigned("delay_continuous_dispatch", run_id, "dispatch", timeout=120)
    now = utcnow()
    # Due 2-45 s ahead, and a burst of 300 due at one instant.
    before_kill = [DelayedMessage(queue, b"t", now + timedelta(seconds=d), {}, f"t-{d}-{i}")
                   for d in (2, 5, 10, 15) for i in range(3)]
    burst = [DelayedMessage(queue, b"b", now + timedelta(seconds=8), {}, f"burst-{i}") for i in range(300)]
    after_kill = [DelayedMessage(queue, b"k", now + timedelta(seconds=d), {}, f"k-{d}-{i}")
                  for d in (25, 35, 45) for i in range(3)]
    store.store(before_kill + burst + after_kill)
    first = {m.message_id for m in before_kill + burst}
    got = receive_until(queues, queue, first, timeout=60)
    lateness = _check_once_and_on_time(got, first)
    # Loose: a resume-based dispatcher is late by a task resume (seconds); the benchmark has the real figures.
    assert lateness[-1] < 5.0, lateness[-10:]
    # SIGKILL the triggerer while the rest wait, start it again: the trigger is taken up anew, nothing is lost.
    airflow.kill("triggerer")
    time.sleep(2)
    airflow.restart("triggerer")
    rest = {m.message_id for m in after_kill}
    got = receive_until(queues, queue, rest, timeout=150)
    _check_once_and_on_time(got, rest)
    # What the page and `airflow delayed-messages history` read, written by the triggerer's pump: one delivered
    # entry per message, with its due time, handed over at or after it; and the dispatcher's route, where the page
    # looks for its dead letters.
    entries = store.delivery_history(destination=queue, limit=1_000).entries
    stored = {m.message_id: m.due_at for m in before_kill + burst + after_kill}
    assert sorted(e.message_id for e in entries) == sorted(stored), len(entries)
    assert all(e.outcome == "delivered" and e.attempts == 1 for e in entries), {e.outcome for e in entries}
    assert all(e.due_at == stored[e.message_id] <= e.handed_at for e in entries)
    assert any(r["transport"] == "sql" for r in store.routes.routes()), store.routes.routes()
    assert airflow.wait_run("delay_continuous_dispatch", run_id, timeout=240) == "success"
    _stop(airflow, "delay_continuous_dispatch")
