"""Claims of due messages: which rows a claim takes, where its scan of the due index starts, and the claim itself.

A claim locks the due rows it takes (`FOR UPDATE SKIP LOCKED` on PostgreSQL; SQLite's write lock) and deletes
them in the same statement; what its batch does not settle is written back before it commits (`_SqlClaim`).
On a store in partitions (stores/tiers.py) claims read `_soon` alone while the move's last look says `_later`
holds nothing they could take.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    ColumnElement,
    Integer,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    cast,
    delete,
    false,
    func,
    insert,
    literal_column,
    or_,
    select,
    text,
)
from sqlalchemy.engine import Connection, Row
from sqlalchemy.sql import Select

from airflow_delay_provider.core.history import Settled
from airflow_delay_provider.core.ports import Claim
from airflow_delay_provider.stores.dedup import AcceptedIds
from airflow_delay_provider.stores.engine import Database, IndexStart

if TYPE_CHECKING:
    from airflow_delay_provider.stores.engine import AnyResult
from airflow_delay_provider.stores.history import DeliveryHistory, facts_of
from airflow_delay_provider.stores.tables import SOON, StoreTables, _message, from_us, to_us

#: How far before its clock a reading of where claims start marks the due times of rows written after it.
_START_MARGIN_US = 1_000_000
#: The start of the due index before where claims start is known (the lowest BIGINT: every due time is above it).
_LOWEST_US = -(2**63)
#: The values a claim's statement is run with (`DueClaims.due_values`): its moment, where its scan starts, the due
#: time it stays before and its size. Bound at each run, so the statement is built once (`DueClaims.built`).
NOW_US = bindparam("claim_now_us", type_=BigInteger)
START_US = bindparam("claim_start_us", type_=BigInteger)
BEFORE_US = bindparam("claim_before_us", type_=BigInteger)
LIMIT = bindparam("claim_limit", type_=Integer)
#: Statements kept per store object, at most (a shape per partition choice, bound, exclusions and history).
_BUILT_MAX = 32


class _SqlClaim(Claim):
    """Claimed rows are deleted by the claiming statement itself, inside the claim's transaction.

    Delivered messages then cost no further statement; retried ones are written back with their new
    due time; anything left unsettled is restored before commit; an error rolls all of it back.
    """

    def __init__(self, conn: Connection, table: Table, rows: Iterable[Row[Any]], accepted: AcceptedIds,
                 tier: Callable[[int], int | None]) -> None:
        self.connection = conn
        self._table = table
        self._accepted = accepted
        self._tier = tier
        rows = sorted(rows, key=lambda r: (r.due_at_us, r.id))  # RETURNING has no order
        self._rows = {row.message_id: row for row in rows}
        self._unsettled = set(self._rows)
        self.messages = [_message(row) for row in rows]
        #: Where the batch's delivery history goes (None: nowhere).
        self.history: DeliveryHistory | None = None

    def remove(self, message_ids: Iterable[str]) -> int:
        before = len(self._unsettled)
        self._unsettled.difference_update(message_ids)
        return before - len(self._unsettled)

    def retry(self, next_due: Mapping[str, datetime], headers: Mapping[str, dict[str, str]] | None = None) -> None:
        changes = {m: {"failures": self._rows[m].failures + 1, "due_at_us": to_us(d)} for m, d in next_due.items()}
        for m, h in (headers or {}).items():
            changes[m]["headers"] = json.dumps(h, separators=(",", ":"))
        self._write_back(changes)
        self._accepted.moved(self.connection, ((m, c["due_at_us"], self._rows[m].stored_at_us)
                                               for m, c in changes.items()))

    def record(self, handed_at: datetime, groups: Sequence[Settled]) -> None:
        if self.history is not None:
            self.history.write(self.connection, to_us(handed_at), groups, facts_of(self._rows.values()))

    def restore_unsettled(self) -> None:
        if self._unsettled:
            self._write_back({m: {} for m in self._unsettled})

    def _write_back(self, changes: Mapping[str, dict[str, Any]]) -> None:
        rows = [{**self._rows[m]._asdict(), "claim_id": None, **change} for m, change in changes.items()]
        # Each in the partition of its due time: a retry an hour on goes to that hour's, not to `_soon`.
        tiers = [self._tier(row["due_at_us"]) for row in rows]
        if None not in tiers:
            for row, tier in zip(rows, tiers, strict=True):
                row["tier"] = tier
        self.connection.execute(insert(self._table), rows)
        self._unsettled.difference_update(changes)



class DueClaims:
    """One store object's claims of due messages, on its database and tables: the ids a claim takes, where its scan
    starts (`due_start`, this object's own), the claim, and the next due time.

    :param accepted: the store's accepted ids, whose guards follow a retry's due time (stores/dedup.py).
    :param scope: the conditions every claim and read of the store object adds (`SqlDelayedMessageStore.restrict`).
    :param tiered: whether the messages are in the two partitions (stores/tiers.py).
    :param clear_until_us: until when `_later` holds nothing a claim could take (the move's last look).
    :param tier: the partition a row due at a time goes to now (None: the store has none), for rows written back.
    """

    def __init__(self, db: Database, tables: StoreTables, accepted: AcceptedIds,
                 scope: Callable[[], list[ColumnElement[bool]]], tiered: Callable[[], bool],
                 clear_until_us: Callable[[], float], tier: Callable[[int], int | None]) -> None:
        self.db = db
        self.tables = tables
        self.accepted = accepted
        self.tier = tier
        self.scope = scope
        self.tiered = tiered
        self.clear_until_us = clear_until_us
        self.history: DeliveryHistory | None = None  # set by the store
        self.due_start = IndexStart()  # where this object's claims start reading the due index
        self._start_soon_only = False  # whether `due_start` is `_soon`'s alone (read apart from both partitions')
        self._built: dict[tuple[Any, ...], Any] = {}

    def restart(self) -> None:
        """Read where claims start afresh (the scope changed)."""
        self.due_start = IndexStart()
        self._built.clear()

    def built(self, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        """The statement `build` makes for `key`, built once for this store object (until its scope changes) and
        run with `due_values`. Building the move's statement and its parts took 1.5-2 ms of Python for each batch,
        on the way to a burst's first row and between every two batches of its drain; SQLAlchemy's cache of
        compiled statements only saves the compiling."""
        statement = self._built.get(key)
        if statement is None:
            if len(self._built) >= _BUILT_MAX:  # shapes that came and went (exclusions of a throttle)
                self._built.clear()
            statement = self._built[key] = build()
        return statement

    def due_ids(
        self, now: datetime, limit: int, due_before: datetime | None = None, exclude: Collection[str] = (),
        soon_only: bool | None = None,
    ) -> Select[int]:
        """The query of the ids a claim takes: due, not leased, paused or an event destination; oldest first;
        rows another claim holds are skipped, never waited for or handed out twice. Its values bound
        (`due_query` and `due_values` give the statement and its values apart).

        :param soon_only: read `_soon` only (see `claims_soon_only`; by default, what it says at `now`). Pass the
            same to `claimed`.
        """
        if soon_only is None:
            soon_only = self.claims_soon_only(now)
        values = self.due_values(now, limit, due_before, soon_only)
        return self.due_query(soon_only, due_before is not None, exclude).params(values)

    def due_query(self, soon_only: bool, before: bool, exclude: Collection[str] = ()) -> Select[int]:
        """`due_ids` with its values as parameters (NOW_US, START_US, BEFORE_US with `before`, LIMIT)."""
        t, tables = self.tables.messages, self.tables
        due = select(t.c.id).where(t.c.due_at_us <= NOW_US, tables.unleased(NOW_US), tables.not_paused(),
                                   tables.dispatchable(), *self.scope())
        if soon_only:
            due = due.where(self.tables.in_tier(SOON))
        if self.db.is_postgres:
            # Always there, from the lowest BIGINT before the start is known: a condition only present once it was
            # made the first claim of a burst a statement the process had not run, compiled (3-4 ms of CPU) and
            # planned on the way to its first row, after a pump had slept through the reading that found the start.
            due = due.where(t.c.due_at_us >= START_US)
        if before:
            due = due.where(t.c.due_at_us < BEFORE_US)
        if exclude:
            due = due.where(t.c.destination.not_in(sorted(exclude)))
        return due.order_by(t.c.due_at_us, t.c.id).limit(LIMIT).with_for_update(skip_locked=True)

    def due_values(self, now: datetime, limit: int, due_before: datetime | None, soon_only: bool) -> dict[str, int]:
        """The values `due_query`'s statement runs with at `now` (reading where claims start when it is time)."""
        self._start_of(soon_only)
        values = {NOW_US.key: to_us(now), LIMIT.key: limit, START_US.key: _LOWEST_US}
        if self.db.is_postgres:
            values[START_US.key] = self._claims_start(now, soon_only) or _LOWEST_US
        if due_before is not None:
            values[BEFORE_US.key] = to_us(due_before)
        return values

    def claims_soon_only(self, now: datetime) -> bool:
        """Whether claims at `now` may read `_soon` only: `_later` holds nothing they could take until its last
        look's bound (stores/tiers.py). Never on SQLite or a store not migrated to the two partitions. The move
        renews the bound in another thread, so a claim asks once and builds `due_ids` and `claimed` from that."""
        return to_us(now) < self.clear_until_us()

    def ready_for(self, due: datetime) -> None:
        """Read where the claims at `due` start now (DelayedMessageStore.ready_for), for the shape they will have."""
        if self.db.is_postgres:
            soon_only = self.claims_soon_only(due)
            self._start_of(soon_only)
            self._claims_start(due, soon_only, ahead=True)

    def _start_of(self, soon_only: bool) -> None:
        """Keep where claims start for the partitions they read (`_soon` alone or all)."""
        if soon_only != self._start_soon_only:  # the other partitions' start was never read: read it afresh
            self._start_soon_only, self.due_start = soon_only, IndexStart()

    def _claims_start(self, now: datetime, soon_only: bool = False, ahead: bool = False) -> int:
        """Where claims start reading the due index (engine.IndexStart): the earliest due time a claim could take
        (future ones too), and as the mark this clock's time less `_START_MARGIN_US` (senders' due times are never
        before their own clock, which lags the database's by at most a round trip)."""
        def read(walk_from: int, _look_ahead: float) -> tuple[int | None, int]:
            # Due rows stay due: what a claim could take later is in the earliest due time already.
            first = self.earliest_due(to_us(now)).where(self.tables.messages.c.due_at_us >= walk_from)
            if soon_only:
                first = first.where(self.tables.in_tier(SOON))
            with self.db.errors("read where claims start"), self.db.engine.begin() as conn:
                self.db.in_index_order(conn)
                return conn.execute(first).scalar(), to_us(self.db.clock()) - _START_MARGIN_US

        return self.due_start.current(read, ahead)

    def earliest_due(self, now_us: int) -> Select[int]:
        """The earliest due time of the messages a claim of this object could take, now or later.

        The first row in due order, not `min(due_at_us)`: under `in_index_order` (the claims' reading) the planner
        priced out the plan that stops at the first row and read the whole due index instead, 7-10 s on a store of
        9,000,000, so a pump fell behind by a minute each minute."""
        t, tables = self.tables.messages, self.tables
        return select(t.c.due_at_us).where(tables.unleased(now_us), tables.not_paused(), tables.dispatchable(),
                                           *self.scope()).order_by(t.c.due_at_us).limit(1)

    def claimed(self, ids: Select[int], soon_only: bool = False) -> ColumnElement[bool]:
        """The condition on the table's rows whose ids the subquery `ids` gives, in one statement (`taken` says
        which to use).

        :param soon_only: `ids` reads `_soon` only (`due_ids` with the same `soon_only`), so each row is found by
            its place in `_soon` (its `ctid`, which the claim's lock keeps); else by its id (SQLite, a store not
            in partitions).
        """
        # `= ANY(ARRAY(...))` finds each claimed row by its place or key; with `IN (...)` PostgreSQL's planner
        # hash-joins the subquery against a scan of the whole table (measured: 10-30% slower claims).
        subquery = ids.scalar_subquery()
        if not self.db.is_postgres:
            return self.tables.messages.c.id.in_(subquery)
        if soon_only:
            # By place, a TID scan of the one partition: no index for the planner to choose from statistics. By
            # id, a partition analysed when all but empty had each id looked up through its due index (id is its
            # second column), read in full for each (tiers.LaterMessages._moving).
            ctid: ColumnElement[Any] = literal_column("ctid")
            places = ids.with_only_columns(ctid).scalar_subquery()
            return and_(self.tables.in_tier(SOON), ctid == any_(func.array(places)))
        return self.tables.messages.c.id == any_(func.array(subquery))

    def taken(self, conn: Connection, ids: Select[int], soon_only: bool = False,
              values: Mapping[str, Any] | None = None) -> ColumnElement[bool]:
        """The condition on the table's rows that `ids` selects (a query that locks them: FOR UPDATE), for the
        statement that takes them on `conn`. From `_soon` alone, `claimed`: one statement. Otherwise (a pump that
        has just started, a move that has failed for 30 s, a sweep's window) `ids` runs here first, and its rows
        are found again by their place in their own partition (a TID scan of each), which their lock keeps.
        `values`: those of `ids`' parameters (`due_values`), for that first run.

        By id, a claim that read every partition looked each id up in all of them, and in the current hour's, once
        an analyse had found it all but empty, the planner took its due index for the lookup (id is its second
        column) and read all of it for each id, as the move of `_later` did (tiers.LaterMessages._moving)."""
        if self._found_alone(soon_only):
            return self.claimed(ids, soon_only)
        picked: dict[int, list[str]] = {}
        columns = ids.with_only_columns(self.tables.messages.c.tier, cast(literal_column("ctid"), Text))
        for tier, tid in conn.execute(columns, dict(values or {})):
            picked.setdefault(tier, []).append(tid)
        if not picked:
            return false()
        return or_(*(and_(self.tables.in_tier(tier), text(f"ctid = ANY(CAST(:tids_{tier} AS tid[]))")
                          .bindparams(bindparam(f"tids_{tier}", tids, type_=ARRAY(Text))))
                     for tier, tids in picked.items()))

    def run(self, conn: Connection, key: tuple[Any, ...], build: Callable[[], Any], values: Mapping[str, Any],
            soon_only: bool) -> AnyResult:
        """Run a claim's statement (`build` makes it from `due_query` and `taken`) with `values` on `conn`: built once
        for `key` and prepared when `taken` finds the claimed rows in the statement itself; otherwise built afresh,
        since the rows' places are in it (`taken` ran `ids` first)."""
        if self._found_alone(soon_only):
            return self.db.run_prepared(conn, self.built(key, build), values)
        return conn.execute(build(), values)

    def _found_alone(self, soon_only: bool) -> bool:
        """Whether `taken` finds the claimed rows in the claim's own statement, not by running `ids` first."""
        return soon_only or not self.db.is_postgres or not self.tiered()

    @contextmanager
    def claim_due(
        self, now: datetime, limit: int, due_before: datetime | None = None, exclude: Collection[str] = ()
    ) -> Iterator[Claim]:
        t = self.tables.messages
        soon_only = self.claims_soon_only(now)
        values = self.due_values(now, limit, due_before, soon_only)
        key = ("claim", soon_only, due_before is not None, frozenset(exclude))
        with self.db.errors("claim due messages"), self.db.engine.begin() as conn:
            self.db.in_index_order(conn)

            def claiming() -> Any:
                ids = self.due_query(soon_only, due_before is not None, exclude)
                return delete(t).where(self.taken(conn, ids, soon_only, values)).returning(*self.tables.row)

            claim = _SqlClaim(conn, t, self.run(conn, key, claiming, values, soon_only).all(), self.accepted,
                              self.tier)
            claim.history = self.history
            yield claim
            claim.restore_unsettled()

    def next_due(self, destination: str | None = None, due_before: datetime | None = None) -> datetime | None:
        t = self.tables.messages
        now = self.db.clock()
        query = self.earliest_due(to_us(now))
        if destination is not None:
            query = query.where(t.c.destination == destination)
        if due_before is not None:
            query = query.where(t.c.due_at_us < to_us(due_before))
        with self.db.errors("read the next due time"), self.db.engine.connect() as conn:
            value = None
            if self.claims_soon_only(now):  # `_later` only when `_soon` has nothing before its bound
                value = conn.execute(query.where(self.tables.in_tier(SOON))).scalar()
                if value is not None and value >= self.clear_until_us():
                    value = None
            if value is None:
                value = conn.execute(query).scalar()
        if value is None:
            return None
        # Read from the beginning: a message made due before where claims start (rescheduled, resumed) is taken
        # at the pump's next claim, not the next full reading.
        self.due_start.lower(value)
        return from_us(value)

