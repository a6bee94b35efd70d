"""Pausing and resuming a SQL store's scheduled messages by ids or by a filter (schema version 14 on).

A paused message stays stored with its due time, body and headers, in the partition of `tier` HELD (on SQLite, with
that value of the column): every claim, sweep, event lease and the move leave it alone (`StoreTables.not_paused`),
while browse, counts, stories, cancel, reschedule, edit and purge see it as any other. A resume gives each row back
the partition its due time says and wakes the pumps, so a message whose due time passed while paused is delivered
at once, late. Both work as a cancel by a filter does (stores/bulk.py): in batches, each its own transaction,
waiting for a pump's claim row by row, in passes until one finds nothing. A message a claim has taken is delivered
(or retried, and a later pass pauses its retry); one a sweep holds is reported in flight and left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import ColumnElement, case, func, literal_column, select

from airflow_delay_provider.core.backlog import (
    BULK_BATCH,
    LISTED,
    Selector,
    bulk_report,
    change_report,
    count_report,
    held_report,
)
from airflow_delay_provider.core.errors import StoreNotReadyError
from airflow_delay_provider.stores.bulk import BatchedChange, leased_selected
from airflow_delay_provider.stores.dedup import AcceptedIds
from airflow_delay_provider.stores.destinations import DestinationSettings
from airflow_delay_provider.stores.engine import Database
from airflow_delay_provider.stores.tables import HELD, HELD_VERSION, SOON, StoreTables, tier_of_rows, to_us


class MessageHolds:
    """Pause and resume one store's scheduled messages (`BacklogControls` gives them their selection).

    :param selected: the conditions of a selector on the messages table (the store's scope included).
    :param accepted_of: of some ids, those the store accepted within its de-duplication window.
    :param version: reads the store's schema version (pausing needs HELD_VERSION).
    :param batch: the messages changed per transaction (the controls', which tests make small).
    """

    def __init__(self, db: Database, tables: StoreTables, settings: DestinationSettings, accepted: AcceptedIds,
                 selected: Callable[[Selector], list[ColumnElement[bool]]],
                 accepted_of: Callable[[Sequence[str]], list[str]], version: Callable[[], int],
                 tiered: Callable[[], bool], ringed: Callable[[], bool],
                 batch: Callable[[], int] = lambda: BULK_BATCH) -> None:
        self.db, self.tables, self.settings, self.accepted = db, tables, settings, accepted
        self.selected, self.accepted_of, self.version = selected, accepted_of, version
        self.tiered, self.ringed, self.batch = tiered, ringed, batch

    def pause(self, selector: Selector) -> dict[str, Any]:
        """Hold the selected messages: `paused` (the ids, the first LISTED of a filter's; by ids also those already
        paused), `in_flight` (a sweep holds them, or a claim had them again at every pass: not paused), by ids `gone`
        and `unknown` as a cancel reports them; a filter's report also counts `already_paused`."""
        now_us = self._ready(selector)
        where = [*self.selected(selector), self.tables.unleased(now_us), self.tables.not_held()]
        already_where = [*self.selected(selector), self.tables.held_rows()]
        with self.db.errors("pause messages"), self.db.engine.connect() as conn:  # those paused before this
            already_count = int(conn.execute(select(func.count()).where(*already_where)).scalar_one())
            already = list(conn.execute(select(self.tables.messages.c.message_id).where(*already_where)
                                        .limit(LISTED + 1)).scalars())
        change = self._change("pause messages", where, {"tier": literal_column(str(HELD))}, wake=False)
        with self.db.errors("pause messages"), self.db.engine.connect() as conn:
            in_flight, in_flight_count = leased_selected(conn, self.tables, self.selected(selector), now_us)
        return self._report(selector, "paused", change, already, already_count, [*change.left, *in_flight],
                            len(change.left) + in_flight_count)

    def resume(self, selector: Selector) -> dict[str, Any]:
        """Release the selected paused messages to their due times (those past due go at once): `resumed` (by ids
        also those that were not paused), and by ids `gone` and `unknown`, as `pause` reports them."""
        now_us = self._ready(selector)
        t = self.tables.messages
        tier = tier_of_rows(t.c.due_at_us, now_us, self.ringed()) if self.tiered() else literal_column(str(SOON))
        change = self._change("resume messages", [*self.selected(selector), self.tables.held_rows()],
                              {"tier": tier}, wake=True)
        already: list[str] = []
        if selector.message_ids:  # by ids, one that is not paused is where a resume would put it
            with self.db.errors("resume messages"), self.db.engine.connect() as conn:
                already = list(conn.execute(select(t.c.message_id).where(*self.selected(selector),
                                                                         self.tables.not_held())).scalars())
        return self._report(selector, "resumed", change, already, len(already), list(change.left), len(change.left))

    def count(self, selector: Selector, action: str) -> dict[str, Any]:
        """What a pause (`action` "pause") or a resume would change now, changing nothing (`count_report`)."""
        now_us = self._ready(selector)
        selected = self.selected(selector)
        if action == "pause":
            where = [*selected, self.tables.not_held()]
            query = select(func.count(), func.sum(case((self.tables.leased(now_us), 1), else_=0))).where(*where)
        else:
            query = select(func.count(), literal_column("0")).where(*selected, self.tables.held_rows())
        with self.db.errors(f"count messages to {action}"), self.db.engine.connect() as conn:
            total, held = conn.execute(query).one()
        return count_report(selector, action, int(total or 0) - int(held or 0), int(held or 0))

    def held_counts(self, destination: str | None) -> dict[str, int]:
        """Paused messages per destination (none on a store older than HELD_VERSION, which cannot hold any)."""
        if not self.tables.shape.has_tier:
            return {}
        t = self.tables.messages
        query = select(t.c.destination, func.count()).where(self.tables.held_rows())
        if destination is not None:
            query = query.where(t.c.destination == destination)
        with self.db.errors("count paused messages"), self.db.engine.connect() as conn:
            return {destination: n for destination, n in conn.execute(query.group_by(t.c.destination))}

    # -- parts ------------------------------------------------------------------------------------------
    def _ready(self, selector: Selector) -> int:
        """Refuse a store that cannot hold messages, or a selection that names nothing or an unknown destination;
        returns now (µs)."""
        version = self.version()
        if version < HELD_VERSION:
            raise StoreNotReadyError(
                f"this delay store is at schema version {version}; pausing messages by a filter needs version "
                f"{HELD_VERSION}: run `airflow delayed-messages db upgrade` (pumps keep running meanwhile)")
        selector.check_for_change(self.settings.check_known)
        return to_us(self.db.clock())

    def _change(self, action: str, where: Sequence[ColumnElement[bool]], values: dict[str, Any],
                wake: bool) -> BatchedChange:
        return BatchedChange(self.db, self.tables, self.accepted, action, where, None, values, self.batch(),
                             self.tiered(), wake=wake).run()

    def _report(self, selector: Selector, key: str, change: BatchedChange, already: list[str], already_count: int,
                in_flight: list[str], in_flight_count: int) -> dict[str, Any]:
        if selector.message_ids:
            done = set(change.listed)
            changed = [*change.listed, *(m for m in already if m not in done)]
            return held_report(change_report(selector, changed, in_flight, self.accepted_of), key)
        report = bulk_report(selector, change.listed, change.count, in_flight, in_flight_count, change.batches)
        return held_report(report, key, already_count)
