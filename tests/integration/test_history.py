"""The delivery history on SQLite, the real PostgreSQL and in memory: what each settlement writes (delivered,
retried, dead-lettered), the move's entries, the charts against a computation of their own, a message's story,
retention, the day partitions' upkeep, and a store from before the history."""

from __future__ import annotations

import math
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import func, inspect, select, text

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.history import CANCELLED, DEAD_LETTERED, DELIVERED, RETRIED, Settled
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.stores.engine import advisory_key
from airflow_delay_provider.stores.history import DAY_US
from airflow_delay_provider.stores.tables import from_us, to_us
from airflow_delay_provider.testing.store import InMemoryStore
from tests.helpers import ClockedStore, HeldClock, drain, make_transport
from tests.integration.test_pump import FlakyTransport

POLICY = DeliveryPolicy(1, 1, 2, num_no_delay_retries=2)  # two immediate retries, then the error queue


def _store(url, schema, table, clock, **kwargs):
    store = ClockedStore(url, table=table, schema=schema, local_clock=clock.clock, **kwargs)
    store.create_schema()
    return store


def _drive(pump, clock, seconds, step=0.25):
    """Dispatch what is due, moving the clock on in steps, for `seconds` of the test's time."""
    end = clock.now + timedelta(seconds=seconds)
    while clock.now <= end:
        while (stats := pump.dispatch_batch()) is not None and stats.batches:
            pass
        clock.advance(step)


def test_each_settlement_is_recorded_with_its_attempts_and_outcome(db):
    url, schema, table = db
    clock = HeldClock()
    store = _store(url, schema, table, clock)
    transport = FlakyTransport(make_transport(url, schema, table, "orders", "error"), {"orders": 2})
    due = clock.now + timedelta(seconds=1)
    store.store([DelayedMessage("orders", b"o", due, {}, "flaky-1"),
                 DelayedMessage("nowhere", b"n", due, {}, "lost-1"),  # no such queue: dead-lettered at once
                 DelayedMessage("error", b"e", due + timedelta(seconds=1), {}, "plain-1")])
    pump = Pump(store, transport, PumpConfig(retry_jitter=0, error_queue="error"), policy=POLICY,
                clock=clock.clock, sleep=lambda s: None)
    _drive(pump, clock, 5)
    assert {m.message_id for m in drain(transport, "orders")} == {"flaky-1"}

    story = store.message_story("flaky-1")
    assert story["state"] == DELIVERED and story["scheduled"] is None
    steps = story["history"]
    assert [(s["outcome"], s["attempts"]) for s in steps] == [(RETRIED, 1), (RETRIED, 2), (DELIVERED, 3)]
    assert "ConnectionError: orders refused" in steps[0]["detail"] and steps[2]["detail"] is None
    assert all(s["stored_at"] == (clock.START.isoformat()) for s in steps)
    # Lateness: from the due time to the hand-over, on the store's clock.
    assert steps[0]["lateness_ms"] == 0.0 and steps[2]["lateness_ms"] >= 0

    [lost] = store.delivery_history(message_id="lost-1").entries
    assert lost.outcome == DEAD_LETTERED and lost.attempts == 1 and "destination not found" in lost.detail
    assert store.message_story("plain-1")["state"] == DELIVERED
    # Newest first, by destination and by outcome.
    recent = store.delivery_history().entries
    assert [e.handed_at for e in recent] == sorted((e.handed_at for e in recent), reverse=True)
    assert len(recent) == 5
    assert [e.message_id for e in store.delivery_history(outcome=RETRIED).entries] == ["flaky-1", "flaky-1"]
    assert {e.message_id for e in store.delivery_history(destination="nowhere").entries} == {"lost-1"}
    assert store.message_story("never-stored")["state"] == "unknown"


def test_a_scheduled_message_s_story_shows_where_it_is(db):
    url, schema, table = db
    clock = HeldClock()
    store = _store(url, schema, table, clock)
    store.store([DelayedMessage("orders", b"secret body", clock.now + timedelta(hours=1), {"k": "v"}, "later-1")])
    story = store.message_story("later-1")
    assert story["state"] == "scheduled" and story["history"] == []
    assert story["scheduled"]["headers"] == {"k": "v"} and "body" not in story["scheduled"]  # no body by default
    assert store.message_story("later-1", body_bytes=100)["scheduled"]["body"] == "secret body"


def _nearest_rank(values, q):
    values = sorted(values)
    return values[max(1, math.ceil(q * len(values))) - 1]


@pytest.mark.parametrize("kind", ["sql", "memory"])
def test_the_chart_gives_each_minute_s_counts_and_nearest_rank_lateness(db, kind):
    url, schema, table = db
    clock = HeldClock()
    clock.now = datetime(2026, 5, 1, 11, 0, 0, tzinfo=UTC)
    store = _store(url, schema, table, clock) if kind == "sql" else InMemoryStore(clock=clock.clock)
    transport = make_transport(url, schema, table, "orders", "other")
    lateness = {0: [], 1: []}  # per minute, ms
    # Two minutes of messages handed over at known lateness: each batch is due `late` ms before the clock.
    for minute, lates in ((0, [5, 1, 250, 40, 3, 7, 900]), (1, [2, 2, 60])):
        for i, late in enumerate(lates):
            clock.now = datetime(2026, 5, 1, 11, minute, 10 + i, tzinfo=UTC)
            mid = f"m{minute}-{i}"
            store.store([DelayedMessage("orders", b"x", clock.now - timedelta(milliseconds=late), {}, mid),
                         DelayedMessage("other", b"x", clock.now, {}, f"o-{mid}")])
            pump = Pump(store, transport, PumpConfig(), clock=clock.clock, sleep=lambda s: None)
            assert pump.dispatch_batch().dispatched == 2
            lateness[minute].append(late)
    since = datetime(2026, 5, 1, 10, 0, tzinfo=UTC)
    points = store.history_chart("orders", since, since + timedelta(hours=2))
    assert [p["minute"] for p in points] == ["2026-05-01T11:00:00+00:00", "2026-05-01T11:01:00+00:00"]
    for point, minute in zip(points, (0, 1), strict=True):
        assert point["delivered"] == len(lateness[minute])
        assert point["p50_ms"] == _nearest_rank(lateness[minute], 0.5)
        assert point["p99_ms"] == _nearest_rank(lateness[minute], 0.99)
        assert point["dead_lettered"] == point["retried"] == 0
    assert sum(p["delivered"] for p in store.history_chart(None, since, since + timedelta(hours=2))) == 20
    assert store.history_chart("orders", since, since + timedelta(minutes=30)) == []


def test_the_move_into_sql_queues_records_its_deliveries(pg):
    url, schema, table = pg
    clock = HeldClock()
    store = _store(url, schema, table, clock)
    transport = make_transport(url, schema, table, "orders")
    store.store([DelayedMessage("orders", b"x", clock.now, {}, f"mv-{i}") for i in range(30)])
    pump = Pump(store, transport, PumpConfig(), clock=clock.clock, sleep=lambda s: None)
    pump.run(stop_when_idle=True)
    assert pump._moves, "the pump should have moved the rows inside the database"
    entries = store.delivery_history(destination="orders", limit=100).entries
    assert sorted(e.message_id for e in entries) == sorted(f"mv-{i}" for i in range(30))
    assert {(e.outcome, e.attempts, e.stored_at) for e in entries} == {(DELIVERED, 1, clock.START)}
    assert len(drain(transport, "orders")) == 30


def test_any_printable_id_and_a_missing_stored_time_read_back_as_written(pg):
    """PostgreSQL's rows carry their messages in arrays sent as literals (`_literal`): whatever a message id may hold
    (quotes, backslashes, commas, braces, spaces, "NULL"), each entry reads back as it was written."""
    url, schema, table = pg
    clock = HeldClock()
    store = _store(url, schema, table, clock)
    handed = iter(range(to_us(clock.now), to_us(clock.now) + 10**9))

    @settings(max_examples=60, deadline=None, database=None)
    @given(ids=st.lists(st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), min_size=1,
                                max_size=40).filter(str.isprintable), min_size=1, max_size=8, unique=True),
           stored=st.lists(st.one_of(st.none(), st.integers(0, 250_000_000_000_000_000)), min_size=8, max_size=8))
    def written_and_read(ids, stored):
        at = next(handed)
        facts = {m: ("orders", at - i, i % 3, stored[i]) for i, m in enumerate(ids)}
        with store.engine.begin() as conn:
            store.history.write(conn, at, [Settled(DELIVERED, tuple(ids))], facts)
        entries, _ = store.history.entries(since=from_us(at), before=from_us(at + 1), limit=100)
        got = {e.message_id: (to_us(e.due_at), e.attempts, None if e.stored_at is None else to_us(e.stored_at))
               for e in entries}
        assert got == {m: (f[1], f[2] + 1, f[3]) for m, f in facts.items()}

    written_and_read()


def test_no_history_is_written_with_a_retention_of_0_nor_by_a_store_from_before_it(db):
    url, schema, table = db
    clock = HeldClock()
    off = _store(url, schema, table, clock, history_days=0)
    transport = make_transport(url, schema, table, "orders")
    off.store([DelayedMessage("orders", b"x", clock.now, {}, "a")])
    assert Pump(off, transport, PumpConfig(), clock=clock.clock).dispatch_batch().dispatched == 1
    assert off.delivery_history().entries == []
    with off.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(off.history.table)).scalar() == 0

    old = ClockedStore(url, table=f"o_{uuid.uuid4().hex[:8]}", schema=schema, local_clock=clock.clock)
    old.migrate(up_to=11)
    old.store([DelayedMessage("orders", b"x", clock.now, {}, "b")])
    assert Pump(old, transport, PumpConfig(), clock=clock.clock).dispatch_batch().dispatched == 1
    assert old.delivery_history().entries == [] and old.message_story("b")["state"] == "unknown"
    with old.engine.connect() as conn:  # reading it made nothing
        assert not inspect(conn).has_table(old.tables.history.name, schema=schema)
    assert {m.message_id for m in drain(transport, "orders")} == {"a", "b"}


def test_sqlite_upkeep_deletes_what_is_past_the_retention(tmp_path):
    clock = HeldClock()
    store = _store(f"sqlite:///{tmp_path / 's.db'}", None, "d", clock, history_days=2)
    transport = make_transport(store.url, None, "d", "orders")
    for day in range(4):
        store.store([DelayedMessage("orders", b"x", clock.now, {}, f"day-{day}")])
        Pump(store, transport, PumpConfig(), clock=clock.clock).dispatch_batch()
        clock.advance(86_400)
    store.history.keep()
    assert [e.message_id for e in store.delivery_history().entries] == ["day-3", "day-2"]


def _partitions(store):
    with store.engine.connect() as conn:
        return sorted(conn.execute(text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(:p)"), {"p": store.qualified(store.tables.history.name)}).scalars())


def _where(store) -> dict[str, str]:
    """The partition each entry is in, by message id."""
    with store.engine.connect() as conn:
        return {m: where.split(".")[-1] for m, where in conn.execute(text(
            f"SELECT unnest(message_ids), tableoid::regclass::text FROM {store.qualified(store.tables.history.name)}"))
            .all()}


def test_postgresql_keeps_a_partition_per_day_and_drops_those_past_the_retention(pg):
    url, schema, table = pg
    clock = HeldClock()
    clock.now = datetime(2026, 5, 1, 23, 0, tzinfo=UTC)
    store = _store(url, schema, table, clock, history_days=2)
    transport = make_transport(url, schema, table, "orders")

    def deliver(mid):
        store.store([DelayedMessage("orders", b"x", clock.now, {}, mid)])
        assert Pump(store, transport, PumpConfig(), clock=clock.clock).dispatch_batch().dispatched == 1

    deliver("first-day")  # the day the history was made has no partition: the default takes it
    assert _partitions(store) == [f"{table}_hdefault"]
    # Only days nobody writes to yet: attached for a day under way, the range would fail inserts routed meanwhile.
    assert store.history.keep()["made"] == [f"{table}_h260502", f"{table}_h260503"]
    assert store.history.keep() == {"made": [], "dropped": []}  # nothing to do twice
    clock.now = datetime(2026, 5, 2, 0, 0, 1, tzinfo=UTC)
    deliver("second-day")
    assert _where(store) == {"first-day": f"{table}_hdefault", "second-day": f"{table}_h260502"}
    assert store.history.keep()["made"] == [f"{table}_h260504"]
    # Days on: the days that ended before the retention's start go, the default's old rows with them.
    clock.now = datetime(2026, 5, 5, 0, 30, tzinfo=UTC)
    deliver("recent")
    done = store.history.keep()
    assert done["dropped"] == [f"{table}_h260502"] and done["made"] == [f"{table}_h260506", f"{table}_h260507"]
    assert [e.message_id for e in store.delivery_history().entries] == ["recent"]
    assert f"{table}_h260503" in _partitions(store)  # ends within the retention: kept


def test_pumps_starting_together_make_each_day_once_and_none_fails(pg):
    """Every pump's upkeep finds the coming days missing at once: one makes them, the others leave them (a second
    CREATE of one table failed in the catalog, putting that pump's upkeep off for ten minutes)."""
    url, schema, table = pg
    clock = HeldClock()
    clock.now = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    stores = [_store(url, schema, table, clock) for _ in range(4)]
    # Another process holds the days' lock: this pass makes nothing, and says so.
    with stores[0].engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                     {"key": advisory_key(f"airflow_delay_provider.history:{stores[0].qualified(f'{table}_history')}")})
        assert stores[1].history.keep()["made"] == []
    start = threading.Barrier(len(stores))

    def keep(store):
        start.wait()
        return store.history.keep()["made"]

    with ThreadPoolExecutor(len(stores)) as pool:
        made = [name for names in pool.map(keep, stores) for name in names]
    assert sorted(made) == [f"{table}_h260502", f"{table}_h260503"]
    assert _partitions(stores[0]) == sorted([f"{table}_hdefault", *made])


def test_a_day_with_rows_in_the_default_gets_a_partition_after_them(pg):
    """A host whose clock is ahead writes tomorrow's entries before tomorrow's partition is there: they stay in the
    default, and the partition starts after the last of them."""
    url, schema, table = pg
    clock = HeldClock()
    store = _store(url, schema, table, clock)
    transport = make_transport(url, schema, table, "orders")
    ahead = HeldClock()
    ahead.now = (clock.now + timedelta(days=1)).replace(hour=0, minute=0, second=5)
    store.store([DelayedMessage("orders", b"x", ahead.now, {}, "early")])
    Pump(store, transport, PumpConfig(), clock=ahead.clock).dispatch_batch()
    store.history.keep()
    with store.engine.connect() as conn:
        bound = conn.execute(text("SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class c WHERE c.oid = "
                                  "to_regclass(:p)"), {"p": store.qualified(f"{table}_h260502")}).scalar()
    assert bound == f"FOR VALUES FROM ('{to_us(ahead.now) + 1}') TO ('{(to_us(ahead.now) // DAY_US + 1) * DAY_US}')"
    ahead.advance(1)
    store.store([DelayedMessage("orders", b"x", ahead.now, {}, "later")])
    Pump(store, transport, PumpConfig(), clock=ahead.clock).dispatch_batch()
    assert _where(store) == {"early": f"{table}_hdefault", "later": f"{table}_h260502"}
    assert [e.message_id for e in store.delivery_history().entries] == ["later", "early"]


def test_a_cancel_is_recorded_by_ids_and_by_a_filter(db):
    url, schema, table = db
    clock = HeldClock()
    store = _store(url, schema, table, clock)
    store.store([DelayedMessage("orders", b"x", clock.now + timedelta(hours=1), {}, f"c-{i}") for i in range(3)])
    store.controls.batch = 2  # the bulk path, in batches
    assert store.cancel(Selector(destination="orders"))["counts"]["cancelled"] == 3
    entries = store.delivery_history(outcome=CANCELLED).entries
    assert sorted(e.message_id for e in entries) == ["c-0", "c-1", "c-2"]
    assert {e.attempts for e in entries} == {0}
    store.store([DelayedMessage("orders", b"x", clock.now + timedelta(hours=1), {}, "by-id")])
    store.cancel(Selector(message_ids=("by-id",)))
    assert store.message_story("by-id")["state"] == CANCELLED


def test_in_memory_history_follows_the_same_rules():
    clock = HeldClock()
    store = InMemoryStore(clock=clock.clock, history_days=1)
    from airflow_delay_provider.testing.transport import InMemoryTransport

    transport = InMemoryTransport()
    transport.provision("orders")
    store.store([DelayedMessage("orders", b"x", clock.now, {}, "m1")])
    Pump(store, transport, PumpConfig(), clock=clock.clock).dispatch_batch()
    assert store.message_story("m1")["state"] == DELIVERED
    clock.advance(2 * 86_400)
    store.store([DelayedMessage("orders", b"x", clock.now, {}, "m2")])
    Pump(store, transport, PumpConfig(), clock=clock.clock).dispatch_batch()
    assert [e.message_id for e in store.delivery_history().entries] == ["m2"]  # m1 is past the retention
    store.store([DelayedMessage("orders", b"x", clock.now + timedelta(hours=1), {}, "m3")])
    store.cancel(Selector(message_ids=("m3",)))
    [cancelled] = store.delivery_history(message_id="m3").entries
    assert cancelled.outcome == CANCELLED and cancelled.stored_at == clock.now


@pytest.mark.parametrize("kind", ["sql", "memory"])
def test_pages_of_the_history_show_each_entry_once_even_within_one_batch(db, kind):
    url, schema, table = db
    clock = HeldClock()
    store = _store(url, schema, table, clock) if kind == "sql" else InMemoryStore(clock=clock.clock)
    transport = make_transport(url, schema, table, "orders", "other")
    for batch in range(3):  # three batches of 7, each handed over at one time
        store.store([DelayedMessage("orders" if i % 2 else "other", b"x", clock.now, {}, f"b{batch}-{i}")
                     for i in range(7)])
        assert Pump(store, transport, PumpConfig(), clock=clock.clock).dispatch_batch().dispatched == 7
        clock.advance(1)
    seen, after, pages = [], None, 0
    while True:
        page = store.delivery_history(limit=4, after=after)
        seen += [e.message_id for e in page.entries]
        pages += 1
        if page.next is None:
            break
        after = page.next
    assert sorted(seen) == sorted(f"b{b}-{i}" for b in range(3) for i in range(7)) and pages == 6
    assert [m[:2] for m in seen] == ["b2"] * 7 + ["b1"] * 7 + ["b0"] * 7  # newest first
    orders = store.delivery_history(destination="orders", limit=100).entries
    assert len(orders) == 9 and {e.destination for e in orders} == {"orders"}


@pytest.mark.parametrize("kind", ["sql", "memory"])
def test_a_page_after_newer_entries_came_goes_on_from_where_the_last_one_ended(db, kind):
    """The cursor says where a page ended, not how many entries came before it: deliveries recorded between two
    pages (newer, so on no later page) neither repeat the last page's entries nor skip any."""
    url, schema, table = db
    clock = HeldClock()
    store = _store(url, schema, table, clock) if kind == "sql" else InMemoryStore(clock=clock.clock)
    transport = make_transport(url, schema, table, "orders", "other")

    def deliver(prefix: str, n: int) -> None:
        store.store([DelayedMessage("orders", b"x", clock.now, {}, f"{prefix}-{i}") for i in range(n)])
        assert Pump(store, transport, PumpConfig(), clock=clock.clock).dispatch_batch().dispatched == n
        clock.advance(1)

    for batch in range(3):
        deliver(f"b{batch}", 3)
    first = store.delivery_history(limit=4)
    deliver("new", 5)  # newer than every entry of the first page
    rest = store.delivery_history(limit=100, after=first.next)
    seen = [e.message_id for e in first.entries + rest.entries]
    assert sorted(seen) == sorted(f"b{b}-{i}" for b in range(3) for i in range(3)) and rest.next is None


def test_the_history_table_is_made_as_the_code_declares_it(db):
    url, schema, table = db
    store = _store(url, schema, table, HeldClock())
    declared = store.history.table
    with store.engine.connect() as conn:
        inspector = inspect(conn)
        found = {c["name"]: c["nullable"] for c in inspector.get_columns(declared.name, schema=schema)}
        indexes = sorted((ix["name"], tuple(ix["column_names"])) for ix in inspector.get_indexes(declared.name,
                                                                                              schema=schema))
    assert found == {c.name: c.nullable for c in declared.columns}
    assert indexes == sorted((ix.name, tuple(c.name for c in ix.columns)) for ix in declared.indexes)


def test_events_handed_to_airflow_are_recorded_as_delivered(db):
    url, schema, table = db
    clock = HeldClock()
    store = _store(url, schema, table, clock)
    destination = "airflow.asset.orders_due"
    store.store([DelayedMessage(destination, b"{}", clock.now - timedelta(seconds=3), {}, "ev-1")])
    store.open_event_claim("claim-1", destination, 60)
    leased, _ = store.lease_events("claim-1", destination, 10)
    assert [m.message_id for m in leased] == ["ev-1"]
    assert store.ack_events("claim-1", ["ev-1"]) == 1
    [entry] = store.delivery_history(destination=destination).entries
    assert (entry.outcome, entry.attempts, entry.lateness) == (DELIVERED, 1, 3.0)


@pytest.mark.parametrize("kind", ["sql", "memory"])
def test_a_forced_forget_records_each_message_it_purges_as_cancelled(db, kind):
    url, schema, table = db
    clock = HeldClock()
    store = _store(url, schema, table, clock) if kind == "sql" else InMemoryStore(clock=clock.clock)
    store.store([DelayedMessage("retired", b"x", clock.now + timedelta(hours=i), {}, f"r{i}") for i in range(3)])
    store.store([DelayedMessage("kept", b"x", clock.now + timedelta(hours=1), {}, "k0")])
    assert store.forget_destinations(["retired"], force=True)["purged"] == {"retired": 3}
    entries = store.delivery_history(limit=100).entries
    assert sorted((e.message_id, e.outcome, e.attempts) for e in entries) == [
        (f"r{i}", CANCELLED, 0) for i in range(3)]
    assert store.message_story("r1")["state"] == CANCELLED and store.message_story("k0")["state"] == "scheduled"


def test_events_retried_and_dead_lettered_are_recorded_so_with_their_failure(db):
    url, schema, table = db
    clock = HeldClock()
    store = _store(url, schema, table, clock)
    destination = "airflow.asset.orders_due"
    due = clock.now - timedelta(seconds=2)
    store.store([DelayedMessage(destination, b"{}", due, {}, "ev-1")])
    store.open_event_claim("claim-1", destination, 60)
    store.lease_events("claim-1", destination, 10)
    assert store.retry_events("claim-1", {"ev-1": clock.now}, failures={"ev-1": "the event was not recorded"}) == 1
    clock.advance(5)
    store.lease_events("claim-1", destination, 10)
    assert store.ack_events("claim-1", ["ev-1"], failures={"ev-1": "rejected by a subscriber"}) == 1
    story = [(e.outcome, e.attempts, e.due_at, e.detail) for e in store.delivery_history(message_id="ev-1").entries]
    assert story == [(RETRIED, 1, due, "the event was not recorded"),
                     (DEAD_LETTERED, 2, clock.now - timedelta(seconds=5), "rejected by a subscriber")]
    assert store.message_story("ev-1")["state"] == DEAD_LETTERED
