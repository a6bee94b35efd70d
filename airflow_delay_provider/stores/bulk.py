"""A cancel or a reschedule by a filter, in batches: a million selected messages as many short transactions, never
one long one (which would hold back vacuum and every pump's snapshot, and lose all its work to one failure).

A pass first reads which rows the filter selects, in one snapshot and one scan (the plan the database picks for the
filter: a range of the due index for a due window, the table itself for a destination or a body text), keeping only
each row's partition and id; the snapshot ends there. It then changes them `BULK_BATCH` at a time, in partition and
id order (each batch looks in one or two partitions), each batch its own transaction, re-checking the filter on every
row. A pump's claim is waited for row by row, as by one transaction: a row it delivered is gone and skipped; a row it
wrote back for a retry is a new row, which the next pass finds, as it finds rows stored meanwhile that match. Passes
repeat until one finds nothing (changed rows no longer match: deleted, or at the new due time), at most PASSES.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, func, select, update
from sqlalchemy.engine import Connection

from airflow_delay_provider.core.backlog import BULK_BATCH, LISTED
from airflow_delay_provider.stores.dedup import AcceptedIds
from airflow_delay_provider.stores.engine import PASSES, Database, in_transaction
from airflow_delay_provider.stores.history import DeliveryHistory, removed_columns
from airflow_delay_provider.stores.tables import StoreTables, to_us

log = logging.getLogger(__name__)

#: Seconds between two progress lines of a long change.
PROGRESS_EVERY = 5.0
#: Rows read at a time while a pass reads what it selects.
_READ_CHUNK = 50_000


def settle_cancelled(conn: Connection, rows: Sequence[Any], at_us: int, accepted: AcceptedIds,
                     history: DeliveryHistory | None) -> None:
    """What removing scheduled messages for good leaves, in the caller's transaction (the rows as `removed_columns`
    returns them): their ids guarded from their acceptance again, and each cancelled in the delivery history."""
    accepted.cancelled(conn, [(r.message_id, r.stored_at_us) for r in rows])
    if history is not None:
        history.cancelled(conn, rows, at_us)


def leased_selected(conn: Connection, tables: StoreTables, selected: Sequence[ColumnElement[bool]],
                    now_us: int) -> tuple[list[str], int]:
    """(the first LISTED + 1 ids, the count) of the selected rows a live sweep lease holds: looked for only while a
    sweep holds one (the sweeps table, not the messages, is read otherwise)."""
    s, t = tables.sweeps, tables.messages
    if not conn.execute(select(s.c.claim_id).where(s.c.lease_until_us >= now_us).limit(1)).first():
        return [], 0
    leased = [*selected, tables.leased(now_us)]
    count = int(conn.execute(select(func.count()).where(*leased)).scalar_one())
    return list(conn.execute(select(t.c.message_id).where(*leased).limit(LISTED + 1)).scalars()), count


class BatchedChange:
    """Delete (`due_us` None and no `values`), re-time (`due_us`) or move between partitions (`values` alone: a
    pause or a resume by a filter) the rows `where` selects, `batch` rows per transaction.

    :param where: the selection's conditions, with the one that leaves rows a live sweep lease holds and, for a
        reschedule, the one that leaves rows already at the new due time (so a changed row is never chosen again;
        a pause or a resume: rows already held, or not held).
    :param values: the columns a reschedule, a pause or a resume writes.
    :param tiered: whether the rows are in partitions by `tier` (a store from before has no such column).
    :param wake: tell waiting pumps of the earliest due time changed (a resume).

    After `run`: `listed` (the first LISTED + 1 ids changed), `count`, `batches`, and `left` (ids still selected
    after the last pass: a claim wrote them back for a retry before every pass)."""

    def __init__(self, db: Database, tables: StoreTables, accepted: AcceptedIds, action: str,
                 where: Sequence[ColumnElement[bool]], due_us: int | None, values: dict[str, Any],
                 batch: int = BULK_BATCH, tiered: bool = False, history: DeliveryHistory | None = None,
                 wake: bool = False) -> None:
        self.db, self.tables, self.accepted, self.action = db, tables, accepted, action
        self.wake = wake
        self.history = history  # where a cancel's rows are recorded
        self.where, self.due_us, self.values, self.batch = list(where), due_us, values, batch
        self.tiered = tiered
        self.listed: list[str] = []
        self.left: list[str] = []
        self.count = 0
        self.batches = 0
        self.expected = 0
        self._started = self._said = time.monotonic()

    def run(self) -> BatchedChange:
        """Every pass; returns itself."""
        for number in range(1, PASSES + 1):
            tiers, ids = self._selected()
            if not ids:
                break
            if number == 1:
                self.expected = len(ids)
                log.info("%s: %d messages selected; changing them %d at a time", self.action, len(ids), self.batch)
            for start in range(0, len(ids), self.batch):
                self._change(tiers[start:start + self.batch], ids[start:start + self.batch])
        else:
            t = self.tables.messages
            with self.db.errors(self.action), self.db.engine.connect() as conn:
                self.left = list(conn.execute(select(t.c.message_id).where(*self.where).limit(LISTED + 1)).scalars())
        took = time.monotonic() - self._started
        log.info("%s: %d messages in %d batches of at most %d, %.1f s (%.0f/s)", self.action, self.count,
                 self.batches, self.batch, took, self.count / took if took > 0 else 0.0)
        return self

    def _selected(self) -> tuple[array[int], array[int]]:
        """(partitions, ids) of the rows selected now, in that order: one read, one snapshot."""
        t = self.tables.messages
        order = [t.c.tier, t.c.id] if self.tiered else [t.c.id]
        tiers, ids = array("h"), array("q")
        with self.db.errors(self.action), self.db.engine.connect() as conn:
            rows = conn.execution_options(yield_per=_READ_CHUNK).execute(
                select(*order).where(*self.where).order_by(*order))
            for part in rows.partitions():
                for row in part:
                    tiers.append(row[0] if self.tiered else 0)
                    ids.append(row[-1])
        return tiers, ids

    def _change(self, tiers: Sequence[int], ids: Sequence[int]) -> None:
        t = self.tables.messages
        # The partitions by value (literals): PostgreSQL then looks for the ids in those one or two, not in each of
        # the store's hundred and more (its hours).
        chosen: ColumnElement[bool] = t.c.id.in_(list(ids))
        if self.tiered:
            chosen = and_(t.c.tier.in_(sorted(set(tiers))), chosen)
        cancel = self.due_us is None and not self.values
        plain = delete(t) if cancel else update(t).values(**self.values)
        statement = plain.where(chosen, *self.where).returning(*removed_columns(t))

        def work(conn: Connection) -> tuple[int, list[str]]:
            now_us = to_us(self.db.clock())
            if not cancel and self.due_us is None:  # a pause or a resume: the due times and the ids' guards stay
                rows = conn.execute(statement).all()
                ids = [r.message_id for r in rows]
                if rows and self.wake and self.db.is_postgres:
                    conn.execute(select(func.pg_notify(self.tables.channel, str(min(r.due_at_us for r in rows)))))
            elif self.db.is_postgres:
                # The change, the ids it keeps and its history in one statement: 10,000 rows need not go to the client
                # and back.
                changed = statement.cte("changed")
                kept = self.accepted.kept_from(changed, self.due_us)
                recorded = self.history.cancelled_from(conn, changed, now_us) if cancel and self.history else None
                if recorded is not None:
                    kept = kept.add_cte(recorded.cte("recorded"))
                ids = list(conn.execute(kept).scalars())
                if ids and not cancel:  # pumps asleep past the new time wake
                    conn.execute(select(func.pg_notify(self.tables.channel, str(self.due_us))))
            else:
                rows = conn.execute(statement).all()
                if self.due_us is None:
                    settle_cancelled(conn, rows, now_us, self.accepted, self.history)
                else:
                    self.accepted.moved(conn, ((r.message_id, self.due_us, r.stored_at_us) for r in rows))
                ids = [r.message_id for r in rows]
            # Only once committed: a transaction tried again (in_transaction) lists nothing twice.
            return len(ids), ids[:max(0, LISTED + 1 - len(self.listed))]

        changed, listed = in_transaction(self.db, self.action, work)
        self.count += changed
        self.listed.extend(listed)
        self.batches += 1
        self._progress()

    def _progress(self) -> None:
        now = time.monotonic()
        if now - self._said < PROGRESS_EVERY:
            return
        self._said = now
        rate = self.count / (now - self._started)
        left = max(0, self.expected - self.count)
        eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
        log.info("%s: %d of about %d messages in %d batches, %.0f/s, ETA %s", self.action, self.count,
                 self.expected, self.batches, rate, eta)
