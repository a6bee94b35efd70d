"""Storing delayed messages: new ids, each in the partition of its due time, waking the pumps that sleep past it.

Ids already stored, or accepted within the store's de-duplication window (stores/dedup.py), are duplicates: skipped,
so a retried send stores nothing twice, or changing the stored message as `on_duplicate` says (core/duplicates.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import bindparam, func, literal, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from airflow_delay_provider.core.duplicates import SKIP, applied, check_on_duplicate, fold
from airflow_delay_provider.core.errors import InvalidMessageError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.dedup import AcceptedIds
from airflow_delay_provider.stores.destinations import DestinationSettings
from airflow_delay_provider.stores.engine import PASSES, Database, copy_rows, in_transaction
from airflow_delay_provider.stores.tables import HELD, SOON, StoreTables, _message, tier_of, to_us

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

    def store(self, messages: Sequence[DelayedMessage], deduplicate: bool = True, on_duplicate: str = SKIP) -> int:
        """Store messages atomically; ids already stored, or accepted within the de-duplication window,
        are duplicates, which `on_duplicate` (core/duplicates.py) skips or lets change the stored message.
        Returns how many were new or changed. `deduplicate=False` (a migration moving messages that were
        accepted before) skips only ids that are stored right now."""
        mode = check_on_duplicate(on_duplicate)
        if not messages:
            return 0
        wrong = next((m for m in messages if not isinstance(m, DelayedMessage)), None)
        if wrong is not None:
            raise InvalidMessageError(f"messages must be DelayedMessage objects (each checked when it is built), "
                                      f"got {type(wrong).__name__}")
        batch = fold(messages, mode)
        destinations = {m.destination for m in messages}

        def write(conn: Connection) -> int:
            now = to_us(self.db.clock())
            tiered, ring = self.tiered(), self.ringed()
            self.accepted.expire(conn, now)
            held: set[str] = set()
            changed: list[dict[str, Any]] = []
            if mode != SKIP:
                # Only an id with a row in the ids table can be stored (stores/dedup.py): the others go straight in.
                seen = self.accepted.known(conn, [m.message_id for m in batch])
                held, changed = self._change_stored(conn, [m for m in batch if m.message_id in seen], mode, now,
                                                    tiered, ring)
            rows = [self._row(m, now, tiered, ring) for m in batch if m.message_id not in held]
            admitted = self._insert_new(conn, rows, now, deduplicate, tiered) if rows else set()
            if mode != SKIP:
                # Stored by a send that committed between the look above and the insert: changed as a duplicate.
                late = [m for m in batch if m.message_id not in held | admitted | seen]
                if late:
                    changed += self._change_stored(conn, late, mode, now, tiered, ring)[1]
            if admitted or changed:
                self.settings.register(conn, destinations, now)
                self._wake(conn, [*rows, *changed])
            return len(admitted) + len(changed)

        if mode == SKIP:
            with self.db.errors("store delayed messages"), self.db.engine.begin() as conn:
                return write(conn)
        # A change waits for the rows it locks, which the move may take to another partition meanwhile.
        return in_transaction(self.db, "store delayed messages", write)

    def _row(self, m: DelayedMessage, now_us: int, tiered: bool, ring: bool) -> dict[str, Any]:
        due_us = to_us(m.due_at)
        row: dict[str, Any] = {"message_id": m.message_id, "destination": m.destination, "body": m.body,
               "headers": json.dumps(m.headers, separators=(",", ":")), "due_at_us": due_us,
               "stored_at_us": now_us, "failures": m.failures}
        if tiered:
            row["tier"] = tier_of(due_us, now_us, ring)
        return row

    def _change_stored(self, conn: Connection, batch: list[DelayedMessage], mode: str, now_us: int, tiered: bool,
                       ring: bool) -> tuple[set[str], list[dict[str, Any]]]:
        """Lock the stored messages of these ids that no sweep holds, and write what `mode` makes of them; returns
        (the ids found stored, the rows written). A row a pump's claim holds is waited for: delivered, it is gone;
        written back for a retry, a later pass (a new snapshot) finds it, as the backlog's changes do."""
        t = self.tables.messages
        wanted = {m.message_id: m for m in batch}
        found: dict[str, DelayedMessage] = {}
        tiers: dict[str, int] = {}  # where each row is: its update looks in that partition only
        left = sorted(wanted)
        for _ in range(PASSES):
            rows = conn.execute(select(t.c.message_id, t.c.destination, t.c.body, t.c.headers, t.c.due_at_us,
                                       t.c.failures, t.c.tier if tiered else literal(SOON).label("tier"))
                                .where(t.c.message_id.in_(left), self.tables.unleased(now_us)).with_for_update()).all()
            found.update((r.message_id, _message(r)) for r in rows)
            tiers.update((r.message_id, r.tier) for r in rows)
            left = sorted(set(wanted) - set(found))
            # A claim this pass waited for may have written a row back; a new statement (a new snapshot) sees it.
            if not left or not conn.execute(select(t.c.id).where(t.c.message_id.in_(left),
                                                                 self.tables.unleased(now_us)).limit(1)).first():
                break
        written = [self._row(m, now_us, tiered, ring)
                   for m in applied(((found[i], wanted[i]) for i in found), mode)]
        for r in written:
            if tiered and tiers[r["message_id"]] == HELD:
                r["tier"] = HELD  # a paused message stays paused, whatever a send changes of it
        if written:
            names = [c for c in written[0] if c != "message_id"]
            partition = [t.c.tier == bindparam("m_tier")] if tiered else []
            conn.execute(update(t).where(t.c.message_id == bindparam("m_id"), *partition)
                         .values({c: bindparam(f"v_{c}") for c in names}),
                         [{"m_id": r["message_id"], "m_tier": tiers[r["message_id"]],
                           **{f"v_{c}": r[c] for c in names}} for r in written])
            # A change is a new acceptance: the window runs from it, and the id is kept until the new due time.
            self.accepted.moved(conn, ((r["message_id"], r["due_at_us"], now_us) for r in written))
        return set(found), written

    def _wake(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        """Notify at commit, waking idle pumps that sleep past these due times: each destination's soonest, for a
        few (dispatchers restricted to other destinations sleep on)."""
        if not self.db.is_postgres or not rows:
            return
        soonest: dict[str, int] = {}
        for r in rows:
            soonest[r["destination"]] = min(r["due_at_us"], soonest.get(r["destination"], r["due_at_us"]))
        if len(soonest) > _NAMED_WAKEUPS:
            payloads = [str(min(soonest.values()))]
        else:
            payloads = [f"{due} {destination}" for destination, due in soonest.items()]
        for payload in payloads:
            conn.execute(select(func.pg_notify(self.tables.channel, payload)))

    _COPY_COLUMNS = ("message_id", "destination", "body", "headers", "due_at_us", "stored_at_us", "failures")
    _COPY_TYPES = ("text", "text", "bytea", "text", "int8", "int8", "int4")

    def _insert_new(self, conn: Connection, rows: list[dict[str, Any]], now_us: int, deduplicate: bool,
                    tiered: bool = False) -> set[str]:
        """Insert the rows whose message id may be stored (stores/dedup.py), remembering their ids; returns their
        ids. The ids table, not the messages' unique index, decides: on PostgreSQL the messages are in partitions,
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
                return set(guards)
            except UniqueViolation:
                pass
        admitted = self.accepted.admit(conn, guards, now_us, deduplicate)
        rows = [r for r in rows if r["message_id"] in admitted]
        if not rows:
            return set()
        # No conflict target: on the partitioned table (and a view of the store older than its migration) the
        # partition a row goes to checks its keys.
        insert = (postgresql.insert if self.db.is_postgres else sqlite.insert)(self.tables.messages)
        returning = insert.on_conflict_do_nothing().returning(self.tables.messages.c.message_id)
        return set(conn.execute(returning, rows).scalars())
