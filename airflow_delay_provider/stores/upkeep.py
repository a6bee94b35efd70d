"""The store looks after its own tables on PostgreSQL: statistics after bulk loads, dead rows after deliveries.

A store is a queue: every message is inserted once and deleted once, so its tables churn at the delivery rate,
and users fill them in bulk (a backfill, a campaign). PostgreSQL's autovacuum handles that when it is on and
keeps up; but it may be switched off (it is on the PostgreSQL this project's benchmarks ran on), and by its
default thresholds (a fifth of a table) a store of millions waits hours for it. Until a table is analysed
after a bulk load the planner works from the empty table's statistics, and until it is vacuumed the space of
delivered rows is not reused and the table and its indexes grow.

So the processes that use the store see to it, within bounds: a pump calls `upkeep()` between batches; at
most every `UPKEEP_CHECK_SECONDS` one background thread sums up the backlog counts' rows of changes, reads
the tables' counters (`pg_stat_user_tables`) and runs `ANALYZE` or `VACUUM` where they passed thresholds
tuned for a queue (far lower than autovacuum's).
One process per store does it at a time (an advisory lock), it never waits for a lock a transaction holds
(`SKIP_LOCKED`, `lock_timeout`), and a pump never waits for it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError

from airflow_delay_provider.stores.background import BackgroundWork
from airflow_delay_provider.stores.engine import LOCK_NOT_AVAILABLE, Database, advisory_key

log = logging.getLogger(__name__)

#: How often a process reads the counters (seconds).
UPKEEP_CHECK_SECONDS = 15.0
#: The upkeep's sessions in pg_stat_activity: a migration cancels their work, as autovacuum yields to DDL.
APPLICATION_NAME = "airflow-delay-upkeep"
#: A session that has held a snapshot (or a transaction id) this long (seconds) is named in a warning.
OLD_SNAPSHOT_SECONDS = 60.0
#: The sessions of this database that hold back its vacuums (a condition on pg_stat_activity): a snapshot or a
#: transaction id, other than this session's; a VACUUM's own snapshot holds nothing back (PostgreSQL leaves it out).
HOLDS_BACK_VACUUM = (
    "datname = current_database() AND pid <> pg_backend_pid() "
    "AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) "
    "AND backend_type <> 'autovacuum worker' AND NOT (state = 'active' AND ltrim(lower(query)) LIKE 'vacuum%')"
)
#: How long after a rebuild gave way to an older transaction the upkeep tries none again (seconds).
REBUILD_RETRY_SECONDS = 600.0
#: The sessions named so far, as (pid, start of their transaction): each is named once per process.
_named_holders: set[tuple[Any, ...]] = set()


@dataclass(frozen=True)
class Thresholds:
    """When a table needs work: a base count plus a fraction of its rows, as autovacuum counts, but lower.
    Inserts alone call for no vacuum here: the claims need statistics, not the visibility map."""

    analyze_base: int = 1_000
    analyze_fraction: float = 0.02
    #: Tables that only take inserts until their turn comes (the partitions of the hours after the current one): at
    #: 2% each of the 24 was analysed every few minutes as it filled, each analyse reading up to 30,000 of its pages
    #: at random (the next hour's, 2.4 million rows, for 8.2 s in a soak). At a fifth its histogram keeps its
    #: shape: the rows' due times spread over the hour from its first inserts on.
    growing_analyze_fraction: float = 0.2
    vacuum_base: int = 10_000
    vacuum_fraction: float = 0.02
    #: Tables emptied whole another way: a pass over a partition of two million rows scans its every index, and
    #: near the end of its hour few rows are left, so 2% of them would call for one every few seconds.
    emptied_vacuum_base: int = 100_000
    emptied_vacuum_fraction: float = 0.2
    #: An index is rebuilt when it takes this many times the pages its entries would fill packed (2,000,000 random
    #: UUIDs stored in batches took 1.3 times), and at least `rebuild_min_pages` more (16 MB).
    rebuild_ratio: float = 1.5
    rebuild_min_pages: int = 2_048

    def rebuild(self, pages: int, packed: float) -> bool:
        return pages > self.rebuild_ratio * packed and pages - packed > self.rebuild_min_pages

    def work(self, live: int, dead: int, modified: int, emptied: bool = False, growing: bool = False) -> list[str]:
        """What a table with these counters needs, in order: "vacuum" and/or "analyze".

        :param emptied: the table is emptied whole another way (`TableUpkeep`'s `emptied`).
        :param growing: the table only takes inserts for now (`TableUpkeep`'s `growing`)."""
        rows = max(live, 0)
        todo = []
        base, fraction = ((self.emptied_vacuum_base, self.emptied_vacuum_fraction) if emptied
                          else (self.vacuum_base, self.vacuum_fraction))
        if dead > base + fraction * rows:
            todo.append("vacuum")
        changed = self.growing_analyze_fraction if growing else self.analyze_fraction
        if modified > self.analyze_base + changed * rows:
            todo.append("analyze")
        return todo


class TableUpkeep(BackgroundWork):
    """The upkeep of one set of tables (a store's, or the SQL-table queues'), on their database.

    :param kept: the tables to vacuum, the first one the table that names the set (called at each check: a
        store's set grows when it is migrated).
    :param rebuilt: those of them whose B-tree indexes may grow sparse (see `_rebuild_sparse_indexes`).
    :param analyzed: those whose queries need fresh statistics (the others are read by key); default: all kept.
    :param emptied: those emptied whole another way (the hours' partitions of `_later`, truncated once their hour is
        past): vacuumed only past `Thresholds.emptied_vacuum_base` and `emptied_vacuum_fraction`, so that the dead
        entries their readers pass over stay few without a pass every few thousand rows.
    :param unvacuumed: those of them not to vacuum at this check, only to analyse (called at each check: the current
        hour's partition of `_later` and the hour past's, see `LaterMessages.unvacuumed`).
    :param growing: those of them that only take inserts for now, analysed less often (called at each check: the
        partitions of the hours after the current one, see `LaterMessages.growing`).
    :param before: work to do at each check, before the counters are read.
    """

    thread_name = "delay-store-upkeep"

    def __init__(self, db: Database, kept: Callable[[], Sequence[Table]], rebuilt: Sequence[Table] = (),
                 analyzed: Sequence[Table] | None = None, emptied: Sequence[Table] = (),
                 unvacuumed: Callable[[], Sequence[Table]] = tuple, growing: Callable[[], Sequence[Table]] = tuple,
                 before: Callable[[Connection], object] | None = None) -> None:
        super().__init__()
        self.db = db
        self.kept = kept
        self.rebuilt = tuple(rebuilt)
        self.analyzed = None if analyzed is None else tuple(analyzed)
        self.emptied = tuple(emptied)
        self.unvacuumed = unvacuumed
        self.growing = growing
        self.before = before
        self.thresholds = Thresholds()
        self._rebuild_after = -math.inf

    def __repr__(self) -> str:
        return f"TableUpkeep({self.db!r})"

    def interval(self) -> float:
        return UPKEEP_CHECK_SECONDS

    def start(self) -> None:
        """Start the check in a background thread when it is time (never blocks; PostgreSQL only)."""
        if self.db.is_postgres:
            super().start()

    def run(self) -> list[tuple[str, str, float]]:
        """Check the counters and do what they call for; returns (table, work, seconds) of what was done."""
        # SKIP_LOCKED passes over a table someone holds with a warning, not an error.
        skipped: list[str] = []

        def on_notice(notice: Any) -> None:
            if "skipping" in (notice.message_primary or ""):
                skipped.append(notice.message_primary)

        try:
            # Translated: a failed statement is logged by what it did, never by its text.
            with self.db.errors("look after its tables"), \
                    self.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                key = self.key()
                if not conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": key}).scalar():
                    return []  # another process is at it
                driver: Any = conn.connection.driver_connection
                driver.add_notice_handler(on_notice)
                try:
                    # Never queued behind a lock; named, so that a migration can cancel it; paced as autovacuum
                    # paces itself (a manual VACUUM is not), so pumps keep the disk.
                    conn.execute(text(f"SET lock_timeout = '2s'; SET application_name = '{APPLICATION_NAME}'; "
                                      "SET vacuum_cost_delay = '2ms'"))
                    return self._do_upkeep(conn, skipped)
                finally:
                    # The connection goes back to the pool: its next user gets the server's settings.
                    driver.remove_notice_handler(on_notice)
                    conn.execute(text("RESET lock_timeout; RESET application_name; RESET vacuum_cost_delay"))
                    conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
        except Exception as exc:  # an outage, a lock, a migration: the pumps meet outages under their breakers
            log.warning("upkeep of %r skipped: %s", self.db, exc)  # repr: no password, no query of an unreachable db
            return []

    def _do_upkeep(self, conn: Connection, skipped: list[str]) -> list[tuple[str, str, float]]:
        done = []
        self.name_old_snapshots(conn)
        if self.before is not None:
            self.before(conn)
        for table in self.rebuilt:
            done.extend(self._rebuild_sparse_indexes(conn, table))
        analyzed = self.kept() if self.analyzed is None else self.analyzed
        unvacuumed, growing = self.unvacuumed(), self.growing()
        for table in self.kept():
            row = conn.execute(text(
                "SELECT n_live_tup, n_dead_tup, n_mod_since_analyze FROM pg_stat_user_tables "
                "WHERE relid = to_regclass(:name)"), {"name": self.db.qualified(table.name)}).first()
            if row is None:
                continue
            live, dead, modified = row
            for work in self.thresholds.work(live, dead, modified, emptied=table in self.emptied,
                                             growing=table in growing):
                if (work == "analyze" and table not in analyzed) or (work == "vacuum" and table in unvacuumed):
                    continue
                started = time.monotonic()
                # Identifiers come from the store's checked names, quoted by the dialect.
                statement = "VACUUM (SKIP_LOCKED)" if work == "vacuum" else "ANALYZE (SKIP_LOCKED)"
                conn.exec_driver_sql(f"{statement} {self.db.qualified(table.name)}")
                took = time.monotonic() - started
                if skipped:
                    log.info("upkeep: %s of %s skipped: %s", work, self.db.qualified(table.name), skipped.pop())
                    continue
                done.append((table.name, work, took))
                log.info("upkeep: %s %s in %.1f s (%d rows, %d dead, %d changed since analysed)",
                         work, self.db.qualified(table.name), took, row[0], row[1], row[2])
        return done

    def name_old_snapshots(self, conn: Connection) -> list[dict[str, Any]]:
        """Warn, once each, of the sessions and prepared transactions of this database that have held a snapshot or a
        transaction id for more than `OLD_SNAPSHOT_SECONDS` (a backup, a report, a session left idle in a
        transaction, an index rebuild): until they end, no row deleted since can be vacuumed, so the tables and
        their indexes grow with every delivery. Claims and receives keep their speed (they start past the dead
        entries), so nothing else would show it. Returns what it found."""
        holders = conn.execute(text(
            "SELECT pid, coalesce(nullif(application_name, ''), backend_type) AS application, state, "
            "extract(epoch FROM now() - xact_start)::float8 AS seconds, xact_start AS since FROM pg_stat_activity "
            f"WHERE {HOLDS_BACK_VACUUM} AND xact_start < now() - make_interval(secs => :seconds) "
            "UNION ALL SELECT NULL, 'prepared transaction ' || quote_literal(gid), 'prepared', "
            "extract(epoch FROM now() - prepared)::float8, prepared FROM pg_prepared_xacts "
            "WHERE database = current_database() AND prepared < now() - make_interval(secs => :seconds) "
            "ORDER BY seconds DESC"), {"seconds": OLD_SNAPSHOT_SECONDS}).mappings().all()
        for holder in holders:
            key = (holder["pid"], holder["since"])
            if key in _named_holders:
                continue
            _named_holders.add(key)
            if holder["pid"] is None:
                who, see = holder["application"], "COMMIT PREPARED or ROLLBACK PREPARED it"
            else:
                who = f"session pid {holder['pid']} ({holder['application']}, {holder['state']})"
                see = f"end it, or see why it stays open: SELECT * FROM pg_stat_activity WHERE pid = {holder['pid']}"
            log.warning("%s has held a snapshot for %.0f s: the rows of %s delivered since cannot be vacuumed until it "
                        "ends, so its tables and indexes grow with every delivery (claims keep their speed); %s",
                        who, holder["seconds"], self.kept_names()[0], see)
        if len(_named_holders) > 10_000:  # a process that lives for years
            _named_holders.clear()
        return [dict(h) for h in holders]

    def _rebuild_sparse_indexes(self, conn: Connection, table: Table) -> list[tuple[str, str, float]]:
        """REINDEX CONCURRENTLY the table's unique B-tree indexes that take more than `Thresholds.rebuild_ratio`
        times the pages their entries would fill packed. Writes go on meanwhile (the new index is built beside the
        old one).

        Why: a B-tree page is only reused once every entry on it is gone. The store's id and message-id indexes
        take new entries at their right edge (ids and default message ids grow with time), and messages with
        mixed delays leave each page with the few entries due hours later: with delays of 1 s to a day these
        indexes grew by 20 MB a minute at 6,700 msg/s, for as long as the longest delay, while the table and
        the due index stayed the same size (VACUUM reuses a heap page's free space, and the due index empties
        from its left edge: its emptied pages are reused, though the file keeps its size, which is why it is not
        judged by its size here)."""
        name = self.db.qualified(table.name)
        for (leftover,) in conn.execute(text(
                "SELECT indexrelid::regclass::text FROM pg_index JOIN pg_class ON pg_class.oid = indexrelid "
                "WHERE indrelid = to_regclass(:t) AND NOT indisvalid AND relname ~ '_cc(new|old)[0-9]*$' "
                "AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.relid = indrelid)"),
                {"t": name}):
            # What an interrupted REINDEX CONCURRENTLY leaves: an invalid copy that writes still maintain.
            conn.exec_driver_sql(f"DROP INDEX CONCURRENTLY IF EXISTS {leftover} /* {name} */")
        done: list[tuple[str, str, float]] = []
        if time.monotonic() < self._rebuild_after:
            return done
        indexes = conn.execute(text(
            # The entries: the last count (VACUUM, ANALYZE), or the live rows now if more (after a bulk load, before
            # its ANALYZE, the index is full, not sparse).
            "SELECT i.indexrelid::regclass::text, pg_relation_size(i.indexrelid) / 8192, greatest(c.reltuples, "
            "(SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = i.indrelid)), "
            "array_agg(quote_ident(a.attname) ORDER BY k.n) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_am am ON am.oid = c.relam AND am.amname = 'btree' "
            "CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, n) "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            "WHERE i.indrelid = to_regclass(:t) AND i.indisvalid AND (i.indisprimary OR i.indisunique) "
            "GROUP BY 1, 2, 3"), {"t": name}).all()
        for index, pages, entries, columns in indexes:
            if pages < self.thresholds.rebuild_min_pages or entries <= 0:
                continue
            # An entry: its 8-byte header and the key, aligned to 8 bytes, and a 4-byte line pointer; leaf pages
            # filled to 90% as a build fills them. The key's width is sampled from the table's rows.
            width = conn.exec_driver_sql(
                f"SELECT avg(pg_column_size(ROW({', '.join(columns)})) - 24) FROM (SELECT {', '.join(columns)} "
                f"FROM {name} TABLESAMPLE SYSTEM (1) LIMIT 1000) AS sampled").scalar()
            if width is None:
                continue
            packed = entries * ((8 + float(width) + 7) // 8 * 8 + 4) / (8192 * 0.9 - 24)
            if not self.thresholds.rebuild(pages, packed):
                continue
            started = time.monotonic()
            try:
                conn.exec_driver_sql(f"REINDEX INDEX CONCURRENTLY {index} /* {name} */")
            except OperationalError as exc:
                if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                    raise
                # At its end a rebuild waits for every transaction of the database older than it (a report, a
                # backup) and gives up at `lock_timeout`: the old index stays, the copy it built is dropped at the
                # next check, and the vacuums and analyses of this check go on.
                conn.rollback()
                self._rebuild_after = time.monotonic() + REBUILD_RETRY_SECONDS
                log.info("upkeep: rebuild of index %s gave way to a transaction older than it; again in %.0f s",
                         index, REBUILD_RETRY_SECONDS)
                break
            took = time.monotonic() - started
            log.info("upkeep: rebuilt index %s in %.1f s (%d pages, %d when packed)", index, took, pages, packed)
            done.append((index, "reindex", took))
        return done

    def stop(self, conn: Connection) -> int:
        """Cancel the upkeep's statements on these tables in every process (a VACUUM of millions of rows
        runs for minutes and holds a lock that DDL waits for, and every claim would queue behind the DDL); the
        upkeep tries again at its next check. Returns how many were cancelled."""
        cancelled = 0
        for name in self.kept_names():
            cancelled += sum(conn.execute(text(
                "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE application_name = :app AND "
                "datname = current_database() AND pid <> pg_backend_pid() AND position(:name in query) > 0"),
                {"app": APPLICATION_NAME, "name": name}).scalars())
        return cancelled

    def kept_names(self) -> list[str]:
        return [self.db.qualified(t.name) for t in self.kept()]

    def key(self) -> int:
        # One process at a time per set of tables (a store and its queue table in one schema are kept apart).
        where = self.kept_names()[0]
        return advisory_key(f"airflow_delay_provider.upkeep:{where}")
