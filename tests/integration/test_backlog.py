"""Operating the backlog on the SQL store (SQLite and the real PostgreSQL): browse, counts, cancel,
reschedule, run now, pause/resume and purge, and their races with running pumps and sweeps."""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta

import pytest

from airflow_delay_provider.core.backlog import Selector, new_due_time
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError, UnknownDestinationError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.testing import InMemoryTransport
from tests.helpers import make_store


def _orders(store, n=10, destination="orders", due_in=3600.0, body=b"x"):
    now = utcnow()
    store.store([DelayedMessage(destination, body, now + timedelta(seconds=due_in + i),
                                {"order-id": str(i)}, message_id=f"{destination}-{i}") for i in range(n)])


def _ids(messages):
    return [m["message_id"] for m in messages]


def test_browse_pages_in_due_order_with_filters_and_claims_nothing(db):
    store = make_store(*db)
    _orders(store, 7, body=b"a" * 500)
    _orders(store, 3, destination="refunds", due_in=-5)
    everything = Selector.build(allow_everything=True)
    first = store.browse(everything, limit=4)
    second = store.browse(everything, limit=4, after=first["next"])
    third = store.browse(everything, limit=4, after=second["next"])
    assert _ids(first["messages"]) == ["refunds-0", "refunds-1", "refunds-2", "orders-0"]
    assert _ids(second["messages"]) == [f"orders-{i}" for i in range(1, 5)]
    assert _ids(third["messages"]) == ["orders-5", "orders-6"] and third["next"] is None
    shown = first["messages"][3]
    assert shown["body_bytes"] == 500 and shown["body_truncated"] and len(shown["body"]) == 200
    assert shown["headers"] == {"order-id": "0"} and not shown["in_flight"] and not shown["paused"]
    assert "body" not in store.browse(everything, body_bytes=None)["messages"][0]

    by_header = store.browse(Selector.build(headers={"order-id": "1"}))
    assert _ids(by_header["messages"]) == ["refunds-1", "orders-1"]
    assert _ids(store.browse(Selector.build(destination="refunds", headers={"order-id": "2"}))["messages"]) == [
        "refunds-2"]
    window = Selector.build(destination="orders", due_from=utcnow() + timedelta(seconds=3601.5),
                            due_before=utcnow() + timedelta(seconds=3604.5))
    assert _ids(store.browse(window)["messages"]) == ["orders-2", "orders-3", "orders-4"]
    # Reading claimed nothing: the due messages are all still there for a pump.
    with store.claim_due(utcnow(), 100) as claim:
        assert sorted(m.message_id for m in claim.messages) == ["refunds-0", "refunds-1", "refunds-2"]
    with pytest.raises(InvalidInputError, match="cursor"):
        store.browse(everything, after="nonsense")


def test_backlog_counts_buckets_pauses_and_sweep_leases(db):
    store = make_store(*db)
    now = utcnow()
    dues = [-10, -1, 30, 120, 7200, 90_000, 500_000]
    store.store([DelayedMessage("orders", b"", now + timedelta(seconds=s), message_id=f"o{i}")
                 for i, s in enumerate(dues)])
    _orders(store, 2, destination="refunds", due_in=-3)
    store.set_paused(["refunds"], True)
    report = store.backlog()
    orders, refunds = report["destinations"]["orders"], report["destinations"]["refunds"]
    assert orders["histogram"] == {"due": 2, "next_minute": 1, "next_hour": 1, "next_day": 1, "later": 2}
    assert orders["scheduled"] == 7 and orders["due"] == 2 and not orders["paused"]
    assert refunds["paused"] and refunds["due"] == 2
    assert report["totals"] == {"scheduled": 9, "due": 4, "in_flight": 0, "paused_due": 2}
    store.start_sweep("sweep-1", due_before=utcnow())
    assert store.backlog("orders")["destinations"]["orders"]["in_flight"] == 2  # the paused ones stay unleased
    assert store.backlog("refunds")["destinations"]["refunds"]["in_flight"] == 0


def test_cancel_by_ids_reports_each_and_is_idempotent(db):
    store = make_store(*db)
    _orders(store, 5)
    result = store.cancel(Selector.build(message_ids=["orders-1", "orders-3", "never-sent"]))
    assert sorted(result["cancelled"]) == ["orders-1", "orders-3"]
    assert result["unknown"] == ["never-sent"] and result["gone"] == []
    again = store.cancel(Selector.build(message_ids=["orders-1"]))
    assert again["cancelled"] == [] and again["gone"] == ["orders-1"]
    assert sorted(m.message_id for m in [store.get(f"orders-{i}") for i in range(5)] if m) == [
        "orders-0", "orders-2", "orders-4"]
    # A cancelled id stays accepted: sending it again stores nothing (a retried send task cannot revive it).
    _orders(store, 2)
    assert store.get("orders-1") is None


def test_cancel_by_header_and_destination(db):
    store = make_store(*db)
    _orders(store, 4)
    _orders(store, 4, destination="refunds")
    by_header = store.cancel(Selector.build(headers={"order-id": "2"}))
    assert sorted(by_header["cancelled"]) == ["orders-2", "refunds-2"] and by_header["counts"]["cancelled"] == 2
    whole = store.cancel(Selector.build(destination="refunds"))
    assert whole["counts"]["cancelled"] == 3 and store.count_scheduled() == {"orders": 3}


def test_a_sweep_lease_makes_a_message_in_flight_not_cancelled(db):
    store = make_store(*db)
    _orders(store, 3, due_in=-1)
    store.start_sweep("sweep-2", due_before=utcnow())
    result = store.cancel(Selector.build(message_ids=["orders-0"]))
    assert result["in_flight"] == ["orders-0"] and result["cancelled"] == []
    assert store.get("orders-0") is not None


@pytest.mark.parametrize("selector", [{}, {"message_ids": []}, {"destination": ""}, {"headers": {}}])
def test_an_empty_selector_is_refused(db, selector):
    store = make_store(*db)
    _orders(store, 2)
    with pytest.raises(InvalidInputError, match="would apply to every message"):
        store.cancel(Selector.build(**selector))
    assert sum(store.count_scheduled().values()) == 2


def test_unknown_destinations_are_refused_by_name(db):
    store = make_store(*db)
    _orders(store, 1)
    with pytest.raises(UnknownDestinationError, match=r"unknown destination\(s\) \['ordres'\].*'orders'"):
        store.cancel(Selector.build(destination="ordres"))
    with pytest.raises(UnknownDestinationError):
        store.set_paused(["ordres"], True)
    with pytest.raises(UnknownDestinationError):
        store.purge("ordres", dry_run=False)
    store.register_destinations(["provisioned-only"])
    assert store.set_paused(["provisioned-only"], True) == {"changed": ["provisioned-only"], "unchanged": []}


def test_reschedule_later_and_run_now(db):
    store = make_store(*db)
    _orders(store, 3)
    later = new_due_time(store.clock(), delay_seconds=7200)
    moved = store.reschedule(Selector.build(message_ids=["orders-0"]), later)
    assert moved["rescheduled"] == ["orders-0"] and store.get("orders-0").due_at == later
    now = store.reschedule(Selector.build(message_ids=["orders-1", "orders-9"]),
                           new_due_time(store.clock(), delay_seconds=0))
    assert now["rescheduled"] == ["orders-1"] and now["unknown"] == ["orders-9"]
    with store.claim_due(utcnow(), 10) as claim:
        assert [m.message_id for m in claim.messages] == ["orders-1"]
    with pytest.raises(InvalidInputError, match="in the past"):
        new_due_time(utcnow(), deliver_at=utcnow() - timedelta(minutes=5))
    with pytest.raises(InvalidInputError, match="exactly one"):
        new_due_time(utcnow())


def test_pause_keeps_due_messages_stored_and_resume_releases_them(db):
    store = make_store(*db)
    _orders(store, 3, due_in=-2)
    _orders(store, 2, destination="refunds", due_in=-2)
    assert store.set_paused(["orders"], True)["changed"] == ["orders"]
    assert store.set_paused(["orders"], True) == {"changed": [], "unchanged": ["orders"]}
    assert store.next_due("orders") is None
    with store.claim_due(utcnow(), 10) as claim:
        assert sorted(m.message_id for m in claim.messages) == ["refunds-0", "refunds-1"]
        claim.remove([m.message_id for m in claim.messages])
    assert store.start_sweep("sweep-3", due_before=utcnow())["claimed"] == 0
    assert store.count_scheduled() == {"orders": 3}
    store.set_paused(["orders"], False)
    with store.claim_due(utcnow(), 10) as claim:
        assert [m.message_id for m in claim.messages] == ["orders-0", "orders-1", "orders-2"]


def test_purge_counts_first_then_removes_one_destination(db):
    store = make_store(*db)
    _orders(store, 5)
    _orders(store, 2, destination="refunds")
    assert store.purge("orders") == {"destination": "orders", "dry_run": True, "would_purge": 5, "in_flight": 0}
    assert store.count_scheduled() == {"orders": 5, "refunds": 2}
    assert store.purge("orders", dry_run=False)["purged"] == 5
    assert store.count_scheduled() == {"refunds": 2}


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
