"""The two partitions of a PostgreSQL store's messages: `_soon` and `_later`, and the move from one to the other;
`_later`'s partitions by due hour, and the move and truncation that keep them.

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

From schema version 9 `_later` is partitioned again, by the hour its messages are due (tables.RING_HOURS): a
partition per hour within reach (the current hour and the next 24), used in turn, and `_far` for what is due
further ahead. The move above then deletes from one partition, the current hour's, whose dead rows go by `TRUNCATE`
when its hour is past (`rest`) instead of by vacuums of all of `_later`, which grew longer through an hour of
churn (12.9 s to 60.4 s a pass in a soak) as the moved rows' free space spread over all its pages. Before it, each
run moves `_far`'s messages whose hour came within reach into that hour's partition, the same way.

Within the hour, the dead entries of the rows moved out of the current hour's partition lie at the front of its
due index, where the move and the look read every 5 s. Both start at `start_us` instead (see `look`): the earliest
row the move could take, or the last look's mark below which no send since can have written; a look from the
index's beginning, every `FULL_LOOK_SECONDS` and whenever a sweep's lease has run out, finds what else comes below.
So the upkeep does not vacuum that partition, neither in its hour nor after it until its truncation (`unvacuumed`).

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

import logging
import math
import time
from collections.abc import Callable

from sqlalchemy import Select, Table, TextClause, literal_column, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError

from airflow_delay_provider.stores.background import BackgroundWork
from airflow_delay_provider.stores.engine import LOCK_NOT_AVAILABLE, Database, advisory_key
from airflow_delay_provider.stores.tables import (
    FIRST_HOUR,
    HOUR_US,
    RING_HOURS,
    SOON,
    SOON_US,
    StoreTables,
    hour_tier,
    hour_tier_rows,
    ring_until,
    to_us,
)

log = logging.getLogger(__name__)

#: How often a process moves what came within `SOON_US` of its due time (seconds).
MOVE_EVERY_SECONDS = 5.0
#: Rows per move statement.
MOVE_BATCH = 10_000
#: Move statements from `_far` into the hours' partitions per run, at most (100,000 rows every 5 s).
FAR_BATCHES_PER_RUN = 10
#: How long after a look at `_later` the claims may leave it out (microseconds), at most: rows sent to `_later`
#: since are due more than `SOON_US` after their sender's clock, so this covers a send that took `SOON_US -
#: CLEAR_US` (30 s) from its clock reading to its commit. Moves every 5 s renew it long before it runs out.
CLEAR_US = SOON_US // 2
#: How often the look reads `_later`'s due index from its beginning (seconds), at least; see `LaterMessages.look`.
FULL_LOOK_SECONDS = 60.0
#: How long before the move reaches the next hour's partition (`SOON_US` before the turn) it starts reading that
#: partition's pages into memory, a piece each run (seconds); see `LaterMessages.warm`.
WARM_AHEAD_SECONDS = 540.0
#: How long before a sleeping process wakes (µs) it starts the move and the look when the last look's bound would
#: lapse by then; see `LaterMessages.look_before`.
LOOK_BEFORE_WAKE_US = 1_000_000
_COLUMNS = "id, message_id, destination, body, headers, due_at_us, stored_at_us, failures, claim_id"


class LaterMessages(BackgroundWork):
    """Moves one store's `_later` messages into `_soon` as they come due (PostgreSQL, schema version 8 on); from
    schema version 9 also those of `_far` into their hour's partition as it comes within reach, and truncates the
    partition of the hour just past."""

    thread_name = "delay-store-move"

    def __init__(self, db: Database, tables: StoreTables, earliest: Callable[[int], Select[int]],
                 ringed: Callable[[], bool] = lambda: False) -> None:
        """:param earliest: the query of the earliest due time a claim could take, given now (µs).
        :param ringed: whether `_later` is in partitions by due hour (schema version 9)."""
        super().__init__()
        self.db = db
        self.tables = tables
        self._earliest = earliest
        self.ringed = ringed
        #: Until when (the database's clock, µs) `_later` holds no row the claims could take.
        self.clear_until_us = -math.inf
        #: The hour (µs since the epoch, divided by HOUR_US) whose resting partition was last truncated.
        self.rested_hour: int | None = None
        #: Where the move and the look start reading `_later`'s due index (µs): no row the move could take lies
        #: below it, as of the last look (see `look`).
        self.start_us = 0
        self._mark_us = 0
        self._next_full = -math.inf
        self._full_every = FULL_LOOK_SECONDS
        self._full_at_us = 0
        self._full_again = False
        #: The next hour's partition read so far ahead of its turn: (hour, pages read, pages it had at the start).
        self._warmed = (-1, 0, 0)
        self._vacuum_named: int | None = None  # the hour whose truncation was last said to wait for a vacuum
        self._tid_ranges: bool | None = None  # whether the server reads a range of pages alone (PostgreSQL 14 on)
        messages = db.qualified(tables.messages.name)
        self._pick_later = self._picking(db.qualified(tables.later.name))
        self._pick_far = self._picking(db.qualified(tables.far.name))
        self._into_soon = self._moving(str(SOON))
        self._into_hours = self._moving(str(hour_tier_rows(literal_column("due_at_us"))
                                            .compile(dialect=db.engine.dialect)))
        self._key = advisory_key(f"airflow_delay_provider.tiers:{messages}")

    @staticmethod
    def _picking(source_table: str) -> TextClause:
        """The rows of `source_table` due before :until (not a sweep's), oldest first, skipping any a claim holds,
        locked: each one's partition (`tier`) and place in it (`ctid`), which the lock keeps where it is."""
        return text(f"SELECT tier, ctid::text FROM {source_table} WHERE due_at_us >= :start AND due_at_us < :until "
                    "AND claim_id IS NULL ORDER BY due_at_us LIMIT :n FOR UPDATE SKIP LOCKED")

    def _moving(self, tier: str) -> TextClause:
        """Move the rows picked in one partition (:tier, :tids) into partition `tier` (an SQL expression).

        By their place, not their id: `id = ANY(...)` over the partitioned table looked each id up in every
        partition, and in the current hour's, once an analyse had found it all but empty (237 live rows among
        690,000 dead in a soak, a minute before the turn of the hour), the planner took its due index for the
        lookup (id is its second column) and read all of it for each id: one move of 5,388 rows read 23.7 million
        buffers for 26 s, and the claims waiting for it then did the same. A TID scan of the one partition has no
        index to choose. A row already in the target partition under the same id (a send of an id stored longer
        ago than the de-duplication window) is kept there and the moved one dropped, so the store never holds an
        id twice after a move."""
        messages = self.db.qualified(self.tables.messages.name)
        return text(
            f"WITH moved AS (DELETE FROM {messages} WHERE tier = :tier AND ctid = ANY(CAST(:tids AS tid[])) "
            f"RETURNING {_COLUMNS}), "
            f"kept AS (INSERT INTO {messages} ({_COLUMNS}, tier) SELECT {_COLUMNS}, {tier} FROM moved "
            "ON CONFLICT DO NOTHING RETURNING 1) "
            "SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM kept)")

    def unvacuumed(self) -> tuple[Table, ...]:
        """The partitions its upkeep does not vacuum: the current hour's and the hour past's (from schema version 9).

        The dead rows of the current hour's are those the move took out, behind `start_us`, where neither the move
        nor the look reads, and its `TRUNCATE` once the hour is past (`rest`) removes them all at once; a vacuum of
        it read every page of a partition of over a million rows every few minutes (25-44 s each on a slow disk in
        a soak). It is still analysed: the planner's picture of it otherwise keeps the rows of the hour as they were
        before it began, and a count of the messages due now, which reads every partition's due index up to now,
        then read all of this one (a parallel sequential scan of 75,000 pages at every progress report of a pump,
        from the fifth minute of the hour in a soak).

        The hour past's is the one `rest` truncates once the move has emptied it, seconds after the turn: in a soak
        the checks at two turns vacuumed its 1.0 and 2.8 million dead rows for 18 and 76 s, and `rest`, which never
        waits for a lock, truncated it only after each. One that `rest` cannot empty (a row a sweep holds) is
        vacuumed from the next hour on."""
        hour = to_us(self.db.clock()) // HOUR_US
        return self._partition_of(hour), self._partition_of(hour - 1)

    def growing(self) -> tuple[Table, ...]:
        """The partitions that only take inserts until their hour comes: those of the hours after the current one
        (from schema version 9). Their upkeep analyses them less often (`Thresholds.growing_analyze_fraction`)."""
        hour = to_us(self.db.clock()) // HOUR_US
        return tuple(self._partition_of(hour + ahead) for ahead in range(1, RING_HOURS - 1))

    def _partition_of(self, hour: int) -> Table:
        """The partition of `_later` that holds the messages due in `hour` (µs since the epoch // HOUR_US)."""
        return self.tables.hours[hour_tier(hour * HOUR_US) - FIRST_HOUR]

    def interval(self) -> float:
        return MOVE_EVERY_SECONDS

    def run(self) -> int:
        """Move everything due within `SOON_US`, batch by batch; then (schema version 9) up to
        `FAR_BATCHES_PER_RUN` batches of what came within the hours' reach, and truncate the resting hour's
        partition. Returns how many rows left `_later` for `_soon`."""
        moved = 0
        try:
            moved = self._move_all(self.move_batch)
            self.look()
            if self.ringed():
                # After the move into `_soon` (which takes `_far`'s rows due within the minute too), and bounded:
                # after an upgrade `_far` may hold millions within reach, and the next run goes on.
                self._move_all(self.move_far_batch, FAR_BATCHES_PER_RUN)
                self.rest()
                self.warm()
        except Exception as exc:  # an outage or a migration: the claims read _later too once the look runs out
            log.warning("moving messages due soon of %r skipped: %s", self.db, exc)
        if moved:
            log.debug("moved %d messages due within %d s into %s", moved, SOON_US // 1_000_000,
                      self.db.qualified(self.tables.soon.name))
        return moved

    @staticmethod
    def _move_all(batch: Callable[[int], int | None], most: float = math.inf) -> int:
        moved, done = 0, 0
        while done < most and (taken := batch(MOVE_BATCH)) is not None:
            moved, done = moved + taken, done + 1
            if taken < MOVE_BATCH:
                break
        return moved

    def look(self) -> None:
        """Find until when claims may leave `_later` out: its earliest row a claim could take, or `CLEAR_US` from
        now. A row moved by another process meanwhile, or still being moved, only makes this earlier.

        Each look also reads where the move and the next look start (`start_us`): the current hour's partition
        holds the dead entries of every row moved out of it in its due index, in front of its live ones, until a
        vacuum removes them, and reads from the index's beginning every 5 s passed over them all (hundreds of
        thousands under steady churn). The start is the earliest row the move could take (any a claim holds
        too: this read skips no lock), or the mark of the look before if lower: the database's clock then plus
        `CLEAR_US`, below which no send since can have put a row into `_later` (each is due more than `SOON_US`
        after its sender's clock, and takes at most `SOON_US - CLEAR_US` from that reading to its commit; a
        sweep's release and a reschedule write due times as sends do).

        What only comes below the start otherwise, the rows of a sweep whose lease has run out, is found by a
        look from the index's beginning: when a lease ran out since the last such look, while such looks still
        find rows the start would miss, and every `FULL_LOOK_SECONDS` (or ten times as long as the last one
        took) in any case."""
        now = to_us(self.db.clock())
        horizon = now + CLEAR_US
        t, s = self.tables.messages, self.tables.sweeps
        first = self._earliest(now).where(self.tables.in_later(), t.c.due_at_us < horizon)
        movable = (select(t.c.due_at_us).where(self.tables.in_later(), t.c.claim_id.is_(None))
                   .order_by(t.c.due_at_us).limit(1))
        lapsed = select(s.c.claim_id).where(s.c.lease_until_us < now, s.c.lease_until_us >= self._full_at_us)
        started = time.monotonic()
        with self.db.errors("look at messages due later"), self.db.engine.begin() as conn:
            self.db.in_index_order(conn)
            full = (started >= self._next_full or self._full_again
                    or conn.execute(lapsed.limit(1)).first() is not None)
            walk_from = 0 if full else self.start_us
            low = conn.execute(movable.where(t.c.due_at_us >= walk_from)).scalar()
            # Below `low` a claim could take only a lapsed lease's rows, which a full look finds.
            value = (conn.execute(first).scalar() if full
                     else None if low is None else conn.execute(first.where(t.c.due_at_us >= low)).scalar())
        if full:
            self._full_again = value is not None and (low is None or value < low)
            self._full_at_us = now
            self._full_every = max(FULL_LOOK_SECONDS, 10 * (time.monotonic() - started))
            self._next_full = started + self._full_every
        self.start_us = self._mark_us if low is None else min(low, self._mark_us)
        self._mark_us = horizon
        self.clear_until_us = horizon if value is None else value

    def look_before(self, wake_us: int) -> int | None:
        """When (the database's clock, µs) a process asleep until `wake_us` should start the move and the look, or
        None: when the last look's bound lapses before a second after the wake. Moves run only while a pump is
        awake, and one that slept longer than `CLEAR_US` woke with the bound lapsed: the first claims of the burst
        it woke for read every partition, and the burst's rows, if the move had not reached them, from `_later`."""
        at = wake_us - LOOK_BEFORE_WAKE_US
        if self.clear_until_us >= wake_us + LOOK_BEFORE_WAKE_US or at <= to_us(self.db.clock()):
            return None
        return at

    def move_batch(self, limit: int) -> int | None:
        """One move of up to `limit` rows due within `SOON_US` into `_soon`, in a transaction of its own; returns
        how many left `_later`, or None when another process of the store is moving (one at a time: a
        transaction's advisory lock)."""
        return self._move_batch(self._pick_later, self._into_soon, to_us(self.db.clock()) + SOON_US, limit,
                                self.tables.soon.name)

    def move_far_batch(self, limit: int) -> int | None:
        """One move of up to `limit` rows of `_far` that came within the hours' reach into their hour's partition
        (schema version 9); returns how many left `_far`, or None as `move_batch`."""
        return self._move_batch(self._pick_far, self._into_hours, ring_until(to_us(self.db.clock())), limit,
                                "the hours' partitions")

    def _move_batch(self, pick: TextClause, move: TextClause, until: int, limit: int, into: str) -> int | None:
        left = kept = 0
        with self.db.errors("move messages due soon"), self.db.engine.begin() as conn:
            if not conn.execute(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": self._key}).scalar():
                return None
            self.db.in_index_order(conn)
            picked: dict[int, list[str]] = {}
            for tier, tid in conn.execute(pick, {"start": self.start_us, "until": until, "n": limit}):
                picked.setdefault(tier, []).append(tid)
            for tier, tids in picked.items():  # one partition, or two across the turn of an hour
                gone, stayed = conn.execute(move, {"tier": tier, "tids": tids}).one()
                left, kept = left + gone, kept + stayed
        if left != kept:
            log.info("%d messages moved were already in %s under the same id: kept those", left - kept, into)
        return int(left)

    def warm(self, now_us: int | None = None) -> tuple[int, int] | None:
        """Read a piece of the next hour's partition, in the order of its pages, so that by the time the move
        reaches it (`SOON_US` before the turn) all of it has been read once in the `WARM_AHEAD_SECONDS` before
        (schema version 9, PostgreSQL 14 on). Returns the pages read (first, end), or None.

        Its rows were written through the day in the order they were sent, so those due in any one minute lie on
        pages all over it, and from the turn on the move reads nearly every page of it within minutes, in due
        order: each a read at random from the disk once the page cache has let the partition go (in a soak at
        5,420 msg/s, a move's pick of 10,000 rows a minute before the turn waited 6.0 s on the disk, and the
        claims' p99 lateness went past 2 s). Read here by ranges of pages (a TID range scan), they are sequential
        reads, a little each run, while the move has nothing to wait for."""
        now = to_us(self.db.clock()) if now_us is None else now_us
        hour = now // HOUR_US + 1
        left = hour * HOUR_US - SOON_US - now
        if not 0 < left <= WARM_AHEAD_SECONDS * 1_000_000:
            return None
        partition = self.db.qualified(self._partition_of(hour).name)
        with self.db.errors("read the next hour's messages ahead"), self.db.engine.begin() as conn:
            if self._tid_ranges is None:
                self._tid_ranges = int(conn.execute(text("SHOW server_version_num")).scalar_one()) >= 140_000
            if not self._tid_ranges:
                return None
            if self._warmed[0] != hour:
                pages = conn.execute(text("SELECT pg_relation_size(:t) / 8192"), {"t": partition}).scalar_one()
                self._warmed = (hour, 0, int(pages))
            _, done, pages = self._warmed
            if done >= pages:
                return None
            # The same share of what is left at each run, so the last piece ends as the move comes.
            runs = max(1.0, left / (MOVE_EVERY_SECONDS * 1_000_000))
            end = min(pages, done + math.ceil((pages - done) / runs))
            conn.execute(text(f"SELECT count(*) FROM {partition} WHERE ctid >= CAST(:first AS tid) "
                              "AND ctid < CAST(:end AS tid)"), {"first": f"({done},0)", "end": f"({end},0)"})
        self._warmed = (hour, end, pages)
        return done, end

    def rest(self) -> bool:
        """Truncate the partition of the hour just past (schema version 9) once it is empty, once an hour: its
        dead rows go at once, with no vacuum. Never waits for a lock (another transaction reading all the
        partitions, a long report, a vacuum of it): the next move tries again, 5 s on. Waiting would queue every
        reader of the partition behind the lock it asks for, and a vacuum would not yield to it anyway: autovacuum
        does not vacuum these partitions (schema version 11) but to prevent wraparound, which never yields, and a
        VACUUM someone runs never does. Returns whether it truncated."""
        hour = to_us(self.db.clock()) // HOUR_US
        if self.rested_hour == hour:
            return False
        resting = self._partition_of(hour - 1)
        name = self.db.qualified(resting.name)
        # Its due index, not its heap: a read that passes over the dead entries, not a scan of every dead row.
        first = text(f"SELECT 1 FROM {name} ORDER BY due_at_us LIMIT 1")
        with self.db.errors("truncate the partition of the hour past"), self.db.engine.begin() as conn:
            if not conn.execute(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": self._key}).scalar():
                return False
            if conn.execute(first).first() is not None:
                return False  # a row a sweep holds, or one the move has not reached: at the next move
            conn.execute(text("SET LOCAL lock_timeout = '50ms'"))
            try:
                with conn.begin_nested():
                    conn.execute(text(f"LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE"))
            except OperationalError as exc:
                if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                    raise
                self._name_vacuum(conn, name, hour)
                return False
            # Under the lock nothing can add a row; one added before it is seen here.
            if conn.execute(first).first() is not None:
                return False
            conn.execute(text(f"TRUNCATE {name}"))
        self.rested_hour = hour
        log.info("truncated %s, the partition of the messages due in the hour past", name)
        return True

    def _name_vacuum(self, conn: Connection, name: str, hour: int) -> None:
        """Say, once an hour, that the truncation waits for a vacuum of the partition: autovacuum's to prevent
        wraparound (which no option turns off, nor makes yield) or one someone ran (a nightly `vacuumdb`). Other
        holders (a report reading every partition) end within moments, and are not named."""
        vacuums = conn.execute(text(
            "SELECT a.pid, a.backend_type = 'autovacuum worker', a.query LIKE '%to prevent wraparound%' "
            "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.relation = to_regclass(:t) "
            "AND l.granted AND l.pid <> pg_backend_pid() AND (a.backend_type = 'autovacuum worker' "
            "OR ltrim(lower(a.query)) LIKE 'vacuum%')"), {"t": name}).all()
        if not vacuums or self._vacuum_named == hour:
            log.debug("truncating %s waits for its readers: at the next move", name)
            return
        self._vacuum_named = hour
        pid, auto, wraparound = vacuums[0]
        who = ("autovacuum, to prevent wraparound" if wraparound else "autovacuum" if auto else "a VACUUM someone ran")
        log.info("truncating %s waits for a vacuum of it (%s, pid %s): the moves go on meanwhile, and the truncation "
                 "follows it", name, who, pid)
