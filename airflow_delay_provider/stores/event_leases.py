"""Event leases: due messages of an event destination handed to Airflow as trigger events, one lease at a time.

For `triggers.asset.DueMessageEventTrigger`. Its producer cannot hold a claim's transaction open while
Airflow persists the events it yields (that takes a state sync of the triggerer, a second or more,
and the rows must survive the triggerer's death), so a message is handed over in three short
transactions instead:

1. **lease**: due rows of the destination are marked with the producer's claim id; the claim is a
   row of the sweeps table with a lease (`lease_until_us`) the producer renews while it lives. Every
   pump, sweep and backlog action already leaves rows of a live lease alone (`StoreTables.unleased`).
2. **ack** (`ack_events`): once Airflow confirmed the events persisted, the rows are deleted, only
   where this claim still holds them.
3. **release** / **retry** / end of the claim: rows not acknowledged go back to the store (at once on
   a clean stop; after the lease on a crash, when the next producer takes them over).

Event destinations are named `airflow.asset.<name>` (EVENT_PREFIX): pumps and bulk sweeps never
claim them (they are not queues to send to), only event leases do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, insert, or_, select, update

from airflow_delay_provider.core.history import DELIVERED, Settled, settled_groups
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.dedup import AcceptedIds
from airflow_delay_provider.stores.engine import Database
from airflow_delay_provider.stores.history import DeliveryHistory, facts_of, removed_columns
from airflow_delay_provider.stores.leases import SweepLeases
from airflow_delay_provider.stores.tables import EVENT_PREFIX, StoreTables, _message, check_claim_id, from_us, to_us

log = logging.getLogger("airflow_delay_provider.stores.sql")

#: The claim row's `due_before_us` (NOT NULL in the sweeps table): an event claim has no window.
_NO_WINDOW_US = 2**62
_KIND = "asset-events"


def is_event_destination(destination: str) -> bool:
    return destination.startswith(EVENT_PREFIX)


__all__ = ["EVENT_PREFIX", "EventLeases", "is_event_destination"]


class EventLeases:
    """One store's event claims, on its database and tables; a claim is a sweep's lease row (`sweeps`)."""

    def __init__(self, db: Database, tables: StoreTables, sweeps: SweepLeases, accepted: AcceptedIds) -> None:
        self.db = db
        self.tables = tables
        self.sweeps = sweeps
        self.accepted = accepted
        #: Where handed-over events are recorded (set by the store; None: nowhere).
        self.history: DeliveryHistory | None = None

    # -- the claim ----------------------------------------------------------------------------------
    def open_event_claim(self, claim_id: str, destination: str, lease_seconds: float) -> None:
        """Start a claim (a sweeps row, status `running`, kind `asset-events`) whose lease the caller renews
        with `renew_lease` while it hands `destination`'s messages over."""
        check_claim_id(claim_id)
        now_us = to_us(self.db.clock())
        with self.db.errors("open an event claim"), self.db.engine.begin() as conn:
            conn.execute(insert(self.tables.sweeps).values(
                claim_id=claim_id, lease_until_us=now_us + int(lease_seconds * 1e6), due_from_us=None,
                due_before_us=_NO_WINDOW_US, status="running", started_at_us=now_us,
                summary=json.dumps({"kind": _KIND, "destination": destination}),
            ))

    def close_event_claim(self, claim_id: str, summary: Mapping[str, Any] | None = None) -> int:
        """End a claim: the rows it still holds go back to the store at once (they are handed over again);
        returns how many. Waiting producers are woken."""
        released = self.sweeps.finish_sweep(claim_id, "finished", {"kind": _KIND, **(summary or {})})
        if released:
            self._notify_now()
        return released

    def event_claims(self, destination: str | None = None) -> list[dict[str, Any]]:
        """The live event claims (a running producer each), optionally of one destination."""
        s = self.tables.sweeps
        now_us = to_us(self.db.clock())
        query = select(s).where(s.c.status == "running", s.c.lease_until_us >= now_us,
                                s.c.summary.contains(f'"kind": "{_KIND}"'))
        with self.db.errors("read event claims"), self.db.engine.connect() as conn:
            rows = conn.execute(query).all()
        claims = []
        for row in rows:
            record = row._asdict()
            record["summary"] = json.loads(record["summary"])
            if destination is None or record["summary"].get("destination") == destination:
                claims.append(record)
        return claims

    # -- handing over -------------------------------------------------------------------------------
    def lease_events(self, claim_id: str, destination: str, limit: int) -> tuple[list[DelayedMessage], int]:
        """Lease up to `limit` due messages of `destination` to `claim_id`, oldest first; rows of an expired
        lease (a crashed producer's) are taken over, never rows `claim_id` holds itself. Returns the messages
        and how many were taken over."""
        t, s = self.tables.messages, self.tables.sweeps
        now_us = to_us(self.db.clock())
        live = select(s.c.claim_id).where(s.c.lease_until_us >= now_us)
        # Never this claim's own rows: it handed them over already, and they wait for their settlement even when
        # its lease ran out meanwhile (a store outage stops the renewals too).
        free = or_(t.c.claim_id.is_(None), and_(t.c.claim_id.not_in(live), t.c.claim_id != claim_id))
        ids = (select(t.c.id).where(t.c.destination == destination, t.c.due_at_us <= now_us, free,
                                    self.tables.not_paused())
               .order_by(t.c.due_at_us, t.c.id).limit(limit).with_for_update(skip_locked=True))
        with self.db.errors("lease due messages"), self.db.engine.begin() as conn:
            self.db.in_index_order(conn)
            before = {r.id: r.claim_id for r in conn.execute(
                select(t.c.id, t.c.claim_id).where(t.c.id.in_(ids.scalar_subquery())))}
            if not before:
                return [], 0
            rows = conn.execute(update(t).where(t.c.id.in_(list(before)), free)
                                .values(claim_id=claim_id).returning(*self.tables.row)).all()
        rows = sorted(rows, key=lambda r: (r.due_at_us, r.id))
        taken_over = sum(1 for r in rows if before.get(r.id) is not None)
        return [_message(r) for r in rows], taken_over

    def ack_events(self, claim_id: str, message_ids: Collection[str], failures: Mapping[str, str] | None = None
                   ) -> int:
        """Delete handed-over messages this claim still holds; returns how many went. A row another claim
        took over meanwhile (this lease had expired) stays: that claim hands it over again. In the delivery
        history they are delivered (asset events Airflow recorded), or with `failures` (id -> why) dead-lettered."""
        if not message_ids:
            return 0
        t = self.tables.messages
        with self.db.errors("acknowledge handed-over messages"), self.db.engine.begin() as conn:
            gone = conn.execute(t.delete().where(t.c.message_id.in_(list(message_ids)), t.c.claim_id == claim_id)
                                .returning(*removed_columns(t))).all()
            if gone and self.history is not None:
                ids = [r.message_id for r in gone]
                groups = settled_groups([], {}, {m: failures[m] for m in ids}) if failures is not None else \
                    [Settled(DELIVERED, tuple(ids))]
                self.history.write(conn, to_us(self.db.clock()), groups, facts_of(gone))
            return len(gone)

    def release_events(self, claim_id: str, message_ids: Collection[str]) -> int:
        """Give messages back untouched (due as they were); returns how many."""
        if not message_ids:
            return 0
        t = self.tables.messages
        with self.db.errors("release messages"), self.db.engine.begin() as conn:
            n = conn.execute(update(t).where(t.c.message_id.in_(list(message_ids)), t.c.claim_id == claim_id)
                             .values(claim_id=None)).rowcount
        if n:
            self._notify_now()
        return n

    def retry_events(self, claim_id: str, next_due: Mapping[str, datetime],
                     headers: Mapping[str, dict[str, str]] | None = None,
                     failures: Mapping[str, str] | None = None) -> int:
        """Count one more failure for each message and make it due again at its time (new headers where
        given), releasing it; returns how many. The delivery history records each as retried, with its failure
        from `failures` (id -> why)."""
        t = self.tables.messages
        n = 0
        with self.db.errors("reschedule messages for a retry"), self.db.engine.begin() as conn:
            if self.history is not None and next_due:  # as they were when handed over: due time and attempts
                held = conn.execute(select(*removed_columns(t)).where(t.c.message_id.in_(list(next_due)),
                                                                      t.c.claim_id == claim_id)).all()
                if held:
                    why = failures or {}
                    groups = settled_groups([], {r.message_id: why.get(r.message_id, "") for r in held}, {})
                    self.history.write(conn, to_us(self.db.clock()), groups, facts_of(held))
            for message_id, due in next_due.items():
                values: dict[str, Any] = {"claim_id": None, "failures": t.c.failures + 1, "due_at_us": to_us(due)}
                if headers and message_id in headers:
                    values["headers"] = json.dumps(headers[message_id], separators=(",", ":"))
                retried = conn.execute(update(t).where(t.c.message_id == message_id, t.c.claim_id == claim_id)
                                       .values(**values).returning(t.c.message_id, t.c.due_at_us,
                                                                   t.c.stored_at_us)).all()
                self.accepted.moved(conn, retried)
                n += len(retried)
            if n and self.db.is_postgres:
                conn.execute(select(func.pg_notify(self.tables.channel, str(to_us(min(next_due.values()))))))
        return n

    def next_event_due(self, destination: str) -> datetime | None:
        """Due time of the earliest message of `destination` no live lease holds (None: none, or paused)."""
        t, s = self.tables.messages, self.tables.sweeps
        now_us = to_us(self.db.clock())
        live = select(s.c.claim_id).where(s.c.lease_until_us >= now_us)
        query = select(func.min(t.c.due_at_us)).where(
            t.c.destination == destination, self.tables.not_paused(),
            or_(t.c.claim_id.is_(None), and_(t.c.claim_id.is_not(None), t.c.claim_id.not_in(live))))
        with self.db.errors("read the next due time"), self.db.engine.connect() as conn:
            value = conn.execute(query).scalar()
        return None if value is None else from_us(value)

    def lease_expiry(self, destination: str) -> datetime | None:
        """When the earliest live lease holding a row of `destination` runs out (a crashed producer's rows
        come back then), or None."""
        t, s = self.tables.messages, self.tables.sweeps
        query = (select(func.min(s.c.lease_until_us))
                 .where(s.c.claim_id.in_(select(t.c.claim_id).where(t.c.destination == destination,
                                                                    t.c.claim_id.is_not(None))),
                        s.c.lease_until_us >= to_us(self.db.clock())))
        with self.db.errors("read lease expiries"), self.db.engine.connect() as conn:
            value = conn.execute(query).scalar()
        return None if value is None else from_us(value)

    def _notify_now(self) -> None:
        """Wake waiting producers and pumps (released rows may be due now)."""
        if self.db.is_postgres:
            with self.db.errors("notify waiting dispatchers"), self.db.engine.begin() as conn:
                conn.execute(select(func.pg_notify(self.tables.channel, str(to_us(self.db.clock())))))
