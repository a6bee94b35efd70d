"""One LISTEN connection per database, channel and event loop, shared by every store object waiting in that loop.

A triggerer runs its deferred dispatchers in one event loop, each on a store object of its own: a connection per
store object made 50 dispatchers hold 50 connections beside the pool. A store object subscribes at its first
`wait_async` (which returns once LISTEN is in effect, so the caller re-reads the store) and stays subscribed
between waits until `aclose()` or the connection's loss. The first subscriber opens the connection, the last to
leave closes it at once (no grace period: a dispatcher stays subscribed while it works between waits). One task
reads the connection and hands each notification to every subscriber: a waiting one wakes if the message is due
before its `until`, an idle one keeps the soonest for its next wait. A lost connection wakes every subscriber
and ends the subscriptions; the next wait opens a new connection.

Pumps in worker processes (the synchronous `wait`) keep a connection per store object.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING

from airflow_delay_provider.stores.engine import KEEPALIVES, safe_url

if TYPE_CHECKING:
    from psycopg import Notify

log = logging.getLogger(__name__)

#: The shared connections' application_name in pg_stat_activity, unless the store's URL sets its own.
APPLICATION_NAME = "airflow-delay-listener"

_lock = threading.Lock()  # loops in several threads subscribe and leave
_listeners: dict[tuple[asyncio.AbstractEventLoop, str, str], _Listener] = {}


def subscribe(url: str, channel: str, wants: Callable[[str], bool] | None = None) -> Subscription:
    """A subscription to `channel` on this loop's connection to `url` (libpq form, with its password), which
    is opened if there is none; `wants` says which destinations' notifications concern it (None: all)."""
    loop = asyncio.get_running_loop()
    with _lock:
        listener = _listeners.get((loop, url, channel))
        if listener is None:
            listener = _listeners[loop, url, channel] = _Listener(loop, url, channel)
    subscription = Subscription(listener, wants)
    listener.subscriptions.add(subscription)
    return subscription


class Subscription:
    """One store object's place on a shared connection."""

    def __init__(self, listener: _Listener, wants: Callable[[str], bool] | None = None) -> None:
        self.listener = listener
        self.wants = wants
        self.loop = listener.loop
        self._in_place = False  # a wait saw LISTEN in effect
        self._left = False
        self._until_us = 0
        self._woken: asyncio.Future[None] | None = None  # while a wait runs
        self._pending: Notify | None = None  # the soonest notification received between waits

    @property
    def closed(self) -> bool:
        return self._left or self.listener.closed

    async def wait(self, until_us: int, timeout: float) -> None:
        """Until a notification of a message due before `until_us`, the connection's loss, or `timeout` s."""
        ready = self.listener.ready
        if not self._in_place:
            # A message stored before LISTEN took effect sent no notification we could see: return once it is
            # in place, so the caller reads the next due time again.
            await asyncio.wait({ready}, timeout=timeout)
            if ready.done() and ready.result():
                self._in_place = True
            elif ready.done():  # the database is down: wait a little, the caller's breaker decides
                await asyncio.sleep(min(timeout, 1.0))
            return
        pending, self._pending = self._pending, None
        if self.closed or (pending is not None and sooner(pending, until_us, self.wants)):
            return
        self._until_us, self._woken = until_us, self.loop.create_future()
        try:
            await asyncio.wait({self._woken}, timeout=timeout)
        finally:
            self._woken = None

    def notify(self, note: Notify) -> None:
        if self._woken is None:
            if sooner(note, _due(self._pending) if self._pending else 2**63, self.wants):
                self._pending = note
        elif sooner(note, self._until_us, self.wants):
            self.wake()

    def wake(self) -> None:
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    async def leave(self) -> None:
        """Stop receiving; the last subscriber's leave closes the connection (returning once it is closed)."""
        self._left = True
        listener = self.listener
        if self.loop is asyncio.get_running_loop():
            self.wake()
            closing = listener.drop(self)
            if closing is not None:
                await asyncio.wait({closing})
        elif not self.loop.is_closed():  # a loop of before: it closes its own connection
            with suppress(RuntimeError):  # closed meanwhile
                self.loop.call_soon_threadsafe(listener.drop, self)


class _Listener:
    """One LISTEN connection and the task that reads it, for every subscriber of a channel in a loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, url: str, channel: str) -> None:
        self.loop, self.url, self.channel = loop, url, channel
        self.subscriptions: set[Subscription] = set()
        self.ready = loop.create_future()  # True once LISTEN is in effect, False if it could not be
        self.closed = False
        self._task = loop.create_task(self._run(), name=f"LISTEN {channel}")

    async def _run(self) -> None:
        import psycopg  # only PostgreSQL stores get here

        conn = None
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, fallback_application_name=APPLICATION_NAME, **KEEPALIVES)
            await conn.execute(f'LISTEN "{self.channel}"')  # channel is a hex digest with a fixed prefix
            self.ready.set_result(True)
            async for note in conn.notifies():
                for subscription in self.subscriptions:
                    subscription.notify(note)
        except Exception as exc:  # killed backend, restart, fail-over: the next wait listens again
            if self.ready.done():
                log.warning("lost the LISTEN connection to %s (%s); listening again", safe_url(self.url), exc)
            else:
                log.warning("could not LISTEN for new messages at %s (%s); retrying", safe_url(self.url), exc)
        finally:
            self._end()
            if conn is not None:
                await conn.close()

    def drop(self, subscription: Subscription) -> asyncio.Task[None] | None:
        """Remove a subscriber; after the last, the task that closes the connection."""
        self.subscriptions.discard(subscription)
        if self.subscriptions:
            return None
        if not self.closed:
            self._end()
            self._task.cancel()
        return self._task

    def _end(self) -> None:
        """No new subscribers from here on; those there are woken to re-read the store."""
        if self.closed:
            return
        self.closed = True
        if not self.ready.done():
            self.ready.set_result(False)
        with _lock:
            if _listeners.get((self.loop, self.url, self.channel)) is self:
                del _listeners[self.loop, self.url, self.channel]
        for subscription in self.subscriptions:
            subscription.wake()


def sooner(note: Notify, until_us: int, wants: Callable[[str], bool] | None = None) -> bool:
    """A notification of a message due before `until_us` for a destination the waiter serves (`wants`; None:
    all). The payload is the due time in microseconds, then the destination after a space when one was named
    (a send to a few destinations names each: a team's dispatcher sleeps through the other teams' sends)."""
    due, _, destination = note.payload.partition(" ")
    if not due.isdigit() or int(due) >= until_us:
        return False
    return not destination or wants is None or wants(destination)


def _due(note: Notify) -> int:
    return int(note.payload.partition(" ")[0])
