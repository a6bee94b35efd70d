"""The example DAGs: they import cleanly with docs, the trigger form refuses bad input, and the order timeout works."""

from __future__ import annotations

import copy
import importlib.util

import pytest

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


def test_every_example_dag_imports_with_docs(airflow_home):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert bag.import_errors == {}
    assert {"demo_delayed_delivery", "delay_manual_send", "delay_scheduled_sweep", "delay_sqs_relay",
            "delay_order_timeout", "delay_provision_all", "spark_bulk_sweep"} <= set(bag.dag_ids)
    assert all(bag.get_dag(d).doc_md for d in bag.dag_ids)
    sweep = bag.get_dag("delay_scheduled_sweep")
    assert sweep.catchup and sweep.get_task("dispatch").due_before == "{{ data_interval_end }}"
    spark = bag.get_dag("spark_bulk_sweep").get_task("sweep")
    assert bag.get_dag("spark_bulk_sweep").catchup
    assert (spark.due_from, spark.due_before) == ("{{ data_interval_start }}", "{{ data_interval_end }}")


@pytest.mark.parametrize(("conf", "field"), [
    ({"delay_seconds": 604801}, "delay_seconds"),
    ({"delay_seconds": -1}, "delay_seconds"),
    ({"transport": "kafka"}, "transport"),
    ({"destination": "has space"}, "destination"),
    ({"destination": ""}, "destination"),
    ({"deliver_at": "tomorrow"}, "deliver_at"),
    ({"retry_policy": "forever"}, "retry_policy"),
])
def test_manual_send_form_refuses_bad_values(airflow_home, conf, field):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match=field):
        form(conf)


def test_manual_send_form_accepts_good_values(airflow_home):
    values = form({"transport": "rabbitmq", "destination": "orders.cancel", "delay_seconds": 30,
                   "deliver_at": "2026-12-24T18:00:00+00:00"})
    assert values["transport"] == "rabbitmq" and values["delay_seconds"] == 30


@pytest.mark.parametrize(("pay", "check", "status"), [(False, "cancelled", "cancelled"), (True, "left alone", "paid")])
def test_order_timeout_cancels_only_unpaid_orders(run_dag, pay, check, status):
    state, states, values = run_dag(load("delay_order_timeout"), {"timeout_seconds": 2, "pay": pay})
    assert state == "success", states
    result = values["cancel_if_unpaid"]
    assert (result["check"], result["status"]) == (check, status)
    assert values["dispatch"]["dispatched"] >= 1


def test_manual_send_renders_the_transport_from_the_form(run_dag):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    state, states, values = run_dag(load("delay_manual_send"), {"transport": "sql", "destination": "manual.q",
                                                                 "delay_seconds": 300, "retry_policy": "smtp"})
    assert state == "success", states
    store = DelayStoreHook().get_store()
    stored = store.get(values["send"])
    assert stored is not None and stored.destination == "manual.q" and stored.body == b'{"order": 1}'
    assert store.policies()["manual.q"]["healthyRetryPolicy"]["numRetries"] == 50  # seed 003's smtp policy
