"""Messages paused by a filter on the real PostgreSQL: they wait in a partition of their own that no claim reads,
a resume puts each back in the partition of its due time, and a pause under running pumps lets no paused message
through once it has returned (each is delivered before it, or held, once)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import timedelta

from sqlalchemy import text
from sqlalchemy.dialects import postgresql

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.tables import FIRST_HOUR, hour_tier, to_us
from tests.helpers import make_store, plan_nodes
from tests.integration.test_backlog_races import _Recording, drain_with_pumps
from tests.waiting import wait_for


def _partitions(store) -> dict[str, int]:
    """Rows per partition of the messages table, by the partition's name."""
    with store.engine.connect() as conn:
        rows = conn.execute(text(f"SELECT tableoid::regclass::text, count(*) FROM "
                                 f"{store.qualified(store.table_name)} GROUP BY 1")).all()
    return {name.rpartition(".")[2].strip('"'): n for name, n in rows}


def _waiting_for_a_lock(store) -> bool:
    """Whether a statement that changes the store's messages waits for a row lock."""
    with store.engine.connect() as conn:
        return bool(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                      "AND query LIKE 'UPDATE%' AND position(:table IN query) > 0"),
                                 {"table": store.table_name}).scalar())


def test_paused_messages_wait_in_their_partition_and_a_resume_puts_each_where_its_due_time_says(pg):
    store = make_store(*pg)
    now = store.clock()
    later = now + timedelta(hours=2)
    store.store([DelayedMessage("orders", b"x", now - timedelta(seconds=1), {"tenant": "a"}, f"due-{i}")
                 for i in range(300)]
                + [DelayedMessage("orders", b"x", later, {"tenant": "a"}, f"later-{i}") for i in range(20)]
                + [DelayedMessage("orders", b"x", now - timedelta(seconds=1), {"tenant": "b"}, f"b-{i}")
                   for i in range(30)])
    table = store.table_name
    store.controls.batch = 100
    report = store.pause_messages(Selector.build(headers={"tenant": "a"}))
    assert report["counts"]["paused"] == 320 and report["batches"] == 4
    assert _partitions(store) == {f"{table}_held": 320, f"{table}_soon": 30}

    store.resume_messages(Selector.build(headers={"tenant": "a"}))
    hour = store.tables.hours[hour_tier(to_us(later)) - FIRST_HOUR].name
    assert _partitions(store) == {f"{table}_soon": 330, hour: 20}


def test_a_claim_of_every_partition_never_reads_the_paused_messages(pg):
    """A claim that reads every partition (the move has not looked yet) plans no scan of `_held`, however many
    paused messages are due there."""
    store = make_store(*pg)
    due = store.clock() - timedelta(seconds=5)
    with store.engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {store.qualified(store.table_name)} (message_id, destination, body, "
                          "headers, due_at_us, stored_at_us, tier) SELECT 'held-' || g, 'orders', '\\x00', '{}', "
                          ":due, 0, -1 FROM generate_series(1, 5000) g"), {"due": to_us(due)})
    store.store([DelayedMessage("orders", b"x", due, message_id=f"live-{i}") for i in range(5)])
    ids = store.due_ids(store.clock(), 100, soon_only=False)
    sql = str(ids.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    with store.engine.connect() as conn:
        store.in_index_order(conn)
        plan = conn.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql.replace("%%", "%"))).scalar()[0]["Plan"]
    relations = {n.get("Relation Name") for n in plan_nodes(plan)}
    assert f"{store.table_name}_soon" in relations and f"{store.table_name}_held" not in relations, \
        json.dumps(plan)[:2000]
    with store.claim_due(store.clock(), 100) as claim:
        assert sorted(m.message_id for m in claim.messages) == [f"live-{i}" for i in range(5)]
        claim.remove([m.message_id for m in claim.messages])
    assert store.next_due() is None
    assert store.backlog("orders")["destinations"]["orders"]["held"] == 5000


def test_a_pause_under_running_pumps_lets_nothing_through_after_it_and_a_resume_delivers_each_once(pg):
    store = make_store(*pg)
    transport = _Recording(hold_after=300)
    for queue in ("orders", "error"):
        transport.provision(queue)
    due = utcnow() - timedelta(seconds=1)
    store.store([DelayedMessage("orders", b"x", due, {"tenant": "ab"[i % 2]}, f"orders-{i}") for i in range(3000)])
    threads = drain_with_pumps(pg, transport, 50)
    wait_for(lambda: transport.orders_sent() >= 300, 60, "300 orders sent")
    # The pumps' sends wait with a batch claimed each: the pause waits for those rows, then pauses what is left.
    store.controls.batch = 200
    result: dict = {}
    pausing = threading.Thread(target=lambda: result.update(store.pause_messages(
        Selector.build(headers={"tenant": "a"}))))
    pausing.start()
    wait_for(lambda: _waiting_for_a_lock(store), 60, "the pause to wait for the rows the pumps' claims hold")
    transport.resume.set()
    pausing.join(timeout=120)
    sent_at_pause = Counter(transport.sent)
    for t in threads:
        t.join(timeout=120)
    tenant_a = {f"orders-{i}" for i in range(0, 3000, 2)}
    assert result["counts"]["paused"] == store.backlog("orders")["totals"]["held"] > 0
    sent_a = {m for m in transport.sent if m in tenant_a}
    # Nothing of tenant a was sent after the pause returned; each message of it was sent or is held, not both.
    assert sent_a == {m for m in sent_at_pause if m in tenant_a}
    assert len(sent_a) + result["counts"]["paused"] == 1500
    assert store.count_scheduled() == {"orders": result["counts"]["paused"]}

    store.resume_messages(Selector.build(headers={"tenant": "a"}))
    for t in drain_with_pumps(pg, transport, 50):
        t.join(timeout=120)
    assert store.count_scheduled() == {}
    assert Counter(transport.sent) == Counter({f"orders-{i}": 1 for i in range(3000)})


def test_a_paused_delayed_dag_run_is_not_handed_to_airflow_until_resumed(pg):
    """Messages of a delayed DAG run's destination (taken by asset watchers' event leases, not by pumps) are paused
    the same way: no lease takes them, the next event due time passes over them, and a resume lets them go."""
    store = make_store(*pg)
    destination = "airflow.asset.orders_due"
    due = store.clock() - timedelta(seconds=3)
    store.store([DelayedMessage(destination, b"{}", due, {"tenant": t}, f"ev-{t}") for t in ("a", "b")])
    store.pause_messages(Selector.build(headers={"tenant": "a"}))
    store.open_event_claim("claim-1", destination, 60)
    leased, _ = store.lease_events("claim-1", destination, 10)
    assert [m.message_id for m in leased] == ["ev-b"]
    assert store.ack_events("claim-1", ["ev-b"]) == 1
    assert store.next_event_due(destination) is None
    store.resume_messages(Selector.build(headers={"tenant": "a"}))
    assert store.next_event_due(destination) == due
    assert [m.message_id for m in store.lease_events("claim-1", destination, 10)[0]] == ["ev-a"]
