"""The SQL delayed-message store (an external store of delayed messages, claimed in batches): SQLite and PostgreSQL.

All SQL of the store is in this module. Times are integer microseconds since the epoch (UTC),
which compare and index the same way on every database.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
from collections import deque
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Callable, Collection, Iterable, Iterator, Mapping, Sequence

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    bindparam,
    delete,
    func,
    insert,
    inspect,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection

from airflow_delay_provider.core.delays import resolve_delay, utcnow
from airflow_delay_provider.core.errors import (
    InvalidInputError,
    InvalidMessageError,
    InvalidNameError,
    UnavailableError,
)
from airflow_delay_provider.core.message import DelayedMessage, check_destination
from airflow_delay_provider.core.ports import Claim, DelayedMessageStore
from airflow_delay_provider.core.retry_policy import DeliveryPolicy, PolicyError
from airflow_delay_provider.stores.engine import (
    KEEPALIVES,
    SqlDatabase,
    check_identifier,
    copy_rows,
    engine_url,
    safe_url,
)

log = logging.getLogger(__name__)

DEFAULT_TABLE = "delayed_messages"
#: Without LISTEN/NOTIFY (SQLite) an idle pump re-reads the next due time this often.
SQLITE_POLL_SECONDS = 0.5


EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_US = timedelta(microseconds=1)


def to_us(moment: datetime) -> int:
    return (moment - EPOCH) // _US  # integer arithmetic: exact, unlike timestamp() floats


def from_us(us: int) -> datetime:
    return EPOCH + us * _US


# One BIGINT primary key that autoincrements on both SQLite (as the rowid) and PostgreSQL.
_Id = BigInteger().with_variant(Integer, "sqlite")


def store_table(metadata: MetaData, name: str, schema: str | None) -> Table:
    return Table(
        name,
        metadata,
        Column("id", _Id, primary_key=True, autoincrement=True),
        Column("message_id", String(200), nullable=False, unique=True),
        Column("destination", String(255), nullable=False),
        Column("body", LargeBinary, nullable=False),
        Column("headers", Text, nullable=False),
        Column("due_at_us", BigInteger, nullable=False),
        Column("stored_at_us", BigInteger, nullable=False),
        Column("failures", Integer, nullable=False, server_default="0"),
        # Set while a bulk sweep holds the row; the lease in the sweeps table says until when.
        Column("claim_id", String(64), nullable=True),
        Index(f"ix_{name}_due", "due_at_us", "id"),
        schema=schema,
    )


def sweeps_table(metadata: MetaData, name: str, schema: str | None) -> Table:
    """One row per bulk sweep: its window, its lease (renewed while it runs) and its outcome."""
    return Table(
        name,
        metadata,
        Column("claim_id", String(64), primary_key=True),
        Column("lease_until_us", BigInteger, nullable=False),
        Column("due_from_us", BigInteger, nullable=True),
        Column("due_before_us", BigInteger, nullable=False),
        Column("status", String(16), nullable=False),
        Column("started_at_us", BigInteger, nullable=False),
        Column("finished_at_us", BigInteger, nullable=True),
        Column("claimed", BigInteger, nullable=False, server_default="0"),
        Column("taken_over", BigInteger, nullable=False, server_default="0"),
        Column("summary", Text, nullable=True),
        schema=schema,
    )


def ids_table(metadata: MetaData, store_table_name: str, schema: str | None) -> Table:
    """Message ids accepted in the last de-duplication window (stored or sent natively): a send
    retried after its messages were delivered finds its ids here and sends nothing twice."""
    name = f"{store_table_name}_ids"
    short = hashlib.sha1(f"{schema}.{name}".encode()).hexdigest()[:16]  # <table>_ids_... may exceed 63
    return Table(
        name,
        metadata,
        Column("message_id", String(200), primary_key=True),
        Column("seen_at_us", BigInteger, nullable=False),
        Index(f"ix_ids_{short}", "seen_at_us"),
        schema=schema,
    )


def throttle_table(metadata: MetaData, store_table_name: str, schema: str | None) -> Table:
    """One token bucket per throttled destination, shared by every pump of the store."""
    return Table(
        f"{store_table_name}_throttle",
        metadata,
        Column("destination", String(255), primary_key=True),
        Column("tokens", Float, nullable=False),
        Column("updated_us", BigInteger, nullable=False),
        schema=schema,
    )


def queue_delays_table(metadata: MetaData, store_table_name: str, schema: str | None) -> Table:
    """Each destination's queue-level delay, set when it is provisioned: every send path applies it
    to messages that have no delay of their own, so two senders to one destination cannot disagree."""
    return Table(
        f"{store_table_name}_delays",
        metadata,
        Column("destination", String(255), primary_key=True),
        Column("queue_delay_seconds", Integer, nullable=False),
        schema=schema,
    )


#: How long an accepted message id is remembered (seconds): within it, the same id is neither stored
#: nor sent natively again. Like SQS FIFO's five-minute window or Cloud Tasks' task names, but longer.
DEFAULT_DEDUP_WINDOW_SECONDS = 86_400
#: How often a store re-measures the offset between the database's clock and this host's.
_CLOCK_CHECK_SECONDS = 300.0
#: Expired ids are deleted at most this often per store object.
_EXPIRE_EVERY_SECONDS = 60.0


class _SqlClaim(Claim):
    """Claimed rows are deleted by the claiming statement itself, inside the claim's transaction.

    Delivered messages then cost no further statement; retried ones are written back with their new
    due time; anything left unsettled is restored before commit; an error rolls all of it back.
    """

    def __init__(self, conn: Connection, table: Table, rows) -> None:
        self.connection = conn
        self._table = table
        rows = sorted(rows, key=lambda r: (r.due_at_us, r.id))  # RETURNING has no order
        self._rows = {row.message_id: row for row in rows}
        self._unsettled = set(self._rows)
        self.messages = [_message(row) for row in rows]

    def remove(self, message_ids: Iterable[str]) -> int:
        before = len(self._unsettled)
        self._unsettled.difference_update(message_ids)
        return before - len(self._unsettled)

    def retry(self, next_due: Mapping[str, datetime], headers: Mapping[str, dict[str, str]] | None = None) -> None:
        changes = {m: {"failures": self._rows[m].failures + 1, "due_at_us": to_us(d)} for m, d in next_due.items()}
        for m, h in (headers or {}).items():
            changes[m]["headers"] = json.dumps(h, separators=(",", ":"))
        self._write_back(changes)

    def restore_unsettled(self) -> None:
        if self._unsettled:
            self._write_back({m: {} for m in self._unsettled})

    def _write_back(self, changes: Mapping[str, dict]) -> None:
        rows = [{**self._rows[m]._asdict(), "claim_id": None, **change} for m, change in changes.items()]
        self.connection.execute(insert(self._table), rows)
        self._unsettled.difference_update(changes)


def _message(row) -> DelayedMessage:
    return _rebuild(row.message_id, row.destination, row.body, row.headers, row.due_at_us, row.failures)


def _rebuild(message_id: str, destination: str, body, headers: str, due_at_us: int, failures: int) -> DelayedMessage:
    return DelayedMessage.trusted(
        destination, bytes(body), from_us(due_at_us), {} if headers == "{}" else json.loads(headers), message_id, failures
    )


#: The store also creates `<table>_policies`, `_sweeps`, `_delays` and others, which must fit PostgreSQL's
#: 63-character identifiers too.
MAX_TABLE_NAME = 63 - len("_policies")


def check_store_table(name: object) -> str:
    name = check_identifier("table name", name)
    if len(name) > MAX_TABLE_NAME:
        raise InvalidNameError(
            f"table name {name!r} has {len(name)} characters; a store's table name may have at most {MAX_TABLE_NAME}, "
            "since the store also creates <table>_policies and <table>_sweeps (63 characters at most)"
        )
    return name


#: Columns a sweep reads, in this order, as tuples (the Spark readers produce the same).
SWEEP_COLUMNS = ("id", "message_id", "destination", "body", "headers", "due_at_us", "failures")
_CLAIM_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_claim_id(claim_id: object) -> str:
    """Claim ids go into Spark JDBC predicates as literals: only letters, digits, '-' and '_'."""
    if not isinstance(claim_id, str) or not _CLAIM_ID.match(claim_id):
        raise InvalidInputError(f"claim id {claim_id!r} is not allowed: use 1-64 ASCII letters, digits, '-' and '_'")
    return claim_id


class _LeasedClaim(Claim):
    """A batch of rows a sweep holds, locked again in this transaction; settled rows are deleted or
    rescheduled in it, unsettled ones go back to the sweep's queue (still under its lease)."""

    def __init__(self, conn: Connection, table: Table, rows: list[tuple], hand_back) -> None:
        self.connection = conn
        self._table = table
        self._rows = {row[1]: row for row in rows}
        self._unsettled = set(self._rows)
        self._hand_back = hand_back
        self.messages = [_rebuild(*row[1:]) for row in rows]

    def remove(self, message_ids: Iterable[str]) -> int:
        ids = [self._rows[m][0] for m in message_ids if m in self._unsettled]
        self._unsettled.difference_update(message_ids)
        if ids:
            self.connection.execute(delete(self._table).where(self._table.c.id.in_(ids)))
        return len(ids)

    def retry(self, next_due: Mapping[str, datetime], headers: Mapping[str, dict[str, str]] | None = None) -> None:
        t = self._table
        headers = headers or {}
        rows = [
            {
                "rid": self._rows[m][0],
                "f": self._rows[m][6] + 1,
                "d": to_us(due),
                "h": json.dumps(headers[m], separators=(",", ":")) if m in headers else self._rows[m][4],
            }
            for m, due in next_due.items()
        ]
        # A retry leaves the sweep: it is an ordinary delayed message again, for whoever dispatches it when due.
        stmt = (update(t).where(t.c.id == bindparam("rid"))
                .values(failures=bindparam("f"), due_at_us=bindparam("d"), headers=bindparam("h"), claim_id=None))
        self.connection.execute(stmt, rows)
        self._unsettled.difference_update(next_due)

    def restore_unsettled(self) -> None:
        if self._unsettled:
            self._hand_back(self._rows[m] for m in self._unsettled)
            self._unsettled.clear()


class LeasedRows(DelayedMessageStore):
    """The rows one part of a sweep holds under its claim id, handed to a Pump batch by batch.

    Each batch is locked again in the transaction that settles it and only rows still held by this
    claim are sent, so a row that another sweep took over (after this lease expired) or that is gone
    is skipped, never sent twice. Rows come as tuples in SWEEP_COLUMNS order.
    """

    def __init__(self, store: SqlDelayedMessageStore, claim_id: str, rows: Iterable[tuple]) -> None:
        self.home = store
        self.clock = store.clock
        self.shared_throttle = store.shared_throttle  # a sweep's partitions and the pumps share one bucket
        self.engine = store.engine  # a SQL transport on the same database joins the settling transaction
        self.table = store.table
        self.claim_id = check_claim_id(claim_id)
        self.concurrent_claims = store.concurrent_claims
        self.skipped = 0
        self._rows = iter(rows)
        self._held: deque[tuple] = deque()  # handed back unsettled (throttled or broker outage)
        self._exhausted = False

    def __repr__(self) -> str:
        return f"LeasedRows({self.home!r}, claim_id={self.claim_id!r})"

    def _take(self, limit: int, exclude: Collection[str]) -> list[tuple]:
        taken: list[tuple] = []
        passed: list[tuple] = []
        while self._held and len(taken) < limit:
            row = self._held.popleft()
            (passed if row[2] in exclude else taken).append(row)
        while not self._exhausted and len(taken) < limit:
            row = next(self._rows, None)
            if row is None:
                self._exhausted = True
            else:
                (passed if row[2] in exclude else taken).append(row)
        self._held.extendleft(reversed(passed))
        return taken

    @property
    def remaining(self) -> bool:
        if self._held:
            return True
        if not self._exhausted:
            row = next(self._rows, None)
            if row is None:
                self._exhausted = True
            else:
                self._held.append(row)
        return bool(self._held)

    @contextmanager
    def claim_due(
        self, now: datetime, limit: int, due_before: datetime | None = None, exclude: Collection[str] = ()
    ) -> Iterator[Claim]:
        rows = self._take(limit, exclude)
        t = self.table
        with self.home._errors("lock swept messages"), self.engine.begin() as conn:
            held: set[int] = set()
            if rows:
                mine = select(t.c.id).where(t.c.id.in_([r[0] for r in rows]), t.c.claim_id == self.claim_id)
                held = set(conn.execute(mine.with_for_update()).scalars())
            kept = [r for r in rows if r[0] in held]
            self.skipped += len(rows) - len(kept)
            claim = _LeasedClaim(conn, t, kept, self._held.extend)
            yield claim
            claim.restore_unsettled()

    def next_due(self, destination: str | None = None, due_before: datetime | None = None) -> datetime | None:
        return self.clock() if self.remaining else None

    def count_scheduled(self, due_before: datetime | None = None) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self._held:
            counts[row[2]] = counts.get(row[2], 0) + 1
        return counts

    def store(self, messages: Sequence[DelayedMessage], deduplicate: bool = True) -> int:
        return self.home.store(messages, deduplicate)

    def policies(self) -> dict[str, dict]:
        return self.home.policies()

    def take_tokens(self, destination: str, rate: float, n: int) -> tuple[int, float]:
        return self.home.take_tokens(destination, rate, n)

    def wait(self, until: datetime) -> None:
        time.sleep(max(0.0, min((until - self.clock()).total_seconds(), 0.05)))


class SqlDelayedMessageStore(SqlDatabase, DelayedMessageStore):
    """Delayed messages in one table; claims lock rows (`FOR UPDATE SKIP LOCKED` on PostgreSQL)."""

    def __init__(
        self, url: URL | str, table: str = DEFAULT_TABLE, schema: str | None = None,
        dedup_window_seconds: float = DEFAULT_DEDUP_WINDOW_SECONDS,
        local_clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.table_name = check_store_table(table)
        super().__init__(url, schema)
        if isinstance(dedup_window_seconds, bool) or not isinstance(dedup_window_seconds, (int, float)) \
                or dedup_window_seconds < 0:
            raise InvalidInputError(f"dedup_window_seconds must be a number of seconds >= 0 (0 turns "
                                    f"de-duplication off), got {dedup_window_seconds!r}")
        self.dedup_window_us = int(dedup_window_seconds * 1_000_000)
        self._expired_at = 0.0
        self._local_clock = local_clock
        self._offset: timedelta | None = None  # the database's clock minus this host's
        self._offset_at = -math.inf
        self.table = store_table(MetaData(), self.table_name, self.schema)
        self.ids = ids_table(self.table.metadata, self.table_name, self.schema)
        self.throttle = throttle_table(self.table.metadata, self.table_name, self.schema)
        self.delays = queue_delays_table(self.table.metadata, self.table_name, self.schema)
        # On SQLite a claim holds the database's write lock, which a second transaction would wait for:
        # there each pump keeps its own bucket (pumps on one SQLite file take turns anyway).
        # Delivery policies per destination live beside the messages, so every pump sees the same.
        self.policy_table = Table(
            f"{self.table_name}_policies",
            self.table.metadata,
            Column("destination", String(255), primary_key=True),
            Column("policy", Text, nullable=False),
            schema=self.schema,
        )
        self.sweeps = sweeps_table(self.table.metadata, f"{self.table_name}_sweeps", self.schema)
        self.concurrent_claims = self.is_postgres  # SQLite locks the whole database per write transaction
        self.shared_throttle = self.is_postgres
        qualified = f"{self.schema}.{self.table_name}" if self.schema else self.table_name
        # LISTEN takes an identifier of at most 63 bytes; a hash keeps any schema.table pair within it.
        self.channel = "delay_" + hashlib.sha1(qualified.encode()).hexdigest()[:24]
        self._listener = None
        self._alistener = None
        self._scope: list = []  # conditions every claim and read of this store object adds

    def restrict(
        self, destinations: Collection[str] | None = None, prefix: str | None = None, due_from: datetime | None = None
    ) -> SqlDelayedMessageStore:
        """Serve only some destinations (names, and/or those starting with `prefix`) and, with `due_from`,
        only messages due at or after it: claims, next due times and counts of this object see no others,
        so one store can serve several teams' dispatchers, or a sweep its window. Returns self."""
        t = self.table
        self._scope = []
        wanted = []
        if destinations:
            wanted.append(t.c.destination.in_(sorted(set(destinations))))
        if prefix:
            wanted.append(t.c.destination.startswith(prefix, autoescape=True))
        if wanted:
            self._scope.append(or_(*wanted))
        if due_from is not None:
            self._scope.append(t.c.due_at_us >= to_us(due_from))
        return self

    def __repr__(self) -> str:
        return f"SqlDelayedMessageStore({safe_url(self.url)!r}, table={self.table_name!r}, schema={self.schema!r})"

    # -- time ----------------------------------------------------------------------------------------
    def clock(self) -> datetime:
        """Now on the database's clock: due times are stored and compared on it, so senders and pumps
        on hosts whose clocks disagree never deliver early. The offset to this host's clock is measured
        (to within half a round trip) and re-measured every few minutes; SQLite is this host."""
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
        with self._errors("read the database clock"), self.engine.connect() as conn:
            before = self._local_clock()
            database = conn.execute(select(func.clock_timestamp())).scalar()
            after = self._local_clock()
        return database - (before + (after - before) / 2)

    # -- schema --------------------------------------------------------------------------------
    def create_schema(self) -> None:
        """Create the schema, tables and index if missing (idempotent, safe to run concurrently).

        A table of that name that is not a delay store (another application's) is refused before
        anything is created or changed."""
        self._check_existing_shape()
        self._create_tables(self.table.metadata, "the delay store tables")
        with self._errors("upgrade the delay store table"), self.engine.begin() as conn:
            columns = {c["name"] for c in inspect(conn).get_columns(self.table_name, schema=self.schema)}
            if "claim_id" not in columns:  # a store created before bulk sweeps existed
                name = ".".join(f'"{part}"' for part in filter(None, (self.schema, self.table_name)))
                conn.execute(text(f"ALTER TABLE {name} ADD COLUMN claim_id VARCHAR(64)"))  # checked identifiers

    def _check_existing_shape(self) -> None:
        with self._errors("inspect the delay store"), self.engine.connect() as conn:
            inspector = inspect(conn)
            for table in (self.table, self.policy_table, self.sweeps, self.ids, self.throttle, self.delays):
                if not inspector.has_table(table.name, schema=self.schema):
                    continue
                found = {c["name"] for c in inspector.get_columns(table.name, schema=self.schema)}
                # claim_id is the one column an older store may lack; it is added below.
                missing = sorted({c.name for c in table.columns} - found - {"claim_id"})
                if missing:
                    where = f"{self.schema}.{table.name}" if self.schema else table.name
                    raise InvalidInputError(
                        f"table {where} exists but is not a delay store table (missing columns {missing}); "
                        "nothing was changed: choose another `table` (or `db_schema`) for the store"
                    )

    def set_policies(self, policies: Mapping[str, dict]) -> None:
        """Store each destination's delivery policy (delivery-policy JSON), replacing what was there.
        Each is checked first: a pump ignores a stored policy it cannot read."""
        for destination, policy in policies.items():
            check_destination(destination)
            try:
                DeliveryPolicy.from_dict(policy)
            except PolicyError as exc:
                raise PolicyError(f"the delivery policy of {destination!r}: {exc}") from None
        t = self.policy_table
        with self._errors("store delivery policies"), self.engine.begin() as conn:
            if policies:
                conn.execute(delete(t).where(t.c.destination.in_(list(policies))))
                conn.execute(insert(t), [{"destination": d, "policy": json.dumps(p)} for d, p in policies.items()])

    def set_queue_delays(self, delays: Mapping[str, int]) -> None:
        """Store each destination's queue-level delay in seconds (0..7 days), replacing what was there;
        0 removes it. Applies to messages sent from now on, as a broker's queue attribute would."""
        for destination, seconds in delays.items():
            resolve_delay(queue_delay=seconds, queue_field=f"queue_delay_seconds of {destination!r}")
        t = self.delays
        with self._errors("store queue-level delays"), self.engine.begin() as conn:
            if delays:
                conn.execute(delete(t).where(t.c.destination.in_(list(delays))))
                rows = [{"destination": d, "queue_delay_seconds": s} for d, s in delays.items() if s]
                if rows:
                    conn.execute(insert(t), rows)

    def queue_delays(self, destinations: Collection[str] | None = None) -> dict[str, int]:
        """The queue-level delays set for these destinations (all, without `destinations`)."""
        t = self.delays
        query = select(t.c.destination, t.c.queue_delay_seconds)
        if destinations is not None:
            query = query.where(t.c.destination.in_(sorted(set(destinations))))
        with self._errors("read queue-level delays"), self.engine.connect() as conn:
            return dict(conn.execute(query).all())

    def take_tokens(self, destination: str, rate: float, n: int) -> tuple[int, float]:
        """Take up to `n` tokens of the destination's bucket, in a transaction of its own (the row lock
        makes pumps take turns); the bucket refills at `rate` on the database's clock, holds at most
        one second's worth and starts with one token, as TokenBucket does."""
        t = self.throttle
        capacity = max(float(rate), 1.0)
        now = to_us(self.clock())
        with self._errors("take throttle tokens"), self.engine.begin() as conn:
            insert = (postgresql.insert if self.is_postgres else sqlite.insert)(t)
            conn.execute(insert.values(destination=destination, tokens=min(1.0, float(rate)), updated_us=now)
                         .on_conflict_do_nothing(index_elements=["destination"]))
            tokens, updated = conn.execute(
                select(t.c.tokens, t.c.updated_us).where(t.c.destination == destination).with_for_update()).one()
            tokens = min(capacity, tokens + max(0, now - updated) / 1e6 * rate)
            taken = min(n, int(tokens))
            conn.execute(update(t).where(t.c.destination == destination).values(tokens=tokens - taken, updated_us=now))
        return taken, tokens - taken

    def policies(self) -> dict[str, dict]:
        t = self.policy_table
        with self._errors("read delivery policies"), self.engine.connect() as conn:
            return {d: json.loads(p) for d, p in conn.execute(select(t.c.destination, t.c.policy)).all()}

    def exists(self) -> bool:
        with self._errors("inspect the delay store"), self.engine.connect() as conn:
            return inspect(conn).has_table(self.table_name, schema=self.schema)

    # -- writes -----------------------------------------------------------------------------------
    def store(self, messages: Sequence[DelayedMessage], deduplicate: bool = True) -> int:
        """Store messages atomically; ids already stored, or accepted within the de-duplication window,
        are skipped. Returns how many were new. `deduplicate=False` (a migration moving messages that
        were accepted before) skips only ids that are stored right now."""
        if not messages:
            return 0
        wrong = next((m for m in messages if not isinstance(m, DelayedMessage)), None)
        if wrong is not None:
            raise InvalidMessageError(f"messages must be DelayedMessage objects (each checked when it is built), "
                                      f"got {type(wrong).__name__}")
        now = to_us(self.clock())
        rows = [
            {
                "message_id": m.message_id,
                "destination": m.destination,
                "body": m.body,
                "headers": json.dumps(m.headers, separators=(",", ":")),
                "due_at_us": to_us(m.due_at),
                "stored_at_us": now,
                "failures": m.failures,
            }
            for m in messages
        ]
        remember = deduplicate and self.dedup_window_us > 0
        with self._errors("store delayed messages"), self.engine.begin() as conn:
            if remember:
                self._expire_ids(conn, now)
            stored = self._insert_new(conn, rows, now if remember else None)
            if self.is_postgres and stored:
                # Delivered at commit; wakes idle pumps that sleep past this due time.
                soonest = min(r["due_at_us"] for r in rows)
                conn.execute(select(func.pg_notify(self.channel, str(soonest))))
        return stored

    _COPY_COLUMNS = ("message_id", "destination", "body", "headers", "due_at_us", "stored_at_us", "failures")
    _COPY_TYPES = ("text", "text", "bytea", "text", "int8", "int8", "int4")

    def _insert_new(self, conn: Connection, rows: list[dict], seen_at_us: int | None) -> int:
        """Insert the rows whose message id is new (a retried task stores nothing twice); returns how many.
        With `seen_at_us`, their ids are remembered in the ids table and ids found there are skipped."""
        if self.is_postgres:
            from psycopg.errors import UniqueViolation

            try:
                with conn.begin_nested():  # COPY is the fast way, for the usual case of all-new ids
                    if seen_at_us is not None:
                        copy_rows(conn, self.ids, ("message_id", "seen_at_us"), ("text", "int8"),
                                  ((r["message_id"], seen_at_us) for r in rows))
                    copy_rows(conn, self.table, self._COPY_COLUMNS, self._COPY_TYPES,
                              ([r[c] for c in self._COPY_COLUMNS] for r in rows))
                return len(rows)
            except UniqueViolation:
                pass
        if seen_at_us is not None:
            fresh = set(self._remember(conn, [r["message_id"] for r in rows], seen_at_us))
            rows = [r for r in rows if r["message_id"] in fresh]
            if not rows:
                return 0
        insert = (postgresql.insert if self.is_postgres else sqlite.insert)(self.table)
        stmt = insert.on_conflict_do_nothing(index_elements=["message_id"]).returning(self.table.c.id)
        return len(conn.execute(stmt, rows).all())

    def _remember(self, conn: Connection, message_ids: Sequence[str], seen_at_us: int) -> list[str]:
        """Add ids to the ids table; returns those that were not there within the window (the new ones:
        an id seen longer ago than the window counts as new, even before the expiry deleted it)."""
        t = self.ids
        insert = (postgresql.insert if self.is_postgres else sqlite.insert)(t)
        stmt = insert.on_conflict_do_update(
            index_elements=["message_id"], set_={"seen_at_us": insert.excluded.seen_at_us},
            where=t.c.seen_at_us < seen_at_us - self.dedup_window_us,
        ).returning(t.c.message_id)
        rows = [{"message_id": m, "seen_at_us": seen_at_us} for m in dict.fromkeys(message_ids)]
        return list(conn.execute(stmt, rows).scalars()) if rows else []

    def _expire_ids(self, conn: Connection, now_us: int) -> None:
        if time.monotonic() - self._expired_at >= _EXPIRE_EVERY_SECONDS:
            self._expired_at = time.monotonic()
            conn.execute(delete(self.ids).where(self.ids.c.seen_at_us < now_us - self.dedup_window_us))

    def unseen(self, message_ids: Sequence[str]) -> list[str]:
        """The ids not accepted within the de-duplication window: what a native send may still send."""
        if self.dedup_window_us <= 0 or not message_ids:
            return list(message_ids)
        cutoff = to_us(self.clock()) - self.dedup_window_us
        t = self.ids
        with self._errors("read sent message ids"), self.engine.connect() as conn:
            seen = set(conn.execute(select(t.c.message_id).where(
                t.c.message_id.in_(list(message_ids)), t.c.seen_at_us >= cutoff)).scalars())
        return [m for m in message_ids if m not in seen]

    def remember_sent(self, message_ids: Sequence[str]) -> None:
        """Record ids a broker confirmed (a native send), so a retried send skips them."""
        if self.dedup_window_us <= 0 or not message_ids:
            return
        now = to_us(self.clock())
        with self._errors("record sent message ids"), self.engine.begin() as conn:
            self._expire_ids(conn, now)
            self._remember(conn, message_ids, now)

    @contextmanager
    def claim_due(
        self, now: datetime, limit: int, due_before: datetime | None = None, exclude: Collection[str] = ()
    ) -> Iterator[Claim]:
        t = self.table
        due = select(t.c.id).where(t.c.due_at_us <= to_us(now), self._unleased(to_us(now)), *self._scope)
        if due_before is not None:
            due = due.where(t.c.due_at_us < to_us(due_before))
        if exclude:
            due = due.where(t.c.destination.not_in(list(exclude)))
        # Oldest first; rows another claim holds are skipped, never waited for or handed out twice.
        due = due.order_by(t.c.due_at_us, t.c.id).limit(limit).with_for_update(skip_locked=True)
        claim_rows = delete(t).where(t.c.id.in_(due.scalar_subquery())).returning(*t.c)
        with self._errors("claim due messages"), self.engine.begin() as conn:
            claim = _SqlClaim(conn, t, conn.execute(claim_rows).all())
            yield claim
            claim.restore_unsettled()

    def _unleased(self, now_us: int):
        """Rows no running sweep holds: never claimed by one, or its lease has expired."""
        t, s = self.table, self.sweeps
        return or_(t.c.claim_id.is_(None), t.c.claim_id.not_in(select(s.c.claim_id).where(s.c.lease_until_us >= now_us)))

    # -- bulk sweeps -------------------------------------------------------------------------
    def start_sweep(
        self, claim_id: str, due_before: datetime, due_from: datetime | None = None,
        lease_seconds: float = 600.0, chunk: int = 100_000,
    ) -> dict:
        """Lease the messages due in [due_from, due_before) and already due to `claim_id`.

        The lease row is committed first, so the pump skips the rows from the moment they carry the
        claim id. Rows of expired leases (a crashed sweep's) are taken over; rows a pump holds at
        that moment are skipped (it is dispatching them). Returns how many rows were claimed.
        """
        check_claim_id(claim_id)
        now_us = to_us(self.clock())
        if lease_seconds <= 0:
            raise InvalidInputError(f"lease_seconds must be > 0, got {lease_seconds!r}")
        t, s = self.table, self.sweeps
        with self._errors("start a sweep"), self.engine.begin() as conn:
            if conn.execute(select(s.c.claim_id).where(s.c.claim_id == claim_id)).first():
                raise InvalidInputError(f"claim id {claim_id!r} was used by an earlier sweep; use a new one")
            conn.execute(insert(s).values(
                claim_id=claim_id, lease_until_us=now_us + int(lease_seconds * 1e6),
                due_from_us=None if due_from is None else to_us(due_from), due_before_us=to_us(due_before),
                status="running", started_at_us=now_us,
            ))
        window = [t.c.due_at_us <= now_us, t.c.due_at_us < to_us(due_before)]
        if due_from is not None:
            window.append(t.c.due_at_us >= to_us(due_from))
        expired = select(s.c.claim_id).where(s.c.lease_until_us < now_us)
        taken_over = self._lease(claim_id, [*window, t.c.claim_id.in_(expired)], chunk)
        claimed = taken_over + self._lease(claim_id, [*window, t.c.claim_id.is_(None)], chunk)
        with self._errors("record a sweep"), self.engine.begin() as conn:
            conn.execute(update(s).where(s.c.claim_id == claim_id).values(claimed=claimed, taken_over=taken_over))
        return {"claimed": claimed, "taken_over": taken_over}

    def _lease(self, claim_id: str, conditions: list, chunk: int) -> int:
        t = self.table
        total = 0
        while True:
            ids = select(t.c.id).where(*conditions).limit(chunk).with_for_update(skip_locked=True)
            with self._errors("claim messages for a sweep"), self.engine.begin() as conn:
                n = conn.execute(update(t).where(t.c.id.in_(ids.scalar_subquery())).values(claim_id=claim_id)).rowcount
            total += n
            if n < chunk:
                return total
            log.info("sweep %s: %d messages claimed so far", claim_id, total)

    def renew_lease(self, claim_id: str, lease_seconds: float) -> bool:
        """Extend a running sweep's lease; False when it is no longer running (finished or never started)."""
        s = self.sweeps
        until = to_us(self.clock()) + int(lease_seconds * 1e6)
        with self._errors("renew a sweep's lease"), self.engine.begin() as conn:
            stmt = update(s).where(s.c.claim_id == claim_id, s.c.status == "running").values(lease_until_us=until)
            return conn.execute(stmt).rowcount == 1

    def claimed_range(self, claim_id: str) -> tuple[int, int, int]:
        """(lowest id, highest id, count) of the rows a sweep still holds; (0, -1, 0) when none."""
        t = self.table
        query = select(func.min(t.c.id), func.max(t.c.id), func.count()).where(t.c.claim_id == claim_id)
        with self._errors("read a sweep's claim"), self.engine.connect() as conn:
            low, high, n = conn.execute(query).one()
        return (0, -1, 0) if not n else (low, high, n)

    def read_claimed(self, claim_id: str, low: int, high: int, chunk: int = 10_000) -> Iterator[tuple]:
        """The rows a sweep holds with low <= id <= high, in id order, as SWEEP_COLUMNS tuples."""
        t = self.table
        query = (select(*(t.c[c] for c in SWEEP_COLUMNS))
                 .where(t.c.claim_id == claim_id, t.c.id >= low, t.c.id <= high).order_by(t.c.id))
        with self._errors("read swept messages"), self.engine.connect() as conn:
            for row in conn.execution_options(yield_per=chunk).execute(query):
                yield tuple(row)

    def leased_rows(self, claim_id: str, rows: Iterable[tuple]) -> LeasedRows:
        return LeasedRows(self, claim_id, rows)

    def finish_sweep(self, claim_id: str, status: str, summary: dict) -> int:
        """End a sweep: rows it still holds are released to the pump at once, its lease ends, its
        summary is kept. Returns how many rows were released."""
        t, s = self.table, self.sweeps
        now_us = to_us(self.clock())
        with self._errors("finish a sweep"), self.engine.begin() as conn:
            released = conn.execute(update(t).where(t.c.claim_id == claim_id).values(claim_id=None)).rowcount
            conn.execute(update(s).where(s.c.claim_id == claim_id).values(
                status=status, finished_at_us=now_us, lease_until_us=0,
                summary=json.dumps({**summary, "released": released}),
            ))
        return released

    def sweep_record(self, claim_id: str) -> dict | None:
        """A sweep's row: window, status, claimed and taken-over counts, and its summary."""
        s = self.sweeps
        with self._errors("read a sweep"), self.engine.connect() as conn:
            row = conn.execute(select(s).where(s.c.claim_id == claim_id)).first()
        if row is None:
            return None
        record = row._asdict()
        record["summary"] = None if record["summary"] is None else json.loads(record["summary"])
        return record

    # -- reads -----------------------------------------------------------------------------------
    def next_due(self, destination: str | None = None, due_before: datetime | None = None) -> datetime | None:
        t = self.table
        query = select(func.min(t.c.due_at_us)).where(self._unleased(to_us(self.clock())), *self._scope)
        if destination is not None:
            query = query.where(t.c.destination == destination)
        if due_before is not None:
            query = query.where(t.c.due_at_us < to_us(due_before))
        with self._errors("read the next due time"), self.engine.connect() as conn:
            value = conn.execute(query).scalar()
        return None if value is None else from_us(value)

    def count_scheduled(self, due_before: datetime | None = None, destination: str | None = None) -> dict[str, int]:
        t = self.table
        query = select(t.c.destination, func.count()).where(*self._scope).group_by(t.c.destination)
        if due_before is not None:
            query = query.where(t.c.due_at_us < to_us(due_before))
        if destination is not None:
            query = query.where(t.c.destination == destination)
        with self._errors("count scheduled messages"), self.engine.connect() as conn:
            return {dest: n for dest, n in conn.execute(query).all()}

    def get(self, message_id: str) -> DelayedMessage | None:
        """A stored message by id (for inspection and tests)."""
        t = self.table
        with self._errors("read a stored message"), self.engine.connect() as conn:
            row = conn.execute(select(t).where(t.c.message_id == message_id)).first()
        return None if row is None else _message(row)

    # -- waiting ---------------------------------------------------------------------------------
    def wait(self, until: datetime) -> None:
        """Sleep until `until`, returning early when a message due sooner is stored (LISTEN/NOTIFY on
        PostgreSQL, a short poll on SQLite). A lost listening connection is dropped and opened again on
        the next call; the caller re-reads the store in between, under its own circuit breaker."""
        remaining = (until - self.clock()).total_seconds()
        if remaining <= 0:
            return
        if not self.is_postgres:
            time.sleep(min(remaining, SQLITE_POLL_SECONDS))
            return
        if self._listener is None or self._listener.closed:
            try:
                self._listener = self._listen()
            except Exception as exc:  # the database is down: wait a little, the caller's breaker decides
                log.warning("could not LISTEN for new messages (%s); retrying", exc)
                time.sleep(min(remaining, 1.0))
            # A message stored before LISTEN took effect sent no notification we could see:
            # return so the caller reads the next due time again, now with the listener in place.
            return
        listener = self._listener
        until_us = to_us(until)
        deadline = time.monotonic() + remaining
        try:
            while (left := deadline - time.monotonic()) > 0:
                # Each notifies() runs to its end (one note or the timeout), leaving the connection idle.
                if [n for n in listener.notifies(timeout=left, stop_after=1) if _sooner(n, until_us)]:
                    return
        except Exception as exc:  # killed backend, restart, fail-over: listen again next time
            log.warning("lost the LISTEN connection (%s); listening again", exc)
            self._close_listener()

    async def wait_async(self, until: datetime) -> None:
        """`wait` for an event loop (a trigger): the same wake-ups, on psycopg's async connection."""
        remaining = (until - self.clock()).total_seconds()
        if remaining <= 0:
            return
        if not self.is_postgres:
            await asyncio.sleep(min(remaining, SQLITE_POLL_SECONDS))
            return
        if self._alistener is None or self._alistener.closed:
            try:
                self._alistener = await self._alisten()
            except Exception as exc:
                log.warning("could not LISTEN for new messages (%s); retrying", exc)
                await asyncio.sleep(min(remaining, 1.0))
            return
        until_us = to_us(until)
        deadline = time.monotonic() + remaining
        try:
            while (left := deadline - time.monotonic()) > 0:
                if [n async for n in self._alistener.notifies(timeout=left, stop_after=1) if _sooner(n, until_us)]:
                    return
        except Exception as exc:
            log.warning("lost the LISTEN connection (%s); listening again", exc)
            await self._alistener.close()
            self._alistener = None

    def _listen_url(self) -> str:
        return engine_url(self.url).set(drivername="postgresql").render_as_string(hide_password=False)

    def _listen(self):
        import psycopg  # only PostgreSQL stores get here

        conn = psycopg.connect(self._listen_url(), autocommit=True, **KEEPALIVES)
        conn.execute(f'LISTEN "{self.channel}"')  # channel is a hex digest with a fixed prefix
        return conn

    async def _alisten(self):
        import psycopg

        conn = await psycopg.AsyncConnection.connect(self._listen_url(), autocommit=True, **KEEPALIVES)
        await conn.execute(f'LISTEN "{self.channel}"')
        return conn

    def _close_listener(self) -> None:
        if self._listener is not None:
            try:
                self._listener.close()
            finally:
                self._listener = None

    def close(self) -> None:
        self._close_listener()

    async def aclose(self) -> None:
        if self._alistener is not None:
            await self._alistener.close()
            self._alistener = None
        self.close()


def _sooner(note, until_us: int) -> bool:
    """A notification of a message due before `until_us` (the payload is its due time in microseconds)."""
    return note.payload.isdigit() and int(note.payload) < until_us
