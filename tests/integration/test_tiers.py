"""The two partitions of a PostgreSQL store's messages (schema version 8): messages due within minutes in `_soon`,
the rest in `_later`, moved into `_soon` as they come due; every read, claim and count sees both."""

from __future__ import annotations

import dataclasses
import json
import threading
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import event, text

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump
from airflow_delay_provider.stores import tables, tiers
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.stores.tables import SOON_US, from_us, to_us
from airflow_delay_provider.testing import InMemoryTransport
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.helpers import drain, messages, plan_nodes
from tests.waiting import wait_for


def _store(pg, **kwargs) -> SqlDelayedMessageStore:
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema, **kwargs)
    store.create_schema()
    assert store.tiered()
    return store


def _where(store: SqlDelayedMessageStore) -> dict[str, str]:
    """Each stored message id: "soon" or "later", the partition that holds it."""
    found = {}
    with store.engine.connect() as conn:
        for part in ("soon", "later"):
            table = store.qualified(getattr(store.tables, part).name)
            found.update({m: part for m in conn.execute(text(f"SELECT message_id FROM {table}")).scalars()})
    return found


def _leaves(store: SqlDelayedMessageStore) -> dict[str, str]:
    """Each stored message id: the name of the table that holds it (`_soon`, `_far`, an hour's partition)."""
    with store.engine.connect() as conn:
        return dict(conn.execute(text(
            f"SELECT m.message_id, c.relname FROM {store.qualified(store.table_name)} AS m JOIN pg_class AS c "
            "ON c.oid = m.tableoid"
        )).all())


def _scheduled(store: SqlDelayedMessageStore) -> int:
    return store.backlog()["totals"]["scheduled"]


def test_messages_go_to_the_partition_of_their_due_time_and_every_read_sees_both(pg):
    store = _store(pg)
    soon_s = SOON_US / 1e6
    store.store(messages(3, delay=-1) + messages(2, delay=soon_s - 30, start=3) + messages(4, delay=3600, start=5))
    assert _where(store) == {**{f"m-{i}": "soon" for i in range(5)}, **{f"m-{i}": "later" for i in range(5, 9)}}
    assert store.count_scheduled() == {"orders": 9}
    assert _scheduled(store) == 9  # the counts' triggers are on the partitioned table
    listed = store.browse(Selector(destination="orders"), limit=100)["messages"]
    assert [m["message_id"] for m in listed] == [f"m-{i}" for i in range(9)]  # in due order across both
    assert store.get("m-7").body == b"body-7"
    # Cancel, reschedule and purge reach either partition.
    assert store.cancel(Selector(message_ids=["m-1", "m-6"]))["cancelled"] == ["m-1", "m-6"]
    moved_to = utcnow() - timedelta(seconds=1)
    assert store.reschedule(Selector(message_ids=["m-8"]), moved_to)["rescheduled"] == ["m-8"]
    with store.claim_due(utcnow(), 100) as claim:  # the due ones, from both partitions, in due order
        assert [m.message_id for m in claim.messages] == ["m-0", "m-2", "m-8"]
        claim.remove([m.message_id for m in claim.messages])
    assert _scheduled(store) == 4 and store.count_scheduled() == {"orders": 4}
    assert store.purge("orders", dry_run=False)["purged"] == 4
    assert _where(store) == {} and _scheduled(store) == 0


def test_the_move_brings_messages_into_soon_before_they_are_due(pg, monkeypatch):
    store = _store(pg)
    monkeypatch.setattr(tables, "SOON_US", 1_000_000)  # sends due more than 1 s later go to _later
    store.store(messages(3, delay=20) + messages(2, delay=3600, start=3))
    assert set(_where(store).values()) == {"later"}
    histogram = store.backlog()["destinations"]["orders"]["histogram"]
    monkeypatch.setattr(tiers, "SOON_US", 60_000_000)  # moved within a minute of their due time
    assert store.later.run() == 3
    assert _where(store) == {"m-0": "soon", "m-1": "soon", "m-2": "soon", "m-3": "later", "m-4": "later"}
    assert store.later.run() == 0  # nothing more is due within the minute
    # A move is a delete and an insert of the same rows: the counts and everything read are as before.
    assert store.backlog()["destinations"]["orders"]["histogram"] == histogram
    assert store.get("m-1").due_at == store.get("m-0").due_at
    assert [m["message_id"] for m in store.browse(Selector(destination="orders"))["messages"]] == [
        f"m-{i}" for i in range(5)]


def test_a_pump_moves_and_delivers_messages_stored_for_later_once_each(pg, monkeypatch):
    """Sent as `_later` messages (due beyond the threshold when stored), moved while the pump waits, delivered
    once each and none early, into the SQL-table queue."""
    url, schema, table = pg
    store = _store(pg)
    monkeypatch.setattr(tables, "SOON_US", 500_000)
    monkeypatch.setattr(tiers, "SOON_US", 2_000_000)
    monkeypatch.setattr(tiers, "MOVE_EVERY_SECONDS", 0.2)
    batch = messages(200, delay=3) + messages(50, delay=-1, start=200)
    store.store(batch)
    assert list(_where(store).values()).count("later") == 200
    queue = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    queue.provision("orders")
    last_due = max(m.due_at for m in batch)
    result = Pump(store, queue).run(due_before=last_due + timedelta(microseconds=1))
    received = drain(queue, "orders")
    assert sorted(m.message_id for m in received) == sorted(m.message_id for m in batch)
    due = {m.message_id: m.due_at for m in batch}
    assert all(m.enqueued_at >= due[m.message_id] for m in received)
    assert result.stats.dispatched == 250 and _where(store) == {} and _scheduled(store) == 0


def test_due_messages_still_in_later_are_claimed_without_the_move(pg, monkeypatch):
    """The move is for locality only: with nobody moving, a due message in `_later` is claimed on time."""
    store = _store(pg)
    monkeypatch.setattr(store.later, "start", lambda: None)  # nobody moves (a pump's upkeep would)
    monkeypatch.setattr(tables, "SOON_US", 0)
    store.store(messages(5, delay=0.2))
    assert set(_where(store).values()) == {"later"}
    # On the store's clock, which the pump claims by (it lags this host's by up to a round trip).
    wait_for(lambda: store.count_scheduled(due_before=store.clock()) == {"orders": 5}, 10, "the messages to fall due")
    transport = InMemoryTransport()
    transport.provision("orders")
    assert Pump(store, transport).run(stop_when_idle=True).stats.dispatched == 5
    assert sorted(m.message_id for m in transport.receive("orders", max_messages=10)) == [f"m-{i}" for i in range(5)]


def test_an_id_is_stored_once_across_both_partitions(pg, monkeypatch):
    """Without the ids table (de-duplication off, or a migration's `deduplicate=False`), a send of an id that the
    other partition holds is skipped; a duplicate that got into `_soon` anyway is dropped by the move, not kept
    twice."""
    store = _store(pg, dedup_window_seconds=0)
    due_later = utcnow() + timedelta(hours=2)
    assert store.store([DelayedMessage("orders", b"first", due_later, {}, "x")]) == 1
    assert store.store([DelayedMessage("orders", b"again", utcnow(), {}, "x")]) == 0
    assert store.store([DelayedMessage("orders", b"again", utcnow(), {}, "x")], deduplicate=False) == 0
    assert _where(store) == {"x": "later"}
    # What two concurrent sends of one id to different partitions could leave (each partition checks its own keys).
    with store.engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {store.qualified(store.table_name)} (message_id, destination, body, headers, "
                          "due_at_us, stored_at_us, tier) VALUES ('x', 'orders', '\\x00', '{}', 1, 1, 0)"))
    assert _scheduled(store) == 2
    monkeypatch.setattr(tiers, "SOON_US", 3 * 3600 * 1_000_000)
    assert store.later.run() == 1
    assert _where(store) == {"x": "soon"} and _scheduled(store) == 1


def test_the_move_passes_over_rows_a_claim_or_a_sweep_holds(pg, monkeypatch):
    url, _, _ = pg
    store = _store(pg)
    store.store(messages(4, delay=3600))
    table = store.qualified(store.table_name)
    with store.engine.begin() as conn:  # as a sweep leaves the rows it holds: it removes them by key later
        conn.execute(text(f"UPDATE {table} SET claim_id = 'sweep-1'"))
    monkeypatch.setattr(tiers, "SOON_US", 2 * 3600 * 1_000_000)
    assert store.later.run() == 0
    with store.engine.begin() as conn:
        conn.execute(text(f"UPDATE {table} SET claim_id = NULL"))
    # A row another transaction holds is skipped, never waited for.
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as holder:
        holder.execute(f"SELECT 1 FROM {store.qualified(store.tables.later.name)} WHERE message_id = 'm-0' FOR UPDATE")
        done = []
        mover = threading.Thread(target=lambda: done.append(store.later.run()))
        mover.start()
        mover.join(30)
        assert done == [3]
    assert store.later.run() == 1
    assert set(_where(store).values()) == {"soon"}


def test_one_process_moves_at_a_time(pg, monkeypatch):
    url, _, _ = pg
    store = _store(pg)
    store.store(messages(3, delay=3600))
    monkeypatch.setattr(tiers, "SOON_US", 2 * 3600 * 1_000_000)
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as other:
        assert other.execute("SELECT pg_try_advisory_xact_lock(%s)", [store.later._key]).fetchone()[0]
        assert store.later.move_batch(100) is None  # the other process is at it
    assert store.later.move_batch(100) == 3


@pytest.mark.parametrize("start", [4, 7, 8])
def test_a_store_with_rows_is_split_in_place_while_a_pump_delivers(pg, start):
    """An older store with rows due before, during and after the upgrade and a day later: it becomes the
    `_soon` partition in place (every row kept, ids and counts too) while a pump delivers, each once. A store
    of schema version 8 keeps its `_later` in place as `_far`, and the move sends those rows on to their hours'
    partitions."""
    url, schema, table = pg
    old = SqlDelayedMessageStore(url, table=table, schema=schema)
    assert old.migrate(up_to=start) == list(range(1, start + 1))
    batches = [messages(100, "orders", delay=d, start=100 * i) for i, d in enumerate((-1.0, 1.0, 2.5))]
    far = messages(50, "orders", delay=86_400, start=1000)
    for batch in (*batches, far):
        old.store(batch)
    queue = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    queue.provision("orders")
    last_due = max(m.due_at for batch in batches for m in batch)
    errors, results = [], []

    def pump() -> None:
        try:
            results.append(Pump(SqlDelayedMessageStore(url, table=table, schema=schema), queue)
                           .run(due_before=last_due + timedelta(microseconds=1)))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    worker = threading.Thread(target=pump)
    worker.start()
    try:
        wait_for(lambda: not old.count_scheduled(due_before=utcnow() - timedelta(seconds=0.5)), 30,
                 "the pump to deliver the messages that were due before the upgrade")
        upgraded = SqlDelayedMessageStore(url, table=table, schema=schema)
        upgraded.create_schema()
        assert upgraded.tiered() and upgraded.count_scheduled(), "upgraded while messages were still waiting"
    finally:
        worker.join(timeout=60)
    assert errors == [] and not worker.is_alive()
    received = drain(queue, "orders")
    assert sorted(m.message_id for m in received) == sorted(m.message_id for b in batches for m in b)
    due = {m.message_id: m.due_at for b in batches for m in b}
    assert all(m.enqueued_at >= due[m.message_id] for m in received)
    kept_in = f"{table}_far" if start == 8 else f"{table}_soon"
    assert _leaves(upgraded) == {m.message_id: kept_in for m in far}  # kept in place, not copied
    assert _scheduled(upgraded) == 50
    if start == 8:  # rows of `_soon` stay there (claims take them when due); those of `_later` go to their hour
        upgraded.later.run()
        assert _leaves(upgraded) == {
            m.message_id: f"{table}_hour{tables.hour_tier(to_us(m.due_at)) - tables.FIRST_HOUR:02d}" for m in far}
        assert _scheduled(upgraded) == 50
    # New sends go by their due time; ids keep growing from the same sequence.
    upgraded.store(messages(1, delay=7200, start=2000))
    assert _where(upgraded)["m-2000"] == "later"
    with upgraded.engine.connect() as conn:
        ids = conn.execute(text(f"SELECT message_id, id FROM {upgraded.qualified(table)} ORDER BY id")).all()
    assert ids[-1][0] == "m-2000"


def test_later_is_looked_after_apart_from_soon(pg):
    """A vacuum of `_far` (millions of rows) runs for minutes: it has its own check, thread and lock, and the
    check of the tables the claims churn never waits for it. The hours' partitions are checked there too, and
    vacuumed at far more dead rows than other tables, the current hour's and the hour past's not at all (only
    analysed): the move truncates each once its hour is past."""
    from airflow_delay_provider.stores.upkeep import Thresholds

    store = _store(pg)
    small = Thresholds(analyze_base=500, analyze_fraction=0.0, vacuum_base=500, vacuum_fraction=0.0)
    store.maintenance.thresholds = store.later_maintenance.thresholds = small
    for start in range(0, 2000, 1000):
        store.store(messages(1000, delay=7200, start=start) + messages(1000, delay=3 * 86400, start=5000 + start))
    store.cancel(Selector(message_ids=[f"m-{i}" for i in (*range(1000), *range(5000, 6000))]))
    two_hours_on = store.clock() + timedelta(hours=2)
    hour = store.tables.hours[tables.hour_tier(to_us(two_hours_on)) - tables.FIRST_HOUR].name
    far = store.tables.far.name

    def counters(name: str) -> tuple[int, int]:
        with store.engine.connect() as conn:
            return conn.execute(text("SELECT n_mod_since_analyze, n_dead_tup FROM pg_stat_user_tables WHERE relid = "
                                     "to_regclass(:t)"), {"t": store.qualified(name)}).one()

    for name in (hour, far):
        wait_for(lambda name=name: (c := counters(name))[0] >= 3000 and c[1] >= 1000, 10, f"the counters of {name}")
    assert not {hour, far} & {t for t, _, _ in store.maintenance.run()}
    assert store.later_maintenance.key() != store.maintenance.key()
    done = {(t, w) for t, w, _ in store.later_maintenance.run()}
    assert {(far, "vacuum"), (far, "analyze"), (hour, "analyze")} <= done and (hour, "vacuum") not in done, done
    store.later_maintenance.thresholds = dataclasses.replace(small, emptied_vacuum_base=500,
                                                             emptied_vacuum_fraction=0.0)
    store.cancel(Selector(message_ids=[f"m-{i}" for i in range(1000, 2000)]))
    wait_for(lambda: (c := counters(hour))[0] >= 1000 and c[1] >= 2000, 10, f"the counters of {hour}")
    # Two hours on, that hour's partition is the current one: the move empties it, its truncation frees it, and
    # only the planner needs to know what is left in it.
    store.clock = lambda: two_hours_on
    done = {(t, w) for t, w, _ in store.later_maintenance.run()}
    assert (hour, "analyze") in done and (hour, "vacuum") not in done, done
    # An hour later it is the hour past's, which the move truncates within seconds of the turn.
    store.clock = lambda: two_hours_on + timedelta(hours=1)
    assert (hour, "vacuum") not in {(t, w) for t, w, _ in store.later_maintenance.run()}
    del store.clock
    assert (hour, "vacuum") in {(t, w) for t, w, _ in store.later_maintenance.run()}


def test_the_partitions_of_the_hours_to_come_are_analysed_less_often_until_their_hour(pg):
    """They only take inserts until their hour: analysed at a fraction of their rows changed ten times (here,
    beyond reach) the other tables', and like the others once their hour has come."""
    from airflow_delay_provider.stores.upkeep import Thresholds

    store = _store(pg)
    store.later_maintenance.thresholds = Thresholds(analyze_base=0, analyze_fraction=0.0, growing_analyze_fraction=2.0)
    store.store(messages(1000, delay=7200))
    two_hours_on = store.clock() + timedelta(hours=2)
    hour = store.tables.hours[tables.hour_tier(to_us(two_hours_on)) - tables.FIRST_HOUR]
    assert hour in store.later.growing() and len(store.later.growing()) == tables.RING_HOURS - 2

    def changed() -> int:  # a transaction of its own each time: one keeps the counters it read first
        with store.engine.connect() as conn:
            return conn.execute(text("SELECT n_mod_since_analyze FROM pg_stat_user_tables WHERE relid = "
                                     "to_regclass(:t)"), {"t": store.qualified(hour.name)}).scalar()

    wait_for(lambda: changed() == 1000, 30, f"the counters of {hour.name}")  # an idle session's come within 10 s
    assert (hour.name, "analyze") not in {(t, w) for t, w, _ in store.later_maintenance.run()}
    store.clock = lambda: two_hours_on
    assert hour not in store.later.growing()
    assert (hour.name, "analyze") in {(t, w) for t, w, _ in store.later_maintenance.run()}


def _claim_plan(store: SqlDelayedMessageStore) -> tuple[list[str], str]:
    """The ids a claim took now (handed back), and the plans its statements that read the due rows ran with
    (replayed, explained): the claim's DELETE, and the locking read before it where there is one."""
    from sqlalchemy import event

    sent: list[tuple[str, object]] = []

    def record(_conn, _cursor, statement, parameters, *_) -> None:
        sent.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        with store.claim_due(store.clock(), 100) as claim:
            taken = [m.message_id for m in claim.messages]
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    plans = []
    with store.engine.begin() as conn:
        for statement, parameters in sent:
            words = statement.lstrip().upper()
            if words.startswith("DELETE") or (words.startswith("SELECT") and "FOR UPDATE" in words):
                plans.append("\n".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN {statement}", parameters)))
            elif not words.startswith("INSERT"):  # not the hand-back
                conn.exec_driver_sql(statement, parameters)
    assert 1 <= len(plans) <= 2, sent
    return taken, "\n".join(plans)


def test_claims_leave_later_out_while_a_look_finds_nothing_due_there(pg):
    """`_later`'s due index holds the dead entries of every moved row until a vacuum of millions gets to them:
    once the move has looked and found nothing there a claim could take, claims read `_soon` only."""
    store = _store(pg)
    store.store(messages(3, delay=-1) + messages(5, delay=3600, start=3))
    later = store.tables.later.name
    taken, plan = _claim_plan(store)  # a store object that has not looked yet reads both
    assert sorted(taken) == ["m-0", "m-1", "m-2"] and later in plan, plan
    assert store.later.run() == 0
    assert store.later.clear_until_us > to_us(store.clock()) + tiers.CLEAR_US - 5_000_000
    taken, plan = _claim_plan(store)
    assert sorted(taken) == ["m-0", "m-1", "m-2"], taken  # the same rows: the hand-back put them back
    assert later not in plan and store.tables.soon.name in plan, plan
    # What a send puts in `_later` after the look is due after its bound. Not 1 ms past the edge of `_soon`: the
    # store reads its clock after the messages were made, and on a busy machine that took longer.
    store.store(messages(2, delay=SOON_US / 1e6 + 5, start=10))
    assert _where(store)["m-10"] == "later"
    assert store.get("m-10").due_at > from_us(int(store.later.clear_until_us))


def test_a_store_asleep_past_the_looks_bound_moves_and_looks_a_second_before_it_wakes(pg):
    """Moves run while a pump is awake: one that slept longer than the look's bound woke with it lapsed, and the
    first claims of the burst it woke for read every partition. The wait starts the move and the look a second
    before the wake instead, so that the claims at the wake read `_soon` alone."""
    store = _store(pg)
    store.wait(store.clock() + timedelta(seconds=0.2))  # the first wait only opens the LISTEN connection
    wake = store.clock() + timedelta(seconds=1.5)
    assert not store.claims_soon_only(wake)  # no look yet: the bound has lapsed (as after a long sleep)
    store.wait(wake)
    assert store.later.thread is not None
    store.later.thread.join(30)
    assert store.claims_soon_only(wake)


def test_a_due_row_the_move_did_not_take_keeps_claims_reading_later(pg, monkeypatch):
    """Without the move (none has run, or it failed), a look that finds a row of `_later` due soon bounds the
    claims' `_soon`-only reading at its due time: from then on they read `_later` too and take it on time."""
    store = _store(pg)
    monkeypatch.setattr(store.later, "start", lambda: None)  # nobody moves (a pump's upkeep would)
    monkeypatch.setattr(tables, "SOON_US", 0)
    store.store(messages(2, delay=0.5))
    assert set(_where(store).values()) == {"later"}
    store.later.look()  # no move
    due = store.get("m-0").due_at
    assert store.later.clear_until_us == to_us(due)
    # At the times themselves, not the clock's now: on a busy machine the look may end after the due time.
    assert store.claims_soon_only(due - timedelta(microseconds=1)) and not store.claims_soon_only(due)
    wait_for(lambda: store.clock() >= due, 10, "the messages to fall due on the store's clock")
    assert not store.claims_soon_only(store.clock())
    transport = InMemoryTransport()
    transport.provision("orders")
    assert Pump(store, transport).run(stop_when_idle=True).stats.dispatched == 2
    assert all(m.enqueued_at >= due for m in transport.receive("orders", max_messages=10))


def test_a_reschedule_and_a_sweeps_release_put_rows_where_claims_read(pg):
    """A row of `_later` rescheduled to now, or released by a sweep that ends, goes to `_soon`: claims that
    leave `_later` out take it at once, not at the next move. One rescheduled to tomorrow goes to `_later`."""
    store = _store(pg)
    store.store(messages(3, delay=3600) + messages(1, delay=-1, start=3))
    assert store.reschedule(Selector(message_ids=["m-0"]), store.clock())["rescheduled"] == ["m-0"]
    assert store.reschedule(Selector(message_ids=["m-3"]), store.clock() + timedelta(days=1))["rescheduled"]
    assert _where(store) == {"m-0": "soon", "m-1": "later", "m-2": "later", "m-3": "later"}
    # m-1 falls due in `_later` (no move has run), a sweep leases it and m-0, then ends without sending them.
    with store.engine.begin() as conn:
        conn.execute(text(f"UPDATE {store.qualified(store.tables.later.name)} SET due_at_us = :now "
                          "WHERE message_id = 'm-1'"), {"now": to_us(store.clock())})
    assert store.start_sweep("sweep-1", due_before=store.clock() + timedelta(seconds=1))["claimed"] == 2
    assert store.finish_sweep("sweep-1", "failed", {}) == 2  # m-0 and m-1
    assert _where(store) == {"m-0": "soon", "m-1": "soon", "m-2": "later", "m-3": "later"}
    store.later.look()
    assert store.claims_soon_only(store.clock())
    with store.claim_due(store.clock(), 100) as claim:
        assert sorted(m.message_id for m in claim.messages) == ["m-0", "m-1"]


def test_a_sweeps_move_takes_later_rows_on_a_store_whose_claims_leave_later_out(pg):
    """Whether claims leave `_later` out is decided per claim, not kept from the last one: a sweep's move on the
    same store object (a pump and a sweep in one process) right after such a claim still takes the rows of its
    window that are in `_later`."""
    url, schema, table = pg
    store = _store(pg)
    store.store(messages(3, delay=3600))
    with store.engine.begin() as conn:  # due now, still in `_later` (no move has run)
        conn.execute(text(f"UPDATE {store.qualified(store.tables.later.name)} SET due_at_us = :now"),
                      {"now": to_us(store.clock())})
    store.later.clear_until_us = to_us(store.clock()) + 60_000_000  # as a look that came just before them
    assert store.claims_soon_only(store.clock())
    with store.claim_due(store.clock(), 100) as claim:  # reads `_soon` alone: nothing
        assert claim.messages == []
    queue = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    queue.provision("orders")
    store.open_sweep("sweep-1", due_before=store.clock() + timedelta(seconds=1))
    low, high, n = store.leases.window_range("sweep-1")
    assert n == 3
    moved = queue.move_window(store, "sweep-1", low, high, 100)
    assert moved is not None and sum(count for _, _, count in moved[0]) == 3
    assert sorted(m.message_id for m in drain(queue, "orders")) == ["m-0", "m-1", "m-2"]
    assert _where(store) == {}


@pytest.mark.parametrize("action", ["reschedule", "cancel", "forget"])
def test_an_action_that_waited_for_a_row_moved_to_the_other_partition_meanwhile_is_done_again(pg, action):
    """Another session reschedules a message of `_later` to now (PostgreSQL moves the row into `_soon`) and holds
    its transaction open; a reschedule, cancel or forget of the same message waits for it, and when it commits,
    PostgreSQL fails the waiting statement ("tuple to be locked was already moved to another partition due to
    concurrent update", SQLSTATE 40001). The action runs again in a new transaction and is done, not reported
    as an unreachable database."""
    url, _, _ = pg
    store = _store(pg)
    store.store(messages(1, delay=3600))
    assert _where(store) == {"m-0": "later"}
    outcome: list = []

    def act() -> None:
        try:
            if action == "reschedule":
                outcome.append(store.reschedule(Selector(message_ids=["m-0"]), store.clock() + timedelta(hours=2)))
            elif action == "cancel":
                outcome.append(store.cancel(Selector(message_ids=["m-0"])))
            else:
                outcome.append(store.forget_destinations(["orders"], force=True))
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            outcome.append(exc)

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as other:
        other.execute(f"UPDATE {store.qualified(store.table_name)} SET due_at_us = %s, tier = {tables.SOON} "
                      "WHERE message_id = 'm-0'", [to_us(store.clock())])
        xid = other.execute("SELECT backend_xid::text FROM pg_stat_activity WHERE pid = pg_backend_pid()").fetchone()[0]
        actor = threading.Thread(target=act)
        actor.start()
        wait_for(lambda: other.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT "
                                       "granted AND transactionid::text = %s", [xid]).fetchone()[0] > 0,
                 30, f"the {action} to wait for the row the other session moved")
        other.commit()
    actor.join(30)
    assert not actor.is_alive()
    [result] = outcome
    assert not isinstance(result, Exception), repr(result)
    if action == "reschedule":
        assert result["rescheduled"] == ["m-0"]
        assert _where(store) == {"m-0": "later"}  # two hours ahead: back in `_later`
    elif action == "cancel":
        assert result["cancelled"] == ["m-0"]
        assert _where(store) == {}
    else:
        assert result == {"forgotten": ["orders"], "purged": {"orders": 1}} and _where(store) == {}
        assert "orders" not in store.destinations()


def test_the_database_puts_rows_in_the_partition_the_code_does(pg):
    """`tier_of_rows` (a sweep's release) and the move from `_far` compute in SQL what `tier_of` does in Python."""
    from sqlalchemy import BigInteger, column, select, values

    store = _store(pg)
    now = to_us(store.clock())
    dues = [now - 1, now + SOON_US, now + SOON_US + 1, now + 7_200_000_000, now + 86_400_000_000,
            tables.ring_until(now) - 1, tables.ring_until(now), now + 5 * 86_400_000_000]
    due = column("due_at_us", BigInteger)
    rows = values(due, name="v").data([(d,) for d in dues])
    with store.engine.connect() as conn:
        found = conn.execute(select(tables.tier_of_rows(rows.c.due_at_us, now, ring=True))).scalars().all()
    assert found == [tables.tier_of(d, now, ring=True) for d in dues]


def test_messages_due_within_the_hours_reach_leave_far_for_their_hours_partition(pg):
    """A message due beyond the hours' reach waits in `_far`; once its hour comes within reach the move sends it
    to that hour's partition, and one due within the minute straight on to `_soon`."""
    store = _store(pg)
    store.store(messages(3, delay=3 * 86_400))
    assert set(_leaves(store).values()) == {f"{store.table_name}_far"}
    now = to_us(store.clock())
    with store.engine.begin() as conn:  # as time passing would: due in two hours, and in 10 s (still in `_far`)
        far = store.qualified(store.tables.far.name)
        conn.execute(text(f"UPDATE {far} SET due_at_us = :due WHERE message_id IN ('m-0', 'm-1')"),
                     {"due": now + 7_200_000_000})
        conn.execute(text(f"UPDATE {far} SET due_at_us = :due WHERE message_id = 'm-2'"), {"due": now + 10_000_000})
    assert store.later.run() == 1  # m-2: into `_soon`
    hour = f"{store.table_name}_hour{tables.hour_tier(now + 7_200_000_000) - tables.FIRST_HOUR:02d}"
    assert _leaves(store) == {"m-0": hour, "m-1": hour, "m-2": f"{store.table_name}_soon"}
    assert _scheduled(store) == 3 and store.count_scheduled() == {"orders": 3}


def test_far_is_moved_a_bounded_number_of_batches_a_run_after_the_move_into_soon(pg, monkeypatch):
    """After an upgrade `_far` may hold millions within the hours' reach: each run moves what is due within the
    minute first, then at most `FAR_BATCHES_PER_RUN` batches from `_far`, and the next run goes on."""
    store = _store(pg)
    store.store(messages(5, delay=3 * 86_400))
    now = to_us(store.clock())
    with store.engine.begin() as conn:  # four within reach, one due within the minute
        far = store.qualified(store.tables.far.name)
        conn.execute(text(f"UPDATE {far} SET due_at_us = :due WHERE message_id <> 'm-4'"), {"due": now + 7_200_000_000})
        conn.execute(text(f"UPDATE {far} SET due_at_us = :due WHERE message_id = 'm-4'"), {"due": now + 10_000_000})
    monkeypatch.setattr(tiers, "MOVE_BATCH", 1)
    monkeypatch.setattr(tiers, "FAR_BATCHES_PER_RUN", 3)
    assert store.later.run() == 1  # m-4 into `_soon`, then three of the four into their hour's partition
    left = [m for m, leaf in _leaves(store).items() if leaf.endswith("_far")]
    assert len(left) == 1 and _leaves(store)["m-4"].endswith("_soon")
    store.later.run()
    assert not any(leaf.endswith("_far") for leaf in _leaves(store).values())


def test_the_partition_of_the_hour_past_is_truncated_once_empty_without_waiting_for_readers(pg, monkeypatch):
    store = _store(pg)
    store.store(messages(3, delay=7200))
    hour = store.tables.hours[tables.hour_tier(to_us(store.clock()) + 7_200_000_000) - tables.FIRST_HOUR]
    name = store.qualified(hour.name)
    real_clock = store.clock
    monkeypatch.setattr(store, "clock", lambda: real_clock() + timedelta(hours=3))  # that hour is now the one past
    assert store.later.rest() is False  # still holds rows (as if a sweep held them): not truncated

    def size() -> int:
        with store.engine.connect() as conn:
            return conn.execute(text("SELECT pg_relation_size(:t)"), {"t": name}).scalar()

    store.cancel(Selector(message_ids=["m-0", "m-1", "m-2"]))
    assert size() > 0  # the dead rows' page
    with psycopg.connect(pg[0].replace("postgresql+psycopg://", "postgresql://"), autocommit=False) as reader:
        # Another session reading all of `_later` in a transaction (a claim that reads every partition, a report).
        reader.execute(f"SELECT count(*) FROM {store.qualified(store.tables.later.name)}")
        assert store.later.rest() is False  # never waits for it: the next move tries again
        assert store.later.rested_hour is None and size() > 0
    assert store.later.rest() is True
    assert size() == 0 and store.later.rested_hour is not None
    assert store.later.rest() is False  # once an hour


def test_the_move_and_the_look_start_past_the_rows_moved_out_and_a_full_look_finds_what_came_below(pg, monkeypatch):
    """The current hour's due index holds the dead entries of the rows moved out of it: the move and the look
    start past them, at the earliest row the move could take or the last look's mark. A row that comes below
    that start other than by a send within the margin (here: written as if its send had taken longer than
    `SOON_US - CLEAR_US`) waits for a look from the index's beginning, one every `FULL_LOOK_SECONDS`."""
    store = _store(pg)
    monkeypatch.setattr(store.later, "start", lambda: None)  # this test runs the moves
    store.store(messages(5, delay=3600))
    # Moves within 3 h of due times, sends assumed to take at most 1 h: the mark passes rows due in 2 h.
    monkeypatch.setattr(tiers, "SOON_US", 3 * 3600 * 1_000_000)
    monkeypatch.setattr(tiers, "CLEAR_US", 2 * 3600 * 1_000_000)
    assert store.later.run() == 5
    assert store.later.start_us == 0  # a first look has no mark before it
    assert store.later.run() == 0
    assert store.later.start_us > to_us(store.get("m-4").due_at)  # past the five rows moved out
    store.store(messages(2, delay=3600, start=5))
    assert {_where(store)[m] for m in ("m-5", "m-6")} == {"later"}
    assert store.later.run() == 0  # below the start: not read
    assert {_where(store)[m] for m in ("m-5", "m-6")} == {"later"}
    monkeypatch.setattr(tiers, "FULL_LOOK_SECONDS", 0.0)
    store.later._next_full = 0.0  # the time of the next full look, as if it had come
    store.later.run()  # the full look lowers the start ...
    assert store.later.start_us <= to_us(store.get("m-5").due_at)
    assert store.later.run() == 2  # ... and the move takes them
    assert set(_where(store).values()) == {"soon"}


def test_a_lapsed_sweeps_rows_below_where_the_look_starts_are_found_at_the_next_look(pg, monkeypatch):
    """A sweep's rows are not the move's, so the start passes them; when its lease runs out they are due rows a
    claim may take: the next look reads from the index's beginning, finds them and the claims read `_later`."""
    store = _store(pg)
    monkeypatch.setattr(store.later, "start", lambda: None)
    monkeypatch.setattr(tables, "SOON_US", 0)  # into `_later` though due at once
    store.store(messages(2, delay=0.2))
    assert set(_where(store).values()) == {"later"}
    due = store.get("m-1").due_at
    wait_for(lambda: store.clock() > due, 10, "the messages to fall due on the store's clock")
    now = store.clock()
    assert store.start_sweep("sweep-1", due_before=now, lease_seconds=1.0)["claimed"] == 2
    # The looks while the lease holds, at the clock's reading before it began: on a busy machine a second may
    # pass before they run.
    store.clock = lambda: now
    store.later.look()
    store.later.look()
    assert store.later.start_us > to_us(due)  # the start passed the leased rows
    assert store.claims_soon_only(now)
    del store.clock
    lease_until = from_us(store.sweep_record("sweep-1")["lease_until_us"])
    wait_for(lambda: store.clock() > lease_until, 10, "the sweep's lease to run out on the store's clock")
    store.later.look()
    assert store.later.clear_until_us <= to_us(due)
    assert not store.claims_soon_only(store.clock())
    transport = InMemoryTransport()
    transport.provision("orders")
    assert Pump(store, transport).run(stop_when_idle=True).stats.dispatched == 2
    store.later.look()  # a full look again, as the last one found rows below the start: none left
    assert store.claims_soon_only(store.clock())


def _insert_due(store: SqlDelayedMessageStore, first_us: int, n: int, start: int, tier: int | None = None) -> None:
    """`n` messages due 1 ms apart from `first_us` in an order other than their ids' (as sends of mixed delays
    store them), written straight into their partition (faster than sends): that of their due hour, or `tier`."""
    with store.engine.begin() as conn:
        conn.execute(text(
            f"INSERT INTO {store.qualified(store.table_name)} (message_id, destination, body, headers, due_at_us, "
            "stored_at_us, tier) SELECT 'm-' || g, 'orders', '\\x00', '{}', :first + (g - :start) * 7919 % :n * 1000, "
            ":first, :tier FROM generate_series(:start, :start + :n - 1) AS g"),
            {"first": first_us, "n": n, "start": start,
             "tier": tables.hour_tier(first_us) if tier is None else tier})


def _explained(store: SqlDelayedMessageStore) -> list[dict]:
    """The plans (JSON, each node with its rows and buffers) of the statements the store runs from now on, as
    auto_explain sends them to the client (not to the server's log)."""
    plans: list[dict] = []

    def note(diag) -> None:
        if "plan:" in (diag.message_primary or ""):
            plans.append(json.loads(diag.message_primary.split("plan:", 1)[1]))

    @event.listens_for(store.engine, "connect")
    def _explain(dbapi_connection, _record) -> None:
        dbapi_connection.add_notice_handler(note)
        with dbapi_connection.cursor() as cursor:
            cursor.execute("LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; "
                           "SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on; "
                           "SET auto_explain.log_timing = off; SET auto_explain.log_format = json; "
                           "SET client_min_messages = log; SET log_min_messages = panic")
        dbapi_connection.commit()

    store.engine.dispose()
    return plans


def _deletes(plans: list[dict], starts: str) -> list[dict]:
    """The Delete nodes of the plans of the statements whose text starts with `starts`."""
    return [n for plan in plans if plan["Query Text"].lstrip().startswith(starts)
            for n in plan_nodes(plan["Plan"]) if n.get("Operation") == "Delete"]


def _read_by(deleted: dict) -> tuple[dict[str, str], int]:
    """How a Delete node found its rows (each table it read: the scan's kind, such as "Tid Scan" for by place, or
    the index it looked them up in), not counting its subqueries, and the buffers it touched without them."""
    subqueries = [n for n in deleted.get("Plans", []) if n.get("Parent Relationship") == "InitPlan"]
    subqueries += [n for top in deleted.get("Plans", []) for n in top.get("Plans", [])
                   if n.get("Parent Relationship") == "InitPlan"]
    inside = {id(n) for top in subqueries for n in plan_nodes(top)}
    scans = [n for n in plan_nodes(deleted) if id(n) not in inside and "Relation Name" in n and n is not deleted]
    return ({n["Relation Name"]: n.get("Index Name") or n["Node Type"] for n in scans},
            deleted["Shared Hit Blocks"] + deleted["Shared Read Blocks"]
            - sum(n["Shared Hit Blocks"] + n["Shared Read Blocks"] for n in subqueries))


def test_the_move_reads_only_the_rows_it_moves_whatever_the_statistics_say(pg, monkeypatch):
    """Each move statement reads its rows in their own partition, by place: never a lookup in the other
    partitions, and none through an index the planner picks from statistics. An hour's partition that an
    analyse found empty after the move had taken all its rows (as at the end of each hour) was searched
    for every moved id through its due index, read in full for each: 23.7 million buffers for 5,388 rows in a
    soak, a 26-s move, and claims stalled behind it."""
    store = _store(pg)
    monkeypatch.setattr(store.later, "start", lambda: None)
    plans = _explained(store)
    monkeypatch.setattr(tiers, "SOON_US", 3 * 3600 * 1_000_000)  # the move takes what is due within 3 h
    hour = to_us(store.clock()) // tables.HOUR_US * tables.HOUR_US
    emptied = store.tables.hours[tables.hour_tier(hour + tables.HOUR_US) - tables.FIRST_HOUR]
    _insert_due(store, hour + tables.HOUR_US, 5_000, 0)
    assert store.later.run() == 5_000
    with store.engine.begin() as conn:  # as the upkeep analyses the current hour's partition
        conn.execute(text(f"ANALYZE {store.qualified(emptied.name)}"))
    _insert_due(store, hour + 2 * tables.HOUR_US, 500, 5_000)
    plans.clear()
    assert store.later.run() == 500
    assert set(_where(store).values()) == {"soon"} and len(_where(store)) == 5_500
    deletes = _deletes(plans, "WITH moved AS")
    assert deletes, [p["Query Text"] for p in plans]
    for deleted in deletes:
        scanned, read = _read_by(deleted)
        assert len(scanned) == 1 and emptied.name not in scanned and set(scanned.values()) == {"Tid Scan"}, scanned
        assert read <= 10 * deleted["Actual Rows"] + 10, (read, deleted["Actual Rows"])


def test_a_claim_of_soon_reads_only_the_rows_it_takes_whatever_the_statistics_say(pg, monkeypatch):
    """Claims that read `_soon` alone take each row by its place in it, not through an index the planner picks
    from statistics: after a burst was claimed and an analyse found `_soon` all but empty, a look-up by id could
    read all of its due index for each id (as it did in the current hour's partition at the end of an hour)."""
    store = _store(pg)
    monkeypatch.setattr(store.later, "start", lambda: None)
    plans = _explained(store)
    now = to_us(store.clock())
    _insert_due(store, now - 60_000_000, 5_000, 0, tier=tables.SOON)
    with store.engine.begin() as conn:  # the burst, claimed
        conn.execute(text(f"DELETE FROM {store.qualified(store.table_name)} WHERE tier = {tables.SOON}"))
    with store.engine.begin() as conn:  # the upkeep's analyse
        conn.execute(text(f"ANALYZE {store.qualified(store.tables.soon.name)}"))
    _insert_due(store, now - 1_000_000, 500, 5_000, tier=tables.SOON)
    assert store.later.run() == 0 and store.claims_soon_only(store.clock())
    plans.clear()
    with store.claim_due(store.clock(), 1_000) as claim:
        assert len(claim.messages) == 500
        claim.remove([m.message_id for m in claim.messages])
    assert _scheduled(store) == 0
    deletes = _deletes(plans, "DELETE")
    assert len(deletes) >= 1, [p["Query Text"] for p in plans]
    scanned, read = _read_by(deletes[0])
    assert scanned == {store.tables.soon.name: "Tid Scan"}, scanned
    assert read <= 10 * deletes[0]["Actual Rows"] + 10, (read, deletes[0]["Actual Rows"])


def test_a_claim_of_every_partition_reads_only_the_rows_it_takes_whatever_the_statistics_say(pg, monkeypatch):
    """A claim that reads `_later` too (a pump that has just started, a move that has failed for 30 s) locks its
    rows, then takes each by its place in its own partition. By id, each was looked up in every partition, and an
    hour's partition that an analyse found empty after the move had taken all its rows (as at the end of each
    hour) was searched for every id through its due index, read in full for each."""
    store = _store(pg)
    monkeypatch.setattr(store.later, "start", lambda: None)
    monkeypatch.setattr(tiers, "SOON_US", 3 * 3600 * 1_000_000)  # the move takes what is due within 3 h
    now = to_us(store.clock())
    hour = now // tables.HOUR_US * tables.HOUR_US
    emptied = store.tables.hours[tables.hour_tier(hour + tables.HOUR_US) - tables.FIRST_HOUR]
    _insert_due(store, hour + tables.HOUR_US, 5_000, 0)
    assert store.later.run() == 5_000
    with store.engine.begin() as conn:  # the moved rows claimed, and the partition they left analysed
        conn.execute(text(f"DELETE FROM {store.qualified(store.table_name)} WHERE tier = {tables.SOON}"))
        conn.execute(text(f"ANALYZE {store.qualified(emptied.name)}"))
    _insert_due(store, now - 1_000_000, 500, 5_000)  # due now, still in `_later`: no move has run since
    claiming = _store(pg)  # another process's store, which has not looked: its claims read every partition
    assert not claiming.claims_soon_only(claiming.clock())
    plans = _explained(claiming)
    with claiming.claim_due(claiming.clock(), 1_000) as claim:
        assert sorted(m.message_id for m in claim.messages) == sorted(f"m-{i}" for i in range(5_000, 5_500))
        claim.remove([m.message_id for m in claim.messages])
    assert _scheduled(claiming) == 0
    deletes = _deletes(plans, "DELETE")
    assert len(deletes) == 1, [p["Query Text"] for p in plans]
    scanned, read = _read_by(deletes[0])
    assert len(scanned) == 1 and emptied.name not in scanned and set(scanned.values()) == {"Tid Scan"}, scanned
    assert read <= 10 * deletes[0]["Actual Rows"] + 10, (read, deletes[0]["Actual Rows"])


def test_the_next_hours_partition_is_read_in_order_of_its_pages_in_pieces_before_the_move_reaches_it(pg):
    """From `WARM_AHEAD_SECONDS` before the move reaches the next hour's partition, each run reads the same share of
    what is left of its pages by a TID range scan, so that all of it has been read once, in pieces, by then: the
    move's reads of it in due order, all over its pages, then find them in memory, not on the disk."""
    store = _store(pg)
    hour = to_us(store.clock()) // tables.HOUR_US + 2
    _insert_due(store, hour * tables.HOUR_US, 20_000, 0)
    name = store.tables.hours[tables.hour_tier(hour * tables.HOUR_US) - tables.FIRST_HOUR].name
    with store.engine.connect() as conn:
        pages = conn.execute(text("SELECT pg_relation_size(:t) / 8192"), {"t": store.qualified(name)}).scalar()
    assert pages > 100
    plans = _explained(store)
    reaches = hour * tables.HOUR_US - SOON_US
    ahead = int(tiers.WARM_AHEAD_SECONDS * 1_000_000)
    step = int(tiers.MOVE_EVERY_SECONDS * 1_000_000)
    read = {now: store.later.warm(now) for now in range(reaches - ahead - 3 * step, reaches + 3 * step, step)}
    pieces = [r for r in read.values() if r is not None]
    assert all(r is None for now, r in read.items() if not reaches - ahead <= now < reaches), read
    assert [first for first, _ in pieces] == [0] + [end for _, end in pieces[:-1]] and pieces[-1][1] == pages
    runs = ahead // step
    assert len(pieces) >= runs - 1 and max(end - first for first, end in pieces) <= pages / (runs - 1) + 1, pieces
    scans = [n for plan in plans if "ctid >=" in plan["Query Text"] for n in plan_nodes(plan["Plan"])
             if n.get("Relation Name") == name]
    assert {n["Node Type"] for n in scans} == {"Tid Range Scan"} and len(scans) == len(pieces)
    assert sum(n["Shared Hit Blocks"] + n["Shared Read Blocks"] for n in scans) >= pages
    assert store.later.warm(reaches - step) is None  # read once an hour


def test_a_retry_an_hour_on_goes_to_that_hours_partition_not_to_soon(pg):
    """A claim writes its retries back with their new due time: one a few seconds on goes to `_soon`, one an hour on
    to its hour's partition (it went to `_soon`, which is meant to hold a minute of messages, and waited there)."""
    store = _store(pg)
    now = store.clock()
    store.store([DelayedMessage("orders", b"x", now, message_id=i) for i in ("soon", "hour")])
    with store.claim_due(store.clock(), 10) as claim:
        claim.retry({"soon": now + timedelta(seconds=3), "hour": now + timedelta(hours=1)})
    hour = store.tables.hours[tables.hour_tier(to_us(now + timedelta(hours=1))) - tables.FIRST_HOUR].name
    assert _leaves(store) == {"soon": store.tables.soon.name, "hour": hour}
