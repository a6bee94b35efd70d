"""Operating the backlog where only the SQL store (SQLite and the real PostgreSQL) is concerned: messages a
bulk sweep holds, and actions racing running pumps. What every store does (browse, counts, cancel,
reschedule, run now, pause/resume, purge) is in tests/contract/test_store_contract.py."""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.testing import InMemoryTransport
from tests.helpers import make_store, orders, spread_backlog
from tests.waiting import wait_for


def test_backlog_counts_what_a_sweep_leases_as_in_flight(db):
    store = make_store(*db)
    spread_backlog(store)
    store.start_sweep("sweep-1", due_before=utcnow())
    assert store.backlog("orders")["destinations"]["orders"]["in_flight"] == 2  # the paused ones stay unleased
    assert store.backlog("refunds")["destinations"]["refunds"]["in_flight"] == 0


def test_a_sweep_lease_makes_a_message_in_flight_not_cancelled(db):
    store = make_store(*db)
    orders(store, 3, due_in=-1)
    store.start_sweep("sweep-2", due_before=utcnow())
    result = store.cancel(Selector.build(message_ids=["orders-0"]))
    assert result["in_flight"] == ["orders-0"] and result["cancelled"] == []
    assert store.get("orders-0") is not None


def test_a_new_sweep_leaves_a_paused_destination_stored(db):
    store = make_store(*db)
    orders(store, 3, due_in=-2)
    orders(store, 2, destination="refunds", due_in=-2)
    store.set_paused(["orders"], True)
    with store.claim_due(utcnow(), 10) as claim:
        assert sorted(m.message_id for m in claim.messages) == ["refunds-0", "refunds-1"]
        claim.remove([m.message_id for m in claim.messages])
    assert store.start_sweep("sweep-3", due_before=utcnow())["claimed"] == 0
    assert store.count_scheduled() == {"orders": 3}
    store.set_paused(["orders"], False)
    assert store.start_sweep("sweep-4", due_before=utcnow())["claimed"] == 3


class _SlowFlaky(InMemoryTransport):
    """Refuses a third of the sends (so claims write messages back for a retry) and takes its time."""

    def __init__(self) -> None:
        super().__init__()
        self.sent_at: dict[str, float] = {}
        self.in_send: list[str] = []

    def send(self, messages, connection=None):
        self.in_send = [m.message_id for m in messages]  # what a claim holds right now
        threading.Event().wait(0.01)
        refused = {m.message_id: RuntimeError("503") for m in messages if random.random() < 0.33}
        result = super().send([m for m in messages if m.message_id not in refused])
        self.sent_at.update((m.message_id, time.monotonic()) for m in messages if m.message_id not in refused)
        return {**refused, **result}


def test_cancel_and_reschedule_race_pumps_without_a_message_both_cancelled_and_delivered(pg):
    """Two pumps drain 3,000 due messages through a flaky transport (claims write back retries) while
    cancels, reschedules and a pause hit random ids. Afterwards every message was either delivered
    exactly once or cancelled, never both, and nothing was lost."""
    store = make_store(*pg)
    n = 3000
    transport = _SlowFlaky()
    for queue in ("orders", "error"):
        transport.provision(queue)
    store.store([DelayedMessage("orders", b"x", utcnow() - timedelta(seconds=1), message_id=f"m{i}")
                 for i in range(n)])
    pumps = [Pump(make_store(*pg), transport, PumpConfig(batch_size=50, number_of_retries=100))
             for _ in range(2)]
    threads = [threading.Thread(target=p.run, kwargs={"stop_when_idle": True}) for p in pumps]
    for t in threads:
        t.start()
    cancelled, gone, rng = set(), {}, random.Random(7)
    while any(t.is_alive() for t in threads):
        # Half of the ids are rows a claim holds at this moment: the cancel waits for that claim.
        ids = rng.sample(transport.in_send, min(10, len(transport.in_send))) + [f"m{rng.randrange(n)}"
                                                                                for _ in range(10)]
        result = store.cancel(Selector.build(message_ids=ids))
        cancelled.update(result["cancelled"])
        gone.update((m, time.monotonic()) for m in result["gone"] if m not in gone)
        store.reschedule(Selector.build(message_ids=[f"m{rng.randrange(n)}"]), store.clock())
    for t in threads:
        t.join()
    delivered = [m.message_id for m in transport.receive("orders", max_messages=10 * n)]
    assert len(delivered) == len(set(delivered))  # the in-memory transport is exactly-once here
    assert cancelled, "the race never hit a scheduled message: the test did not test anything"
    assert not cancelled & set(delivered)
    assert cancelled | set(delivered) == {f"m{i}" for i in range(n)}
    # "gone" was true when said: the message had been sent (or cancelled) before the report came back,
    # never written back for a retry and delivered after it.
    late = [m for m, at in gone.items() if m not in cancelled and transport.sent_at[m] > at]
    assert late == []
    assert transport.receive("error", max_messages=n) == []


def test_an_id_a_claim_writes_back_after_the_last_pass_is_reported_in_flight_not_gone(pg, monkeypatch):
    """A cancel waits for the claim holding a row; a claim that fails writes the row back for a retry, which the
    next pass finds. When pumps claim it again before every pass, the passes run out with the row still stored:
    it was reported gone (delivered), and delivered after the report. Now it is reported in flight."""
    import psycopg
    from sqlalchemy import text

    from airflow_delay_provider.stores import backlog

    store = make_store(*pg)
    store.store([DelayedMessage("orders", b"x", utcnow() + timedelta(minutes=5), message_id="m-1")])
    monkeypatch.setattr(backlog, "_PASSES", 1)
    table = store.qualified(store.tables.messages.name)
    columns = "message_id, destination, body, headers, due_at_us, stored_at_us, failures, claim_id, tier"
    result: dict = {}
    with psycopg.connect(pg[0].replace("postgresql+psycopg://", "postgresql://")) as claim:
        # A claim: the row deleted in a transaction that is still open.
        rows = claim.execute(f"DELETE FROM {table} WHERE message_id = 'm-1' RETURNING {columns}").fetchall()
        cancelling = threading.Thread(target=lambda: result.update(store.cancel(Selector.build(message_ids=["m-1"]))))
        cancelling.start()

        def waits() -> bool:
            with store.engine.connect() as conn:
                return conn.execute(text(  # this test's cancel, not another test's wait in the same database
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE NOT l.granted "
                    "AND position(:table in a.query) > 0"), {"table": store.tables.messages.name}).scalar_one() > 0

        deadline = time.monotonic() + 30
        while not waits() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert waits(), "the cancel never waited for the claim"
        # The send failed: written back for a retry, in the same transaction, which then commits.
        claim.execute(f"INSERT INTO {table} ({columns}) VALUES ({', '.join(['%s'] * 9)})", rows[0])
        claim.commit()
    cancelling.join(30)
    assert result["in_flight"] == ["m-1"] and "m-1" not in result.get("gone", []), result
    assert result["cancelled"] == [] and store.get("m-1") is not None


def test_a_cancel_by_a_filter_in_batches_races_pumps_without_a_message_both_cancelled_and_delivered(pg):
    """Two pumps drain 3,000 due messages through a flaky transport while one cancel by a body search (900 of them)
    runs in batches of 25, each its own transaction. Every marked message is then cancelled or delivered, never
    both; every other one delivered; the report's count is what it removed."""
    store = make_store(*pg)
    store.controls.batch = 25
    n = 3000
    transport = _SlowFlaky()
    for queue in ("orders", "error"):
        transport.provision(queue)
    marked = {f"m{i}" for i in range(0, n, 10)} | {f"m{i}" for i in range(3, n, 5)}
    store.store([DelayedMessage("orders", b"cancel me" if f"m{i}" in marked else b"keep",
                                utcnow() - timedelta(seconds=1), message_id=f"m{i}") for i in range(n)])
    pumps = [Pump(make_store(*pg), transport, PumpConfig(batch_size=50, number_of_retries=100))
             for _ in range(2)]
    threads = [threading.Thread(target=p.run, kwargs={"stop_when_idle": True}) for p in pumps]
    for t in threads:
        t.start()
    wait_for(lambda: len(transport.sent_at) >= 100, 60, "the pumps delivering")
    report = store.cancel(Selector.build(body_contains="cancel me"))
    for t in threads:
        t.join()
    delivered = [m.message_id for m in transport.receive("orders", max_messages=10 * n)]
    cancelled = set(report["cancelled"])
    assert len(delivered) == len(set(delivered))
    assert len(cancelled) == report["counts"]["cancelled"] > 0 and report["batches"] > 1
    assert not cancelled & set(delivered)
    assert cancelled <= marked and cancelled | set(delivered) == {f"m{i}" for i in range(n)}
    # Held by a claim's retry through every pass: reported in flight, never silently left.
    assert set(report["in_flight"]) <= (marked - cancelled) & set(delivered)
