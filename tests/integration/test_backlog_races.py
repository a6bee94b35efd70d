"""Pausing and cancelling while pumps and a Spark sweep run, on the real PostgreSQL: a pause loses nothing
and lets nothing of the paused destination through after its in-flight batches; a cancel never removes
what a running sweep holds, and during a sweep that moves rows by statement it takes each message or leaves it,
once."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from datetime import timedelta

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.spark import sweep as sweep_app
from airflow_delay_provider.testing import InMemoryTransport
from tests.helpers import drain, make_store, make_transport
from tests.integration.test_spark import due_messages, spark_ready, specs, submit  # noqa: F401 - fixture
from tests.waiting import wait_for


class _Recording(InMemoryTransport):
    """Remembers which messages were sent; once `hold_after` orders were sent, each send waits for `resume`, so a
    pause lands while both pumps hold a claimed batch, however fast or slow the machine."""

    def __init__(self, hold_after: int) -> None:
        super().__init__()
        self.sent: list[str] = []
        self.hold_after = hold_after
        self.resume = threading.Event()

    def orders_sent(self) -> int:
        return sum(1 for m in self.sent if m.startswith("orders"))

    def send(self, messages, connection=None):
        if self.orders_sent() >= self.hold_after:
            assert self.resume.wait(60), "the test never resumed the sends"
        result = super().send(messages)
        self.sent.extend(m.message_id for m in messages if m.message_id not in result)
        return result


def drain_with_pumps(pg, transport: InMemoryTransport, batch_size: int) -> list[threading.Thread]:
    """Two pumps of stores of their own, each in a thread, stopping once nothing is left to claim."""
    pumps = [Pump(make_store(*pg), transport, PumpConfig(batch_size=batch_size)) for _ in range(2)]
    threads = [threading.Thread(target=p.run, kwargs={"stop_when_idle": True}) for p in pumps]
    for t in threads:
        t.start()
    return threads


def test_a_pause_under_running_pumps_holds_the_rest_and_a_resume_delivers_it_once(pg):
    store = make_store(*pg)
    transport = _Recording(hold_after=500)
    for queue in ("orders", "refunds", "error"):
        transport.provision(queue)
    due = utcnow() - timedelta(seconds=1)
    store.store([DelayedMessage(d, b"x", due, message_id=f"{d}-{i}") for d in ("orders", "refunds")
                 for i in range(3000)])
    batch_size = 50
    threads = drain_with_pumps(pg, transport, batch_size)
    wait_for(lambda: transport.orders_sent() >= 500, 60, "500 orders sent")
    store.set_paused(["orders"], True)
    before_pause = transport.orders_sent()
    transport.resume.set()
    for t in threads:  # they stop when nothing is left to claim: refunds drained, orders held
        t.join(timeout=120)
    held = store.count_scheduled().get("orders", 0)
    # Only the batches the two pumps had claimed before the pause went on (one each: this transport does not pipeline).
    assert transport.orders_sent() - before_pause <= 2 * batch_size
    assert held > 0 and held + transport.orders_sent() == 3000
    assert store.count_scheduled().get("refunds") is None
    assert store.backlog("orders")["totals"]["paused_due"] == held

    store.set_paused(["orders"], False)
    for t in drain_with_pumps(pg, transport, batch_size):
        t.join(timeout=120)
    assert store.count_scheduled() == {}
    delivered = Counter(m.message_id for q in ("orders", "refunds") for m in transport.receive(q, 10_000))
    assert len(delivered) == 6000 and set(delivered.values()) == {1}


def test_a_sweep_leaves_a_paused_destination_and_cancel_cannot_take_what_it_holds(spark_ready, pg):  # noqa: F811
    store = make_store(*pg)
    transport = make_transport(*pg, "orders", "refunds", "error")
    store.store(due_messages(2000, "orders") + due_messages(500, "refunds", prefix="r"))
    store.set_paused(["refunds"], True)
    # Throttled, so the partitions lease the rows and send them through their Pump rather than moving them by
    # statement (the next test); at 500/s (one bucket for both partitions) the last partition's 1,000 take two
    # seconds after it leased them: the moment every message is leased lasts long enough to be seen on a loaded
    # machine (at 2,000/s it lasted half a second, and was missed).
    store.set_policies({"orders": {"throttlePolicy": {"maxReceivesPerSecond": 500}}})

    def leased() -> bool:  # by both partitions: every stored message of orders is held
        totals = store.backlog("orders")["totals"]
        return 0 < totals["in_flight"] == totals["scheduled"]

    # Once the sweep has leased its window, a cancel of every message finds each either in flight
    # (held, perhaps being sent) or gone (already delivered): it removes none of them.
    result, _ = cancel_during_sweep(pg, store, 2000, 50, leased)
    assert result["counts"]["in_flight"] > 0, "the cancel never met the sweep's lease"
    assert result["cancelled"] == [] and result["counts"]["in_flight"] + result["counts"]["gone"] == 2000
    swept = Counter(m.message_id for m in drain(transport, "orders"))
    assert len(swept) == 2000 and set(swept.values()) == {1}
    assert store.count_scheduled() == {"refunds": 500} and drain(transport, "refunds") == []


def test_a_cancel_during_a_sweep_that_moves_by_statement_takes_each_message_or_leaves_it_once(
        spark_ready, pg):  # noqa: F811
    """Rows moved into same-database queues are leased and moved in one statement per batch, not leased ahead:
    a cancel meanwhile takes what is not moved yet, and no message is both cancelled and delivered."""
    store = make_store(*pg)
    transport = make_transport(*pg, "orders", "error")
    store.store(due_messages(10_000, "orders"))
    result, summary = cancel_during_sweep(pg, store, 10_000, 10, lambda: transport.depth("orders")["visible"])
    cancelled = set(result["cancelled"])
    moved = Counter(m.message_id for m in drain(transport, "orders"))
    assert cancelled, "the cancel came after the sweep had moved everything"
    assert moved, "the cancel came before the sweep moved anything"
    assert set(moved.values()) == {1} and not cancelled & set(moved)  # never both, never twice
    assert len(cancelled) + len(moved) == 10_000 and store.count_scheduled() == {}
    assert summary["claimed"] == summary["dispatched"] == len(moved) and summary["status"] == "done"


def cancel_during_sweep(pg, store, n: int, batch_size: int, started) -> tuple[dict, dict]:
    """spark-submit a sweep of everything due into the SQL-table queues, cancel messages m-0 .. m-{n-1} once
    `started()` is true (or the sweep ended), and wait for the sweep; returns the cancel's result and the
    sweep's summary."""
    url, schema, table = pg
    sql = {"kind": "sql", "url": url, "schema": schema, "table_prefix": f"{table}_"}
    proc = submit(*specs(*pg, sql), "--due-before", (utcnow() + timedelta(minutes=1)).isoformat(),
                  "--partitions", "2", "--batch-size", str(batch_size), wait=False)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not started():
            time.sleep(0.01)
        result = store.cancel(Selector.build(message_ids=[f"m-{i}" for i in range(n)]))
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    [summary] = [json.loads(line[len(sweep_app.SUMMARY_MARKER):]) for line in output.splitlines()
                 if line.startswith(sweep_app.SUMMARY_MARKER)]
    return result, summary
