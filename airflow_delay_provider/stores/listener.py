"""One LISTEN connection per database, channel and event loop, shared by every store object waiting in that loop.

A triggerer runs its deferred dispatchers in one event loop, each on a store object of its own: a connection per
store object made 50 dispatchers hold 50 connections beside the pool. A store object subscribes at its first
`wait_async` (which returns once LISTEN is in effect, so the caller re-reads the store) and stays subscribed
between waits until `aclose()` or the connection's loss. The first subscriber opens the connection, the last to
leave closes it at once (no grace period: a dispatcher stays subscribed while it works between waits). One task
reads the connection and hands each notification to every subscriber: a waiting one wakes if the message is due
before its `until`, an idle one keeps the soonest for its next wait. A lost connection wakes every subscriber
and ends the subscriptions; the next wait opens a new connection.

Pumps in worker processes (the synchronous `wait`) keep a connection per store object. `StoreWaiting` is a store
object's waiting, both ways.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from datetime import datetime
from typing import TYPE_CHECKING, Any

from airflow_delay_provider.stores.engine import KEEPALIVES, Database, engine_url, safe_url
from airflow_delay_provider.stores.tables import to_us

if TYPE_CHECKING:
    import psycopg
    from psycopg import Notify

log = logging.getLogger(__name__)

#: Without LISTEN/NOTIFY (SQLite) an idle pump re-reads the next due time this often.
SQLITE_POLL_SECONDS = 0.5
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


class StoreWaiting:
    """How one store object waits for its next due time: woken by a NOTIFY of a message due sooner on PostgreSQL
    (a LISTEN connection of its own for `wait`, the loop's shared one for `wait_async`), a short poll on SQLite.

    :param channel: the store's NOTIFY channel.
    :param wants: the destinations the store object serves (None: all), read at each wait (`restrict` changes it).
    """

    def __init__(self, db: Database, channel: str, wants: Callable[[], Callable[[str], bool] | None]) -> None:
        self.db = db
        self.channel = channel
        self.wants = wants
        self.listener: psycopg.Connection[Any] | None = None
        self.subscription: Subscription | None = None  # this object's place on the loop's shared LISTEN connection

    def wait(self, until: datetime) -> None:
        """Sleep until `until`, returning early when a message due sooner is stored. A lost listening connection
        is dropped and opened again on the next call; the caller re-reads the store in between, under its own
        circuit breaker."""
        remaining = (until - self.db.clock()).total_seconds()
        if remaining <= 0:
            return
        if not self.db.is_postgres:
            time.sleep(min(remaining, SQLITE_POLL_SECONDS))
            return
        if self.listener is None or self.listener.closed:
            try:
                self.listener = self._listen()
            except Exception as exc:  # the database is down: wait a little, the caller's breaker decides
                log.warning("could not LISTEN for new messages (%s); retrying", exc)
                time.sleep(min(remaining, 1.0))
            # A message stored before LISTEN took effect sent no notification we could see:
            # return so the caller reads the next due time again, now with the listener in place.
            return
        listener = self.listener
        until_us = to_us(until)
        deadline = time.monotonic() + remaining
        try:
            while (left := deadline - time.monotonic()) > 0:
                # Each notifies() runs to its end (one note or the timeout), leaving the connection idle.
                wants = self.wants()
                if [n for n in listener.notifies(timeout=left, stop_after=1) if sooner(n, until_us, wants)]:
                    return
        except Exception as exc:  # killed backend, restart, fail-over: listen again next time
            log.warning("lost the LISTEN connection (%s); listening again", exc)
            self._close_listener()

    async def wait_async(self, until: datetime) -> None:
        """`wait` for an event loop (a trigger): the same wake-ups, on the LISTEN connection that every store
        object of this database and table waiting in the loop shares."""
        remaining = (until - self.db.clock()).total_seconds()
        if remaining <= 0:
            return
        if not self.db.is_postgres:
            await asyncio.sleep(min(remaining, SQLITE_POLL_SECONDS))
            return
        subscription = self.subscription
        if subscription is None or subscription.closed or subscription.loop is not asyncio.get_running_loop():
            if subscription is not None:
                await subscription.leave()
            self.subscription = subscription = subscribe(self._listen_url(), self.channel, self.wants())
        await subscription.wait(to_us(until), remaining)

    def _listen_url(self) -> str:
        return engine_url(self.db.url).set(drivername="postgresql").render_as_string(hide_password=False)

    def _listen(self) -> psycopg.Connection[Any]:
        import psycopg  # only PostgreSQL stores get here

        conn = psycopg.connect(self._listen_url(), autocommit=True, **KEEPALIVES)
        conn.execute(f'LISTEN "{self.channel}"')  # channel is a hex digest with a fixed prefix
        return conn

    def _close_listener(self) -> None:
        if self.listener is not None:
            try:
                self.listener.close()
            finally:
                self.listener = None

    def close(self) -> None:
        self._close_listener()

    async def aclose(self) -> None:
        subscription, self.subscription = self.subscription, None
        if subscription is not None:
            await subscription.leave()
        self.close()
