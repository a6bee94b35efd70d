"""Versioned migrations of the store's tables.

Each change to the store's tables is a numbered SQL file in `schema/` (`0001_messages.sql`, ...),
applied in order and recorded in `<table>_schema`, so a store created by any earlier release is brought
up to date by `create_schema()` and the record says what was applied and when. Only explicit steps run them
(provisioning, `airflow delayed-messages db upgrade`, and writers whose connection allows it): everything else
checks where the tables stand (`state`, `require`) and says what to run when they are not there. The SQL-table queues'
tables are versioned the same way (files in `transports/queue_schema/`, record `<prefix>queue_versions`).
The files are templates: the runner fills in the (checked, quoted) table names and the two types SQLite
and PostgreSQL spell differently; a statement that starts with `/* postgresql */` runs on PostgreSQL only, one
that starts with `/* sqlite */` on SQLite only.
A store made before versioning existed has tables but no record: it is adopted by looking at its columns,
then migrated from there.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cache
from importlib import resources

from sqlalchemy import Table, func, insert, inspect, select
from sqlalchemy.engine import Connection

from airflow_delay_provider.core.errors import DelayProviderError, InvalidInputError, StoreNotReadyError
from airflow_delay_provider.stores.engine import Database, safe_url, translate_errors
from airflow_delay_provider.stores.tables import DEFAULT_TABLE, to_us

log = logging.getLogger(__name__)

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_POSTGRES_ONLY = "/* postgresql */"
_SQLITE_ONLY = "/* sqlite */"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    template: str

    def statements(self, names: dict[str, str], postgres: bool) -> list[str]:
        """The statements with the names filled in; those marked `/* postgresql */` only on PostgreSQL."""
        lines = [line for line in self.template.splitlines() if not line.lstrip().startswith("--")]
        found = [s.strip() for s in _split("\n".join(lines).format(**names)) if s.strip()]
        skipped = _SQLITE_ONLY if postgres else _POSTGRES_ONLY
        return [s.removeprefix(_POSTGRES_ONLY).removeprefix(_SQLITE_ONLY).strip() for s in found
                if not s.startswith(skipped)]


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


#: The store's migrations.
STORE_SCHEMA = "airflow_delay_provider.stores.schema"


@cache
def migrations(package: str = STORE_SCHEMA) -> tuple[Migration, ...]:
    """Every migration of one set of tables shipped with the package, by version (1, 2, ... with no gaps)."""
    found = []
    for entry in resources.files(package).iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations in {package} must be numbered 1..n without gaps: {[m.version for m in found]}")
    return tuple(found)


def latest_version(package: str = STORE_SCHEMA) -> int:
    return migrations(package)[-1].version


#: The command that creates and upgrades a store's tables (cli/definition.py).
UPGRADE_COMMAND = "airflow delayed-messages db upgrade"


@dataclass(frozen=True)
class SchemaState:
    """Where one set of versioned tables stands against this release."""

    version: int  # the newest migration recorded (0: none)
    latest: int  # this release's newest
    exists: bool  # its first table is there (a set made before versions were recorded has no record)

    @property
    def missing(self) -> bool:
        return not self.exists

    @property
    def current(self) -> bool:
        return self.version >= self.latest

    @property
    def older(self) -> bool:
        return self.exists and not self.current


@dataclass(frozen=True)
class VersionedTables:
    """One set of tables that versioned migrations create and upgrade: a store's, or the SQL-table queues'.

    :param package: where its numbered SQL files are.
    :param kind: what its tables are ("delay store").
    :param label: how logs name it ("Delay store public.delayed_messages").
    :param versions: its table of applied migrations.
    :param tables: the tables its migrations create, as the code declares them: a table of one of these names
        that lacks their columns (another application's) is refused before anything changes.
    :param names: the identifiers and types its SQL templates name.
    :param optional_columns: columns a set made before versioning may lack (a migration adds them).
    :param adopt: for tables made before versioning (no record, the first table there): the version they are at.
    :param refuse_hint: what to do instead when a table is refused.
    :param before: work to do first, in the migration's transaction (stop anything holding the tables' locks).
    :param noun: how errors name the set, and whether that is plural. The defaults here are the store's.
    :param table_option: whether the upgrade command names the set's first table (`--table`), when its database
        was opened without a connection (the store's: yes; the queues' have no option of their own).
    :param creates: what creates the set when it is not there (`{command}`: the upgrade command).
    """

    package: str
    kind: str
    label: str
    versions: Table
    tables: tuple[Table, ...]
    names: Mapping[str, str]
    refuse_hint: str
    optional_columns: frozenset[str] = frozenset()
    adopt: Callable[[Connection], int] = lambda _conn: 0
    before: Callable[[Connection], object] | None = None
    noun: tuple[str, bool] = ("the delay store", False)
    table_option: bool = True
    creates: str = "run the provisioning DAG or `{command}`"


class SchemaMigrations:
    """`schema_version()` and `migrate()` of one set of versioned tables, on its database."""

    def __init__(self, db: Database, target: VersionedTables) -> None:
        self.db = db
        self.target = target
        self._seen: SchemaState | None = None  # the last state `require` found good enough: not read again
        self._refused = False  # `require` refused once: say so when the tables are there

    def schema_version(self) -> int:
        """The newest migration applied to these tables (0: none here yet)."""
        with self._errors("read the schema version"), self.db.engine.connect() as conn:
            return self._applied(conn)

    def _errors(self, action: str) -> AbstractContextManager[None]:
        # Without the store's own translation, which would ask this object again about a missing table.
        return translate_errors(self.db.url, f"{action} of {self.target.label}")

    def state(self) -> SchemaState:
        """Where the tables stand, changing nothing. A table of the set's name that is not one of its tables
        (another application's) is refused, as `migrate` would refuse it."""
        t = self.target
        database = self.db.url.database
        if not self.db.is_postgres and database and database != ":memory:" and not os.path.exists(database):
            return SchemaState(0, latest_version(t.package), False)  # connecting would create the SQLite file
        with self._errors("read the schema version"), self.db.engine.connect() as conn:
            version = self._applied(conn)
            exists = version > 0 or inspect(conn).has_table(t.tables[0].name, schema=self.db.schema)
            if exists and version == 0:
                self._check_existing_shape(conn)
        return SchemaState(version, latest_version(t.package), exists)

    def pending(self) -> list[Migration]:
        """The migrations `migrate()` would apply now (a set made before versions, from the version it is at),
        changing nothing."""
        t = self.target
        with self._errors("read the schema version"), self.db.engine.connect() as conn:
            applied = self._applied(conn)
            if applied == 0 and inspect(conn).has_table(t.tables[0].name, schema=self.db.schema):
                self._check_existing_shape(conn)
                applied = t.adopt(conn)
        return list(migrations(t.package)[applied:])

    def require(self, current: bool = True) -> SchemaState:
        """The state, when the tables are there (and, with `current`, at this release's version or newer);
        otherwise StoreNotReadyError, saying what to run. Once good enough it is not read again: the tables
        are only ever added to."""
        seen = self._seen
        if seen is not None and (seen.current or not current):
            return seen
        state = self.state()
        problem = self.problem_of(state, current)
        if problem is not None:
            self._refused = True
            raise problem
        if self._refused:
            log.info("%s: its tables are there now (schema version %d)", self.target.label, state.version)
            self._refused = False
        self._seen = state
        return state

    def problem(self) -> DelayProviderError | None:
        """Why a statement found a table or column missing, when the tables are not there or older than this
        release; None when they are current (or cannot be read: the statement's own error says more)."""
        try:
            return self.problem_of(self.state(), current=True)
        except DelayProviderError as exc:
            return exc if isinstance(exc, InvalidInputError) else None

    def problem_of(self, state: SchemaState, current: bool = True) -> StoreNotReadyError | None:
        """The error for tables in `state`, or None when they will do."""
        t = self.target
        noun, plural = t.noun
        where, command = self.where(), self.upgrade_command()
        if state.missing:
            return StoreNotReadyError(f"{noun} {where} {'have' if plural else 'has'} no tables yet: "
                                      f"{t.creates.format(command=command)}")
        if current and not state.current:
            at = f"schema version {state.version}" if state.version else "no schema version (it predates them)"
            return StoreNotReadyError(
                f"{noun} {where} {'have' if plural else 'has'} {at}; this release needs version {state.latest}: run "
                f"`{command}` once every machine runs this release (or let writers do it: the connection's "
                "auto_migrate extra)")
        return None

    def where(self) -> str:
        """Which tables, for messages: the connection, the database (never its password), the schema, the tables."""
        db = self.db
        parts = [f"database {safe_url(db.url)}"]
        if db.is_postgres:
            parts.append(f"schema {db.schema!r}" if db.schema else "the default schema")
        names = [tb.name for tb in self.target.tables[:2]]
        plural = self.target.noun[1]
        parts.append("tables " + " and ".join(map(repr, names)) if plural else f"table {names[0]!r}")
        owner = f"of connection {db.source.conn_id!r} " if db.source is not None else ""
        return f"{owner}({', '.join(parts)})"

    def upgrade_command(self) -> str:
        """The command that brings these tables up to date."""
        db = self.db
        first = self.target.tables[0].name
        if db.source is not None:
            options = db.source.options
        else:
            options = (*(("--table", first) if self.target.table_option and first != DEFAULT_TABLE else ()),
                       *(("--db-schema", db.schema) if db.schema else ()))
        return " ".join((UPGRADE_COMMAND, *options))

    def migrate(self, up_to: int | None = None) -> list[int]:
        """Apply the migrations these tables lack, in order, up to `up_to` (default: all); returns the
        versions applied. Safe to run concurrently (one transaction under an advisory lock on
        PostgreSQL, the database's write lock on SQLite): the others find the tables up to date."""
        t = self.target
        latest = latest_version(t.package)
        target = latest if up_to is None else up_to
        if isinstance(target, bool) or not isinstance(target, int) or not 1 <= target <= latest:
            raise InvalidInputError(f"up_to must be a schema version from 1 to {latest}, got {up_to!r}")
        if self.schema_version() >= target:  # the common case: one read, no lock
            return []
        with self._errors("migrate the tables"), self.db.engine.begin() as conn:
            self.db.lock_schema(conn)
            if self.db.is_postgres and t.before is not None:
                t.before(conn)
            applied = self._applied(conn)
            if applied == 0:
                self._check_existing_shape(conn)
                t.versions.create(conn, checkfirst=True)
                if inspect(conn).has_table(t.tables[0].name, schema=self.db.schema):
                    applied = self._adopt(conn)
            done = []
            for migration in migrations(t.package)[applied:target]:
                for statement in migration.statements(dict(t.names), self.db.is_postgres):
                    conn.exec_driver_sql(statement)
                conn.execute(insert(t.versions), {"version": migration.version, "name": migration.name,
                                                  "applied_at_us": to_us(self.db.clock())})
                done.append(migration.version)
        if done:
            log.info("%s migrated to schema version %d (applied %s)", t.label, target, done)
        return done

    def _applied(self, conn: Connection) -> int:
        versions = self.target.versions
        if not inspect(conn).has_table(versions.name, schema=self.db.schema):
            return 0
        version = int(conn.execute(select(func.max(versions.c.version))).scalar() or 0)
        latest = latest_version(self.target.package)
        if version > latest:
            # Migrations only add, so this release can still use the tables; it must not change them.
            log.warning("%s has schema version %d; this release knows up to %d: upgrade "
                        "airflow-delay-provider on every machine", self.target.label, version, latest)
        return version

    def _check_existing_shape(self, conn: Connection) -> None:
        inspector = inspect(conn)
        schema = self.db.schema
        for table in self.target.tables:
            if not inspector.has_table(table.name, schema=schema):
                continue
            found = {c["name"] for c in inspector.get_columns(table.name, schema=schema)}
            missing = sorted({c.name for c in table.columns} - found - self.target.optional_columns)
            if missing:
                where = f"{schema}.{table.name}" if schema else table.name
                raise InvalidInputError(
                    f"table {where} exists but is not a {self.target.kind} table (missing columns {missing}); "
                    f"nothing was changed: {self.target.refuse_hint}"
                )

    def _adopt(self, conn: Connection) -> int:
        """Tables made before versioning: record the migrations they already have."""
        have = self.target.adopt(conn)
        if have:
            now = to_us(self.db.clock())
            conn.execute(insert(self.target.versions), [
                {"version": m.version, "name": f"{m.name} (adopted)", "applied_at_us": now}
                for m in migrations(self.target.package)[:have]])
            log.info("%s predates schema versions: adopted at version %d", self.target.label, have)
        return have
