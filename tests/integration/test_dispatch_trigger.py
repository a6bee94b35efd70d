"""DispatchTrigger on the real PostgreSQL: woken at due times, two copies share the store, a killed
LISTEN connection is reopened (for the trigger and for a pump in a worker)."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from datetime import datetime, timedelta

import pytest

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump
from airflow_delay_provider.stores.listener import Subscription
from airflow_delay_provider.triggers import delay_store as delay_store_module
from airflow_delay_provider.triggers.delay_store import DispatchTrigger
from tests.conftest import PG_URL
from tests.helpers import collect, make_store, make_transport, messages, store_connection
from tests.waiting import SleepLog


@pytest.fixture
def store_conn(pg, monkeypatch):
    """A `delay_store` connection to this test's table on PostgreSQL, its store and the SQL-table transport."""
    url, schema, table = pg
    conn_id = f"store_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(store_connection(PG_URL, schema, table)))
    store = make_store(url, schema, table)
    # The transport's default table prefix, shared by the run's tests: a queue name of this test's own.
    name = f"q{uuid.uuid4().hex[:8]}"
    queue = make_transport(url, schema, "delay", name, "error")
    return conn_id, store, queue, name


def _kill_listeners(store) -> int:
    """pg_terminate_backend on this store's LISTEN connections (a restart or an idle-connection killer)."""
    from sqlalchemy import text

    with store.engine.begin() as conn:
        return conn.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE query = :q"),
                            {"q": f'LISTEN "{store.channel}"'}).scalar()


class _WatchedTrigger(DispatchTrigger):
    """DispatchTrigger whose store's sleeps are recorded in `sleeps` (it behaves the same otherwise)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sleeps = SleepLog()
        self.readied: list[tuple[datetime, datetime]] = []  # (due time read ahead for, store's clock then)

    def open_pump(self) -> Pump:
        pump = super().open_pump()
        self.sleeps.attach(pump.store)
        ready_for = pump.ready_for

        def watched_ready_for(due: datetime) -> None:
            self.readied.append((due, pump.store.clock()))
            ready_for(due)

        pump.ready_for = watched_ready_for
        return pump


def _trigger(conn_id: str, seconds: float, **kwargs) -> _WatchedTrigger:
    return _WatchedTrigger(delay_store_conn_id=conn_id,
                           deadline=(utcnow() + timedelta(seconds=seconds)).isoformat(), **kwargs)


async def _events(*triggers: DispatchTrigger) -> list[dict]:
    async def first(trigger):
        async for event in trigger.run():
            return event.payload

    return await asyncio.gather(*(first(t) for t in triggers))


def _run_while(triggers: list[_WatchedTrigger], meanwhile) -> list[dict]:
    """Run the triggers to their events while `meanwhile(sleeps)` runs in a thread, once each trigger sleeps on
    its LISTEN connection (`sleeps`: those sleeps); what `meanwhile` raises is raised here."""
    failed = []

    def act():
        try:
            meanwhile([t.sleeps.asleep(30, "on its LISTEN connection") for t in triggers])
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread below
            failed.append(exc)

    helper = threading.Thread(target=act)
    helper.start()
    events = asyncio.run(_events(*triggers))
    helper.join()
    if failed:
        raise failed[0]
    return events


def test_a_sooner_message_stored_while_the_trigger_sleeps_wakes_it(store_conn):
    conn_id, store, queue, Q = store_conn
    store.store(messages(1, Q, delay=3600, start=100))  # the trigger would sleep an hour for this one
    slept = []

    def store_sooner(asleep):
        slept.extend(asleep)
        store.store(messages(1, Q, delay=1.0))

    [event] = _run_while([_trigger(conn_id, 30, poll_interval=60, max_messages=1)], store_sooner)
    assert event["status"] == "done" and event["summary"]["dispatched"] == 1
    got = collect(queue, Q, 1, timeout=2)
    [(_, message)] = got
    assert message.message_id == "m-0"
    # Woken by NOTIFY: the sleep (until the 60 s poll) ended before the message was due.
    assert slept[0].ended is not None and slept[0].ended < message.due_at, slept
    lateness = (message.enqueued_at - message.due_at).total_seconds()
    assert 0 <= lateness < 2.0  # not after the 60 s poll interval, never early


def test_the_trigger_rehearses_a_due_time_on_its_shared_listen_connection(store_conn, monkeypatch):
    conn_id, store, queue, Q = store_conn
    # A rehearsal a second ahead, not 100 ms: a loaded machine (CI's, with the suite on four workers) woke the loop
    # more than 100 ms late, past the due time, where there is nothing left to rehearse.
    rehearsal = timedelta(seconds=1)
    monkeypatch.setattr(delay_store_module, "REHEARSAL", rehearsal)
    [stored] = messages(1, Q, delay=4.0)
    store.store([stored])
    due = stored.due_at
    trigger = _trigger(conn_id, 30, poll_interval=60, max_messages=1)
    [event] = asyncio.run(_events(trigger))
    assert event["status"] == "done" and event["summary"]["dispatched"] == 1
    [(_, message)] = collect(queue, Q, 1, timeout=2)
    assert message.enqueued_at >= message.due_at  # never early
    # It slept until the rehearsal's time before the due time, read ahead and ran its claim then, and slept again
    # until the due time itself: both on the loop's connection, none on a LISTEN connection of the thread's.
    untils = [s.until for s in trigger.sleeps.sleeps]
    assert untils[-2:] == [due - rehearsal, due], untils
    assert all(isinstance(s.listener, Subscription) for s in trigger.sleeps.sleeps)
    [(readied_for, at)] = trigger.readied
    assert readied_for == due and due - rehearsal <= at < due, (trigger.readied, due)


def test_two_copies_of_a_trigger_share_the_store_and_deliver_each_message_once(store_conn):
    conn_id, store, queue, Q = store_conn
    n = 3000
    # Stored due in a minute, 1000 a second apart; both copies start and sleep until then, and only then
    # do the messages fall due: over the next two seconds, and some at once.
    later = utcnow() + timedelta(seconds=60)
    groups = [later + timedelta(seconds=k) for k in range(3)]
    for k, due in enumerate(groups):
        store.store([DelayedMessage(Q, f"body-{i}".encode(), due, {"n": str(i)}, f"m-{i}")
                     for i in range(k * 1000, (k + 1) * 1000)])
    window = (later + timedelta(seconds=10)).isoformat()

    def fall_due(asleep):
        now = store.clock()
        for k, due in enumerate(groups):
            group = Selector.build(destination=Q, due_from=due, due_before=due + timedelta(seconds=0.5))
            assert store.reschedule(group, now + timedelta(seconds=k))["counts"]["rescheduled"] == 1000

    triggers = [_trigger(conn_id, 120, due_before=window, pump_config={"batch_size": 100}) for _ in range(2)]
    events = _run_while(triggers, fall_due)
    assert [e["status"] for e in events] == ["done", "done"]
    assert [e["summary"]["stopped_because"] for e in events] == ["drained", "drained"]
    assert sum(e["summary"]["dispatched"] for e in events) == n
    assert all(e["summary"]["dispatched"] > 0 for e in events)  # both took a share
    got = collect(queue, Q, n, timeout=10)
    ids = [m.message_id for _, m in got]
    assert len(ids) == len(set(ids)) == n  # exactly once: a SQL-table queue in the store's database
    assert all(m.enqueued_at >= m.due_at for _, m in got)  # none early
    assert store.count_scheduled() == {}


def test_the_trigger_keeps_dispatching_after_its_listen_connection_is_killed(store_conn):
    conn_id, store, queue, Q = store_conn
    killed, slept = [], []

    def kill_listener_then_send(asleep):
        killed.append(_kill_listeners(store))
        # The trigger notices, listens again on a new connection and sleeps there: then the message is stored.
        slept.append(trigger.sleeps.asleep(30, "on a new LISTEN connection",
                                           lambda s: s.listener is not asleep[0].listener))
        store.store(messages(1, Q, delay=1.0))

    trigger = _trigger(conn_id, 30, poll_interval=60, max_messages=1)
    [event] = _run_while([trigger], kill_listener_then_send)
    assert killed[0] >= 1
    assert event["status"] == "done" and event["summary"]["dispatched"] == 1
    [(_, message)] = collect(queue, Q, 1, timeout=2)
    assert slept[0].ended is not None and slept[0].ended < message.due_at, slept  # woken on the new connection
    assert (message.enqueued_at - message.due_at).total_seconds() < 3.0  # not after the 60 s poll


def test_a_pump_in_a_worker_survives_its_listen_connection_being_killed(store_conn):
    _, store, queue, Q = store_conn
    sleeps = SleepLog(store)
    pump = Pump(store, queue)
    result = {}

    def run():
        result["r"] = pump.run(deadline=utcnow() + timedelta(seconds=30), max_messages=2)

    runner = threading.Thread(target=run)
    runner.start()
    idle = sleeps.asleep(20, "idle, on its LISTEN connection")
    assert _kill_listeners(store) >= 1
    again = sleeps.asleep(20, "on a new LISTEN connection", lambda s: s.listener is not idle.listener)
    store.store(messages(2, Q, delay=1.0))
    runner.join(timeout=30)
    assert not runner.is_alive()
    assert result["r"].reason == "max_messages" and result["r"].stats.dispatched == 2
    got = collect(queue, Q, 2, timeout=2)
    assert len(got) == 2
    assert again.ended is not None and again.ended < got[0][1].due_at, again  # woken on the new connection
