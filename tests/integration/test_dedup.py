"""An id is refused while a message with it is stored, whatever partition holds it, and for the de-duplication window
after it was accepted: the cases the stateful model test found, and the ids' upkeep around them, on SQLite and on
PostgreSQL's partitions, on a clock the test holds."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump
from airflow_delay_provider.stores import dedup
from airflow_delay_provider.stores.sql import to_us
from airflow_delay_provider.testing import InMemoryTransport
from tests.conftest import PG_URL
from tests.helpers import ClockedStore, HeldClock

HOUR = 3_600


@pytest.fixture
def clock(monkeypatch) -> HeldClock:
    return HeldClock().install(monkeypatch, dedup)


def _store(db, clock: HeldClock, window: float = 1.0) -> ClockedStore:
    url, schema, table = db
    store = ClockedStore(url, table=table, schema=schema, dedup_window_seconds=window, local_clock=clock.clock)
    store.create_schema()
    return store


def _send(store, clock: HeldClock, message_id: str, seconds: float, destination: str = "orders") -> int:
    return store.store([DelayedMessage(destination, b"x", clock.now + timedelta(seconds=seconds),
                                       message_id=message_id)])


def _rows(store, message_id: str) -> int:
    t = store.table
    with store.engine.connect() as conn:
        return conn.execute(select(func.count()).where(t.c.message_id == message_id)).scalar_one()


def _deliver(store, clock: HeldClock) -> list[str]:
    transport = InMemoryTransport()
    transport.provision("orders")
    Pump(store, transport, clock=clock.clock).run(stop_when_idle=True)
    return [m.message_id for m in transport.receive("orders", 100)]


@pytest.mark.parametrize("window", [1.0, 0])
def test_a_re_sent_id_still_stored_in_another_partition_is_skipped_after_the_window(db, clock, window):
    """Sent due in 30 h (`_far` on PostgreSQL), then again due in 2 h (an hour's partition) after the window ran
    out: stored once, delivered once."""
    store = _store(db, clock, window)
    assert _send(store, clock, "order-42", 30 * HOUR) == 1
    clock.advance(2)
    assert _send(store, clock, "order-42", 2 * HOUR) == 0
    assert _rows(store, "order-42") == 1
    clock.advance(30 * HOUR)
    assert _deliver(store, clock) == ["order-42"]


def test_an_id_twice_in_one_send_is_stored_once_the_first(db, clock):
    """Due now and due in a minute: two partitions on PostgreSQL, one row (the first)."""
    store = _store(db, clock, 0)
    messages = [DelayedMessage("orders", b"first", clock.now, message_id="m"),
                DelayedMessage("orders", b"second", clock.now + timedelta(seconds=61), message_id="m")]
    assert store.store(messages) == 1
    assert store.get("m").body == b"first"


def test_a_refused_re_send_does_not_renew_the_window(db, clock):
    """A re-send refused because the id is stored is not an acceptance: once the message is delivered, the id
    is remembered from its own acceptance, not from the refused send."""
    store = _store(db, clock, 5)
    assert _send(store, clock, "m", -5) == 1
    clock.advance(300)
    assert _send(store, clock, "m", -5) == 0  # stored: refused
    assert _deliver(store, clock) == ["m"]
    assert _send(store, clock, "m", -5) == 1  # accepted 300 s ago, window 5 s


def test_a_cancelled_id_is_remembered_from_its_acceptance_not_until_its_due_time(db, clock):
    store = _store(db, clock, 5)
    assert _send(store, clock, "m", 30 * HOUR) == 1
    clock.advance(1)
    assert store.cancel(Selector(message_ids=("m",)))["cancelled"] == ["m"]
    assert _send(store, clock, "m", 60) == 0  # accepted 1 s ago, within the window
    clock.advance(5)
    assert _send(store, clock, "m", 60) == 1


def test_an_id_stays_refused_while_its_message_waits_past_its_due_time(db, clock):
    """A paused destination's message is still stored long after its due time and the window: the ids' expiry
    keeps its id, and a re-send is refused."""
    store = _store(db, clock, 1)
    assert _send(store, clock, "m", 10) == 1
    store.set_paused(["orders"], True)
    clock.advance(3 * HOUR)
    with store.engine.begin() as conn:
        store.accepted.expire(conn, to_us(clock.now))
    assert _send(store, clock, "m", 10) == 0
    assert _rows(store, "m") == 1


def test_a_retry_keeps_its_id_refused_until_it_is_due_again(db, clock):
    """A retry an hour later, with a window of 1 s: a re-send in between is refused."""
    store = _store(db, clock, 1)
    assert _send(store, clock, "m", 0) == 1
    with store.claim_due(clock.now, 10) as claim:
        claim.retry({"m": clock.now + timedelta(hours=1)})
    clock.advance(1_800)
    with store.engine.begin() as conn:
        store.accepted.expire(conn, to_us(clock.now))
    assert _send(store, clock, "m", 0) == 0
    assert _rows(store, "m") == 1


def test_a_message_made_due_now_and_delivered_can_be_sent_again_with_no_window(db, clock):
    """Its id was kept until its due time a day ahead; run now and delivered, it is no longer stored, and with the
    window at 0 nothing else refuses it."""
    store = _store(db, clock, 0)
    assert _send(store, clock, "m", 100_000) == 1
    assert store.reschedule(Selector(message_ids=("m",)), clock.now)["rescheduled"] == ["m"]
    assert _deliver(store, clock) == ["m"]
    assert _send(store, clock, "m", 0) == 1


def test_a_store_object_that_has_not_seen_the_upgrade_to_partitions_yet_refuses_a_re_sent_id(pg, clock):
    """Another process migrates the store to the partitions while this object still takes it for one table (it
    looks again every 30 s): a re-send falls back from COPY, and its insert must suit the partitioned table
    (PostgreSQL refused `ON CONFLICT (message_id)` there, which no partition's unique index matches)."""
    url, schema, table = pg
    store = ClockedStore(url, table=table, schema=schema, dedup_window_seconds=1, local_clock=clock.clock)
    store.migrate(up_to=7)
    assert not store.tiered()
    assert _send(store, clock, "m", 60) == 1
    ClockedStore(url, table=table, schema=schema).migrate()
    assert not store.tiered()  # its view is the one table for up to 30 s
    clock.advance(2)
    assert _send(store, clock, "m", 60) == 0
    assert _send(store, clock, "n", 60) == 1
    assert _rows(store, "m") == _rows(store, "n") == 1


@pytest.mark.parametrize("kind", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def test_a_debounce_re_sent_every_second_for_an_hour_delivers_once_at_the_end(clock, monkeypatch, request, tmp_path,
                                                                               kind):
    """`on_duplicate="replace"`: "five minutes after the last activity". The id is re-sent every second for an hour,
    each send due five minutes later; a pump drains every ten seconds (and the move runs, on PostgreSQL). Nothing is
    delivered during the hour; the message is delivered once, five minutes after the last send, with its body."""
    from airflow_delay_provider.core import pump as pump_module
    from airflow_delay_provider.stores import counts, sql, tiers
    from airflow_delay_provider.testing import InMemoryStore

    clock.install(monkeypatch, pump_module, sql, tiers, counts)
    if kind == "memory":
        store = InMemoryStore(clock=clock.clock, dedup_window_seconds=HOUR)
    else:
        schema = request.getfixturevalue("pg_schema") if kind == "postgres" else None
        url = PG_URL if kind == "postgres" else f"sqlite:///{tmp_path / 'store.db'}"
        store = _store((url, schema, f"t_{uuid.uuid4().hex[:12]}"), clock, window=HOUR)
    transport = InMemoryTransport()
    transport.provision("orders")
    pump = clock.hold_breakers(Pump(store, transport, clock=clock.clock))
    moves = getattr(store, "later", None) if getattr(store, "tiered", lambda: False)() else None
    for second in range(HOUR):
        body = f"activity {second}".encode()
        assert store.store([DelayedMessage("orders", body, clock.now + timedelta(seconds=300),
                                           message_id="remind-7")], on_duplicate="replace") == 1
        if second % 10 == 9:
            if moves is not None:
                moves.run()
            pump.run(stop_when_idle=True)
            assert transport.receive("orders", 10) == [], f"delivered {second + 1} s in, before the last activity"
        clock.advance(1)
    last_send = clock.now - timedelta(seconds=1)
    clock.now = last_send + timedelta(seconds=299)
    if moves is not None:
        moves.run()
    pump.run(stop_when_idle=True)
    assert transport.receive("orders", 10) == [], "delivered before five minutes after the last send"
    clock.advance(1)
    pump.run(stop_when_idle=True)
    got = transport.receive("orders", 10)
    assert [(m.message_id, m.body) for m in got] == [("remind-7", f"activity {HOUR - 1}".encode())]
    transport.ack("orders", [m.receipt for m in got])
    clock.advance(600)
    pump.run(stop_when_idle=True)
    assert transport.receive("orders", 10) == [] and store.count_scheduled() == {}
