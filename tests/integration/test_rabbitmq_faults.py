"""RabbitMQ refusing or bouncing messages, against the real broker: nacks, redelivery loops, old deployments."""

from __future__ import annotations

import json
import shlex
import time
from datetime import timedelta

import pika
import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError, InvalidNameError, UnavailableError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport
from tests.conftest import RABBIT_HOST, RABBIT_PORT, _rabbitmqctl
from tests.helpers import collect, make_store, messages
from tests.integration.test_rabbitmq import args_of, listing


def wait_for_depth(transport: RabbitMQTransport, queue: str, depth: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while transport.depth(queue)["visible"] < depth and time.monotonic() < deadline:
        time.sleep(0.1)
    return transport.depth(queue)["visible"]


def bounce(transport: RabbitMQTransport, queue: str, most: int) -> int:
    """A consumer that rejects (requeue=True) whatever it gets, up to `most` times; returns how many it got."""
    channel = transport._channel()
    got = 0
    try:
        while got < most:
            method, _properties, _body = channel.basic_get(queue, auto_ack=False)
            if method is None:
                break
            got += 1
            channel.basic_reject(method.delivery_tag, requeue=True)
    finally:
        channel.close()
    return got


def test_a_broker_nack_releases_the_batch_untouched_and_spends_no_retry(rabbit, rabbit_vhost, pg):
    rabbit.provision("orders")
    rabbit.provision("error")
    _rabbitmqctl("set_policy", "-p", rabbit_vhost, "full", "^orders$",
                 '{"max-length": 1, "overflow": "reject-publish"}', "--apply-to", "queues")
    # Fill the queue to its limit, until the broker nacks.
    deadline = time.monotonic() + 20
    nacked, fillers = None, []
    while nacked is None and time.monotonic() < deadline:
        fillers.append(f"fill-{len(fillers)}")
        failures = rabbit.send([DelayedMessage("orders", b"filler", utcnow(), {}, fillers[-1])])
        nacked = next(iter(failures.values()), None)
    assert nacked is not None, "the broker never refused a publish to the full queue"
    assert isinstance(nacked, UnavailableError) and "nack" in str(nacked)

    store = make_store(*pg)
    store.store(messages(5))
    pump = Pump(store, rabbit, PumpConfig(batch_size=100, time_to_trigger_dispatch_circuit_breaker=300))
    result = pump.run(deadline=utcnow() + timedelta(seconds=3))
    assert result.stats.dead_lettered == 0 and result.stats.retried == 0
    assert result.stats.released >= 5
    assert [store.get(f"m-{i}").failures for i in range(5)] == [0] * 5
    assert rabbit.depth("error")["visible"] == 0

    # Lift the limit; a consumer taking the fillers is what tells publishers the queue has room again.
    _rabbitmqctl("clear_policy", "-p", rabbit_vhost, "full")
    assert {m.message_id for _, m in collect(rabbit, "orders", 1, timeout=10)} <= set(fillers)
    result = Pump(store, rabbit, PumpConfig(batch_size=100)).run(stop_when_idle=True)
    assert (result.stats.dispatched, result.stats.dead_lettered) == (5, 0)
    assert store.count_scheduled() == {}
    assert {m.message_id for _, m in collect(rabbit, "orders", 5, timeout=10)} == {f"m-{i}" for i in range(5)}
    assert rabbit.depth("error")["visible"] == 0


def test_a_message_requeued_past_the_delivery_limit_lands_in_poison(rabbit, rabbit_vhost):
    rabbit.provision("orders")
    [queue] = [q for q in listing("queues", rabbit_vhost, "name", "arguments") if q["name"] == "orders"]
    assert args_of(queue) == {
        "x-queue-type": "quorum",
        "x-delivery-limit": 20,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": rabbit.names.poison,
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }
    assert rabbit.send([DelayedMessage("orders", b"bad apple", utcnow(), {"k": "v"}, "poison-1")]) == {}
    assert bounce(rabbit, "orders", most=50) == 21  # the first delivery and 20 redeliveries
    assert wait_for_depth(rabbit, rabbit.names.poison, 1) == 1
    [m] = rabbit.receive(rabbit.names.poison)
    assert (m.message_id, m.body, m.headers) == ("poison-1", b"bad apple", {"k": "v"})
    assert rabbit.depth("orders")["visible"] == 0


def test_delivery_limit_is_a_connection_option(rabbit_vhost):
    from airflow.sdk import Connection

    from airflow_delay_provider.hooks.rabbitmq import connection_spec

    conn = Connection(conn_id="rabbit_opt", conn_type="rabbitmq", host=RABBIT_HOST, port=RABBIT_PORT,
                      schema=rabbit_vhost, login="guest", password="guest",
                      extra=json.dumps({"prefix": "opt", "delivery_limit": "2"}))
    transport = RabbitMQTransport.from_spec(connection_spec(conn))
    try:
        transport.provision("orders")
        assert transport.send([DelayedMessage("orders", b"x", utcnow(), {}, "opt-1")]) == {}
        assert bounce(transport, "orders", most=10) == 3
        assert wait_for_depth(transport, "opt.poison", 1) == 1
    finally:
        transport.close()
    # Another limit cannot be declared over an existing queue: the error names the argument.
    other = RabbitMQTransport.from_spec({"host": RABBIT_HOST, "port": RABBIT_PORT, "virtual_host": rabbit_vhost,
                                         "prefix": "opt"})
    with pytest.raises(InvalidNameError, match="x-delivery-limit"):
        other.provision("orders")
    other.close()
    # -1 means "no limit" on RabbitMQ 4.x but "drop at the first redelivery" on 3.x: refused.
    with pytest.raises(InvalidInputError, match="delivery_limit must be an int >= 1"):
        RabbitMQTransport.from_spec({"virtual_host": rabbit_vhost, "delivery_limit": -1})


def test_an_endpoint_queue_declared_without_a_delivery_limit_is_kept_reported_and_fixable(rabbit, rabbit_vhost):
    channel = rabbit._channel()  # as earlier versions declared it, with a message waiting
    channel.queue_declare("orders", durable=True, arguments={"x-queue-type": "quorum"})
    channel.basic_publish("", "orders", b"old", pika.BasicProperties(message_id="old-1", delivery_mode=2))
    channel.close()
    result = rabbit.provision("orders")  # must not fail: the queue and its message stay as they are
    assert "x-delivery-limit" in result["outdated"]
    assert rabbit.depth("orders")["visible"] == 1
    report = rabbit.verify(["orders"])
    assert report["complete"] and [o["name"] for o in report["outdated"]] == ["orders"]
    fix = shlex.split(report["outdated_fix"])
    assert fix[:2] == ["rabbitmqctl", "set_policy"] and rabbit_vhost in fix
    _rabbitmqctl(*fix[1:])  # the documented remedy, as verify prints it
    deadline = time.monotonic() + 10
    bounced = 0
    while not rabbit.depth(rabbit.names.poison)["visible"] and time.monotonic() < deadline:
        bounced += bounce(rabbit, "orders", most=5)
        time.sleep(0.1)
    assert rabbit.depth(rabbit.names.poison)["visible"] == 1 and rabbit.depth("orders")["visible"] == 0
    assert bounced <= 100  # stopped by the policy's limit (20 redeliveries), not by the deadline


def test_a_publisher_idle_past_its_heartbeats_is_replaced_before_it_publishes(rabbit_vhost):
    """Between batches nothing runs pika's I/O loop, so the broker may drop an idle publisher's connection
    (missed heartbeats); the next batch must not fail on it (a failed batch costs a breaker's wait)."""
    params = pika.ConnectionParameters(RABBIT_HOST, RABBIT_PORT, rabbit_vhost, pika.PlainCredentials("guest", "guest"),
                                       heartbeat=2)
    transport = RabbitMQTransport(params, prefix="hb")
    try:
        transport.provision("orders")
        assert transport.send(messages(1, "orders")) == {}
        first = transport._publisher
        time.sleep(7)  # the broker closes a connection that missed two heartbeats
        assert transport.send(messages(1, "orders", start=1)) == {}  # no failure: a fresh connection
        assert transport._publisher is not first
        assert len(collect(transport, "orders", 2, timeout=5)) == 2
    finally:
        transport.close()
