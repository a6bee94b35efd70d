"""SQLAlchemy engines shared by the SQL store and the SQL transport, and checks on SQL identifiers."""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sqlalchemy import Engine, Table, create_engine, event, func, inspect, select
from sqlalchemy.engine import URL, Connection, CursorResult, make_url
from sqlalchemy.exc import DBAPIError, OperationalError, PendingRollbackError
from sqlalchemy.schema import CreateSchema
from sqlalchemy.sql.base import Executable

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import DelayProviderError, InvalidInputError, InvalidNameError, UnavailableError

if TYPE_CHECKING:  # Python 3.10 has no typing.Unpack, nor the star in a subscript
    from typing import TypeAlias

    from typing_extensions import Unpack

    #: A statement's result of any columns.
    AnyResult: TypeAlias = CursorResult[Unpack[tuple[Any, ...]]]

log = logging.getLogger(__name__)

#: How often the offset between the database's clock and this host's is measured again.
_CLOCK_CHECK_SECONDS = 300.0
#: PostgreSQL's SQLSTATE for a lock not had within `lock_timeout`.
LOCK_NOT_AVAILABLE = "55P03"
#: Passes a change of stored rows makes, at most: the second and later ones see rows that a claim it waited for wrote
#: back for a retry. Under churn (two pumps retrying a flaky destination at once) a row can be claimed again before
#: each pass reaches it.
PASSES = 20
#: Attempts of a transaction that met a row moved between the partitions meanwhile (SQLSTATE below).
_ATTEMPTS = 5
_MOVED_MEANWHILE = "40001"  # PostgreSQL's serialization_failure: "tuple to be locked was already moved to ..."
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def check_identifier(kind: str, name: object) -> str:
    """Table and schema names go into SQL text, so only plain identifiers are allowed."""
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise InvalidNameError(
            f"{kind} {name!r} is not allowed: use 1-63 ASCII letters, digits and underscores, "
            "starting with a letter or underscore"
        )
    return name


@dataclass(frozen=True)
class ConnectionSource:
    """The Airflow connection a store or its SQL-table queues were opened from, for messages that say what to run:
    its id, and the command-line options that name the same tables when the caller overrode its extras."""

    conn_id: str
    options: tuple[str, ...] = ()


class Database(Protocol):
    """What the parts of a store (and the SQL-table queues) are given to work on: SqlDatabase has all of it."""

    url: URL
    schema: str | None
    engine: Engine
    is_postgres: bool
    source: ConnectionSource | None

    def clock(self) -> datetime: ...

    def errors(self, action: str) -> AbstractContextManager[None]: ...

    def qualified(self, name: str) -> str: ...

    def in_index_order(self, conn: Connection) -> None: ...

    def run_prepared(self, conn: Connection, statement: Executable, values: Mapping[str, Any]) -> AnyResult: ...

    def lock_schema(self, conn: Connection) -> None: ...


class TablePresence:
    """Whether a table that a later schema version adds is there yet, asked on the caller's connection (on SQLite a
    second one would wait for the write lock the caller may hold). Once found it is not looked for again: migrations
    only add tables. Until then, `every` seconds apart at most (a writer's hot path asks on each batch)."""

    def __init__(self, db: Database, table: Table) -> None:
        self.db = db
        self.table = table
        self.found = False
        self._looked = -math.inf

    def __call__(self, conn: Connection, every: float = 0.0) -> bool:
        if not self.found and time.monotonic() - self._looked >= every:
            # The time of a look only once it has found (or not): another thread's look under way must not make a
            # writer pass over a table that is there.
            self.found = inspect(conn).has_table(self.table.name, schema=self.db.schema)
            self._looked = time.monotonic()
        return self.found


class SqlDatabase:
    """Where a store or a SQL transport keeps its tables: a database URL (whose password never reaches
    text), an optional schema, and the process's shared engine for that URL."""

    def __init__(self, url: URL | str, schema: str | None = None,
                 local_clock: Callable[[], datetime] = utcnow) -> None:
        self.url = make_url(url)
        self.schema = None if schema is None else check_identifier("schema name", schema)
        if self.schema is not None and self.url.get_backend_name() != "postgresql":
            # SQLite would report the unknown schema as an unreachable database, an outage retried in vain.
            raise InvalidInputError(f"schema {schema!r}: a schema (db_schema) is only supported on PostgreSQL, "
                                    f"not {self.url.get_backend_name()}")
        self.engine = get_engine(self.url)
        self.is_postgres = self.engine.dialect.name == "postgresql"
        self._local_clock = local_clock
        self._offset: timedelta | None = None  # the database's clock minus this host's
        self._offset_at = -math.inf
        #: Set by the hook that opened it: errors then name the connection and say what to run.
        self.source: ConnectionSource | None = None

    def clock(self) -> datetime:
        """Now on the database's clock: due times and visibility times are stored and compared on it, so
        hosts whose clocks disagree never deliver early. The offset to this host's clock is measured (never
        ahead of the database's: behind it by at most a round trip) and re-measured every few minutes; SQLite
        is this host."""
        local = self._local_clock()
        if not self.is_postgres:
            return local
        if time.monotonic() - self._offset_at > (_CLOCK_CHECK_SECONDS if self._offset is not None else 1.0):
            self._offset_at = time.monotonic()
            try:
                self._offset = self._measure_offset()
            except UnavailableError as exc:
                # The database is down: nothing can be claimed until it is back, and the caller's own
                # reads meet the same error under their circuit breakers. Measure again soon.
                log.warning("could not read the database clock (%s); using this host's until it can", exc)
        return local + (self._offset or timedelta(0))

    def _measure_offset(self) -> timedelta:
        # The database read its clock at some moment of the round trip, which may be lopsided (a request that
        # left late): taken as read at the end of it, the estimate can only lag the database's clock, never lead
        # it, so no message is taken for due before the database says it is.
        with self.errors("read the database clock"), self.engine.connect() as conn:
            database: datetime = conn.execute(select(func.clock_timestamp())).scalar_one()
            after = self._local_clock()
        return database - after

    def errors(self, action: str) -> AbstractContextManager[None]:
        """Database errors while doing `action`, as this package's errors (no URL or password in them, nor the
        statement); a table or column not there, when the tables are missing or older than this release, as the
        StoreNotReadyError of `schema_problem`."""
        return translate_errors(self.url, action, self.schema_problem)

    def schema_problem(self) -> DelayProviderError | None:
        """Why a statement found a table or column missing, when that is the tables' state (not created yet, older
        than this release): an error saying what to run. None by default, and when the tables are as they should."""
        return None

    def qualified(self, name: str) -> str:
        """`name` in this database's schema, each part quoted as an identifier (for SQL written as text)."""
        preparer = self.engine.dialect.identifier_preparer
        return ".".join(preparer.quote_identifier(p) for p in filter(None, (self.schema, name)))

    def in_index_order(self, conn: Connection) -> None:
        """Make this transaction's queries read their index in order, whatever the statistics say: the claims of
        due messages (the due index) and the receives of SQL-table queues (queue order). A queue table is analysed
        while it is empty (or nearly) and then filled, and looks tiny to the planner, which then reads every due
        or visible row and sorts them all for each batch: a burst of 20,000 went at a sixth of its rate, and a
        consumer behind by 100,000 messages spent most of a CPU sorting. The other plans are priced out, which
        prices the query past the JIT compiler's threshold: half a second of compiling each time, so no JIT.

        Sorts are priced out too. Each partition's scan carries the store's subqueries (live leases, paused
        destinations) over tables that only a priced-out sequential scan reads, so over the 28 partitions of
        schema version 9 a query starts at a price where the planner's 1% tolerance is larger than the real cost
        of reading everything, and it took an Append and a Sort of all partitions for the plan that reads each
        index from its start: right after a fill of 10,000,000 the earliest-due reading of a pump that had just
        started ran for minutes.

        And the plans are generic (the driver prepares a statement run 5 times on a connection): they are the
        same whatever the values, and a plan made for the values read the index of each partition whose
        statistics put a bound in their first or last bucket from its end to find its true end
        (`get_actual_variable_range`), over the entries of every row moved out of the current hour's partition
        since its hour began: 26,633 blocks and 155 ms of planning for a query that ran in 2.6 ms, for each move,
        look and claim across the partitions late in an hour of a soak."""
        if self.is_postgres:
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; "
                                 "SET LOCAL enable_sort = off; SET LOCAL jit = off; "
                                 "SET LOCAL plan_cache_mode = force_generic_plan")

    def run_prepared(self, conn: Connection, statement: Executable, values: Mapping[str, Any]) -> AnyResult:
        """Run `statement` as a prepared statement from its first run on the connection (psycopg prepares one only
        at its sixth): a claim's statement parsed and planned afresh took 0.4-1 ms more than its prepared plan, on
        the way to a burst's first row and in each batch of its drain. Only the statements built once are run this
        way (DueClaims.built): the driver keeps a hundred per connection and drops the least used."""
        raw = conn.connection.driver_connection if self.is_postgres else None
        threshold = getattr(raw, "prepare_threshold", None)
        if threshold is None:  # not psycopg, or preparing turned off
            return conn.execute(statement, values)
        raw.prepare_threshold = 0  # type: ignore[union-attr]
        try:
            return conn.execute(statement, values)
        finally:
            raw.prepare_threshold = threshold  # type: ignore[union-attr]

    def lock_schema(self, conn: Connection) -> None:
        """On PostgreSQL "check, then CREATE" races: a transaction-level advisory lock per schema makes
        concurrent creators wait and then find the tables there (SQLite's BEGIN IMMEDIATE already
        serialises them). Also creates the schema if missing."""
        if self.is_postgres:
            conn.execute(select(func.pg_advisory_xact_lock(advisory_key(f"airflow_delay_provider:{self.schema}"))))
            if self.schema:
                conn.execute(CreateSchema(self.schema, if_not_exists=True))


#: How often (at least) a process reads where the scans of a queue-like index start (seconds); see IndexStart.
START_SECONDS = 1.0


class IndexStart:
    """Where a process's scans of a queue-like index start: the store's due index for claims, a SQL-table queue's
    index for receives. Both are read from their beginning, oldest first, and every row claimed or acked leaves
    a dead entry there until VACUUM removes it; while any transaction in the database holds a snapshot older than
    they are (a backup, a report, a REINDEX CONCURRENTLY) nothing can, and every scan walked them all: 90 s of one
    open REPEATABLE READ transaction at 5,800 msg/s left 500,000 in the due index and 950,000 in the queue's,
    and a pump and a consumer that had kept pace fell 7-25 s behind.

    A reading takes the first key a scan could want (`first`) and a mark below which no key can come from a row
    written since (`mark`): the start is the lower of that first key and the previous reading's mark, so the rows
    written since the previous reading are found at once, whatever the order their transactions commit in.
    Readings walk from the start every `START_SECONDS`; a full reading walks from the index's beginning (the
    dead entries too) every `START_SECONDS` or ten times as long as the last one took, whichever is longer, and
    finds what came below the start meanwhile (a transaction that outlasted a reading, a row made due or visible
    again by another process). A key this process itself puts back below the start lowers it (`lower`).

    The first scan after a wait (no call for longer than `START_SECONDS`) keeps the start it has and leaves the
    reading to the next call: that scan is the one a waiting message is late by (a pump woken at a due time, a
    poll after a quiet spell), and a full reading there cost it a walk over the dead entries. The kept start still
    finds every row written since the last reading (readings only ever advance it past what was read); what only
    a reading finds comes one call later. Never twice in a row, so a caller that always waits longer than
    `START_SECONDS` between calls still reads at every other call."""

    def __init__(self) -> None:
        self.value = 0
        self._mark = 0
        self._next_reading = -math.inf
        self._next_full = -math.inf
        self._full_every = START_SECONDS
        self._last_call = -math.inf
        self._postponed = False

    def current(self, read: Callable[[int, float], tuple[int | None, int]], ahead: bool = False) -> int:
        """The start, read again when it is time: `read(walk_from, look_ahead)` returns the first key at or after
        `walk_from` (0 on a full reading) that is wanted now or within `look_ahead` seconds (until the next full
        reading, and a reading more), or None, and the mark. `ahead`: read now, neither postponed nor left for
        later, just before a wake (the scans then come within `START_SECONDS` of it and read nothing)."""
        now = time.monotonic()
        waited, self._last_call = now - self._last_call > START_SECONDS, now
        if now < self._next_reading and not ahead:
            return self.value
        if waited and not self._postponed and self._mark and not ahead:
            self._postponed = True
            return self.value
        self._postponed = False
        full = now >= self._next_full
        if full:
            self._next_full = now + self._full_every
        first, mark = read(0 if full else self.value, self._next_full - now + START_SECONDS)
        self.value = self._mark if first is None else min(first, self._mark)
        self._mark = mark
        self._next_reading = now + START_SECONDS
        if full:
            self._full_every = max(START_SECONDS, 10 * (time.monotonic() - now))
        return self.value

    def lower(self, value: int) -> None:
        self.value = min(self.value, value)


_T = TypeVar("_T")


def advisory_key(name: str) -> int:
    """A PostgreSQL advisory lock's key for `name` (what one process at a time does to one set of tables)."""
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big", signed=True)


def in_transaction(db: Database, action: str, work: Callable[[Connection], _T]) -> _T:
    """`work` in a transaction of its own, and again from the start when it waited for a row that the
    transaction holding it moved to the other partition (a reschedule between `_soon` and `_later`, a sweep
    releasing its rows, the move): PostgreSQL then fails the statement that waited (SQLSTATE 40001) and the whole
    transaction rolls back, so nothing of the first attempt was written."""
    with db.errors(action):
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with db.engine.begin() as conn:
                    return work(conn)
            except OperationalError as exc:
                if attempt == _ATTEMPTS or getattr(exc.orig, "sqlstate", None) != _MOVED_MEANWHILE:
                    raise
                log.info("%s: a row it waited for was moved to the other partition meanwhile; again (attempt "
                         "%d of %d)", action, attempt + 1, _ATTEMPTS)
    raise AssertionError("unreachable: the last attempt returns or raises")


def copy_rows(conn: Connection, table: Table, columns: tuple[str, ...], types: tuple[str, ...],
              rows: Iterable[Sequence[Any]]) -> None:
    """PostgreSQL COPY (binary) of `rows` (sequences in `columns` order) on the connection's open transaction.

    Several times the rate of INSERTs; the table and column names are quoted as identifiers.
    """
    from psycopg import sql  # only PostgreSQL gets here

    target = sql.Identifier(*filter(None, (table.schema, table.name)))
    statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
        target, sql.SQL(", ").join(map(sql.Identifier, columns))
    )
    driver: Any = conn.connection.driver_connection
    with driver.cursor() as cursor, cursor.copy(statement) as copy:
        copy.set_types(types)
        for row in rows:
            copy.write_row(row)


def safe_url(url: URL | str) -> str:
    """The URL as it may appear in logs and errors: never with its password."""
    return make_url(url).render_as_string(hide_password=True)


def get_engine(url: URL | str) -> Engine:
    """One engine (and pool) per database URL in a process, so a store and a transport can share it."""
    url = make_url(url)
    key = url.render_as_string(hide_password=False)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = _create(url)
        return engine


def _create(url: URL) -> Engine:
    if url.get_backend_name() != "sqlite":
        options = postgres_session_options(url)
        # Last in, first out: a pump's claims run on the connection its previous statement used, whose server
        # process has the claim's plan and the counts trigger's function ready. In turns (the default), a pump
        # woken at a due time took the connection idle the longest, often one only a background pass had used.
        return create_engine(engine_url(url), pool_pre_ping=True, pool_size=5, max_overflow=5, pool_use_lifo=True,
                             connect_args=options)
    engine = create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:  # pragma: no branch
        # Take over transaction control from pysqlite so BEGIN IMMEDIATE can be issued:
        # a claim then holds the write lock from its first read, which SQLite needs in place
        # of SKIP LOCKED to keep two pumps from taking the same rows.
        dbapi_connection.isolation_level = None
        dbapi_connection.execute("PRAGMA journal_mode=WAL")
        # FULL: a send acknowledged to its task survives a power loss, not only a crash (WAL's
        # NORMAL may lose the last commits); it costs an fsync per commit.
        dbapi_connection.execute("PRAGMA synchronous=FULL")

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


#: Bounds on what a vanished client can hold (configurable as URL query parameters, e.g. in the
#: connection's `url` extra: `?idle_in_transaction_session_timeout=300s&lock_timeout=60s`).
#: A claim is an open transaction while its batch is sent and confirmed: a pump host that dies or
#: is cut off would otherwise keep its rows locked until TCP notices, which takes hours by default.
POSTGRES_DEFAULTS = {
    "idle_in_transaction_session_timeout": "120s",  # the server rolls back a claim left idle this long
    "lock_timeout": "30s",  # no statement waits longer than this for a lock
}
#: TCP keepalives: a silent peer is noticed in about a minute (30 s idle, then 3 probes 10 s apart).
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}


_DURATION = re.compile(r"^\d+(ms|s|min|h)?$")


def postgres_session_options(url: URL) -> dict[str, Any]:
    """psycopg connect arguments: keepalives, and the session timeouts above unless the URL sets its own."""
    settings = {name: url.query.get(name, default) for name, default in POSTGRES_DEFAULTS.items()}
    for name, value in settings.items():
        if not isinstance(value, str) or not _DURATION.match(value):
            raise InvalidInputError(
                f"{name} must be a duration such as 30s, 500ms or 2min (0 disables it), got {value!r}")
    options = " ".join(f"-c {name}={value}" for name, value in settings.items())
    return {**KEEPALIVES, "options": options}


def engine_url(url: URL) -> URL:
    """The URL without the session settings above, which go to the server as options instead."""
    return url.difference_update_query(list(POSTGRES_DEFAULTS))


#: SQLSTATEs of a missing table, column or schema; SQLite says it in words (an OperationalError there).
_UNDEFINED = frozenset({"42P01", "42703", "3F000"})
_SQLITE_UNDEFINED = ("no such table", "no such column")


def _undefined(exc: DBAPIError) -> bool:
    return getattr(exc.orig, "sqlstate", None) in _UNDEFINED or str(exc.orig).startswith(_SQLITE_UNDEFINED)


@contextmanager
def translate_errors(url: URL | str, action: str,
                     problem: Callable[[], DelayProviderError | None] | None = None) -> Iterator[None]:
    """Turn driver errors into this package's: UnavailableError for a connection's (naming the database, never its
    password), `problem()` for a table or column not there when it explains it (StoreNotReadyError), and
    DelayProviderError for the rest. Only the first line of the driver's message is kept: SQLAlchemy's text of an
    error carries the statement and its parameters, which may hold a message's values."""
    try:
        yield
    except DBAPIError as exc:
        found = problem() if problem is not None and _undefined(exc) else None
        if found is not None:
            raise found from None
        message = str(exc.orig) if exc.orig is not None else ""
        password = make_url(url).password
        if password:
            message = message.replace(str(password), "***")
        first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
        if not isinstance(exc, OperationalError):
            raise DelayProviderError(
                f"could not {action}: the database at {safe_url(url)} refused the statement ({first})") from None
        raise UnavailableError(
            f"could not {action}: the database at {safe_url(url)} is not reachable or refused the operation ({first})"
        ) from None  # the driver's exception may carry the connection string
    except PendingRollbackError:
        # A connection lost inside a transaction: SQLAlchemy refuses it until that transaction is
        # rolled back, which happens as the claim unwinds; the next attempt takes a fresh connection.
        raise UnavailableError(
            f"could not {action}: the connection to the database at {safe_url(url)} was lost inside a transaction"
        ) from None
