"""Delays beyond seven days: a store connection's `max_delay_seconds` raises the limit (up to ten years), every path
checks it, and a message due in a year is stored and dispatched once, at its due time, on a clock the test holds.
RabbitMQ's levels and SQS's large bodies refuse what they cannot carry before anything is sent, saying what would."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pika
import pytest

from airflow_delay_provider.core.breakers import CircuitBreaker
from airflow_delay_provider.core.delays import LONGEST_MAX_DELAY_SECONDS, DelayLimits
from airflow_delay_provider.core.errors import DelayError, InvalidInputError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump
from airflow_delay_provider.core.sending import send_natively
from airflow_delay_provider.stores import dedup, sql, tiers
from airflow_delay_provider.testing import InMemoryStore, InMemoryTransport
from tests.conftest import PG_URL
from tests.helpers import ClockedStore, FakeTI, HeldClock

DAY = 86_400
YEAR = 31_557_600


@pytest.mark.parametrize("kind", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def test_a_message_due_in_a_year_is_dispatched_once_at_its_due_time(kind, monkeypatch, request, tmp_path):
    """Stored a year ahead (`_far` on PostgreSQL), with the moves of a pump's process running every day of the test's
    clock and a pump draining: nothing before the due time, the message once at it."""
    from airflow_delay_provider.core import pump as pump_module

    clock = HeldClock().install(monkeypatch, dedup, sql, tiers, pump_module)
    if kind == "memory":
        store = InMemoryStore(clock=clock.clock)
    else:
        schema = request.getfixturevalue("pg_schema") if kind == "postgres" else None
        url = PG_URL if kind == "postgres" else f"sqlite:///{tmp_path / 'store.db'}"
        store = ClockedStore(url, table=f"t_{uuid.uuid4().hex[:12]}", schema=schema, local_clock=clock.clock)
        store.create_schema()
    transport = InMemoryTransport()
    transport.provision("renewals")
    due = clock.now + timedelta(seconds=YEAR)
    assert store.store([DelayedMessage("renewals", b"renew", due, message_id="renew-7")]) == 1
    pump = clock.hold_breakers(Pump(store, transport, clock=clock.clock))
    moves = store.later if getattr(store, "tiered", lambda: False)() else None
    while clock.now < due - timedelta(days=1):
        clock.advance(min(7 * DAY, (due - clock.now).total_seconds() - DAY))
        if moves is not None:
            moves.run()
        pump.run(stop_when_idle=True)
        assert transport.receive("renewals", 10) == [], f"delivered {(due - clock.now)} before its due time"
    clock.now = due - timedelta(seconds=1)
    if moves is not None:
        moves.run()
    pump.run(stop_when_idle=True)
    assert transport.receive("renewals", 10) == []
    clock.now = due
    pump.run(stop_when_idle=True)
    got = transport.receive("renewals", 10)
    assert [(m.message_id, m.body) for m in got] == [("renew-7", b"renew")] and store.count_scheduled() == {}


def _conn(monkeypatch, tmp_path, **extra) -> str:
    conn_id = f"long_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({
        "conn_type": "delay_store", "schema": str(tmp_path / "store.db"),
        "extra": {"driver": "sqlite", "table": "long_delays", **extra}}))
    return conn_id


def test_the_connections_max_delay_seconds_lets_a_send_ask_for_a_year_and_only_where_it_says(monkeypatch, tmp_path):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.send import SendDelayedMessageOperator

    def send(conn_id: str, destination: str, seconds: int):
        return SendDelayedMessageOperator(task_id="t", delay_store_conn_id=conn_id, destination=destination,
                                          body="b", delay_seconds=seconds,
                                          message_id=f"{destination}-{seconds}").execute({"ti": FakeTI()})

    default = _conn(monkeypatch, tmp_path)
    with pytest.raises(DelayError, match=r"^delay_seconds must be in 0\.\.604800 seconds \(7 days\), got 31557600; "
                                         r"the store connection's max_delay_seconds .* allows up to 315576000 s"):
        send(default, "renewals", YEAR)
    assert DelayStoreHook(default).get_store().count_scheduled() == {}
    ten_days = _conn(monkeypatch, tmp_path, max_delay_seconds=10 * DAY,
                     max_delay_seconds_per_destination={"renewals": YEAR})
    store = DelayStoreHook(ten_days).get_store()
    message_id = send(ten_days, "renewals", YEAR)
    assert (store.get(message_id).due_at - store.clock()).total_seconds() > YEAR - 60
    send(ten_days, "reminders", 10 * DAY)
    with pytest.raises(DelayError, match=r"must be in 0\.\.864000 seconds \(10 days\), got 950400"):
        send(ten_days, "reminders", 11 * DAY)
    assert store.count_scheduled() == {"renewals": 1, "reminders": 1}


def test_a_reschedule_is_held_to_the_destinations_longest_delay(monkeypatch, tmp_path):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    hook = DelayStoreHook(_conn(monkeypatch, tmp_path, max_delay_seconds_per_destination={"renewals": YEAR}))
    store = hook.get_store()
    store.create_schema()
    now = store.clock()
    store.store([DelayedMessage("renewals", b"r", now, message_id="r1"),
                 DelayedMessage("orders", b"o", now, message_id="o1")])
    report = hook.reschedule(destination="renewals", delay_seconds=YEAR)
    assert report["rescheduled"] == ["r1"]
    with pytest.raises(InvalidInputError, match=r"delay_seconds must be .*604800"):
        hook.reschedule(destination="orders", delay_seconds=8 * DAY)


@pytest.mark.parametrize(("extra", "pattern"), [
    ({"max_delay_seconds": 0}, r"max_delay_seconds must be a whole number of seconds in 1\.\.315576000 \(ten years\), "
                               r"got 0"),
    ({"max_delay_seconds": LONGEST_MAX_DELAY_SECONDS + 1}, r"in 1\.\.315576000 \(ten years\), got 315576001"),
    ({"max_delay_seconds": "a year"}, r"got 'a year'"),
    ({"max_delay_seconds_per_destination": [1]}, r"max_delay_seconds_per_destination must be an object of "
                                                 r"destination names to seconds, got \[1\]"),
    ({"max_delay_seconds_per_destination": {"renewals": 2.5}}, r"max_delay_seconds_per_destination\['renewals'\] "
                                                               r"must be a whole number"),
])
def test_a_bad_max_delay_extra_names_the_connection_the_extra_and_the_range(monkeypatch, tmp_path, extra, pattern):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    conn_id = _conn(monkeypatch, tmp_path, **extra)
    with pytest.raises(DelayError, match=rf"^connection '{conn_id}': .*{pattern}"):
        DelayStoreHook(conn_id).get_store()


def test_limits_parse_from_text_as_a_rendered_extra_gives_them():
    limits = DelayLimits.parse("864000", '{"renewals": 31557600}')
    assert (limits.of("renewals"), limits.of("orders"), limits.of(None), limits.longest) == (YEAR, 864000, 864000,
                                                                                              YEAR)


@pytest.mark.services
def test_rabbitmq_refuses_a_delay_beyond_its_levels_naming_the_levels_that_would_carry_it(rabbit_vhost):
    from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport
    from tests.conftest import RABBIT_HOST, RABBIT_PORT

    params = pika.ConnectionParameters(RABBIT_HOST, RABBIT_PORT, rabbit_vhost, pika.PlainCredentials("guest", "guest"))
    transport = RabbitMQTransport(params, prefix=f"d{uuid.uuid4().hex[:6]}", levels=20)
    try:
        transport.provision("renewals")
        now = transport.clock()
        year = DelayedMessage("renewals", b"r", now + timedelta(seconds=YEAR), message_id="r-year")
        soon = DelayedMessage("renewals", b"s", now + timedelta(seconds=60), message_id="r-soon")
        sent: list[str] = []

        class Ids:
            def unseen(self, ids):
                return list(ids)

            def remember_sent(self, ids):
                sent.extend(ids)

        with pytest.raises(DelayError, match=r"exceeds the maximum delay value of 1048575 s \(20 levels.*\); 25 levels "
                                             r"would carry it \(the connection's `levels` extra, at most 28\)"):
            send_natively(Ids(), transport, [soon, year], CircuitBreaker("test", 5))
        assert sent == []  # the message that fitted was not sent either
    finally:
        transport.close()


def test_an_sqs_body_in_s3_must_outlive_its_delay():
    from airflow_delay_provider.transports.sqs.bodies import Bodies

    bodies = Bodies(None, "bucket", "", max_bytes=100, expiration_days=35)
    large, small = (DelayedMessage("q", b"x" * n, HeldClock.START, message_id=f"m{n}") for n in (200, 50))
    bodies.check_delay(large, 7 * DAY)
    bodies.check_delay(small, YEAR)  # in the message itself: no expiry
    with pytest.raises(DelayError, match=r"message m200 has a body too large for SQS, carried through S3, where it "
                                         r"expires after body_expiration_days \(35\); its delay of 691201 s needs at "
                                         r"least 37 days"):
        bodies.check_delay(large, 8 * DAY + 1)


@pytest.mark.services
def test_rabbitmq_holds_a_message_due_in_a_year_in_its_levels_and_hands_it_back_intact(rabbit):
    """The broker's clock cannot be held, so a year is not waited out: the message goes in at the level of its
    highest bit (24 for a year) and comes back, taken as a migration to the store takes it, with its due time."""
    rabbit.provision("renewals")
    due = rabbit.clock() + timedelta(seconds=YEAR)
    assert rabbit.send([DelayedMessage("renewals", b"renew", due, {"k": "v"}, "renew-year")]) == {}
    levels = {n: rabbit.depth(rabbit.names.level(n))["visible"] for n in range(rabbit.names.levels)}
    assert {n for n, count in levels.items() if count} == {YEAR.bit_length() - 1}
    [held] = rabbit.take_held(10)
    assert (held.message.message_id, held.message.body, held.message.headers) == ("renew-year", b"renew", {"k": "v"})
    assert abs((held.message.due_at - due).total_seconds()) <= 1
    rabbit.ack_held([held.receipt])


@pytest.mark.services
def test_sqs_takes_a_message_due_in_a_year_into_its_delay_queue_for_the_relay(sqs_client):
    """SQS keeps the message in the destination's delay queue and the relay sends it back every cycle until it is
    due (tests/integration/test_sqs.py waits cycles out); nothing reaches the destination early."""
    from airflow_delay_provider.transports.sqs import SqsTransport

    transport = SqsTransport(sqs_client, queue_delay=900, prefix=f"y{uuid.uuid4().hex[:6]}-")
    try:
        transport.provision("renewals")
        due = transport.clock() + timedelta(seconds=YEAR)
        assert transport.send([DelayedMessage("renewals", b"renew", due, message_id="renew-year")]) == {}
        assert transport.describe_delay(YEAR, "renewals").startswith(f"{YEAR} s = 35063 cycle(s) through the delay "
                                                                      "queue")
        assert transport.receive("renewals") == []
        waiting = transport.lifecycle("renewals", delay_queue=True)
        assert waiting["scheduled"] + waiting["visible"] == 1 and transport.depth("renewals")["visible"] == 0
    finally:
        transport.close()
