"""Storing delayed messages: new ids only, each in the partition of its due time, waking the pumps that sleep past it.

Ids already stored, or accepted within the store's de-duplication window (stores/dedup.py), are skipped, so a
retried send stores nothing twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from airflow_delay_provider.core.errors import InvalidMessageError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.dedup import AcceptedIds
from airflow_delay_provider.stores.destinations import DestinationSettings
from airflow_delay_provider.stores.engine import Database, copy_rows
from airflow_delay_provider.stores.tables import StoreTables, tier_of, to_us

#: A send to more destinations than this wakes every waiting pump with one notification, naming none.
_NAMED_WAKEUPS = 16


class MessageWrites:
    """One store's writes of new messages, on its database and tables.

    :param tiered: whether the messages are in the two partitions (stores/tiers.py).
    :param ringed: whether `_later` is in partitions by due hour (schema version 9).
    """

    def __init__(self, db: Database, tables: StoreTables, accepted: AcceptedIds, settings: DestinationSettings,
                 tiered: Callable[[], bool], ringed: Callable[[], bool]) -> None:
        self.db = db
        self.tables = tables
        self.accepted = accepted
        self.settings = settings
        self.tiered = tiered
        self.ringed = ringed

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
        now = to_us(self.db.clock())
        tiered, ring = self.tiered(), self.ringed()
        rows: list[dict[str, Any]] = [
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
        if tiered:
            for r in rows:
                r["tier"] = tier_of(r["due_at_us"], now, ring)
        first: dict[str, dict[str, Any]] = {}
        for r in rows:  # an id twice in one send: the first is the one stored
            first.setdefault(r["message_id"], r)
        with self.db.errors("store delayed messages"), self.db.engine.begin() as conn:
            self.accepted.expire(conn, now)
            stored = self._insert_new(conn, list(first.values()), now, deduplicate, tiered)
            if stored:
                self.settings.register(conn, {r["destination"] for r in rows}, now)
            if self.db.is_postgres and stored:
                # Delivered at commit; wakes idle pumps that sleep past this due time. Each destination's
                # soonest, for a few: dispatchers restricted to other destinations sleep on.
                soonest: dict[str, int] = {}
                for r in rows:
                    soonest[r["destination"]] = min(r["due_at_us"], soonest.get(r["destination"], r["due_at_us"]))
                if len(soonest) > _NAMED_WAKEUPS:
                    payloads = [str(min(soonest.values()))]
                else:
                    payloads = [f"{due} {destination}" for destination, due in soonest.items()]
                for payload in payloads:
                    conn.execute(select(func.pg_notify(self.tables.channel, payload)))
        return stored

    _COPY_COLUMNS = ("message_id", "destination", "body", "headers", "due_at_us", "stored_at_us", "failures")
    _COPY_TYPES = ("text", "text", "bytea", "text", "int8", "int8", "int4")

    def _insert_new(self, conn: Connection, rows: list[dict[str, Any]], now_us: int, deduplicate: bool,
                    tiered: bool = False) -> int:
        """Insert the rows whose message id may be stored (stores/dedup.py), remembering their ids; returns how
        many. The ids table, not the messages' unique index, decides: on PostgreSQL the messages are in partitions,
        each with its own index."""
        guards = {r["message_id"]: self.accepted.guard(r["due_at_us"], now_us) for r in rows}
        if self.db.is_postgres:
            from psycopg.errors import UniqueViolation

            columns: tuple[str, ...] = self._COPY_COLUMNS
            types: tuple[str, ...] = self._COPY_TYPES
            if tiered:
                columns, types = (*columns, "tier"), (*types, "int2")
            try:
                # COPY is the fast way, for the usual case of ids never seen: an id without a row in the ids table
                # is not stored (its row stays while it is).
                with conn.begin_nested():
                    copy_rows(conn, self.tables.ids, ("message_id", "seen_at_us"), ("text", "int8"), guards.items())
                    copy_rows(conn, self.tables.messages, columns, types, ([r[c] for c in columns] for r in rows))
                return len(rows)
            except UniqueViolation:
                pass
        admitted = self.accepted.admit(conn, guards, now_us, deduplicate)
        rows = [r for r in rows if r["message_id"] in admitted]
        if not rows:
            return 0
        # No conflict target: on the partitioned table (and a view of the store older than its migration) the
        # partition a row goes to checks its keys.
        insert = (postgresql.insert if self.db.is_postgres else sqlite.insert)(self.tables.messages)
        return len(conn.execute(insert.on_conflict_do_nothing().returning(self.tables.messages.c.id), rows).all())
