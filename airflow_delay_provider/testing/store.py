"""The in-memory store: a dict and a due-time heap, keeping the SQL store's contract (the same contract tests
run against both). Its backlog controls apply the core's rules (core.backlog) as the SQL store does."""

from __future__ import annotations

import heapq
import itertools
import json
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from airflow_delay_provider.core.backlog import (
    BODY_PREVIEW_BYTES,
    MAX_PAGE,
    Selector,
    backlog_report,
    bucket_of,
    bulk_report,
    change_report,
    check_known,
    count_report,
    destination_counts,
    edited_report,
    edited_values,
    forget_check,
    forget_report,
    held_report,
    parse_cursor,
    pause_names,
    pause_report,
    preview,
    purge_report,
    rescheduled_report,
)
from airflow_delay_provider.core.checks import check_int
from airflow_delay_provider.core.delays import UTC, to_us, utcnow
from airflow_delay_provider.core.duplicates import SKIP, applied, check_on_duplicate, fold
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.history import (
    CANCELLED,
    DEFAULT_HISTORY_DAYS,
    MAX_HISTORY_PAGE,
    Delivery,
    HistoryPage,
    Settled,
    check_history_days,
    entries_of,
    minute_series,
)
from airflow_delay_provider.core.message import DelayedMessage, check_destination
from airflow_delay_provider.core.ports import DEFAULT_DEDUP_WINDOW_SECONDS, Claim, DelayedMessageStore


class _MemoryClaim(Claim):
    def __init__(self, store: InMemoryStore, messages: list[DelayedMessage]) -> None:
        self._store = store
        self.messages = messages
        self._unsettled = {m.message_id: m for m in messages}
        self.history: list[Delivery] = []

    def remove(self, message_ids: Iterable[str]) -> int:
        with self._store._lock:
            removed = sum(self._unsettled.pop(mid, None) is not None for mid in list(message_ids))
            self._store._settled.notify_all()
        return removed

    def retry(self, next_due: Mapping[str, datetime], headers: Mapping[str, dict[str, str]] | None = None) -> None:
        with self._store._lock:
            for mid, due in next_due.items():
                m = self._unsettled.pop(mid)
                self._store._put(DelayedMessage.trusted(m.destination, m.body, due,
                                                        dict((headers or {}).get(mid, m.headers)),
                                                        m.message_id, m.failures + 1))
            self._store._settled.notify_all()

    def record(self, handed_at: datetime, groups: Sequence[Settled]) -> None:
        with self._store._lock:  # kept when the claim ends without an error, as a transaction commits
            stored = {m.message_id: self._store._meta.get(m.message_id, (0, None))[1] for m in self.messages}
            self.history.extend(entries_of(groups, {m.message_id: m for m in self.messages}, handed_at, stored))

    def restore(self) -> None:
        for m in self._unsettled.values():
            self._store._put(m)
        self._unsettled.clear()


class InMemoryStore(DelayedMessageStore):
    """A delayed-message store in a dict and a due-time heap; claims may overlap (like row locks).

    The backlog controls behave as the SQL store's, without sweeps (nothing is ever `in_flight`). A cancel,
    reschedule or purge that selects a message an open claim holds waits for that claim to settle it, as
    the SQL store waits for the claim's row lock: so a message is never both cancelled and delivered.
    """

    concurrent_claims = True
    threaded_claims = True  # every claim and settlement takes the lock

    def __init__(self, clock: Callable[[], datetime] = utcnow,
                 dedup_window_seconds: float = DEFAULT_DEDUP_WINDOW_SECONDS,
                 history_days: int = DEFAULT_HISTORY_DAYS) -> None:
        self._clock = clock
        self.history_days = check_history_days(history_days)
        self._history: deque[tuple[int, Delivery]] = deque()  # (the order it was recorded in, entry), oldest first
        self._recorded = itertools.count()
        self._window = timedelta(seconds=dedup_window_seconds)
        lock = threading.RLock()
        self._lock = threading.Condition(lock)  # notified when a message is stored or becomes claimable
        self._settled = threading.Condition(lock)  # notified when a claim settles messages
        self._messages: dict[str, DelayedMessage] = {}
        self._heap: list[tuple[datetime, int, str]] = []
        self._seq = itertools.count()
        self._policies: dict[str, dict[str, Any]] = {}
        self._meta: dict[str, tuple[int, datetime]] = {}  # per stored message: (store order, stored at)
        self._accepted: dict[str, datetime] = {}  # when each id was stored with de-duplication (the ids table)
        self._known: dict[str, datetime | None] = {}  # known destinations: when paused, or None
        self._holds: set[str] = set()  # ids of the messages paused by a selection (the SQL store's HELD rows)
        self._claims: list[_MemoryClaim] = []  # open claims

    def clock(self) -> datetime:
        return self._clock()

    def _put(self, message: DelayedMessage) -> None:
        with self._lock:
            self._messages[message.message_id] = message
            self._meta.setdefault(message.message_id, (next(self._seq), self.clock()))
            heapq.heappush(self._heap, (message.due_at, next(self._seq), message.message_id))
            self._lock.notify_all()

    def store(self, messages: Sequence[DelayedMessage], deduplicate: bool = True, on_duplicate: str = SKIP) -> int:
        mode = check_on_duplicate(on_duplicate)
        batch = fold(messages, mode)
        with self._lock:
            if mode != SKIP:  # a message a claim holds: its outcome first (delivered, or back for a retry)
                while any(self._held(m.message_id) for m in batch):
                    self._settled.wait()
            now = self.clock()
            changed = applied(((self._messages[m.message_id], m) for m in batch
                               if mode != SKIP and m.message_id in self._messages), mode)
            for m in changed:
                self._meta[m.message_id] = (self._meta[m.message_id][0], now)
                self._put(m)
            new = [m for m in batch
                   if m.message_id not in self._messages and not (deduplicate and self._seen(m.message_id, now))]
            for m in new:
                self._meta[m.message_id] = (next(self._seq), now)
                self._put(m)
            if deduplicate and self._window:
                self._accepted.update((m.message_id, now) for m in [*new, *changed])
            if new or changed:
                for destination in {m.destination for m in messages}:
                    self._known.setdefault(destination, None)
            return len(new) + len(changed)

    def _paused(self, destination: str) -> bool:
        return self._known.get(destination) is not None

    @contextmanager
    def claim_due(
        self, now: datetime, limit: int, due_before: datetime | None = None, exclude: Collection[str] = ()
    ) -> Iterator[Claim]:
        taken: list[DelayedMessage] = []
        with self._lock:
            skipped = []
            while self._heap and len(taken) < limit and self._heap[0][0] <= now:
                entry = heapq.heappop(self._heap)
                m = self._messages.get(entry[2])
                if m is None or m.due_at != entry[0]:
                    continue  # settled, or rescheduled under a newer entry
                if m.destination in exclude or self._paused(m.destination) or m.message_id in self._holds \
                        or (due_before is not None and m.due_at >= due_before):
                    skipped.append(entry)
                    continue
                del self._messages[m.message_id]
                taken.append(m)
            for entry in skipped:
                heapq.heappush(self._heap, entry)
            claim = _MemoryClaim(self, taken)
            self._claims.append(claim)
        try:
            yield claim
            self._keep_history(claim.history)
        finally:  # an error releases the whole batch; a normal end returns what was not settled
            with self._lock:
                claim.restore()
                self._claims.remove(claim)
                for m in claim.messages:  # delivered ones are gone for good
                    if m.message_id not in self._messages and not self._held(m.message_id):
                        self._meta.pop(m.message_id, None)
                self._settled.notify_all()

    def _keep_history(self, entries: Iterable[Delivery]) -> None:
        if not self.history_days:
            return
        with self._lock:
            self._history.extend((next(self._recorded), e) for e in entries)
            cutoff = self.clock() - timedelta(days=self.history_days)
            while self._history and self._history[0][1].handed_at < cutoff:
                self._history.popleft()

    def delivery_history(self, destination: str | None = None, message_id: str | None = None,
                         outcome: str | None = None, since: datetime | None = None, before: datetime | None = None,
                         limit: int = 50, after: str | None = None) -> HistoryPage:
        with self._lock:
            found = [(to_us(e.handed_at), n, e) for n, e in self._history
                     if (destination is None or e.destination == destination)
                     and (message_id is None or e.message_id == message_id)
                     and (outcome is None or e.outcome == outcome)
                     and (since is None or e.handed_at >= since) and (before is None or e.handed_at < before)]
        newest_first = message_id is None  # a message's story reads oldest first
        found.sort(key=lambda f: f[:2], reverse=newest_first)
        if after:  # the cursor: the time and order of the last entry shown, so entries recorded since shift nothing
            try:
                at_us, _, n = after.partition(":")
                last = (int(at_us), int(n))
            except ValueError:
                raise InvalidInputError(f"after must be the `next` cursor a page of the history gave, got "
                                        f"{after!r}") from None
            found = [f for f in found if (f[:2] < last if newest_first else f[:2] > last)]
        page = found[:min(limit, MAX_HISTORY_PAGE)]
        cursor = f"{page[-1][0]}:{page[-1][1]}" if len(found) > len(page) else None
        return HistoryPage([e for _, _, e in page], cursor)

    def history_chart(self, destination: str | None, since: datetime, until: datetime) -> list[dict[str, Any]]:
        with self._lock:
            entries = [e for _, e in self._history if destination is None or e.destination == destination]
        return minute_series(entries, since, until)

    def _held(self, message_id: str) -> bool:
        return any(message_id in c._unsettled for c in self._claims)

    def next_due(self, destination: str | None = None, due_before: datetime | None = None) -> datetime | None:
        with self._lock:
            dues = [m.due_at for m in self._messages.values()
                    if (destination is None or m.destination == destination) and not self._paused(m.destination)
                    and m.message_id not in self._holds and (due_before is None or m.due_at < due_before)]
        return min(dues, default=None)

    def count_scheduled(self, due_before: datetime | None = None) -> dict[str, int]:
        counts: dict[str, int] = {}
        with self._lock:
            for m in self._messages.values():
                if due_before is None or m.due_at < due_before:
                    counts[m.destination] = counts.get(m.destination, 0) + 1
        return counts

    def get(self, message_id: str) -> DelayedMessage | None:
        with self._lock:
            return self._messages.get(message_id)

    def set_policies(self, policies: Mapping[str, dict[str, Any]]) -> None:
        self._policies.update(policies)

    def policies(self) -> dict[str, dict[str, Any]]:
        return dict(self._policies)

    def wait(self, until: datetime) -> None:
        seconds = (until - self.clock()).total_seconds()
        if seconds > 0:
            with self._lock:  # a store() wakes the waiter: a sooner message may have arrived
                self._lock.wait(min(seconds, 1.0))

    # -- the backlog ----------------------------------------------------------------------------------
    def browse(self, selector: Selector, limit: int = 50, after: str | None = None,
               body_bytes: int | None = BODY_PREVIEW_BYTES) -> dict[str, Any]:
        check_int("limit", limit, 1, MAX_PAGE)
        start = parse_cursor(after) if after else None
        with self._lock:
            rows = [(self._key(m), m, self._meta[m.message_id][1]) for m in self._select(selector)]
            paused = {d for d in self._known if self._paused(d)}
        if start is not None:
            rows = [row for row in rows if row[0] > start]
        page = []
        for _, m, stored_at in rows[:limit]:
            item = {"message_id": m.message_id, "destination": m.destination, "due_at": m.due_at.isoformat(),
                    "stored_at": stored_at.astimezone(UTC).isoformat(), "failures": m.failures,
                    "headers": dict(m.headers), "in_flight": False, "paused": m.destination in paused,
                    "held": m.message_id in self._holds}
            item |= preview(m.body, body_bytes) if body_bytes is not None else {"body_bytes": len(m.body)}
            page.append(item)
        last = rows[limit - 1][0] if len(rows) > limit else None
        return {"messages": page, "next": None if last is None else f"{last[0]}:{last[1]}"}

    def backlog(self, destination: str | None = None) -> dict[str, Any]:
        if destination is not None:
            check_destination(destination)
        with self._lock:
            now = self.clock()
            known = {d: self._paused(d) for d in self._known}
            dues = [(m.destination, m.due_at, m.message_id in self._holds) for m in self._messages.values()
                    if destination is None or m.destination == destination]
        report = {name: destination_counts(known.get(name, False))
                  for name in sorted({d for d, _, _ in dues} | ({destination} if destination else set(known)))}
        for name, due_at, held in dues:
            report[name]["scheduled"] += 1
            report[name]["held"] += held
            report[name]["histogram"][bucket_of((due_at - now).total_seconds())] += 1
        return backlog_report(now, report)

    def count_selected(self, selector: Selector, action: str = "cancel") -> dict[str, Any]:
        selector.check_for_change(self.check_known)
        with self._lock:
            selected = self._select(selector)
            if action in ("pause", "resume"):  # those it would change: not paused yet, or paused
                selected = [m for m in selected if (m.message_id in self._holds) == (action == "resume")]
            return count_report(selector, action, len(selected), 0)

    def pause_messages(self, selector: Selector) -> dict[str, Any]:
        return self._hold(selector, True)

    def resume_messages(self, selector: Selector) -> dict[str, Any]:
        return self._hold(selector, False)

    def _hold(self, selector: Selector, pause: bool) -> dict[str, Any]:
        """Pause or resume the selected messages once no open claim holds one of them; by ids, one already in that
        state is reported changed, by a filter only those changed (and, paused, the count of those paused before)."""
        selector.check_for_change(self.check_known)
        with self._lock:
            while any(selector.matches(m) for c in self._claims for m in c._unsettled.values()):
                self._settled.wait()
            selected = [m.message_id for m in self._select(selector)]
            changed = [i for i in selected if (i in self._holds) != pause]
            already = len(selected) - len(changed)
            (self._holds.update if pause else self._holds.difference_update)(changed)
            if changed and not pause:
                self._lock.notify_all()  # resumed messages may be due now: wake the waiters
        key = "paused" if pause else "resumed"
        if selector.message_ids:
            return held_report(change_report(selector, selected, [], self._accepted_of), key)
        return held_report(bulk_report(selector, changed, len(changed), [], 0, 1 if changed else 0), key,
                           already if pause else None)

    def cancel(self, selector: Selector) -> dict[str, Any]:
        return change_report(selector, self._change(selector, None), [], self._accepted_of)

    def reschedule(self, selector: Selector, due_at: datetime) -> dict[str, Any]:
        due = max(due_at, self.clock()).astimezone(UTC)
        return rescheduled_report(change_report(selector, self._change(selector, due), [], self._accepted_of), due)

    def edit(self, message_id: str, body: bytes | str | None = None,
             headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        message_id, values = edited_values(message_id, body, headers)
        edited, in_flight = [], []
        with self._lock:
            m = self._messages.get(message_id)
            if m is not None:
                new_headers = json.loads(values["headers"]) if "headers" in values else dict(m.headers)
                self._put(DelayedMessage.trusted(m.destination, values.get("body", m.body), m.due_at, new_headers,
                                                 message_id, m.failures))
                edited.append(message_id)
            elif self._held(message_id):  # an open claim has it: refused, as the SQL store's locked row is
                in_flight.append(message_id)
        return edited_report(change_report(Selector(message_ids=(message_id,)), edited, in_flight,
                                           self._accepted_of))

    def purge(self, destination: str, dry_run: bool = True) -> dict[str, Any]:
        self.check_known([check_destination(destination)])
        if dry_run:
            return purge_report(destination, True, self.backlog(destination)["destinations"][destination]["scheduled"],
                                0)
        return purge_report(destination, False, len(self._change(Selector(destination=destination), None)), 0)

    def forget_destinations(self, destinations: Collection[str], force: bool = False) -> dict[str, Any]:
        names = pause_names(destinations, "forget")
        self.check_known(names)
        with self._lock:
            while any(m.destination in names for c in self._claims for m in c._unsettled.values()):
                self._settled.wait()
            mine = [m for m in self._messages.values() if m.destination in names]
            scheduled: dict[str, int] = {}
            for m in mine:
                scheduled[m.destination] = scheduled.get(m.destination, 0) + 1
            forget_check(names, scheduled, {}, force)
            self._cancel(mine)  # forced: purged
            for name in names:
                self._known.pop(name, None)
                self._policies.pop(name, None)
        return forget_report(names, scheduled)

    def _change(self, selector: Selector, due_at: datetime | None) -> list[str]:
        """Delete (due_at None) or re-time the selected messages, once no open claim holds one of them."""
        selector.check_for_change(self.check_known)
        changed = []
        with self._lock:
            while any(selector.matches(m) for c in self._claims for m in c._unsettled.values()):
                self._settled.wait()
            gone = []
            for m in self._select(selector):
                if due_at is None:
                    gone.append(m)
                elif m.due_at != due_at:  # one already due then stays as it is, and counts as rescheduled
                    self._put(DelayedMessage.trusted(m.destination, m.body, due_at, dict(m.headers), m.message_id,
                                                     m.failures))
                changed.append(m.message_id)
            self._cancel(gone)
        return changed

    def _cancel(self, gone: Sequence[DelayedMessage]) -> None:
        """Remove stored messages for good, each cancelled in the delivery history (the caller holds the lock)."""
        stored = {}
        for m in gone:
            del self._messages[m.message_id]
            self._holds.discard(m.message_id)
            stored[m.message_id] = self._meta.pop(m.message_id, (0, None))[1]
        self._keep_history(entries_of([Settled(CANCELLED, tuple(stored))], {m.message_id: m for m in gone},
                                      self.clock(), stored))

    def _accepted_of(self, message_ids: Sequence[str]) -> list[str]:
        """Of these ids, those stored with de-duplication (the SQL store's ids table)."""
        with self._lock:
            now = self.clock()
            return [m for m in message_ids if self._seen(m, now)]

    def _seen(self, message_id: str, now: datetime) -> bool:
        """Whether the id was accepted within the de-duplication window."""
        at = self._accepted.get(message_id)
        return at is not None and at >= now - self._window

    def _select(self, selector: Selector) -> list[DelayedMessage]:
        """The stored messages the selector matches, soonest due first (under the lock)."""
        pool = ([self._messages[i] for i in selector.message_ids if i in self._messages] if selector.message_ids
                else list(self._messages.values()))
        return sorted(filter(selector.matches, pool), key=self._key)

    def _key(self, m: DelayedMessage) -> tuple[int, int]:
        return to_us(m.due_at), self._meta[m.message_id][0]

    # -- destinations --------------------------------------------------------------------------------
    def register_destinations(self, destinations: Collection[str]) -> None:
        for destination in destinations:
            check_destination(destination)
        with self._lock:
            for destination in destinations:
                self._known.setdefault(destination, None)

    def destinations(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {name: {"paused": at is not None, "paused_at": None if at is None else at.isoformat()}
                    for name, at in sorted(self._known.items())}

    def check_known(self, destinations: Collection[str]) -> None:
        """Refuse destinations the store has never provisioned nor taken messages for, naming them."""
        check_known(destinations, self.destinations())

    def set_paused(self, destinations: Collection[str], paused: bool) -> dict[str, list[str]]:
        names = pause_names(destinations)
        self.check_known(names)
        with self._lock:
            now = self.clock().astimezone(UTC)
            changed = [name for name in names if self._paused(name) != paused]
            for name in changed:
                self._known[name] = now if paused else None
            if changed and not paused:
                self._lock.notify_all()  # resumed messages may be due now: wake the waiters
        return pause_report(names, changed)
