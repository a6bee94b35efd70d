"""The store on PostgreSQL as users run it, with autovacuum on, beside a server with it off (the machines' own is
tuned off): autovacuum leaves the hours' partitions of `_later` to the store, keeps the other tables, and the two
never do the same work twice; the hour past's truncation waits for a vacuum of it without holding up the moves;
and a pump delivers the same way on both. Each server is a throwaway cluster of the installed PostgreSQL
(tests/pg_cluster.py) with its shipped settings, autovacuum's pause between rounds aside (1 s instead of 60)."""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import create_engine, text

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump
from airflow_delay_provider.stores import tables, tiers
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.stores.tables import to_us
from airflow_delay_provider.stores.upkeep import Thresholds
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests import pg_cluster
from tests.helpers import drain
from tests.waiting import wait_for


@pytest.fixture(scope="module", params=["on", "off"], ids=["autovacuum-on", "autovacuum-off"])
def server(request):
    """(url, autovacuum) of a throwaway cluster with autovacuum on or off."""
    try:
        with pg_cluster.throwaway_cluster({"autovacuum": request.param, "autovacuum_naptime": "1"}) as url:
            engine = create_engine(url)
            with engine.connect() as conn:
                assert conn.execute(text("SHOW autovacuum")).scalar() == request.param  # read, not assumed
            engine.dispose()
            yield url, request.param == "on"
    except pg_cluster.ClusterError as exc:
        pytest.fail(f"{exc} (these tests run PostgreSQL clusters of their own, with autovacuum on and off)",
                    pytrace=False)


@pytest.fixture
def store(server):
    url, _ = server
    schema = f"av_{uuid.uuid4().hex[:8]}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    made = SqlDelayedMessageStore(url, table="delayed", schema=schema)
    made.create_schema()
    yield made
    made.close()
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    engine.dispose()


def _messages(n: int, delay: float, start: int = 0, body: int = 16) -> list[DelayedMessage]:
    due = utcnow() + timedelta(seconds=delay)
    return [DelayedMessage("orders", b"x" * body, due, {"n": str(i)}, f"m-{i}") for i in range(start, start + n)]


def _hour_partition(store: SqlDelayedMessageStore, seconds_ahead: float) -> str:
    due_us = to_us(store.clock()) + int(seconds_ahead * 1_000_000)
    return store.qualified(store.tables.hours[tables.hour_tier(due_us) - tables.FIRST_HOUR].name)


def _stats(store: SqlDelayedMessageStore, name: str) -> dict:
    with store.engine.connect() as conn:  # a transaction of its own: one keeps the counters it read first
        return dict(conn.execute(text(
            "SELECT n_dead_tup, vacuum_count, autovacuum_count, analyze_count, autoanalyze_count "
            "FROM pg_stat_user_tables WHERE relid = to_regclass(:t)"), {"t": name}).mappings().one())


def _options(store: SqlDelayedMessageStore, name: str) -> list[str]:
    with store.engine.connect() as conn:
        return conn.execute(text("SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = to_regclass(:t)"),
                            {"t": name}).scalar_one()


def test_autovacuum_leaves_the_hours_partitions_to_the_store_and_neither_does_the_others_work_twice(store, server):
    _, autovacuum = server
    soon, far = store.qualified(store.tables.soon.name), store.qualified(store.tables.far.name)
    hour = _hour_partition(store, 7200)
    every_hour = [store.qualified(t.name) for t in store.tables.hours]
    assert all("autovacuum_enabled=false" in _options(store, name) for name in every_hour)
    assert not any(o.startswith("autovacuum_enabled") for name in (soon, far) for o in _options(store, name))
    # Thresholds that the dead rows below pass, on both, so that only `autovacuum_enabled` tells them apart.
    with store.engine.begin() as conn:
        for name in (soon, hour):
            conn.execute(text(f"ALTER TABLE {name} SET (autovacuum_vacuum_threshold = 50, "
                              "autovacuum_vacuum_scale_factor = 0, autovacuum_analyze_threshold = 50, "
                              "autovacuum_analyze_scale_factor = 0)"))
    store.store(_messages(500, delay=7200))
    store.cancel(Selector(message_ids=[f"m-{i}" for i in range(500)]))
    # Counted before `_soon` has any: autovacuum's round that takes `_soon` has seen these.
    wait_for(lambda: (c := _stats(store, hour))["n_dead_tup"] >= 500 or c["autovacuum_count"], 30,
             f"the counters of {hour}")
    store.store(_messages(500, delay=30, start=500))  # within `SOON_US`: `_soon`
    store.cancel(Selector(message_ids=[f"m-{i}" for i in range(500, 1000)]))
    if autovacuum:
        # A round of autovacuum after both had their dead rows: it looked at both, and took `_soon` only.
        wait_for(lambda: _stats(store, soon)["autovacuum_count"] >= 1, 60, f"autovacuum to vacuum {soon}")
        wait_for(lambda: _stats(store, soon)["autoanalyze_count"] >= 1, 60, f"autovacuum to analyse {soon}")
        assert _stats(store, hour) == {"n_dead_tup": 500, "vacuum_count": 0, "autovacuum_count": 0,
                                       "analyze_count": 0, "autoanalyze_count": 0}
    else:
        wait_for(lambda: _stats(store, soon)["n_dead_tup"] >= 500, 30, f"the counters of {soon}")
    small = Thresholds(analyze_base=50, analyze_fraction=0.0, vacuum_base=50, vacuum_fraction=0.0,
                       emptied_vacuum_base=50, emptied_vacuum_fraction=0.0, growing_analyze_fraction=0.0)
    store.maintenance.thresholds = store.later_maintenance.thresholds = small
    done = {(store.qualified(t), w) for t, w, _ in store.maintenance.run() + store.later_maintenance.run()}
    # The store's upkeep does the hours' partitions on both servers; `_soon` where autovacuum did not already.
    assert {(hour, "vacuum"), (hour, "analyze")} <= done, done
    assert ((soon, "vacuum") in done) is not autovacuum, done
    after = _stats(store, hour)
    assert (after["vacuum_count"], after["autovacuum_count"], after["n_dead_tup"]) == (1, 0, 0)
    assert (_stats(store, soon)["vacuum_count"] + _stats(store, soon)["autovacuum_count"]) == 1


def test_the_hour_pasts_truncation_waits_for_a_vacuum_of_it_while_the_moves_go_on(store, monkeypatch, caplog):
    """A vacuum of the hour past's partition holds the lock its truncation needs: autovacuum's to prevent
    wraparound (which no option turns off and which never yields) or one someone ran. Stood for here by a VACUUM
    slowed down, as autovacuum paces itself. The move goes on meanwhile, and the truncation follows the vacuum."""
    store.store(_messages(300, delay=7200, body=400))
    past = _hour_partition(store, 7200)
    store.cancel(Selector(message_ids=[f"m-{i}" for i in range(300)]))
    store.store(_messages(5, delay=3 * 3600 + 20, start=300))  # in `_later`, the partition of 3 hours on
    real_clock = store.clock
    monkeypatch.setattr(store, "clock", lambda: real_clock() + timedelta(hours=3))  # that hour is the one past

    def size() -> int:
        with store.engine.connect() as conn:
            return conn.execute(text("SELECT pg_relation_size(:t)"), {"t": past}).scalar_one()

    assert size() > 0  # its dead rows' pages
    vacuum_url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)

    def vacuum() -> None:
        with psycopg.connect(vacuum_url, autocommit=True) as conn:
            conn.execute("SET vacuum_cost_delay = 100")  # ms a pause, the most there is
            conn.execute("SET vacuum_cost_limit = 1")  # a pause at every page
            conn.execute(f"VACUUM {past}")

    def vacuuming() -> bool:
        with store.engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM pg_stat_progress_vacuum WHERE relid = to_regclass(:t)"),
                                {"t": past}).scalar_one() > 0

    thread = threading.Thread(target=vacuum)
    thread.start()
    try:
        wait_for(vacuuming, 30, f"a VACUUM of {past}")
        with caplog.at_level(logging.INFO, logger=tiers.__name__):
            assert store.later.run() == 5  # the move goes on
        assert vacuuming()  # still running: the run did not wait it out
        assert store.later.rested_hour is None and size() > 0
        assert "waits for a vacuum of it (a VACUUM someone ran" in caplog.text
    finally:
        thread.join(120)
    assert not thread.is_alive()
    assert store.later.rest() is True and size() == 0


def test_a_pump_delivers_messages_moved_from_later_once_each_and_none_early(store, server, monkeypatch):
    url, _ = server
    monkeypatch.setattr(tables, "SOON_US", 500_000)
    monkeypatch.setattr(tiers, "SOON_US", 2_000_000)
    monkeypatch.setattr(tiers, "MOVE_EVERY_SECONDS", 0.2)
    batch = _messages(300, delay=3) + _messages(100, delay=-1, start=300)
    store.store(batch)
    queue = SqlTableTransport(url, schema=store.schema, table_prefix="delayed_")
    queue.provision("orders")
    result = Pump(store, queue).run(due_before=max(m.due_at for m in batch) + timedelta(microseconds=1))
    received = drain(queue, "orders")
    assert sorted(m.message_id for m in received) == sorted(m.message_id for m in batch)
    due = {m.message_id: m.due_at for m in batch}
    assert all(m.enqueued_at >= due[m.message_id] for m in received)
    assert result.stats.dispatched == 400 and store.backlog()["totals"]["scheduled"] == 0
