"""Versioned migrations of the store's tables.

Each change to the store's tables is a numbered SQL file in `schema/` (`0001_messages.sql`, ...),
applied in order and recorded in `<table>_schema`, so a store created by any earlier release is brought
up to date by `create_schema()` and the record says what was applied and when. The files are templates:
the runner fills in the (checked, quoted) table names and the two types SQLite and PostgreSQL spell
differently; a statement that starts with `/* postgresql */` runs on PostgreSQL only. A store made before
versioning existed has tables but no record: it is adopted by looking at its columns, then migrated from
there.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, func, insert, inspect, select

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.stores.tables import to_us

log = logging.getLogger(__name__)

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_POSTGRES_ONLY = "/* postgresql */"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    template: str

    def statements(self, names: dict[str, str], postgres: bool) -> list[str]:
        """The statements with the names filled in; those marked `/* postgresql */` only on PostgreSQL."""
        lines = [line for line in self.template.splitlines() if not line.lstrip().startswith("--")]
        found = [s.strip() for s in _split("\n".join(lines).format(**names)) if s.strip()]
        return [s.removeprefix(_POSTGRES_ONLY).strip() for s in found if postgres or not s.startswith(_POSTGRES_ONLY)]


def _split(script: str) -> list[str]:
    """Statements split at semicolons, except inside a $$-quoted function body."""
    statements, quoted = [""], False
    for i, part in enumerate(script.split("$$")):
        if i:
            statements[-1] += "$$"
            quoted = not quoted
        if quoted:
            statements[-1] += part
            continue
        first, *rest = part.split(";")
        statements[-1] += first
        statements.extend(rest)
    return statements


@cache
def migrations() -> tuple[Migration, ...]:
    """Every migration shipped with the package, by version (1, 2, ... with no gaps)."""
    found = []
    for entry in resources.files("airflow_delay_provider.stores.schema").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"store migrations must be numbered 1..n without gaps: {[m.version for m in found]}")
    return tuple(found)


def latest_version() -> int:
    return migrations()[-1].version


def versions_table(metadata: MetaData, store_table_name: str, schema: str | None) -> Table:
    """One row per applied migration."""
    return Table(
        f"{store_table_name}_schema",
        metadata,
        Column("version", Integer, primary_key=True, autoincrement=False),
        Column("name", String(100), nullable=False),
        Column("applied_at_us", BigInteger, nullable=False),
        schema=schema,
    )


class SchemaMigrations:
    """A mixin of SqlDelayedMessageStore: `schema_version()` and `migrate()`, on its engine and tables."""

    def schema_version(self) -> int:
        """The newest migration applied to this store (0: no store here yet)."""
        with self._errors("read the delay store's schema version"), self.engine.connect() as conn:
            return self._applied(conn)

    def migrate(self, up_to: int | None = None) -> list[int]:
        """Apply the migrations this store lacks, in order, up to `up_to` (default: all); returns the
        versions applied. Safe to run concurrently (one transaction under an advisory lock on
        PostgreSQL, the database's write lock on SQLite): the others find the store up to date."""
        target = latest_version() if up_to is None else up_to
        if not 1 <= target <= latest_version():
            raise InvalidInputError(f"up_to must be a schema version from 1 to {latest_version()}, got {up_to!r}")
        if self.schema_version() >= target:  # the common case: one read, no lock
            return []
        with self._errors("migrate the delay store"), self.engine.begin() as conn:
            self._lock_schema(conn)
            if self.is_postgres:
                self.stop_upkeep(conn)  # its VACUUM would hold the migration's table locks for minutes
            applied = self._applied(conn)
            if applied == 0:
                self._check_existing_shape(conn)
                if inspect(conn).has_table(self.table_name, schema=self.schema):
                    applied = self._adopt(conn)
                self.versions.create(conn, checkfirst=True)
            names = self._template_names()
            done = []
            for migration in migrations()[applied:target]:
                for statement in migration.statements(names, self.is_postgres):
                    conn.exec_driver_sql(statement)
                conn.execute(insert(self.versions), {"version": migration.version, "name": migration.name,
                                                     "applied_at_us": to_us(self.clock())})
                done.append(migration.version)
        if done:
            log.info("Delay store %s migrated to schema version %d (applied %s)", self._where(), target, done)
        return done

    def _applied(self, conn) -> int:
        if not inspect(conn).has_table(self.versions.name, schema=self.schema):
            return 0
        version = conn.execute(select(func.max(self.versions.c.version))).scalar() or 0
        if version > latest_version():
            # Migrations only add, so this release can still use the store; it must not change it.
            log.warning("Delay store %s has schema version %d; this release knows up to %d: upgrade "
                        "airflow-delay-provider on every machine", self._where(), version, latest_version())
        return version

    def _adopt(self, conn) -> int:
        """A store made before versioning: record the migrations its tables already have."""
        columns = {c["name"] for c in inspect(conn).get_columns(self.table_name, schema=self.schema)}
        # claim_id came with bulk sweeps (2); the later migrations only create tables, IF NOT EXISTS.
        have = 2 if "claim_id" in columns else 1
        self.versions.create(conn, checkfirst=True)
        now = to_us(self.clock())
        conn.execute(insert(self.versions), [{"version": m.version, "name": f"{m.name} (adopted)",
                                              "applied_at_us": now} for m in migrations()[:have]])
        log.info("Delay store %s predates schema versions: adopted at version %d", self._where(), have)
        return have

    def _template_names(self) -> dict[str, str]:
        preparer, q = self.engine.dialect.identifier_preparer, self._qualified
        t = self.table_name
        ids_index = "ix_ids_" + hashlib.sha1(f"{self.schema}.{t}_ids".encode()).hexdigest()[:16]
        return {
            "messages": q(t), "policies": q(f"{t}_policies"), "sweeps": q(f"{t}_sweeps"), "ids": q(f"{t}_ids"),
            "throttle": q(f"{t}_throttle"), "delays": q(f"{t}_delays"), "dests": q(f"{t}_dests"),
            "counts": q(f"{t}_counts"),
            "count_fn": q("delay_counts_" + hashlib.sha1(f"{self.schema}.{t}".encode()).hexdigest()[:16]),
            # Index names live in the table's schema on PostgreSQL and may not be qualified there.
            "ix_due": preparer.quote_identifier(f"ix_{t}_due"), "ix_ids": preparer.quote_identifier(ids_index),
            "ix_leased": preparer.quote_identifier(ids_index.replace("ix_ids_", "ix_leased_")),
            "id_type": "BIGSERIAL" if self.is_postgres else "INTEGER",  # SQLite's INTEGER key is the rowid
            "bytes_type": "BYTEA" if self.is_postgres else "BLOB",
        }

    def _where(self) -> str:
        return f"{self.schema}.{self.table_name}" if self.schema else self.table_name
