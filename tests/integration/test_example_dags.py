"""The example DAGs: they import cleanly with docs, the trigger form refuses bad input, and the order timeout works."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from airflow_delay_provider.compat import shared_stream
from tests.conftest import ROOT


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dags" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


def form(conf: dict) -> dict:
    """What the trigger form does with the values typed in: the DAG's params, updated, validated."""
    params = copy.deepcopy(load("delay_manual_send").params)
    for key, value in conf.items():
        params[key] = value
    return params.validate()


EXAMPLE_DAGS = {"demo_delayed_delivery", "delay_manual_send", "delay_scheduled_sweep", "delay_continuous_dispatch",
                "delay_sqs_relay", "delay_order_timeout", "delay_provision_all", "spark_bulk_sweep",
                "delay_dag_run_scheduler", "delay_dag_run_target", "delay_message_queue_target"}


# Delayed DAG runs: Airflow 3.3.
NEEDS_SHARED_STREAMS = {"delay_dag_run_scheduler", "delay_dag_run_target", "delay_message_queue_target"}


def _bag():
    """The example DAGs; on an Airflow without shared streams (3.2) the delayed DAG runs' two fail to import,
    each saying which Airflow it needs, and the others import."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    if shared_stream:
        assert bag.import_errors == {}
    else:
        assert {Path(f).stem for f in bag.import_errors} == NEEDS_SHARED_STREAMS
        assert all("needs Airflow 3.3 or later" in error for error in bag.import_errors.values())
    return bag


def test_every_example_dag_imports_with_docs_and_no_unbounded_catchup(airflow_home):
    from airflow.sdk import DeltaDataIntervalTimetable

    bag = _bag()
    assert set(bag.dag_ids) >= (EXAMPLE_DAGS if shared_stream else EXAMPLE_DAGS - NEEDS_SHARED_STREAMS)
    assert all(bag.get_dag(d).doc_md for d in bag.dag_ids)
    # Unpausing an example never starts a catch-up from its start date: backfills are asked for.
    assert not any(bag.get_dag(d).catchup for d in bag.dag_ids)
    for dag_id, task_id in (("delay_scheduled_sweep", "dispatch"), ("spark_bulk_sweep", "sweep")):
        dag = bag.get_dag(dag_id)
        # A real window per run (3.3's timedelta schedules give runs with start == end).
        assert isinstance(dag.timetable, DeltaDataIntervalTimetable)
        task = dag.get_task(task_id)
        assert "data_interval_start" in task.due_from and "data_interval_end" in task.due_before
    continuous = bag.get_dag("delay_continuous_dispatch")
    dispatch = continuous.get_task("dispatch")
    # Each run dispatches longer than the interval: the next is up before it stops.
    assert dispatch.deferrable and continuous.params["dispatch_seconds"] > continuous.timetable.delta.total_seconds()
    assert continuous.max_active_runs >= 2


def test_every_connection_the_example_dags_name_is_defined_in_compose(airflow_home):
    import yaml

    from airflow_delay_provider.operators.delay import DelayOperatorBase
    from airflow_delay_provider.operators.sweep import BulkSweepOperator

    defaults = {"sql": None, "rabbitmq": "rabbitmq_default", "sqs": "aws_default"}
    named = set()
    for dag in _bag().dags.values():
        for task in dag.tasks:
            if isinstance(task, DelayOperatorBase):
                named.add(task.delay_store_conn_id)
                transports = [task.transport] if task.transport in defaults else list(defaults)  # a templated one
                named.update(task.transport_conn_id or defaults[t] for t in transports)
            if isinstance(task, BulkSweepOperator):
                named.add(task._conn_id)
    named.discard(None)
    compose = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
    defined = {k[len("AIRFLOW_CONN_"):].lower() for k in compose["x-airflow"]["environment"]
               if k.startswith("AIRFLOW_CONN_")}
    assert "delay_store_default" in named
    assert named <= defined, f"named by the example DAGs but not defined in docker-compose.yaml: {named - defined}"


@pytest.mark.parametrize(("conf", "field"), [
    ({"delay_seconds": 315576001}, "delay_seconds"),  # ten years; the connection's limit is checked at run time
    ({"on_duplicate": "overwrite"}, "on_duplicate"),
    ({"message_id": ""}, "message_id"),
    ({"delay_seconds": -1}, "delay_seconds"),
    ({"transport": "kafka"}, "transport"),
    ({"destination": "has space"}, "destination"),
    ({"destination": ""}, "destination"),
    ({"deliver_at": "tomorrow"}, "deliver_at"),
    ({"deliver_at": "2026-12-24T18:00:00"}, "deliver_at"),  # no timezone
    ({"retry_policy": "forever"}, "retry_policy"),
    ({"retry_policy": "[1, 2]"}, "retry_policy"),
])
def test_manual_send_form_refuses_bad_values(airflow_home, conf, field):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match=field):
        form(conf)


def test_manual_send_form_accepts_good_values(airflow_home):
    values = form({"transport": "rabbitmq", "destination": "orders.cancel", "delay_seconds": 30,
                   "deliver_at": "2026-12-24T18:00:00+00:00"})
    assert values["transport"] == "rabbitmq" and values["delay_seconds"] == 30
    # What the form's date picker sends, and a custom policy as JSON beside the built-ins' names.
    policy = '{"healthyRetryPolicy": {"numRetries": 5, "minDelayTarget": 10, "maxDelayTarget": 300}}'
    values = form({"deliver_at": "2026-12-24T18:00:00.000Z", "retry_policy": policy})
    assert values["retry_policy"] == policy
    assert form({"retry_policy": "mobile-push"})["retry_policy"] == "mobile-push"


@pytest.mark.parametrize("value", ["tomorrow", "2026-12-24", "2026-12-24T18:00:00", "2026-13-01T00:00:00Z"])
def test_manual_send_form_refuses_a_deliver_at_without_a_format_checker(airflow_home, value):
    """Airflow checks `format: date-time` only where rfc3339-validator is installed (it is here, through the test
    tools, but not in a plain install): the schema's pattern alone must refuse what is not a date-time."""
    import jsonschema

    schema = load("delay_manual_send").params.get_param("deliver_at").schema
    jsonschema.validate("2026-12-24T18:00:00.000Z", schema)  # no format_checker: as an install without it
    jsonschema.validate("2026-12-24 18:00+01:00", schema)
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        jsonschema.validate(value, schema)


def test_order_timeout_cancels_an_unpaid_order_when_the_check_arrives(run_dag):
    state, states, values = run_dag(load("delay_order_timeout"), {"timeout_seconds": 2, "pay": False})
    assert state == "success", states
    assert (values["cancel_if_unpaid"]["check"], values["cancel_if_unpaid"]["status"]) == ("cancelled", "cancelled")
    assert values["dispatch"]["dispatched"] >= 1
    assert states["pay_order"] == states["cancel_check"] == "skipped"


def test_order_timeout_takes_the_check_back_when_the_order_is_paid(run_dag):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    state, states, values = run_dag(load("delay_order_timeout"), {"timeout_seconds": 60, "pay": True})
    assert state == "success", states
    check_id = values["schedule_check"]
    assert values["cancel_check"]["cancelled"] == [check_id]
    assert states["dispatch"] == states["cancel_if_unpaid"] == "skipped"
    store = DelayStoreHook().get_store()
    assert store.get(check_id) is None  # never to be delivered: nothing left to dispatch


def test_manual_send_refuses_unknown_conf_keys_and_stores_nothing(run_dag):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    store = DelayStoreHook().get_store()
    store.create_schema()
    before = store.count_scheduled()
    state, states, _ = run_dag(load("delay_manual_send"), {"destination": "typo.q", "delay": 5})
    assert state == "failed" and states["send"] == "failed"
    assert store.count_scheduled() == before


def test_manual_send_renders_the_transport_from_the_form(run_dag):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    state, states, values = run_dag(load("delay_manual_send"), {"transport": "sql", "destination": "manual.q",
                                                                 "delay_seconds": 300, "retry_policy": "smtp"})
    assert state == "success", states
    store = DelayStoreHook().get_store()
    stored = store.get(values["send"])
    assert stored is not None and stored.destination == "manual.q" and stored.body == b'{"order": 1}'
    assert store.policies()["manual.q"]["healthyRetryPolicy"]["numRetries"] == 50  # SNS's built-in smtp policy


def test_manual_send_stores_a_custom_policy_given_as_json_and_refuses_a_bad_one(run_dag):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    policy = '{"healthyRetryPolicy": {"numRetries": 7, "minDelayTarget": 5, "maxDelayTarget": 120}}'
    state, states, values = run_dag(load("delay_manual_send"), {"destination": "manual.custom", "retry_policy": policy})
    assert state == "success", states
    store = DelayStoreHook().get_store()
    stored = store.policies()["manual.custom"]["healthyRetryPolicy"]
    assert (stored["numRetries"], stored["minDelayTarget"], stored["maxDelayTarget"]) == (7, 5, 120)
    before = store.count_scheduled()
    bad = '{"healthyRetryPolicy": {"numRetries": 500}}'  # a JSON object, so the form lets it through
    state, states, _ = run_dag(load("delay_manual_send"), {"destination": "manual.bad", "retry_policy": bad})
    assert state == "failed" and states["send"] == "failed"
    assert store.count_scheduled() == before and "manual.bad" not in store.policies()
