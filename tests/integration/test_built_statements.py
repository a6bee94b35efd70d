"""The statements of the hot paths (a pump's claim and move, a consumer's receive) are built once per store or queue
object and run prepared from their first run on a connection, on the real PostgreSQL and SQLite; what they take
follows the values of each run and the store object's scope."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import text

from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport


@pytest.fixture
def parts(db):
    yield from _parts(*db)


@pytest.fixture
def pg_parts(pg):
    yield from _parts(*pg)


def _parts(url: str, schema: str | None, table: str):
    """A store and its SQL-table queues `orders` and `refunds`, in one database."""
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    queue = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    for name in ("orders", "refunds"):
        queue.provision(name)
    if store.is_postgres:
        store.later.run()  # the move's look: claims read `_soon` alone, as a running pump's do
    yield store, queue
    queue.close()
    store.close()


def _due(store: SqlDelayedMessageStore, destination: str, n: int, prefix: str, ago: float = 1.0) -> None:
    due = store.clock() - timedelta(seconds=ago)
    store.store([DelayedMessage(destination, b"x", due, {"k": prefix}, f"{prefix}-{i}") for i in range(n)])


def _ran(database) -> list:
    """The statements `run_prepared` runs on `database`, in order."""
    ran: list = []
    run = database.run_prepared

    def recording(conn, statement, values):
        ran.append(statement)
        return run(conn, statement, values)

    database.run_prepared = recording
    return ran


def _prepared(database, starts: str) -> int:
    """Prepared statements starting with `starts` on the connection the pool hands out next (the last used)."""
    with database.engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE :s"),
                            {"s": starts + "%"}).scalar_one()


def test_a_claim_is_built_once_and_takes_what_each_runs_values_say(parts):
    store, _ = parts
    ran = _ran(store)
    _due(store, "orders", 5, "a")
    with store.claim_due(store.clock(), 3) as claim:
        first = [m.message_id for m in claim.messages]
        claim.remove(first)  # delivered
    _due(store, "orders", 2, "b", ago=0.5)
    with store.claim_due(store.clock(), 10) as claim:
        second = [m.message_id for m in claim.messages]
        claim.remove(second)
    assert first == ["a-0", "a-1", "a-2"]
    assert sorted(second) == ["a-3", "a-4", "b-0", "b-1"]  # the limit and the moment of each run
    assert len(ran) == 2 and ran[0] is ran[1]
    with store.claim_due(store.clock() - timedelta(seconds=5), 10) as claim:  # a moment before any is due
        assert claim.messages == []
    if store.is_postgres:
        assert _prepared(store, "DELETE FROM") >= 1


def test_a_move_into_sql_queues_is_built_once_and_prepared_from_its_first_run(pg_parts):
    store, queue = pg_parts  # SQLite has no move by statement: its claims go through the pump
    ran = _ran(store)
    _due(store, "orders", 4, "a")
    assert [n for _, _, n in queue.move_due(store, store.clock(), 3)] == [3]
    assert _prepared(store, "WITH claimed AS") >= 1  # prepared at its first run, not its sixth
    _due(store, "refunds", 2, "r")
    moved = queue.move_due(store, store.clock(), 10)
    assert sorted((q, n) for q, _, n in moved) == [("orders", 1), ("refunds", 2)]
    assert len(ran) == 2 and ran[0] is ran[1]
    got = queue.receive("orders", 10) + queue.receive("refunds", 10)
    assert sorted(m.message_id for m in got) == ["a-0", "a-1", "a-2", "a-3", "r-0", "r-1"]


def test_a_scope_set_after_claims_were_built_narrows_the_next_claim(parts):
    store, _ = parts
    _due(store, "orders", 2, "o")
    _due(store, "refunds", 2, "r")
    with store.claim_due(store.clock(), 1) as claim:  # built for the whole store
        claim.remove([m.message_id for m in claim.messages])
    store.restrict(destinations=["refunds"])
    with store.claim_due(store.clock(), 10) as claim:
        assert sorted(m.destination for m in claim.messages) == ["refunds", "refunds"]


def test_a_receive_takes_hides_and_counts_in_one_statement_prepared_from_its_first_run(parts):
    store, queue = parts
    ran = _ran(queue)
    now = queue.clock()
    queue.send([DelayedMessage("orders", b"x", now, {}, f"m-{i}") for i in range(5)])
    first = queue.receive("orders", 3, visibility_timeout=60)
    assert [m.message_id for m in first] == ["m-0", "m-1", "m-2"]  # queue order, whatever RETURNING gives
    assert {m.receive_count for m in first} == {1}
    assert [m.message_id for m in queue.receive("orders", 10)] == ["m-3", "m-4"]  # the first three are hidden
    assert queue.receive("orders", 10) == []
    assert queue.release("orders", [m.receipt for m in first]) == 3
    again = queue.receive("orders", 10)
    assert [(m.message_id, m.receive_count) for m in again] == [("m-0", 2), ("m-1", 2), ("m-2", 2)]
    assert len(ran) == 4 and all(statement is ran[0] for statement in ran)
    if queue.is_postgres:
        assert _prepared(queue, "UPDATE") >= 1
