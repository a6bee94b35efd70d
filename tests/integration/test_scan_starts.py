"""Where a pump's claims start reading the due index and a consumer's receives a SQL-table queue, on the real
PostgreSQL (engine.IndexStart).

Every claimed message and every received and acked one leaves a dead entry at the beginning of its index until
VACUUM removes it, and while any transaction in the database holds an older snapshot (a backup, a report, a
REINDEX CONCURRENTLY) nothing can. A scan that read the index from its beginning walked them all: here it starts
past them, and still finds every message that becomes due or visible below that point (other consumers' releases
and expired visibility timeouts, its own releases, a destination resumed, a sender's transaction that commits
late)."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.dialects import postgresql

from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.stores.tables import to_us
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.helpers import EngineClock


@pytest.fixture
def clock(monkeypatch) -> EngineClock:
    return EngineClock.install(monkeypatch)


@pytest.fixture
def queue(pg) -> SqlTableTransport:
    url, schema, table = pg
    transport = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    transport.provision("orders")
    yield transport
    transport.close()


def _send(queue: SqlTableTransport, n: int, prefix: str) -> None:
    due = queue.clock()
    queue.send([DelayedMessage("orders", b"x", due, {}, f"{prefix}-{i}") for i in range(n)])


def _entries_read(database, table: str, query) -> int:
    """Index entries a query's scans of `table`'s indexes (or its partitions') read (dead ones too), from the
    transaction's own statistics; the query is rolled back. All its indexes: where the statistics make two serve the
    order (a queue's (queue, seq) and its primary key), either may be the one read."""
    sql = str(query.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    # The counts a backend has not reported yet, which include its earlier transactions': read before and after.
    # A partitioned table (the store's messages): its partitions' indexes.
    count = text("SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(indexrelid)), 0) FROM pg_index "
                 "WHERE indrelid = to_regclass(:table) OR indrelid IN "
                 "(SELECT inhrelid FROM pg_inherits WHERE inhparent = to_regclass(:table))"
                 ).bindparams(table=database.qualified(table))
    with database.engine.connect() as conn:
        database.in_index_order(conn)
        before = conn.execute(count).scalar()
        conn.execute(text(sql.replace("%%", "%"))).all()
        return conn.execute(count).scalar() - before


def _receive_reads(queue: SqlTableTransport, start: int) -> int:
    return _entries_read(queue, queue.messages.name, queue._receiving("orders", 10, queue.clock(), start))


def test_a_receive_passes_the_dead_entries_a_held_snapshot_keeps(queue, clock, pg):
    """5,000 messages received and acked while another session holds a snapshot: the next receive of the 10 sent
    after them starts past the 5,000 dead entries (reading from the start touches a buffer per dead entry)."""
    with psycopg.connect(pg[0].replace("postgresql+psycopg://", "postgresql://")) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1").fetchone()  # the snapshot: no row deleted after it can be removed
        _send(queue, 5000, "old")
        while batch := queue.receive("orders", max_messages=1000, visibility_timeout=600):
            queue.ack("orders", [m.receipt for m in batch])
            clock.reading_due()  # a reading per batch: the last one comes after every old message was sent
        _send(queue, 10, "new")
        clock.reading_due()
        got = queue.receive("orders", max_messages=10, visibility_timeout=600)
        assert [m.message_id for m in got] == [f"new-{i}" for i in range(10)]
        queue.release("orders", [m.receipt for m in got])
        start = queue._starts["orders"].value
        assert start > 5000 - 1000, start  # past the dead entries of all but the last reading's batch
        from_start = _receive_reads(queue, 0)
        started = _receive_reads(queue, start)
        assert from_start > 5000  # the case this guards against: every dead entry read
        assert started < 100


def test_messages_turning_visible_below_the_start_are_received(queue, clock, pg):
    url, schema, table = pg
    other = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    try:
        _send(queue, 3, "m")
        # Another consumer takes m-0 for 30 s; this one takes m-1, then a later reading starts at m-2.
        assert [m.message_id for m in other.receive("orders", 1, visibility_timeout=30)] == ["m-0"]
        first = queue.receive("orders", 1, visibility_timeout=7200)
        assert [m.message_id for m in first] == ["m-1"]
        clock.reading_due()
        assert [m.message_id for m in queue.receive("orders", 1, visibility_timeout=7200)] == ["m-2"]
        start = queue._starts["orders"].value
        assert start > first[0].receipt
        # Its own release: found by the next receive, before any reading.
        queue.release("orders", [first[0].receipt])
        assert [m.message_id for m in queue.receive("orders", 1, visibility_timeout=7200)] == ["m-1"]
        # Another consumer's message whose visibility timeout ends: in the reading before it ends, it is "soon".
        with queue.engine.begin() as conn:
            # It ends within the next reading's second.
            visible_at_us = conn.execute(text(
                f"UPDATE {queue.qualified(queue.messages.name)} SET visible_at_us = visible_at_us - 29500000 "
                "WHERE message_id = 'm-0' RETURNING visible_at_us")).scalar_one()
        clock.reading_due()
        got = queue.receive("orders", 1)
        # Not before it is visible; on a loaded machine the half second may be over by now, and then it is due.
        assert got == [] or to_us(queue.clock()) >= visible_at_us, got
        deadline = queue.clock() + timedelta(seconds=30)
        while not got and queue.clock() < deadline:  # the real clock: the timeout ends on the database's
            got = queue.receive("orders", 1)
        assert [m.message_id for m in got] == ["m-0"]
    finally:
        other.close()


@pytest.mark.parametrize("full_readings", [True, False], ids=["full-readings", "quick-readings-between"])
def test_a_sender_transaction_that_commits_after_readings_is_received(queue, clock, full_readings):
    """Rows inserted (their seqs handed out) before two readings and committed after them: the next full reading
    finds them, as it takes the first visible row from the beginning. The readings between full ones walk from the
    start only (the dead entries before it are what they save walking), and leave them to it."""
    queue.receive("orders", 1)  # the first reading (a full one)
    queue._starts["orders"]._full_every = 2 if full_readings else 3600
    with queue.engine.connect() as conn, conn.begin() as tx:
        queue.send([DelayedMessage("orders", b"x", queue.clock(), {}, "slow")], connection=conn)
        for round_ in range(3):
            _send(queue, 2, f"quick{round_}")
            clock.reading_due()
            got = queue.receive("orders", 10, visibility_timeout=600)
            assert [m.message_id for m in got] == [f"quick{round_}-0", f"quick{round_}-1"]
            queue.ack("orders", [m.receipt for m in got])
        tx.commit()
    assert queue._starts["orders"].value > 1 + 2  # the start passed the slow row's seq
    assert queue.receive("orders", 10) == []  # the reading stands: not found yet
    clock.reading_due()
    if not full_readings:
        assert queue.receive("orders", 10) == []  # a quick reading: not found yet
        clock.now += 3600
        assert queue.receive("orders", 10) == []  # the first receive after a wait keeps the start
    assert [m.message_id for m in queue.receive("orders", 10)] == ["slow"]


# -- the store's claims ------------------------------------------------------------------------------------
@pytest.fixture
def store(pg) -> SqlDelayedMessageStore:
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    yield store
    store.close()


def _store_due_now(store: SqlDelayedMessageStore, n: int, prefix: str, destination: str = "orders",
                   ago: float = 0.001) -> None:
    due = store.clock() - timedelta(seconds=ago)
    store.store([DelayedMessage(destination, b"x", due, {}, f"{prefix}-{i}") for i in range(n)])


def _claim(store: SqlDelayedMessageStore, limit: int = 1000) -> list[str]:
    with store.claim_due(store.clock(), limit) as claim:
        ids = [m.message_id for m in claim.messages]
        claim.remove(ids)
    return ids


def _claim_reads(store: SqlDelayedMessageStore) -> int:
    return _entries_read(store, store.table_name, store.due_ids(store.clock(), 10))


def test_a_claim_passes_the_dead_entries_a_held_snapshot_keeps(store, clock, pg):
    with psycopg.connect(pg[0].replace("postgresql+psycopg://", "postgresql://")) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1").fetchone()
        _store_due_now(store, 5000, "old", ago=10)  # before the readings' marks (their clock less a second)
        while _claim(store):
            clock.reading_due()
        _store_due_now(store, 10, "new")
        clock.reading_due()
        started = _claim_reads(store)  # a reading: the start passes the 5,000 claimed
        store.claims.due_start.value = 0
        from_beginning = _claim_reads(store)
        assert from_beginning > 5000  # the case this guards against: every dead entry read
        assert started < 100
        assert sorted(_claim(store)) == sorted(f"new-{i}" for i in range(10))


def test_a_destination_resumed_below_the_start_is_claimed_after_the_next_due_time_is_read(store, clock):
    """A pump that finds nothing to claim reads the next due time, from the beginning: that lowers the start, so
    a paused destination's old messages are claimed as soon as it is resumed (the pump's wake-up reads it)."""
    _store_due_now(store, 2, "held", destination="held", ago=10)  # due before any reading's mark
    store.set_paused(["held"], True)
    for round_ in range(3):
        _store_due_now(store, 3, f"o{round_}")
        clock.reading_due()
        assert sorted(_claim(store)) == [f"o{round_}-{i}" for i in range(3)]
    store.set_paused(["held"], False)
    assert _claim(store) == []  # the start passed them while they were paused
    assert store.next_due() is not None
    assert sorted(_claim(store)) == ["held-0", "held-1"]


def test_a_message_stored_by_a_transaction_that_commits_late_is_claimed_at_the_next_full_reading(store, clock):
    store.next_due()  # nothing stored: no effect
    _claim(store)  # the first (full) reading
    store.claims.due_start._full_every = 3600
    with store.engine.connect() as conn, conn.begin():
        conn.execute(text(f"INSERT INTO {store.qualified(store.table_name)} (message_id, destination, body, headers, "
                          "due_at_us, stored_at_us) VALUES ('slow', 'orders', '\\x00', '{}', :due, :due)"),
                     {"due": to_us(store.clock() - timedelta(seconds=10))})  # before any mark
        for round_ in range(3):
            _store_due_now(store, 2, f"quick{round_}")
            clock.reading_due()
            assert sorted(_claim(store)) == [f"quick{round_}-0", f"quick{round_}-1"]
    assert _claim(store) == []  # the reading stands
    clock.reading_due()
    assert _claim(store) == []  # a quick reading walks from the start, past it
    clock.now += 3600
    assert _claim(store) == []  # the first claim after a wait keeps the start: the reading comes at the next
    assert _claim(store) == ["slow"]


def test_a_reading_of_where_claims_start_stops_at_the_first_row(store):
    """5,000 messages due later: the reading reads the first entry of the due index, not all of them (as
    `min(due_at_us)` did under the claims' planner settings: on a soak's store of 9,000,000 every reading took 7-10
    s, and the pump fell behind by a minute each minute)."""
    _store_due_now(store, 5000, "later", ago=-3600)
    reading = store.claims.earliest_due(to_us(store.clock())).where(store.table.c.due_at_us >= 0)
    assert _entries_read(store, store.table_name, reading) < 10


def test_a_claim_is_the_same_statement_whether_or_not_where_claims_start_is_known(store, clock):
    """Where claims start is a bound value from the first claim on: a condition added only once the start was known
    made the first claim of a burst, after a pump had slept through the reading that found it, a statement the
    process had never run, compiled and planned on the way to the burst's first row."""
    def claim_sql() -> str:
        return str(store.due_ids(store.clock(), 10).compile(dialect=postgresql.dialect()))

    unknown = claim_sql()  # nothing stored, nothing read: no start yet
    assert store.claims.due_start.value == 0
    _store_due_now(store, 3, "a")
    for _ in range(2):
        clock.reading_due()
        _claim(store)
    assert store.claims.due_start.value != 0
    assert claim_sql() == unknown


def test_a_receive_is_the_same_statement_whether_or_not_where_it_starts_is_known(queue):
    """As the claims': a consumer's first receive after a wait is not a statement its process has not run."""
    def receive_sql(start: int) -> str:
        return str(queue._receiving("orders", 10, queue.clock(), start).compile(dialect=postgresql.dialect()))

    assert receive_sql(0) == receive_sql(12345)
