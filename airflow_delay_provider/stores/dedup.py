"""De-duplication: the message ids a store accepted within its window, stored or sent natively.

A send retried after its messages were delivered finds their ids here and sends nothing twice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from sqlalchemy import Table, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from airflow_delay_provider.stores.engine import Database
from airflow_delay_provider.stores.tables import to_us

#: How long an accepted message id is remembered (seconds): within it, the same id is neither stored
#: nor sent natively again. Like SQS FIFO's five-minute window or Cloud Tasks' task names, but longer.
DEFAULT_DEDUP_WINDOW_SECONDS = 86_400
#: Expired ids are deleted at most this often per store object.
_EXPIRE_EVERY_SECONDS = 60.0


class AcceptedIds:
    """One store's accepted ids (its ids table), remembered for `window_us` microseconds (0: not at all)."""

    def __init__(self, db: Database, ids: Table, window_us: int) -> None:
        self.db = db
        self.ids = ids
        self.window_us = window_us
        self._expired_at = 0.0

    def remember(self, conn: Connection, message_ids: Sequence[str], seen_at_us: int) -> list[str]:
        """Add ids to the ids table in the caller's transaction; returns those that were not there within the
        window (the new ones: an id seen longer ago than the window counts as new, even before the expiry
        deleted it)."""
        t = self.ids
        insert = (postgresql.insert if self.db.is_postgres else sqlite.insert)(t)
        stmt = insert.on_conflict_do_update(
            index_elements=["message_id"], set_={"seen_at_us": insert.excluded.seen_at_us},
            where=t.c.seen_at_us < seen_at_us - self.window_us,
        ).returning(t.c.message_id)
        rows = [{"message_id": m, "seen_at_us": seen_at_us} for m in dict.fromkeys(message_ids)]
        return list(conn.execute(stmt, rows).scalars()) if rows else []

    def expire(self, conn: Connection, now_us: int) -> None:
        """Delete the ids older than the window, in the caller's transaction, at most every minute.

        By their index, whatever the statistics say: the ids table only takes inserts for a window's length, so
        neither a vacuum nor autovacuum's analyse may have looked at it yet, and the planner, taking it for a few
        pages, read all of it (65 ms at 1,000,000 ids, 0.5 s at 7,000,000 in the soak, once a minute in a send,
        and a day's window at thousands a second holds hundreds of millions)."""
        if time.monotonic() - self._expired_at < _EXPIRE_EVERY_SECONDS:
            return
        self._expired_at = time.monotonic()
        if self.db.is_postgres:
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        conn.execute(delete(self.ids).where(self.ids.c.seen_at_us < now_us - self.window_us))
        if self.db.is_postgres:
            conn.exec_driver_sql("SET LOCAL enable_seqscan TO DEFAULT")

    def unseen(self, message_ids: Sequence[str]) -> list[str]:
        """The ids not accepted within the window: what a native send may still send."""
        if self.window_us <= 0 or not message_ids:
            return list(message_ids)
        cutoff = to_us(self.db.clock()) - self.window_us
        t = self.ids
        with self.db.errors("read sent message ids"), self.db.engine.connect() as conn:
            seen = set(conn.execute(select(t.c.message_id).where(
                t.c.message_id.in_(list(message_ids)), t.c.seen_at_us >= cutoff)).scalars())
        return [m for m in message_ids if m not in seen]

    def remember_sent(self, message_ids: Sequence[str]) -> None:
        """Record ids a broker confirmed (a native send), so a retried send skips them."""
        if self.window_us <= 0 or not message_ids:
            return
        now = to_us(self.db.clock())
        with self.db.errors("record sent message ids"), self.db.engine.begin() as conn:
            self.expire(conn, now)
            self.remember(conn, message_ids, now)
