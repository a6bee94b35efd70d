"""StatsD metrics through Airflow's own Stats, the backlog sensor, provisioning every transport from one
config, and each hook's test_connection, against the real services."""

from __future__ import annotations

import json
import os
import socket

import pytest

from tests.conftest import RABBIT_HOST, RABBIT_PORT
from tests.helpers import messages
from tests.integration.test_example_dags import load


@pytest.fixture
def statsd(monkeypatch):
    """Airflow's StatsD client pointed at a UDP socket of this test; returns a function that reads the
    metrics received so far as {name: [values]}."""
    from airflow.sdk._shared.observability.metrics.base_stats_logger import NoStatsLogger
    from airflow.sdk.observability import stats
    from airflow.sdk.observability.metrics.stats_utils import get_stats_factory

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_ON", "True")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_HOST", "127.0.0.1")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PORT", str(sock.getsockname()[1]))
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PREFIX", "airflow")
    stats.initialize(factory=get_stats_factory(), export_legacy_names=False)
    received: dict[str, list[str]] = {}

    def read() -> dict[str, list[str]]:
        while True:
            try:
                data = sock.recv(65536).decode()
            except TimeoutError:
                return received
            for line in data.splitlines():
                name, value = line.split(":", 1)
                received.setdefault(name, []).append(value)

    yield read
    stats.initialize(factory=NoStatsLogger, export_legacy_names=False)
    sock.close()


def test_send_dispatch_and_backlog_emit_statsd_metrics(statsd, run_dag):
    from airflow.sdk import DAG

    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.delay import DispatchDueMessagesOperator, SendDelayedMessageOperator
    from airflow_delay_provider.sensors.delay_store import DelayBacklogSensor

    DelayStoreHook().get_transport().provision("metrics.q")
    with DAG("test_metrics", schedule=None, catchup=False) as dag:
        send = SendDelayedMessageOperator(task_id="send", messages=[
            {"destination": "metrics.q", "body": f"m{i}", "delay_seconds": 0} for i in range(3)])
        backlog = DelayBacklogSensor(task_id="backlog", threshold=3, comparison="above", destination="metrics.q",
                                     poke_interval=0.2, timeout=10)
        # Its own destination only: the run's default store is shared with other tests.
        dispatch = DispatchDueMessagesOperator(task_id="dispatch", max_messages=3, max_runtime=30,
                                               destinations=["metrics.q"])
        caught_up = DelayBacklogSensor(task_id="caught_up", threshold=0, destination="metrics.q",
                                       poke_interval=0.2, timeout=10)
        send >> backlog >> dispatch >> caught_up
    state, states, values = run_dag(dag)
    assert state == "success", states
    assert values["backlog"] == {"measure": "due", "total": 3, "counts": {"metrics.q": 3}}
    assert values["caught_up"]["total"] == 0
    got = statsd()
    assert got["airflow.delay_provider.sent.metrics_q"] == ["3|c"]
    assert got["airflow.delay_provider.dispatch.metrics_q.dispatched"] == ["3|c"]
    assert "3|g" in got["airflow.delay_provider.store.metrics_q.due"]
    assert "0|g" in got["airflow.delay_provider.store.metrics_q.due"]
    assert "airflow.delay_provider.dispatch.lateness_p50_ms" in got


def test_backlog_sensor_refuses_bad_arguments():
    from airflow_delay_provider.core.errors import InvalidInputError
    from airflow_delay_provider.sensors.delay_store import DelayBacklogSensor

    for bad in ({"threshold": -1}, {"threshold": "many"}, {"threshold": 1, "comparison": "equal"},
                {"threshold": 1, "measure": "visible"}):
        with pytest.raises(InvalidInputError):
            DelayBacklogSensor(task_id="bad", **bad)


def test_provision_all_dag_creates_every_transport_from_one_config(run_dag, rabbit_vhost, aws_conn, sqs_client,
                                                                   monkeypatch):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook

    monkeypatch.setenv("AIRFLOW_CONN_RABBITMQ_DEFAULT", json.dumps({
        "conn_type": "rabbitmq", "host": RABBIT_HOST, "port": RABBIT_PORT, "login": "guest", "password": "guest",
        "schema": rabbit_vhost}))
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", os.environ["AIRFLOW_CONN_AWS_MOTO"])
    state, states, _ = run_dag(load("delay_provision_all"))
    assert state == "success", states
    assert states == dict.fromkeys(["provision_sql", "provision_rabbitmq", "verify_rabbitmq", "provision_sqs"],
                                   "success")
    sql = DelayStoreHook().get_transport()
    assert sql.depth("orders.cancel") == {"visible": 0, "in_flight": 0}
    assert DelayStoreHook().get_store().policies()["billing.retry"]["healthyRetryPolicy"]["numRetries"] == 3
    ok, text = RabbitMQDelayHook().test_connection()
    assert ok and "topology is complete" in text, text
    urls = sqs_client.list_queues()["QueueUrls"]
    assert any(u.endswith("/prod-orders-cancel") for u in urls)
    assert any(u.endswith("/prod-orders-cancel-delay.fifo") for u in urls)


def test_every_hook_tests_its_connection(aws_conn, sqs_client, rabbit_vhost, monkeypatch):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook
    from airflow_delay_provider.hooks.sqs import SqsDelayHook

    sqs_client.create_queue(QueueName="a")
    sqs_client.create_queue(QueueName="a-delay.fifo", Attributes={"FifoQueue": "true"})
    ok, text = SqsDelayHook(aws_conn_id=aws_conn).test_connection()
    assert ok and "2 queue(s), 1 of them -delay.fifo" in text, text

    store = DelayStoreHook(table="tc_store").get_store()
    store.create_schema()
    store.store(messages(2, destination="tc", delay=3600))
    ok, text = DelayStoreHook(table="tc_store").test_connection()
    assert ok and "2 message(s) scheduled" in text, text

    monkeypatch.setenv("AIRFLOW_CONN_RABBIT_TC", json.dumps({
        "conn_type": "rabbitmq", "host": RABBIT_HOST, "port": RABBIT_PORT, "login": "guest", "password": "wrong-pw",
        "schema": rabbit_vhost}))
    ok, text = RabbitMQDelayHook("rabbit_tc").test_connection()
    assert not ok and "wrong-pw" not in text
    monkeypatch.setenv("AIRFLOW_CONN_PG_TC", json.dumps({
        "conn_type": "delay_store", "host": "127.0.0.1", "port": 1, "login": "u", "password": "secret-pw",
        "schema": "test"}))
    ok, text = DelayStoreHook("pg_tc").test_connection()
    assert not ok and "secret-pw" not in text and "not reachable" in text, text
