"""Sweep leases and the per-partition dispatch of a sweep (LeasedRows) on the real PostgreSQL, without Spark."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from tests.helpers import drain, make_store, make_transport, messages
from tests.integration.test_pump import FlakyTransport
from tests.waiting import wait_for


def test_leases_keep_pumps_and_other_sweeps_off_until_they_expire(pg):
    store = make_store(*pg)
    transport = make_transport(*pg, "orders", "error")
    store.store(messages(50, delay=-5) + messages(5, delay=3600, start=50))
    end = utcnow() + timedelta(minutes=1)
    # A lease long enough for the next checks however slow the machine is; "a" cuts it short below.
    assert store.start_sweep("a", end, lease_seconds=60) == {"claimed": 50, "taken_over": 0}
    assert store.claimed_range("a")[2] == 50  # the message due in an hour is not in the window

    pump = Pump(store, transport, PumpConfig(batch_size=100))
    assert pump.run(stop_when_idle=True).stats.dispatched == 0  # leased rows are not the pump's
    assert store.start_sweep("b", end, lease_seconds=60) == {"claimed": 0, "taken_over": 0}
    assert store.backlog()["totals"]["in_flight"] == 50  # still held by "a"
    assert store.renew_lease("a", 0.5)  # "a" renews for the last time, then stops renewing: its lease expires
    wait_for(lambda: store.backlog()["totals"]["in_flight"] == 0, 10, 'the lease of "a" to expire')
    assert store.start_sweep("c", end, lease_seconds=60) == {"claimed": 50, "taken_over": 50}
    assert store.renew_lease("c", 60) and not store.renew_lease("nope", 60)

    assert store.finish_sweep("c", "done", {"dispatched": 0}) == 50  # released at once, not at expiry
    assert store.sweep_record("c")["summary"] == {"dispatched": 0, "released": 50}
    assert not store.renew_lease("c", 60)
    assert pump.run(stop_when_idle=True).stats.dispatched == 50
    assert sorted(m.message_id for m in drain(transport, "orders")) == sorted(f"m-{i}" for i in range(50))


def test_leased_rows_send_only_what_is_still_theirs_and_reschedule_failures(pg):
    url, schema, table = pg
    store = make_store(*pg)
    inner = make_transport(*pg, "orders", "flaky", "error")
    store.store(messages(20, delay=-5) + messages(3, destination="flaky", delay=-5, start=20))
    store.start_sweep("s", utcnow() + timedelta(minutes=1), lease_seconds=60)
    low, high, n = store.claimed_range("s")
    rows = list(store.read_claimed("s", low, high))
    assert n == len(rows) == 23
    # Another sweep took two of the rows over after reading (as if this one's lease had lapsed).
    taken = [rows[0][0], rows[1][0]]
    with store.engine.begin() as conn:
        conn.execute(update(store.table).where(store.table.c.id.in_(taken)).values(claim_id="other"))

    policy = DeliveryPolicy(5, 20, 3)  # first retry 5 s later
    transport = FlakyTransport(inner, {"flaky": -1})  # always refuses
    leased = store.leased_rows("s", rows)
    started = utcnow()
    stats = Pump(leased, transport, PumpConfig(batch_size=7), policy=policy).run(stop_when_idle=True).stats
    assert leased.skipped == 2 and not leased.remaining
    assert stats.destinations == {"orders": {"dispatched": 18}, "flaky": {"failed": 3}}
    assert sorted(m.message_id for m in drain(inner, "orders")) == sorted(f"m-{i}" for i in range(2, 20))
    for i in range(20, 23):
        retried = store.get(f"m-{i}")
        assert retried.failures == 1 and "x-delay-first-failed-at" in retried.headers
        assert started + timedelta(seconds=5) <= retried.due_at <= utcnow() + timedelta(seconds=5)
    # The retries left the sweep: a pump takes them when due; the two taken-over rows stay with "other".
    assert store.claimed_range("s")[2] == 0 and store.claimed_range("other")[2] == 2


def test_a_sweeps_retry_goes_to_the_partition_of_its_new_due_time_and_is_claimed_on_time(pg, monkeypatch):
    """A sweep leased a row still in its hour's partition (the pumps were off when it came due) and retries it due 3 s
    later, while a pump's moves run: the retry goes where claims read, and is claimed at its due time, not at the
    next full look of `_later` (up to a minute later)."""
    from airflow_delay_provider.core.message import DelayedMessage
    from airflow_delay_provider.stores import engine, tiers
    from airflow_delay_provider.testing import InMemoryTransport
    from tests.helpers import ClockedStore, HeldClock

    clock = HeldClock().install(monkeypatch, engine, tiers)
    url, schema, table = pg
    store = ClockedStore(url, table=table, schema=schema, local_clock=clock.clock)
    store.create_schema()
    store.store([DelayedMessage("orders", b"x", clock.now + timedelta(seconds=120), message_id="m")])
    clock.advance(121)  # due, and no move ran: still in its hour's partition
    assert store.start_sweep("s", clock.now + timedelta(seconds=1), lease_seconds=600)["claimed"] == 1
    store.later.run()  # a pump's process starts moving (its first look reads all of `_later`)
    clock.advance(5)
    store.later.run()
    clock.advance(4)
    class Refusing(InMemoryTransport):
        def send(self, batch, connection=None):
            return {m.message_id: RuntimeError("refused") for m in batch}

    rows = list(store.read_claimed("s", *store.claimed_range("s")[:2]))
    retry = DeliveryPolicy(min_delay_target=3, max_delay_target=3, num_retries=1)
    Pump(store.leased_rows("s", rows), Refusing(), policy=retry, clock=clock.clock).run(stop_when_idle=True)
    assert store.get("m").due_at == clock.now + timedelta(seconds=3)
    clock.advance(1)
    store.later.run()
    clock.advance(2)
    transport = InMemoryTransport()
    transport.provision("orders")
    Pump(store, transport, clock=clock.clock).run(stop_when_idle=True)
    assert [m.message_id for m in transport.receive("orders", 10)] == ["m"]
