"""The store's delivery history (core/history.py): written in the settling transaction, read for the page and the
CLI, and kept for `history_days` days.

On PostgreSQL a row holds a batch's messages of one destination and outcome in arrays: a row per message cost the
pump a fifth of its rate (tables.history_table). The table is partitioned by day: upkeep attaches the partitions of
the next two days ahead of time (`<table>_hYYMMDD`), never today's, and drops those whose day ended before the
retention's start, so old history goes with no DELETE and no vacuum. A partition is only attached for a day nobody
writes to yet: an insert PostgreSQL routed to the default partition before an ATTACH of the range it falls in fails
once the ATTACH commits ("violates partition constraint"), which would release a pump's whole batch. The default
partition takes the rows of a day with no partition (the day the history was made, or days when upkeep did not run);
should it hold rows of a day to come (a host whose clock is ahead), that day's partition starts after its last row.
Upkeep deletes the default's rows past the retention. A message's story is a scan of the arrays, newest first: an
index of every id would cost the pump another fifth. On SQLite one row per message, indexed by id; upkeep deletes the
old rows.

A store whose tables predate the history (schema version 11 or older) writes none: the table is looked for once
a minute until it is there.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    ColumnElement,
    Insert,
    Integer,
    String,
    Table,
    Text,
    bindparam,
    cast,
    delete,
    func,
    insert,
    literal,
    select,
    text,
)
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError
from sqlalchemy.sql.expression import CTE

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.history import (
    CANCELLED,
    DELIVERED,
    MAX_HISTORY_PAGE,
    MINUTE_US,
    Delivery,
    Settled,
    check_history_days,
    lateness_stats,
    series_point,
)
from airflow_delay_provider.stores.background import BackgroundWork
from airflow_delay_provider.stores.engine import LOCK_NOT_AVAILABLE, Database, TablePresence, advisory_key
from airflow_delay_provider.stores.tables import StoreTables, from_us, to_us

log = logging.getLogger(__name__)

DAY_US = 86_400_000_000
#: How many days ahead upkeep has each day's partition ready (the next two: never today's, which takes inserts).
_DAYS_AHEAD = 2
#: Upkeep looks at the partitions this often (seconds): a day's partition is made two days before it starts.
_UPKEEP_SECONDS = 600.0
_PRESENT_CHECK_SECONDS = 60.0
_DAY_NAME = re.compile(r"_h(\d{6})$")


#: What a write needs of each message, by id: (destination, due_at_us, failures before this attempt, stored_at_us).
Facts = Mapping[str, tuple[str, int, int, int | None]]
#: The array columns of a PostgreSQL history row.
_ARRAYS = ("message_ids", "due_at_us", "attempts", "stored_at_us")


def removed_columns(t: Table) -> tuple[Column[Any], ...]:
    """What a statement that removes messages (a cancel, an event's acknowledgement) returns, for their ids' guards
    and their history: each row's id, stored time, destination, due time and failures."""
    return t.c.message_id, t.c.stored_at_us, t.c.destination, t.c.due_at_us, t.c.failures


def facts_of(rows: Iterable[Any]) -> dict[str, tuple[str, int, int, int | None]]:
    """The Facts of rows with those columns (message rows, or what `removed_columns` returned)."""
    return {r.message_id: (r.destination, r.due_at_us, r.failures, r.stored_at_us) for r in rows}


class DeliveryHistory(BackgroundWork):
    """One store's history: `write` (a claim's settlement), `moved_from` (the move's statement), `cancelled_from`
    (a cancel's), the reads, and its upkeep (`start`, in a thread)."""

    thread_name = "delay-store-history"

    def __init__(self, db: Database, tables: StoreTables, days: int) -> None:
        super().__init__()
        self.db = db
        self.tables = tables
        self.batches = db.is_postgres
        self.table = tables.history if self.batches else tables.history_rows
        self.days = check_history_days(days)
        self.present = TablePresence(db, self.table)
        self._literal_statement: Insert | None = None  # `_literal_insert`'s, built once

    def interval(self) -> float:
        return _UPKEEP_SECONDS

    # -- whether to write ------------------------------------------------------------------------------
    def on(self, conn: Connection) -> bool:
        """Whether entries are written: a retention above 0 and the table there (looked for at most once a minute,
        on the writer's own connection)."""
        return bool(self.days) and self.present(conn, every=_PRESENT_CHECK_SECONDS)

    # -- writes -----------------------------------------------------------------------------------------
    def write(self, conn: Connection, handed_at_us: int, groups: Sequence[Settled], facts: Facts) -> None:
        """Insert a batch's outcomes in the caller's transaction: on PostgreSQL a row per destination and group, its
        arrays sent as array literals (the driver's adaptation of four lists of 1,000 took 2 ms of the pump's thread
        per batch, a literal 0.2 ms)."""
        with self.db.errors("record the delivery history"):  # the claim's own error, as its statements give
            if groups and self.on(conn):
                rows = self._rows(handed_at_us, groups, facts)
                if self.batches:
                    conn.execute(self._literal_insert(rows[0]), [
                        {f"p_{k}": _literal(v) if k in _ARRAYS else v for k, v in row.items()} for row in rows])
                else:
                    conn.execute(insert(self.table), rows)

    def _literal_insert(self, row: Mapping[str, Any]) -> Insert:
        """The insert of rows with `row`'s columns (every PostgreSQL row has the same), the arrays cast from text."""
        if self._literal_statement is None:
            c = self.table.c
            self._literal_statement = insert(self.table).values({
                k: cast(bindparam(f"p_{k}", type_=Text), c[k].type) if k in _ARRAYS
                else bindparam(f"p_{k}", type_=c[k].type) for k in row})
        return self._literal_statement

    def _rows(self, handed_at_us: int, groups: Sequence[Settled], facts: Facts) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for group in groups:
            extra = 0 if group.outcome == CANCELLED else 1  # this attempt, but for a cancel
            by_destination: dict[str, list[str]] = {}
            for message_id in group.message_ids:
                by_destination.setdefault(facts[message_id][0], []).append(message_id)
            for destination, ids in by_destination.items():
                base = {"handed_at_us": handed_at_us, "destination": destination, "outcome": group.outcome,
                        "detail": group.detail}
                if self.batches:
                    rows.append({**base, "n": len(ids), "message_ids": ids,
                                 "due_at_us": [facts[m][1] for m in ids],
                                 "attempts": [facts[m][2] + extra for m in ids],
                                 "stored_at_us": [facts[m][3] for m in ids]})
                else:
                    rows += [{**base, "message_id": m, "due_at_us": facts[m][1], "attempts": facts[m][2] + extra,
                              "stored_at_us": facts[m][3]} for m in ids]
        return rows

    def cancelled(self, conn: Connection, rows: Sequence[Any], at_us: int) -> None:
        """Record the rows a cancel deleted (as `removed_columns` returns them), in its transaction."""
        if rows:
            self.write(conn, at_us, [Settled(CANCELLED, tuple(r.message_id for r in rows))], facts_of(rows))

    def _from(self, changed: CTE, handed_us: ColumnElement[int], outcome: str,
              attempts: ColumnElement[int]) -> Insert:
        """On PostgreSQL: the insert of a row per destination of `changed` (a CTE of a DELETE returning at least
        `removed_columns`), for the changing statement itself."""
        c = changed.c
        rows = select(handed_us, c.destination, literal(outcome, String), literal(None, String), func.count(),
                      func.array_agg(c.message_id), func.array_agg(c.due_at_us), func.array_agg(attempts),
                      func.array_agg(c.stored_at_us)).group_by(c.destination)
        return insert(self.table).from_select(["handed_at_us", "destination", "outcome", "detail", "n", "message_ids",
                                               "due_at_us", "attempts", "stored_at_us"], rows)

    def moved_from(self, conn: Connection, claimed: CTE, handed_us: ColumnElement[int]) -> Insert | None:
        """The insert of the entries of the rows a move delivered (`claimed`, as `_from` takes it), for the move's own
        statement; None when no history is kept."""
        if not self.on(conn):
            return None
        return self._from(claimed, handed_us, DELIVERED, claimed.c.failures + literal(1, Integer))

    def cancelled_from(self, conn: Connection, changed: CTE, now_us: int) -> Insert | None:
        """The insert of the entries of the rows a cancel deleted (a CTE as `_from` takes it), or None."""
        if not self.on(conn):
            return None
        return self._from(changed, literal(now_us, BigInteger), CANCELLED, changed.c.failures)

    # -- reads ------------------------------------------------------------------------------------------
    def entries(self, destination: str | None = None, message_id: str | None = None, outcome: str | None = None,
                since: datetime | None = None, before: datetime | None = None, limit: int = 50,
                oldest_first: bool = False, after: str | None = None) -> tuple[list[Delivery], str | None]:
        """Entries newest first (oldest first for a message's story), and the cursor of the next page (None: no
        more). `after` is the cursor a previous page gave: the entries of one batch share their time, so it says how
        many of those at the page's last time were shown."""
        limit = min(limit, MAX_HISTORY_PAGE)
        at_us, shown = _cursor(after)
        where: list[str] = []
        params: dict[str, Any] = {"limit": limit + 1 + shown}
        for column, value, op in (("destination", destination, "="), ("outcome", outcome, "="),
                                  ("handed_at_us", None if since is None else to_us(since), ">="),
                                  ("handed_at_us", None if before is None else to_us(before), "<"),
                                  ("handed_at_us", at_us, ">=" if oldest_first else "<=")):
            if value is not None:
                key = f"p{len(params)}"
                where.append(f"h.{column} {op} :{key}")
                params[key] = value
        # A message's own columns: the unnested arrays' (`u`) on PostgreSQL, the row's (`h`) on SQLite.
        u = "u" if self.batches else "h"
        if message_id is not None:
            params["mid"] = message_id
            where.append(f"{u}.message_id = :mid")
            if self.batches:  # the arrays that hold it, before they are unnested
                where.append("h.message_ids @> ARRAY[CAST(:mid AS TEXT)]")
        name = self.db.qualified(self.table.name)
        direction = "" if oldest_first else " DESC"
        if self.batches:
            source = (f"{name} h CROSS JOIN LATERAL unnest(h.message_ids, h.due_at_us, h.attempts, h.stored_at_us) "
                      "WITH ORDINALITY AS u(message_id, due_at_us, attempts, stored_at_us, i)")
            order = f"h.handed_at_us{direction}, h.seq{direction}, u.i{direction}"
        else:
            source = f"{name} h"
            order = f"h.handed_at_us{direction}, h.rowid{direction}"
        columns = (f"h.handed_at_us, h.destination, h.outcome, h.detail, {u}.message_id, {u}.due_at_us, "
                   f"{u}.attempts, {u}.stored_at_us")
        query = text(f"SELECT {columns} FROM {source} {'WHERE ' + ' AND '.join(where) if where else ''} "
                     f"ORDER BY {order} LIMIT :limit")
        with self.db.errors("read the delivery history"), self.db.engine.connect() as conn:
            if not self.present(conn):
                return [], None
            rows = conn.execute(query, params).all()[shown:]
        page = [Delivery(r.message_id, r.destination, from_us(r.due_at_us), from_us(r.handed_at_us), r.attempts,
                         r.outcome, r.detail, None if r.stored_at_us is None else from_us(r.stored_at_us))
                for r in rows[:limit]]
        if len(rows) <= limit:
            return page, None
        last = rows[limit - 1].handed_at_us
        same = sum(1 for r in rows[:limit] if r.handed_at_us == last) + (shown if last == at_us else 0)
        return page, f"{last}:{same}"

    def chart(self, destination: str | None, since: datetime, until: datetime) -> list[dict[str, Any]]:
        """Per minute: the delivered count and lateness p50/p99 (nearest rank), and the other outcomes' counts."""
        name = self.db.qualified(self.table.name)
        params: dict[str, Any] = {"since": to_us(since), "until": to_us(until), "minute": MINUTE_US,
                                  "delivered": DELIVERED}
        where = "h.handed_at_us >= :since AND h.handed_at_us < :until"
        if destination is not None:
            where += " AND h.destination = :destination"
            params["destination"] = destination
        count = "sum(h.n)" if self.batches else "count(*)"
        others = text(f"SELECT h.handed_at_us / :minute AS minute, h.outcome, {count} FROM {name} h "
                      f"WHERE {where} AND h.outcome <> :delivered GROUP BY 1, 2")
        with self.db.errors("read the delivery history"), self.db.engine.connect() as conn:
            if not self.present(conn):
                return []
            counts: dict[int, dict[str, int]] = {}
            for m, outcome, n in conn.execute(others, params):
                counts.setdefault(int(m), {})[outcome] = int(n)
            stats: dict[int, tuple[int, int | None, int | None]]
            if self.batches:
                late = "h.handed_at_us - d"
                stats = {int(m): (int(n), p50, p99) for m, n, p50, p99 in conn.execute(text(
                    f"SELECT h.handed_at_us / :minute AS minute, count(*), "
                    f"percentile_disc(0.5) WITHIN GROUP (ORDER BY {late}), "
                    f"percentile_disc(0.99) WITHIN GROUP (ORDER BY {late}) "
                    f"FROM {name} h CROSS JOIN LATERAL unnest(h.due_at_us) AS d "
                    f"WHERE {where} AND h.outcome = :delivered GROUP BY 1"), params)}
            else:  # SQLite has no percentile: the minutes' values, sorted, and the same nearest rank
                values: dict[int, list[int]] = {}
                for m, value in conn.execute(text(
                        f"SELECT h.handed_at_us / :minute AS minute, h.handed_at_us - h.due_at_us FROM {name} h "
                        f"WHERE {where} AND h.outcome = :delivered ORDER BY 1, 2"), params):
                    values.setdefault(int(m), []).append(int(value))
                stats = {m: lateness_stats(v) for m, v in values.items()}
        return [series_point(m, *stats.get(m, (0, None, None)), counts.get(m, {}))
                for m in sorted(stats.keys() | counts.keys())]

    # -- upkeep -----------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.keep()
        except Exception as exc:  # upkeep is retried at its next pass; a pump must not stop for it
            log.warning("delivery history upkeep of %s failed, tried again in %.0f s: %s", self.tables.where,
                        self.interval(), exc)

    def keep(self) -> dict[str, list[str]]:
        """Make the coming days' partitions and drop (or delete) what is past the retention; returns the partitions
        made and dropped. Never waits more than moments for a lock: the next pass tries again. Run it at least once
        a day (a pump's loop starts it every ten minutes): a day that starts without its partition writes to the
        default."""
        if not self._readable_now():
            return {"made": [], "dropped": []}
        now_us = to_us(self.db.clock())
        cutoff_us = now_us - self.days * DAY_US
        if not self.db.is_postgres:
            with self.db.errors("trim the delivery history"), self.db.engine.begin() as conn:
                conn.execute(delete(self.table).where(self.table.c.handed_at_us < cutoff_us))
            return {"made": [], "dropped": []}
        made, dropped = [], []
        today = now_us // DAY_US
        have = self._partitions()
        for day in range(today + 1, today + 1 + _DAYS_AHEAD):
            if day not in have and self._make(day):
                made.append(self._name(day))
        for day in sorted(have):
            if (day + 1) * DAY_US <= cutoff_us and self._drop(day):
                dropped.append(self._name(day))
        with self.db.errors("trim the delivery history"), self.db.engine.begin() as conn:
            conn.execute(text(f"DELETE FROM {self._default} WHERE handed_at_us < :cutoff"), {"cutoff": cutoff_us})
        if made or dropped:
            log.info("delivery history of %s: made %s, dropped %s (kept %d days)", self.tables.where, made or "none",
                     dropped or "none", self.days)
        return {"made": made, "dropped": dropped}

    def _readable_now(self) -> bool:
        with self.db.errors("look for the delivery history"), self.db.engine.connect() as conn:
            return self.present(conn)

    @property
    def _default(self) -> str:
        """The default partition (the migration makes it), qualified."""
        return self.db.qualified(f"{self.tables.name}_hdefault")

    def _name(self, day: int) -> str:
        return f"{self.tables.name}_h{(datetime(1970, 1, 1) + timedelta(days=day)).strftime('%y%m%d')}"

    def _partitions(self) -> set[int]:
        """The days that have a partition, from their names."""
        with self.db.errors("list the delivery history's partitions"), self.db.engine.connect() as conn:
            names = conn.execute(text(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = to_regclass(:parent)"), {"parent": self.db.qualified(self.table.name)}).scalars()
            days = set()
            for name in names:
                match = _DAY_NAME.search(name)
                if match and name == f"{self.tables.name}_h{match[1]}":
                    days.add((datetime.strptime(match[1], "%y%m%d") - datetime(1970, 1, 1)).days)
        return days

    def _briefly(self, action: str, work: Callable[[Connection], object]) -> bool:
        """Do `work` in a transaction whose locks are had within moments or not at all: False when someone holds
        one (the next pass tries again), so pumps never queue long behind a request for a lock here."""
        with self.db.errors(action):
            try:
                with self.db.engine.begin() as conn:
                    conn.execute(text("SET LOCAL lock_timeout = '200ms'"))
                    work(conn)
            except OperationalError as exc:
                if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                    raise
                return False
        return True

    def _make(self, day: int) -> bool:
        """Attach a new table as the day's partition: ATTACH takes the parent's SHARE UPDATE EXCLUSIVE lock, which
        inserts do not wait for (CREATE ... PARTITION OF would take ACCESS EXCLUSIVE). Returns whether this call
        made it (not when another process is making it, or made it meanwhile)."""
        parent, default = self.db.qualified(self.table.name), self._default
        name = self.db.qualified(self._name(day))
        made: list[str] = []

        def make(conn: Connection) -> None:
            # One process at a time: two pumps starting together both found the day missing, and the second CREATE
            # failed in the catalog (a duplicate type name), putting its upkeep off for ten minutes.
            key = advisory_key(f"airflow_delay_provider.history:{parent}")
            if not conn.execute(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": key}).scalar():
                return  # another process's upkeep is making it
            if conn.execute(text("SELECT to_regclass(:name)"), {"name": name}).scalar() is not None:
                return  # made meanwhile
            conn.execute(text(f"CREATE TABLE {name} (LIKE {parent} INCLUDING DEFAULTS)"))
            # Inserts into the default wait while its rows of that day are read and the partition is attached.
            conn.execute(text(f"LOCK TABLE {default} IN SHARE ROW EXCLUSIVE MODE"))
            last = conn.execute(text(f"SELECT max(handed_at_us) FROM {default} WHERE handed_at_us >= :start "
                                     "AND handed_at_us < :end"),
                                {"start": day * DAY_US, "end": (day + 1) * DAY_US}).scalar()
            start = day * DAY_US if last is None else int(last) + 1
            conn.execute(text(f"ALTER TABLE {parent} ATTACH PARTITION {name} FOR VALUES FROM ({start}) "
                              f"TO ({(day + 1) * DAY_US})"))
            made.append(name)

        return self._briefly("make a day's partition of the delivery history", make) and bool(made)

    def _drop(self, day: int) -> bool:
        """Drop a day's partition: a moment's ACCESS EXCLUSIVE lock of the parent, once a day."""
        name = self.db.qualified(self._name(day))
        return self._briefly("drop a day's partition of the delivery history",
                             lambda conn: conn.execute(text(f"DROP TABLE IF EXISTS {name}")))


def _cursor(after: str | None) -> tuple[int | None, int]:
    """(the time of a page's last entry, how many entries of that time it showed) from its `next` cursor."""
    if not after:
        return None, 0
    try:
        at, _, shown = after.partition(":")
        return int(at), int(shown)
    except ValueError:
        raise InvalidInputError(f"after must be the `next` cursor a page of the history gave, got {after!r}") from None


def _literal(values: Sequence[Any]) -> str:
    """A PostgreSQL array literal of ints (None as NULL) or of strings, each string quoted with `\\` and `"` escaped."""
    if values and isinstance(values[0], str):
        return "{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}"
    if None in values:
        return "{" + ",".join("NULL" if v is None else str(v) for v in values) + "}"
    return "{" + ",".join(map(str, values)) + "}"
