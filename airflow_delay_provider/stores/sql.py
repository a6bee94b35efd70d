"""The SQL delayed-message store (seed 001's external store, in batches): SQLite and PostgreSQL.

All SQL of the store is in this module. Times are integer microseconds since the epoch (UTC),
which compare and index the same way on every database.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Collection, Iterable, Iterator, Mapping, Sequence

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    delete,
    func,
    insert,
    inspect,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.ports import Claim, DelayedMessageStore
from airflow_delay_provider.stores.engine import (
    SqlDatabase,
    check_identifier,
    copy_rows,
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
        Index(f"ix_{name}_due", "due_at_us", "id"),
        schema=schema,
    )


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
        rows = [{**self._rows[m]._asdict(), **change} for m, change in changes.items()]
        self.connection.execute(insert(self._table), rows)
        self._unsettled.difference_update(changes)


def _message(row) -> DelayedMessage:
    headers = {} if row.headers == "{}" else json.loads(row.headers)
    return DelayedMessage.trusted(
        row.destination, bytes(row.body), from_us(row.due_at_us), headers, row.message_id, row.failures
    )


class SqlDelayedMessageStore(SqlDatabase, DelayedMessageStore):
    """Delayed messages in one table; claims lock rows (`FOR UPDATE SKIP LOCKED` on PostgreSQL)."""

    def __init__(self, url: URL | str, table: str = DEFAULT_TABLE, schema: str | None = None) -> None:
        self.table_name = check_identifier("table name", table)
        super().__init__(url, schema)
        self.table = store_table(MetaData(), self.table_name, self.schema)
        # Delivery policies per destination live beside the messages, so every pump sees the same.
        check_identifier("table name", f"{self.table_name}_policies")
        self.policy_table = Table(
            f"{self.table_name}_policies",
            self.table.metadata,
            Column("destination", String(255), primary_key=True),
            Column("policy", Text, nullable=False),
            schema=self.schema,
        )
        self.concurrent_claims = self.is_postgres  # SQLite locks the whole database per write transaction
        qualified = f"{self.schema}.{self.table_name}" if self.schema else self.table_name
        # LISTEN takes an identifier of at most 63 bytes; a hash keeps any schema.table pair within it.
        self.channel = "delay_" + hashlib.sha1(qualified.encode()).hexdigest()[:24]
        self._listener = None

    def __repr__(self) -> str:
        return f"SqlDelayedMessageStore({safe_url(self.url)!r}, table={self.table_name!r}, schema={self.schema!r})"

    # -- schema --------------------------------------------------------------------------------
    def create_schema(self) -> None:
        """Create the schema, tables and index if missing (idempotent, safe to run concurrently)."""
        self._create_tables(self.table.metadata, "the delay store tables")

    def set_policies(self, policies: Mapping[str, dict]) -> None:
        """Store each destination's delivery policy (seed 003 JSON), replacing what was there."""
        t = self.policy_table
        with self._errors("store delivery policies"), self.engine.begin() as conn:
            if policies:
                conn.execute(delete(t).where(t.c.destination.in_(list(policies))))
                conn.execute(insert(t), [{"destination": d, "policy": json.dumps(p)} for d, p in policies.items()])

    def policies(self) -> dict[str, dict]:
        t = self.policy_table
        with self._errors("read delivery policies"), self.engine.connect() as conn:
            return {d: json.loads(p) for d, p in conn.execute(select(t.c.destination, t.c.policy)).all()}

    def exists(self) -> bool:
        with self._errors("inspect the delay store"), self.engine.connect() as conn:
            return inspect(conn).has_table(self.table_name, schema=self.schema)

    # -- writes -----------------------------------------------------------------------------------
    def store(self, messages: Sequence[DelayedMessage]) -> int:
        if not messages:
            return 0
        now = to_us(utcnow())
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
        with self._errors("store delayed messages"), self.engine.begin() as conn:
            stored = self._insert_new(conn, rows)
            if self.is_postgres and stored:
                # Delivered at commit; wakes idle pumps that sleep past this due time.
                soonest = min(r["due_at_us"] for r in rows)
                conn.execute(select(func.pg_notify(self.channel, str(soonest))))
        return stored

    _COPY_COLUMNS = ("message_id", "destination", "body", "headers", "due_at_us", "stored_at_us", "failures")
    _COPY_TYPES = ("text", "text", "bytea", "text", "int8", "int8", "int4")

    def _insert_new(self, conn: Connection, rows: list[dict]) -> int:
        """Insert the rows whose message id is new (a retried task stores nothing twice); returns how many."""
        if self.is_postgres:
            from psycopg.errors import UniqueViolation

            try:
                with conn.begin_nested():  # COPY is the fast way, for the usual case of all-new ids
                    copy_rows(conn, self.table, self._COPY_COLUMNS, self._COPY_TYPES,
                              ([r[c] for c in self._COPY_COLUMNS] for r in rows))
                return len(rows)
            except UniqueViolation:
                pass
        insert = (postgresql.insert if self.is_postgres else sqlite.insert)(self.table)
        stmt = insert.on_conflict_do_nothing(index_elements=["message_id"]).returning(self.table.c.id)
        return len(conn.execute(stmt, rows).all())

    @contextmanager
    def claim_due(
        self, now: datetime, limit: int, due_before: datetime | None = None, exclude: Collection[str] = ()
    ) -> Iterator[Claim]:
        t = self.table
        due = select(t.c.id).where(t.c.due_at_us <= to_us(now))
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

    # -- reads -----------------------------------------------------------------------------------
    def next_due(self, destination: str | None = None, due_before: datetime | None = None) -> datetime | None:
        t = self.table
        query = select(func.min(t.c.due_at_us))
        if destination is not None:
            query = query.where(t.c.destination == destination)
        if due_before is not None:
            query = query.where(t.c.due_at_us < to_us(due_before))
        with self._errors("read the next due time"), self.engine.connect() as conn:
            value = conn.execute(query).scalar()
        return None if value is None else from_us(value)

    def count_scheduled(self, due_before: datetime | None = None, destination: str | None = None) -> dict[str, int]:
        t = self.table
        query = select(t.c.destination, func.count()).group_by(t.c.destination)
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
        remaining = (until - utcnow()).total_seconds()
        if remaining <= 0:
            return
        if not self.is_postgres:
            time.sleep(min(remaining, SQLITE_POLL_SECONDS))
            return
        if self._listener is None or self._listener.closed:
            try:
                self._listener = self._listen()
            except Exception as exc:  # fall back to polling; the pump re-checks after each wake-up
                log.warning("LISTEN failed (%s); polling instead", exc)
                time.sleep(min(remaining, 1.0))
            # A message stored before LISTEN took effect sent no notification we could see:
            # return so the caller reads the next due time again, now with the listener in place.
            return
        listener = self._listener
        until_us = to_us(until)
        deadline = time.monotonic() + remaining
        while (left := deadline - time.monotonic()) > 0:
            for note in listener.notifies(timeout=left, stop_after=1):
                if note.payload.isdigit() and int(note.payload) < until_us:
                    return
                break

    def _listen(self):
        import psycopg  # only PostgreSQL stores get here

        url = self.url.set(drivername="postgresql")
        conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
        conn.execute(f'LISTEN "{self.channel}"')  # channel is a hex digest with a fixed prefix
        return conn

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
