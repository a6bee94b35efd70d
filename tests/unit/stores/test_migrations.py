"""The migration files themselves: numbered without gaps, every placeholder known, and the templates
render for both databases without touching one."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from airflow_delay_provider.core.errors import InvalidNameError
from airflow_delay_provider.stores.migrations import STORE_SCHEMA, Migration, latest_version, migrations
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import QUEUE_SCHEMA, SqlTableTransport


@pytest.mark.parametrize("package", [STORE_SCHEMA, QUEUE_SCHEMA])
def test_files_are_numbered_from_one_without_gaps(package):
    names = sorted(e.name for e in resources.files(package).iterdir() if e.name.endswith(".sql"))
    assert names and [int(n[:4]) for n in names] == list(range(1, len(names) + 1))
    assert [m.version for m in migrations(package)] == list(range(1, latest_version(package) + 1))


@pytest.mark.parametrize("url", ["sqlite:///:memory:", "postgresql+psycopg://u:secret@127.0.0.1:1/x"])
def test_queue_table_statements_name_only_the_prefixed_tables_quoted(url):
    postgres = url.startswith("postgresql")
    queues = SqlTableTransport(url, schema="s1" if postgres else None, table_prefix="team_a_")
    for migration in migrations(QUEUE_SCHEMA):
        statements = migration.statements(dict(queues.migrations.target.names), postgres)
        assert statements
        for statement in statements:
            assert "{" not in statement and "--" not in statement
            targets = re.findall(r"\b(?:TABLE|ON|INDEX)(?: IF (?:NOT )?EXISTS)? (\S+)", statement)
            assert targets, statement
            for target in targets:
                assert target.startswith('"'), statement
                assert target.strip('"').split('"."')[-1].startswith(("team_a_", "ix_team_a_")), statement


def test_a_table_prefix_too_long_for_the_queue_tables_is_refused():
    SqlTableTransport("sqlite:///:memory:", table_prefix="p" * 49)  # 49 + len("queue_messages") == 63
    with pytest.raises(InvalidNameError, match="table prefix 'p{50}' is too long: at most 49 characters"):
        SqlTableTransport("sqlite:///:memory:", table_prefix="p" * 50)


@pytest.mark.parametrize("url", ["sqlite:///:memory:", "postgresql+psycopg://u:secret@127.0.0.1:1/x"])
def test_every_statement_renders_with_quoted_names_only(url):
    store = SqlDelayedMessageStore(url, table="orders", schema="s1" if url.startswith("postgresql") else None)
    names = store._template_names()
    for migration in migrations():
        statements = migration.statements(names, store.is_postgres)
        # Autovacuum's table options, the triggered counts and the partitions are PostgreSQL's: SQLite records the
        # version.
        postgres_only = ("queue_upkeep", "backlog_counts", "count_slots", "later_by_hour", "hours_left_to_the_store",
                         "held_messages")
        assert statements or (migration.name in postgres_only and not store.is_postgres), migration.name
        for statement in statements:
            assert "{" not in statement and "--" not in statement and "/*" not in statement
            # Every table a statement names is this store's, quoted.
            named = r"\b(?:TABLE(?: IF NOT EXISTS)?|ON(?: ONLY)?) (?!AS\b|CONFLICT\b)(\S+)"  # not ON CONFLICT
            for target in re.findall(named, statement):
                if target == "'":  # a name a PL/pgSQL loop builds: from this store's name, quoted there
                    assert "quote_ident('orders' || " in statement, statement
                    continue
                assert target.strip('"').split('"."')[-1].startswith("orders"), statement
    assert names["id_type"] == ("BIGSERIAL" if store.is_postgres else "INTEGER")


def test_a_template_with_an_unknown_placeholder_fails_loudly():
    with pytest.raises(KeyError, match="nope"):
        Migration(9, "bad", "CREATE TABLE {nope} (x INTEGER);").statements({"messages": '"t"'}, True)


def test_postgresql_only_statements_are_left_out_on_sqlite():
    migration = Migration(9, "mixed", 'CREATE TABLE {messages} (x INTEGER);\n/* postgresql */ ALTER TABLE {messages} '
                                      "SET (fillfactor = 90);")
    assert migration.statements({"messages": '"t"'}, False) == ['CREATE TABLE "t" (x INTEGER)']
    assert migration.statements({"messages": '"t"'}, True) == ['CREATE TABLE "t" (x INTEGER)',
                                                               'ALTER TABLE "t" SET (fillfactor = 90)']


def test_sqlite_only_statements_are_left_out_on_postgresql():
    migration = Migration(9, "mixed", '/* sqlite */ CREATE TABLE {messages} (x INTEGER);\n/* postgresql */ CREATE '
                                      "TABLE {messages} (x INTEGER) PARTITION BY RANGE (x);")
    assert migration.statements({"messages": '"t"'}, False) == ['CREATE TABLE "t" (x INTEGER)']
    assert migration.statements({"messages": '"t"'}, True) == ['CREATE TABLE "t" (x INTEGER) PARTITION BY RANGE (x)']
