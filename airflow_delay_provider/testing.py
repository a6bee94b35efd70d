"""In-memory store and transport: for tests of code built on this provider, and the fast test tier.

They keep the contracts of the real ones (the same contract tests run against both): claims hand a
message out once, settled messages leave the store, unsettled ones return to it, ids are de-duplicated,
a transport refuses destinations that were never provisioned. Thread-safe; nothing persists.

    store, transport = InMemoryStore(), InMemoryTransport()
    transport.provision("orders")
    store.store([DelayedMessage("orders", b"x", utcnow())])
    Pump(store, transport).run(stop_when_idle=True)
    [m] = transport.receive("orders")

A new transport for a broker follows InMemoryTransport's shape: check_endpoint, provision, send
(failures by id, never an exception for one bad message), receive/ack, depth, verify, from_spec; and
one line in `airflow_delay_provider.transports.registry`. InMemoryTransport also delays natively (a
message sent before its due time waits for it) and can take such messages back (take_held and the
rest), as the RabbitMQ transport does for a migration back to the store.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow_delay_provider.core.backlog import (
    BODY_PREVIEW_BYTES,
    MAX_PAGE,
    Selector,
    bucket_of,
    cancel_report,
    check_known,
    empty_histogram,
    preview,
)
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import DestinationNotFoundError, InvalidInputError
from airflow_delay_provider.core.message import DelayedMessage, check_destination
from airflow_delay_provider.core.ports import Claim, DelayedMessageStore, HeldMessage, ReceivedMessage, Transport

__all__ = ["InMemoryStore", "InMemoryTransport"]


class _MemoryClaim(Claim):
    def __init__(self, store: InMemoryStore, messages: list[DelayedMessage]) -> None:
        self._store = store
        self.messages = messages
        self._unsettled = {m.message_id: m for m in messages}

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

    def __init__(self, clock: Callable[[], datetime] = utcnow) -> None:
        self._clock = clock
        lock = threading.RLock()
        self._lock = threading.Condition(lock)  # notified when a message is stored or becomes claimable
        self._settled = threading.Condition(lock)  # notified when a claim settles messages
        self._messages: dict[str, DelayedMessage] = {}
        self._heap: list[tuple[datetime, int, str]] = []
        self._seq = itertools.count()
        self._policies: dict[str, dict[str, Any]] = {}
        self._meta: dict[str, tuple[int, datetime]] = {}  # per stored message: (store order, stored at)
        self._accepted: set[str] = set()  # every id stored with de-duplication (the SQL store's ids table)
        self._known: dict[str, datetime | None] = {}  # known destinations: when paused, or None
        self._claims: list[_MemoryClaim] = []  # open claims

    def clock(self) -> datetime:
        return self._clock()

    def _put(self, message: DelayedMessage) -> None:
        with self._lock:
            self._messages[message.message_id] = message
            self._meta.setdefault(message.message_id, (next(self._seq), self.clock()))
            heapq.heappush(self._heap, (message.due_at, next(self._seq), message.message_id))
            self._lock.notify_all()

    def store(self, messages: Sequence[DelayedMessage], deduplicate: bool = True) -> int:
        with self._lock:
            new = [m for m in dict((m.message_id, m) for m in messages).values()
                   if m.message_id not in self._messages and not (deduplicate and m.message_id in self._accepted)]
            now = self.clock()
            for m in new:
                self._meta[m.message_id] = (next(self._seq), now)
                self._put(m)
            if deduplicate:
                self._accepted.update(m.message_id for m in new)
            if new:
                for destination in {m.destination for m in messages}:
                    self._known.setdefault(destination, None)
            return len(new)

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
                if m.destination in exclude or self._paused(m.destination) \
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
        finally:  # an error releases the whole batch; a normal end returns what was not settled
            with self._lock:
                claim.restore()
                self._claims.remove(claim)
                for m in claim.messages:  # delivered ones are gone for good
                    if m.message_id not in self._messages and not self._held(m.message_id):
                        self._meta.pop(m.message_id, None)
                self._settled.notify_all()

    def _held(self, message_id: str) -> bool:
        return any(message_id in c._unsettled for c in self._claims)

    def next_due(self, destination: str | None = None, due_before: datetime | None = None) -> datetime | None:
        with self._lock:
            dues = [m.due_at for m in self._messages.values()
                    if (destination is None or m.destination == destination) and not self._paused(m.destination)
                    and (due_before is None or m.due_at < due_before)]
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
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
            raise InvalidInputError(f"limit must be an int from 1 to {MAX_PAGE}, got {limit!r}")
        start = _cursor(after) if after else None
        with self._lock:
            rows = [(self._key(m), m, self._meta[m.message_id][1]) for m in self._select(selector)]
            paused = {d for d in self._known if self._paused(d)}
        if start is not None:
            rows = [row for row in rows if row[0] > start]
        page = []
        for _, m, stored_at in rows[:limit]:
            item = {"message_id": m.message_id, "destination": m.destination, "due_at": m.due_at.isoformat(),
                    "stored_at": stored_at.astimezone(UTC).isoformat(), "failures": m.failures,
                    "headers": dict(m.headers), "in_flight": False, "paused": m.destination in paused}
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
            dues = [(m.destination, m.due_at) for m in self._messages.values()
                    if destination is None or m.destination == destination]
        report: dict[str, dict[str, Any]] = {
            name: {"scheduled": 0, "due": 0, "in_flight": 0, "paused": known.get(name, False),
                   "histogram": empty_histogram()}
            for name in sorted({d for d, _ in dues} | ({destination} if destination else set(known)))}
        for name, due_at in dues:
            report[name]["scheduled"] += 1
            report[name]["histogram"][bucket_of((due_at - now).total_seconds())] += 1
        for entry in report.values():
            entry["due"] = entry["histogram"]["due"]
        totals = {k: sum(e[k] for e in report.values()) for k in ("scheduled", "due", "in_flight")}
        totals["paused_due"] = sum(e["due"] for e in report.values() if e["paused"])
        return {"at": now.astimezone(UTC).isoformat(), "destinations": report, "totals": totals}

    def cancel(self, selector: Selector) -> dict[str, Any]:
        return self._report(selector, self._change(selector, None))

    def reschedule(self, selector: Selector, due_at: datetime) -> dict[str, Any]:
        due = max(due_at, self.clock()).astimezone(UTC)
        report = self._report(selector, self._change(selector, due))
        report["rescheduled"] = report.pop("cancelled")
        report["counts"]["rescheduled"] = report["counts"].pop("cancelled")
        report["due_at"] = due.isoformat()
        return report

    def purge(self, destination: str, dry_run: bool = True) -> dict[str, Any]:
        self.check_known([check_destination(destination)])
        if dry_run:
            counts = self.backlog(destination)["destinations"][destination]
            return {"destination": destination, "dry_run": True, "would_purge": counts["scheduled"],
                    "in_flight": 0}
        purged = self._change(Selector(destination=destination), None)
        return {"destination": destination, "dry_run": False, "purged": len(purged), "in_flight": 0}

    def _change(self, selector: Selector, due_at: datetime | None) -> list[str]:
        """Delete (due_at None) or re-time the selected messages, once no open claim holds one of them."""
        selector.require_something()
        if selector.destination is not None:
            self.check_known([selector.destination])
        matches = _matcher(selector)
        changed = []
        with self._lock:
            while any(matches(m) for c in self._claims for m in c._unsettled.values()):
                self._settled.wait()
            for m in self._select(selector):
                if due_at is None:
                    del self._messages[m.message_id]
                    self._meta.pop(m.message_id, None)
                elif m.due_at != due_at:  # one already due then stays as it is, and counts as rescheduled
                    self._put(DelayedMessage.trusted(m.destination, m.body, due_at, dict(m.headers), m.message_id,
                                                     m.failures))
                changed.append(m.message_id)
        return changed

    def _report(self, selector: Selector, changed: list[str]) -> dict[str, Any]:
        if not selector.message_ids:
            return {"cancelled": changed[:_LISTED], "in_flight": [], "counts": {"cancelled": len(changed),
                    "in_flight": 0}, "truncated": len(changed) > _LISTED, "selector": selector.describe()}
        done = set(changed)
        with self._lock:
            accepted = [m for m in selector.message_ids if m not in done and m in self._accepted]
        return {**cancel_report(selector.message_ids, changed, [], accepted), "selector": selector.describe()}

    def _select(self, selector: Selector) -> list[DelayedMessage]:
        """The stored messages the selector matches, soonest due first (under the lock)."""
        matches = _matcher(selector)
        pool = ([self._messages[i] for i in selector.message_ids if i in self._messages] if selector.message_ids
                else list(self._messages.values()))
        return sorted(filter(matches, pool), key=self._key)

    def _key(self, m: DelayedMessage) -> tuple[int, int]:
        return (m.due_at - _EPOCH) // _US, self._meta[m.message_id][0]

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
        names = sorted(set(destinations))
        if not names:
            raise InvalidInputError("name the destination(s) to pause or resume")
        self.check_known(names)
        with self._lock:
            now = self.clock().astimezone(UTC)
            changed = [name for name in names if self._paused(name) != paused]
            for name in changed:
                self._known[name] = now if paused else None
            if changed and not paused:
                self._lock.notify_all()  # resumed messages may be due now: wake the waiters
        return {"changed": changed, "unchanged": [n for n in names if n not in changed]}


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
#: Ids listed in a report at most (the counts are always complete), as the SQL store.
_LISTED = 1_000


def _matcher(selector: Selector) -> Callable[[DelayedMessage], bool]:
    ids = frozenset(selector.message_ids)

    def matches(m: DelayedMessage) -> bool:
        return ((not ids or m.message_id in ids)
                and (selector.destination is None or m.destination == selector.destination)
                and selector.matches_headers(m.headers)
                and (selector.due_from is None or m.due_at >= selector.due_from)
                and (selector.due_before is None or m.due_at < selector.due_before))

    return matches


def _cursor(value: str) -> tuple[int, int]:
    try:
        due_us, order = (int(part) for part in value.split(":"))
    except (ValueError, AttributeError):
        raise InvalidInputError(f"after must be the `next` cursor of a previous page, got {value!r}") from None
    return due_us, order


class InMemoryTransport(Transport):
    """Queues in memory: provisioned destinations receive; others fail with DestinationNotFoundError.

    A message sent before its due time is held until then (`scheduled` in depth()), like a broker's own
    delays; take_held() takes such messages back, and messages taken to the poison queue land in `poisoned`.
    """

    name = "memory"
    can_take_back = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, dict[str, tuple[ReceivedMessage, datetime]]] = {}
        self._receipts = itertools.count()
        # Held until due, by receipt: the message (None when it cannot be read back) and its raw body.
        self._held: dict[str, tuple[DelayedMessage | None, bytes]] = {}
        self._taken: dict[str, tuple[DelayedMessage | None, bytes]] = {}
        #: Bodies of held messages sent to poison by poison_held(), oldest first.
        self.poisoned: list[bytes] = []

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> InMemoryTransport:
        return cls()

    def provision(self, endpoint: str, **options: Any) -> dict[str, Any]:
        with self._lock:
            created = check_destination(endpoint) not in self._queues
            self._queues.setdefault(endpoint, {})
        return {"transport": self.name, "endpoint": endpoint, "created": created}

    def verify(self, endpoints: Iterable[str] = ()) -> dict[str, Any]:
        missing = [e for e in endpoints if e not in self._queues]
        return {"complete": not missing, "missing": missing, "different": []}

    def send(self, messages: Sequence[DelayedMessage], connection: Any = None) -> dict[str, Exception]:
        failures: dict[str, Exception] = {}
        now = self.clock()
        with self._lock:
            for m in messages:
                queue = self._queues.get(m.destination)
                if queue is None:
                    failures[m.message_id] = DestinationNotFoundError(f"queue {m.destination!r} does not exist")
                    continue
                receipt = f"r{next(self._receipts)}"
                if m.due_at > now:
                    self._held[receipt] = (m, m.body)
                else:
                    self._enqueue(queue, receipt, m, now)
        return failures

    def hold_unreadable(self, body: bytes) -> None:
        """Hold a message that cannot be read back (as a broker may hold one without the needed headers)."""
        with self._lock:
            self._held[f"r{next(self._receipts)}"] = (None, body)

    @staticmethod
    def _enqueue(queue: dict[str, tuple[ReceivedMessage, datetime]], receipt: str, m: DelayedMessage,
                 now: datetime) -> None:
        queue[receipt] = (ReceivedMessage(m.message_id, m.destination, m.body, dict(m.headers), receipt, now,
                                          m.due_at), now)

    def _deliver_due(self, now: datetime) -> None:
        """Move held messages whose time has come to their queues (under the lock)."""
        due = sorted(((m.due_at, receipt, m) for receipt, (m, _) in self._held.items()
                      if m is not None and m.due_at <= now), key=lambda entry: entry[0])
        for _, receipt, m in due:
            del self._held[receipt]
            self._enqueue(self._queues[m.destination], receipt, m, now)

    def receive(self, endpoint: str, max_messages: int = 10, visibility_timeout: float = 30.0) -> list[ReceivedMessage]:
        now = self.clock()
        got: list[ReceivedMessage] = []
        with self._lock:
            self._deliver_due(now)
            queue = self._queue(endpoint)
            for receipt, (message, visible_at) in list(queue.items()):
                if len(got) == max_messages:
                    break
                if visible_at <= now:
                    queue[receipt] = (message, now + timedelta(seconds=visibility_timeout))
                    got.append(message)
        return got

    def ack(self, endpoint: str, receipts: Iterable[Any]) -> int:
        with self._lock:
            queue = self._queue(endpoint)
            return sum(queue.pop(r, None) is not None for r in receipts)

    can_peek = True

    def peek(self, endpoint: str, max_messages: int = 10) -> list[ReceivedMessage]:
        now = self.clock()
        with self._lock:
            self._deliver_due(now)
            visible = [m for m, visible_at in self._queue(endpoint).values() if visible_at <= now]
        return [replace(m, receipt=None) for m in visible[:max_messages]]

    def release(self, endpoint: str, receipts: Iterable[Any]) -> int:
        """Make received, unacked messages visible again now."""
        now = self.clock()
        with self._lock:
            queue = self._queue(endpoint)
            released = [r for r in receipts if r in queue]
            for r in released:
                queue[r] = (queue[r][0], now)
        return len(released)

    def depth(self, endpoint: str) -> dict[str, int]:
        now = self.clock()
        with self._lock:
            self._deliver_due(now)
            states = [visible_at <= now for _, visible_at in self._queue(endpoint).values()]
            scheduled = sum(m is not None and m.destination == endpoint for m, _ in self._held.values())
        return {"visible": sum(states), "in_flight": len(states) - sum(states), "scheduled": scheduled}

    def take_held(self, max_messages: int) -> list[HeldMessage]:
        with self._lock:
            self._deliver_due(self.clock())  # due ones are no longer held: they are in their queues
            taken = list(itertools.islice(self._held.items(), max_messages))
            for receipt, entry in taken:
                del self._held[receipt]
                self._taken[receipt] = entry
        return [HeldMessage(m, receipt) for receipt, (m, _) in taken]

    def ack_held(self, receipts: Iterable[Any]) -> int:
        with self._lock:
            return sum(self._taken.pop(r, None) is not None for r in receipts)

    def poison_held(self, receipts: Iterable[Any]) -> int:
        with self._lock:
            bodies = [entry[1] for entry in (self._taken.pop(r, None) for r in receipts) if entry is not None]
            self.poisoned.extend(bodies)
        return len(bodies)

    def release_held(self, receipts: Iterable[Any]) -> None:
        with self._lock:
            for r in receipts:
                if r in self._taken:
                    self._held[r] = self._taken.pop(r)

    def _queue(self, endpoint: str) -> dict[str, tuple[ReceivedMessage, datetime]]:
        if endpoint not in self._queues:
            raise DestinationNotFoundError(f"queue {endpoint!r} does not exist")
        return self._queues[endpoint]
