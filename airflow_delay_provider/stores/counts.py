"""The backlog's counts per destination on a SQL store: from the rows themselves, or (PostgreSQL, schema version 6
on) from the counts per ten-minute slot of due time that triggers keep, summed up by the store's upkeep."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import case, func, inspect, literal, select, union_all
from sqlalchemy.engine import Connection

from airflow_delay_provider.core.backlog import BUCKETS
from airflow_delay_provider.stores.engine import Database
from airflow_delay_provider.stores.tables import COUNT_SLOT_US, StoreTables

log = logging.getLogger(__name__)


class BacklogCounts:
    """(destination, scheduled, in flight, due by each bucket's limit...) rows of one store's backlog."""

    def __init__(self, db: Database, tables: StoreTables) -> None:
        self.db, self.tables = db, tables
        self._has_counts = False

    def rows(self, conn: Connection, now_us: int, destination: str | None) -> list[tuple[Any, ...]]:
        """From the counts per slot where the store keeps them, else from the rows."""
        return (self.from_counts if self.counted() else self.from_rows)(conn, now_us, destination)

    def counted(self) -> bool:
        """Whether this store keeps counts per slot of due time (PostgreSQL, schema version 6 on)."""
        if not self.db.is_postgres:
            return False
        if not self._has_counts:
            with self.db.engine.connect() as conn:
                self._has_counts = inspect(conn).has_table(self.tables.counts.name, schema=self.db.schema)
        return self._has_counts

    def sum_up_counts(self, conn: Connection) -> int:
        """Replace the rows of changes in the counts table by one row per destination and slot (rows added
        meanwhile are left for the next time); returns how many rows it replaced."""
        c = self.db.qualified(self.tables.counts.name)
        started = time.monotonic()
        replaced, kept = conn.exec_driver_sql(
            f"WITH gone AS (DELETE FROM {c} WHERE id <= (SELECT max(id) FROM {c}) RETURNING destination, slot, n), "
            f"kept AS (INSERT INTO {c} (destination, slot, n) SELECT destination, slot, sum(n) FROM gone "
            "GROUP BY destination, slot HAVING sum(n) <> 0 RETURNING 1) "
            "SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM kept)").one()
        took = time.monotonic() - started
        # A bulk load leaves a row per destination and slot of each statement: its first sum-up is work to see.
        log.log(logging.INFO if took >= 1.0 else logging.DEBUG, "upkeep: summed up %d rows of backlog counts into "
                "%d in %.1f s (%s)", replaced, kept, took, c)
        return int(replaced)

    def from_rows(self, conn: Connection, now_us: int, destination: str | None) -> list[tuple[Any, ...]]:
        """(destination, scheduled, in flight, due by each bucket's limit...), counted row by row."""
        t = self.tables.messages
        buckets = [func.sum(case((t.c.due_at_us <= now_us + limit * 1_000_000, 1), else_=0)) for _, limit in BUCKETS]
        leased = func.sum(case((self.tables.leased(now_us), 1), else_=0))
        query = select(t.c.destination, func.count(), leased, *buckets)
        if destination is not None:
            query = query.where(t.c.destination == destination)
        return [tuple(row) for row in conn.execute(query.group_by(t.c.destination))]

    def from_counts(self, conn: Connection, now_us: int, destination: str | None) -> list[tuple[Any, ...]]:
        """(destination, scheduled, in flight, due by each bucket's limit...) from the counts per slot: whole
        slots before a limit's slot from the counts, the part of its own slot from the rows (ten minutes of
        rows at most), all in one snapshot."""
        c, t = self.tables.counts, self.tables.messages
        limits = [now_us + seconds * 1_000_000 for _, seconds in BUCKETS]
        slots = [limit // COUNT_SLOT_US for limit in limits]
        counted = select(c.c.destination, func.sum(c.c.n),
                         *(func.sum(c.c.n).filter(c.c.slot < slot) for slot in slots)).group_by(c.c.destination)
        # One range scan of the due index per limit (an OR of the ranges lets the planner scan the whole table).
        parts = [select(literal(k).label("k"), t.c.destination, func.count().label("n"))
                 .where(t.c.due_at_us.between(slot * COUNT_SLOT_US, limit), *(
                     [t.c.destination == destination] if destination is not None else []))
                 .group_by(t.c.destination)
                 for k, (slot, limit) in enumerate(zip(slots, limits, strict=True))]
        if destination is not None:
            counted = counted.where(c.c.destination == destination)
        conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            totals = {d: (int(n), [int(x or 0) for x in upto]) for d, n, *upto in conn.execute(counted) if n}
            within: dict[str, list[int]] = {}
            for k, name, n in conn.execute(union_all(*parts)):
                within.setdefault(name, [0] * len(BUCKETS))[k] = n
            leased: dict[str, int] = {}
            live = select(self.tables.sweeps.c.claim_id).where(self.tables.sweeps.c.lease_until_us >= now_us)
            if conn.execute(live.limit(1)).first():
                held = select(t.c.destination, func.count()).where(self.tables.leased(now_us))
                if destination is not None:
                    held = held.where(t.c.destination == destination)
                leased = dict(conn.execute(held.group_by(t.c.destination)).all())
        return [(d, n, leased.get(d, 0), *(a + b for a, b in zip(upto, within.get(d, [0] * len(BUCKETS)),
                                                                 strict=True)))
                for d, (n, upto) in totals.items()]

