"""Operating the backlog of a SQL store: browse, count, cancel, reschedule and purge scheduled messages.

Cancel, reschedule and purge race safely with pumps: a pump claims rows by deleting them inside its
transaction, so an action that reaches a claimed row waits for that claim to end (it never skips it).
When the claim committed, the message was delivered (or dead-lettered) and the action reports it gone;
when the claim failed and wrote the message back for a retry, the action's next pass (a new snapshot)
finds the written-back row. So a cancel and a delivery of one message never both succeed. Rows a bulk
sweep holds under a live lease are reported `in_flight` and left alone: the sweep may be sending them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import (
    ColumnElement,
    Integer,
    and_,
    case,
    delete,
    func,
    literal,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from airflow_delay_provider.core.backlog import (
    BODY_PREVIEW_BYTES,
    BUCKETS,
    BULK_BATCH,
    LISTED,
    MAX_PAGE,
    Selector,
    backlog_report,
    bulk_report,
    change_report,
    count_report,
    destination_counts,
    edited_report,
    edited_values,
    forget_check,
    forget_report,
    parse_cursor,
    pause_names,
    preview,
    purge_report,
    rescheduled_report,
)
from airflow_delay_provider.core.checks import check_int
from airflow_delay_provider.core.message import check_destination
from airflow_delay_provider.stores.bulk import BatchedChange, leased_selected, settle_cancelled
from airflow_delay_provider.stores.counts import BacklogCounts
from airflow_delay_provider.stores.dedup import AcceptedIds
from airflow_delay_provider.stores.destinations import DestinationSettings
from airflow_delay_provider.stores.engine import PASSES, Database, in_transaction
from airflow_delay_provider.stores.history import DeliveryHistory, removed_columns
from airflow_delay_provider.stores.holds import MessageHolds
from airflow_delay_provider.stores.tables import HELD, StoreTables, _message, from_us, tier_of, to_us

log = logging.getLogger(__name__)

#: Passes an action makes, at most: one still there after the last pass is reported in flight, never as gone (see
#: `_change`).
_PASSES = PASSES
_T = TypeVar("_T")


class BacklogControls:
    """Browse, count and change one store's scheduled messages, on its database and tables.

    :param settings: the store's destinations (known ones, paused ones).
    :param scope: the conditions every read and change adds (a store restricted to some destinations).
    :param tiered: whether the messages are in the two partitions (stores/tiers.py): a reschedule puts each row
        in the partition of its new due time.
    :param ringed: whether `_later` is in partitions by due hour (schema version 9)."""

    def __init__(self, db: Database, tables: StoreTables, settings: DestinationSettings, accepted: AcceptedIds,
                 scope: Callable[[], Sequence[ColumnElement[bool]]] = tuple,
                 tiered: Callable[[], bool] = lambda: False, ringed: Callable[[], bool] = lambda: False,
                 version: Callable[[], int] = lambda: 0) -> None:
        self.db = db
        self.tables = tables
        self.settings = settings
        self.accepted = accepted  # a cancel gives ids their acceptance time back, a reschedule moves their guard
        self.scope = scope
        self.tiered = tiered
        self.ringed = ringed
        self.counts = BacklogCounts(db, tables)
        #: Messages a change by a filter changes per transaction (tests make it small, to see many batches).
        self.batch = BULK_BATCH
        #: Where cancels are recorded (set by the store; None: nowhere).
        self.history: DeliveryHistory | None = None
        #: Pausing and resuming messages by a selection (schema version 14 on).
        self.holds = MessageHolds(db, tables, settings, accepted, self._selected, self._accepted, version, tiered,
                                  ringed, lambda: self.batch)

    # -- reading ------------------------------------------------------------------------------------
    def browse(self, selector: Selector, limit: int = 50, after: str | None = None,
               body_bytes: int | None = BODY_PREVIEW_BYTES) -> dict[str, Any]:
        """One page of scheduled messages, soonest due first, without claiming or locking them.

        :param selector: which messages (`Selector.build(..., allow_everything=True)` for all).
        :param limit: messages per page (1..1000).
        :param after: the `next` cursor of the previous page.
        :param body_bytes: bodies are cut to this many bytes; None leaves bodies out (for readers who may
            not see them).
        :return: ``{"messages": [...], "next": cursor or None}``.
        """
        check_int("limit", limit, 1, MAX_PAGE)
        t = self.tables.messages
        held = self.tables.held_rows() if self.tables.shape.has_tier else literal(False)
        query = select(*self.tables.row, self._leased_now().label("in_flight"), held.label("held")).where(
            *self._selected(selector))
        if after:
            due_us, row_id = parse_cursor(after)
            query = query.where(or_(t.c.due_at_us > due_us, and_(t.c.due_at_us == due_us, t.c.id > row_id)))
        query = query.order_by(t.c.due_at_us, t.c.id).limit(limit + 1)
        paused = {d for d, state in self.settings.destinations().items() if state["paused"]}
        with self.db.errors("browse scheduled messages"), self.db.engine.connect() as conn:
            rows = conn.execute(query).all()
        page = []
        for row in rows[:limit]:
            m = _message(row)
            if not selector.matches_headers(m.headers):  # the SQL match is a substring prefilter
                continue
            item = {"message_id": m.message_id, "destination": m.destination, "due_at": m.due_at.isoformat(),
                    "stored_at": from_us(row.stored_at_us).isoformat(), "failures": m.failures,
                    "headers": m.headers, "in_flight": bool(row.in_flight), "paused": m.destination in paused,
                    "held": bool(row.held)}
            item |= preview(m.body, body_bytes) if body_bytes is not None else {"body_bytes": len(m.body)}
            page.append(item)
        more = len(rows) > limit
        return {"messages": page, "next": f"{rows[limit - 1].due_at_us}:{rows[limit - 1].id}" if more else None}

    def backlog(self, destination: str | None = None) -> dict[str, Any]:
        """Counts per destination: scheduled, due now (`paused` instead while it is paused), held by a
        sweep, and the due-time histogram (due, next minute, hour, day, later)."""
        now_us = to_us(self.db.clock())
        if destination is not None:
            check_destination(destination)
        with self.db.errors("count the backlog"), self.db.engine.connect() as conn:
            # SQLite, or a store not yet migrated to version 6: count the rows themselves.
            rows = self.counts.rows(conn, now_us, destination)
        known = self.settings.destinations()
        report = {name: destination_counts(known.get(name, {}).get("paused", False))
                  for name in sorted({r[0] for r in rows} | ({destination} if destination else set(known)))}
        for name, scheduled, leased, *cumulative in rows:
            entry = report[name]
            entry["scheduled"], entry["in_flight"] = scheduled, int(leased or 0)
            previous = 0
            for (bucket, _), upto in zip(BUCKETS, cumulative, strict=True):
                entry["histogram"][bucket] = int(upto or 0) - previous
                previous = int(upto or 0)
            entry["histogram"]["later"] = scheduled - previous
        for name, held in self.holds.held_counts(destination).items():
            report[name]["held"] = held
        return backlog_report(from_us(now_us), report)

    def count(self, selector: Selector, action: str = "cancel") -> dict[str, Any]:
        """What a change by `selector` would touch (its dry run): `would_<action>` (the messages it would change now)
        and `in_flight` (held by a sweep: left as they are), counted in one snapshot, changing nothing."""
        if action in ("pause", "resume"):
            return self.holds.count(selector, action)
        selector.check_for_change(self.settings.check_known)
        held = case((self._leased_now(), 1), else_=0)
        query = select(func.count(), func.sum(held)).where(*self._selected(selector))
        with self.db.errors("count selected messages"), self.db.engine.connect() as conn:
            total, held = conn.execute(query).one()
        return count_report(selector, action, int(total or 0) - int(held or 0), int(held or 0))

    # -- changing -----------------------------------------------------------------------------------
    def cancel(self, selector: Selector) -> dict[str, Any]:
        """Remove the selected scheduled messages so they are never delivered.

        :return: ``cancelled`` (removed now), ``in_flight`` (held by a running sweep, or by pumps retrying it
            through every pass: not cancelled),
            and for ids that were asked for and not found: ``gone`` (accepted earlier, no longer
            scheduled: delivered, dead-lettered or cancelled before) and ``unknown``; with counts.
        """
        if selector.is_filter:
            return self._bulk(selector, "cancel scheduled messages", None)
        cancelled, in_flight = self._change(selector, "cancel scheduled messages", None)
        return change_report(selector, cancelled, in_flight, self._accepted)

    def reschedule(self, selector: Selector, due_at: datetime) -> dict[str, Any]:
        """Make the selected messages due at `due_at` (checked by `core.backlog.new_due_time`: never before
        now). Pumps waiting past the new time are woken. Reports like `cancel`, with `rescheduled`."""
        due_us = max(to_us(due_at), to_us(self.db.clock()))
        if selector.is_filter:
            return rescheduled_report(self._bulk(selector, "reschedule messages", due_us), from_us(due_us))
        changed, in_flight = self._change(selector, "reschedule messages", due_us)
        return rescheduled_report(change_report(selector, changed, in_flight, self._accepted), from_us(due_us))

    def edit(self, message_id: str, body: bytes | str | None = None,
             headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Change the body and/or the headers (all of them) of one scheduled message, keeping its due time. Refused
        once taken: a row a pump's claim locks, or a sweep or an event lease holds, is reported `in_flight` and left
        as it is (the delivery may be under way); `gone` and `unknown` as `cancel` reports them."""
        message_id, values = edited_values(message_id, body, headers)
        t = self.tables.messages
        now_us = to_us(self.db.clock())
        mine = [t.c.message_id == message_id, *self.scope()]

        def work(conn: Connection) -> tuple[list[str], list[str]]:
            row = conn.execute(select(t.c.id).where(*mine, self.tables.unleased(now_us))
                               .with_for_update(skip_locked=True)).first()
            if row is None:  # not there, or taken: a claim's lock, a lease
                return [], [message_id] if conn.execute(select(t.c.id).where(*mine)).first() else []
            conn.execute(update(t).where(t.c.id == row.id, *mine).values(**values))
            return [message_id], []

        edited, in_flight = self._in_transaction("edit a scheduled message", work)
        return edited_report(change_report(Selector(message_ids=(message_id,)), edited, in_flight, self._accepted))

    def purge(self, destination: str, dry_run: bool = True) -> dict[str, Any]:
        """Remove every scheduled message of one named destination; with `dry_run` (the default) only
        count what would go. Messages a running sweep holds stay (counted `in_flight`)."""
        self.settings.check_known([check_destination(destination)])
        selector = Selector(destination=destination)
        if dry_run:
            counts = self.backlog(destination)["destinations"][destination]
            return purge_report(destination, True, counts["scheduled"] - counts["in_flight"], counts["in_flight"])
        report = self._bulk(selector, "purge a destination", None)
        return purge_report(destination, False, report["counts"]["cancelled"], report["counts"]["in_flight"])

    def forget(self, destinations: Collection[str], force: bool = False) -> dict[str, Any]:
        """Forget destinations (a mistyped one, a retired one): they are no longer listed, known or paused, and
        their policy, queue delay and throttle bucket go. Refused while they have scheduled messages, unless
        `force`, which purges those in the same transaction; always refused while a running sweep holds some."""
        names = pause_names(destinations, "forget")
        self.settings.check_known(names)
        t = self.tables.messages
        mine = t.c.destination.in_(names)

        def forget(conn: Connection) -> dict[str, int]:
            # Lock the rows first (a pump claiming one of them now finishes before the count), so the counts are
            # what the delete below removes.
            conn.execute(select(t.c.id).where(mine).with_for_update())
            count = select(t.c.destination, func.count()).where(mine).group_by(t.c.destination)
            scheduled: dict[str, int] = {d: n for d, n in conn.execute(count).all()}
            in_flight: dict[str, int] = {d: n for d, n in conn.execute(count.where(self._leased_now())).all()}
            forget_check(names, scheduled, in_flight, force)
            if scheduled:  # forced: purged, each cancelled in the delivery history
                gone = conn.execute(delete(t).where(mine).returning(*removed_columns(t))).all()
                settle_cancelled(conn, gone, to_us(self.db.clock()), self.accepted, self.history)
            self.settings.forget(conn, names)
            return scheduled

        return forget_report(names, self._in_transaction("forget destinations", forget))

    def _change(self, selector: Selector, action: str, due_us: int | None) -> tuple[list[str], list[str]]:
        """Delete (due_us None) or re-time the rows a selection by ids selects and no live sweep lease holds, in one
        transaction, in passes until a pass finds nothing; returns (changed ids, in-flight ids: the first LISTED + 1).
        A selection by a filter goes through `_bulk`."""
        selector.check_for_change(self.settings.check_known)
        t = self.tables.messages
        now_us = to_us(self.db.clock())
        where = [*self._selected(selector), self.tables.unleased(now_us)]
        new_values = self._new_values(due_us, now_us)
        if due_us is not None:
            where.append(t.c.due_at_us != due_us)  # rows already at the new time are done

        def change(conn: Connection) -> tuple[list[str], list[str]]:
            changed: list[str] = []
            for _ in range(_PASSES):
                statement = delete(t) if due_us is None else update(t).values(**new_values)
                rows = conn.execute(statement.where(*where).returning(*removed_columns(t))).all()
                changed.extend(r.message_id for r in rows)
                if due_us is None:
                    settle_cancelled(conn, rows, now_us, self.accepted, self.history)
                else:
                    self.accepted.moved(conn, ((r.message_id, due_us, r.stored_at_us) for r in rows))
                # A claim this pass waited for may have written rows back for a retry; a new statement
                # (a new snapshot) sees them, and the next pass takes them.
                if not conn.execute(select(t.c.id).where(*where).limit(1)).first():
                    break
            if due_us is not None:
                # Rows already at the new time (a repeated reschedule) are where they were asked to be.
                at_time = select(t.c.message_id).where(*where[:-1], t.c.due_at_us == due_us).limit(LISTED + 1)
                done = set(changed)
                changed.extend(m for m in conn.execute(at_time).scalars() if m not in done)
                if changed and self.db.is_postgres:
                    conn.execute(select(func.pg_notify(self.tables.channel, str(due_us))))
            in_flight = list(conn.execute(select(t.c.message_id).where(
                *self._selected(selector), self._leased_now()).limit(LISTED + 1)).scalars())
            # An id still stored after the last pass: a pump's claim had it again each time, and wrote it back for a
            # retry. Not changed, and not gone either: "gone" says it was delivered or cancelled before.
            retried = conn.execute(select(t.c.message_id).where(*where).limit(LISTED + 1)).scalars()
            in_flight.extend(m for m in retried if m not in in_flight)
            return changed, in_flight

        return self._in_transaction(action, change)

    def _bulk(self, selector: Selector, action: str, due_us: int | None) -> dict[str, Any]:
        """`_change` of a selection by a filter, in batches (stores/bulk.py); reports like a cancel: the first LISTED
        ids changed and in flight, complete counts, and the batches. A reschedule counts the rows already at the new
        time as rescheduled, as `_change` does (once: they are counted before, and no batch chooses them)."""
        selector.check_for_change(self.settings.check_known)
        t = self.tables.messages
        now_us = to_us(self.db.clock())
        selected = self._selected(selector)
        where = [*selected, self.tables.unleased(now_us)]
        already: list[str] = []
        already_count = 0
        if due_us is not None:
            at_time = [*where, t.c.due_at_us == due_us]  # a range of the due index: cheap
            with self.db.errors(action), self.db.engine.connect() as conn:
                already_count = int(conn.execute(select(func.count()).where(*at_time)).scalar_one())
                already = list(conn.execute(select(t.c.message_id).where(*at_time).limit(LISTED + 1)).scalars())
            where.append(t.c.due_at_us != due_us)
        change = BatchedChange(self.db, self.tables, self.accepted, action, where, due_us,
                               self._new_values(due_us, now_us), self.batch, self.tiered(), self.history).run()
        # Held: a sweep's live lease (looked for only while a sweep holds one), or a claim that wrote the row back for
        # a retry before every pass (`left`): not changed, and it may yet be delivered.
        with self.db.errors(action), self.db.engine.connect() as conn:
            leased, leased_count = leased_selected(conn, self.tables, selected, now_us)
        held, held_count = [*change.left, *leased], len(change.left) + leased_count
        return bulk_report(selector, [*change.listed, *already][:LISTED + 1], change.count + already_count, held,
                           held_count, change.batches)

    def _new_values(self, due_us: int | None, now_us: int) -> dict[str, Any]:
        """The columns a reschedule to `due_us` writes (none for a cancel)."""
        if due_us is None:
            return {}
        values: dict[str, Any] = {"due_at_us": due_us}
        if self.tiered():
            # A row of `_later` made due now goes where claims read at once, not at the next move; PostgreSQL moves
            # a row whose partition key changes. A paused one stays paused.
            tier = self.tables.messages.c.tier
            values["tier"] = case((tier == literal_column(str(HELD)), tier),
                                  else_=literal_column(str(tier_of(due_us, now_us, self.ringed()))))
        return values

    def _in_transaction(self, action: str, work: Callable[[Connection], _T]) -> _T:
        return in_transaction(self.db, action, work)

    def _accepted(self, message_ids: Sequence[str]) -> list[str]:
        """Of these ids, those the store accepted within its de-duplication window."""
        if not message_ids:
            return []
        i = self.tables.ids
        with self.db.errors("read accepted message ids"), self.db.engine.connect() as conn:
            return list(conn.execute(select(i.c.message_id).where(i.c.message_id.in_(list(message_ids)))).scalars())

    # -- conditions ---------------------------------------------------------------------------------
    def _selected(self, selector: Selector) -> list[ColumnElement[bool]]:
        t = self.tables.messages
        conditions = list(self.scope())
        if selector.message_ids:
            conditions.append(t.c.message_id.in_(list(selector.message_ids)))
        if selector.destination is not None:
            conditions.append(t.c.destination == selector.destination)
        # Headers are stored as compact ASCII JSON, so `"key":"value"` appears in the text exactly when
        # the header has that value (quotes inside values are escaped, so they cannot fake it).
        conditions.extend(t.c.headers.contains(p, autoescape=True) for p in selector.header_patterns())
        if selector.due_from is not None:
            conditions.append(t.c.due_at_us >= to_us(selector.due_from))
        if selector.due_before is not None:
            conditions.append(t.c.due_at_us < to_us(selector.due_before))
        if selector.body_bytes is not None:
            conditions.append(_position(selector.body_bytes, t.c.body) > 0)
        return conditions

    def _leased_now(self) -> ColumnElement[bool]:
        return self.tables.leased(to_us(self.db.clock()))


class _position(FunctionElement[int]):
    """Where a byte string first occurs in a binary column, from 1 (0: nowhere), on both databases: a body search is
    of bytes, which `LIKE` would read as text (SQLite) or need escaped (PostgreSQL)."""

    type = Integer()
    inherit_cache = True


@compiles(_position)
def _position_sqlite(element: _position, compiler: SQLCompiler, **kw: Any) -> str:
    needle, haystack = (compiler.process(c, **kw) for c in element.clauses)
    return f"instr({haystack}, {needle})"


@compiles(_position, "postgresql")
def _position_postgres(element: _position, compiler: SQLCompiler, **kw: Any) -> str:
    needle, haystack = (compiler.process(c, **kw) for c in element.clauses)
    return f"position({needle} IN {haystack})"
