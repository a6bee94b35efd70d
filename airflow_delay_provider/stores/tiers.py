"""The two partitions of a PostgreSQL store's messages: `_soon` and `_later`, and the move from one to the other.

A store under steady churn with mixed delays (seconds to a day) kept every message in one table: the space of each
delivered row was reused by the next insert wherever it was, so over hours the rows due within the minute spread
over all the pages of a table of millions, and every claim, every vacuum pass and every first change to a page
after a checkpoint (a full page image in the WAL) touched more of them. The cost per message grew all through an
hour-long run at a steady rate and a level backlog.

So messages due more than `SOON_US` after they are stored go to `_later`, which only takes inserts and this move,
and the rest to `_soon`, which stays small (minutes of messages) and takes the claims' churn. `LaterMessages` moves
`_later`'s rows into `_soon` when they come within `SOON_US` of their due time, in batches, each in one statement
on the partitioned table (`DELETE ... RETURNING` then `INSERT`), so the backlog counts' triggers see a move as -n
and +n.

The claims read `_soon` only while this process knows `_later` holds nothing they could take: after each move it
looks for `_later`'s earliest claimable row due within `CLEAR_US` and leaves `_later` out of the claims until then
(`clear_until_us`). Every row that reaches `_later` later is due more than `SOON_US` after its sender's clock, so
past that bound. Otherwise (no move for `CLEAR_US`: a process that has just started, a move that fails, or a due
row the move cannot take, such as one a sweep's expired lease left) the claims read both partitions, so a row the
move has not reached is still claimed on time, from `_later`. Leaving `_later` out is what keeps claims flat
through hours of churn: its due index holds the dead entries of every moved row until a vacuum of millions of
rows gets to them, and claims that read it paid for each (the planner's probe of the index's end, the scan from
where claims start): in an hour-long soak the claims' p99 lateness rose by 39% with `_later`'s vacuums.

Rows the move and a claim both want are never waited for: each skips the other's locked rows. Rows a sweep holds
(`claim_id` set) are not moved: the sweep removes them by key later; those it releases when it ends go to the
partition of their due time, and those it retries are moved like any other (a sweep's retry due within seconds of
a row still in `_later` waits for the next move, 5 s at most, or goes with claims that read both). A reschedule
puts each row in the partition of its new due time (PostgreSQL moves a row whose partition key changes). A cancel
or reschedule that reaches a row the move has locked finds it gone and, at its next pass, in `_soon`
(stores/backlog.py makes several passes). One that waited for a row another transaction moved to the other
partition by changing its due time (a concurrent reschedule, a sweep's release) is failed by PostgreSQL (SQLSTATE
40001) and rolled back; the backlog's actions then run again in a new transaction.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable

from sqlalchemy import Select, text

from airflow_delay_provider.stores.background import BackgroundWork
from airflow_delay_provider.stores.engine import Database
from airflow_delay_provider.stores.tables import LATER, SOON, SOON_US, StoreTables, to_us

log = logging.getLogger(__name__)

#: How often a process moves what came within `SOON_US` of its due time (seconds).
MOVE_EVERY_SECONDS = 5.0
#: Rows per move statement.
MOVE_BATCH = 10_000
#: How long after a look at `_later` the claims may leave it out (microseconds), at most: rows sent to `_later`
#: since are due more than `SOON_US` after their sender's clock, so this covers a send that took `SOON_US -
#: CLEAR_US` (30 s) from its clock reading to its commit. Moves every 5 s renew it long before it runs out.
CLEAR_US = SOON_US // 2
_COLUMNS = "id, message_id, destination, body, headers, due_at_us, stored_at_us, failures, claim_id"


class LaterMessages(BackgroundWork):
    """Moves one store's `_later` messages into `_soon` as they come due (PostgreSQL, schema version 8 on)."""

    thread_name = "delay-store-move"

    def __init__(self, db: Database, tables: StoreTables, earliest: Callable[[int], Select[int]]) -> None:
        """:param earliest: the query of the earliest due time a claim could take, given now (µs)."""
        super().__init__()
        self.db = db
        self.tables = tables
        self._earliest = earliest
        #: Until when (the database's clock, µs) `_later` holds no row the claims could take.
        self.clear_until_us = -math.inf
        messages, later = db.qualified(tables.messages.name), db.qualified(tables.later.name)
        # The rows of _later due before :until (not a sweep's), oldest first, skipping any a claim holds; a row
        # already in _soon under the same id (a send of an id stored longer ago than the de-duplication window)
        # is kept there and the moved one dropped, so the store never holds an id twice after a move.
        self._move = text(
            f"WITH moved AS (DELETE FROM {messages} WHERE tier = {LATER} AND id = ANY(ARRAY("
            f"SELECT id FROM {later} WHERE due_at_us < :until AND claim_id IS NULL "
            f"ORDER BY due_at_us LIMIT :n FOR UPDATE SKIP LOCKED)) RETURNING {_COLUMNS}), "
            f"kept AS (INSERT INTO {messages} ({_COLUMNS}, tier) SELECT {_COLUMNS}, {SOON} FROM moved "
            "ON CONFLICT DO NOTHING RETURNING 1) "
            "SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM kept)")
        digest = hashlib.sha1(f"airflow_delay_provider.tiers:{messages}".encode()).digest()
        self._key = int.from_bytes(digest[:8], "big", signed=True)

    def interval(self) -> float:
        return MOVE_EVERY_SECONDS

    def run(self) -> int:
        """Move everything due within `SOON_US`, batch by batch; returns how many rows left `_later`."""
        moved = 0
        try:
            while (taken := self.move_batch(MOVE_BATCH)) is not None:
                moved += taken
                if taken < MOVE_BATCH:
                    break
            self.look()
        except Exception as exc:  # an outage or a migration: the claims read _later too once the look runs out
            log.warning("moving messages due soon of %r skipped: %s", self.db, exc)
        if moved:
            log.debug("moved %d messages due within %d s into %s", moved, SOON_US // 1_000_000,
                      self.db.qualified(self.tables.soon.name))
        return moved

    def look(self) -> None:
        """Find until when claims may leave `_later` out: its earliest row a claim could take, or `CLEAR_US` from
        now. A row moved by another process meanwhile, or still being moved, only makes this earlier."""
        now = to_us(self.db.clock())
        horizon = now + CLEAR_US
        t = self.tables.messages
        first = self._earliest(now).where(self.tables.in_tier(LATER), t.c.due_at_us < horizon)
        with self.db.errors("look at messages due later"), self.db.engine.begin() as conn:
            self.db.in_index_order(conn)
            value = conn.execute(first).scalar()
        self.clear_until_us = horizon if value is None else value

    def move_batch(self, limit: int) -> int | None:
        """One move of up to `limit` rows, in a transaction of its own; returns how many left `_later`, or None
        when another process of the store is moving (one at a time: a transaction's advisory lock)."""
        until = to_us(self.db.clock()) + SOON_US
        with self.db.errors("move messages due soon"), self.db.engine.begin() as conn:
            if not conn.execute(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": self._key}).scalar():
                return None
            self.db.in_index_order(conn)
            left, kept = conn.execute(self._move, {"until": until, "n": limit}).one()
        if left != kept:
            log.info("%d messages moved due soon were already in %s under the same id: kept those", left - kept,
                     self.db.qualified(self.tables.soon.name))
        return int(left)
