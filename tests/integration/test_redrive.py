"""Dead letters on every transport against the real services: SQL queues (SQLite, PostgreSQL), RabbitMQ
and SQS (moto). The pump dead-letters messages (an unknown destination, a destination that keeps
refusing), they are listed without being consumed, redriven by destination, by id and all, and the pump
then delivers each exactly once with its redrive count; and the operator, run in a DAG."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from datetime import datetime, timedelta

import pika
import pytest

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.message import HEADER_FAILED_DESTINATION, DelayedMessage
from airflow_delay_provider.core.ports import Transport
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.core.redrive import (
    FAILURE_HEADERS,
    HEADER_REDRIVEN,
    delete_dead_letters,
    list_dead_letters,
    redrive,
)
from tests.helpers import collect, make_store, make_transport

ORDERS = [f"o-{i}" for i in range(3)]  # refused by their destination twice: attempts 2
NOWHERE = [f"n-{i}" for i in range(4)]  # for a destination not provisioned yet: attempts 1


class Refusing(Transport):
    """A real transport whose sends to `orders` fail (a delivery failure, not an outage)."""

    def __init__(self, inner: Transport) -> None:
        self.inner, self.name = inner, inner.name

    def provision(self, endpoint):
        return self.inner.provision(endpoint)

    def send(self, messages, connection=None):
        refused = {m.message_id: RuntimeError("503 from orders") for m in messages if m.destination == "orders"}
        sent = self.inner.send([m for m in messages if m.message_id not in refused], connection=connection)
        return {**refused, **sent}

    def receive(self, endpoint, max_messages=10, visibility_timeout=30.0):
        return self.inner.receive(endpoint, max_messages, visibility_timeout)

    def ack(self, endpoint, receipts):
        return self.inner.ack(endpoint, receipts)

    def depth(self, endpoint):
        return self.inner.depth(endpoint)

    def joins(self, store):
        return self.inner.joins(store)


@pytest.fixture(params=["sql-sqlite", "sql-postgres", "rabbitmq", "sqs"])
def setup(request, tmp_path):
    """(store, transport) on each transport; the SQL queues live in the store's own database."""
    kind = request.param
    if kind.startswith("sql"):
        where = (f"sqlite:///{tmp_path / 'store.db'}", None, f"t_{uuid.uuid4().hex[:10]}") if kind == "sql-sqlite" \
            else request.getfixturevalue("pg")
        return make_store(*where), make_transport(*where)
    store = make_store(f"sqlite:///{tmp_path / 'store.db'}", None, "delayed")
    if kind == "rabbitmq":
        return store, request.getfixturevalue("rabbit")
    from airflow_delay_provider.transports.sqs import SqsTransport

    return store, SqsTransport(request.getfixturevalue("sqs_client"), prefix=f"r{uuid.uuid4().hex[:6]}-")


def dead_letter_some(store, transport) -> None:
    """Seven dead letters in `error`, written by the pump."""
    for queue in ("orders", "error"):
        transport.provision(queue)
    past = utcnow() - timedelta(seconds=1)
    store.store([DelayedMessage("orders", f"body {m}".encode(), past, {"k": m}, m) for m in ORDERS]
                + [DelayedMessage("nowhere", f"body {m}".encode(), past, {"k": m}, m) for m in NOWHERE])
    pump = Pump(store, Refusing(transport), PumpConfig(number_of_retries=1, retry_jitter=0), sleep=lambda _: None)
    assert pump.run(stop_when_idle=True).stats.dead_lettered == 7
    assert visible(transport, "error", 7) == 7 and store.count_scheduled() == {}


def visible(transport, queue: str, expected: int, timeout: float = 10.0) -> int:
    """The queue's visible count once it is `expected` (or after `timeout`): a broker applies a nack or a
    publish a moment after the call returns."""
    deadline = time.monotonic() + timeout
    while (depth := transport.depth(queue)["visible"]) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return depth


def poison_depth(transport) -> int:
    return transport.depth(transport.names.poison)["visible"] if transport.name == "rabbitmq" else 0


def test_dead_letters_are_listed_redriven_and_delivered_once(setup):
    store, transport = setup
    dead_letter_some(store, transport)
    if transport.can_peek:
        listing = list_dead_letters(transport, "error")
        assert listing["count"] == 7 and not listing["more"]
        by_id = {d["message_id"]: d for d in listing["dead_letters"]}
        assert {by_id[m]["attempts"] for m in ORDERS} == {2} and {by_id[m]["attempts"] for m in NOWHERE} == {1}
        assert by_id["o-0"]["destination"] == "orders" and "503 from orders" in by_id["o-0"]["last_error"]
        assert by_id["o-0"]["first_failed_at"] < by_id["o-0"]["last_failed_at"]
        assert by_id["n-1"]["body"] == "body n-1" and by_id["n-1"]["headers"]["k"] == "n-1"
        assert by_id["n-1"]["headers"][HEADER_FAILED_DESTINATION] == "nowhere"
        by_ids = list_dead_letters(transport, "error", message_ids=["n-2", "o-1"])
        assert sorted(d["message_id"] for d in by_ids["dead_letters"]) == ["n-2", "o-1"]
        # Looking consumed nothing: all still visible, none received meanwhile, listed again the same.
        assert visible(transport, "error", 7) == 7
        assert sorted(d["message_id"] for d in list_dead_letters(transport, "error")["dead_letters"]) == sorted(by_id)
        if transport.name == "sql":
            assert {m.receive_count for m in transport.peek("error", 100)} == {0}
    else:  # RabbitMQ: it refuses, and says why (see test_rabbitmq_counts_every_return_so_peek_refuses)
        with pytest.raises(NotImplementedError, match="x-delivery-limit"):
            list_dead_letters(transport, "error")
        assert visible(transport, "error", 7) == 7 and poison_depth(transport) == 0

    transport.provision("nowhere")
    first = redrive(store, transport, "error", destination="nowhere")
    assert (first["redriven"], first["left"], first["skipped"]) == (4, 3, 0) and first["destinations"] == {"nowhere": 4}
    assert store.count_scheduled() == {"nowhere": 4}
    assert visible(transport, "error", 3) == 3  # the others were given back at once
    second = redrive(store, transport, "error", message_ids=["o-1"])
    assert (second["redriven"], second["destinations"]) == (1, {"orders": 1})
    third = redrive(store, transport, "error", max_per_second=50)
    assert (third["redriven"], third["left"], third["destinations"]) == (2, 0, {"orders": 2})
    assert store.count_scheduled() == {"nowhere": 4, "orders": 3}
    assert visible(transport, "error", 0) == 0

    result = Pump(store, transport).run(stop_when_idle=True)
    assert (result.stats.dispatched, result.stats.dead_lettered) == (7, 0)
    got = [m for _, m in collect(transport, "orders", 3, timeout=10) + collect(transport, "nowhere", 4, timeout=10)]
    assert Counter(m.message_id for m in got) == Counter(ORDERS + NOWHERE)  # nothing lost, nothing twice
    for m in got:
        assert m.headers[HEADER_REDRIVEN] == "1" and m.headers["k"] == m.message_id
        assert not FAILURE_HEADERS & set(m.headers)
        assert m.body == f"body {m.message_id}".encode()
    assert store.count_scheduled() == {} and visible(transport, "error", 0) == 0
    assert poison_depth(transport) == 0


def test_dead_letters_are_deleted_by_destination_by_id_and_all_and_a_dry_run_deletes_nothing(setup):
    store, transport = setup
    dead_letter_some(store, transport)
    if transport.can_peek:
        dry = delete_dead_letters(transport, "error", destination="orders")
        assert (dry["dry_run"], dry["would_delete"], dry["more"]) == (True, 3, False)
        assert sorted(d["message_id"] for d in dry["dead_letters"]) == ORDERS
        assert {d["destination"] for d in dry["dead_letters"]} == {"orders"}
        assert "503 from orders" in dry["dead_letters"][0]["last_error"]
        assert delete_dead_letters(transport, "error", everything=True)["would_delete"] == 7
        assert visible(transport, "error", 7) == 7  # looked, consumed nothing
    else:
        with pytest.raises(NotImplementedError, match="x-delivery-limit"):
            delete_dead_letters(transport, "error", destination="orders")
    with pytest.raises(InvalidInputError, match="or all of them with everything=True$"):
        delete_dead_letters(transport, "error", dry_run=False)
    with pytest.raises(InvalidInputError, match=r"everything=True \(not both\)"):
        delete_dead_letters(transport, "error", destination="orders", everything=True, dry_run=False)

    by_destination = delete_dead_letters(transport, "error", destination="orders", dry_run=False)
    assert (by_destination["deleted"], by_destination["destinations"], by_destination["left"]) == (3, {"orders": 3}, 4)
    assert visible(transport, "error", 4) == 4  # those not selected were given back at once
    by_id = delete_dead_letters(transport, "error", message_ids=["n-1", "nope"], dry_run=False)
    assert (by_id["deleted"], by_id["destinations"]) == (1, {"nowhere": 1})
    assert visible(transport, "error", 3) == 3
    rest = delete_dead_letters(transport, "error", everything=True, dry_run=False)
    assert (rest["deleted"], rest["left"]) == (3, 0)
    assert visible(transport, "error", 0) == 0 and store.count_scheduled() == {}
    assert poison_depth(transport) == 0


def test_a_redrive_to_a_destination_not_provisioned_leaves_its_messages_in_the_error_queue_saying_why(setup):
    """Stored again, they would only be dead-lettered again (and the report said `redriven`): they stay, skipped
    with the reason, until the destination is provisioned."""
    store, transport = setup
    dead_letter_some(store, transport)
    refused = redrive(store, transport, "error", destination="nowhere")
    assert (refused["redriven"], refused["skipped"]) == (0, 4), refused
    assert {s["message_id"] for s in refused["skipped_messages"]} == set(NOWHERE)
    assert all("'nowhere' is not provisioned" in s["reason"] for s in refused["skipped_messages"])
    assert store.count_scheduled() == {} and visible(transport, "error", 7) == 7
    transport.provision("nowhere")
    assert redrive(store, transport, "error", destination="nowhere")["redriven"] == 4
    assert store.count_scheduled() == {"nowhere": 4}


def test_a_message_redriven_into_the_same_failure_is_dead_lettered_again_with_its_count(setup):
    store, transport = setup
    dead_letter_some(store, transport)
    report = redrive(store, transport, "error", destination="orders")
    assert report["redriven"] == 3
    Pump(store, Refusing(transport), sleep=lambda _: None).run(stop_when_idle=True)
    assert visible(transport, "error", 7) == 7
    again = redrive(store, transport, "error", destination="orders")
    assert again["redriven"] == 3 and again["left"] == 4
    for mid in ORDERS:
        headers = _stored_headers(store, mid)
        assert headers[HEADER_REDRIVEN] == "2" and not FAILURE_HEADERS & set(headers)


def _stored_headers(store, message_id: str) -> dict:
    [stored] = store.browse(Selector.build(message_ids=[message_id]))["messages"]
    return stored["headers"]


def test_a_message_not_dead_lettered_by_the_pump_is_skipped_and_stays(setup):
    store, transport = setup
    transport.provision("error")
    transport.send([DelayedMessage("error", b"by hand", utcnow(), {"x": "1"}, "stray-1")])
    assert visible(transport, "error", 1) == 1
    report = redrive(store, transport, "error")
    assert (report["redriven"], report["skipped"]) == (0, 1)
    assert report["skipped_messages"][0]["message_id"] == "stray-1"
    assert HEADER_FAILED_DESTINATION in report["skipped_messages"][0]["reason"]
    assert visible(transport, "error", 1) == 1 and store.count_scheduled() == {}


def test_rabbitmq_counts_every_return_so_peek_refuses(rabbit, rabbit_vhost):
    """The evidence: on this broker a quorum queue with x-delivery-limit counts a message returned by
    closing its channel and one returned by basic.nack(requeue=True) alike, and past the limit moves it
    to poison. Peeking by get-and-return would do that to a dead letter, so peek refuses."""
    from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport

    strict = RabbitMQTransport(rabbit.parameters, prefix=rabbit.names.prefix, delivery_limit=2)
    strict.provision("probe")
    try:
        for way in ("close", "nack"):
            assert not strict.send([DelayedMessage("probe", b"look", utcnow(), {}, f"look-{way}")])
            counts = []
            connection = pika.BlockingConnection(strict.parameters)
            for _ in range(4):
                channel = connection.channel()
                method, properties, _ = channel.basic_get("probe", auto_ack=False)
                if method is None:
                    break
                counts.append(int((properties.headers or {}).get("x-delivery-count", 0)))
                if way == "nack":
                    channel.basic_nack(method.delivery_tag, requeue=True)
                channel.close()
            connection.close()
            assert counts == [0, 1, 2], (way, counts)  # every return counted; the third went past the limit
        deadline = time.monotonic() + 10
        while strict.depth(strict.names.poison)["visible"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert strict.depth(strict.names.poison)["visible"] == 2 and strict.depth("probe")["visible"] == 0
        assert not strict.can_peek
        with pytest.raises(NotImplementedError, match="counts its return"):
            strict.peek("probe")
    finally:
        strict.close()


def test_sqs_peek_refuses_a_queue_with_a_redrive_policy(sqs_client):
    from airflow_delay_provider.transports.sqs import SqsTransport

    transport = SqsTransport(sqs_client, prefix=f"r{uuid.uuid4().hex[:6]}-")
    transport.provision("error")
    dlq = sqs_client.create_queue(QueueName=f"{transport.prefix}error-dlq")["QueueUrl"]
    arn = sqs_client.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    url = sqs_client.get_queue_url(QueueName=transport.queue_name("error"))["QueueUrl"]
    sqs_client.set_queue_attributes(QueueUrl=url, Attributes={
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": "1"})})
    with pytest.raises(NotImplementedError, match="RedrivePolicy"):
        transport.peek("error")


def test_the_operator_redrives_in_a_dag(run_dag, monkeypatch, tmp_path):
    from airflow.sdk import DAG

    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.redrive import RedriveDeadLettersOperator

    monkeypatch.setenv("AIRFLOW_CONN_STORE_REDRIVE", json.dumps(
        {"conn_type": "delay_store", "schema": str(tmp_path / "store.db"), "extra": {"driver": "sqlite"}}))
    hook = DelayStoreHook("store_redrive")
    store, transport = hook.get_store(), hook.get_transport()
    store.create_schema()
    dead_letter_some(store, transport)
    listed = hook.dead_letters(transport, destination="nowhere", limit=2)
    assert listed["count"] == 2 and listed["more"] and {d["attempts"] for d in listed["dead_letters"]} == {1}
    transport.provision("nowhere")
    with DAG("t_redrive", schedule=None, start_date=datetime(2026, 1, 1)) as dag:
        RedriveDeadLettersOperator(task_id="redrive", delay_store_conn_id="store_redrive",
                                   destination="{{ params.destination }}", max_messages="{{ params.max }}",
                                   params={"destination": "nowhere", "max": 3})
    state, states, values = run_dag(dag)
    assert state == "success", states
    report = values["redrive"]
    assert (report["redriven"], report["destinations"]) == (3, {"nowhere": 3})
    assert hook.redrive(transport)["redriven"] == 4  # the fourth of nowhere and the three of orders
    result = Pump(store, transport).run(stop_when_idle=True)
    assert result.stats.dispatched == 7 and visible(transport, "error", 0) == 0
    with pytest.raises(Exception, match="max_messages"):
        RedriveDeadLettersOperator(task_id="bad", max_messages=0)


def test_a_destination_with_dead_letters_is_forgotten_only_when_forced(setup, tmp_path):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    store, transport = setup
    if not transport.can_peek:
        pytest.skip(f"{transport.name} cannot look at its error queue without consuming it")
    dead_letter_some(store, transport)  # "nowhere" (a typo, say) has 4 dead letters and no scheduled message
    hook = DelayStoreHook()
    hook.get_store = lambda: store  # the store of this test, not a connection's
    with pytest.raises(InvalidInputError, match=r"cannot forget \['nowhere'\]: the error queue 'error' still holds"):
        hook.forget(["nowhere"], transport=transport)
    assert "nowhere" in store.destinations()
    report = hook.forget(["nowhere"], force=True, transport=transport)
    assert report["forgotten"] == ["nowhere"] and report["dead_letters_left"] == ["nowhere"]
    assert report["dead_letters_checked"] is True
    assert "nowhere" not in store.destinations() and visible(transport, "error", 7) == 7  # the dead letters stay
