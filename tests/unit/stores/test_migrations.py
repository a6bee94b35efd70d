"""The migration files themselves: numbered without gaps, every placeholder known, and the templates
render for both databases without touching one."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from airflow_delay_provider.stores.migrations import Migration, latest_version, migrations
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore


def test_files_are_numbered_from_one_without_gaps():
    names = sorted(e.name for e in resources.files("airflow_delay_provider.stores.schema").iterdir()
                   if e.name.endswith(".sql"))
    assert [int(n[:4]) for n in names] == list(range(1, len(names) + 1))
    assert [m.version for m in migrations()] == list(range(1, latest_version() + 1))


@pytest.mark.parametrize("url", ["sqlite:///:memory:", "postgresql+psycopg://u:secret@127.0.0.1:1/x"])
def test_every_statement_renders_with_quoted_names_only(url):
    store = SqlDelayedMessageStore(url, table="orders", schema="s1" if url.startswith("postgresql") else None)
    names = store._template_names()
    for migration in migrations():
        statements = migration.statements(names, store.is_postgres)
        # Autovacuum's table options and the triggered counts are PostgreSQL's: SQLite records the version.
        postgres_only = ("queue_upkeep", "backlog_counts", "count_slots")
        assert statements or (migration.name in postgres_only and not store.is_postgres), migration.name
        for statement in statements:
            assert "{" not in statement and "--" not in statement and "/*" not in statement
            # Every table a statement names is this store's, quoted.
            for target in re.findall(r"\b(?:TABLE(?: IF NOT EXISTS)?|ON) (?!AS\b)(\S+)", statement):
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
