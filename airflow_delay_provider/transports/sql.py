"""Queues as SQL tables: the embedded default transport (SQLite or PostgreSQL).

Every queue's messages live in one table, keyed by queue name, beside a registry of provisioned
queues. A message is visible, in flight (received, hidden until its visibility timeout) or
deleted (acked): a queue message's lifecycle. When the delayed-message store is in the same database
the pump inserts here inside its claim transaction, so dispatch is exactly once.

Every time written or compared here (enqueued, visible, provisioned) is on the database's clock, as
`move_due` writes it inside the database: senders and receivers on hosts whose clocks differ agree
on when a message is visible.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

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
    any_,
    bindparam,
    case,
    cast,
    delete,
    func,
    insert,
    inspect,
    literal,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection
from sqlalchemy.sql.expression import CTE, ColumnElement, Select

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import DelayProviderError, DestinationNotFoundError, InvalidNameError
from airflow_delay_provider.core.message import DelayedMessage, check_destination
from airflow_delay_provider.core.ports import DelayedMessageStore, ReceivedMessage, Transport
from airflow_delay_provider.stores.claims import NOW_US
from airflow_delay_provider.stores.engine import (
    IndexStart,
    SqlDatabase,
    check_identifier,
    copy_rows,
    safe_url,
    translate_errors,
)
from airflow_delay_provider.stores.migrations import SchemaMigrations, VersionedTables
from airflow_delay_provider.stores.sql import LeasedRows, SqlDelayedMessageStore, from_us, to_us
from airflow_delay_provider.stores.tables import ID_TYPE, versions_table
from airflow_delay_provider.stores.upkeep import TableUpkeep

if TYPE_CHECKING:  # Python 3.10 has no typing.Unpack, nor the star in a subscript
    from typing import TypeAlias

    from typing_extensions import Unpack

    #: A SELECT of any columns.
    Rows: TypeAlias = Select[Unpack[tuple[Any, ...]]]

#: The queue tables' migrations.
QUEUE_SCHEMA = "airflow_delay_provider.transports.queue_schema"
#: The longest name of the queue tables after the prefix.
_LONGEST = "queue_messages"

# Column order of the rows _insert builds (COPY on PostgreSQL, executemany elsewhere).
_COPY_COLUMNS = ("queue", "message_id", "body", "headers", "due_at_us", "enqueued_at_us", "visible_at_us")
_COPY_TYPES = ("text", "text", "bytea", "text", "int8", "int8", "int8")


class SqlTableTransport(SqlDatabase, Transport):
    name = "sql"

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> SqlTableTransport:
        """From the plain data of DelayStoreHook.transport_spec() (a process without Airflow)."""
        return cls(spec["url"], schema=spec.get("schema"), table_prefix=spec.get("table_prefix", "delay_"))

    def __init__(self, url: URL | str, schema: str | None = None, table_prefix: str = "delay_",
                 local_clock: Callable[[], datetime] = utcnow) -> None:
        check_identifier("table prefix", table_prefix + "queues")
        if len(table_prefix + _LONGEST) > 63:
            raise InvalidNameError(f"table prefix {table_prefix!r} is too long: at most {63 - len(_LONGEST)} "
                                   f"characters, since the tables are named <prefix>{_LONGEST} (63 characters at most)")
        super().__init__(url, schema, local_clock)
        md = MetaData()
        self.queues = Table(
            f"{table_prefix}queues",
            md,
            Column("name", String(255), primary_key=True),
            Column("created_at_us", BigInteger, nullable=False),
            schema=self.schema,
        )
        self.messages = Table(
            f"{table_prefix}queue_messages",
            md,
            Column("seq", ID_TYPE, primary_key=True, autoincrement=True),
            Column("queue", String(255), nullable=False),
            Column("message_id", String(200), nullable=False),
            Column("body", LargeBinary, nullable=False),
            Column("headers", Text, nullable=False),
            Column("due_at_us", BigInteger),
            Column("enqueued_at_us", BigInteger, nullable=False),
            Column("visible_at_us", BigInteger, nullable=False),
            Column("receive_count", Integer, nullable=False, server_default="0"),
            # A queue's messages in queue order: a receive walks it, passing over the few in flight, and stops at
            # the first `max_messages` visible ones. (An index led by the visibility time would make it read and
            # sort every visible message first, so a consumer that falls behind would slow down further.)
            Index(f"ix_{table_prefix}queue_messages_order", "queue", "seq"),
            schema=self.schema,
        )
        #: Per queue: where its receives start (see `_start_of`).
        self._starts: dict[str, IndexStart] = {}
        self._receive: Any = None  # the receive's statement, built once (`_taking`)
        self._sequence: str | None = None
        # Receives update and acks delete, so the queue table churns as the store does (stores/upkeep.py).
        self.maintenance = TableUpkeep(self, kept=lambda: (self.messages,))
        preparer = self.engine.dialect.identifier_preparer
        where = ".".join(filter(None, (self.schema, self.queues.name)))
        self.migrations = SchemaMigrations(self, VersionedTables(
            package=QUEUE_SCHEMA, kind="delay queue", label=f"SQL-table queues {where}",
            versions=versions_table(MetaData(), f"{table_prefix}queue_versions", self.schema),
            tables=(self.queues, self.messages), refuse_hint="choose another `table_prefix` (or schema) for the queues",
            # Provisioning the queues creates these tables; errors about them say to run it.
            noun=("the SQL-table queues", True), table_option=False,
            creates="run the provisioning DAG (its ProvisionDelayInfrastructureOperator creates them with the queues)",
            names={"queues": self.qualified(self.queues.name), "messages": self.qualified(self.messages.name),
                   # Index names live in the table's schema on PostgreSQL and may not be qualified there.
                   "ix_order": preparer.quote_identifier(str(next(iter(self.messages.indexes)).name)),
                   # The index tables of earlier releases had instead (dropped by name: qualified).
                   "ix_visible": self.qualified(f"ix_{table_prefix}queue_messages_visible"),
                   "id_type": "BIGSERIAL" if self.is_postgres else "INTEGER",
                   "bytes_type": "BYTEA" if self.is_postgres else "BLOB"},
            before=self.maintenance.stop,
        ))

    def __repr__(self) -> str:
        return f"SqlTableTransport({safe_url(self.url)!r}, schema={self.schema!r})"

    def use_clock(self, clock: Callable[[], datetime]) -> SqlTableTransport:
        """Changes nothing: this transport has no remaining delay to count (a message is visible once sent), and its
        enqueue and visibility times stay on its database's clock (`clock()`), the one every sender, receiver and
        `move_due` of its tables shares, whatever clock the caller keeps due times on."""
        return self

    def create_schema(self) -> None:
        """Create the queue tables, or bring those of an earlier release up to date (versioned migrations, as the
        store's): idempotent, cheap when up to date, safe to run concurrently."""
        self.migrations.migrate()

    def check_ready(self) -> None:
        """StoreNotReadyError, saying what to run, while the queue tables are not there (a dispatcher started
        before provisioning waits on it); cheap once they are. Tables of an earlier release are used as they are."""
        self.migrations.require(current=False)

    def schema_problem(self) -> DelayProviderError | None:
        return self.migrations.problem()

    def upkeep(self) -> None:
        self.maintenance.start()

    def provision(self, endpoint: str) -> dict[str, Any]:
        check_destination(endpoint)
        self.create_schema()
        stmt = (postgresql.insert if self.is_postgres else sqlite.insert)(self.queues)
        stmt = stmt.on_conflict_do_nothing(index_elements=["name"])
        with self.errors(f"provision queue {endpoint!r}"), self.engine.begin() as conn:
            # The row it inserted, if any: rowcount of a single-row INSERT is not reliable across drivers
            # (psycopg reported none for the first queue on a new database).
            created = conn.execute(stmt.returning(self.queues.c.name),
                                   {"name": endpoint, "created_at_us": to_us(self.clock())}).first() is not None
        return {"transport": self.name, "endpoint": endpoint, "created": created}

    def verify(self, endpoints: Iterable[str] = ()) -> dict[str, Any]:
        """Which queues provisioning would create, changing nothing."""
        wanted = list(endpoints)
        with self.errors("inspect the queue tables"), self.engine.connect() as conn:
            if not inspect(conn).has_table(self.queues.name, schema=self.schema):
                found: set[str] = set()
            else:
                found = set(conn.execute(select(self.queues.c.name).where(self.queues.c.name.in_(wanted))).scalars())
        missing = [e for e in wanted if e not in found]
        return {"complete": not missing, "missing": missing, "different": [], "ok": sorted(found)}

    def teardown(self, endpoint: str) -> int:
        """Remove a queue and the messages in it; later sends to it are dead-lettered as not found."""
        with self.errors(f"tear down queue {endpoint!r}"), self.engine.begin() as conn:
            conn.execute(delete(self.queues).where(self.queues.c.name == endpoint))
            return conn.execute(delete(self.messages).where(self.messages.c.queue == endpoint)).rowcount

    def joins(self, store: DelayedMessageStore) -> bool:
        return isinstance(store, (SqlDelayedMessageStore, LeasedRows)) and store.engine is self.engine

    def moves_from(self, store: DelayedMessageStore) -> bool:
        return isinstance(store, SqlDelayedMessageStore) and store.engine is self.engine and self.is_postgres

    def move_due(self, store: DelayedMessageStore, now: datetime, limit: int, due_before: datetime | None = None,
                 exclude: Collection[str] = ()) -> list[tuple[str, datetime, int]]:
        """One statement deletes the due rows of provisioned queues from the store and inserts them into the
        queue table (`WITH claimed AS (DELETE ... RETURNING ...) INSERT ... SELECT FROM claimed`): the claim and
        the send of the pump's exactly-once path, without the rows coming to Python and going back."""
        assert isinstance(store, SqlDelayedMessageStore)
        claims = store.claims
        soon_only = claims.claims_soon_only(now)
        values = claims.due_values(now, limit, due_before, soon_only)
        with store.errors("move due messages into their queues"), store.engine.begin() as conn:
            store.in_index_order(conn)
            recorded = store.history.on(conn)

            def moving() -> Rows:
                ids = self.provisioned(store, claims.due_query(soon_only, due_before is not None, exclude))
                return self._moving(store, conn, claims.taken(conn, ids, soon_only, values), NOW_US)[1]

            # Built once per shape (and queue table), run with the values of each batch.
            key = ("move", self.messages, soon_only, due_before is not None, frozenset(exclude), recorded)
            moved = claims.run(conn, key, moving, values, soon_only)
            return [(queue, from_us(due_us), n) for queue, due_us, n in moved]

    def move_window(self, store: SqlDelayedMessageStore, claim_id: str, low: int, high: int, limit: int,
                    exclude: Collection[str] = ()) -> tuple[list[tuple[str, datetime, int]], int] | None:
        """move_due for a sweep's partition: up to `limit` rows of the running sweep's window with
        low <= id <= high (free, or under another sweep's expired lease), leased and moved in one statement that
        adds them to the sweep's claimed and taken-over counts, so no lease is written row by row. Returns the
        moved groups and how many were taken over; None when the sweep is not running (nothing is moved)."""
        ids = store.leases.leasable_ids(claim_id, low, high, limit, exclude)
        if ids is None:
            return None
        with store.errors("move a sweep's messages into their queues"), store.engine.connect() as conn, \
                conn.begin() as tx:
            claimed, counts = self._moving(store, conn, store.taken(conn, self.provisioned(store, ids)),
                                           literal(to_us(store.clock()), BigInteger))
            total = select(func.count()).select_from(claimed).scalar_subquery()
            taken = (select(func.count()).select_from(claimed).where(claimed.c.claim_id.is_not(None))
                     .scalar_subquery())
            counted = store.leases.count_leased(claim_id, total, taken).cte("counted")
            counts = counts.add_columns(select(func.count()).select_from(counted).scalar_subquery(), taken)
            rows = conn.execute(counts).all()
            if rows and rows[0][3] == 0:  # the sweep finished meanwhile: its window is no longer its to move
                tx.rollback()
                return None
        return [(queue, from_us(due_us), n) for queue, due_us, n, _, _ in rows], (rows[0][4] if rows else 0)

    def provisioned(self, store: SqlDelayedMessageStore, ids: Select[int]) -> Select[int]:
        """`ids` less the rows of destinations that have no queue here: a claim dead-letters those."""
        # `= ANY(ARRAY(...))` is a filter on the due index's ordered scan; with `IN (SELECT ...)` the planner may
        # hash-join every due row and sort them all for a batch of 16, which it did with statistics gathered
        # before the due rows were stored.
        t = store.tables.messages
        return ids.where(t.c.destination == any_(func.array(select(self.queues.c.name).scalar_subquery())))

    def _moving(self, store: SqlDelayedMessageStore, conn: Connection, taken: ColumnElement[bool],
                now_us: ColumnElement[int]) -> tuple[CTE, Rows]:
        """The move of the rows `taken` finds (`store.taken` of `provisioned` ids): the CTE of the rows deleted
        from the store, and the statement inserting them into the queue table that returns (queue, due time,
        count)."""
        t, q = store.tables.messages, self.messages
        claimed = (delete(t).where(taken)
                   .returning(t.c.id, t.c.destination, t.c.message_id, t.c.body, t.c.headers, t.c.due_at_us,
                              t.c.claim_id, t.c.stored_at_us, t.c.failures)
                   .cte("claimed"))
        # Enqueued when inserted, on the database's clock, and never before the claim's moment (so never before
        # a moved message's due time, whatever the offset between this host's clock and the database's).
        enqueued = func.greatest(now_us, _database_now_us())
        rows = select(claimed.c.destination, claimed.c.message_id, claimed.c.body, claimed.c.headers,
                      claimed.c.due_at_us, enqueued, enqueued).order_by(claimed.c.due_at_us, claimed.c.id)
        # Queue order (seq) is due order, as when the pump inserts a claimed batch itself.
        moved = insert(q).from_select(_COPY_COLUMNS, rows).returning(q.c.queue, q.c.due_at_us).cte("moved")
        # Counted per queue and due time in the database: a burst due at one instant comes back as one row.
        groups = (moved.c.queue, moved.c.due_at_us)
        counts = select(*groups, func.count()).group_by(*groups)
        recorded = store.history.moved_from(conn, claimed, enqueued)  # the delivery history, in the same statement
        return claimed, counts if recorded is None else counts.add_cte(recorded.cte("recorded"))

    def send(self, messages: Sequence[DelayedMessage], connection: Any = None) -> dict[str, Exception]:
        if not messages:
            return {}
        if connection is not None:
            # A savepoint keeps a failed insert from aborting the store's claim transaction; its errors say what
            # failed without the statement (which carries the messages' values).
            with translate_errors(self.url, "send to SQL queues"), connection.begin_nested():
                return self._insert(connection, messages)
        with self.errors("send to SQL queues"), self.engine.begin() as conn:
            return self._insert(conn, messages)

    def _insert(self, conn: Connection, messages: Sequence[DelayedMessage]) -> dict[str, Exception]:
        wanted = {m.destination for m in messages}
        known = set(conn.execute(select(self.queues.c.name).where(self.queues.c.name.in_(wanted))).scalars())
        failures: dict[str, Exception] = {}
        now = to_us(self.clock())
        rows = []
        for m in messages:
            if m.destination not in known:
                failures[m.message_id] = DestinationNotFoundError(
                    f"queue {m.destination!r} does not exist; provision it first (ProvisionDelayInfrastructureOperator "
                    "or SqlTableTransport.provision)"
                )
                continue
            headers = json.dumps(m.headers, separators=(",", ":")) if m.headers else "{}"
            # A due message is enqueued after the claim that found it due on the store's estimate of this clock,
            # which may lead this object's estimate by the round trip each was measured over: never stamped earlier.
            enqueued = max(now, to_us(m.due_at))
            rows.append((m.destination, m.message_id, m.body, headers, to_us(m.due_at), enqueued, enqueued))
        if rows and self.is_postgres:
            copy_rows(conn, self.messages, _COPY_COLUMNS, _COPY_TYPES, rows)
        elif rows:
            conn.execute(insert(self.messages), [dict(zip(_COPY_COLUMNS, row, strict=False)) for row in rows])
        return failures

    def _now_us(self, now: datetime) -> ColumnElement[int] | int:
        """Now, for comparing visibility times. On PostgreSQL the database's clock as the statement starts: a move
        stamps rows with the database's clock, and this process's estimate of it lags by up to a round trip."""
        return _statement_now_us() if self.is_postgres else to_us(now)

    def receive(self, endpoint: str, max_messages: int = 10, visibility_timeout: float = 30.0) -> list[ReceivedMessage]:
        self.upkeep()  # consumers call this in a loop: their process looks after the table if no pump does
        now = self.clock()
        values = {_QUEUE.key: endpoint, _LIMIT.key: max_messages, _NOW_US.key: to_us(now),
                  _HIDDEN_US.key: to_us(now + timedelta(seconds=visibility_timeout))}
        with self.errors(f"receive from queue {endpoint!r}"), self.engine.begin() as conn:
            self.in_index_order(conn)
            values[_START.key] = self._start_of(conn, endpoint, now) if self.is_postgres else 0
            rows = sorted(self.run_prepared(conn, self._taking(), values), key=lambda r: r.seq)  # RETURNING: no order
        return [_received(r, receipt=r.seq, receive_count=r.receive_count) for r in rows]

    def _taking(self) -> Any:
        """The receive: one statement hides the oldest visible messages (`_receiving`) for the visibility timeout,
        counts the receive and returns them, built once and prepared. A SELECT, then an UPDATE of what it locked,
        took a round trip more and a millisecond of this process between them, for each batch of a consumer."""
        if self._receive is None:
            t = self.messages
            seqs = self._receiving_query().with_only_columns(t.c.seq).scalar_subquery()
            taken = t.c.seq == any_(func.array(seqs)) if self.is_postgres else t.c.seq.in_(seqs)
            self._receive = (update(t).where(taken)
                             .values(visible_at_us=_HIDDEN_US, receive_count=t.c.receive_count + 1).returning(*t.c))
        return self._receive

    def _start_of(self, conn: Connection, endpoint: str, now: datetime) -> int:
        """Where a receive starts reading the queue (engine.IndexStart): the first seq that is visible or turns
        visible before the next full reading, and the queue sequence's value as the mark."""
        if self._sequence is None:
            self._sequence = conn.execute(select(func.pg_get_serial_sequence(self.qualified(self.messages.name),
                                                                             "seq"))).scalar()
            if self._sequence is None:  # not a table this class created: read it from the beginning, as before
                return 0
        t = self.messages

        def read(walk_from: int, look_ahead: float) -> tuple[int | None, int]:
            soon = self._now_us(now) + int(look_ahead * 1_000_000)
            first = conn.execute(select(t.c.seq).where(t.c.queue == endpoint, t.c.visible_at_us <= soon,
                                                       t.c.seq >= walk_from).order_by(t.c.seq).limit(1)).scalar()
            # The last seq handed out, committed or not (a sequence is not transactional); its name comes quoted.
            # (A sequence always has a last_value: typing.cast, as sqlalchemy's `cast` is SQL's CAST here.)
            last = typing.cast(int, conn.exec_driver_sql(f"SELECT last_value FROM {self._sequence}").scalar())
            return first, last

        return self._starts.setdefault(endpoint, IndexStart()).current(read)

    def _visible_in_order(self, endpoint: str | ColumnElement[str], max_messages: int | ColumnElement[int],
                          now_us: int | ColumnElement[int]) -> Rows:
        """The oldest messages of the queue visible at `now_us` (values or parameters)."""
        t = self.messages
        return select(t).where(t.c.queue == endpoint, t.c.visible_at_us <= now_us).order_by(t.c.seq).limit(max_messages)

    def _receiving(self, endpoint: str, max_messages: int, now: datetime, start: int = 0) -> Rows:
        """The oldest visible messages of the queue from seq `start` on, locked (those another receive holds are
        skipped): `_receiving_query` with these values."""
        return self._receiving_query().params({_QUEUE.key: endpoint, _LIMIT.key: max_messages, _START.key: start,
                                               _NOW_US.key: to_us(now)})

    def _receiving_query(self) -> Rows:
        """`_receiving` with its values as parameters (_QUEUE, _LIMIT, _START and, on SQLite, _NOW_US)."""
        query = self._visible_in_order(_QUEUE, _LIMIT, _statement_now_us() if self.is_postgres else _NOW_US)
        # The start always there (seqs start at 1): one statement whether or not it is known, so the receive after a
        # consumer's wait is not compiled and planned afresh (as the store's claims, stores/claims.py `due_ids`).
        return query.with_for_update(skip_locked=True).where(self.messages.c.seq >= _START)

    can_peek = True

    def peek(self, endpoint: str, max_messages: int = 10) -> list[ReceivedMessage]:
        """A plain SELECT of the visible messages, oldest first: nothing is locked, hidden or counted."""
        query = self._visible_in_order(endpoint, max_messages, self._now_us(self.clock()))
        with self.errors(f"peek at queue {endpoint!r}"), self.engine.connect() as conn:
            self._require_queue(conn, endpoint)
            self.in_index_order(conn)  # as a receive reads it: the batch, not every visible message sorted
            rows = conn.execute(query).all()
        return [_received(r, receipt=None, receive_count=r.receive_count) for r in rows]

    def release(self, endpoint: str, receipts: Iterable[Any]) -> int:
        """Make received, unacked messages visible again now (as if their visibility timeout ended)."""
        seqs = [int(r) for r in receipts]
        if not seqs:
            return 0
        t = self.messages
        with self.errors(f"release messages of queue {endpoint!r}"), self.engine.begin() as conn:
            released = conn.execute(update(t).where(t.c.queue == endpoint, t.c.seq.in_(seqs))
                                    .values(visible_at_us=to_us(self.clock()))).rowcount
        if endpoint in self._starts:  # this consumer's next receive finds them at once
            self._starts[endpoint].lower(min(seqs))
        return released

    def ack(self, endpoint: str, receipts: Iterable[Any]) -> int:
        seqs = [int(r) for r in receipts]
        if not seqs:
            return 0
        t = self.messages
        with self.errors(f"ack messages of queue {endpoint!r}"), self.engine.begin() as conn:
            return conn.execute(delete(t).where(t.c.queue == endpoint, t.c.seq.in_(seqs))).rowcount

    def depth(self, endpoint: str) -> dict[str, int]:
        """Messages in the queue by lifecycle state: visible, and in flight (received, not yet acked).
        DestinationNotFoundError for a queue never provisioned, as a broker says (a redrive checks it)."""
        t = self.messages
        now = self._now_us(self.clock())
        query = select(
            func.count(case((t.c.visible_at_us <= now, 1))),
            func.count(case((t.c.visible_at_us > now, 1))),
        ).where(t.c.queue == endpoint)
        with self.errors(f"read the depth of queue {endpoint!r}"), self.engine.connect() as conn:
            self._require_queue(conn, endpoint)
            visible, in_flight = conn.execute(query).one()
        return {"visible": visible, "in_flight": in_flight}

    def _require_queue(self, conn: Any, endpoint: str) -> None:
        # A queue never provisioned (no queue tables at all, on a new store) is missing, as a broker says.
        q = self.queues
        if not inspect(conn).has_table(q.name, schema=self.schema) or conn.execute(
                select(q.c.name).where(q.c.name == endpoint)).first() is None:
            raise DestinationNotFoundError(f"queue {endpoint!r} does not exist (it was never provisioned)")


#: The values a receive runs with: the queue, how many, where its scan starts, now (SQLite's; PostgreSQL reads its
#: own clock) and until when what it takes is hidden.
_QUEUE = bindparam("receive_queue", type_=String)
_LIMIT = bindparam("receive_limit", type_=Integer)
_START = bindparam("receive_start", type_=BigInteger)
_NOW_US = bindparam("receive_now_us", type_=BigInteger)
_HIDDEN_US = bindparam("receive_hidden_us", type_=BigInteger)


def _received(r: Any, receipt: Any, receive_count: int) -> ReceivedMessage:
    return ReceivedMessage(
        message_id=r.message_id,
        destination=r.queue,
        body=r.body,
        headers=json.loads(r.headers),
        receipt=receipt,
        enqueued_at=from_us(r.enqueued_at_us),
        due_at=None if r.due_at_us is None else from_us(r.due_at_us),
        receive_count=receive_count,
    )


def _statement_now_us() -> ColumnElement[int]:
    """PostgreSQL's clock as the statement started, in microseconds."""
    return cast(func.extract("epoch", func.statement_timestamp()) * 1_000_000, BigInteger)


def _database_now_us() -> ColumnElement[int]:
    """PostgreSQL's clock at the moment the statement reads it, in microseconds."""
    return cast(func.extract("epoch", func.clock_timestamp()) * 1_000_000, BigInteger)
