"""Bulk-sweep leases: a sweep's claim on a window of rows, renewed while it settles them, and the rows
one part of a sweep holds."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    Table,
    Update,
    bindparam,
    delete,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.history import Settled
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.ports import Claim, DelayedMessageStore
from airflow_delay_provider.stores.dedup import AcceptedIds
from airflow_delay_provider.stores.engine import Database
from airflow_delay_provider.stores.history import DeliveryHistory
from airflow_delay_provider.stores.tables import (
    SWEEP_COLUMNS,
    StoreTables,
    _rebuild,
    check_claim_id,
    tier_of_rows,
    to_us,
)

log = logging.getLogger("airflow_delay_provider.stores.sql")


class SweepLeases:
    """One store's bulk-sweep leases, on its database and tables (the sweeps table holds one row per lease)."""

    def __init__(self, db: Database, tables: StoreTables, tiered: Callable[[], bool] = lambda: False,
                 ringed: Callable[[], bool] = lambda: False) -> None:
        """:param tiered: whether the messages are in the two partitions (stores/tiers.py): rows a sweep releases
            go to the partition of their due time.
        :param ringed: whether `_later` is in partitions by due hour (schema version 9)."""
        self.db = db
        self.tables = tables
        self.tiered = tiered
        self.ringed = ringed

    def start_sweep(
        self, claim_id: str, due_before: datetime, due_from: datetime | None = None,
        lease_seconds: float = 600.0, chunk: int = 100_000,
    ) -> dict[str, int]:
        """Lease the messages due in [due_from, due_before) and already due to `claim_id`.

        The lease row is committed first, so the pump skips the rows from the moment they carry the
        claim id. Rows of expired leases (a crashed sweep's) are taken over; rows a pump holds at
        that moment are skipped (it is dispatching them). Returns how many rows were claimed.
        """
        now_us = self.open_sweep(claim_id, due_before, due_from, lease_seconds)
        t, s = self.tables.messages, self.tables.sweeps
        window = self._sweep_window(now_us, to_us(due_before), None if due_from is None else to_us(due_from))
        expired = select(s.c.claim_id).where(s.c.lease_until_us < now_us)
        taken_over = self._lease(claim_id, [*window, t.c.claim_id.in_(expired)], chunk)
        claimed = taken_over + self._lease(claim_id, [*window, t.c.claim_id.is_(None)], chunk)
        with self.db.errors("record a sweep"), self.db.engine.begin() as conn:
            conn.execute(update(s).where(s.c.claim_id == claim_id).values(claimed=claimed, taken_over=taken_over))
        return {"claimed": claimed, "taken_over": taken_over}

    def open_sweep(
        self, claim_id: str, due_before: datetime, due_from: datetime | None = None, lease_seconds: float = 600.0,
    ) -> int:
        """Commit a sweep's lease row (status `running`) without leasing any message yet; returns its start
        on the database clock (microseconds): its window holds the messages already due then."""
        check_claim_id(claim_id)
        now_us = to_us(self.db.clock())
        if lease_seconds <= 0:
            raise InvalidInputError(f"lease_seconds must be > 0, got {lease_seconds!r}")
        s = self.tables.sweeps
        with self.db.errors("start a sweep"), self.db.engine.begin() as conn:
            if conn.execute(select(s.c.claim_id).where(s.c.claim_id == claim_id)).first():
                raise InvalidInputError(f"claim id {claim_id!r} was used by an earlier sweep; use a new one")
            conn.execute(insert(s).values(
                claim_id=claim_id, lease_until_us=now_us + int(lease_seconds * 1e6),
                due_from_us=None if due_from is None else to_us(due_from), due_before_us=to_us(due_before),
                status="running", started_at_us=now_us,
            ))
        return now_us

    def _sweep_window(self, now_us: int, due_before_us: int, due_from_us: int | None) -> list[ColumnElement[bool]]:
        t = self.tables.messages
        # A paused destination's rows stay stored: the sweep leaves them, as the pump does.
        # Event destinations are handed to Airflow by their asset watchers, not swept.
        window = [t.c.due_at_us <= now_us, t.c.due_at_us < due_before_us, self.tables.not_paused(),
                  self.tables.dispatchable()]
        if due_from_us is not None:
            window.append(t.c.due_at_us >= due_from_us)
        return window

    def _lease(self, claim_id: str, conditions: list[ColumnElement[bool]], chunk: int) -> int:
        t = self.tables.messages
        total = 0
        while True:
            ids = select(t.c.id).where(*conditions).limit(chunk).with_for_update(skip_locked=True)
            with self.db.errors("claim messages for a sweep"), self.db.engine.begin() as conn:
                n = conn.execute(update(t).where(t.c.id.in_(ids.scalar_subquery())).values(claim_id=claim_id)).rowcount
            total += n
            if n < chunk:
                return total
            log.info("sweep %s: %d messages claimed so far", claim_id, total)

    def renew_lease(self, claim_id: str, lease_seconds: float) -> bool:
        """Extend a running sweep's lease; False when it is no longer running (finished or never started)."""
        s = self.tables.sweeps
        until = to_us(self.db.clock()) + int(lease_seconds * 1e6)
        with self.db.errors("renew a sweep's lease"), self.db.engine.begin() as conn:
            stmt = update(s).where(s.c.claim_id == claim_id, s.c.status == "running").values(lease_until_us=until)
            return conn.execute(stmt).rowcount == 1

    def claimed_range(self, claim_id: str) -> tuple[int, int, int]:
        """(lowest id, highest id, count) of the rows a sweep still holds; (0, -1, 0) when none."""
        t = self.tables.messages
        query = select(func.min(t.c.id), func.max(t.c.id), func.count()).where(t.c.claim_id == claim_id)
        with self.db.errors("read a sweep's claim"), self.db.engine.connect() as conn:
            low, high, n = conn.execute(query).one()
        return (0, -1, 0) if not n else (low, high, n)

    def read_claimed(
        self, claim_id: str, low: int, high: int, chunk: int = 10_000, limit: int | None = None,
    ) -> Iterator[tuple[Any, ...]]:
        """The rows a sweep holds with low <= id <= high, in id order, as SWEEP_COLUMNS tuples; the first
        `limit` of them when given."""
        t = self.tables.messages
        query = (select(*(t.c[c] for c in SWEEP_COLUMNS))
                 .where(t.c.claim_id == claim_id, t.c.id >= low, t.c.id <= high).order_by(t.c.id).limit(limit))
        with self.db.errors("read swept messages"), self.db.engine.connect() as conn:
            for row in conn.execution_options(yield_per=chunk).execute(query):
                yield tuple(row)

    def _open_window(self, conn: Connection, claim_id: str) -> list[ColumnElement[bool]] | None:
        """The conditions of the rows a running sweep may lease: due in its window, and free or held under
        another sweep's expired lease; None when the sweep is not running (finished, killed or unknown)."""
        t, s = self.tables.messages, self.tables.sweeps
        row = conn.execute(select(s).where(s.c.claim_id == check_claim_id(claim_id))).first()
        if row is None or row.status != "running":
            return None
        expired = select(s.c.claim_id).where(s.c.lease_until_us < to_us(self.db.clock()), s.c.claim_id != claim_id)
        return [*self._sweep_window(row.started_at_us, row.due_before_us, row.due_from_us),
                or_(t.c.claim_id.is_(None), t.c.claim_id.in_(expired))]

    def window_range(self, claim_id: str) -> tuple[int, int, int]:
        """(lowest id, highest id, count) of the rows an opened sweep may lease (`lease_range`): due in its
        window, free or under an expired lease; (0, -1, 0) when none or the sweep is not running."""
        t = self.tables.messages
        with self.db.errors("plan a sweep"), self.db.engine.connect() as conn:
            leasable = self._open_window(conn, claim_id)
            if leasable is None:
                return 0, -1, 0
            low, high, n = conn.execute(select(func.min(t.c.id), func.max(t.c.id), func.count())
                                        .where(*leasable)).one()
        return (0, -1, 0) if not n else (low, high, n)

    def leasable_ids(
        self, claim_id: str, low: int, high: int, limit: int, exclude: Collection[str] = ()
    ) -> Select[int] | None:
        """The query of up to `limit` ids, in id order, of rows a running sweep may lease with low <= id <= high
        (not those of `exclude`), locked, skipping rows others hold: for a move that leases and settles them in
        one statement (`SqlTableTransport.move_window`). None when the sweep is not running."""
        t = self.tables.messages
        with self.db.errors("plan a sweep's move"), self.db.engine.connect() as conn:
            leasable = self._open_window(conn, claim_id)
        if leasable is None:
            return None
        ids = select(t.c.id).where(*leasable, t.c.id >= low, t.c.id <= high)
        if exclude:
            ids = ids.where(t.c.destination.not_in(list(exclude)))
        return ids.order_by(t.c.id).limit(limit).with_for_update(skip_locked=True)

    def count_leased(self, claim_id: str, claimed: Any, taken_over: Any) -> Update:
        """The statement adding `claimed` rows, `taken_over` of them from expired leases (SQL expressions), to a
        running sweep's counts; it returns the sweep's id, or no row when the sweep is no longer running."""
        s = self.tables.sweeps
        return (update(s).where(s.c.claim_id == claim_id, s.c.status == "running")
                .values(claimed=s.c.claimed + claimed, taken_over=s.c.taken_over + taken_over).returning(s.c.claim_id))

    def lease_range(self, claim_id: str, low: int, high: int, step: int = 10_000) -> dict[str, int]:
        """Lease to an opened sweep the rows of its window with low <= id <= high (expired leases' rows are
        taken over, rows a pump holds are skipped), the next `step` of them per transaction, so that sparse
        ids cost no empty steps. Each transaction adds its rows to the sweep's claimed and taken-over
        counts, and commits only while the sweep runs: once it is finished or killed, nothing more is
        leased. Returns {"claimed": n, "taken_over": m}."""
        t, s = self.tables.messages, self.tables.sweeps
        claimed = taken_over = 0
        with self.db.errors("claim messages for a sweep"), self.db.engine.connect() as conn:
            while low <= high:
                with conn.begin() as tx:
                    leasable = self._open_window(conn, claim_id)
                    if leasable is None:
                        tx.rollback()
                        break
                    rows = conn.execute(select(t.c.id, t.c.claim_id).where(*leasable, t.c.id >= low, t.c.id <= high)
                                        .order_by(t.c.id).limit(step).with_for_update(skip_locked=True)).all()
                    if not rows:
                        tx.rollback()
                        break
                    took = sum(row.claim_id is not None for row in rows)
                    conn.execute(update(t).where(t.c.id.in_([row.id for row in rows])).values(claim_id=claim_id))
                    running = conn.execute(update(s).where(s.c.claim_id == claim_id, s.c.status == "running")
                                           .values(claimed=s.c.claimed + len(rows),
                                                   taken_over=s.c.taken_over + took))
                    if running.rowcount != 1:  # finished meanwhile: its rows were released, these stay free
                        tx.rollback()
                        break
                claimed += len(rows)
                taken_over += took
                low = rows[-1].id + 1
        return {"claimed": claimed, "taken_over": taken_over}

    def sweep_progress(self, claim_id: str) -> tuple[int, int]:
        """(rows leased so far, rows still held) of a sweep, read in one statement so that a lease committing
        between two reads cannot pass for progress; settled = leased - held."""
        t, s = self.tables.messages, self.tables.sweeps
        held = select(func.count()).where(t.c.claim_id == claim_id).scalar_subquery()
        with self.db.errors("read a sweep's progress"), self.db.engine.connect() as conn:
            row = conn.execute(select(s.c.claimed, held).where(s.c.claim_id == claim_id)).first()
        return (0, 0) if row is None else (row[0], row[1])

    def finish_sweep(self, claim_id: str, status: str, summary: Mapping[str, Any]) -> int:
        """End a sweep: rows it still holds are released to the pump at once, its lease ends, its
        summary is kept. Returns how many rows were released."""
        t, s = self.tables.messages, self.tables.sweeps
        now_us = to_us(self.db.clock())
        with self.db.errors("finish a sweep"), self.db.engine.begin() as conn:
            release = update(t).where(t.c.claim_id == claim_id).values(claim_id=None)
            if self.tiered():  # a due row left in `_later` would wait for the next move: claims may not read there
                release = release.values(tier=tier_of_rows(t.c.due_at_us, now_us, self.ringed()))
            released = conn.execute(release).rowcount
            conn.execute(update(s).where(s.c.claim_id == claim_id).values(
                status=status, finished_at_us=now_us, lease_until_us=0,
                summary=json.dumps({**summary, "released": released}),
            ))
        return released

    def sweep_record(self, claim_id: str) -> dict[str, Any] | None:
        """A sweep's row: window, status, claimed and taken-over counts, and its summary."""
        s = self.tables.sweeps
        with self.db.errors("read a sweep"), self.db.engine.connect() as conn:
            row = conn.execute(select(s).where(s.c.claim_id == claim_id)).first()
        if row is None:
            return None
        record = row._asdict()
        record["summary"] = None if record["summary"] is None else json.loads(record["summary"])
        return record


class _LeasedClaim(Claim):
    """A batch of rows a sweep holds, locked again in this transaction; settled rows are deleted or
    rescheduled in it, unsettled ones go back to the sweep's queue (still under its lease)."""

    def __init__(self, conn: Connection, table: Table, rows: list[tuple[Any, ...]],
                 hand_back: Callable[[Iterable[tuple[Any, ...]]], None], accepted: AcceptedIds,
                 tier: Callable[[int], int | None]) -> None:
        self.connection = conn
        self._table = table
        self._accepted = accepted
        self._tier = tier
        self._rows = {row[1]: row for row in rows}
        self._unsettled = set(self._rows)
        self._hand_back = hand_back
        self.messages = [_rebuild(*row[1:]) for row in rows]
        self.history: DeliveryHistory | None = None

    def record(self, handed_at: datetime, groups: Sequence[Settled]) -> None:
        if self.history is not None:  # a sweep's rows come without their stored time
            self.history.write(self.connection, to_us(handed_at), groups,
                               {row[1]: (row[2], row[5], row[6], None) for row in self._rows.values()})

    def remove(self, message_ids: Iterable[str]) -> int:
        ids = [self._rows[m][0] for m in message_ids if m in self._unsettled]
        self._unsettled.difference_update(message_ids)
        if ids:
            self.connection.execute(delete(self._table).where(self._table.c.id.in_(ids)))
        return len(ids)

    def retry(self, next_due: Mapping[str, datetime], headers: Mapping[str, dict[str, str]] | None = None) -> None:
        t = self._table
        headers = headers or {}
        rows = [
            {
                "rid": self._rows[m][0],
                "f": self._rows[m][6] + 1,
                "d": to_us(due),
                "h": json.dumps(headers[m], separators=(",", ":")) if m in headers else self._rows[m][4],
            }
            for m, due in next_due.items()
        ]
        # A retry leaves the sweep: it is an ordinary delayed message again, for whoever dispatches it when due, in the
        # partition of its new due time (a row leased in `_later` and left there would wait for a full look of it).
        values: dict[str, Any] = {"failures": bindparam("f"), "due_at_us": bindparam("d"), "headers": bindparam("h"),
                                  "claim_id": None}
        tiers = [self._tier(row["d"]) for row in rows]
        if None not in tiers:
            for row, tier in zip(rows, tiers, strict=True):
                row["t"] = tier
            values["tier"] = bindparam("t")
        stmt = update(t).where(t.c.id == bindparam("rid")).values(**values)
        self.connection.execute(stmt, rows)
        accepted = select(t.c.message_id, t.c.due_at_us, t.c.stored_at_us).where(t.c.id.in_([r["rid"] for r in rows]))
        self._accepted.moved(self.connection, (tuple(row) for row in self.connection.execute(accepted)))
        self._unsettled.difference_update(next_due)

    def restore_unsettled(self) -> None:
        if self._unsettled:
            self._hand_back(self._rows[m] for m in self._unsettled)
            self._unsettled.clear()


class LeasedRows(DelayedMessageStore):
    """The rows one part of a sweep holds under its claim id, handed to a Pump batch by batch.

    Each batch is locked again in the transaction that settles it and only rows still held by this
    claim are sent, so a row that another sweep took over (after this lease expired) or that is gone
    is skipped, never sent twice. Rows come as tuples in SWEEP_COLUMNS order.
    """

    def __init__(self, home: DelayedMessageStore, db: Database, table: Table, claim_id: str,
                 rows: Iterable[tuple[Any, ...]], accepted: AcceptedIds,
                 tier: Callable[[int], int | None] = lambda _due_us: None,
                 history: DeliveryHistory | None = None) -> None:
        """:param home: the store the rows are in, which stores retries and keeps the throttle and the policies.
        :param db: its database: a SQL transport on the same database joins the settling transaction.
        :param table: its messages table.
        :param accepted: its accepted ids, whose guards follow a retry's due time (stores/dedup.py).
        :param tier: the partition a row due at a time goes to now (None: the store has none).
        :param history: where the batches' delivery history goes (None: nowhere)."""
        self.history = history
        self.accepted = accepted
        self.tier = tier
        self.home = home
        self.db = db
        self.engine = db.engine
        self.table = table
        self.shared_throttle = home.shared_throttle  # a sweep's partitions and the pumps share one bucket
        self.claim_id = check_claim_id(claim_id)
        self.concurrent_claims = home.concurrent_claims
        self.skipped = 0
        self._rows = iter(rows)
        self._held: deque[tuple[Any, ...]] = deque()  # handed back unsettled (throttled or broker outage)
        self._exhausted = False

    def __repr__(self) -> str:
        return f"LeasedRows({self.home!r}, claim_id={self.claim_id!r})"

    def _take(self, limit: int, exclude: Collection[str]) -> list[tuple[Any, ...]]:
        taken: list[tuple[Any, ...]] = []
        passed: list[tuple[Any, ...]] = []
        while self._held and len(taken) < limit:
            row = self._held.popleft()
            (passed if row[2] in exclude else taken).append(row)
        while not self._exhausted and len(taken) < limit:
            found = next(self._rows, None)
            if found is None:
                self._exhausted = True
            else:
                (passed if found[2] in exclude else taken).append(found)
        self._held.extendleft(reversed(passed))
        return taken

    @property
    def remaining(self) -> bool:
        if self._held:
            return True
        if not self._exhausted:
            row = next(self._rows, None)
            if row is None:
                self._exhausted = True
            else:
                self._held.append(row)
        return bool(self._held)

    @contextmanager
    def claim_due(
        self, now: datetime, limit: int, due_before: datetime | None = None, exclude: Collection[str] = ()
    ) -> Iterator[Claim]:
        rows = self._take(limit, exclude)
        t = self.table
        with self.db.errors("lock swept messages"), self.engine.begin() as conn:
            held: set[int] = set()
            if rows:
                mine = select(t.c.id).where(t.c.id.in_([r[0] for r in rows]), t.c.claim_id == self.claim_id)
                held = set(conn.execute(mine.with_for_update()).scalars())
            kept = [r for r in rows if r[0] in held]
            self.skipped += len(rows) - len(kept)
            claim = _LeasedClaim(conn, t, kept, self._held.extend, self.accepted, self.tier)
            claim.history = self.history
            yield claim
            claim.restore_unsettled()

    def clock(self) -> datetime:
        return self.home.clock()

    def next_due(self, destination: str | None = None, due_before: datetime | None = None) -> datetime | None:
        return self.clock() if self.remaining else None

    def count_scheduled(self, due_before: datetime | None = None) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self._held:
            counts[row[2]] = counts.get(row[2], 0) + 1
        return counts

    def store(self, messages: Sequence[DelayedMessage], deduplicate: bool = True, on_duplicate: str = "skip") -> int:
        return self.home.store(messages, deduplicate, on_duplicate)

    def policies(self) -> dict[str, dict[str, Any]]:
        return self.home.policies()

    def take_tokens(self, destination: str, rate: float, n: int) -> tuple[int, float]:
        return self.home.take_tokens(destination, rate, n)

    def wait(self, until: datetime) -> None:
        time.sleep(max(0.0, min((until - self.clock()).total_seconds(), 0.05)))
