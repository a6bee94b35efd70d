"""The backlog controls of DelayStoreHook: one set of methods behind the operators, the CLI and the UI page.

Each takes plain values (as a form, a command line or a rendered template gives them), checks them
with `core.backlog`, acts on the store and returns a JSON-ready dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow_delay_provider.core.backlog import BODY_PREVIEW_BYTES, Selector, new_due_time, utc_moment
from airflow_delay_provider.core.checks import check_int
from airflow_delay_provider.core.errors import DestinationNotFoundError, InvalidInputError
from airflow_delay_provider.core.history import MAX_HISTORY_PAGE, check_outcome, check_window
from airflow_delay_provider.core.message import check_destination
from airflow_delay_provider.core.ports import Transport
from airflow_delay_provider.core.redrive import delete_dead_letters as delete_from_error_queue
from airflow_delay_provider.core.redrive import list_dead_letters
from airflow_delay_provider.core.redrive import redrive as redrive_dead_letters
from airflow_delay_provider.core.requests import parse_count
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore


class BacklogActions:
    """A mixin of DelayStoreHook, which gives it `get_store()`, `auto_migrate` and `prepare_for_writes()`."""

    _checked: SqlDelayedMessageStore | None = None

    def checked_store(self, writes: bool = False) -> SqlDelayedMessageStore:
        """The store of a read or an action (the sensors', the page's, the command line's), checked once per hook.
        Never created here: a store that is not there is a StoreNotReadyError saying how to create it (a typo must
        not look like an empty backlog). An older store is read as it is; an action that changes it (`writes`)
        needs it up to date first, which the connection's `auto_migrate` lets it do."""
        if self._checked is None:
            store: SqlDelayedMessageStore = self.get_store()  # type: ignore[attr-defined]
            store.check_ready()
            self._checked = store
        if writes:
            self.prepare_for_writes(self._checked)  # type: ignore[attr-defined]
        return self._checked

    def browse(self, *, message_ids: Any = None, destination: Any = None, headers: Any = None,
               due_from: Any = None, due_before: Any = None, limit: int = 50, after: str | None = None,
               show_bodies: bool = True, body_bytes: int = BODY_PREVIEW_BYTES,
               body_contains: Any = None) -> dict[str, Any]:
        """A page of scheduled messages, soonest first, claiming nothing. With no selector: every message.

        :param show_bodies: False leaves bodies out (only their size is shown).
        :param body_contains: only messages whose body contains this text (for readers who may see bodies).
        """
        selector = Selector.build(message_ids, destination, headers, due_from, due_before, allow_everything=True,
                                  body_contains=body_contains)
        return self.checked_store().browse(selector, limit=limit, after=after,
                                           body_bytes=body_bytes if show_bodies else None)

    def backlog(self, destination: str | None = None) -> dict[str, Any]:
        """Per destination: scheduled, due, in flight (a sweep holds them), paused, the due-time histogram."""
        return self.checked_store().backlog(destination or None)

    def count(self, *, message_ids: Any = None, destination: Any = None, headers: Any = None, due_from: Any = None,
              due_before: Any = None, body_contains: Any = None, action: str = "cancel") -> dict[str, Any]:
        """What a cancel (or another `action`) of these messages would touch, changing nothing: `would_<action>`,
        `in_flight` (a sweep holds them: left alone) and `confirm` (more than CONFIRM_ABOVE: ask first)."""
        selector = Selector.build(message_ids, destination, headers, due_from, due_before, body_contains=body_contains)
        return self.checked_store().count_selected(selector, action)

    def cancel(self, *, message_ids: Any = None, destination: Any = None, headers: Any = None,
               due_from: Any = None, due_before: Any = None, body_contains: Any = None,
               dry_run: bool = False) -> dict[str, Any]:
        """Cancel scheduled messages: by ids, or by a filter (destination, header match, due window, body text),
        which works in batches of BULK_BATCH, each its own transaction. `dry_run` only counts (see `count`)."""
        if dry_run:
            return self.count(message_ids=message_ids, destination=destination, headers=headers, due_from=due_from,
                              due_before=due_before, body_contains=body_contains)
        selector = Selector.build(message_ids, destination, headers, due_from, due_before, body_contains=body_contains)
        return self.checked_store(writes=True).cancel(selector)

    def reschedule(self, *, message_ids: Any = None, destination: Any = None, headers: Any = None,
                   deliver_at: Any = None, delay_seconds: Any = None, due_from: Any = None, due_before: Any = None,
                   body_contains: Any = None, dry_run: bool = False) -> dict[str, Any]:
        """Make selected messages due at `deliver_at` or after `delay_seconds` from now (0: run now); selected as
        `cancel` selects them, and in batches the same way. `dry_run` checks the new time and only counts."""
        selector = Selector.build(message_ids, destination, headers, due_from, due_before, body_contains=body_contains)
        store = self.checked_store(writes=not dry_run)
        limit = self.delay_limits.of(selector.destination)  # type: ignore[attr-defined]
        due_at = new_due_time(store.clock(), deliver_at, delay_seconds, limit)
        if dry_run:
            return {**store.count_selected(selector, "reschedule"), "due_at": due_at.isoformat()}
        return store.reschedule(selector, due_at)

    def edit(self, *, message_id: Any, body: Any = None, headers: Any = None) -> dict[str, Any]:
        """Change one scheduled message's body (text as UTF-8, or bytes) and/or its headers (all of them, a dict of
        str), keeping its due time; refused (`in_flight`) once a pump, a sweep or an event lease has taken it."""
        return self.checked_store(writes=True).edit(message_id, body, headers)

    def run_now(self, *, message_ids: Any = None, destination: Any = None, headers: Any = None, due_from: Any = None,
                due_before: Any = None, body_contains: Any = None, dry_run: bool = False) -> dict[str, Any]:
        """Make selected messages due now (selected as `cancel` selects them)."""
        return self.reschedule(message_ids=message_ids, destination=destination, headers=headers, delay_seconds=0,
                               due_from=due_from, due_before=due_before, body_contains=body_contains,
                               dry_run=dry_run)

    def pause_messages(self, *, message_ids: Any = None, destination: Any = None, headers: Any = None,
                       due_from: Any = None, due_before: Any = None, body_contains: Any = None,
                       dry_run: bool = False) -> dict[str, Any]:
        """Pause scheduled messages, selected as `cancel` selects them: they stay stored, due or not, and are never
        delivered until resumed (`resume_messages`); a destination's new messages are not affected (`pause` pauses
        a destination). `dry_run` only counts (`would_pause`)."""
        return self._hold("pause", dict(message_ids=message_ids, destination=destination, headers=headers,
                                        due_from=due_from, due_before=due_before, body_contains=body_contains), dry_run)

    def resume_messages(self, *, message_ids: Any = None, destination: Any = None, headers: Any = None,
                        due_from: Any = None, due_before: Any = None, body_contains: Any = None,
                        dry_run: bool = False) -> dict[str, Any]:
        """Resume paused messages, selected as `cancel` selects them: each is due at its due time again, and those
        whose due time passed meanwhile are delivered at once. `dry_run` only counts (`would_resume`)."""
        return self._hold("resume", dict(message_ids=message_ids, destination=destination, headers=headers,
                                         due_from=due_from, due_before=due_before, body_contains=body_contains),
                          dry_run)

    def _hold(self, action: str, selection: dict[str, Any], dry_run: bool) -> dict[str, Any]:
        selector = Selector.build(**selection)
        if dry_run:
            return self.checked_store().count_selected(selector, action)
        store = self.checked_store(writes=True)
        return store.pause_messages(selector) if action == "pause" else store.resume_messages(selector)

    def pause(self, destinations: Any) -> dict[str, Any]:
        """Pause destinations: their messages stay stored until resumed (batches already claimed finish)."""
        return {"paused": True, **self.checked_store(writes=True).set_paused(_names(destinations), True)}

    def resume(self, destinations: Any) -> dict[str, Any]:
        """Resume destinations: pumps take their waiting messages oldest first, within the throttle."""
        return {"paused": False, **self.checked_store(writes=True).set_paused(_names(destinations), False)}

    def purge(self, destination: str, dry_run: bool = True) -> dict[str, Any]:
        """Remove every scheduled message of `destination`; `dry_run` (default) only counts them."""
        return self.checked_store(writes=not dry_run).purge(destination, dry_run=dry_run)

    def forget(self, destinations: Any, force: bool = False, transport: Transport | None = None,
               error_queue: str = "error", error_queues: Sequence[tuple[Transport, str]] = ()) -> dict[str, Any]:
        """Forget destinations (a mistyped or retired name): no longer listed, known or paused, their policy, queue
        delay and throttle gone. Refused while they have scheduled messages, or (given the `transport` of
        `error_queue`, or several (transport, error queue) pairs in `error_queues`, where they can look without
        consuming) dead letters; `force` purges the scheduled messages and leaves the dead letters where they are,
        listed in the report."""
        names = _names(destinations)
        store = self.checked_store(writes=True)
        store.check_known(names)
        dead: dict[str, int] = {}
        queues = [*error_queues, *([(transport, error_queue)] if transport is not None else [])]
        looked = [(t, q) for t, q in queues if t.can_peek]
        checked = bool(looked)
        for each, queue in looked:
            for name in names:
                try:
                    found = list_dead_letters(each, queue, destination=name, limit=1)["count"]
                except DestinationNotFoundError:  # no error queue yet: nothing was dead-lettered
                    break
                if found:
                    dead[name] = dead.get(name, 0) + found
        if dead and not force:
            where = ", ".join(repr(q) for _, q in looked)
            raise InvalidInputError(f"cannot forget {sorted(dead)}: the error queue {where} still holds "
                                    "their dead letters; redrive or delete them first (`airflow delayed-messages "
                                    "dead-letters delete`), or forget with force")
        report = store.forget_destinations(names, force=force)
        report["dead_letters_left"] = sorted(dead)
        report["dead_letters_checked"] = checked
        return report

    def dead_letters(self, transport: Transport, error_queue: str = "error", destination: Any = None,
                     message_ids: Any = None, limit: Any = 50) -> dict[str, Any]:
        """Dead letters in `error_queue` of `transport`, oldest first, consuming nothing: each with its
        original destination, attempts, first and last failure, last error, body preview and headers;
        filtered by original destination and/or message ids. A transport that cannot look without
        consuming (RabbitMQ: see Transport.peek) refuses, saying why."""
        return list_dead_letters(transport, error_queue, destination=destination or None,
                                 message_ids=message_ids, limit=parse_count("limit", limit) or 50)

    def delete_dead_letters(self, transport: Transport, error_queue: str = "error", destination: Any = None,
                            message_ids: Any = None, everything: bool = False, dry_run: bool = True) -> dict[str, Any]:
        """Delete dead letters of `error_queue` of `transport`: by original destination and/or message ids, or
        all with `everything`; `dry_run` (default) lists what would go and deletes nothing. Refused, saying how to
        create them, where the store or the SQL-table queues are not there (nothing is created)."""
        self.checked_store()
        transport.check_ready()
        return delete_from_error_queue(transport, error_queue, destination=destination or None,
                                       message_ids=message_ids, everything=everything, dry_run=dry_run)

    def redrive(self, transport: Transport, error_queue: str = "error", destination: Any = None,
                message_ids: Any = None, max_messages: Any = None, max_per_second: Any = None) -> dict[str, Any]:
        """Store dead letters of `error_queue` again for their original destination, due now, failures
        reset; each leaves the error queue once stored. Returns counts: redriven (per destination),
        skipped (not dead-lettered by the pump, with why) and left (not selected)."""
        return redrive_dead_letters(self.checked_store(writes=True), transport, error_queue,
                                    destination=destination or None, message_ids=message_ids,
                                    max_messages=max_messages, max_per_second=max_per_second)

    # -- the delivery history (core/history.py): reads, never a write ----------------------------------
    def history(self, *, destination: Any = None, message_id: Any = None, outcome: Any = None, since: Any = None,
                before: Any = None, limit: Any = 50, after: str | None = None) -> dict[str, Any]:
        """What became of delivered, retried, dead-lettered and cancelled messages, newest first: `entries` (each
        with its destination, due and hand-over times, lateness in ms, attempts, outcome and failure), `next` (the
        cursor of the next page, for `after`; None: no more) and `history_days` (the connection's retention: 0, none
        is kept). `since` and `before` bound the hand-over time."""
        store = self.checked_store()
        page = store.delivery_history(
            destination=None if destination in (None, "") else check_destination(destination),
            message_id=None if message_id in (None, "") else str(message_id), outcome=check_outcome(outcome),
            since=utc_moment("since", since), before=utc_moment("before", before),
            limit=check_int("limit", parse_count("limit", limit) or 50, 1, MAX_HISTORY_PAGE), after=after or None)
        return {"entries": [e.as_dict() for e in page.entries], "next": page.next, "history_days": store.history_days}

    def history_chart(self, *, destination: Any = None, window: Any = "1h") -> dict[str, Any]:
        """Per minute over the last `window` (1h, 6h or 24h): delivered, lateness p50/p99 (ms, nearest rank), retried,
        dead-lettered and cancelled, of one destination or all; minutes with nothing are left out."""
        seconds = check_window(window or "1h")
        store = self.checked_store()
        until = store.clock()
        since = until - timedelta(seconds=seconds)
        dest = None if destination in (None, "") else check_destination(destination)
        return {"destination": dest, "window": window or "1h", "since": since.isoformat(), "until": until.isoformat(),
                "minutes": store.history_chart(dest, since, until), "history_days": store.history_days}

    def story(self, message_id: Any, show_bodies: bool = False) -> dict[str, Any]:
        """A message's story: `state` (scheduled, delivered, retried, dead_lettered, cancelled, or unknown: never
        stored, or its history is past the retention), its stored row while scheduled (the body only with
        `show_bodies`), and each attempt's entry, oldest first."""
        if not isinstance(message_id, str) or not message_id.strip():
            raise InvalidInputError("message_id must name a message (the id a send returned)")
        return self.checked_store().message_story(message_id.strip(), BODY_PREVIEW_BYTES if show_bodies else None)


def _names(value: Any) -> list[str]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return list(value or [])
