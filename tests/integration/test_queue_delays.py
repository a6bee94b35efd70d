"""A queue-level delay is a property of the destination: set when it is provisioned, applied by every send."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import DelayError, InvalidInputError
from tests.helpers import FakeTI, collect
from tests.integration.test_airflow import _rabbit_conn


def _context(task_id: str) -> dict:
    return {"ti": FakeTI(task_id=task_id)}


@pytest.fixture
def store_conn(monkeypatch, tmp_path, airflow_home) -> str:
    monkeypatch.setenv("AIRFLOW_CONN_STORE_QD", json.dumps(
        {"conn_type": "delay_store", "schema": str(tmp_path / "store.db"), "extra": {"driver": "sqlite"}}))
    return "store_qd"


def test_sql_destinations_keep_their_queue_level_delay_for_every_sender(store_conn):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.delay import ProvisionDelayInfrastructureOperator, SendDelayedMessageOperator

    sql = {"transport": "sql", "delay_store_conn_id": store_conn}
    summary = ProvisionDelayInfrastructureOperator(
        task_id="p", endpoints=["slow", "slower"], endpoint_options={"queue_delay_seconds": 600}, **sql
    ).execute(_context("p"))
    assert summary["queue_delay_seconds"] == 600
    store = DelayStoreHook(store_conn).get_store()
    assert store.queue_delays() == {"slow": 600, "slower": 600}  # not the error queue

    def send(task_id: str, **kwargs):
        SendDelayedMessageOperator(task_id=task_id, message_id=task_id, **sql, **kwargs).execute(_context(task_id))
        return (store.get(task_id).due_at - utcnow()).total_seconds()

    assert 590 < send("plain", destination="slow", body="x") <= 600  # no delay of its own: the queue's
    assert 0 < send("own", destination="slow", body="x", delay_seconds=5) <= 5  # a message-level delay wins
    assert 590 < send("same", destination="slow", body="x", queue_delay_seconds=600) <= 600
    assert 20 < send("elsewhere", destination="other", body="x", queue_delay_seconds=30) <= 30
    # A second sender that believes the queue has another delay is refused, and stores nothing.
    with pytest.raises(DelayError, match=r"queue_delay_seconds=30 disagrees with .* 600 s .*'slow'"):
        send("disagrees", destination="slow", body="x", queue_delay_seconds=30)
    assert store.get("disagrees") is None
    # Provisioning again changes it for messages sent from then on; 0 removes it.
    ProvisionDelayInfrastructureOperator(task_id="p2", endpoints=["slow"], endpoint_options={"queue_delay_seconds": 0},
                                         **sql).execute(_context("p2"))
    assert store.queue_delays() == {"slower": 600}
    assert send("now", destination="slow", body="x") <= 0.5
    assert (store.get("plain").due_at - utcnow()).total_seconds() > 590  # earlier messages keep theirs
    store.close()


@pytest.mark.parametrize(
    ("transport", "options", "match"),
    [
        ("sql", {"unrestricted": True}, r"endpoint_options \['unrestricted'\] .*transport='sql'; allowed: \['queue_"),
        ("rabbitmq", {"queue_delay": 5}, r"endpoint_options \['queue_delay'\] .*allowed: \['queue_delay_seconds'\]"),
        ("sql", {"queue_delay_seconds": 3_700 * 86_400},
         r"endpoint_options.queue_delay_seconds must be in 0..315576000 seconds \(10 years\)"),
        ("sql", {"queue_delay_seconds": "600"}, r"endpoint_options.queue_delay_seconds must be an int"),
        ("sqs", {"queue_delay_seconds": 901}, r"endpoint_options.queue_delay_seconds is 901.* allowed: 0..900"),
    ],
)
def test_bad_endpoint_options_are_refused_when_the_dag_is_parsed(transport, options, match):
    from airflow_delay_provider.operators.delay import ProvisionDelayInfrastructureOperator

    with pytest.raises((InvalidInputError, DelayError), match=match):
        ProvisionDelayInfrastructureOperator(task_id="p", endpoints=["slow"], transport=transport,
                                             endpoint_options=options)


def test_native_rabbitmq_sends_apply_the_destinations_queue_level_delay(store_conn, rabbit_vhost, monkeypatch):
    from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook
    from airflow_delay_provider.operators.delay import ProvisionDelayInfrastructureOperator, SendDelayedMessageOperator

    rabbit = {"transport": "rabbitmq", "transport_conn_id": _rabbit_conn(monkeypatch, rabbit_vhost, "qd"),
              "delay_store_conn_id": store_conn}
    ProvisionDelayInfrastructureOperator(task_id="p", endpoints=["slow", "fast"],
                                         endpoint_options={"queue_delay_seconds": 3}, **rabbit).execute(_context("p"))
    ProvisionDelayInfrastructureOperator(task_id="p2", endpoints=["fast"], endpoint_options={"queue_delay_seconds": 0},
                                         **rabbit).execute(_context("p2"))
    sent_at = utcnow()
    SendDelayedMessageOperator(task_id="s", destination="slow", body="q", **rabbit).execute(_context("s"))
    SendDelayedMessageOperator(task_id="f", destination="fast", body="f", **rabbit).execute(_context("f"))
    transport = RabbitMQDelayHook(rabbit["transport_conn_id"]).get_transport()
    try:
        [(fast_at, _)] = collect(transport, "fast", 1, timeout=10)
        [(slow_at, slow)] = collect(transport, "slow", 1, timeout=15)
    finally:
        transport.close()
    assert slow.body == b"q"
    assert fast_at - sent_at < timedelta(seconds=2)  # no queue-level delay: at once
    assert slow_at - sent_at >= timedelta(seconds=3)  # the broker's levels held it the queue's 3 s


def test_provisioning_checks_every_name_before_it_creates_anything(rabbit_vhost, monkeypatch, store_conn):
    from airflow_delay_provider.core.errors import InvalidNameError
    from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook
    from airflow_delay_provider.operators.delay import ProvisionDelayInfrastructureOperator

    rabbit = {"transport": "rabbitmq", "transport_conn_id": _rabbit_conn(monkeypatch, rabbit_vhost, "pc"),
              "delay_store_conn_id": store_conn}
    with pytest.raises(InvalidNameError, match="amq.x"):
        ProvisionDelayInfrastructureOperator(task_id="p", endpoints=["orders", "amq.x"],
                                             **rabbit).execute(_context("p"))
    transport = RabbitMQDelayHook(rabbit["transport_conn_id"]).get_transport()
    try:
        report = transport.verify(["orders"])
    finally:
        transport.close()
    assert not report["complete"] and "orders" in str(report["missing"])  # not even the first endpoint


def test_a_bad_policy_among_destination_policies_names_its_destination():
    from airflow_delay_provider.core.retry_policy import PolicyError
    from airflow_delay_provider.operators.delay import ProvisionDelayInfrastructureOperator

    with pytest.raises(PolicyError, match=r"destination_policies\['billing'\]: delivery policy is not valid JSON"):
        ProvisionDelayInfrastructureOperator(task_id="p", endpoints=["billing"],
                                             destination_policies={"orders": "http", "billing": "{oops"})
