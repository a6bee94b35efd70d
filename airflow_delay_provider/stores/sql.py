"""The SQL delayed-message store (an external store of delayed messages, claimed in batches): SQLite and PostgreSQL.

The store is composed of parts that each get its database and tables: storing (writes.py), claiming (claims.py),
per-destination settings (destinations.py), bulk-sweep leases (leases.py), event claims (event_leases.py),
backlog controls (backlog.py), de-duplication (dedup.py), waiting for the next due time (listener.py), the move
between partitions (tiers.py), upkeep (upkeep.py) and migrations (migrations.py). The tables are declared in
tables.py. Here: the parts put together, the schema, and the store's public methods.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Table, func, inspect, or_, select
from sqlalchemy.engine import URL, Connection
from sqlalchemy.sql import Select

from airflow_delay_provider.core.backlog import BODY_PREVIEW_BYTES, Selector
from airflow_delay_provider.core.checks import check_number
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import DelayProviderError
from airflow_delay_provider.core.history import DEFAULT_HISTORY_DAYS, HistoryPage
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.ports import Claim, DelayedMessageStore
from airflow_delay_provider.stores.backlog import BacklogControls
from airflow_delay_provider.stores.claims import DueClaims
from airflow_delay_provider.stores.dedup import DEFAULT_DEDUP_WINDOW_SECONDS, AcceptedIds
from airflow_delay_provider.stores.destinations import DestinationSettings
from airflow_delay_provider.stores.engine import SqlDatabase, safe_url
from airflow_delay_provider.stores.event_leases import EventLeases
from airflow_delay_provider.stores.history import DeliveryHistory
from airflow_delay_provider.stores.leases import LeasedRows, SweepLeases
from airflow_delay_provider.stores.listener import StoreWaiting
from airflow_delay_provider.stores.migrations import STORE_SCHEMA, SchemaMigrations, VersionedTables
from airflow_delay_provider.stores.routes import DispatchRoutes
from airflow_delay_provider.stores.tables import (
    DEFAULT_TABLE,
    MAX_TABLE_NAME,
    SWEEP_COLUMNS,
    StoreTables,
    _message,
    check_claim_id,
    check_store_table,
    from_us,
    tier_of,
    to_us,
)
from airflow_delay_provider.stores.tiers import LaterMessages
from airflow_delay_provider.stores.upkeep import TableUpkeep
from airflow_delay_provider.stores.writes import MessageWrites

log = logging.getLogger(__name__)

#: The schema version that added `tier` to the messages.
_TIER_VERSION = 8
#: How often a store object looks again whether its store has been migrated to the two partitions.
_TIERS_CHECK_SECONDS = 30.0


__all__ = [  # the names other modules import from here
    "DEFAULT_DEDUP_WINDOW_SECONDS", "DEFAULT_TABLE", "MAX_TABLE_NAME", "SWEEP_COLUMNS", "LeasedRows",
    "SqlDelayedMessageStore", "check_claim_id", "check_store_table", "from_us", "to_us",
]


class SqlDelayedMessageStore(SqlDatabase, DelayedMessageStore):
    """Delayed messages in one table (on PostgreSQL in two partitions, `_soon` and `_later`: stores/tiers.py); claims
    lock rows (`FOR UPDATE SKIP LOCKED` on PostgreSQL).

    The store is its database (SqlDatabase) and its tables (`tables`, declared in tables.py), and the parts that
    each work on those two: `settings` (destinations, pauses, policies, queue delays, throttles), `leases` (bulk
    sweeps), `events` (event claims), `controls` (browse, count, cancel, reschedule, purge), `accepted`
    (de-duplication), `waiting`, `maintenance` and `later_maintenance` (vacuum and analyse), `later` (the move from
    `_later` to `_soon`), `writes` (storing, stores/writes.py), `claims` (claiming, stores/claims.py), `history`
    (the delivery history, stores/history.py), `routes` (where messages go, stores/routes.py) and `migrations`. The
    parts' public methods are the store's.
    """

    def __init__(
        self, url: URL | str, table: str = DEFAULT_TABLE, schema: str | None = None,
        dedup_window_seconds: float = DEFAULT_DEDUP_WINDOW_SECONDS,
        local_clock: Callable[[], datetime] = utcnow, history_days: int = DEFAULT_HISTORY_DAYS,
    ) -> None:
        self.table_name = check_store_table(table)
        super().__init__(url, schema, local_clock=local_clock)
        check_number("dedup_window_seconds", dedup_window_seconds, 0, what="a number of seconds",
                     hint="0 turns de-duplication off")
        self.dedup_window_us = int(dedup_window_seconds * 1_000_000)
        self.tables = StoreTables.declare(self.table_name, self.schema)
        self.accepted = AcceptedIds(self, self.tables, self.dedup_window_us)
        self.concurrent_claims = self.is_postgres  # SQLite locks the whole database per write transaction
        self.threaded_claims = self.is_postgres
        # On SQLite a claim holds the database's write lock, which a second transaction would wait for:
        # there each pump keeps its own bucket (pumps on one SQLite file take turns anyway).
        self.shared_throttle = self.is_postgres
        self._scope: list[ColumnElement[bool]] = []  # conditions every claim and read of this store object adds
        self._wants: Callable[[str], bool] | None = None  # the destinations it serves, when restricted
        self.waiting = StoreWaiting(self, self.tables.channel, lambda: self._wants)
        self.settings = DestinationSettings(self, self.tables)
        self.leases = SweepLeases(self, self.tables, self.tiered, self.ringed)
        self.events = EventLeases(self, self.tables, self.leases, self.accepted)
        self.controls = BacklogControls(self, self.tables, self.settings, self.accepted, lambda: self._scope,
                                        self.tiered, self.ringed, lambda: self.migrations.schema_version())
        t = self.tables
        self.writes = MessageWrites(self, t, self.accepted, self.settings, self.tiered, self.ringed)
        self.claims = DueClaims(self, t, self.accepted, lambda: self._scope, self.tiered,
                                lambda: self.later.clear_until_us, self._tier)
        self.later = LaterMessages(self, t, self.claims.earliest_due, self.ringed)
        self.routes = DispatchRoutes(self, t)
        self.history = DeliveryHistory(self, t, history_days)  # the parts that settle or remove messages write it
        self.claims.history = self.controls.history = self.events.history = self.history
        self._tiered: bool | None = None
        self._ringed = False
        self._tiered_checked = -math.inf
        # On PostgreSQL from schema version 8 the messages are in two partitions, whose counters and indexes
        # are their own (the partitioned table has none); the names of tables not there are passed over.
        messages = (t.messages, t.soon)
        self.maintenance = TableUpkeep(
            self, kept=lambda: (*messages, t.ids, t.counts) if self.controls.counts.counted() else (*messages, t.ids),
            rebuilt=messages, analyzed=messages,  # the claims' plans need statistics; the rest: by key
            before=lambda conn: self.controls.counts.counted() and self.controls.counts.sum_up_counts(conn))
        # `_later` holds millions, and a vacuum of it runs for minutes (102 s at 8.9 million in the soak): in a
        # thread and under a lock of its own, so that `_soon`, which the claims churn, is never left waiting for it.
        # From schema version 9 `_far` and the hours' partitions; those are truncated as they rest (stores/tiers.py),
        # vacuumed only at many dead rows, the current one not at all, and those of the hours to come, which only take
        # inserts until then, analysed less often. Names of tables not there are passed over.
        self.later_maintenance = TableUpkeep(self, kept=lambda: (t.later, t.far, *t.hours), rebuilt=(t.later, t.far),
                                             emptied=t.hours, unvacuumed=self.later.unvacuumed,
                                             growing=self.later.growing)
        self.migrations = SchemaMigrations(self, VersionedTables(
            package=STORE_SCHEMA, kind="delay store", label=f"Delay store {t.where}", versions=t.versions,
            tables=t.of_store(), names=self._template_names(),
            # claim_id and tier are the columns a store from before bulk sweeps lacks; their migrations add them.
            optional_columns=frozenset({"claim_id", "tier"}), adopt=self._adopt,
            refuse_hint="choose another `table` (or `db_schema`) for the store",
            # Their VACUUMs would hold the migration's table locks for minutes.
            before=lambda conn: self.maintenance.stop(conn) + self.later_maintenance.stop(conn),
        ))

    @property
    def table(self) -> Table:
        """The messages table (`tables.messages`)."""
        return self.tables.messages

    @property
    def channel(self) -> str:
        return self.tables.channel

    def restrict(
        self, destinations: Collection[str] | None = None, prefix: str | None = None, due_from: datetime | None = None
    ) -> SqlDelayedMessageStore:
        """Serve only some destinations (names, and/or those starting with `prefix`) and, with `due_from`,
        only messages due at or after it: claims, next due times and counts of this object see no others,
        so one store can serve several teams' dispatchers, or a sweep its window. Returns self."""
        t = self.table
        self._scope = []
        self.claims.restart()
        wanted: list[ColumnElement[bool]] = []
        names = frozenset(destinations or ())
        if names:
            wanted.append(t.c.destination.in_(sorted(names)))
        if prefix:
            wanted.append(t.c.destination.startswith(prefix, autoescape=True))
        if wanted:
            self._scope.append(or_(*wanted))
            # Wake-ups naming another destination are not this object's (see listener.sooner).
            self._wants = lambda d: d in names or prefix is not None and d.startswith(prefix)
        if due_from is not None:
            self._scope.append(t.c.due_at_us >= to_us(due_from))
        return self

    def __repr__(self) -> str:
        return f"SqlDelayedMessageStore({safe_url(self.url)!r}, table={self.table_name!r}, schema={self.schema!r})"

    # -- schema --------------------------------------------------------------------------------
    def create_schema(self) -> None:
        """Create the schema and tables, or bring an older store's up to date (the versioned migrations in
        migrations.py): idempotent, cheap when up to date, safe to run concurrently.

        A table of that name that is not a delay store (another application's) is refused before
        anything is created or changed."""
        self.migrations.migrate()

    def schema_version(self) -> int:
        """The newest migration applied to this store (0: no store here yet)."""
        return self.migrations.schema_version()

    def check_ready(self, current: bool = False) -> None:
        """StoreNotReadyError (naming the store and what to run) while its tables are not there or, with `current`,
        older than this release; cheap once they are. Reads never create them (`migrations.state()` only looks)."""
        state = self.migrations.require(current)
        # A store from before schema version 8 has no `tier`: its claims leave out the condition on held messages.
        self.tables.shape.has_tier = state.version >= _TIER_VERSION or bool(self._tiered)

    def schema_problem(self) -> DelayProviderError | None:
        return self.migrations.problem()

    def migrate(self, up_to: int | None = None) -> list[int]:
        """Apply the migrations this store lacks, up to `up_to` (default: all); returns the versions applied.
        Safe to run concurrently: the others find the store up to date."""
        applied = self.migrations.migrate(up_to)
        if applied:
            self.tables.shape.has_tier = self.migrations.schema_version() >= _TIER_VERSION
        return applied

    def _adopt(self, conn: Connection) -> int:
        """The version of a store made before versioning: claim_id came with bulk sweeps (2); the later
        migrations only create tables, IF NOT EXISTS."""
        columns = {c["name"] for c in inspect(conn).get_columns(self.table_name, schema=self.schema)}
        return 2 if "claim_id" in columns else 1

    def _template_names(self) -> dict[str, str]:
        return self.tables.template_names(self)

    def upkeep(self) -> None:
        """Vacuum and analyse the store's tables when their counters call for it (stores/upkeep.py), move
        messages from `_later` to `_soon` as they come due (stores/tiers.py), and keep the delivery history's days
        (stores/history.py, SQLite too), in background threads; never blocks."""
        self.maintenance.start()
        self.history.start()
        try:
            tiered = self.tiered()
        except DelayProviderError:  # an outage: the caller meets it under its breakers, not here
            return
        if tiered:
            self.later_maintenance.start()
            self.later.start()

    def tiered(self) -> bool:
        """Whether the messages are in the two partitions `_soon` and `_later` (PostgreSQL, schema version 8 on)."""
        if not self.is_postgres or self._ringed:
            return bool(self._tiered)
        if time.monotonic() - self._tiered_checked > _TIERS_CHECK_SECONDS:
            self._tiered_checked = time.monotonic()
            with self.errors("inspect the delay store"), self.engine.connect() as conn:
                inspector = inspect(conn)
                self._tiered = inspector.has_table(self.tables.later.name, schema=self.schema)
                self._ringed = self._tiered and inspector.has_table(self.tables.far.name, schema=self.schema)
                if self._tiered:
                    self.tables.shape.has_tier = True
        return bool(self._tiered)

    def ringed(self) -> bool:
        """Whether `_later` is in partitions by due hour (PostgreSQL, schema version 9 on)."""
        self.tiered()
        return self._ringed

    def exists(self) -> bool:
        with self.errors("inspect the delay store"), self.engine.connect() as conn:
            return inspect(conn).has_table(self.table_name, schema=self.schema)

    # -- writes (stores/writes.py) -----------------------------------------------------------------
    def store(self, messages: Sequence[DelayedMessage], deduplicate: bool = True, on_duplicate: str = "skip") -> int:
        return self.writes.store(messages, deduplicate, on_duplicate)

    def unseen(self, message_ids: Sequence[str]) -> list[str]:
        """The ids not accepted within the de-duplication window: what a native send may still send."""
        return self.accepted.unseen(message_ids)

    def remember_sent(self, message_ids: Sequence[str]) -> None:
        """Record ids a broker confirmed (a native send), so a retried send skips them."""
        self.accepted.remember_sent(message_ids)

    # -- claims (stores/claims.py) -----------------------------------------------------------------
    def due_ids(self, now: datetime, limit: int, due_before: datetime | None = None, exclude: Collection[str] = (),
                soon_only: bool | None = None) -> Select[int]:
        return self.claims.due_ids(now, limit, due_before, exclude, soon_only)

    def claims_soon_only(self, now: datetime) -> bool:
        return self.claims.claims_soon_only(now)

    def claimed(self, ids: Select[int], soon_only: bool = False) -> ColumnElement[bool]:
        return self.claims.claimed(ids, soon_only)

    def taken(self, conn: Connection, ids: Select[int], soon_only: bool = False) -> ColumnElement[bool]:
        return self.claims.taken(conn, ids, soon_only)

    def claim_due(self, now: datetime, limit: int, due_before: datetime | None = None,
                  exclude: Collection[str] = ()) -> AbstractContextManager[Claim]:
        return self.claims.claim_due(now, limit, due_before, exclude)

    def next_due(self, destination: str | None = None, due_before: datetime | None = None) -> datetime | None:
        return self.claims.next_due(destination, due_before)

    def ready_for(self, due: datetime) -> None:
        self.claims.ready_for(due)

    # -- the other parts' methods ------------------------------------------------------------------
    # destinations (stores/destinations.py)
    def register_destinations(self, destinations: Collection[str]) -> None:
        self.settings.register_destinations(destinations)

    def destinations(self) -> dict[str, dict[str, Any]]:
        return self.settings.destinations()

    def check_known(self, destinations: Collection[str]) -> None:
        self.settings.check_known(destinations)

    def set_paused(self, destinations: Collection[str], paused: bool) -> dict[str, list[str]]:
        return self.settings.set_paused(destinations, paused)

    def set_policies(self, policies: Mapping[str, dict[str, Any]]) -> None:
        self.settings.set_policies(policies)

    def policies(self) -> dict[str, dict[str, Any]]:
        return self.settings.policies()

    def set_queue_delays(self, delays: Mapping[str, int]) -> None:
        self.settings.set_queue_delays(delays)

    def queue_delays(self, destinations: Collection[str] | None = None) -> dict[str, int]:
        return self.settings.queue_delays(destinations)

    def take_tokens(self, destination: str, rate: float, n: int) -> tuple[int, float]:
        return self.settings.take_tokens(destination, rate, n)

    # the backlog (stores/backlog.py)
    def browse(self, selector: Selector, limit: int = 50, after: str | None = None,
               body_bytes: int | None = BODY_PREVIEW_BYTES) -> dict[str, Any]:
        return self.controls.browse(selector, limit, after, body_bytes)

    def backlog(self, destination: str | None = None) -> dict[str, Any]:
        return self.controls.backlog(destination)

    def count_selected(self, selector: Selector, action: str = "cancel") -> dict[str, Any]:
        return self.controls.count(selector, action)

    def cancel(self, selector: Selector) -> dict[str, Any]:
        return self.controls.cancel(selector)

    def reschedule(self, selector: Selector, due_at: datetime) -> dict[str, Any]:
        return self.controls.reschedule(selector, due_at)

    def edit(self, message_id: str, body: bytes | str | None = None,
             headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        return self.controls.edit(message_id, body, headers)

    def pause_messages(self, selector: Selector) -> dict[str, Any]:
        return self.controls.holds.pause(selector)

    def resume_messages(self, selector: Selector) -> dict[str, Any]:
        return self.controls.holds.resume(selector)

    def purge(self, destination: str, dry_run: bool = True) -> dict[str, Any]:
        return self.controls.purge(destination, dry_run)

    def forget_destinations(self, destinations: Collection[str], force: bool = False) -> dict[str, Any]:
        return self.controls.forget(destinations, force)

    # bulk sweeps (stores/leases.py)
    def start_sweep(self, claim_id: str, due_before: datetime, due_from: datetime | None = None,
                    lease_seconds: float = 600.0, chunk: int = 100_000) -> dict[str, int]:
        return self.leases.start_sweep(claim_id, due_before, due_from, lease_seconds, chunk)

    def open_sweep(self, claim_id: str, due_before: datetime, due_from: datetime | None = None,
                   lease_seconds: float = 600.0) -> int:
        return self.leases.open_sweep(claim_id, due_before, due_from, lease_seconds)

    def renew_lease(self, claim_id: str, lease_seconds: float) -> bool:
        return self.leases.renew_lease(claim_id, lease_seconds)

    def claimed_range(self, claim_id: str) -> tuple[int, int, int]:
        return self.leases.claimed_range(claim_id)

    def read_claimed(self, claim_id: str, low: int, high: int, chunk: int = 10_000,
                     limit: int | None = None) -> Iterator[tuple[Any, ...]]:
        return self.leases.read_claimed(claim_id, low, high, chunk, limit)

    def window_range(self, claim_id: str) -> tuple[int, int, int]:
        return self.leases.window_range(claim_id)

    def lease_range(self, claim_id: str, low: int, high: int, step: int = 10_000) -> dict[str, int]:
        return self.leases.lease_range(claim_id, low, high, step)

    def sweep_progress(self, claim_id: str) -> tuple[int, int]:
        return self.leases.sweep_progress(claim_id)

    def finish_sweep(self, claim_id: str, status: str, summary: Mapping[str, Any]) -> int:
        return self.leases.finish_sweep(claim_id, status, summary)

    def sweep_record(self, claim_id: str) -> dict[str, Any] | None:
        return self.leases.sweep_record(claim_id)

    def leased_rows(self, claim_id: str, rows: Iterable[tuple[Any, ...]]) -> LeasedRows:
        """The rows a part of a sweep holds, for a Pump to send batch by batch (retries are stored here)."""
        return LeasedRows(self, self, self.tables.messages, claim_id, rows, self.accepted, self._tier, self.history)

    def _tier(self, due_us: int) -> int | None:
        """The partition a row due at `due_us` goes to when written now (None: the store is not in partitions)."""
        return tier_of(due_us, to_us(self.clock()), self.ringed()) if self.tiered() else None

    # event claims (stores/event_leases.py)
    def open_event_claim(self, claim_id: str, destination: str, lease_seconds: float) -> None:
        self.events.open_event_claim(claim_id, destination, lease_seconds)

    def close_event_claim(self, claim_id: str, summary: Mapping[str, Any] | None = None) -> int:
        return self.events.close_event_claim(claim_id, summary)

    def event_claims(self, destination: str | None = None) -> list[dict[str, Any]]:
        return self.events.event_claims(destination)

    def lease_events(self, claim_id: str, destination: str, limit: int) -> tuple[list[DelayedMessage], int]:
        return self.events.lease_events(claim_id, destination, limit)

    def ack_events(self, claim_id: str, message_ids: Collection[str], failures: Mapping[str, str] | None = None
                   ) -> int:
        return self.events.ack_events(claim_id, message_ids, failures)

    def release_events(self, claim_id: str, message_ids: Collection[str]) -> int:
        return self.events.release_events(claim_id, message_ids)

    def retry_events(self, claim_id: str, next_due: Mapping[str, datetime],
                     headers: Mapping[str, dict[str, str]] | None = None,
                     failures: Mapping[str, str] | None = None) -> int:
        return self.events.retry_events(claim_id, next_due, headers, failures)

    def next_event_due(self, destination: str) -> datetime | None:
        return self.events.next_event_due(destination)

    def lease_expiry(self, destination: str) -> datetime | None:
        return self.events.lease_expiry(destination)

    # -- reads -----------------------------------------------------------------------------------
    def count_scheduled(self, due_before: datetime | None = None, destination: str | None = None) -> dict[str, int]:
        t = self.table
        query = select(t.c.destination, func.count()).where(*self._scope).group_by(t.c.destination)
        if due_before is not None:
            query = query.where(t.c.due_at_us < to_us(due_before))
        if destination is not None:
            query = query.where(t.c.destination == destination)
        with self.errors("count scheduled messages"), self.engine.connect() as conn:
            return {dest: n for dest, n in conn.execute(query).all()}

    @property
    def history_days(self) -> int:  # type: ignore[override]
        return self.history.days

    def delivery_history(self, destination: str | None = None, message_id: str | None = None,
                         outcome: str | None = None, since: datetime | None = None, before: datetime | None = None,
                         limit: int = 50, after: str | None = None) -> HistoryPage:
        return HistoryPage(*self.history.entries(destination, message_id, outcome, since, before, limit,
                                                 oldest_first=message_id is not None, after=after))

    def history_chart(self, destination: str | None, since: datetime, until: datetime) -> list[dict[str, Any]]:
        return self.history.chart(destination, since, until)

    def get(self, message_id: str) -> DelayedMessage | None:
        """A stored message by id (for inspection and tests)."""
        t = self.table
        with self.errors("read a stored message"), self.engine.connect() as conn:
            row = conn.execute(select(*self.tables.row).where(t.c.message_id == message_id)).first()
        return None if row is None else _message(row)

    # -- waiting (stores/listener.py) ----------------------------------------------------------------
    def wait(self, until: datetime) -> None:
        """Sleep until `until`, returning early when a message due sooner is stored (`StoreWaiting.wait`). On a store
        in partitions, the move and look of `_later` start a second before `until` if their bound would lapse by
        then (`LaterMessages.look_before`), so that the claims of the wake read `_soon` alone."""
        look_at = self.later.look_before(to_us(until)) if self._tiered else None
        if look_at is not None:
            self.waiting.wait(from_us(look_at))
            if to_us(self.clock()) < look_at:
                return  # woken by a message: the caller reads the next due time again
            self.upkeep()
        self.waiting.wait(until)

    async def wait_async(self, until: datetime) -> None:
        """`wait` for an event loop (a trigger), on the loop's shared LISTEN connection."""
        await self.waiting.wait_async(until)

    def close(self) -> None:
        self.waiting.close()

    async def aclose(self) -> None:
        await self.waiting.aclose()
