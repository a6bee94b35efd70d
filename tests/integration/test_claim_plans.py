"""The claims' plans on the real PostgreSQL when the statistics are stale, as they are in a queue: the rows due
now were stored after the last ANALYZE. A claim of a batch must read the batch from the due index, not every
due row, whether the last ANALYZE saw only messages due later (with 2,000,000 stored, the move of 16 rows into
SQL queues read all 20,000 due rows: 27 ms instead of 1) or an empty table (a burst of 20,000 then went at a
sixth of its rate: every batch scanned and sorted the whole table)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import BigInteger, delete, literal, text
from sqlalchemy.dialects import postgresql

from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.stores.tables import to_us
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.helpers import plan_nodes

BATCH = 16


def _store(pg, later: int) -> tuple[SqlDelayedMessageStore, SqlTableTransport]:
    """`later` messages due a day or more later (other teams'), then ANALYZE, then 5,000 due now."""
    url, schema, table = pg
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    queue = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    queue.provision("orders")
    with store.engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {store.qualified(store.table_name)} (message_id, destination, body, headers, "
                          "due_at_us, stored_at_us) SELECT 'later-' || g, 'later-' || (g % 20), '\\x00', '{}', "
                          ":later + (random() * 6e11)::bigint, 0 FROM generate_series(1, :n) g"),
                     {"later": to_us(store.clock() + timedelta(days=1)), "n": later})
        conn.execute(text(f"ANALYZE {store.qualified(store.table_name)}"))
    due = store.clock() - timedelta(seconds=1)
    for _ in range(5):
        store.store([DelayedMessage("orders", b"x", due) for _ in range(1000)])
    return store, queue


def _rows_scanned(store: SqlDelayedMessageStore, statement) -> int:
    """EXPLAIN ANALYZE (rolled back) of a claim in a transaction set up as the store sets up its claims: the rows
    its scans of the messages table read, other than the look-ups of the claimed rows by key or place."""
    sql = str(statement.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    with store.engine.connect() as conn:
        store.in_index_order(conn)
        # On these small tables the planner nests a loop where on millions of rows it hash-joins every due row
        # with the queues (and sorts them all for a batch): whatever join it would pick, only the batch is read.
        conn.execute(text("SET LOCAL enable_nestloop = off"))
        plan = conn.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql.replace("%%", "%"))).scalar()[0]["Plan"]
    # The messages are in partitions (`_soon`, and `_later`'s: `_far` and an hour's each, schema version 9).
    tables = store.tables
    partitions = {t.name for t in (tables.soon, tables.later, tables.far, *tables.hours)}
    scans = [n for n in plan_nodes(plan) if n.get("Relation Name") in partitions and "Scan" in n["Node Type"]
             and n["Node Type"] != "Tid Scan" and not n.get("Index Name", "").endswith("_pkey")]
    assert scans, json.dumps(plan)[:2000]
    return sum(n["Actual Rows"] + n.get("Rows Removed by Filter", 0) for n in scans)


def _move(store, queue, soon_only):
    """The statement of a move into SQL queues that reads the due rows: of `_soon` alone, the move itself; of every
    partition, the locking read of its rows' places before it (`SqlDelayedMessageStore.taken`)."""
    ids = queue.provisioned(store, store.due_ids(store.clock(), BATCH, soon_only=soon_only))
    if not soon_only:
        return ids
    with store.engine.connect() as conn:  # where the move looks whether the delivery history is kept
        now_us = literal(to_us(store.clock()), BigInteger)
        return queue._moving(store, conn, store.claimed(ids, soon_only=True), now_us)[1]


def _claim(store, _queue, soon_only):
    """The same for a claim."""
    ids = store.due_ids(store.clock(), BATCH, soon_only=soon_only)
    return delete(store.table).where(store.claimed(ids, soon_only=True)).returning(store.table.c.id) \
        if soon_only else ids


@pytest.mark.parametrize("later", [0, 100_000], ids=["analysed-empty", "analysed-with-later-rows"])
@pytest.mark.parametrize("soon_only", [True, False], ids=["of-soon", "of-every-partition"])
@pytest.mark.parametrize("statement", [_move, _claim], ids=["move-into-sql-queues", "claim"])
def test_a_claim_reads_only_its_batch(pg, later, soon_only, statement):
    store, queue = _store(pg, later)
    assert _rows_scanned(store, statement(store, queue, soon_only)) <= BATCH


@pytest.mark.parametrize("analysed", [False, True], ids=["never-analysed", "analysed"])
def test_a_receive_reads_only_its_batch_from_a_long_queue(pg, analysed):
    """A consumer behind by 20,000 messages, 200 of them received and in flight at the head of the queue: a
    receive of 10 passes over those and reads 10, instead of reading and sorting every visible message (which
    made a consumer that fell behind slower the further it fell behind)."""
    url, schema, table = pg
    queue = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    queue.provision("orders")
    queue.provision("billing")
    due = queue.clock()
    for destination in ("billing", "orders"):
        for _ in range(10):
            queue.send([DelayedMessage(destination, b"x", due) for _ in range(1000)])
    assert len(queue.receive("orders", max_messages=200, visibility_timeout=600)) == 200
    if analysed:
        with queue.engine.begin() as conn:
            conn.execute(text(f"ANALYZE {queue.qualified(queue.messages.name)}"))
    sql = str(queue._receiving("orders", 10, queue.clock()).compile(
        dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    with queue.engine.connect() as conn:
        queue.in_index_order(conn)  # as receive() sets it up
        plan = conn.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)).scalar()[0]["Plan"]
    assert not [n for n in plan_nodes(plan) if n["Node Type"] == "Sort"], json.dumps(plan)[:2000]
    scans = [n for n in plan_nodes(plan) if n.get("Relation Name") == queue.messages.name]
    assert sum(n["Actual Rows"] + n.get("Rows Removed by Filter", 0) for n in scans) <= 200 + 10, \
        json.dumps(plan)[:2000]
    assert [m.receive_count for m in queue.receive("orders", max_messages=10)] == [1] * 10


def test_the_earliest_due_reading_takes_each_partitions_index_from_its_start_not_a_sort_of_all(pg):
    """Over the 28 partitions of schema version 9 the planner priced the plan that reads every partition's due
    index from its start and the one that reads and sorts all their rows alike (each partition's scan carries
    the store's subqueries over tables only a priced-out sequential scan reads), and took the sort: right after
    a fill of 10,000,000 a pump's reading of where its claims start ran for minutes. `in_index_order` prices
    sorts out too."""
    store, _ = _store(pg, 20_000)
    query = store.claims.earliest_due(to_us(store.clock())).where(store.table.c.due_at_us >= 0)
    sql = str(query.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    with store.engine.connect() as conn:
        store.in_index_order(conn)
        plan = conn.execute(text("EXPLAIN (FORMAT JSON) " + sql.replace("%%", "%"))).scalar()[0]["Plan"]
    kinds = [node["Node Type"] for node in plan_nodes(plan)]
    assert "Merge Append" in kinds and "Sort" not in kinds, kinds
