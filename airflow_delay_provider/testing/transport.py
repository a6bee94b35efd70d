"""The in-memory transport: queues in dicts, native delays (a message sent before its due time waits for it)
and taking such messages back, as the RabbitMQ transport does for a migration to the store. The smallest
complete `Transport`: the example of docs/howto/adding-a-transport.md."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from airflow_delay_provider.core.errors import DestinationNotFoundError
from airflow_delay_provider.core.message import DelayedMessage, check_destination
from airflow_delay_provider.core.ports import HeldMessage, ReceivedMessage, Transport


class InMemoryTransport(Transport):
    """Queues in memory: provisioned destinations receive; others fail with DestinationNotFoundError.

    A message sent before its due time is held until then (`scheduled` in depth()), like a broker's own
    delays; take_held() takes such messages back, and messages taken to the poison queue land in `poisoned`.
    """

    name = "memory"
    delays_natively = True
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
