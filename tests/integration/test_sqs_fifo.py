"""FIFO destinations on SQS against moto's server: provisioning, group and deduplication ids, delays kept
by the relay, order within a group, and delay queues that never collide with another endpoint's queues."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidNameError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.transports.sqs import SqsTransport, delay_queue_name
from tests.integration.test_sqs import wait_for

FOURTEEN_DAYS = "1209600"


def attributes(sqs_client, queue: str) -> dict:
    url = sqs_client.get_queue_url(QueueName=queue)["QueueUrl"]
    return sqs_client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]


def receive_raw(sqs_client, queue: str, n: int, timeout: float = 10) -> list[dict]:
    """SQS's own view of `n` messages, in the order received (each batch deleted before the next receive,
    as a FIFO group holds back its later messages while earlier ones are in flight)."""
    url = sqs_client.get_queue_url(QueueName=queue)["QueueUrl"]
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        batch = sqs_client.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                                           AttributeNames=["All"], MessageAttributeNames=["All"]).get("Messages", [])
        got += batch
        for m in batch:
            sqs_client.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    return got


def existing_fifo_queue(sqs_client, name: str) -> None:
    """A FIFO queue made before the provider looked at it (as SQS allows a `.fifo` name: FifoQueue set)."""
    sqs_client.create_queue(QueueName=name, Attributes={"FifoQueue": "true"})


def message_id(m: dict) -> str:
    return m["MessageAttributes"]["x-message-id"]["StringValue"]


def relay_until_arrived(t: SqsTransport, endpoint: str, n: int, timeout: float = 20) -> tuple[list, int]:
    """Run the relay until `n` messages arrived at the endpoint; (arrival time, message) for each, and how
    many the relay handed over."""
    got, handed, deadline = [], 0, time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        handed += t.relay_once(endpoint, wait_time_seconds=1).handed_over
        got += wait_for(t, endpoint, n - len(got), 0.2)
    return got, handed


# -- provisioning --------------------------------------------------------------------------------------
def test_a_fifo_endpoint_is_provisioned_as_a_fifo_queue_with_a_standard_delay_queue(sqs_client):
    t = SqsTransport(sqs_client, queue_delay=900)
    summary = t.provision("orders.fifo", queue_delay_seconds=60)
    assert summary["queue"] == "orders.fifo" and summary["delay_queue"] == "orders-fifo-delay"
    queue = attributes(sqs_client, "orders.fifo")
    assert queue["FifoQueue"] == "true"
    # SQS would add a queue-level delay to every message, a due one too: the provider keeps it instead.
    assert queue["DelaySeconds"] == "0"
    delay_queue = attributes(sqs_client, "orders-fifo-delay")
    assert "FifoQueue" not in delay_queue and delay_queue["MessageRetentionPeriod"] == FOURTEEN_DAYS
    assert t.check_delay_queue("orders.fifo")["ok"] and t.verify(["orders.fifo"])["complete"]
    t.provision("orders.fifo")  # idempotent


# -- sending -------------------------------------------------------------------------------------------
def test_due_messages_reach_an_existing_fifo_queue_in_order_with_their_group_and_deduplication_ids(sqs_client):
    existing_fifo_queue(sqs_client, "orders.fifo")
    t = SqsTransport(sqs_client, queue_delay=900)
    now = utcnow()
    sent = [DelayedMessage("orders.fifo", f"b{i}".encode(), now, {}, f"m-{i}") for i in range(3)]
    sent.append(DelayedMessage("orders.fifo", b"vip", now, {"x-message-group-id": "vip-7"}, "m-vip"))
    assert t.send(sent) == {}
    got = receive_raw(sqs_client, "orders.fifo", 4)
    assert [message_id(m) for m in got if m["Attributes"]["MessageGroupId"] == "default"] == ["m-0", "m-1", "m-2"]
    assert {message_id(m): m["Attributes"]["MessageGroupId"] for m in got}["m-vip"] == "vip-7"
    assert all(m["Attributes"]["MessageDeduplicationId"] == message_id(m) for m in got)


def test_a_message_group_id_sqs_refuses_is_that_messages_error(sqs_client):
    t = SqsTransport(sqs_client, queue_delay=900)
    t.provision("orders.fifo")
    now = utcnow()
    failures = t.send([DelayedMessage("orders.fifo", b"x", now, {"x-message-group-id": "no spaces"}, "bad-group"),
                       DelayedMessage("orders.fifo", b"y", now, {}, "good")])
    assert list(failures) == ["bad-group"]
    assert "x-message-group-id" in str(failures["bad-group"]) and "128" in str(failures["bad-group"])
    assert [message_id(m) for m in receive_raw(sqs_client, "orders.fifo", 1)] == ["good"]


@pytest.mark.parametrize(("q", "delay"), [(10, 2), (2, 5)], ids=["under-Q", "over-Q"])
def test_a_delay_to_a_fifo_destination_is_kept_by_the_relay_and_ends_on_time(sqs_client, q, delay):
    existing_fifo_queue(sqs_client, "orders.fifo")
    t = SqsTransport(sqs_client, queue_delay=q)
    t.provision("orders.fifo")
    due = utcnow() + timedelta(seconds=delay)
    assert t.send([DelayedMessage("orders.fifo", b"later", due, {"k": "v"}, "d-1")]) == {}
    assert t.receive("orders.fifo") == []  # a FIFO queue takes no per-message delay: the relay keeps it
    assert sum(t.lifecycle("orders.fifo", delay_queue=True).values()) == 1
    got, handed = relay_until_arrived(t, "orders.fifo", 1)
    [(arrived, m)] = got
    assert (m.message_id, m.body, m.headers) == ("d-1", b"later", {"k": "v"})
    assert arrived >= due  # never early
    assert arrived < due + timedelta(seconds=5)  # and not a whole Q late
    assert handed == 1


def test_a_burst_of_one_group_dispatched_by_the_pump_arrives_in_order(sqs_client, tmp_path):
    from airflow_delay_provider.core.pump import Pump, PumpConfig
    from tests.helpers import make_store

    existing_fifo_queue(sqs_client, "orders.fifo")
    t = SqsTransport(sqs_client, queue_delay=900)
    t.provision("error")
    store = make_store(f"sqlite:///{tmp_path / 's.db'}", None, "delayed")
    due = utcnow()
    # Two groups interleaved, all due at one instant; small first batches, so the burst spans several sends.
    burst = [DelayedMessage("orders.fifo", f"b{i}".encode(), due, {"x-message-group-id": f"g{i % 2}"}, f"m-{i:02}")
             for i in range(40)]
    store.store(burst)
    config = PumpConfig(first_batch_size=4, batch_size=16, time_to_trigger_dispatch_circuit_breaker=3)
    assert Pump(store, t, config).run(stop_when_idle=True).stats.dispatched == 40
    got = [m for _, m in wait_for(t, "orders.fifo", 40, 20)]
    for group in ("g0", "g1"):
        expected = [m.message_id for m in burst if m.headers["x-message-group-id"] == group]
        assert [m.message_id for m in got if m.headers["x-message-group-id"] == group] == expected


def test_the_send_operator_takes_a_message_group_id(run_dag, aws_conn, sqs_client, monkeypatch, tmp_path):
    from datetime import datetime

    from airflow.sdk import DAG

    from airflow_delay_provider.operators.delay import SendDelayedMessageOperator

    monkeypatch.setenv("AIRFLOW_CONN_STORE_FIFO", json.dumps(
        {"conn_type": "delay_store", "schema": str(tmp_path / "store.db"), "extra": {"driver": "sqlite"}}))
    SqsTransport(sqs_client).provision("orders.fifo")
    with DAG("t_sqs_fifo", schedule=None, start_date=datetime(2026, 1, 1)) as dag:
        SendDelayedMessageOperator(
            task_id="send", transport="sqs", transport_conn_id=aws_conn, delay_store_conn_id="store_fifo",
            destination="orders.fifo", message_group_id="customer-42",
            messages=[{"body": "a", "message_id": "a"}, {"body": "b", "message_id": "b"},
                      {"body": "c", "message_id": "c", "headers": {"x-message-group-id": "vip"}}])
    state, states, _ = run_dag(dag)
    assert state == "success", states
    got = receive_raw(sqs_client, "orders.fifo", 3)
    assert {message_id(m): m["Attributes"]["MessageGroupId"] for m in got} == {
        "a": "customer-42", "b": "customer-42", "c": "vip"}
    assert [message_id(m) for m in got if m["Attributes"]["MessageGroupId"] == "customer-42"] == ["a", "b"]


# -- delay queues of their own ---------------------------------------------------------------------------
def test_endpoints_x_fifo_and_x_dash_fifo_each_have_their_own_delay_queue(sqs_client):
    t = SqsTransport(sqs_client, queue_delay=1)
    t.provision("x.fifo")
    t.provision("x-fifo")
    due = utcnow() + timedelta(seconds=2)
    assert t.send([DelayedMessage("x.fifo", b"dot", due, {}, "to-dot"),
                   DelayedMessage("x-fifo", b"dash", due, {}, "to-dash")]) == {}
    dash, handed_dash = relay_until_arrived(t, "x-fifo", 1)
    dot, handed_dot = relay_until_arrived(t, "x.fifo", 1)
    assert [m.message_id for _, m in dash] == ["to-dash"] and handed_dash == 1
    assert [m.message_id for _, m in dot] == ["to-dot"] and handed_dot == 1
    assert (delay_queue_name("x.fifo"), delay_queue_name("x-fifo")) == ("x-fifo-delay", "x-fifo-delay.fifo")


@pytest.mark.parametrize("prefix", ["", "dev-"])
@pytest.mark.parametrize("endpoint", ["orders-delay.fifo", "orders-fifo-delay"])
def test_an_endpoint_named_like_a_delay_queue_is_refused(sqs_client, prefix, endpoint):
    t = SqsTransport(sqs_client, prefix=prefix)
    with pytest.raises(InvalidNameError, match=r"reserved for delay queues.*'-delay\.fifo'.*'-fifo-delay'"):
        t.provision(endpoint)
    assert sqs_client.list_queues().get("QueueUrls", []) == []
