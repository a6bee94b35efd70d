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

import hashlib
import logging
import threading
import time
from dataclasses import dataclass

from sqlalchemy import text

log = logging.getLogger(__name__)

#: How often a process reads the counters (seconds).
UPKEEP_CHECK_SECONDS = 15.0
#: The upkeep's sessions in pg_stat_activity: a migration cancels their work, as autovacuum yields to DDL.
APPLICATION_NAME = "airflow-delay-upkeep"


@dataclass(frozen=True)
class Thresholds:
    """When a table needs work: a base count plus a fraction of its rows, as autovacuum counts, but lower.
    Inserts alone call for no vacuum here: the claims need statistics, not the visibility map."""

    analyze_base: int = 1_000
    analyze_fraction: float = 0.02
    vacuum_base: int = 10_000
    vacuum_fraction: float = 0.02

    def work(self, live: int, dead: int, modified: int) -> list[str]:
        """What a table with these counters needs, in order: "vacuum" and/or "analyze"."""
        rows = max(live, 0)
        todo = []
        if dead > self.vacuum_base + self.vacuum_fraction * rows:
            todo.append("vacuum")
        if modified > self.analyze_base + self.analyze_fraction * rows:
            todo.append("analyze")
        return todo


class TableUpkeep:
    """A mixin of SqlDatabase classes (the store, the SQL-table queues): `upkeep()` for the tables
    `_kept_tables()` names."""

    upkeep_thresholds = Thresholds()
    _upkeep_checked = -float("inf")
    _upkeep_thread: threading.Thread | None = None

    def upkeep(self) -> None:
        """Start the check in a background thread when it is time (never blocks; PostgreSQL only)."""
        if not self.is_postgres or time.monotonic() - self._upkeep_checked < UPKEEP_CHECK_SECONDS:
            return
        if self._upkeep_thread is not None and self._upkeep_thread.is_alive():
            return
        self._upkeep_checked = time.monotonic()
        self._upkeep_thread = threading.Thread(target=self._upkeep_now, name="delay-store-upkeep", daemon=True)
        self._upkeep_thread.start()

    def _upkeep_now(self) -> list[tuple[str, str, float]]:
        """Check the counters and do what they call for; returns (table, work, seconds) of what was done."""
        # SKIP_LOCKED passes over a table someone holds with a warning, not an error.
        skipped: list[str] = []

        def on_notice(notice) -> None:
            if "skipping" in (notice.message_primary or ""):
                skipped.append(notice.message_primary)

        try:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                if not conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": self._upkeep_key()}).scalar():
                    return []  # another process is at it
                driver = conn.connection.driver_connection
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
                    conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": self._upkeep_key()})
        except Exception as exc:  # an outage, a lock, a migration: the pumps meet outages under their breakers
            log.warning("upkeep of %r skipped: %s", self, exc)  # repr: no password, no query of an unreachable db
            return []

    def _do_upkeep(self, conn, skipped: list[str]) -> list[tuple[str, str, float]]:
        done = []
        self._before_upkeep(conn)
        for table in self._kept_tables():
            row = conn.execute(text(
                "SELECT n_live_tup, n_dead_tup, n_mod_since_analyze FROM pg_stat_user_tables "
                "WHERE relid = to_regclass(:name)"), {"name": self._qualified(table.name)}).first()
            if row is None:
                continue
            for work in self.upkeep_thresholds.work(*row):
                if work == "analyze" and table not in self._analyzed_tables():
                    continue
                started = time.monotonic()
                # Identifiers come from the store's checked names, quoted by the dialect.
                statement = "VACUUM (SKIP_LOCKED)" if work == "vacuum" else "ANALYZE (SKIP_LOCKED)"
                conn.exec_driver_sql(f"{statement} {self._qualified(table.name)}")
                took = time.monotonic() - started
                if skipped:
                    log.info("upkeep: %s of %s skipped: %s", work, self._qualified(table.name), skipped.pop())
                    continue
                done.append((table.name, work, took))
                log.info("upkeep: %s %s in %.1f s (%d rows, %d dead, %d changed since analysed)",
                         work, self._qualified(table.name), took, row[0], row[1], row[2])
        return done

    def stop_upkeep(self, conn) -> int:
        """Cancel the upkeep's statements on these tables in every process (a VACUUM of millions of rows
        runs for minutes and holds a lock that DDL waits for, and every claim would queue behind the DDL); the
        upkeep tries again at its next check. Returns how many were cancelled."""
        cancelled = 0
        for name in self._kept_names():
            cancelled += sum(conn.execute(text(
                "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE application_name = :app AND "
                "datname = current_database() AND pid <> pg_backend_pid() AND position(:name in query) > 0"),
                {"app": APPLICATION_NAME, "name": name}).scalars())
        return cancelled

    def _kept_tables(self) -> tuple:
        """The tables to vacuum (SQLAlchemy Tables), the first one the table that names the set."""
        raise NotImplementedError

    def _analyzed_tables(self) -> tuple:
        """Those of the kept tables whose queries need fresh statistics (the others are read by key)."""
        return self._kept_tables()

    def _before_upkeep(self, conn) -> None:  # noqa: B027 - a hook: nothing to do by default
        """Work to do at each check before the counters are read."""

    def _kept_names(self) -> list[str]:
        return [self._qualified(t.name) for t in self._kept_tables()]

    def _upkeep_key(self) -> int:
        # One process at a time per set of tables (a store and its queue table in one schema are kept apart).
        where = self._kept_names()[0]
        digest = hashlib.sha1(f"airflow_delay_provider.upkeep:{where}".encode()).digest()
        return int.from_bytes(digest[:8], "big", signed=True)
