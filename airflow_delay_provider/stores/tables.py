"""The store's tables and the value rules every part of it shares.

The tables are declared here once, as SQLAlchemy metadata the queries are built from; the numbered SQL files in
`schema/` create and upgrade them, and a test checks that the two agree (columns, nullability, indexes).

Times are integer microseconds since the epoch (UTC), which compare and index the same way on every
database.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Column,
    ColumnElement,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    and_,
    case,
    cast,
    func,
    literal_column,
    or_,
    select,
)

from airflow_delay_provider.core.delays import from_us as from_us  # the store's names for them too
from airflow_delay_provider.core.delays import to_us as to_us
from airflow_delay_provider.core.errors import InvalidInputError, InvalidNameError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.engine import Database, check_identifier

DEFAULT_TABLE = "delayed_messages"
#: Destinations under this prefix are handed to Airflow as trigger events (asset watchers), never dispatched.
EVENT_PREFIX = "airflow.asset."
#: One BIGINT primary key that autoincrements on both SQLite (as the rowid) and PostgreSQL (the store's and the
#: SQL-table queues' tables).
ID_TYPE = BigInteger().with_variant(Integer, "sqlite")


#: On PostgreSQL the messages table is partitioned in two by `tier` (schema version 8): messages due within this
#: long (microseconds) go to `<table>_soon`, where every claim, send and vacuum works, and those due later to
#: `<table>_later`, from which the store moves them into `_soon` when they come within this long of their due time
#: (stores/tiers.py). A minute: the move looks every 5 s, so a row is in `_soon` a dozen moves before it is due,
#: and `_soon` holds about a minute of messages (a soak's first run with five minutes held 486,000 rows there).
SOON_US = 60_000_000
#: `tier` of the partition of messages due soon.
SOON = 0
#: `tier` of the messages due later: all of `<table>_later` on schema version 8; from version 9, those due beyond
#: the hourly partitions' reach (`<table>_far`).
LATER = 1
#: From schema version 9 `<table>_later` is itself partitioned by `tier`: `<table>_far` (LATER) and `RING_HOURS`
#: partitions `<table>_hour00` ... of the messages due in one hour each, used in turn (tier `FIRST_HOUR` +
#: the due hour modulo `RING_HOURS`). Messages due in the current hour and the next `RING_HOURS - 2` go to their
#: hour's partition; the hour just past rests, empty, until the store truncates it (stores/tiers.py). So each
#: move empties one partition of an hour's messages instead of spreading dead rows over all of `_later`.
HOUR_US = 3_600_000_000
RING_HOURS = 26
FIRST_HOUR = 2
#: `tier` of the messages paused by a filter (schema version 14): `<table>_held` on PostgreSQL, the column's value on
#: SQLite. Claims, leases and the move never take them; a resume gives each row the tier its due time says.
HELD = -1
#: The schema version from which a store can hold messages.
HELD_VERSION = 14


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def hour_tier(due_at_us: int) -> int:
    """The `tier` of the hourly partition of a message due at `due_at_us` (schema version 9)."""
    return FIRST_HOUR + (due_at_us // HOUR_US) % RING_HOURS


def ring_until(now_us: int) -> int:
    """Messages written at `now_us` due before this go to the hourly partitions, later ones to `_far`: the hours
    from the current one to `RING_HOURS - 2` ahead (a day and more), leaving the hour just past to rest."""
    return (now_us // HOUR_US + RING_HOURS - 1) * HOUR_US


def tier_of(due_at_us: int, now_us: int, ring: bool = False) -> int:
    """The partition a message due at `due_at_us` goes to when it is written at `now_us`.

    :param ring: the store has the hourly partitions (schema version 9 on)."""
    if due_at_us <= now_us + SOON_US:
        return SOON
    return hour_tier(due_at_us) if ring and due_at_us < ring_until(now_us) else LATER


def hour_tier_rows(due_at_us: ColumnElement[int]) -> ColumnElement[int]:
    """`hour_tier` in SQL (literals only: the move renders it into its statement's text)."""
    return cast(literal_column(str(FIRST_HOUR)) + func.mod(func.div(due_at_us, literal_column(str(HOUR_US))),
                                                           literal_column(str(RING_HOURS))), SmallInteger)


def tier_of_rows(due_at_us: ColumnElement[int], now_us: int, ring: bool = False) -> ColumnElement[int]:
    """`tier_of` in SQL, for rows written again at `now_us`."""
    later: Any = LATER
    if ring:
        later = case((due_at_us < ring_until(now_us), hour_tier_rows(due_at_us)), else_=LATER)
    return case((due_at_us > now_us + SOON_US, later), else_=SOON)


def _message_columns() -> list[Column[Any]]:
    return [
        Column("id", ID_TYPE, primary_key=True, autoincrement=True),
        Column("message_id", String(200), nullable=False, unique=True),
        Column("destination", String(255), nullable=False),
        Column("body", LargeBinary, nullable=False),
        Column("headers", Text, nullable=False),
        Column("due_at_us", BigInteger, nullable=False),
        Column("stored_at_us", BigInteger, nullable=False),
        Column("failures", Integer, nullable=False, server_default="0"),
        # Set while a bulk sweep holds the row; the lease in the sweeps table says until when.
        Column("claim_id", String(64), nullable=True),
        # SOON or LATER: the partition the row is in (PostgreSQL; always SOON on SQLite, which keeps one table).
        Column("tier", SmallInteger, nullable=False, server_default="0"),
    ]


def store_table(metadata: MetaData, name: str, schema: str | None) -> Table:
    return Table(
        name,
        metadata,
        *_message_columns(),
        Index(f"ix_{name}_due", "due_at_us", "id"),
        schema=schema,
    )


def partition_table(name: str, schema: str | None) -> Table:
    """One of the two partitions of the messages table on PostgreSQL (`<table>_soon`, `<table>_later`): the unique
    indexes on `id` and `message_id` are each partition's (PostgreSQL allows no unique index on the partitioned
    table that lacks `tier`), the due index is the partitioned table's."""
    return Table(name, MetaData(), *_message_columns(), schema=schema)


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


def _per_destination(metadata: MetaData, name: str, schema: str | None, *columns: Column[Any]) -> Table:
    """A table of one row per destination, beside the messages, so every pump of the store sees the same."""
    return Table(name, metadata, Column("destination", String(255), primary_key=True), *columns, schema=schema)


def throttle_table(metadata: MetaData, store_table_name: str, schema: str | None) -> Table:
    """One token bucket per throttled destination, shared by every pump of the store."""
    return _per_destination(metadata, f"{store_table_name}_throttle", schema,
                            Column("tokens", Float, nullable=False), Column("updated_us", BigInteger, nullable=False))


def queue_delays_table(metadata: MetaData, store_table_name: str, schema: str | None) -> Table:
    """Each destination's queue-level delay, set when it is provisioned: every send path applies it
    to messages that have no delay of their own, so two senders to one destination cannot disagree."""
    return _per_destination(metadata, f"{store_table_name}_delays", schema,
                            Column("queue_delay_seconds", Integer, nullable=False))


def destinations_table(metadata: MetaData, store_table_name: str, schema: str | None) -> Table:
    """Every destination the store has taken messages for or provisioned, and its pause state."""
    return _per_destination(metadata, f"{store_table_name}_dests", schema,
                            Column("registered_at_us", BigInteger, nullable=False),
                            Column("paused_at_us", BigInteger, nullable=True))


def policies_table(metadata: MetaData, store_table_name: str, schema: str | None) -> Table:
    """Each destination's delivery policy (delivery-policy JSON)."""
    return _per_destination(metadata, f"{store_table_name}_policies", schema, Column("policy", Text, nullable=False))


#: The width of a counted slot of due times (`<table>_counts`): ten minutes, in microseconds (schema version 7;
#: the counting function in the database divides by the same number).
COUNT_SLOT_US = 600_000_000


def counts_table(metadata: MetaData, store_table_name: str, schema: str | None) -> Table:
    """Messages stored per destination and slot of due time (COUNT_SLOT_US), as rows of changes that add up (PostgreSQL;
    written by triggers, summed up by the store's upkeep)."""
    return Table(
        f"{store_table_name}_counts",
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=True),
        Column("destination", String(255), nullable=False),
        Column("slot", BigInteger, nullable=False),
        Column("n", BigInteger, nullable=False),
        schema=schema,
    )


def routes_table(metadata: MetaData, store_table_name: str, schema: str | None) -> Table:
    """Each transport, connection and error queue the store's messages go through (stores/routes.py)."""
    return Table(
        f"{store_table_name}_routes",
        metadata,
        Column("transport", String(16), primary_key=True),
        Column("conn_id", String(250), primary_key=True),  # "" for the transport's default connection
        Column("error_queue", String(255), primary_key=True),
        Column("scope", Text, nullable=False),
        Column("seen_at_us", BigInteger, nullable=False),
        schema=schema,
    )


def history_table(store_table_name: str, schema: str | None, batches: bool) -> Table:
    """What became of each message a pump settled or a cancel removed (core/history.py): never a body.

    On PostgreSQL (`batches`) one row per batch, destination, outcome and failure, with the messages in arrays (ids,
    due times, attempts, stored times): a row per message cost the pump a fifth of its rate, an index on the ids
    another fifth (measured: docs/benchmarks/history.md). It is partitioned by the day of `handed_at_us`
    (stores/history.py), so a day past the retention is dropped, not deleted. On SQLite one row per message."""
    name = f"{store_table_name}_history"
    short = hashlib.sha1(f"{schema}.{name}".encode()).hexdigest()[:16]  # <table>_history_... may exceed 63
    common = (Column("handed_at_us", BigInteger, nullable=False), Column("destination", String(255), nullable=False),
              Column("outcome", String(16), nullable=False), Column("detail", Text, nullable=True))
    if batches:
        return Table(
            name, MetaData(), *common,
            Column("seq", BigInteger, nullable=False),  # insertion order, for rows of one time (a BIGSERIAL)
            Column("n", Integer, nullable=False),
            Column("message_ids", ARRAY(Text), nullable=False),
            Column("due_at_us", ARRAY(BigInteger), nullable=False),
            Column("attempts", ARRAY(Integer), nullable=False),
            Column("stored_at_us", ARRAY(BigInteger), nullable=False),
            Index(f"ix_hat_{short}", "handed_at_us"),
            Index(f"ix_hdest_{short}", "destination", "handed_at_us"),
            schema=schema,
        )
    return Table(
        name, MetaData(), *common,
        Column("message_id", String(200), nullable=False),
        Column("due_at_us", BigInteger, nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("stored_at_us", BigInteger, nullable=True),
        Index(f"ix_hat_{short}", "handed_at_us"),
        Index(f"ix_hdest_{short}", "destination", "handed_at_us"),
        Index(f"ix_hist_{short}", "message_id"),
        schema=schema,
    )


def versions_table(metadata: MetaData, name: str, schema: str | None) -> Table:
    """One row per applied migration (a store's is `<table>_schema`)."""
    return Table(
        name,
        metadata,
        Column("version", Integer, primary_key=True, autoincrement=False),
        Column("name", String(100), nullable=False),
        Column("applied_at_us", BigInteger, nullable=False),
        schema=schema,
    )


@dataclass
class StoreShape:
    """What a store object learnt of its tables when it checked them: a store from before schema version 8 has no
    `tier` column, so its claims leave the condition on held messages out (it cannot hold any)."""

    has_tier: bool = True


@dataclass(frozen=True)
class StoreTables:
    """Every table of one store (a name and a schema), and the row conditions that several of its parts add to
    their queries. The parts of the store (stores/destinations.py, leases.py, event_leases.py, backlog.py) are
    given this and a `Database`, and use nothing else of the store."""

    name: str
    schema: str | None
    messages: Table
    #: The partitions of `messages` on PostgreSQL from schema version 8 (see SOON_US).
    soon: Table
    later: Table
    #: From schema version 9, the partitions of `later` (see RING_HOURS).
    far: Table
    hours: tuple[Table, ...]
    ids: Table
    sweeps: Table
    throttle: Table
    delays: Table
    policies: Table
    dests: Table
    counts: Table
    #: From schema version 12, the delivery history: a row per batch on PostgreSQL (partitioned by day:
    #: stores/history.py), a row per message on SQLite (`history_rows`).
    history: Table
    history_rows: Table
    #: From schema version 13, the transports, connections and error queues the messages go through.
    routes: Table
    #: From schema version 14 on PostgreSQL, the partition of the messages paused by a filter (HELD).
    held: Table
    versions: Table
    #: The NOTIFY channel that wakes the store's waiting pumps: LISTEN takes an identifier of at most 63 bytes,
    #: and a hash keeps any schema.table pair within it.
    channel: str
    #: What the store object found of its tables' shape (`SqlDelayedMessageStore.check_ready`).
    shape: StoreShape = field(default_factory=StoreShape)

    @classmethod
    def declare(cls, name: str, schema: str | None) -> StoreTables:
        md = MetaData()
        qualified = f"{schema}.{name}" if schema else name
        return cls(
            name=name, schema=schema, messages=store_table(md, name, schema),
            soon=partition_table(f"{name}_soon", schema), later=partition_table(f"{name}_later", schema),
            far=partition_table(f"{name}_far", schema),
            hours=tuple(partition_table(f"{name}_hour{n:02d}", schema) for n in range(RING_HOURS)),
            ids=ids_table(md, name, schema),
            sweeps=sweeps_table(md, f"{name}_sweeps", schema), throttle=throttle_table(md, name, schema),
            delays=queue_delays_table(md, name, schema), policies=policies_table(md, name, schema),
            dests=destinations_table(md, name, schema), counts=counts_table(md, name, schema),
            history=history_table(name, schema, batches=True), history_rows=history_table(name, schema, batches=False),
            routes=routes_table(md, name, schema), held=partition_table(f"{name}_held", schema),
            versions=versions_table(MetaData(), f"{name}_schema", schema),
            channel="delay_" + hashlib.sha1(qualified.encode()).hexdigest()[:24],
        )

    def template_names(self, db: Database) -> dict[str, str]:
        """The names the numbered SQL files (`schema/`) are filled in with, quoted for `db`."""
        preparer, q = db.engine.dialect.identifier_preparer, db.qualified
        t = self.name
        # The index names the SQL files create are the declared ones (tables.py).
        [due_index], [ids_index] = (self.messages.indexes, self.ids.indexes)
        ids_index_name = str(ids_index.name)
        leased = ids_index_name.replace("ix_ids_", "ix_leased_")
        short = hashlib.sha1(f"{self.schema}.{t}".encode()).hexdigest()[:16]
        return {
            "messages": q(t), "policies": q(f"{t}_policies"), "sweeps": q(f"{t}_sweeps"), "ids": q(f"{t}_ids"),
            "throttle": q(f"{t}_throttle"), "delays": q(f"{t}_delays"), "dests": q(f"{t}_dests"),
            "counts": q(f"{t}_counts"),
            "count_fn": q("delay_counts_" + hashlib.sha1(f"{self.schema}.{t}".encode()).hexdigest()[:16]),
            # Index names live in the table's schema on PostgreSQL and may not be qualified there.
            "ix_due": preparer.quote_identifier(str(due_index.name)),
            "ix_ids": preparer.quote_identifier(ids_index_name),
            "ix_leased": preparer.quote_identifier(leased),
            # Schema version 8: the partitions, the sequence of ids they share, and the indexes by name.
            "soon": q(f"{t}_soon"), "soon_name": preparer.quote_identifier(f"{t}_soon"), "later": q(f"{t}_later"),
            "id_seq": q(f"{t}_id_seq"),
            # Schema version 9: `_later`'s partitions; the hours' are named in a loop (checked identifiers, as
            # literals).
            "far": q(f"{t}_far"), "far_name": preparer.quote_identifier(f"{t}_far"),
            "schema_literal": "NULL" if self.schema is None else _literal(self.schema), "table_literal": _literal(t),
            "ix_due_q": q(str(due_index.name)), "ix_leased_q": q(leased),
            "ix_soon_due": preparer.quote_identifier(f"ix_soon_{short}"), "ix_soon_due_q": q(f"ix_soon_{short}"),
            "ix_soon_leased": preparer.quote_identifier(f"ix_soon_leased_{short}"),
            "ix_soon_leased_q": q(f"ix_soon_leased_{short}"),
            # Schema version 12: the delivery history, its default partition and its indexes.
            "history": q(f"{t}_history"), "history_default": q(f"{t}_hdefault"), "routes": q(f"{t}_routes"),
            "held": q(f"{t}_held"),  # schema version 14
            **{f"ix_{str(ix.name).split('_')[1]}": preparer.quote_identifier(str(ix.name))
               for ix in self.history_rows.indexes},  # ix_hat, ix_hdest, ix_hist
            "id_type": "BIGSERIAL" if db.is_postgres else "INTEGER",  # SQLite's INTEGER key is the rowid
            "bytes_type": "BYTEA" if db.is_postgres else "BLOB",
        }

    @property
    def where(self) -> str:
        return f"{self.schema}.{self.name}" if self.schema else self.name

    def of_store(self) -> tuple[Table, ...]:
        """The tables the migrations create (without the versions table), messages first."""
        return tuple(self.messages.metadata.tables.values())

    @property
    def row(self) -> tuple[Column[Any], ...]:
        """The columns of a message as reads return it: all but `tier`, which says where it is, not what it is (and
        which a store not yet migrated to schema version 8 lacks: a process of this release keeps working there
        until it is)."""
        return tuple(c for c in self.messages.c if c.name != "tier")

    # -- conditions on the messages table -------------------------------------------------------------
    def not_paused(self) -> ColumnElement[bool]:
        """Rows neither of a paused destination nor paused themselves (HELD): every claim and lease adds this. On
        PostgreSQL the second leaves `_held` out of the plan (a literal, as `in_tier`)."""
        d = self.dests
        live = self.messages.c.destination.not_in(select(d.c.destination).where(d.c.paused_at_us.is_not(None)))
        if not self.shape.has_tier:  # a store from before schema version 8 holds nothing
            return live
        return and_(live, self.not_held())

    def not_held(self) -> ColumnElement[bool]:
        """Rows not paused by a filter (a literal, so PostgreSQL leaves `_held` out of the plan)."""
        return self.messages.c.tier != literal_column(str(HELD))

    def held_rows(self) -> ColumnElement[bool]:
        """Rows paused by a filter (schema version 14 on)."""
        return self.messages.c.tier == literal_column(str(HELD))

    def in_tier(self, tier: int) -> ColumnElement[bool]:
        """Rows of one partition (SOON or LATER). A literal, not a bound parameter: the planner leaves the other
        partition out of the plan itself."""
        return self.messages.c.tier == literal_column(str(tier))

    def in_later(self) -> ColumnElement[bool]:
        """Rows of `_later` (all its partitions from schema version 9)."""
        return self.messages.c.tier >= literal_column(str(LATER))

    def dispatchable(self) -> ColumnElement[bool]:
        """Rows a pump or a sweep may take: not those of event destinations (Airflow takes them as events)."""
        return ~self.messages.c.destination.startswith(EVENT_PREFIX, autoescape=True)

    def unleased(self, now_us: int | ColumnElement[int]) -> ColumnElement[bool]:
        """Rows no running sweep holds: never claimed by one, or its lease has expired."""
        t, s = self.messages, self.sweeps
        return or_(t.c.claim_id.is_(None),
                   t.c.claim_id.not_in(select(s.c.claim_id).where(s.c.lease_until_us >= now_us)))

    def leased(self, now_us: int) -> ColumnElement[bool]:
        """Rows a running sweep holds under a live lease."""
        t, s = self.messages, self.sweeps
        return and_(t.c.claim_id.is_not(None),
                    t.c.claim_id.in_(select(s.c.claim_id).where(s.c.lease_until_us >= now_us)))


def _message(row: Any) -> DelayedMessage:
    return _rebuild(row.message_id, row.destination, row.body, row.headers, row.due_at_us, row.failures)


def _rebuild(message_id: str, destination: str, body: bytes | memoryview, headers: str, due_at_us: int,
             failures: int) -> DelayedMessage:
    return DelayedMessage.trusted(
        destination, bytes(body), from_us(due_at_us), {} if headers == "{}" else json.loads(headers), message_id,
        failures,
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



