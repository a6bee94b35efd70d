"""Settings kept per destination beside the messages: the destinations the store knows and which are
paused, delivery policies, queue-level delays, and the throttle buckets every pump of the store shares."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from airflow_delay_provider.core.backlog import check_known, pause_names, pause_report
from airflow_delay_provider.core.delays import LONGEST_MAX_DELAY_SECONDS, resolve_delay
from airflow_delay_provider.core.message import check_destination
from airflow_delay_provider.core.retry_policy import DeliveryPolicy, PolicyError
from airflow_delay_provider.stores.engine import Database
from airflow_delay_provider.stores.tables import StoreTables, from_us, to_us


class DestinationSettings:
    """One store's settings per destination, on its database and tables."""

    def __init__(self, db: Database, tables: StoreTables) -> None:
        self.db = db
        self.tables = tables

    # -- known destinations, paused or not ----------------------------------------------------------
    def register(self, conn: Connection, destinations: Collection[str], now_us: int) -> None:
        """Make destinations known inside the caller's transaction (a store of messages for them)."""
        insert = (postgresql.insert if self.db.is_postgres else sqlite.insert)(self.tables.dests)
        conn.execute(insert.on_conflict_do_nothing(index_elements=["destination"]),
                     [{"destination": d, "registered_at_us": now_us} for d in sorted(destinations)])

    def register_destinations(self, destinations: Collection[str]) -> None:
        """Make destinations known to the store before anything is sent to them (provisioning does)."""
        for destination in destinations:
            check_destination(destination)
        if destinations:
            with self.db.errors("register destinations"), self.db.engine.begin() as conn:
                self.register(conn, destinations, to_us(self.db.clock()))

    def destinations(self) -> dict[str, dict[str, Any]]:
        """Every destination the store knows (provisioned, or sent to): `{name: {"paused": bool,
        "paused_at": iso or None}}`."""
        d = self.tables.dests
        with self.db.errors("read the store's destinations"), self.db.engine.connect() as conn:
            rows = conn.execute(select(d.c.destination, d.c.paused_at_us).order_by(d.c.destination)).all()
        return {name: {"paused": at is not None, "paused_at": None if at is None else from_us(at).isoformat()}
                for name, at in rows}

    def check_known(self, destinations: Collection[str]) -> None:
        """Refuse destinations the store has never provisioned nor taken messages for, naming them."""
        check_known(destinations, self.destinations())

    def set_paused(self, destinations: Collection[str], paused: bool) -> dict[str, list[str]]:
        """Pause (or resume) destinations: while paused, pumps and new sweeps leave their messages stored
        (due ones wait); batches claimed before the pause still finish. Resuming wakes the pumps, which
        take the waiting messages oldest first under the destination's throttle. Idempotent: returns
        `{"changed": [...], "unchanged": [...]}`."""
        names = pause_names(destinations)
        self.check_known(names)
        d, now = self.tables.dests, to_us(self.db.clock())
        with self.db.errors("pause destinations" if paused else "resume destinations"), self.db.engine.begin() as conn:
            changed = list(conn.execute(
                update(d).where(d.c.destination.in_(names),
                                d.c.paused_at_us.is_(None) if paused else d.c.paused_at_us.is_not(None))
                .values(paused_at_us=now if paused else None).returning(d.c.destination)).scalars())
            if changed and not paused and self.db.is_postgres:
                soonest = self._soonest(conn, changed)
                if soonest is not None:  # resumed messages may be due now: wake the pumps
                    conn.execute(select(func.pg_notify(self.tables.channel, str(soonest))))
        return pause_report(names, changed)

    def forget(self, conn: Connection, destinations: Collection[str]) -> None:
        """Remove what the store keeps per destination (known, paused, policy, queue delay, throttle bucket),
        inside the caller's transaction."""
        t = self.tables
        for table in (t.dests, t.policies, t.delays, t.throttle):
            conn.execute(delete(table).where(table.c.destination.in_(list(destinations))))

    def _soonest(self, conn: Connection, destinations: Collection[str]) -> int | None:
        t = self.tables.messages
        return conn.execute(select(func.min(t.c.due_at_us)).where(t.c.destination.in_(list(destinations)))).scalar()

    def set_policies(self, policies: Mapping[str, dict[str, Any]]) -> None:
        """Store each destination's delivery policy (delivery-policy JSON), replacing what was there.
        Each is checked first: a pump ignores a stored policy it cannot read."""
        for destination, policy in policies.items():
            check_destination(destination)
            try:
                DeliveryPolicy.from_dict(policy)
            except PolicyError as exc:
                raise PolicyError(f"the delivery policy of {destination!r}: {exc}") from None
        t = self.tables.policies
        with self.db.errors("store delivery policies"), self.db.engine.begin() as conn:
            if policies:
                conn.execute(delete(t).where(t.c.destination.in_(list(policies))))
                conn.execute(insert(t), [{"destination": d, "policy": json.dumps(p)} for d, p in policies.items()])

    def set_queue_delays(self, delays: Mapping[str, int]) -> None:
        """Store each destination's queue-level delay in seconds (0..ten years: a send holds it to its store
        connection's longest delay), replacing what was there; 0 removes it. Applies to messages sent from now on,
        as a broker's queue attribute would."""
        for destination, seconds in delays.items():
            resolve_delay(queue_delay=seconds, queue_field=f"queue_delay_seconds of {destination!r}",
                          limit=LONGEST_MAX_DELAY_SECONDS)
        t = self.tables.delays
        with self.db.errors("store queue-level delays"), self.db.engine.begin() as conn:
            if delays:
                conn.execute(delete(t).where(t.c.destination.in_(list(delays))))
                rows = [{"destination": d, "queue_delay_seconds": s} for d, s in delays.items() if s]
                if rows:
                    conn.execute(insert(t), rows)

    def queue_delays(self, destinations: Collection[str] | None = None) -> dict[str, int]:
        """The queue-level delays set for these destinations (all, without `destinations`)."""
        t = self.tables.delays
        query = select(t.c.destination, t.c.queue_delay_seconds)
        if destinations is not None:
            query = query.where(t.c.destination.in_(sorted(set(destinations))))
        with self.db.errors("read queue-level delays"), self.db.engine.connect() as conn:
            return dict(conn.execute(query).all())

    def take_tokens(self, destination: str, rate: float, n: int) -> tuple[int, float]:
        """Take up to `n` tokens of the destination's bucket, in a transaction of its own (the row lock
        makes pumps take turns); the bucket refills at `rate` on the database's clock, holds at most
        one second's worth and starts with one token, as TokenBucket does."""
        t = self.tables.throttle
        capacity = max(float(rate), 1.0)
        # A new bucket's time; read before the transaction, where the store may measure the database's clock.
        created = to_us(self.db.clock())
        with self.db.errors("take throttle tokens"), self.db.engine.begin() as conn:
            insert = (postgresql.insert if self.db.is_postgres else sqlite.insert)(t)
            conn.execute(insert.values(destination=destination, tokens=min(1.0, float(rate)), updated_us=created)
                         .on_conflict_do_nothing(index_elements=["destination"]))
            tokens, updated = conn.execute(
                select(t.c.tokens, t.c.updated_us).where(t.c.destination == destination).with_for_update()).one()
            # Read once the row is locked: a time read before waiting for another pump's take would be older
            # than the one it wrote. Hosts' clocks still differ a little: the bucket's time never goes back,
            # or the next take would refill the same interval again.
            now = max(updated, to_us(self.db.clock()))
            tokens = min(capacity, tokens + (now - updated) / 1e6 * rate)
            taken = min(n, int(tokens))
            conn.execute(update(t).where(t.c.destination == destination).values(tokens=tokens - taken, updated_us=now))
        return taken, tokens - taken

    def policies(self) -> dict[str, dict[str, Any]]:
        t = self.tables.policies
        with self.db.errors("read delivery policies"), self.db.engine.connect() as conn:
            return {d: json.loads(p) for d, p in conn.execute(select(t.c.destination, t.c.policy)).all()}
