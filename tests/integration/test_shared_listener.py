"""The LISTEN connection store objects share in an event loop (stores/listener.py), on the real PostgreSQL: one
connection for many waiting store objects, notifications fanned out to each, a killed connection re-opened, closed
with the last store object, one per loop."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

from sqlalchemy import text

from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores import listener
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from tests.helpers import make_store
from tests.waiting import Sleep, SleepLog, wait_for


def _listening(store) -> list:
    """(pid, application_name) of the backends that LISTEN on the store's channel."""
    with store.engine.connect() as conn:
        return conn.execute(text("SELECT pid, application_name FROM pg_stat_activity "
                                 "WHERE datname = current_database() AND query = :q"),
                            {"q": f'LISTEN "{store.channel}"'}).all()


class Waiters:
    """`n` store objects on the test's table, each waiting again and again until `until` in a task of its own,
    each with a SleepLog; `writer` stores messages (and never waits)."""

    def __init__(self, pg, n: int) -> None:
        url, schema, table = pg
        self.writer = make_store(url, schema, table)
        self.stores = [SqlDelayedMessageStore(url, table=table, schema=schema) for _ in range(n)]
        self.logs = [SleepLog(store) for store in self.stores]
        self.tasks: list[asyncio.Task] = []

    def start(self, until) -> None:
        async def wait(store):
            while True:
                await store.wait_async(until)

        self.tasks = [asyncio.create_task(wait(store)) for store in self.stores]

    async def asleep(self, what: str, matching=lambda i, s: True) -> list[Sleep]:
        """Each store's sleep that `matching(i, sleep)` accepts, once every store sleeps in one."""
        return await asyncio.to_thread(
            lambda: [log.asleep(30, what, lambda s, i=i: matching(i, s)) for i, log in enumerate(self.logs)])

    async def store_due_in(self, seconds: float, message_id: str):
        due = self.writer.clock() + timedelta(seconds=seconds)
        await asyncio.to_thread(self.writer.store, [DelayedMessage("orders", b"", due, message_id=message_id)])
        return due

    async def listening(self) -> list:
        return await asyncio.to_thread(_listening, self.writer)

    async def stop(self, stores=None) -> None:
        """Cancel the waits (as a triggerer cancels its triggers) and close the stores (`stores`: only these)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        for store in self.stores if stores is None else stores:
            await store.aclose()


def _ended(sleeps: list[Sleep]) -> bool:
    return all(s.ended is not None for s in sleeps)


def test_fifty_waiting_stores_hold_one_connection_and_a_sooner_message_wakes_them_all(pg):
    waiters = Waiters(pg, 50)

    async def scenario():
        assert await waiters.listening() == []
        waiters.start(waiters.writer.clock() + timedelta(hours=1))
        asleep = await waiters.asleep("on the shared connection")
        [(_, name)] = await waiters.listening()
        assert name == listener.APPLICATION_NAME
        assert len({id(s.listener.listener) for s in asleep}) == 1  # one connection under every subscription
        due = await waiters.store_due_in(5, "soon")
        await asyncio.to_thread(wait_for, lambda: _ended(asleep), 10, "every store to wake")
        assert all(s.ended < due for s in asleep), [s.ended for s in asleep]  # by the notification, not the time
        await waiters.stop()

    asyncio.run(scenario())


def test_a_message_due_after_the_waits_wakes_nobody(pg):
    waiters = Waiters(pg, 10)
    probe = Waiters(pg, 1)  # waits past the message's due time: woken by its notification

    async def scenario():
        now = waiters.writer.clock()
        waiters.start(now + timedelta(minutes=5))
        probe.start(now + timedelta(hours=2))
        asleep = await waiters.asleep("until five minutes from now")
        [probed] = await probe.asleep("until two hours from now")
        await waiters.store_due_in(3600, "later")
        # The probe's wake-up and its next sleep come after the hub handed the notification to every store.
        await probe.asleep("again", lambda i, s: s is not probed)
        assert not [s for s in asleep if s.ended is not None]
        await waiters.stop()
        await probe.stop()

    asyncio.run(scenario())


def test_a_message_stored_between_two_waits_cuts_the_next_one_short(pg):
    waiters = Waiters(pg, 1)  # its wake-up says the notification was handed to every subscriber
    url, schema, table = pg
    idle = SqlDelayedMessageStore(url, table=table, schema=schema)  # a dispatcher between two waits

    async def scenario():
        far = waiters.writer.clock() + timedelta(hours=1)
        await idle.wait_async(far)  # subscribes, and returns once LISTEN is in effect
        waiters.start(far)
        [asleep] = await waiters.asleep("on the shared connection")
        due = await waiters.store_due_in(5, "soon")
        await asyncio.to_thread(wait_for, lambda: asleep.ended, 10, "the notification")
        # As a connection of its own would have held it, the notification was kept for this wait.
        await asyncio.wait_for(idle.wait_async(far), 10)
        assert idle.clock() < due
        await waiters.stop()
        await idle.aclose()

    asyncio.run(scenario())


def test_a_killed_connection_wakes_every_store_and_the_next_waits_open_one_again(pg):
    waiters = Waiters(pg, 20)

    async def scenario():
        waiters.start(waiters.writer.clock() + timedelta(hours=1))
        asleep = await waiters.asleep("on the shared connection")
        [(pid, _)] = await waiters.listening()
        await asyncio.to_thread(_terminate, waiters.writer, pid)
        await asyncio.to_thread(wait_for, lambda: _ended(asleep), 10, "every store to wake")
        again = await waiters.asleep("on a new connection", lambda i, s: s.listener is not asleep[i].listener)
        [(new_pid, _)] = await waiters.listening()
        assert new_pid != pid
        assert len({id(s.listener.listener) for s in again}) == 1
        due = await waiters.store_due_in(5, "soon")
        await asyncio.to_thread(wait_for, lambda: _ended(again), 10, "every store to wake on the new connection")
        assert all(s.ended < due for s in again)
        await waiters.stop()

    asyncio.run(scenario())


def _terminate(store, pid: int) -> None:
    with store.engine.begin() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()


def test_the_connection_closes_with_the_last_store_and_nothing_is_left(pg):
    waiters = Waiters(pg, 10)

    async def scenario():
        waiters.start(waiters.writer.clock() + timedelta(hours=1))
        await waiters.asleep("on the shared connection")
        [(pid, _)] = await waiters.listening()
        await waiters.stop(waiters.stores[:-1])
        assert await waiters.listening() == [(pid, listener.APPLICATION_NAME)]  # one store object still needs it
        await waiters.stores[-1].aclose()
        await asyncio.to_thread(wait_for, lambda: _listening(waiters.writer) == [], 10, "the connection to go")
        assert asyncio.all_tasks() == {asyncio.current_task()}  # the reader task ended with its connection
        assert not [key for key in listener._listeners if key[0] is asyncio.get_running_loop()]

    asyncio.run(scenario())


def test_each_event_loop_has_a_connection_of_its_own(pg):
    groups = [Waiters(pg, 5) for _ in range(2)]
    both_asleep = threading.Barrier(3)
    pids = []

    async def scenario(waiters):
        waiters.start(waiters.writer.clock() + timedelta(hours=1))
        await waiters.asleep("on its loop's connection")
        await asyncio.to_thread(both_asleep.wait, 30)  # counted by the test while both loops wait
        await asyncio.to_thread(both_asleep.wait, 30)
        await waiters.stop()

    threads = [threading.Thread(target=asyncio.run, args=(scenario(g),)) for g in groups]
    for thread in threads:
        thread.start()
    both_asleep.wait(30)
    pids.extend(pid for pid, _ in _listening(groups[0].writer))
    both_asleep.wait(30)
    for thread in threads:
        thread.join(30)
    assert len(set(pids)) == 2
    wait_for(lambda: _listening(groups[0].writer) == [], 10, "both connections to go")


def test_a_dispatcher_restricted_to_its_destinations_sleeps_through_other_teams_sends(pg):
    """Sends name their destinations in the wake-up: 50 teams' dispatchers are not all woken by one team's."""
    url, schema, table = pg
    writer = make_store(url, schema, table)
    team_a = SqlDelayedMessageStore(url, table=table, schema=schema).restrict(prefix="team-a.")
    team_b = SqlDelayedMessageStore(url, table=table, schema=schema).restrict(destinations=["team-b.orders"])
    logs = {"a": SleepLog(team_a), "b": SleepLog(team_b)}

    async def scenario():
        until = writer.clock() + timedelta(hours=1)

        async def wait(store):
            while True:
                await store.wait_async(until)

        tasks = [asyncio.create_task(wait(s)) for s in (team_a, team_b)]
        try:
            slept = {k: await asyncio.to_thread(log.asleep, 30, f"team {k} on the connection") for k, log in
                     logs.items()}
            due = writer.clock() + timedelta(minutes=5)
            await asyncio.to_thread(writer.store, [DelayedMessage("team-a.orders", b"", due)])
            await asyncio.to_thread(wait_for, lambda: slept["a"].ended is not None, 30, "team a's wake-up")
            assert slept["b"].ended is None  # team b's sleep goes on
            await asyncio.to_thread(writer.store, [DelayedMessage("team-b.orders", b"", due)])
            await asyncio.to_thread(wait_for, lambda: slept["b"].ended is not None, 30, "team b's wake-up")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for store in (team_a, team_b):
                await store.aclose()

    asyncio.run(scenario())


def test_a_send_to_many_destinations_wakes_every_dispatcher(pg):
    url, schema, table = pg
    writer = make_store(url, schema, table)
    team_a = SqlDelayedMessageStore(url, table=table, schema=schema).restrict(prefix="team-a.")
    log = SleepLog(team_a)
    team_a.wait(team_a.clock() + timedelta(seconds=1))  # opens its (synchronous) LISTEN connection
    until = team_a.clock() + timedelta(hours=1)
    worker = threading.Thread(target=team_a.wait, args=(until,))
    worker.start()
    try:
        sleep = log.asleep(30, "the pump's sleep")
        due = writer.clock() + timedelta(minutes=5)
        writer.store([DelayedMessage(f"other-{i}", b"", due) for i in range(20)])  # too many to name
        wait_for(lambda: sleep.ended is not None, 30, "the wake-up naming no destination")
    finally:
        worker.join(timeout=60)
        team_a.close()
