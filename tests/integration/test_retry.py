"""Delivery retry policies in the pump: scheduled retries, dead-lettering, throttling."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import HEADER_FIRST_FAILED_AT, DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from tests.helpers import drain, make_store, make_transport, messages
from tests.integration.test_pump import FlakyTransport

T0 = datetime(2030, 1, 1, tzinfo=UTC)
POLICY = DeliveryPolicy(5, 20, 6, num_no_delay_retries=1, num_min_delay_retries=2, num_max_delay_retries=1)


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self):
        return self.now


class Recording(FlakyTransport):
    def __init__(self, inner, fail, clock):
        super().__init__(inner, fail)
        self.clock = clock
        self.times = []

    def send(self, batch, connection=None):
        self.times.extend((self.clock() - T0).total_seconds() for m in batch if m.destination == "orders")
        return super().send(batch, connection)


def drive(pump: Pump, clock: Clock, until: float, step: float = 0.5) -> None:
    while (clock.now - T0).total_seconds() <= until:
        while (stats := pump.dispatch_batch()) is not None and stats.batches:
            pass
        clock.now += timedelta(seconds=step)


def test_policy_schedules_retries_then_delivers(tmp_path):
    assert POLICY.retry_delays() == [0, 5, 5, 5, 20, 20]
    url = f"sqlite:///{tmp_path / 'r.db'}"
    store = make_store(url, None, "delayed")
    clock = Clock()
    transport = Recording(make_transport(url, None, "delayed", "orders", "error"), {"orders": 4}, clock)
    store.store([DelayedMessage("orders", b"x", T0, {}, "p-1")])
    # Without jitter, the policy's own schedule (jitter is checked below).
    pump = Pump(store, transport, PumpConfig(retry_jitter=0), policy=POLICY, clock=clock, sleep=lambda s: None)
    drive(pump, clock, 60)
    assert transport.times == [0, 0, 5, 10, 15]  # first try, 1 immediate, 2 at 5 s, first backoff step 5 s
    [got] = drain(transport, "orders")
    assert got.message_id == "p-1" and store.count_scheduled() == {}


def test_retries_of_a_burst_are_spread_by_jitter_within_the_policy_bounds(tmp_path):
    url = f"sqlite:///{tmp_path / 'j.db'}"
    policy = DeliveryPolicy(10, 60, 3, num_min_delay_retries=0)  # backoff 10 s .. 60 s
    delays = {}
    for jitter in (0.0, 0.1):
        store = make_store(url, None, f"j{int(jitter * 10)}")
        transport = FlakyTransport(make_transport(url, None, f"j{int(jitter * 10)}", "orders", "error"),
                                   {"orders": 200})
        store.store([DelayedMessage("orders", b"x", T0, {}, f"b-{i}") for i in range(200)])
        clock = Clock()
        Pump(store, transport, PumpConfig(retry_jitter=jitter), policy=policy, clock=clock).dispatch_batch()
        with store.engine.connect() as conn:
            rows = conn.execute(store.table.select()).all()
        delays[jitter] = {(r.due_at_us - int(T0.timestamp() * 1e6)) / 1e6 for r in rows}
    assert delays[0.0] == {10.0}  # all 200 would retry in the same instant
    assert len(delays[0.1]) > 100 and all(10.0 <= d <= 11.0 for d in delays[0.1])  # spread, never below minDelay


def test_exhausted_policy_dead_letters_after_exactly_its_attempts(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    store = make_store(url, None, "delayed")
    clock = Clock()
    transport = Recording(make_transport(url, None, "delayed", "orders", "error"), {"orders": -1}, clock)
    store.store([DelayedMessage("orders", b"x", T0, {"k": "v"}, "p-2")])
    pump = Pump(store, transport, PumpConfig(retry_jitter=0), policy=POLICY, clock=clock, sleep=lambda s: None)
    drive(pump, clock, 120)
    assert transport.times == [0, 0, 5, 10, 15, 35, 55]  # 1 + numRetries attempts
    [dead] = drain(transport, "error")
    h = dead.headers
    assert h["x-delay-failures"] == "7" and h["k"] == "v"
    assert h["x-delay-first-failed-at"] == T0.isoformat()
    assert h["x-delay-failed-at"] == (T0 + timedelta(seconds=55)).isoformat()
    assert "orders refused" in h["x-delay-failure-reason"]
    assert store.count_scheduled() == {}  # nothing lost: delivered to the error queue


def test_per_destination_policy_and_shorthand(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    store = make_store(url, None, "delayed")
    clock = Clock()
    inner = make_transport(url, None, "delayed", "orders", "other", "error")
    transport = Recording(inner, {"orders": -1, "other": -1}, clock)
    store.store([DelayedMessage("orders", b"x", T0, {}, "a"), DelayedMessage("other", b"x", T0, {}, "b")])
    pump = Pump(store, transport, PumpConfig(number_of_retries=2), policies={"orders": DeliveryPolicy.immediate(0)},
                clock=clock, sleep=lambda s: None)
    drive(pump, clock, 5)
    dead = {m.message_id: m.headers["x-delay-failures"] for m in drain(transport, "error")}
    assert dead == {"a": "1", "b": "3"}  # orders: no retry; other: the shorthand's 2 immediate retries


def test_retries_on_postgres_with_second_scale_delays(pg):
    url, schema, table = pg
    store = make_store(url, schema, table)
    inner = make_transport(url, schema, table, "orders", "error")
    transport = FlakyTransport(inner, {"orders": 2})
    policy = DeliveryPolicy(1, 2, 3, num_min_delay_retries=1, num_max_delay_retries=1)
    due = utcnow()
    store.store([DelayedMessage("orders", b"x", due, {}, "pg-1")])
    result = Pump(store, transport, policy=policy).run(deadline=due + timedelta(seconds=15), max_messages=1)
    assert result.stats.dispatched == 1 and result.stats.retried == 2
    [got] = drain(transport, "orders")
    # Retries at +1 s and +1 s more, each counted from the failure before it; never early. How late the pump took
    # each retry is the machine's (a busy CI machine took the first 1.3 s late), so the delay the policy set is read
    # from the last retry's due time, against when the failure before it was seen (the maximum delay is 2 s).
    first_failed = datetime.fromisoformat(got.headers[HEADER_FIRST_FAILED_AT])
    assert (got.enqueued_at - first_failed).total_seconds() >= 2.0
    assert 0.9 <= (got.due_at - transport.failed_at[-1]).total_seconds() < 1.9


def assert_paced(got, rate: float) -> list:
    """The messages went at `rate` a second: never over it, and not held back under it. Their send times, sorted.

    Never over: any window of T seconds holds at most a second's worth plus rate x T (the bucket's bound), and one
    more for a send whose insert came later than its token. Not under: in at least one half of the sends, the lag
    behind one every 1/rate s grows by under 0.6 s. A pump held back to half the rate falls behind in both halves
    (50 sends at 10/s: 2.4 s in each); one stall of a busy machine (seen in CI: 0.9 s after the second send, the
    rest at the rate) falls in one half only."""
    times = sorted(m.enqueued_at for m in got)
    offsets = [(t - times[0]).total_seconds() for t in times]
    for i, start in enumerate(offsets):
        for j in range(i + 1, len(offsets)):
            assert j - i + 1 <= rate + rate * (offsets[j] - start) + 1, (i, j, offsets[i:j + 1])
    lags = [t - i / rate for i, t in enumerate(offsets)]
    middle = len(lags) // 2
    growth = (lags[middle] - lags[0], lags[-1] - lags[middle])
    assert min(growth) < 0.6, (growth, lags)
    return times


def test_throttle_holds_the_rate(pg):
    url, schema, table = pg
    store = make_store(url, schema, table)
    transport = make_transport(url, schema, table, "slow", "fast", "error")
    store.store(messages(50, "slow") + messages(200, "fast", start=50))
    slow = DeliveryPolicy(0, 0, 0).with_throttle(10)
    started = time.monotonic()
    result = Pump(store, transport, policies={"slow": slow}).run(stop_when_idle=False, max_messages=250,
                                                                  deadline=utcnow() + timedelta(seconds=30))
    assert result.stats.dispatched == 250
    got = drain(transport, "slow")
    times = assert_paced(got, 10)
    fast = drain(transport, "fast")
    assert max(m.enqueued_at for m in fast) < times[10]  # the unthrottled destination did not wait behind it
    assert time.monotonic() - started < 10


def test_two_pumps_of_one_store_share_a_destinations_throttle(pg):
    import threading

    url, schema, table = pg
    store = make_store(url, schema, table)
    transport = make_transport(url, schema, table, "slow", "error")
    store.store(messages(200, "slow"))
    slow = DeliveryPolicy(0, 0, 0).with_throttle(20)
    results = []

    def pump():
        own = make_store(url, schema, table)  # each pump its own store object, as in its own process
        results.append(Pump(own, transport, policies={"slow": slow}).run(deadline=utcnow() + timedelta(seconds=4)))

    pumps = [threading.Thread(target=pump) for _ in range(2)]
    for p in pumps:
        p.start()
    for p in pumps:
        p.join()
    got = drain(transport, "slow")
    assert all(r.stats.dispatched for r in results)  # both pumps took part
    # 20 per second for both together (each with its own bucket: 40 per second, about 160 in 4 s).
    assert len(got) <= 20 * 4 + 5, len(got)
    assert_paced(got, 20)


def test_operator_takes_policies_and_refuses_malformed_ones(airflow_home):
    from airflow_delay_provider.core.retry_policy import PolicyError
    from airflow_delay_provider.operators.delay import DispatchDueMessagesOperator

    op = DispatchDueMessagesOperator(task_id="d", delivery_policy="smtp",
                                     destination_policies={"orders": '{"healthyRetryPolicy": {"numRetries": 1}}'})
    assert op.delivery_policy.total_attempts == 50 and op.destination_policies["orders"].num_retries == 1
    with pytest.raises(PolicyError, match="maxDelayTarget is 4000; allowed: 0..3600"):
        DispatchDueMessagesOperator(task_id="e", delivery_policy={"healthyRetryPolicy": {"maxDelayTarget": 4000}})


def test_policies_stored_per_destination_are_used_by_every_pump(db, airflow_home):
    from airflow_delay_provider.operators.delay import ProvisionDelayInfrastructureOperator

    url, schema, table = db
    store = make_store(url, schema, table)
    store.set_policies({"orders": DeliveryPolicy.immediate(1).to_dict()})
    store.set_policies({"orders": DeliveryPolicy.immediate(3).to_dict()})  # replaced, not added
    assert store.policies() == {"orders": DeliveryPolicy.immediate(3).to_dict()}
    transport = FlakyTransport(make_transport(url, schema, table, "orders", "error"), {"orders": -1})
    store.store(messages(1))
    Pump(store, transport, sleep=lambda s: None).run(stop_when_idle=True)
    [dead] = drain(transport, "error")
    assert dead.headers["x-delay-failures"] == "4"  # the stored policy's 3 retries, not the default 0
    with pytest.raises(ValueError, match="numRetries is 500"):
        ProvisionDelayInfrastructureOperator(
            task_id="p", destination_policies={"x": {"healthyRetryPolicy": {"numRetries": 500}}})
