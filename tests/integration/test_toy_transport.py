"""The adding-a-transport promise: a broker added by one module (tests/toy/directory_transport.py) and one
registry entry is accepted by every operator and the dispatch trigger, and a provision/send/dispatch DAG delivers
through it exactly as the how-to says."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from tests.toy.directory_transport import DirectoryTransport

DESTINATION = "toy.orders"


@pytest.fixture
def directory(monkeypatch, tmp_path):
    """The one registry entry, and a connection naming the directory the queues live in."""
    from airflow_delay_provider.transports.registry import TRANSPORTS, TransportKind

    monkeypatch.setitem(TRANSPORTS, "directory", TransportKind(
        "directory", "tests.toy.directory_transport:DirectoryTransport",
        "tests.toy.directory_transport:DirectoryHook", "directory_default"))
    root = tmp_path / "queues"
    monkeypatch.setenv("AIRFLOW_CONN_DIRECTORY_DEFAULT",
                       json.dumps({"conn_type": "generic", "extra": {"path": str(root)}}))
    monkeypatch.setenv("AIRFLOW_CONN_DELAY_STORE_DEFAULT", json.dumps(
        {"conn_type": "delay_store", "schema": str(tmp_path / "store.db"), "extra": {"driver": "sqlite"}}))
    return root


def test_a_provision_send_dispatch_dag_delivers_through_a_transport_added_by_one_module(run_dag, directory):
    from airflow.sdk import DAG

    from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator
    from airflow_delay_provider.operators.provision import ProvisionDelayInfrastructureOperator
    from airflow_delay_provider.operators.send import SendDelayedMessageOperator

    messages = [{"body": json.dumps({"n": n}), "delay_seconds": 1 + n % 3} for n in range(30)]
    with DAG("toy_transport", schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:
        provision = ProvisionDelayInfrastructureOperator(task_id="provision", endpoints=[DESTINATION],
                                                         transport="directory")
        send = SendDelayedMessageOperator(task_id="send", destination=DESTINATION, messages=messages,
                                          transport="directory")
        dispatch = DispatchDueMessagesOperator(
            task_id="dispatch", destinations=[DESTINATION], transport="directory", deferrable=True,
            due_before="{{ dag_run.start_date + macros.timedelta(seconds=60) }}", max_runtime=timedelta(minutes=3))
        provision >> send >> dispatch
    state, states, values = run_dag(dag)
    assert state == "success", states
    assert values["provision"]["transport"] == "directory"
    sent = values["send"]
    assert len(sent) == 30 and values["dispatch"]["dispatched"] == 30

    transport = DirectoryTransport(directory)
    received = transport.receive(DESTINATION, max_messages=100)
    assert sorted(m.message_id for m in received) == sorted(sent)  # each once
    assert sorted(json.loads(m.body)["n"] for m in received) == list(range(30))
    assert all(m.enqueued_at >= m.due_at for m in received), "a message went out before its due time"
    assert transport.ack(DESTINATION, [m.receipt for m in received]) == 30
    assert transport.depth(DESTINATION) == {"visible": 0, "in_flight": 0}


def test_an_unregistered_transport_is_refused_with_the_ones_there_are():
    from airflow_delay_provider.core.errors import InvalidInputError
    from airflow_delay_provider.operators.send import SendDelayedMessageOperator

    with pytest.raises(InvalidInputError, match=r"transport 'directory' is not supported; choose one of \['sql'"):
        SendDelayedMessageOperator(task_id="s", destination=DESTINATION, body="x", transport="directory")
