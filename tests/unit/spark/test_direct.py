"""The direct reader's partitions, run in this process (no Spark): each leases its id range of the window,
reads it from the store itself and sends it, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.spark import sweep as sweep_app
from airflow_delay_provider.stores.tables import from_us
from tests.helpers import drain, make_store, make_transport
from tests.waiting import wait_for


def due(n: int, destination: str = "orders", prefix: str = "m") -> list[DelayedMessage]:
    at = utcnow() - timedelta(seconds=5)
    return [DelayedMessage(destination, f"body-{i}".encode(), at, {"n": str(i)}, f"{prefix}-{i}") for i in range(n)]


def run_partitions(db, claim_id: str, parts: int) -> list[dict]:
    """Open a sweep of everything due, plan it and run each partition on its range, as Spark would."""
    url, schema, table = db
    store = make_store(*db)
    store.open_sweep(claim_id, utcnow() + timedelta(minutes=1), lease_seconds=60)
    low, high, _ = store.window_range(claim_id)
    ranges = sweep_app.split_range(low, high, parts)
    secret = {"store": {"url": url, "table": table, "schema": schema},
              "transport": {"kind": "sql", "url": url, "schema": schema, "table_prefix": f"{table}_"}}
    settings = {"pump": {"batch_size": 100, "number_of_retries": 0, "error_queue": "error"},
                "delivery_policy": None, "destination_policies": {}, "deadline_us": None, "partitions": len(ranges)}
    run = sweep_app.sweep_ranges(secret, claim_id, settings)
    return [json.loads(line) for span in ranges for line in run(iter([span]))]


def test_each_partition_leases_reads_and_sends_its_range_once(db, monkeypatch):
    monkeypatch.setattr(sweep_app, "PAGE_ROWS", 70)  # several pages per partition
    store = make_store(*db)
    transport = make_transport(*db, "orders", "refunds", "error")
    store.store(due(600) + due(400, "refunds", "r") + due(3, "gone", "g"))
    store.store([DelayedMessage("orders", b"later", utcnow() + timedelta(hours=1), message_id="later")])
    assert store.window_range("none") == (0, -1, 0)  # no such sweep: nothing to plan

    parts = run_partitions(db, "direct-1", 3)
    assert sum(p["claimed"] for p in parts) == 1003 and sum(p["dispatched"] for p in parts) == 1000
    assert sum(p["dead_lettered"] for p in parts) == 3 and not any(p["skipped"] for p in parts)
    ids = Counter(m.message_id for q in ("orders", "refunds") for m in drain(transport, q))
    assert len(ids) == 1000 and set(ids.values()) == {1}
    assert sorted(m.message_id for m in drain(transport, "error")) == ["g-0", "g-1", "g-2"]
    assert store.sweep_record("direct-1")["claimed"] == 1003
    assert store.sweep_progress("direct-1") == (1003, 0)
    assert store.count_scheduled() == {"orders": 1}  # due in an hour: not leased

    again = run_partitions(db, "direct-2", 3)
    assert again == []  # a re-run of the window plans nothing


def test_partitions_take_over_an_expired_lease_and_lease_nothing_for_a_finished_sweep(db):
    store = make_store(*db)
    transport = make_transport(*db, "orders", "error")
    store.store(due(300))
    store.start_sweep("crashed", utcnow() + timedelta(minutes=1), lease_seconds=0.001)  # expires at once
    store.store(due(100, prefix="n"))

    store.open_sweep("finished", utcnow() + timedelta(minutes=1))
    store.finish_sweep("finished", "killed", {})
    assert store.lease_range("finished", 0, 10**9) == {"claimed": 0, "taken_over": 0}

    parts = run_partitions(db, "rescue", 2)
    assert sum(p["taken_over"] for p in parts) == 300 and sum(p["claimed"] for p in parts) == 400
    record = store.sweep_record("rescue")
    assert (record["claimed"], record["taken_over"]) == (400, 300)
    assert len({m.message_id for m in drain(transport, "orders")}) == 400


def test_sparse_ids_are_leased_and_read_by_rows_not_by_id_steps(db, monkeypatch):
    monkeypatch.setattr(sweep_app, "PAGE_ROWS", 4)
    store = make_store(*db)
    later = utcnow() + timedelta(hours=1)
    for i in range(40):  # every other id is due later: the window's ids are sparse
        store.store(due(1, prefix=f"d{i}") + [DelayedMessage("orders", b"x", later, message_id=f"later-{i}")])
    store.open_sweep("sparse", utcnow() + timedelta(minutes=1))
    low, high, n = store.window_range("sparse")
    assert n == 40 and high - low == 78
    assert store.lease_range("sparse", low, high, step=7) == {"claimed": 40, "taken_over": 0}
    rows = list(sweep_app.claimed_pages(store, "sparse", low, high))
    assert [row[1] for row in rows] == [f"d{i}-0" for i in range(40)]
    assert store.sweep_progress("sparse") == (40, 40)


def test_partitions_move_rows_into_queues_of_the_store_database_in_one_statement(pg, monkeypatch):
    """PostgreSQL with the queues beside the store: a partition leases and moves its rows by statement
    (move_window), not through Python; a throttled destination and a missing queue are leased and left to the
    Pump over the rest."""
    from airflow_delay_provider.transports.sql import SqlTableTransport

    calls = []
    move_window = SqlTableTransport.move_window

    def recording(self, store, claim_id, low, high, limit, exclude=()):
        got = move_window(self, store, claim_id, low, high, limit, exclude)
        calls.append(({d for d, *_ in got[0]}, set(exclude)))
        return got

    monkeypatch.setattr(SqlTableTransport, "move_window", recording)
    store = make_store(*pg)
    transport = make_transport(*pg, "orders", "slow", "error")
    store.set_policies({"slow": {"throttlePolicy": {"maxReceivesPerSecond": 1000}}})
    store.store(due(500) + due(5, "slow", "s") + due(2, "gone", "g"))
    parts = run_partitions(pg, "move-1", 2)
    assert sum(p["dispatched"] for p in parts) == 505 and sum(p["dead_lettered"] for p in parts) == 2
    moved = set().union(*(m for m, _ in calls))
    assert moved == {"orders"} and all(exclude == {"slow"} for _, exclude in calls)
    ids = Counter(m.message_id for m in drain(transport, "orders"))
    assert len(ids) == 500 and set(ids.values()) == {1}
    assert len(drain(transport, "slow")) == 5 and len(drain(transport, "error")) == 2
    assert store.count_scheduled() == {} and store.sweep_progress("move-1") == (507, 0)


def test_a_move_takes_only_the_running_sweeps_window_and_counts_what_it_leased(pg):
    """move_window leases and moves in one statement: rows of the window only (not a paused destination's, not
    those due after the sweep opened, not those a live sweep holds), counted in the sweep's record; nothing once
    the sweep has finished."""
    store = make_store(*pg)
    transport = make_transport(*pg, "orders", "held", "error")
    store.store(due(50) + due(3, "held", "h"))
    store.start_sweep("live", utcnow() + timedelta(minutes=1), lease_seconds=600)  # holds those 53
    store.store(due(40, prefix="n") + due(2, "held", "k"))
    store.set_paused(["held"], True)
    store.start_sweep("dead", utcnow() + timedelta(minutes=1), lease_seconds=0.001)  # holds the 40: expires
    store.store(due(10, prefix="f"))
    opened = from_us(store.open_sweep("mover", utcnow() + timedelta(minutes=1), lease_seconds=60))
    soon = opened + timedelta(seconds=0.2)
    store.store([DelayedMessage("orders", b"late", soon, message_id=f"late-{i}") for i in range(5)])
    wait_for(lambda: store.clock() >= soon, 10, "the late ones to fall due")  # due now, but not when it opened
    moved, taken_over = transport.move_window(store, "mover", 0, 10**9, 1000)
    assert sum(n for _, _, n in moved) == 50 and taken_over == 40 and {d for d, *_ in moved} == {"orders"}
    got = {m.message_id for m in drain(transport, "orders")}
    assert got == {f"n-{i}" for i in range(40)} | {f"f-{i}" for i in range(10)}
    record = store.sweep_record("mover")
    assert (record["claimed"], record["taken_over"]) == (50, 40)
    assert transport.move_window(store, "mover", 0, 10**9, 1000) == ([], 0)  # nothing left for it

    store.finish_sweep("mover", "done", {})
    store.open_sweep("over", utcnow() + timedelta(minutes=1), lease_seconds=60)
    store.finish_sweep("over", "killed", {})
    assert transport.move_window(store, "over", 0, 10**9, 1000) is None
    assert store.count_scheduled() == {"orders": 55, "held": 5}  # the live sweep's 50, the 5 late ones


def test_a_sweep_on_a_store_not_there_fails_before_anything_and_creates_nothing(db):
    """A sweep writes, so it may create or upgrade the store only where its connection says `auto_migrate`: without
    it, a store that is not there (a mistyped schema, no provisioning yet) fails the sweep before Spark reads anything,
    naming what to run, and nothing is created."""
    import pytest
    from sqlalchemy import inspect

    from airflow_delay_provider.core.errors import StoreNotReadyError

    url, schema, table = db
    spec = {"url": url, "table": table, "schema": schema, "auto_migrate": False}
    args = sweep_app.parse_args(["--due-before", utcnow().isoformat(), "--reader", "direct"])
    with pytest.raises(StoreNotReadyError, match="db upgrade"):
        sweep_app.sweep(None, {"store": spec, "transport": {"kind": "sql", "url": url, "schema": schema}}, args)
    store = sweep_app.store_from_spec(spec)
    with store.engine.connect() as conn:
        assert not inspect(conn).has_table(table, schema=schema)
