"""The backlog's counts per ten minutes of due time on the real PostgreSQL: whatever writes the messages table
(sends, claims, retries, moves, sweeps, cancels, reschedules, purges, a TRUNCATE), the counts give what counting
the rows gives."""

from __future__ import annotations

import threading
from datetime import timedelta

from sqlalchemy import func, select

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump
from airflow_delay_provider.stores.migrations import latest_version
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.stores.tables import to_us
from airflow_delay_provider.testing import InMemoryTransport
from airflow_delay_provider.transports.sql import SqlTableTransport

#: Due times over a week, around every bucket's limit and across slot boundaries.
OFFSETS = [-120, -1, 0, 1, 59, 61, 599, 601, 3_599, 3_601, 86_399, 86_401, 5 * 86_400, 6.5 * 86_400]


def _store(pg, **kwargs) -> SqlDelayedMessageStore:
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema, **kwargs)
    store.create_schema()
    assert store.controls.counts.counted()
    return store


def _spread(n: int, destination: str, start: float = 0.0) -> list[DelayedMessage]:
    now = utcnow()
    return [DelayedMessage(destination, b"x", now + timedelta(seconds=start + OFFSETS[i % len(OFFSETS)]))
            for i in range(n)]


def assert_counts_match(store: SqlDelayedMessageStore) -> None:
    now_us = to_us(store.clock())
    with store.engine.connect() as conn:
        counted = sorted(store.controls.counts.from_counts(conn, now_us, None))
    with store.engine.connect() as conn:
        scanned = sorted(store.controls.counts.from_rows(conn, now_us, None))
    assert counted == scanned
    for destination, *_ in scanned:
        with store.engine.connect() as conn:
            one = store.controls.counts.from_counts(conn, now_us, destination)
        assert one == [row for row in scanned if row[0] == destination]


def test_sends_claims_and_retries_keep_the_counts(pg):
    store = _store(pg)
    store.store(_spread(300, "orders") + _spread(50, "billing"))  # COPY
    store.store(_spread(10, "orders"))
    assert_counts_match(store)
    again = _spread(1, "orders")
    store.store(again)
    assert store.store([*_spread(5, "orders"), *again]) == 5  # an id already there: the ON CONFLICT path
    assert_counts_match(store)

    transport = InMemoryTransport()
    transport.provision("billing")  # "orders" is missing: its due messages are retried, then dead-lettered
    transport.provision("error")
    Pump(store, transport).run(stop_when_idle=True)
    assert_counts_match(store)
    assert store.backlog()["totals"]["scheduled"] == sum(store.count_scheduled().values())


def test_moves_into_sql_queues_keep_the_counts(pg):
    url, schema, table = pg
    store = _store(pg)
    queue = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    queue.provision("orders")
    # None due within the next 50 s: one due a second later, after a pump that stops when idle, would be due
    # by the time the backlog is read on a busy machine, and not moved.
    now = utcnow()
    store.store([m for m in _spread(200, "orders") if not now < m.due_at < now + timedelta(seconds=50)])
    Pump(store, queue).run(stop_when_idle=True)
    assert_counts_match(store)
    assert store.backlog("orders")["destinations"]["orders"]["due"] == 0
    assert queue.depth("orders")["visible"] > 0  # the due ones were moved


def test_backlog_controls_keep_the_counts(pg):
    store = _store(pg)
    messages = _spread(240, "orders") + _spread(24, "billing")
    store.store(messages)
    store.cancel(Selector.build(message_ids=[m.message_id for m in messages[:30]]))
    assert_counts_match(store)
    store.reschedule(Selector.build(destination="orders", due_from=utcnow() + timedelta(days=4)),
                     utcnow() + timedelta(minutes=30))  # across hours and buckets
    assert_counts_match(store)
    store.purge("billing", dry_run=False)
    assert_counts_match(store)
    assert "billing" not in [row[0] for row in _scan(store)]


def test_sweep_leases_count_in_flight(pg):
    store = _store(pg)
    store.store(_spread(120, "orders", start=-600_000))  # all due
    store.start_sweep("sweep-1", due_before=utcnow())
    assert_counts_match(store)
    assert store.backlog()["destinations"]["orders"]["in_flight"] == 120


def test_truncate_empties_the_counts(pg):
    store = _store(pg)
    store.store(_spread(50, "orders"))
    with store.engine.begin() as conn:
        conn.exec_driver_sql(f"TRUNCATE {store.qualified(store.table_name)}")
    assert store.backlog()["totals"]["scheduled"] == 0
    assert_counts_match(store)


def test_upkeep_sums_the_rows_of_changes_up(pg):
    # The store's clock stands still: messages due a second after the send must not fall due between the two
    # reports (a busy machine took longer than that for the upkeep in between).
    frozen = utcnow()
    store = _store(pg, local_clock=lambda: frozen)
    for _ in range(20):
        store.store(_spread(24, "orders"))
    before = store.backlog()
    rows = _count_rows(store)
    store.maintenance.run()
    c = store.tables.counts.c
    with store.engine.connect() as conn:
        groups = conn.execute(select(func.count()).select_from(
            select(c.slot).group_by(c.destination, c.slot).subquery())).scalar()
    assert _count_rows(store) == groups < rows  # one row per destination and slot
    assert store.backlog()["destinations"] == before["destinations"]
    Pump(store, _provisioned("orders")).run(stop_when_idle=True)  # its upkeep sums up the claims' rows too
    assert_counts_match(store)


def test_a_sum_up_replaces_every_row_of_changes_and_says_how_many(pg):
    store = _store(pg)
    for _ in range(5):
        store.store(_spread(24, "orders"))
    rows = _count_rows(store)
    with store.engine.begin() as conn:
        replaced = store.controls.counts.sum_up_counts(conn)
    assert replaced == rows > _count_rows(store)
    with store.engine.begin() as conn:  # one row per destination and slot already: replaced by themselves
        assert store.controls.counts.sum_up_counts(conn) == _count_rows(store)
    assert_counts_match(store)


def test_concurrent_pumps_and_senders_keep_the_counts(pg):
    url, schema, table = pg
    store = _store(pg)
    errors = []

    def send() -> None:
        try:
            sender = SqlDelayedMessageStore(url, table=table, schema=schema)
            for _ in range(10):
                sender.store(_spread(50, "orders", start=-3_600))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    def pump() -> None:
        try:
            own = SqlDelayedMessageStore(url, table=table, schema=schema)
            Pump(own, _provisioned("orders")).run(stop_when_idle=True)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=f) for f in (send, send, pump, pump)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert_counts_match(store)


def test_a_store_upgraded_with_rows_starts_with_their_counts(pg):
    url, schema, table = pg
    old = SqlDelayedMessageStore(url, table=table, schema=schema)
    old.migrate(up_to=5)
    old.store(_spread(100, "orders") + _spread(7, "billing"))
    assert not old.controls.counts.counted()
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    assert store.migrate() == list(range(6, latest_version() + 1))
    assert_counts_match(store)
    assert store.backlog()["totals"]["scheduled"] == 107


def test_hourly_counts_become_ten_minute_counts_with_their_rows(pg):
    url, schema, table = pg
    old = SqlDelayedMessageStore(url, table=table, schema=schema)
    old.migrate(up_to=6)
    old.store(_spread(140, "orders") + _spread(9, "billing"))
    counts = old.qualified(old.tables.counts.name)
    with old.engine.connect() as conn:
        hourly = conn.exec_driver_sql(f"SELECT sum(n), count(DISTINCT hour) FROM {counts}").one()
    assert hourly[0] == 149
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    assert store.migrate() == list(range(7, latest_version() + 1))
    with store.engine.connect() as conn:
        total, slots = conn.execute(select(func.sum(store.tables.counts.c.n),
                                           func.count(store.tables.counts.c.slot.distinct()))).one()
    assert total == 149 and slots > hourly[1]  # 599 s and 601 s fall in two slots of one hour
    assert_counts_match(store)
    store.store(_spread(14, "orders", start=30))  # the triggers count new rows per slot too
    assert_counts_match(store)


def _provisioned(destination: str) -> InMemoryTransport:
    transport = InMemoryTransport()
    transport.provision(destination)
    return transport


def _scan(store):
    with store.engine.connect() as conn:
        return store.controls.counts.from_rows(conn, to_us(store.clock()), None)


def _count_rows(store) -> int:
    with store.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(store.tables.counts)).scalar()
