"""Every example DAG as a first-time user meets it: a real deployment (tests/deployment/rig.py) over the repository's
dags folder with the store connection only (no RabbitMQ, AWS or Spark connection, no AWS region), every DAG
unpaused, the manual ones triggered through the REST API with their forms' defaults (test_delivery then adds
the other connections to the same deployment, which this module's tests run first on). Each run succeeds; the tasks
of a broker without its connection are skipped, their logs saying which connection to define and how; nothing
fails. The components run without rfc3339-validator, as a plain install does (Airflow checks `format: date-time`
only with it), so the trigger form's refusal of a `deliver_at` that is not a date-time is the schema's own."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest

from tests.deployment.rig import RestError, utcnow, wait_for

#: DAG -> the conf of its manual run (a scheduled DAG's first run is the one unpausing starts).
MANUAL = {
    "demo_delayed_delivery": {},
    "delay_manual_send": {},
    "delay_order_timeout": {},
    "delay_provision_all": {},
    # A run of the target in 3 s rather than the form's 30 minutes: the target's own run is waited for too.
    "delay_dag_run_scheduler": {"delay_seconds": 3},
    # Its scheduled runs dispatch for 11 minutes each, by design: a manual run for 10 s ends.
    "delay_continuous_dispatch": {"dispatch_seconds": 10},
}
SCHEDULED = ("delay_scheduled_sweep", "delay_sqs_relay", "spark_bulk_sweep")
TARGET = "delay_dag_run_target"
#: Tasks skipped without their service's connection -> what their log says.
SKIPPED = {
    ("delay_provision_all", "provision_rabbitmq"): ["RabbitMQ is not set up (no connection 'rabbitmq_default')",
                                                    "AIRFLOW_CONN_RABBITMQ_DEFAULT="],
    ("delay_provision_all", "provision_sqs"): ["Amazon SQS is not set up (no connection 'aws_default', and no AWS "
                                               "region in the environment)", "AIRFLOW_CONN_AWS_DEFAULT="],
    ("delay_provision_all", "verify_rabbitmq"): [],  # its upstream was skipped
    ("delay_sqs_relay", "provision"): ["Amazon SQS is not set up", "AIRFLOW_CONN_AWS_DEFAULT="],
    ("delay_sqs_relay", "relay_orders"): [],
}


@pytest.fixture(scope="module")
def airflow(examples_deployment):
    """The deployment this module shares with test_delivery (tests/deployment/conftest.py), which runs after it."""
    return examples_deployment[0]


@pytest.fixture(scope="module")
def fresh_store(examples_deployment):
    """The deployment's store: tables of its own, created as a deployment's init or `make demo` does."""
    return examples_deployment[1]


def _log(airflow, dag_id: str, run_id: str, task_id: str) -> str:
    """The task's log with every field of each line (a skip's reason is a field of its own)."""
    path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/1"
    body = airflow.api("GET", path, params={"full_content": "true"}, headers={"Accept": "application/json"})
    content = body.get("content")
    entries = content if isinstance(content, list) else [content]
    return "\n".join(" ".join(str(v) for v in e.values()) if isinstance(e, dict) else str(e) for e in entries)


def _scheduled_run(airflow, dag_id: str) -> str:
    runs = wait_for(lambda: [r for r in airflow.dag_runs(dag_id) if r["run_type"] == "scheduled"], 120,
                    f"the run unpausing {dag_id} starts")
    return runs[0]["dag_run_id"]


def test_every_example_dag_succeeds_with_only_the_store_connection(airflow):
    started = time.monotonic()
    dag_ids = {d["dag_id"] for d in airflow.dags()}
    assert dag_ids >= {*MANUAL, *SCHEDULED, TARGET}, dag_ids
    assert airflow.import_errors() == []
    # As a user does: unpause everything, trigger the manual ones. The target's asset watcher starts at the file's
    # next parse: a run scheduled before waits in the store until then.
    airflow.unpause(TARGET)
    runs = {}
    for dag_id, conf in MANUAL.items():
        airflow.unpause(dag_id)
        runs[dag_id] = airflow.trigger(dag_id, conf)
    for dag_id in SCHEDULED:
        airflow.unpause(dag_id)
        runs[dag_id] = _scheduled_run(airflow, dag_id)
    states = {dag_id: airflow.wait_run(dag_id, run_id, timeout=420) for dag_id, run_id in runs.items()}
    print(f"\n[first run] {len(runs)} runs finished {time.monotonic() - started:.0f} s after the first unpause")
    tasks = {dag_id: airflow.task_states(dag_id, run_id) for dag_id, run_id in runs.items()}
    assert states == dict.fromkeys(runs, "success"), (
        f"runs not successful: {({d: tasks[d] for d, s in states.items() if s != 'success'})}\n{airflow.logs_tail()}")
    # Nothing failed on the way (a retried task would end in success), and only the brokers' tasks were skipped.
    tries = {(d, ti["task_id"]): ti["try_number"] for d, r in runs.items() for ti in airflow.task_instances(d, r)}
    assert {k for k, n in tries.items() if n > 1} == set(), tries
    skipped = {(d, t) for d, states_ in tasks.items() for t, s in states_.items() if s == "skipped"}
    branches = {("delay_order_timeout", "pay_order"), ("delay_order_timeout", "cancel_check"),  # not paid
                ("delay_dag_run_scheduler", "cancel_timeout")}
    assert skipped - branches == set(SKIPPED), skipped
    for (dag_id, task_id), says in SKIPPED.items():
        if says:
            log = _log(airflow, dag_id, runs[dag_id], task_id)
            assert all(s in log for s in says), log[-3000:]
    assert tasks["delay_provision_all"]["provision_sql"] == "success"
    assert tasks["spark_bulk_sweep"]["sweep"] == "success"  # no connection: a local Spark on this worker
    demo = airflow.xcom("demo_delayed_delivery", runs["demo_delayed_delivery"], "verify")
    assert demo["delivered"] == demo["sent"] == 200 and demo["duplicates"] == demo["early"] == 0, demo
    assert airflow.xcom("delay_order_timeout", runs["delay_order_timeout"], "cancel_if_unpaid")["status"] == "cancelled"
    # The delayed run scheduled 3 s ahead started the target, which succeeded.
    target = wait_for(lambda: [r for r in airflow.dag_runs(TARGET, run_type="asset_triggered")
                               if r["state"] in ("success", "failed")], 120, "the target's delayed run to finish")
    assert [r["state"] for r in target] == ["success"], target
    # The continuous dispatcher's scheduled run dispatches in the triggerer for its eleven minutes.
    continuous = _scheduled_run(airflow, "delay_continuous_dispatch")
    airflow.wait_task("delay_continuous_dispatch", continuous, "dispatch", states=("deferred",), timeout=120)
    for dag_id in (*MANUAL, *SCHEDULED, TARGET):
        airflow.pause(dag_id)


def test_the_manual_send_form_refuses_a_deliver_at_that_is_not_a_date_time_and_takes_a_json_policy(airflow,
                                                                                                   fresh_store):
    airflow.unpause("delay_manual_send")
    runs_before = len(airflow.dag_runs("delay_manual_send"))
    for bad in ("tomorrow", "2026-12-24T18:00:00"):  # no timezone
        with pytest.raises(RestError) as refused:
            airflow.trigger("delay_manual_send", {"deliver_at": bad})
        assert refused.value.status == 400 and "deliver_at" in refused.value.body, refused.value
    with pytest.raises(RestError, match="retry_policy"):
        airflow.trigger("delay_manual_send", {"retry_policy": "forever"})
    assert len(airflow.dag_runs("delay_manual_send")) == runs_before  # refused before any run existed
    policy = {"healthyRetryPolicy": {"numRetries": 4, "minDelayTarget": 2, "maxDelayTarget": 60}}
    due = (utcnow() + timedelta(days=1)).replace(microsecond=0)
    # As the form's date picker sends it (toISOString: milliseconds and Z).
    conf = {"destination": "first.custom", "deliver_at": due.strftime("%Y-%m-%dT%H:%M:%S.000Z"),
            "retry_policy": json.dumps(policy)}
    run_id = airflow.trigger("delay_manual_send", conf)
    assert airflow.wait_run("delay_manual_send", run_id, timeout=180) == "success", airflow.task_states(
        "delay_manual_send", run_id)
    stored = fresh_store.policies()["first.custom"]["healthyRetryPolicy"]
    assert {k: stored[k] for k in policy["healthyRetryPolicy"]} == policy["healthyRetryPolicy"]
    message = fresh_store.get(airflow.xcom("delay_manual_send", run_id, "send"))
    # Due then: whole seconds from the store's clock, rounded up (never early).
    assert message.destination == "first.custom" and due <= message.due_at < due + timedelta(seconds=1), message
    airflow.pause("delay_manual_send")
