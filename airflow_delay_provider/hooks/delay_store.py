"""DelayStoreHook: the SQL delayed-message store (and its SQL-table transport) behind an Airflow connection."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from airflow.sdk import BaseHook
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from airflow_delay_provider.core.delays import DelayLimits
from airflow_delay_provider.core.errors import ConnectionTypeError, InvalidInputError
from airflow_delay_provider.core.history import DEFAULT_HISTORY_DAYS, check_history_days
from airflow_delay_provider.hooks.backlog import BacklogActions
from airflow_delay_provider.stores.engine import ConnectionSource, check_identifier, safe_url
from airflow_delay_provider.stores.migrations import SchemaMigrations
from airflow_delay_provider.stores.sql import (
    DEFAULT_DEDUP_WINDOW_SECONDS,
    DEFAULT_TABLE,
    SqlDelayedMessageStore,
    check_store_table,
)
from airflow_delay_provider.transports.sql import SqlTableTransport

#: Every operator, sensor and trigger uses this connection unless told otherwise, so the scheduler's,
#: the triggerer's and the workers' processes (separate containers or pods) reach one store.
DEFAULT_CONN_ID = "delay_store_default"

def how_to_define(conn_id: str) -> str:
    """How to define the connection `conn_id` (the environment variable Airflow reads for that id)."""
    var = "AIRFLOW_CONN_" + conn_id.upper()
    return (
        "define it in the deployment (the same for every Airflow component), for example "
        f"""{var}='{{"conn_type": "delay_store", "host": "db", "port": 5432, """
        """"login": "airflow", "password": "...", "schema": "airflow", "extra": {"db_schema": "delays"}}', """
        "or, for a single machine, a SQLite file every component can open: "
        f"""{var}='{{"conn_type": "delay_store", "schema": "/abs/path/delay_store.db", """
        """"extra": {"driver": "sqlite"}}'"""
    )


#: What a `delay_store` connection's `driver` (or `url`) may name: the store runs on these two databases.
SUPPORTED_DRIVERS = "postgresql+psycopg (or another installed postgresql+<driver>) or sqlite"


def _supported(url: URL, conn: Any, field: str) -> URL:
    """The URL, if it names a database the store runs on and a driver that is installed."""
    problem = None
    if url.get_backend_name() not in ("postgresql", "sqlite"):
        problem = "is not supported"
    else:
        try:
            url.get_dialect()
        except NoSuchModuleError:
            problem = "is not installed"
    if problem:
        raise InvalidInputError(f"the {field} extra of connection {conn.conn_id!r} names the driver "
                                f"{url.drivername!r}, which {problem}; allowed: {SUPPORTED_DRIVERS}")
    return url


def _flag(extra: dict, name: str, conn: Any, default: bool) -> bool:
    """A true/false extra (URI extras arrive as strings)."""
    value = extra.get(name)
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise InvalidInputError(f"the {name} extra of connection {conn.conn_id!r} must be true or false, got {value!r}")


def url_from_connection(conn: Any) -> URL:
    """An SQLAlchemy URL from a `delay_store` connection: extra `url`, or host/port/login/password/schema."""
    extra = conn.extra_dejson or {}
    if extra.get("url"):
        try:
            url = make_url(extra["url"])
        except (ArgumentError, TypeError, ValueError):  # not repeated: the text may hold a password
            raise InvalidInputError(
                f"the url extra of connection {conn.conn_id!r} is not an SQLAlchemy URL; allowed: "
                f"{SUPPORTED_DRIVERS} URLs such as postgresql+psycopg://user@host:5432/db"
            ) from None
        if conn.password:
            url = url.set(password=conn.password)
        return _supported(url, conn, "url")
    driver = extra.get("driver") or "postgresql+psycopg"
    if not isinstance(driver, str):
        raise InvalidInputError(f"the driver extra of connection {conn.conn_id!r} must be a string; allowed: "
                                f"{SUPPORTED_DRIVERS}, got {driver!r}")
    if driver.startswith("sqlite"):
        path = conn.schema or conn.host or ""
        # A relative path would name a different file in each process's working directory.
        if not path.startswith("/"):
            raise InvalidInputError(
                f"the SQLite delay store of connection {conn.conn_id!r} needs an absolute file path in Database "
                f"(schema), got {path!r}"
            )
        return _supported(make_url(f"{driver}:///{path}"), conn, "driver")
    return _supported(URL.create(
        driver,
        username=conn.login or None,
        password=conn.password or None,
        host=conn.host or None,
        port=int(conn.port) if conn.port else None,
        database=conn.schema or None,
    ), conn, "driver")


class DelayStoreHook(BacklogActions, BaseHook):
    """Opens the delayed-message store named by a `delay_store` connection (default `delay_store_default`).

    Connection extras: `driver` (default postgresql+psycopg; `sqlite` with an absolute file path as
    Database), `url` (a full SQLAlchemy URL instead of the fields), `table` (default delayed_messages),
    `db_schema` (PostgreSQL schema for the tables), `dedup_window_seconds` (default 86400: how long a
    message id, once stored or sent, is not accepted again; 0 turns that off), `max_delay_seconds` (the
    longest delay a send or reschedule may ask for: default 604800, 7 days; at most 315576000, ten years) and
    `max_delay_seconds_per_destination` (an object of destination names to their own longest delay),
    `auto_migrate` (whether writers, sends and dispatchers, may create the store's tables and bring them up to
    date; default true on SQLite, false on PostgreSQL, where provisioning or `airflow delayed-messages db
    upgrade` does it), `history_days` (days of delivery history kept: default 7, at most 90; 0 keeps none).

    Reads never create or change the tables: a store that is not there is a StoreNotReadyError that says what
    to run. A connection of another type than `delay_store` is refused before anything is opened.

    :param delay_store_conn_id: the `delay_store` connection; a missing one fails saying how to define it.
    :param table: the store's table, overriding the connection's `table` extra.
    :param db_schema: the PostgreSQL schema, overriding the connection's `db_schema` extra.
    """

    conn_name_attr = "delay_store_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = "delay_store"
    hook_name = "Delay Store (SQL)"

    def __init__(
        self,
        delay_store_conn_id: str = DEFAULT_CONN_ID,
        table: str | None = None,
        db_schema: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not delay_store_conn_id:
            raise InvalidInputError(
                f"delay_store_conn_id must name a `delay_store` connection, e.g. {DEFAULT_CONN_ID!r}")
        self.delay_store_conn_id = delay_store_conn_id
        self._table = table
        self._db_schema = db_schema
        self._resolved: tuple[URL, str, str | None] | None = None
        self._dedup_window = DEFAULT_DEDUP_WINDOW_SECONDS
        self._history_days = DEFAULT_HISTORY_DAYS
        self._limits = DelayLimits()
        self._auto_migrate = False
        # What `airflow delayed-messages db upgrade` needs to name the same tables, for errors that say to run it.
        options = [] if delay_store_conn_id == DEFAULT_CONN_ID else ["--conn-id", delay_store_conn_id]
        options += [*(["--table", table] if table else []), *(["--db-schema", db_schema] if db_schema else [])]
        self._source = ConnectionSource(delay_store_conn_id, tuple(options))

    def _locate(self, conn: Any) -> tuple[URL, str, str | None]:
        if conn.conn_type != self.conn_type:
            # Before anything is opened: another type's fields would name another database (a `postgres`
            # connection's, Airflow's own), or a broker a PostgreSQL driver would talk to in vain.
            raise ConnectionTypeError(
                f"connection {conn.conn_id!r} is of type {conn.conn_type!r}; the delay store needs a connection of "
                f"type {self.conn_type!r}, and nothing was opened: {how_to_define(conn.conn_id)}")
        extra = conn.extra_dejson or {}
        window = extra.get("dedup_window_seconds", DEFAULT_DEDUP_WINDOW_SECONDS)
        try:
            self._dedup_window = float(window)
        except (TypeError, ValueError):
            raise InvalidInputError(f"the dedup_window_seconds extra of connection {conn.conn_id!r} must be a number "
                                    f"of seconds >= 0, got {window!r}") from None
        days = extra.get("history_days")
        self._history_days = DEFAULT_HISTORY_DAYS if days in (None, "") else check_history_days(
            days, where=f"connection {conn.conn_id!r}: the ")
        self._limits = DelayLimits.parse(extra.get("max_delay_seconds"), extra.get("max_delay_seconds_per_destination"),
                                         where=f"connection {conn.conn_id!r}: ")
        url = url_from_connection(conn)
        self._auto_migrate = _flag(extra, "auto_migrate", conn, default=url.get_backend_name() == "sqlite")
        return resolve_location(url, extra, self._table, self._db_schema)

    def _missing(self, exc: Exception) -> InvalidInputError:
        return InvalidInputError(f"the delay store connection {self.delay_store_conn_id!r} is not defined "
                                 f"({type(exc).__name__}); {how_to_define(self.delay_store_conn_id)}")

    def _resolve(self) -> tuple[URL, str, str | None]:
        if self._resolved is None:
            from airflow.sdk.exceptions import AirflowNotFoundException

            try:
                conn = self.get_connection(self.delay_store_conn_id)
            except AirflowNotFoundException as exc:
                raise self._missing(exc) from None
            self._resolved = self._locate(conn)
        return self._resolved

    async def aget_store(self) -> SqlDelayedMessageStore:
        """The store, resolving the connection the async way (for triggers)."""
        if self._resolved is None:
            from airflow.sdk.exceptions import AirflowNotFoundException

            try:
                conn = await self.aget_connection(self.delay_store_conn_id)
            except AirflowNotFoundException as exc:
                raise self._missing(exc) from None
            self._resolved = self._locate(conn)
        return self.get_store()

    @property
    def url(self) -> URL:
        """The store database's SQLAlchemy URL (holds the password; render it with safe_url)."""
        return self._resolve()[0]

    def get_store(self) -> SqlDelayedMessageStore:
        """The store: keeps, claims and removes delayed messages. Nothing is read or created yet: see
        `checked_store` (reads) and `prepare_for_writes`."""
        url, table, schema = self._resolve()
        store = SqlDelayedMessageStore(url, table=table, schema=schema, dedup_window_seconds=self._dedup_window,
                                       history_days=self._history_days)
        store.source = self._source
        return store

    @property
    def delay_limits(self) -> DelayLimits:
        """The longest delay of each destination: the `max_delay_seconds` extra (default 604,800 s, 7 days; at most
        ten years) and `max_delay_seconds_per_destination` (an object of destination names to seconds)."""
        self._resolve()
        return self._limits

    @property
    def auto_migrate(self) -> bool:
        """Whether writers may create the store's tables and bring them up to date (the `auto_migrate` extra)."""
        self._resolve()
        return self._auto_migrate

    def prepare_for_writes(self, store: SqlDelayedMessageStore) -> None:
        """Make the store ready for a writer (a send): with `auto_migrate`, create or upgrade its tables; without,
        StoreNotReadyError unless they are at this release's version."""
        if self.auto_migrate:
            store.create_schema()
        else:
            store.check_ready(current=True)

    def upgrade(self, dry_run: bool = False) -> list[dict[str, Any]]:
        """Create the store's tables or bring them up to date, and the SQL-table queues' tables in its database
        where they exist (provisioning queues creates them): `airflow delayed-messages db upgrade`. Per set of
        tables: `what` (which tables, where), `version` (recorded before), `latest` (this release's), `exists`,
        `pending` ([(version, name)] to apply) and `applied` (none with `dry_run`)."""
        store = self.get_store()
        report = [self._upgrade(store.migrations, dry_run, create=True)]
        report.append(self._upgrade(self.get_transport().migrations, dry_run, create=False))
        return report

    @staticmethod
    def _upgrade(migrations: SchemaMigrations, dry_run: bool, create: bool) -> dict[str, Any]:
        state = migrations.state()
        noun = migrations.target.noun[0]
        pending = migrations.pending() if state.exists or create else []
        applied = [] if dry_run or not pending else migrations.migrate()
        return {"what": f"{noun[0].upper()}{noun[1:]} {migrations.where()}", "version": state.version,
                "latest": state.latest, "exists": state.exists, "applied": applied,
                "pending": [(m.version, m.name) for m in pending]}

    @classmethod
    def for_transport(cls, conn_id: str, db_schema: str | None = None) -> DelayStoreHook:
        """The hook of a `transport="sql"` connection other than the store's (see the transport registry)."""
        return cls(conn_id, db_schema=db_schema)

    def get_transport(self) -> SqlTableTransport:
        """Queues as tables in the same database: dispatch from this store to them is exactly once."""
        url, _, schema = self._resolve()
        transport = SqlTableTransport(url, schema=schema)
        transport.source = self._source
        return transport

    def store_spec(self) -> dict:
        """Where the store is, as plain data for a process without Airflow (a Spark sweep); holds the password."""
        url, table, schema = self._resolve()
        return {"url": url.render_as_string(hide_password=False), "table": table, "schema": schema,
                "auto_migrate": self._auto_migrate, "dedup_window_seconds": self._dedup_window,
                "history_days": self._history_days}

    def transport_spec(self) -> dict:
        """The SQL-table transport of get_transport() as plain data; holds the password."""
        url, _, schema = self._resolve()
        return {"kind": "sql", "url": url.render_as_string(hide_password=False), "schema": schema}

    def get_conn(self) -> SqlDelayedMessageStore:
        """The store (Airflow's generic name for get_store)."""
        return self.get_store()

    def test_connection(self) -> tuple[bool, str]:
        """Reach the database and report how many messages are scheduled (the UI's Test button)."""
        try:
            store = self.get_store()
            scheduled = sum(store.count_scheduled().values()) if store.exists() else None
        except Exception as exc:  # shown in the UI; the store's errors never carry the password
            return False, f"{type(exc).__name__}: {exc}"
        where = safe_url(store.url)
        if scheduled is None:
            return True, (f"Reached {where}; table {store.table_name} not created yet (provisioning or "
                          "`airflow delayed-messages db upgrade` creates it)")
        return True, f"Reached {where}; {scheduled} message(s) scheduled in {store.table_name}"


def resolve_location(url: URL, extra: dict, table: str | None, db_schema: str | None) -> tuple[URL, str, str | None]:
    table = check_store_table(table or extra.get("table") or DEFAULT_TABLE)
    schema = db_schema or extra.get("db_schema") or None
    if schema is not None:
        check_identifier("schema name", schema)
        if url.get_backend_name() != "postgresql":
            raise InvalidInputError(f"db_schema is only supported on PostgreSQL, not {url.get_backend_name()}")
    return url, table, schema


class DelayStoreMixin:
    """The store arguments every operator and sensor takes, and the store's hook, built once per task.

    :param delay_store_conn_id: the `delay_store` connection of the store (default `delay_store_default`).
    :param table: the store's table (default: the connection's, else `delayed_messages`).
    :param db_schema: the store's PostgreSQL schema (default: the connection's).
    """

    def __init__(self, *, delay_store_conn_id: str = DEFAULT_CONN_ID, table: str | None = None,
                 db_schema: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay_store_conn_id = delay_store_conn_id
        self.table = table
        self.db_schema = db_schema

    @cached_property
    def hook(self) -> DelayStoreHook:
        return DelayStoreHook(self.delay_store_conn_id, table=self.table, db_schema=self.db_schema)
