"""The store's own upkeep on the real PostgreSQL: ANALYZE after a bulk load, VACUUM after deliveries, one
process at a time, never in a pump's way."""

from __future__ import annotations

import threading
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import inspect, text

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump
from airflow_delay_provider.stores import upkeep
from airflow_delay_provider.stores.migrations import latest_version
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.stores.tables import to_us
from airflow_delay_provider.stores.upkeep import Thresholds
from airflow_delay_provider.testing import InMemoryStore, InMemoryTransport
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.waiting import wait_for

SMALL = Thresholds(analyze_base=500, analyze_fraction=0.0, vacuum_base=500, vacuum_fraction=0.0)


def _bulk(store: SqlDelayedMessageStore, n: int, delay: float) -> None:
    due = utcnow() + timedelta(seconds=delay)
    for start in range(0, n, 1000):
        store.store([DelayedMessage("orders", b"x", due) for _ in range(min(1000, n - start))])


def _loaded(pg) -> SqlDelayedMessageStore:
    """A store with the small thresholds and 1,000 rows whose inserts the statistics views already show."""
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    store.maintenance.thresholds = SMALL
    _bulk(store, 1000, delay=30)  # due within a minute: in `_soon`, whose counters these tests read
    wait_for(lambda: (_counters(store)[1] or 0) >= 1000, 10, "the insert counters")
    return store


def _transport() -> InMemoryTransport:
    transport = InMemoryTransport()
    transport.provision("orders")
    return transport


def _soon(store: SqlDelayedMessageStore) -> str:
    """The partition of the messages due within minutes (schema version 8): what these tests write, and what the
    upkeep works on (the partitioned table has no rows, counters or unique indexes of its own)."""
    return store.qualified(store.tables.soon.name)


def _counters(store: SqlDelayedMessageStore) -> tuple:
    with store.engine.connect() as conn:
        return conn.execute(text("SELECT n_dead_tup, n_mod_since_analyze, last_vacuum, last_analyze "
                                 "FROM pg_stat_user_tables WHERE relid = to_regclass(:t)"),
                            {"t": _soon(store)}).first()


def test_a_bulk_load_is_analysed_and_deliveries_are_vacuumed(pg):
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    store.maintenance.thresholds = SMALL
    _bulk(store, 2000, delay=-1)
    # The statistics counters reach the views when the writing backend flushes them (within a second or so).
    wait_for(lambda: (_counters(store)[1] or 0) >= 2000, 10, "the insert counters")
    done = store.maintenance.run()
    assert (store.tables.soon.name, "analyze") in [(t, w) for t, w, _ in done]
    assert _counters(store)[3] is not None  # last_analyze

    Pump(store, _transport()).run(stop_when_idle=True)  # claims delete every row
    wait_for(lambda: (_counters(store)[0] or 0) >= 2000, 10, "the dead-row counters")
    done = store.maintenance.run()
    assert (store.tables.soon.name, "vacuum") in [(t, w) for t, w, _ in done]
    # (How many dead rows it could remove depends on the oldest snapshot of the whole server: other tests'.)
    assert _counters(store)[2] is not None  # last_vacuum


def test_a_store_with_nothing_to_do_does_nothing(pg):
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    _bulk(store, 100, delay=60)
    assert store.maintenance.run() == []  # 100 rows: far below the default thresholds


def test_one_process_at_a_time(pg):
    url, _, table = pg
    store = _loaded(pg)
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as other:
        assert other.execute("SELECT pg_try_advisory_lock(%s)", [store.maintenance.key()]).fetchone()[0]
        assert store.maintenance.run() == []  # the other holder is at it
        # Released here, not by closing: a closed connection's backend lets go of its locks some time after
        # the client has moved on, and the next try could still find the lock held.
        assert other.execute("SELECT pg_advisory_unlock(%s)", [store.maintenance.key()]).fetchone()[0]
    assert [w for t, w, _ in store.maintenance.run() if t == store.tables.soon.name] == ["analyze"]


def test_upkeep_never_waits_for_a_lock(pg):
    """A migration or an administrator holding the table: the upkeep gives up at once instead of queueing
    behind it (and making every claim queue behind itself)."""
    url, _, table = pg
    store = _loaded(pg)
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as other:
        other.execute(f"LOCK TABLE {_soon(store)} IN SHARE UPDATE EXCLUSIVE MODE")
        # SKIP_LOCKED: nothing done to the held table, nothing waited for (its ids table is analysed).
        assert [w for t, w, _ in store.maintenance.run() if t == store.tables.soon.name] == []
        other.rollback()
    assert [w for t, w, _ in store.maintenance.run() if t == store.tables.soon.name] == ["analyze"]


def test_upkeep_starts_in_the_background_at_most_every_check_interval(pg, monkeypatch):
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    started = []
    # The check of the tables the claims churn (`_later` has one of its own: test_tiers.py).
    monkeypatch.setattr(upkeep.TableUpkeep, "run", lambda self: self is store.maintenance and started.append(1))
    store.upkeep()
    wait_for(lambda: started, 10, "the first check")
    store.maintenance.thread.join(10)
    store.upkeep()  # within the interval: nothing
    assert store.maintenance.thread is None or not store.maintenance.thread.is_alive()
    assert started == [1]
    monkeypatch.setattr(upkeep, "UPKEEP_CHECK_SECONDS", 0.0)
    store.upkeep()
    wait_for(lambda: len(started) == 2, 10, "the next check")


def test_sqlite_stores_have_no_upkeep(tmp_path, monkeypatch):
    store = SqlDelayedMessageStore(f"sqlite:///{tmp_path}/s.db")
    store.create_schema()
    store.upkeep()
    assert store.maintenance.thread is None


def test_pumps_call_upkeep_between_batches():
    calls = []

    class Store(InMemoryStore):
        def upkeep(self) -> None:
            calls.append(1)

    store = Store()
    store.store([DelayedMessage("orders", b"x", utcnow()) for _ in range(5)])
    Pump(store, _transport()).run(stop_when_idle=True)
    assert len(calls) >= 2


def test_upkeep_leaves_its_connection_as_it_found_it(pg):
    """Its lock timeout, name and vacuum pacing must not follow the pooled connection to a claim or a cancel."""
    settings = text("SELECT current_setting('lock_timeout'), current_setting('vacuum_cost_delay'), "
                    "current_setting('application_name')")
    store = _loaded(pg)
    with store.engine.connect() as conn:
        before = conn.execute(settings).one()
    assert store.maintenance.run()
    for _ in range(store.engine.pool.size() + 2):  # whichever pooled connection it used
        with store.engine.connect() as conn:
            assert conn.execute(settings).one() == before


def test_a_migration_cancels_the_upkeep_instead_of_waiting_for_it(pg):
    """A VACUUM of millions of rows runs for minutes with a lock the migration's DDL needs, and every claim would
    queue behind the waiting DDL: the migration cancels it (as autovacuum yields), the upkeep runs again later."""
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.migrate(up_to=5)
    outcome = []
    holding = threading.Event()

    def upkeep_at_work() -> None:  # what a long VACUUM looks like to the migration: its lock, its name, its query
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"),
                             application_name=upkeep.APPLICATION_NAME) as conn:
            conn.execute(f"LOCK TABLE {store.qualified(store.table_name)} IN SHARE UPDATE EXCLUSIVE MODE")
            holding.set()
            try:
                conn.execute(f"SELECT pg_sleep(120), '{store.qualified(store.table_name)}'")
                outcome.append("finished")
            except psycopg.errors.QueryCanceled:
                outcome.append("cancelled")

    worker = threading.Thread(target=upkeep_at_work)
    worker.start()
    try:
        assert holding.wait(30)

        def at_work():  # a new transaction each time: pg_stat_activity is read once per transaction
            with store.engine.connect() as conn:
                return conn.execute(text(
                    "SELECT 1 FROM pg_stat_activity WHERE application_name = :app AND state = 'active' "
                    "AND query LIKE 'SELECT pg_sleep%'"), {"app": upkeep.APPLICATION_NAME}).first()

        wait_for(at_work, 30, "the stand-in upkeep to be at work")
        assert store.migrate() == list(range(6, latest_version() + 1))
    finally:
        worker.join(timeout=150)
    assert outcome == ["cancelled"]
    assert store.controls.counts.counted()


def test_a_queue_table_is_looked_after_by_its_consumers_and_pumps(pg, monkeypatch):
    """Receives update the SQL-table queue's rows and acks delete them: where autovacuum is off or behind, the
    processes that use the queue vacuum and analyse it (here a consumer's receives), as they do the store."""
    monkeypatch.setattr(upkeep, "UPKEEP_CHECK_SECONDS", 0.0)
    url, schema, table = pg
    queue = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    queue.provision("orders")
    queue.maintenance.thresholds = SMALL
    queue.send([DelayedMessage("orders", b"x", utcnow()) for _ in range(2000)])
    while received := queue.receive("orders", max_messages=500):
        queue.ack("orders", [m.receipt for m in received])

    def looked_after() -> bool:
        assert queue.receive("orders") == []  # each receive starts the upkeep when it is time
        with queue.engine.connect() as conn:
            return conn.execute(text("SELECT vacuum_count > 0 AND analyze_count > 0 FROM pg_stat_user_tables "
                                     "WHERE relid = to_regclass(:t)"),
                                {"t": queue.qualified(queue.messages.name)}).scalar()

    wait_for(looked_after, 30, "the consumer's upkeep to vacuum and analyse the queue table")
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    assert queue.maintenance.key() != store.maintenance.key()  # neither waits for the other's turn


def test_pumps_call_the_transports_upkeep_too():
    calls = []

    class Transport(InMemoryTransport):
        def upkeep(self) -> None:
            calls.append(1)

    store = InMemoryStore()
    store.store([DelayedMessage("orders", b"x", utcnow()) for _ in range(5)])
    transport = Transport()
    transport.provision("orders")
    Pump(store, transport).run(stop_when_idle=True)
    assert len(calls) >= 2


@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
def test_a_queue_table_from_before_gets_its_queue_order_index(pg, tmp_path, database):
    url, schema, table = pg
    if database == "sqlite":
        url, schema = f"sqlite:///{tmp_path}/q.db", None
    queue = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    queue.provision("orders")
    queue.send([DelayedMessage("orders", b"kept", utcnow())])
    new, old = next(iter(queue.messages.indexes)).name, f"ix_{table}_queue_messages_visible"
    versions = queue.migrations.target.versions
    with queue.engine.begin() as conn:  # the tables as an earlier release made them: another index, no versions
        conn.exec_driver_sql(f"DROP INDEX {queue.qualified(new)}")
        conn.exec_driver_sql(f"CREATE INDEX {old} ON {queue.qualified(queue.messages.name)} "
                             "(queue, visible_at_us, seq)")
        conn.exec_driver_sql(f"DROP TABLE {queue.qualified(versions.name)}")

    def indexes() -> set[str]:
        with queue.engine.connect() as conn:
            return {ix["name"] for ix in inspect(conn).get_indexes(queue.messages.name, schema=schema)}

    assert old in indexes() and new not in indexes()
    queue.provision("billing")
    assert new in indexes() and old not in indexes()
    assert queue.migrations.schema_version() == 1  # adopted, and recorded
    assert [m.body for m in queue.receive("orders")] == [b"kept"]


def _index_pages(store: SqlDelayedMessageStore) -> dict[str, int]:
    with store.engine.connect() as conn:
        return dict(conn.execute(text(
            "SELECT c.relname, pg_relation_size(c.oid) / 8192 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = to_regclass(:t)"), {"t": _soon(store)}).all())


def _sparse_store(pg) -> tuple[SqlDelayedMessageStore, dict[str, int], dict[str, int]]:
    """A store whose id and message-id indexes a delivery left sparse: 2,000 messages due a day later stay of
    100,000 sent in order. Returns it and its indexes' pages before and after the delivery."""
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    store.maintenance.thresholds = Thresholds(rebuild_min_pages=64)
    name = store.qualified(store.table_name)
    now = to_us(store.clock())
    with store.engine.begin() as conn:
        # 100,000 messages in order of sending, one in 50 due a day later, the others due within the minute.
        conn.execute(text(f"INSERT INTO {name} (message_id, destination, body, headers, due_at_us, stored_at_us) "
                          "SELECT 'm-' || lpad(g::text, 12, '0'), 'orders', '\\x00', '{}', "
                          "CASE WHEN g % 50 = 0 THEN :later ELSE :soon END, 0 FROM generate_series(1, 100000) g"),
                     {"later": now + 86_400_000_000, "soon": now + 60_000_000})
    # A backend reports its counters up to seconds after its commit: counted after the ANALYZE, the inserts would
    # read as changed since it, and the upkeep would analyse again.
    wait_for(lambda: (_counters(store)[1] or 0) >= 100_000, 30, "the insert counters")
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"VACUUM ANALYZE {name}")
        before = _index_pages(store)
        # An interrupted rebuild's leftover: an invalid index named as REINDEX CONCURRENTLY names its copy.
        with pytest.raises(Exception, match="could not create unique index"):
            conn.exec_driver_sql(f'CREATE UNIQUE INDEX CONCURRENTLY "{store.table_name}_due_ccnew" ON {_soon(store)} '
                                 "(due_at_us)")
        assert f"{store.table_name}_due_ccnew" in _index_pages(store)
        assert store.maintenance.run() == []  # packed: nothing to rebuild
        conn.exec_driver_sql(f"DELETE FROM {name} WHERE due_at_us < {now + 3_600_000_000}")  # delivered
        conn.exec_driver_sql(f"VACUUM ANALYZE {name}")
    sparse = _index_pages(store)
    assert f"{store.table_name}_due_ccnew" not in sparse  # dropped by the check above
    return store, before, sparse


def test_indexes_left_sparse_by_mixed_delays_are_rebuilt(pg_own_database):
    """Ids and default message ids grow with time, and messages due hours later keep a few entries on every page
    of their indexes after the rest were delivered: the upkeep rebuilds such an index (writes going on), leaves
    the due index (which empties from its left edge) and the rest alone, and drops an interrupted rebuild's copy.
    In a database of its own: the rebuild gives way to any older transaction of its database (the next test), and
    in the shared one other tests' (or another program's) transactions made it give way."""
    store, before, sparse = _sparse_store(pg_own_database)
    rebuilt = {index.split(".")[-1].strip('"'): work for index, work, _ in store.maintenance.run() if work == "reindex"}
    assert rebuilt == {f"{store.table_name}_pkey": "reindex", f"{store.table_name}_message_id_key": "reindex"}
    after = _index_pages(store)
    for index in rebuilt:
        assert after[index] < sparse[index] / 10 and sparse[index] == before[index]
    due_index = store._template_names()["ix_soon_due"].strip('"')
    assert after[due_index] == sparse[due_index]  # its empty pages get reused
    assert store.backlog()["totals"]["scheduled"] == 2000
    assert len(store.browse(Selector(destination="orders"), limit=5)["messages"]) == 5


def test_a_rebuild_gives_way_to_an_older_transaction_and_the_vacuums_go_on(pg_own_database):
    """At its end REINDEX CONCURRENTLY waits for every transaction of the database older than it (a report, a
    backup, another program's long COPY): the upkeep gives up at its lock timeout, keeps the old index, still
    vacuums and analyses, drops the copy the rebuild left and tries again only later."""
    store, _, sparse = _sparse_store(pg_own_database)
    store.maintenance.thresholds = Thresholds(rebuild_min_pages=64, vacuum_base=100, vacuum_fraction=0.0,
                                              analyze_base=100, analyze_fraction=0.0)
    with store.engine.begin() as conn:
        conn.execute(text(f"DELETE FROM {store.qualified(store.table_name)} WHERE message_id <= 'm-000000050000'"))
    wait_for(lambda: (_counters(store)[0] or 0) >= 1000, 30, "the delete counters")
    soon = _soon(store).split(".")[-1].strip('"')
    dsn = pg_own_database[0].replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as report:
        report.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        report.execute("SELECT 1")  # holds a snapshot, and no lock on the store's tables
        done = store.maintenance.run()
        report.execute("COMMIT")
    assert {(soon, "vacuum"), (soon, "analyze")} <= {(t, w) for t, w, _ in done}, done
    assert not [w for _, w, _ in done if w == "reindex"]
    pages = _index_pages(store)
    assert any(name.endswith("_ccnew") for name in pages), pages  # what the rebuild left
    pkey = f"{store.table_name}_pkey"
    assert pages[pkey] == sparse[pkey]
    assert not [w for _, w, _ in store.maintenance.run() if w == "reindex"]  # not again so soon
    assert not any(name.endswith("_ccnew") for name in _index_pages(store))
    store.maintenance._rebuild_after = 0.0  # the retry's wait over
    assert pkey in {index.split(".")[-1].strip('"') for index, work, _ in store.maintenance.run() if work == "reindex"}


def test_an_index_filled_by_a_bulk_load_is_not_taken_for_sparse(pg):
    """After a bulk load the statistics still count the rows from before it: the index's size is new entries,
    not empty space, and rebuilding it then would compete with the pumps for nothing."""
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    store.maintenance.thresholds = Thresholds(rebuild_min_pages=64)
    name = store.qualified(store.table_name)
    insert = text(f"INSERT INTO {name} (message_id, destination, body, headers, due_at_us, stored_at_us) "
                  "SELECT 'm-' || lpad(g::text, 12, '0'), 'orders', '\\x00', '{}', :due, 0 "
                  "FROM generate_series(CAST(:first AS int), CAST(:last AS int)) g")
    with store.engine.begin() as conn:
        conn.execute(insert, {"due": to_us(store.clock()) + 3_600_000_000, "first": 1, "last": 5_000})
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"VACUUM ANALYZE {name}")
        conn.execute(insert, {"due": to_us(store.clock()) + 3_600_000_000, "first": 5_001, "last": 200_000})
    wait_for(lambda: (_live(store) or 0) >= 200_000, 10, "the insert counters")
    assert [work for _, work, _ in store.maintenance.run() if work == "reindex"] == []


def _live(store: SqlDelayedMessageStore) -> int:
    with store.engine.connect() as conn:
        return conn.execute(text("SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = to_regclass(:t)"),
                            {"t": _soon(store)}).scalar()


def test_a_session_holding_an_old_snapshot_is_named_once(pg, monkeypatch, caplog):
    """A report or a session left idle in a transaction holds back every vacuum of the store; claims keep their
    speed past the dead entries, so the upkeep's warning is what shows it: the session's pid and name, once."""
    url, _, _ = pg
    store = _loaded(pg)
    dsn = url.replace("postgresql+psycopg://", "postgresql://")

    def named(pid: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and f"pid {pid} " in r.getMessage()]

    with psycopg.connect(dsn, application_name="adp-test-report") as report:
        report.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        report.execute("SELECT count(*) FROM pg_class")  # the snapshot, kept until the transaction ends
        pid = report.info.backend_pid
        with caplog.at_level("WARNING", logger=upkeep.__name__):
            monkeypatch.setattr(upkeep, "OLD_SNAPSHOT_SECONDS", 3600.0)
            store.maintenance.run()
            assert named(pid) == []  # not old enough
            monkeypatch.setattr(upkeep, "OLD_SNAPSHOT_SECONDS", 1.0)
            with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                wait_for(lambda: conn.execute(text(
                    "SELECT now() - xact_start > interval '1.5 s' FROM pg_stat_activity WHERE pid = :pid"),
                    {"pid": pid}).scalar(), 30, "the report's snapshot to be older than the threshold", 0.1)
            store.maintenance.run()
            (warning,) = named(pid)
            assert "adp-test-report" in warning and "idle in transaction" in warning
            assert store.qualified(store.table_name) in warning
            store.maintenance.run()
            assert len(named(pid)) == 1  # once per session and transaction
        report.rollback()
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        assert pid not in [h["pid"] for h in store.maintenance.name_old_snapshots(conn)]
