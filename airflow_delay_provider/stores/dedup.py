"""De-duplication: the message ids a store has accepted, stored or sent natively.

An id is refused while a message with it is stored, and for the store's window after it was accepted, so a send
retried after its messages were delivered sends nothing twice.

On PostgreSQL from schema version 8 the messages are in partitions, and a unique index sees its own partition only:
the ids table is what keeps an id stored once. Its row of a stored message is kept at least until the message is
due (`seen_at_us` is `guard`: never before the due time less the window, so the row is not taken for expired while
the message waits), moved on when the due time is (a retry, a reschedule), and given its acceptance time back
when the message is cancelled; the expiry leaves the rows of messages still stored after their due time (a paused
destination, a sweep's lease). So a send of an id that has no row, or a row within the window, needs no look at the
messages; only an id whose row expired (a re-send after the window) is looked for among them.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    ARRAY,
    CTE,
    ColumnElement,
    String,
    any_,
    bindparam,
    delete,
    exists,
    func,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.sql.dml import ReturningInsert

from airflow_delay_provider.core.ports import DEFAULT_DEDUP_WINDOW_SECONDS
from airflow_delay_provider.stores.engine import Database
from airflow_delay_provider.stores.tables import StoreTables, to_us

#: Expired ids are deleted at most this often per store object.
_EXPIRE_EVERY_SECONDS = 60.0


__all__ = ["DEFAULT_DEDUP_WINDOW_SECONDS", "AcceptedIds"]


class AcceptedIds:
    """One store's accepted ids (its ids table), remembered for `window_us` microseconds after acceptance (0: not
    after), and while their messages are stored."""

    def __init__(self, db: Database, tables: StoreTables, window_us: int) -> None:
        self.db = db
        self.tables = tables
        self.ids = tables.ids
        self.window_us = window_us
        self._expired_at = -float("inf")

    def guard(self, due_us: int, accepted_us: int) -> int:
        """The `seen_at_us` of a message accepted at `accepted_us` and due at `due_us`: its id is refused while
        `seen_at_us >= now - window`, that is for the window, and until it is due (after that, the expiry keeps
        the row while the message is stored)."""
        return max(self._accepted_at(accepted_us), due_us - self.window_us - 1)

    def _accepted_at(self, at_us: int) -> int:
        """The `seen_at_us` of an acceptance at `at_us`: with no window, refused not even at that instant."""
        return at_us if self.window_us > 0 else at_us - 1

    def _upsert(self) -> postgresql.Insert | sqlite.Insert:
        return (postgresql.insert if self.db.is_postgres else sqlite.insert)(self.ids)

    def _greatest(self, a: Any, b: Any) -> ColumnElement[int]:
        return func.greatest(a, b) if self.db.is_postgres else func.max(a, b)

    def stored(self, conn: Connection, message_ids: Collection[str]) -> set[str]:
        """Of these ids, those stored now (in any partition)."""
        if not message_ids:
            return set()
        t = self.tables.messages
        ids = literal(sorted(message_ids), ARRAY(String)) if self.db.is_postgres else None
        wanted = t.c.message_id == any_(ids) if ids is not None else t.c.message_id.in_(sorted(message_ids))
        return set(conn.execute(select(t.c.message_id).where(wanted)).scalars())

    def known(self, conn: Connection, message_ids: Collection[str]) -> set[str]:
        """Of these ids, those with a row (stored, or accepted within the window, or not expired yet); the others
        are not stored."""
        if not message_ids:
            return set()
        t = self.ids
        return set(conn.execute(select(t.c.message_id).where(t.c.message_id.in_(sorted(message_ids)))).scalars())

    def admit(self, conn: Connection, guards: Mapping[str, int], now_us: int, deduplicate: bool = True) -> set[str]:
        """Which of the ids (each with its `guard`) may be stored now, remembering them, in the caller's
        transaction: not those stored, nor (with `deduplicate`) those accepted within the window. An id seen
        before is only re-admitted after a look among the messages; concurrent sends of one id wait for each
        other on its row, and one of them wins."""
        t = self.ids
        rows = conn.execute(select(t.c.message_id, t.c.seen_at_us).where(t.c.message_id.in_(sorted(guards)))
                            .with_for_update()).all()
        seen = dict(rows)
        seen_now = {m for m, at in seen.items() if at >= now_us - self.window_us} if deduplicate else set()
        again = set(seen) - seen_now - self.stored(conn, set(seen) - seen_now)
        new = [m for m in guards if m not in seen]
        admitted: set[str] = set()
        if new:
            insert = self._upsert().on_conflict_do_nothing(index_elements=["message_id"]).returning(t.c.message_id)
            admitted.update(conn.execute(insert, [{"message_id": m, "seen_at_us": guards[m]} for m in new]).scalars())
        if again:
            # A re-send after the window is a new acceptance; a migration's (no `deduplicate`) keeps the longer guard.
            value = bindparam("v") if deduplicate else self._greatest(t.c.seen_at_us, bindparam("v"))
            conn.execute(update(t).where(t.c.message_id == bindparam("m")).values(seen_at_us=value),
                         [{"m": m, "v": guards[m]} for m in again])
            admitted.update(again)
        return admitted

    def moved(self, conn: Connection, rows: Iterable[tuple[str, int, int]]) -> None:
        """Stored messages whose due times changed (a retry, a reschedule), as (id, due, accepted at) rows: their ids
        are kept until the new due time (no longer the old one), in the caller's transaction."""
        self._keep(conn, {m: self.guard(due, accepted) for m, due, accepted in rows})

    def cancelled(self, conn: Connection, rows: Iterable[tuple[str, int]]) -> None:
        """Cancelled messages (never delivered), as (id, accepted at) rows: their ids are remembered from their
        acceptance again, no longer until their due time."""
        self._keep(conn, {m: self._accepted_at(accepted) for m, accepted in rows})

    def kept_from(self, changed: CTE, due_us: int | None) -> ReturningInsert[Any]:
        """On PostgreSQL, the statement that does what `cancelled` (`due_us` None) or `moved` does for the rows of
        `changed` (a CTE of a DELETE or UPDATE returning message_id and stored_at_us), in the same statement: the
        rows never leave the database. It returns the ids it kept, one per changed row."""
        accepted = changed.c.stored_at_us - (0 if self.window_us > 0 else 1)
        seen = accepted if due_us is None else func.greatest(accepted, due_us - self.window_us - 1)
        insert = postgresql.insert(self.ids).from_select(["message_id", "seen_at_us"],
                                                         select(changed.c.message_id, seen))
        return insert.on_conflict_do_update(index_elements=["message_id"], set_={
            "seen_at_us": insert.excluded.seen_at_us}).returning(self.ids.c.message_id)

    def _keep(self, conn: Connection, seen_at: Mapping[str, int]) -> None:
        if seen_at:  # a row is missing only for a store from before the ids of stored messages were kept
            insert = self._upsert()
            statement = insert.on_conflict_do_update(index_elements=["message_id"],
                                                     set_={"seen_at_us": insert.excluded.seen_at_us})
            conn.execute(statement, [{"message_id": m, "seen_at_us": v} for m, v in seen_at.items()])

    def expire(self, conn: Connection, now_us: int) -> None:
        """Delete the ids older than the window, in the caller's transaction, at most every minute; not those of
        messages still stored after their due time (a paused destination's, a sweep's), whose rows keep them
        stored once.

        By their index, whatever the statistics say: the ids table only takes inserts for a window's length, so
        neither a vacuum nor autovacuum's analyse may have looked at it yet, and the planner, taking it for a few
        pages, read all of it (65 ms at 1,000,000 ids, 0.5 s at 7,000,000 in the soak, once a minute in a send,
        and a day's window at thousands a second holds hundreds of millions). The messages still stored after
        their due time are read once, through the due index, and kept aside: looked for by id, each expired id
        would be looked up in every partition."""
        if time.monotonic() - self._expired_at < _EXPIRE_EVERY_SECONDS:
            return
        self._expired_at = time.monotonic()
        i, m = self.ids, self.tables.messages
        cutoff = now_us - self.window_us
        if not self.db.is_postgres:
            overdue = exists().where(m.c.message_id == i.c.message_id, m.c.due_at_us <= now_us)
            conn.execute(delete(i).where(i.c.seen_at_us < cutoff, ~overdue))
            return
        conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        conn.execute(text(
            f"WITH overdue AS MATERIALIZED (SELECT message_id FROM {self.db.qualified(m.name)} "
            "WHERE due_at_us <= :now) "
            f"DELETE FROM {self.db.qualified(i.name)} i WHERE i.seen_at_us < :cutoff "
            "AND NOT EXISTS (SELECT 1 FROM overdue o WHERE o.message_id = i.message_id)"),
            {"now": now_us, "cutoff": cutoff})
        conn.exec_driver_sql("SET LOCAL enable_seqscan TO DEFAULT")

    def unseen(self, message_ids: Sequence[str]) -> list[str]:
        """The ids neither stored nor accepted within the window: what a native send may still send."""
        if self.window_us <= 0 or not message_ids:
            return list(message_ids)
        cutoff = to_us(self.db.clock()) - self.window_us
        t = self.ids
        with self.db.errors("read sent message ids"), self.db.engine.connect() as conn:
            rows = dict(conn.execute(select(t.c.message_id, t.c.seen_at_us).where(
                t.c.message_id.in_(list(message_ids)))).all())
            expired = {m for m, at in rows.items() if at < cutoff}
            seen = (set(rows) - expired) | self.stored(conn, expired)
        return [m for m in message_ids if m not in seen]

    def remember_sent(self, message_ids: Sequence[str]) -> None:
        """Record ids a broker confirmed (a native send), so a retried send skips them."""
        if self.window_us <= 0 or not message_ids:
            return
        now = to_us(self.db.clock())
        with self.db.errors("record sent message ids"), self.db.engine.begin() as conn:
            self.expire(conn, now)
            insert = self._upsert()
            conn.execute(insert.on_conflict_do_update(index_elements=["message_id"], set_={
                "seen_at_us": self._greatest(self.ids.c.seen_at_us, insert.excluded.seen_at_us)}),
                [{"message_id": m, "seen_at_us": now} for m in dict.fromkeys(message_ids)])
