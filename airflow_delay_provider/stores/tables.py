"""The store's tables and the value rules every part of it shares.

Times are integer microseconds since the epoch (UTC), which compare and index the same way on every
database.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime, timedelta

from sqlalchemy import BigInteger, Column, Float, Index, Integer, LargeBinary, MetaData, String, Table, Text

from airflow_delay_provider.core.errors import InvalidInputError, InvalidNameError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.engine import check_identifier

DEFAULT_TABLE = "delayed_messages"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
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


def _per_destination(metadata: MetaData, name: str, schema: str | None, *columns: Column) -> Table:
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


def _message(row) -> DelayedMessage:
    return _rebuild(row.message_id, row.destination, row.body, row.headers, row.due_at_us, row.failures)


def _rebuild(message_id: str, destination: str, body, headers: str, due_at_us: int, failures: int) -> DelayedMessage:
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



