"""Storing delayed messages: new ids only, each in the partition of its due time, waking the pumps that sleep past it.

Ids already stored, or accepted within the store's de-duplication window (stores/dedup.py), are skipped, so a
retried send stores nothing twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import ARRAY, String, any_, func, literal, select
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
        remember = deduplicate and self.accepted.window_us > 0
        with self.db.errors("store delayed messages"), self.db.engine.begin() as conn:
            if remember:
                self.accepted.expire(conn, now)
            stored = self._insert_new(conn, rows, now if remember else None, tiered)
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

    def _insert_new(self, conn: Connection, rows: list[dict[str, Any]], seen_at_us: int | None,
                    tiered: bool = False) -> int:
        """Insert the rows whose message id is new (a retried task stores nothing twice); returns how many.
        With `seen_at_us`, their ids are remembered in the ids table and ids found there are skipped."""
        if tiered and seen_at_us is None:
            # Each partition's unique index sees its own rows only: without the ids table, look in both.
            t = self.tables.messages
            stored = set(conn.execute(select(t.c.message_id).where(
                t.c.message_id == any_(literal([r["message_id"] for r in rows], ARRAY(String))))).scalars())
            rows = [r for r in rows if r["message_id"] not in stored]
            if not rows:
                return 0
        if self.db.is_postgres:
            from psycopg.errors import UniqueViolation

            columns: tuple[str, ...] = self._COPY_COLUMNS
            types: tuple[str, ...] = self._COPY_TYPES
            if tiered:
                columns, types = (*columns, "tier"), (*types, "int2")
            try:
                with conn.begin_nested():  # COPY is the fast way, for the usual case of all-new ids
                    if seen_at_us is not None:
                        copy_rows(conn, self.tables.ids, ("message_id", "seen_at_us"), ("text", "int8"),
                                  ((r["message_id"], seen_at_us) for r in rows))
                    copy_rows(conn, self.tables.messages, columns, types, ([r[c] for c in columns] for r in rows))
                return len(rows)
            except UniqueViolation:
                pass
        if seen_at_us is not None:
            fresh = set(self.accepted.remember(conn, [r["message_id"] for r in rows], seen_at_us))
            rows = [r for r in rows if r["message_id"] in fresh]
            if not rows:
                return 0
        insert = (postgresql.insert if self.db.is_postgres else sqlite.insert)(self.tables.messages)
        # The partitioned table has no unique index of its own: the partition a row goes to checks its keys.
        stmt = (insert.on_conflict_do_nothing() if tiered else insert.on_conflict_do_nothing(
            index_elements=["message_id"])).returning(self.tables.messages.c.id)
        return len(conn.execute(stmt, rows).all())

