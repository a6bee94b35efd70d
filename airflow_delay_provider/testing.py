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
from datetime import datetime, timedelta
from typing import Any

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import DestinationNotFoundError
from airflow_delay_provider.core.message import DelayedMessage, check_destination
from airflow_delay_provider.core.ports import Claim, DelayedMessageStore, HeldMessage, ReceivedMessage, Transport

__all__ = ["InMemoryStore", "InMemoryTransport"]


class _MemoryClaim(Claim):
    def __init__(self, store: InMemoryStore, messages: list[DelayedMessage]) -> None:
        self._store = store
        self.messages = messages
        self._unsettled = {m.message_id: m for m in messages}

    def remove(self, message_ids: Iterable[str]) -> int:
        return sum(self._unsettled.pop(mid, None) is not None for mid in list(message_ids))

    def retry(self, next_due: Mapping[str, datetime], headers: Mapping[str, dict[str, str]] | None = None) -> None:
        for mid, due in next_due.items():
            m = self._unsettled.pop(mid)
            self._store._put(DelayedMessage.trusted(m.destination, m.body, due,
                                                    dict((headers or {}).get(mid, m.headers)),
                                                    m.message_id, m.failures + 1))

    def restore(self) -> None:
        for m in self._unsettled.values():
            self._store._put(m)
        self._unsettled.clear()


class InMemoryStore(DelayedMessageStore):
    """A delayed-message store in a dict and a due-time heap; claims may overlap (like row locks)."""

    concurrent_claims = True

    def __init__(self, clock: Callable[[], datetime] = utcnow) -> None:
        self._clock = clock
        self._lock = threading.Condition()
        self._messages: dict[str, DelayedMessage] = {}
        self._heap: list[tuple[datetime, int, str]] = []
        self._seq = itertools.count()
        self._policies: dict[str, dict[str, Any]] = {}

    def clock(self) -> datetime:
        return self._clock()

    def _put(self, message: DelayedMessage) -> None:
        with self._lock:
            self._messages[message.message_id] = message
            heapq.heappush(self._heap, (message.due_at, next(self._seq), message.message_id))
            self._lock.notify_all()

    def store(self, messages: Sequence[DelayedMessage], deduplicate: bool = True) -> int:
        with self._lock:
            new = [m for m in dict((m.message_id, m) for m in messages).values() if m.message_id not in self._messages]
            for m in new:
                self._put(m)
            return len(new)

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
                if m.destination in exclude or (due_before is not None and m.due_at >= due_before):
                    skipped.append(entry)
                    continue
                del self._messages[m.message_id]
                taken.append(m)
            for entry in skipped:
                heapq.heappush(self._heap, entry)
        claim = _MemoryClaim(self, taken)
        try:
            yield claim
        finally:  # an error releases the whole batch; a normal end returns what was not settled
            claim.restore()

    def next_due(self, destination: str | None = None, due_before: datetime | None = None) -> datetime | None:
        with self._lock:
            dues = [m.due_at for m in self._messages.values()
                    if (destination is None or m.destination == destination)
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
        now = utcnow()
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
        now = utcnow()
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

    def depth(self, endpoint: str) -> dict[str, int]:
        now = utcnow()
        with self._lock:
            self._deliver_due(now)
            states = [visible_at <= now for _, visible_at in self._queue(endpoint).values()]
            scheduled = sum(m is not None and m.destination == endpoint for m, _ in self._held.values())
        return {"visible": sum(states), "in_flight": len(states) - sum(states), "scheduled": scheduled}

    def take_held(self, max_messages: int) -> list[HeldMessage]:
        with self._lock:
            self._deliver_due(utcnow())  # due ones are no longer held: they are in their queues
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
