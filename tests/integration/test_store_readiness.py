"""The store's tables change only on purpose: reads (the command line's backlog, browse and dead-letters) never
create or migrate anything, a connection of another type is refused before anything is opened, `airflow
delayed-messages db upgrade` creates and upgrades (`--dry-run`: only says what it would apply), and writers
create or upgrade only where the connection's `auto_migrate` allows it. On the real PostgreSQL and SQLite."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from airflow_delay_provider.core.errors import StoreNotReadyError
from airflow_delay_provider.stores.migrations import latest_version, migrations
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from tests.conftest import PG_URL
from tests.databases import admin_conninfo, drop_later
from tests.integration.test_bad_input import TI

PASSWORD = "s3cr3t-pw"  # trust authentication ignores it; it must show nowhere


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "airflow"), "delayed-messages", *args],
                          capture_output=True, text=True, env={**os.environ}, timeout=120)


def _define(monkeypatch, conn: dict) -> str:
    conn_id = f"ready_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    return conn_id


def _pg_fields(database: str | None = None) -> dict:
    url = make_url(PG_URL)
    return {"host": url.host, "port": url.port or 5432, "login": url.username, "password": PASSWORD,
            "schema": database or url.database}


def _pg_objects(schema: str, database_url: str = PG_URL) -> tuple[bool, list[str]]:
    """Whether the schema exists, and its tables."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            exists = conn.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": schema}).scalar()
            tables = conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = :s ORDER BY 1"),
                                  {"s": schema}).scalars().all()
    finally:
        engine.dispose()
    return bool(exists), list(tables)


@pytest.fixture
def unused_schema(pg_schema):
    """A schema name nobody created (a typo): dropped afterwards in case anything made it."""
    name = f"{pg_schema}_typo"
    yield name
    engine = create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
    engine.dispose()


@pytest.fixture
def empty_database():
    """A database of this test's own on the real PostgreSQL, with nothing in its public schema; dropped after."""
    name = f"adp_ready_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield name, make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    from airflow_delay_provider.stores import engine as engines

    for key in [k for k in engines._engines if k.endswith(f"/{name}")]:  # a store of the old code may hold one
        engines._engines.pop(key).dispose()
    admin.dispose()
    drop_later(admin_conninfo(PG_URL), name)


def _no_secret_nor_sql(text_: str) -> None:
    assert PASSWORD not in text_, text_
    assert "[SQL" not in text_ and "SELECT" not in text_ and "Traceback" not in text_, text_


# -- reads -----------------------------------------------------------------------------------------------------
def test_reads_of_a_store_that_is_not_there_fail_naming_it_and_create_nothing(airflow_home, monkeypatch,
                                                                              unused_schema):
    conn_id = _define(monkeypatch, {"conn_type": "delay_store", **_pg_fields(), "extra": {"db_schema": "delays"}})
    for command in (("backlog",), ("browse", "--limit", "5"), ("dead-letters", "--transport", "sql")):
        result = _cli(*command, "--conn-id", conn_id, "--db-schema", unused_schema)
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert result.stdout == "", result.stdout  # no report: an empty backlog would look like nothing scheduled
        _no_secret_nor_sql(result.stderr)
        assert _pg_objects(unused_schema) == (False, []), command
        if command[0] != "dead-letters":  # the error queue's own message: never provisioned
            message = result.stderr
            assert f"connection {conn_id!r}" in message and f"schema {unused_schema!r}" in message, message
            assert "table 'delayed_messages'" in message and "postgresql+psycopg://postgres:***@" in message, message
            assert "has no tables yet: run the provisioning DAG or `airflow delayed-messages db upgrade " \
                   f"--conn-id {conn_id} --db-schema {unused_schema}`" in message, message


def test_reads_of_a_sqlite_store_that_is_not_there_create_not_even_its_file(monkeypatch, tmp_path, airflow_home):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.sensors.delay_store import DelayBacklogSensor, DelayedMessagesSensor

    path = tmp_path / "tpyo.db"  # SQLite's writers may create it (auto_migrate is on by default): reads may not
    conn_id = _define(monkeypatch, {"conn_type": "delay_store", "schema": str(path), "extra": {"driver": "sqlite"}})
    reads = [DelayStoreHook(conn_id).backlog, lambda: DelayStoreHook(conn_id).browse(limit=5),
             lambda: DelayedMessagesSensor(task_id="s", delay_store_conn_id=conn_id).poke({}),
             lambda: DelayBacklogSensor(task_id="b", delay_store_conn_id=conn_id, threshold=1).poke({})]
    said = (f"the delay store of connection {conn_id!r} (database sqlite:///{path}, table 'delayed_messages') has "
            f"no tables yet: run the provisioning DAG or `airflow delayed-messages db upgrade --conn-id {conn_id}`")
    for read in reads:
        with pytest.raises(StoreNotReadyError) as info:
            read()
        assert said in str(info.value), info.value
        assert not path.exists()

    async def deferred_sensor():  # the deferrable DelayedMessagesSensor's trigger
        from airflow_delay_provider.triggers.delay_store import ScheduledMessagesTrigger

        async for event in ScheduledMessagesTrigger(delay_store_conn_id=conn_id).run():
            return event.payload

    event = asyncio.run(deferred_sensor())
    assert event["status"] == "error" and said in event["message"], event
    assert not path.exists()


@pytest.fixture
def listener():
    """A TCP port on loopback that counts the connections made to it (and closes them)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(1)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join(5)
    server.close()


@pytest.mark.parametrize("kind", ["postgres", "rabbitmq"])
def test_a_connection_of_another_type_is_refused_at_once_naming_the_expected_type(airflow_home, monkeypatch,
                                                                                 empty_database, listener, kind):
    name, url = empty_database
    port, accepted = listener
    if kind == "postgres":  # a connection to a database (Airflow's metadata database, say) that is no store
        conn = {"conn_type": "postgres", **_pg_fields(name)}
    else:  # the broker's connection, given where the store's was meant (it took 42 s to fail, in TLS)
        conn = {"conn_type": "rabbitmq", "host": "127.0.0.1", "port": port, "login": "guest", "password": PASSWORD}
    conn_id = _define(monkeypatch, conn)
    result = _cli("backlog", "--conn-id", conn_id)
    assert result.returncode == 1, result.stdout
    assert f"connection {conn_id!r} is of type {kind!r}" in result.stderr, result.stderr
    assert "the delay store needs a connection of type 'delay_store'" in result.stderr, result.stderr
    _no_secret_nor_sql(result.stderr)
    # Refused before anything is opened: nothing created in the database, no connection to the broker's port.
    assert _pg_objects("public", url) == (True, [])
    assert accepted == [], "the command connected to the broker's port before refusing the connection's type"


# -- db upgrade ------------------------------------------------------------------------------------------------
def test_db_upgrade_says_what_it_applies_and_a_dry_run_applies_nothing(airflow_home, monkeypatch, unused_schema):
    table = f"u_{uuid.uuid4().hex[:8]}"
    conn_id = _define(monkeypatch, {"conn_type": "delay_store", **_pg_fields(),
                                    "extra": {"db_schema": unused_schema, "table": table}})
    latest = latest_version()
    versions = [f"{m.version} {m.name}" for m in migrations()]

    dry = _cli("db", "upgrade", "--conn-id", conn_id, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    _no_secret_nor_sql(dry.stdout + dry.stderr)
    assert "DB: postgresql+psycopg://postgres:***@" in dry.stdout, dry.stdout
    assert f"table {table!r}" in dry.stdout and f"schema {unused_schema!r}" in dry.stdout, dry.stdout
    assert f"schema version 0 (no tables yet); this release's is {latest}" in dry.stdout, dry.stdout
    for line in versions:
        assert line in dry.stdout, (line, dry.stdout)
    assert "Dry run: nothing was applied" in dry.stdout, dry.stdout
    assert _pg_objects(unused_schema) == (False, [])

    applied = _cli("db", "upgrade", "--conn-id", conn_id)
    assert applied.returncode == 0, applied.stderr
    assert all(line in applied.stdout for line in versions), applied.stdout
    assert f"now at schema version {latest}" in applied.stdout, applied.stdout
    store = SqlDelayedMessageStore(PG_URL, table=table, schema=unused_schema)
    assert store.schema_version() == latest

    again = _cli("db", "upgrade", "--conn-id", conn_id, "--dry-run")
    assert again.returncode == 0, again.stderr
    assert f"schema version {latest}, this release's is {latest}: up to date" in again.stdout, again.stdout
    backlog = _cli("backlog", "--conn-id", conn_id)
    assert backlog.returncode == 0, backlog.stderr
    assert json.loads(backlog.stdout)["destinations"] == {}


def test_db_upgrade_brings_an_older_store_up_to_date_and_reads_work_on_it_meanwhile(airflow_home, monkeypatch, pg):
    url, schema, table = pg
    conn_id = _define(monkeypatch, {"conn_type": "delay_store", **_pg_fields(),
                                    "extra": {"db_schema": schema, "table": table}})
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.migrate(up_to=7)
    backlog = _cli("backlog", "--conn-id", conn_id)  # version 7 has every table a backlog report reads
    assert backlog.returncode == 0, backlog.stderr
    assert store.schema_version() == 7
    dry = _cli("db", "upgrade", "--conn-id", conn_id, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    pending = [f"{m.version} {m.name}" for m in migrations()[7:]]
    assert all(line in dry.stdout for line in pending), dry.stdout
    assert "7 count_slots" not in dry.stdout, dry.stdout
    assert store.schema_version() == 7
    assert _cli("db", "upgrade", "--conn-id", conn_id).returncode == 0
    assert store.schema_version() == latest_version()


# -- writers ---------------------------------------------------------------------------------------------------
def _store_conn(monkeypatch, db: tuple, auto_migrate) -> tuple[str, SqlDelayedMessageStore]:
    url, schema, table = db
    extra = {"table": table, **({"db_schema": schema} if schema else {})}
    if auto_migrate is not None:
        extra["auto_migrate"] = auto_migrate
    if url.startswith("sqlite"):
        conn = {"conn_type": "delay_store", "schema": make_url(url).database, "extra": {"driver": "sqlite", **extra}}
    else:
        conn = {"conn_type": "delay_store", **_pg_fields(), "extra": extra}
    return _define(monkeypatch, conn), SqlDelayedMessageStore(url, table=table, schema=schema)


def _tables(store: SqlDelayedMessageStore) -> list[str]:
    from sqlalchemy import inspect

    with store.engine.connect() as conn:
        return [t for t in inspect(conn).get_table_names(schema=store.schema) if t.startswith(store.table_name)]


def _send(conn_id: str) -> str:
    from airflow_delay_provider.operators.send import SendDelayedMessageOperator

    return SendDelayedMessageOperator(task_id="t", delay_store_conn_id=conn_id, destination="orders", body="b",
                                      delay_seconds=60, message_id=f"w-{uuid.uuid4().hex[:6]}").execute(TI)


# None: the connection says nothing, so the database's default applies (SQLite: true, PostgreSQL: false).
@pytest.mark.parametrize("auto_migrate", [None, True, False, "false"])
def test_a_send_creates_the_store_only_where_the_connection_allows_it(db, monkeypatch, auto_migrate, airflow_home):
    conn_id, store = _store_conn(monkeypatch, db, auto_migrate)
    allowed = auto_migrate is True or (auto_migrate is None and store.url.get_backend_name() == "sqlite")
    if allowed:
        message_id = _send(conn_id)
        assert store.get(message_id) is not None and store.schema_version() == latest_version()
        return
    with pytest.raises(StoreNotReadyError) as info:
        _send(conn_id)
    message = str(info.value)
    assert f"connection {conn_id!r}" in message and f"table {store.table_name!r}" in message, message
    assert "has no tables yet: run the provisioning DAG or `airflow delayed-messages db upgrade" in message, message
    _no_secret_nor_sql(message)
    assert _tables(store) == []


@pytest.mark.parametrize("auto_migrate", [None, True])
def test_a_send_to_an_older_store_upgrades_it_only_where_the_connection_allows_it(pg, monkeypatch, auto_migrate):
    conn_id, store = _store_conn(monkeypatch, pg, auto_migrate)
    store.migrate(up_to=5)
    if auto_migrate:
        assert store.get(_send(conn_id)) is not None
        assert store.schema_version() == latest_version()
        return
    with pytest.raises(StoreNotReadyError, match=rf"has schema version 5; this release needs version "
                                                 rf"{latest_version()}: run `airflow delayed-messages db upgrade"):
        _send(conn_id)
    assert store.schema_version() == 5 and store.count_scheduled() == {}


def test_provisioning_creates_the_store_whatever_auto_migrate_says(pg, monkeypatch):
    from airflow_delay_provider.operators.provision import ProvisionDelayInfrastructureOperator

    conn_id, store = _store_conn(monkeypatch, pg, False)
    ProvisionDelayInfrastructureOperator(task_id="p", delay_store_conn_id=conn_id, endpoints=["orders"]).execute({})
    assert store.schema_version() == latest_version()
    assert store.get(_send(conn_id)) is not None


def test_a_bad_auto_migrate_extra_says_what_is_allowed(monkeypatch, tmp_path):
    from airflow_delay_provider.core.errors import InvalidInputError
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    conn_id, _ = _store_conn(monkeypatch, (f"sqlite:///{tmp_path / 's.db'}", None, "t"), "sometimes")
    with pytest.raises(InvalidInputError, match=rf"the auto_migrate extra of connection {conn_id!r} must be true or "
                                                r"false, got 'sometimes'"):
        DelayStoreHook(conn_id).get_store()
    assert not (tmp_path / "s.db").exists()
