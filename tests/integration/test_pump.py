"""The dispatch pump against real databases: exactly once, retries, error queue, breakers, crashes, wake-ups."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import datetime, timedelta

import pytest

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import CriticalError, UnavailableError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.helpers import drain, make_store, make_transport, messages
from tests.integration.pump_worker import Worker
from tests.waiting import SleepLog, wait_for


class FlakyTransport(SqlTableTransport):
    """A real SQL transport whose sends to some destinations fail a given number of times (or always)."""

    def __init__(self, inner: SqlTableTransport, fail: dict[str, int], down: bool = False):
        self.__dict__.update(inner.__dict__)
        self.fail = dict(fail)
        self.down = down
        self.attempts = Counter()
        self.failed_at: list[datetime] = []  # when each failing send returned, this host's clock

    def moves_from(self, store) -> bool:
        return False  # its failures are in send(): the pump must call it, not move rows inside the database

    def send(self, batch, connection=None):
        if self.down:
            raise UnavailableError("broker unreachable")
        failures, ok = {}, []
        for m in batch:
            self.attempts[m.message_id, m.destination] += 1
            if self.fail.get(m.destination, 0) != 0:
                self.fail[m.destination] -= 1
                failures[m.message_id] = ConnectionError(f"{m.destination} refused")
            else:
                ok.append(m)
        failures.update(super().send(ok, connection))
        self.failed_at.extend(utcnow() for _ in failures)
        return failures


def test_dispatch_same_database_is_exactly_once(db):
    url, schema, table = db
    store = make_store(url, schema, table)
    transport = make_transport(url, schema, table, "orders", "error")
    store.store(messages(2500))
    pump = Pump(store, transport, PumpConfig(batch_size=400))
    assert pump.exactly_once
    result = pump.run(stop_when_idle=True)
    assert result.reason == "drained"
    assert result.stats.dispatched == 2500 and result.stats.batches == 7
    got = drain(transport, "orders")
    assert sorted(m.message_id for m in got) == sorted(f"m-{i}" for i in range(2500))
    assert store.count_scheduled() == {}
    sample = next(m for m in got if m.message_id == "m-7")
    assert sample.body == b"body-7" and sample.headers == {"n": "7"} and sample.due_at <= sample.enqueued_at


def test_dispatch_to_another_database_is_at_least_once_with_ids(pg, tmp_path):
    store = make_store(*pg)
    transport = make_transport(f"sqlite:///{tmp_path / 'q.db'}", None, "x", "orders", "error")
    store.store(messages(300))
    pump = Pump(store, transport)
    assert not pump.exactly_once
    assert pump.run(stop_when_idle=True).stats.dispatched == 300
    assert {m.message_id for m in drain(transport, "orders")} == {f"m-{i}" for i in range(300)}


def test_not_yet_due_messages_wait_and_due_before_bounds_the_run(db):
    url, schema, table = db
    store = make_store(url, schema, table)
    transport = make_transport(url, schema, table, "orders", "error")
    store.store(messages(3, delay=-1) + messages(2, delay=3600, start=3))
    result = Pump(store, transport).run(due_before=utcnow())
    assert result.reason == "drained" and result.stats.dispatched == 3
    assert store.count_scheduled() == {"orders": 2}


def test_retries_then_delivery(db):
    url, schema, table = db
    store = make_store(url, schema, table)
    transport = FlakyTransport(make_transport(url, schema, table, "orders", "error"), {"orders": 2})
    store.store(messages(1, delay=-1))
    result = Pump(store, transport, PumpConfig(number_of_retries=2), sleep=lambda s: None).run(stop_when_idle=True)
    assert result.stats.dispatched == 1 and result.stats.retried == 2 and result.stats.dead_lettered == 0
    assert transport.attempts["m-0", "orders"] == 3
    assert [m.message_id for m in drain(transport, "orders")] == ["m-0"]


def test_exhausted_retries_go_to_error_queue_with_headers(db):
    url, schema, table = db
    store = make_store(url, schema, table)
    transport = FlakyTransport(make_transport(url, schema, table, "orders", "error"), {"orders": -1})
    store.store(messages(2, delay=-1))
    result = Pump(store, transport, PumpConfig(number_of_retries=1), sleep=lambda s: None).run(stop_when_idle=True)
    assert result.stats.dead_lettered == 2 and result.stats.dispatched == 0
    assert transport.attempts["m-0", "orders"] == 2  # 1 try + 1 retry
    dead = {m.message_id: m for m in drain(transport, "error")}
    assert set(dead) == {"m-0", "m-1"}
    h = dead["m-0"].headers
    assert h["x-delay-failed-destination"] == "orders"
    assert h["x-delay-failures"] == "2"
    assert "orders refused" in h["x-delay-failure-reason"]
    assert h["n"] == "0" and dead["m-0"].body == b"body-0"
    assert store.count_scheduled() == {} and drain(transport, "orders") == []


def test_unknown_destination_goes_to_error_queue_at_once(db):
    url, schema, table = db
    store = make_store(url, schema, table)
    transport = make_transport(url, schema, table, "orders", "error")
    store.store(messages(1, destination="nowhere", delay=-1) + messages(2, start=1, delay=-1))
    result = Pump(store, transport, PumpConfig(number_of_retries=5)).run(stop_when_idle=True)
    assert (result.stats.dispatched, result.stats.dead_lettered, result.stats.retried) == (2, 1, 0)
    [dead] = drain(transport, "error")
    assert dead.message_id == "m-0" and dead.headers["x-delay-failed-destination"] == "nowhere"
    assert "does not exist" in dead.headers["x-delay-failure-reason"]


def test_failing_dead_letter_keeps_message_and_trips_recovery_breaker(db):
    url, schema, table = db
    store = make_store(url, schema, table)
    transport = make_transport(url, schema, table, "orders")  # no error queue provisioned
    store.store(messages(1, destination="nowhere", delay=-1))
    pump = Pump(store, transport, PumpConfig(maximum_recovery_failures_per_second=0.1))
    with pytest.raises(CriticalError, match="handling failed dispatches: 4 failures within 30 s"):
        pump.run(stop_when_idle=True)
    kept = store.get("m-0")
    assert kept is not None and kept.failures >= 3  # nothing lost


def test_broker_down_trips_dispatch_breaker_and_loses_nothing(db):
    url, schema, table = db
    store = make_store(url, schema, table)
    transport = FlakyTransport(make_transport(url, schema, table, "orders", "error"), {}, down=True)
    # Due a second ago: the store's clock is the database's, read to within a round trip, and a claim that came
    # before the due time by its reckoning would find nothing and stop the pump as idle.
    store.store(messages(5, delay=-1))
    config = PumpConfig(time_to_trigger_dispatch_circuit_breaker=2)
    started = time.monotonic()
    with pytest.raises(CriticalError, match="dispatching kept failing.*broker unreachable"):
        Pump(store, transport, config).run(stop_when_idle=True)
    assert 2 <= time.monotonic() - started < 10
    assert store.count_scheduled() == {"orders": 5}
    assert store.get("m-0").failures == 0  # an outage is not the message's fault: no retry used up


def test_unreachable_store_trips_fetch_breaker_without_leaking_password(tmp_path):
    store = SqlDelayedMessageStore("postgresql+psycopg://bob:hunter2pw@127.0.0.1:1/x", table="t")
    transport = make_transport(f"sqlite:///{tmp_path / 'q.db'}", None, "x", "orders")
    pump = Pump(store, transport, PumpConfig(time_to_trigger_fetch_circuit_breaker=1))
    with pytest.raises(CriticalError) as err:
        pump.run(stop_when_idle=True)
    assert "fetching due messages kept failing" in str(err.value) and "not reachable" in str(err.value)
    assert "hunter2pw" not in str(err.value)


@pytest.fixture
def workers():
    """Starts pump_worker.py processes (Worker's arguments); any still running at the end is killed."""
    started: list[Worker] = []

    def start(*args, **kwargs) -> Worker:
        started.append(Worker(*args, **kwargs))
        return started[-1]

    yield start
    for worker in started:
        worker.kill()


def _backend_gone(store, pid: int) -> bool:
    from sqlalchemy import text

    with store.engine.connect() as conn:
        return not conn.execute(text("SELECT 1 FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}).first()


def test_two_pumps_in_parallel_dispatch_each_message_exactly_once(pg, workers):
    url, schema, table = pg
    store = make_store(url, schema, table)
    transport = make_transport(url, schema, table, "orders", "error")
    store.store(messages(10_000, delay=3600))
    # Both pumps start, find nothing due yet and sleep until the messages fall due; only then do they.
    pumps = [workers(url, schema, table, url, batch=250, due_before=utcnow() + timedelta(hours=2))
             for _ in range(2)]
    for pump in pumps:
        pump.wait_line("sleeping", timeout=60)
    report = store.reschedule(Selector.build(destination="orders"), store.clock())  # due now: both wake
    assert report["counts"]["rescheduled"] == 10_000
    results = [pump.result(timeout=120) for pump in pumps]
    assert [r["reason"] for r in results] == ["drained", "drained"]
    assert sum(r["dispatched"] for r in results) == 10_000
    assert all(r["dispatched"] > 0 for r in results), results  # both really worked
    ids = Counter(m.message_id for m in drain(transport, "orders"))
    assert len(ids) == 10_000 and max(ids.values()) == 1
    assert store.count_scheduled() == {}


@pytest.mark.parametrize("same_database", [True, False], ids=["same-db", "other-db"])
def test_pump_killed_mid_batch_loses_nothing(pg, tmp_path, workers, same_database):
    url, schema, table = pg
    store = make_store(url, schema, table)
    transport_url = url if same_database else f"sqlite:///{tmp_path / 'q.db'}"
    transport = make_transport(transport_url, schema if same_database else None, table, "orders", "error")
    total = 40_000
    store.store(messages(total))
    # The pump stops inside its 5th batch of 500, sent (other-db) or moved (same-db) but not yet committed.
    proc = workers(url, schema, table, transport_url, batch=500, hold_at_claim=5)
    backend = int(proc.wait_line("holding", timeout=120).split()[1])
    proc.kill()
    wait_for(lambda: _backend_gone(store, backend), 30, "PostgreSQL to end the killed pump's claim")
    delivered_before = transport.depth("orders")["visible"]
    assert 0 < delivered_before < total, "the kill should land mid-run"
    rerun = workers(url, schema, table, transport_url)
    assert rerun.result(timeout=120)["reason"] == "drained"
    ids = Counter(m.message_id for m in drain(transport, "orders"))
    assert set(ids) == {f"m-{i}" for i in range(total)}  # at least once: none lost
    duplicates = sum(n - 1 for n in ids.values())
    if same_database:
        assert duplicates == 0  # dispatch joined the claim transaction: exactly once
    else:
        assert duplicates <= 500  # at most the batch in flight at the kill
    assert store.count_scheduled() == {}


def test_sooner_message_wakes_a_sleeping_pump(db):
    url, schema, table = db
    store = make_store(url, schema, table)
    sleeps = SleepLog(store)
    transport = make_transport(url, schema, table, "orders", "error")
    store.store([DelayedMessage("orders", b"late", utcnow() + timedelta(seconds=120), message_id="late")])
    pump = Pump(store, SqlTableTransport(url, schema=schema, table_prefix=f"{table}_"))
    stop = utcnow() + timedelta(seconds=30)
    runner = threading.Thread(target=pump.run, kwargs={"deadline": stop, "max_messages": 1})
    runner.start()
    # The pump sleeps until its deadline (the 120 s message is due after it).
    asleep = sleeps.asleep(20, "until its deadline", lambda s: s.until >= stop)
    due = utcnow() + timedelta(seconds=5)
    store.store([DelayedMessage("orders", b"soon", due, message_id="soon")])
    runner.join(timeout=20)
    assert not runner.is_alive()
    # Woken: the sleep ended before the new message was due (PostgreSQL: its notification; SQLite: the next
    # poll), and the pump slept again until exactly that due time.
    assert asleep.ended is not None and asleep.ended < due, asleep
    assert any(abs((s.until - due).total_seconds()) < 0.001 for s in sleeps.sleeps), sleeps.sleeps
    [got] = drain(transport, "orders")
    assert got.message_id == "soon"
    lateness = (got.enqueued_at - due).total_seconds()
    assert 0 <= lateness < 1.0, lateness
    assert store.count_scheduled() == {"orders": 1}
    store.close()


def test_a_pump_backs_off_while_the_only_due_rows_are_held_by_another(pg):
    url, schema, table = pg
    store = make_store(url, schema, table)
    transport = make_transport(url, schema, table, "orders", "error")
    store.store(messages(3, delay=-1))
    claims = Counter()

    class CountingStore(SqlDelayedMessageStore):
        def claim_due(self, *args, **kwargs):
            claims["n"] += 1
            return super().claim_due(*args, **kwargs)

    counted = CountingStore(url, table=table, schema=schema)
    with store.claim_due(utcnow(), 10) as held:  # another pump holds every due row for 3 s
        assert len(held.messages) == 3
        result = Pump(counted, transport).run(deadline=utcnow() + timedelta(seconds=3))
        held.remove([])  # and releases them unsettled
    assert result.stats.dispatched == 0
    # A fixed 50 ms poll would claim about 60 times in 3 s; backing off (5 ms doubling to 1 s) about 10.
    assert claims["n"] <= 20, claims
    again = Pump(store, transport).run(deadline=utcnow() + timedelta(seconds=3), stop_when_idle=True)
    assert again.stats.dispatched == 3


def test_due_times_are_kept_on_the_database_clock_so_skewed_hosts_never_deliver_early(pg):
    url, schema, table = pg
    make_store(url, schema, table)
    transport = make_transport(url, schema, table, "orders", "error")
    # A sender whose clock is 30 s behind and a pump whose clock is 30 s ahead of the database's.
    sender = SqlDelayedMessageStore(url, table=table, schema=schema,
                                    local_clock=lambda: utcnow() - timedelta(seconds=30))
    pump_store = SqlDelayedMessageStore(url, table=table, schema=schema,
                                        local_clock=lambda: utcnow() + timedelta(seconds=30))
    assert abs((sender.clock() - utcnow()).total_seconds()) < 1  # both read the database's time
    assert abs((pump_store.clock() - utcnow()).total_seconds()) < 1
    now = sender.clock()
    due = now + timedelta(seconds=2)
    sender.store([DelayedMessage("orders", b"x", due, {}, "skew-1")])
    # Until just before the due time (on the database's clock, which the pump keeps its deadline on too).
    result = Pump(pump_store, transport).run(deadline=due - timedelta(seconds=0.5))
    assert result.stats.dispatched == 0  # on the pump host's own clock it was due 28 s ago
    result = Pump(pump_store, transport).run(deadline=utcnow() + timedelta(seconds=4), max_messages=1)
    assert result.stats.dispatched == 1
    [got] = drain(transport, "orders")
    assert got.enqueued_at >= got.due_at


def test_queues_in_the_store_database_are_filled_by_one_statement_exactly_once_in_due_order(pg):
    """PostgreSQL, queue tables beside the store: the transport moves due rows itself (move_due); rows it must not
    move (no such queue, a throttled destination, a paused one) are left to the pump's claims or stay stored."""
    from airflow_delay_provider.core.retry_policy import DeliveryPolicy

    url, schema, table = pg
    store = make_store(url, schema, table)
    transport = make_transport(url, schema, table, "orders", "slow", "held", "error")
    assert transport.moves_from(store)
    now = utcnow()
    # Stored newest first: the queue must still get them in due order.
    store.store([DelayedMessage("orders", f"o{i}".encode(), now - timedelta(seconds=i), {"n": str(i)}, f"o-{i}")
                 for i in range(300)])
    store.store([DelayedMessage("missing", b"m", now, message_id="lost-1"),
                 DelayedMessage("held", b"h", now, message_id="held-1")]
                + [DelayedMessage("slow", b"s", now, message_id=f"s-{i}") for i in range(3)])
    store.set_paused(["held"], True)
    moves = []
    move_due = transport.move_due

    def recording(store, now, limit, due_before=None, exclude=()):
        moved = move_due(store, now, limit, due_before, exclude)
        moves.append(({d for d, *_ in moved}, set(exclude)))
        return moved

    transport.move_due = recording
    pump = Pump(store, transport, PumpConfig(batch_size=100),
                policies={"slow": DeliveryPolicy(max_receives_per_second=1)})
    started = time.monotonic()
    result = pump.run(stop_when_idle=True, deadline=utcnow() + timedelta(seconds=20))
    took = time.monotonic() - started
    assert moves and all(exclude == {"slow"} and moved <= {"orders"} for moved, exclude in moves)
    got = drain(transport, "orders")
    assert [m.message_id for m in got] == [f"o-{i}" for i in reversed(range(300))]  # once each, due order
    assert got[0].headers == {"n": "299"} and got[0].body == b"o299" and got[0].enqueued_at >= got[0].due_at
    assert [m.message_id for m in drain(transport, "error")] == ["lost-1"]  # claimed, dead-lettered
    # Throttled: claimed at its rate (1/s: the first at once, then one a second while the run lasts), never moved
    # in bulk; the rest waits for tokens.
    slow = len(drain(transport, "slow"))
    assert 1 <= slow <= min(3, 1 + int(took)), (slow, took)
    waiting = {"held": 1, "slow": 3 - slow} if slow < 3 else {"held": 1}
    assert store.count_scheduled() == waiting  # paused: left stored
    assert result.stats.dispatched == 300 + slow and result.stats.dead_lettered == 1
