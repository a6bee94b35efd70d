"""Where a store's messages go once due: each transport, its Airflow connection and its error queue, as
provisioning and every dispatcher record them (schema version 13). What reads them (the page's dead letters) finds
every error queue to look at without a setting of its own; `scope` says which destinations a dispatcher took (all,
some names, a prefix) or which endpoints provisioning made.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite

from airflow_delay_provider.core.message import check_destination
from airflow_delay_provider.stores.engine import Database, TablePresence
from airflow_delay_provider.stores.tables import StoreTables, from_us, to_us
from airflow_delay_provider.transports.registry import check_transport

log = logging.getLogger(__name__)

class DispatchRoutes:
    """`record` (provisioning, a dispatcher's start) and `routes` (the page) of one store."""

    def __init__(self, db: Database, tables: StoreTables) -> None:
        self.db = db
        self.table = tables.routes
        self._there = TablePresence(db, tables.routes)

    def record(self, transport: str, conn_id: str | None, error_queue: str, scope: dict[str, Any]) -> bool:
        """Say that messages go through `transport` on `conn_id` (None: the transport's default connection) with
        `error_queue`; False, recording nothing, on a store older than the routes (schema version 12 or before)."""
        check_transport(transport)  # the built-in ones, and any a module registered
        check_destination(error_queue)
        row = {"transport": transport, "conn_id": conn_id or "", "error_queue": error_queue,
               "scope": json.dumps(scope, sort_keys=True, default=str), "seen_at_us": to_us(self.db.clock())}
        with self.db.errors("record where messages go"), self.db.engine.begin() as conn:
            if not self._there(conn):
                return False
            insert = (postgresql.insert if self.db.is_postgres else sqlite.insert)(self.table).values(row)
            conn.execute(insert.on_conflict_do_update(index_elements=["transport", "conn_id", "error_queue"],
                                                      set_={"scope": row["scope"], "seen_at_us": row["seen_at_us"]}))
        return True

    def routes(self) -> list[dict[str, Any]]:
        """Every route recorded, the most recently seen first: transport, conn_id (None: the default), error_queue,
        scope and seen_at; none on a store older than the routes."""
        r = self.table
        with self.db.errors("read where messages go"), self.db.engine.connect() as conn:
            if not self._there(conn):
                return []
            rows = conn.execute(select(r).order_by(r.c.seen_at_us.desc(), r.c.transport, r.c.conn_id,
                                                   r.c.error_queue)).all()
        return [{"transport": row.transport, "conn_id": row.conn_id or None, "error_queue": row.error_queue,
                 "scope": json.loads(row.scope), "seen_at": from_us(row.seen_at_us).isoformat()} for row in rows]
