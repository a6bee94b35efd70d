"""The store's versioned migrations, on SQLite and the real PostgreSQL: a fresh store, a store at an old
version with rows in it, a store made before versions were recorded, concurrent upgrades."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
from sqlalchemy import Table, func, inspect, select, text

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.stores.migrations import latest_version, migrations
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.stores.tables import to_us
from airflow_delay_provider.transports.sql import QUEUE_SCHEMA, SqlTableTransport
from tests.helpers import drain, messages
from tests.waiting import wait_for


def _tables(store):
    """The tables the store creates: the backlog counts only on PostgreSQL."""
    return tuple(t for t in store.table.metadata.tables.values() if store.is_postgres or t is not store.tables.counts)


def _declared_shape(table: Table, extra: list) -> dict:
    """Columns (name: nullable), primary key and indexes (name, columns, unique) as the code declares them."""
    return {"columns": {c.name: c.nullable for c in table.columns},
            "primary_key": [c.name for c in table.primary_key.columns],
            "indexes": sorted([(ix.name, tuple(c.name for c in ix.columns), bool(ix.unique)) for ix in table.indexes]
                              + extra)}


def _found_shape(conn, table: Table) -> dict:
    """The same, read from the database."""
    inspector = inspect(conn)
    indexes = [ix for ix in inspector.get_indexes(table.name, schema=table.schema)
               if not ix.get("duplicates_constraint")]
    return {"columns": {c["name"]: c["nullable"] for c in inspector.get_columns(table.name, schema=table.schema)},
            "primary_key": inspector.get_pk_constraint(table.name, schema=table.schema)["constrained_columns"],
            "indexes": sorted((ix["name"], tuple(ix["column_names"]), bool(ix["unique"])) for ix in indexes)}


def test_queue_tables_are_made_by_their_migrations_as_the_code_declares_them(db):
    url, schema, table = db
    queues = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    assert queues.migrations.schema_version() == 0
    queues.create_schema()
    assert queues.migrations.schema_version() == latest_version(QUEUE_SCHEMA)
    with queues.engine.connect() as conn:
        for t in (queues.queues, queues.messages):
            assert _found_shape(conn, t) == _declared_shape(t, []), t.name
        assert inspect(conn).has_table(f"{table}_queue_versions", schema=schema)  # the record of versions
    assert queues.migrations.migrate() == []
    assert queues.provision("orders")["created"] is True


def _insert_v1_row(store, message_id: str, due) -> None:
    """A row as a version-1 store holds it (no claim_id), written with plain SQL as that release did."""
    with store.engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {store._template_names()['messages']} (message_id, destination, body, "
                          "headers, due_at_us, stored_at_us, failures) VALUES (:m, 'q', :b, '{}', :d, :d, 0)"),
                     {"m": message_id, "b": b"old", "d": to_us(due)})


def test_fresh_store_records_every_version_and_matches_the_table_definitions(db):
    url, schema, table = db
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    assert store.schema_version() == 0
    store.create_schema()
    assert store.schema_version() == latest_version()
    with store.engine.connect() as conn:
        rows = conn.execute(select(store.tables.versions.c.version, store.tables.versions.c.name)).all()
        # What the SQL files create is what the code declares (tables.py) and reads and writes.
        leased = store._template_names()["ix_leased"].strip('"')
        for t in _tables(store):
            declared = _declared_shape(t, extra=[])
            if t is store.table and store.is_postgres:
                # The one index the SQL files add beyond the declarations: partial, for the rows sweeps hold. The
                # unique keys are each partition's: PostgreSQL allows none on the partitioned table without `tier`.
                declared = _declared_shape(t, extra=[(leased, ("claim_id",), False)])
                assert _found_shape(conn, t) == {**declared, "primary_key": []}
                # `_later` is partitioned again by `tier` (schema version 9): its partitions hold the keys.
                found = _found_shape(conn, store.tables.later)
                assert found["columns"] == declared["columns"] and found["primary_key"] == []
                for part in (store.tables.soon, store.tables.far, *store.tables.hours):
                    found = _found_shape(conn, part)
                    assert found["columns"] == declared["columns"] and found["primary_key"] == ["id"], part.name
                    assert sorted(columns for _, columns, _ in found["indexes"]) == [("claim_id",), ("due_at_us", "id")]
                    unique = inspect(conn).get_unique_constraints(part.name, schema=schema)
                    assert [u["column_names"] for u in unique] == [["message_id"]], part.name
                continue
            assert _found_shape(conn, t) == declared, t.name
    assert sorted(rows) == [(m.version, m.name) for m in migrations()]
    assert store.migrate() == []  # up to date: nothing applied twice


@pytest.mark.parametrize("start", range(1, latest_version()))
def test_store_at_an_old_version_is_upgraded_with_its_rows(db, start):
    url, schema, table = db
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    assert store.migrate(up_to=start) == list(range(1, start + 1))
    assert store.schema_version() == start
    if start == 1:
        columns = {c["name"] for c in inspect(store.engine).get_columns(table, schema=schema)}
        assert "claim_id" not in columns and not inspect(store.engine).has_table(f"{table}_sweeps", schema=schema)
    due = utcnow() - timedelta(seconds=1)
    _insert_v1_row(store, "old-1", due)

    assert store.migrate() == list(range(start + 1, latest_version() + 1))
    # The old row is intact, claimable, and the newer features work on the upgraded store.
    assert store.store(messages(2)) == 2
    with store.claim_due(utcnow(), 10) as claim:
        got = {m.message_id: m for m in claim.messages}
        claim.remove(got)
    assert got["old-1"].body == b"old" and got["old-1"].due_at == due
    store.set_queue_delays({"q": 5})
    assert store.queue_delays(["q"]) == {"q": 5}
    store.start_sweep("after-upgrade", due_before=utcnow())


@pytest.mark.parametrize("with_claim_id", [False, True])
def test_store_made_before_versions_were_recorded_is_adopted(db, with_claim_id, caplog):
    url, schema, table = db
    old = SqlDelayedMessageStore(url, table=table, schema=schema)
    old.migrate(up_to=2 if with_claim_id else 1)
    with old.engine.begin() as conn:  # what an older release left: the tables and no record of versions
        old.tables.versions.drop(conn)
    _insert_v1_row(old, "kept", utcnow())

    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    with caplog.at_level(logging.INFO, logger="airflow_delay_provider.stores.migrations"):
        applied = store.migrate()
    first_new = 3 if with_claim_id else 2
    assert applied == list(range(first_new, latest_version() + 1))
    assert f"adopted at version {first_new - 1}" in caplog.text
    assert store.schema_version() == latest_version()
    assert store.count_scheduled() == {"q": 1}


def test_concurrent_upgrades_apply_each_migration_once(pg):
    url, schema, table = pg
    results, errors = [], []

    def upgrade():
        try:
            results.append(SqlDelayedMessageStore(url, table=table, schema=schema).migrate())
        except Exception as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=upgrade) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(v for r in results for v in r) == list(range(1, latest_version() + 1))
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    with store.engine.connect() as conn:
        count = conn.execute(select(func.count()).select_from(store.tables.versions)).scalar()
    assert count == latest_version()


def test_a_foreign_table_of_that_name_is_refused_before_anything_is_created(db):
    url, schema, table = db
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    with store.engine.begin() as conn:
        if schema:
            conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
        conn.execute(text(f"CREATE TABLE {store._template_names()['messages']} (id INTEGER, name TEXT)"))
    with pytest.raises(InvalidInputError, match="not a delay store table"):
        store.create_schema()
    assert store.schema_version() == 0
    assert not inspect(store.engine).has_table(f"{table}_policies", schema=schema)


def test_a_store_newer_than_this_release_is_used_as_is(db, caplog):
    url, schema, table = db
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    with store.engine.begin() as conn:
        conn.execute(store.tables.versions.insert(), {"version": latest_version() + 1, "name": "future",
                                               "applied_at_us": 0})
    with caplog.at_level(logging.WARNING, logger="airflow_delay_provider.stores.migrations"):
        assert store.migrate() == []
    assert "this release knows up to" in caplog.text
    assert store.store(messages(1)) == 1


@pytest.mark.parametrize("up_to", [0, -1, 10_000])
def test_migrating_to_a_version_that_does_not_exist_is_refused(db, up_to):
    store = SqlDelayedMessageStore(db[0], table=db[2], schema=db[1])
    with pytest.raises(InvalidInputError, match=f"up_to must be a schema version from 1 to {latest_version()}"):
        store.migrate(up_to=up_to)
    assert store.schema_version() == 0


def test_upgrade_from_version_4_runs_under_pumps_and_loses_nothing(pg):
    """Version 5 sets table options (no lock that blocks writes); version 6 holds writes for as long as it
    counts the rows: a store at version 4 is upgraded while two pumps deliver messages due before, during and
    after the upgrade, each exactly once and none early, and the counts start right."""
    from airflow_delay_provider.core.pump import Pump
    from airflow_delay_provider.transports.sql import SqlTableTransport

    url, schema, table = pg
    old = SqlDelayedMessageStore(url, table=table, schema=schema)
    assert old.migrate(up_to=4) == [1, 2, 3, 4]
    batches = [messages(100, "orders", delay=d, start=100 * i) for i, d in enumerate((-1.0, 1.0, 8.0))]
    for batch in batches:
        old.store(batch)
    last_due = max(m.due_at for batch in batches for m in batch)
    transport = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    transport.provision("orders")
    results, errors = [], []

    def pump() -> None:
        try:
            store = SqlDelayedMessageStore(url, table=table, schema=schema)
            results.append(Pump(store, SqlTableTransport(url, schema=schema, table_prefix=f"{table}_"))
                           .run(due_before=last_due + timedelta(microseconds=1)))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    pumps = [threading.Thread(target=pump) for _ in range(2)]
    for t in pumps:
        t.start()
    received = []
    try:
        # Upgraded once the pumps are delivering: the first batch is gone and the later ones wait.
        wait_for(lambda: not old.count_scheduled(due_before=utcnow() - timedelta(seconds=0.5)), 30,
                 "the pumps to deliver the messages that were due before the upgrade")
        upgraded = SqlDelayedMessageStore(url, table=table, schema=schema)
        assert upgraded.migrate() == list(range(5, latest_version() + 1))
        assert upgraded.count_scheduled(), "the upgrade must have run while messages were still waiting"
        for t in pumps:
            t.join(timeout=60)
        assert errors == [] and not any(t.is_alive() for t in pumps)
        received = drain(transport, "orders")
    finally:
        for t in pumps:
            t.join(timeout=60)
    ids = [m.message_id for m in received]
    assert sorted(ids) == sorted(m.message_id for batch in batches for m in batch)  # each once
    due = {m.message_id: m.due_at for batch in batches for m in batch}
    assert all(m.enqueued_at >= due[m.message_id] for m in received)  # none early
    assert sum(r.stats.dispatched for r in results) == 300
    with upgraded.engine.connect() as conn:
        # The partitions that keep rows (the partitioned tables keep none): `_soon`, `_far` (schema version 8's
        # `_later`) and the hours' partitions, which are truncated, and vacuumed only at a fifth of their rows dead.
        for part, factor in (("soon", "0.02"), ("far", "0.02"), ("hour00", "0.2"), ("hour25", "0.2")):
            options = conn.execute(text("SELECT reloptions FROM pg_class WHERE oid = to_regclass(:t)"),
                                   {"t": upgraded.qualified(f"{table}_{part}")}).scalar()
            assert f"autovacuum_vacuum_scale_factor={factor}" in options, part
    assert upgraded.backlog()["totals"]["scheduled"] == 0
