"""RabbitMQ refusing, bouncing or not confirming messages, against the real broker: nacks, redelivery loops, confirms
held back, lost connections, old deployments."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
from tests.waiting import wait_for


def wait_for_depth(transport: RabbitMQTransport, queue: str, depth: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while transport.depth(queue)["visible"] < depth and time.monotonic() < deadline:
        time.sleep(0.1)
    return transport.depth(queue)["visible"]


def classic_queue(transport: RabbitMQTransport, name: str) -> None:
    """A durable classic queue: a message due now reaches it by name, like an endpoint queue."""
    channel = transport._channel()
    channel.queue_declare(name, durable=True)
    channel.close()


@contextmanager
def confirms_held(vhost: str, queue: str) -> Iterator[None]:
    """Hold back the broker's confirms of publishes to a classic queue: its process is suspended, so it takes
    nothing in until resumed, while every other queue and the publishing channel go on as usual. (A quorum
    queue's suspended Raft server would stall the publishing channel itself.)"""
    def process(action: str) -> str:
        return (f'{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"{vhost}">>, queue, <<"{queue}">>)), '
                f"sys:{action}(amqqueue:get_pid(Q)).")

    _rabbitmqctl("eval", process("suspend"))
    try:
        yield
    finally:
        _rabbitmqctl("eval", process("resume"))


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

        def open_connections() -> int:
            return _rabbitmqctl("list_connections", "vhost").splitlines()[1:].count(rabbit_vhost)

        # Nothing runs their I/O loops: the broker closes both of the transport's connections once they missed
        # two heartbeats.
        wait_for(lambda: open_connections() == 0, 60, "the broker to drop the idle connections")
        assert transport.send(messages(1, "orders", start=1)) == {}  # no failure: a fresh connection
        assert transport._publisher is not first
        assert len(collect(transport, "orders", 2, timeout=5)) == 2
    finally:
        transport.close()


def test_a_confirm_timeout_fails_only_the_batch_waited_for(rabbit, rabbit_vhost):
    """The pump keeps one batch in flight while it starts the next: a batch not confirmed in time fails alone
    (released, sent again: at least once), while the next one, which the broker confirms, reports no failure, so
    it is not sent twice. Confirms that come late for the failed batch are ignored and the publisher stays."""
    rabbit.confirm_timeout = 2.0
    classic_queue(rabbit, "held")
    rabbit.provision("orders")
    with confirms_held(rabbit_vhost, "held"):
        first = rabbit.send_start(messages(5, "held"))
        second = rabbit.send_start(messages(5, "orders", start=5))
        publisher = rabbit._publisher
        failed = first()
        assert set(failed) == {f"m-{i}" for i in range(5)}
        assert all(isinstance(e, UnavailableError) and "not confirmed" in str(e) for e in failed.values())
        assert second() == {}, "a batch the broker confirmed was failed with the one waited for"
    assert wait_for_depth(rabbit, "held", 5) == 5  # the broker took them after all: a resend would repeat them
    # Their confirms come late, on the same channel: ignored, and the publisher goes on with the next batches.
    for start in (10, 13):
        assert rabbit.send(messages(3, "orders", start=start)) == {}
    assert rabbit._publisher is publisher
    assert not publisher._abandoned, "late confirms of the timed-out batch were not recognised"
    got = collect(rabbit, "orders", 11, timeout=10)
    assert sorted(m.message_id for _, m in got) == sorted(f"m-{i}" for i in range(5, 16))


def test_a_lost_connection_fails_every_unsettled_batch_and_the_publisher_is_replaced(rabbit, rabbit_vhost):
    classic_queue(rabbit, "held")
    with confirms_held(rabbit_vhost, "held"):
        first = rabbit.send_start(messages(3, "held"))
        second = rabbit.send_start(messages(3, "held", start=3))
        broken = rabbit._publisher
        started = time.monotonic()
        _rabbitmqctl("close_all_connections", "-p", rabbit_vhost, "test: publisher connection lost")
        failures = {**first(), **second()}
        assert time.monotonic() - started < 20, "the loss was found only by the confirm timeout"
        assert set(failures) == {f"m-{i}" for i in range(6)}
        assert all(isinstance(e, UnavailableError) for e in failures.values())
    assert rabbit.send(messages(2, "held", start=6)) == {}
    assert rabbit._publisher is not broken and not broken.is_open


def test_a_publisher_whose_channel_confirms_nothing_is_replaced(rabbit, rabbit_vhost):
    """No confirm at all for a whole timeout: the channel (or its connection) is stuck, so the next batch goes
    through a new publisher and the stuck one is closed, not left open."""
    rabbit.confirm_timeout = 2.0
    classic_queue(rabbit, "held")
    rabbit.provision("orders")
    with confirms_held(rabbit_vhost, "held"):
        failed = rabbit.send(messages(3, "held"))
        assert set(failed) == {"m-0", "m-1", "m-2"}
        stuck = rabbit._publisher
        assert rabbit.send(messages(2, "orders", start=3)) == {}
        assert rabbit._publisher is not stuck
        assert stuck._connection.is_closed


def test_a_batch_kept_out_of_a_full_window_waits_for_its_confirms_once_it_is_out(rabbit, rabbit_vhost):
    """The first batch fills the confirm window and is not confirmed: the second goes out only when the first times
    out, and then gets a timeout of its own for its confirms, instead of failing unsent with the first."""
    rabbit.confirm_timeout = 2.0
    rabbit.confirm_window = 5
    classic_queue(rabbit, "held")
    rabbit.provision("orders")
    with confirms_held(rabbit_vhost, "held"):
        first = rabbit.send_start(messages(5, "held"))
        second = rabbit.send_start(messages(5, "orders", start=5))
        assert set(first()) == {f"m-{i}" for i in range(5)}
        assert second() == {}
    assert sorted(m.message_id for _, m in collect(rabbit, "orders", 5, timeout=10)) == [f"m-{i}" for i in range(5, 10)]
