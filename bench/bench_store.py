"""Benchmark: SQL store and dispatch pump vs the reference one-row-per-transaction loop, on PostgreSQL.

Prints one table from one run: our rate, the reference algorithm's rate, and the raw limit of the
database (COPY for inserts, a bare batched claim for dispatch), plus the pump's peak memory with
a small and a 1,000,000-row backlog. `make bench` runs it; `--plot` draws the rates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import describe, machine  # noqa: E402

from airflow_delay_provider.core.delays import utcnow  # noqa: E402
from airflow_delay_provider.core.message import DelayedMessage  # noqa: E402
from airflow_delay_provider.core.pump import Pump, PumpConfig  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore, to_us  # noqa: E402
from airflow_delay_provider.transports.sql import SqlTableTransport  # noqa: E402

BODY = b"x" * 200
HEADERS = {"content-type": "application/json"}
COLUMNS = "message_id, destination, body, headers, due_at_us, stored_at_us, failures"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


#: The relations of the table named `%(t)s` (a psycopg parameter): the table, and its partitions if it has any (the
#: store's messages table has `_soon` and `_later`; a partitioned table has no counters or size of its own).
TABLE_AND_PARTITIONS = ("(SELECT %(t)s::regclass UNION ALL "
                        "SELECT relid FROM pg_partition_tree(%(t)s::regclass) WHERE isleaf)")


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def finish(url: str, schema: str, children: Any, *closers: Callable[[], object]) -> None:
    """A bench's end: its child processes killed, its connections closed (each failure ignored: it is ending
    anyway), its schema dropped."""
    children.kill_all()
    for close in closers:
        with contextlib.suppress(Exception):
            close()
    drop_schema(url, schema)


def drop_schema(url: str, schema: str) -> None:
    """Drop a bench's schema, ending first any backend still working in it (the store's upkeep may be running a
    VACUUM of millions of rows in one of its own)."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                     "AND position(%s in query) > 0", [schema])
        conn.execute("SET lock_timeout = '60s'")
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def new_messages(n: int) -> list[DelayedMessage]:
    due = utcnow()
    return [DelayedMessage("orders", BODY, due, HEADERS, uuid.uuid4().hex) for _ in range(n)]


def raw_rows(n: int, start: int = 0) -> list[tuple]:
    now = to_us(utcnow())
    return [(f"raw-{start + i}", "orders", BODY, json.dumps(HEADERS), now, now, 0) for i in range(n)]


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def store_rate(store: SqlDelayedMessageStore, batch: list[DelayedMessage]) -> float:
    """Seconds our store takes for `batch`, in calls of 1000 messages."""
    return timed(lambda: [store.store(batch[i : i + 1000]) for i in range(0, len(batch), 1000)])


def raw_copy(conn: psycopg.Connection, table: str, rows: list[tuple]) -> None:
    """The database's own insert limit: binary COPY in transactions of 1000 rows."""
    for i in range(0, len(rows), 1000):
        with conn.cursor() as cur, cur.copy(f"COPY {table} ({COLUMNS}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(["text", "text", "bytea", "text", "int8", "int8", "int4"])
            for row in rows[i : i + 1000]:
                copy.write_row(row)
        conn.commit()


def raw_claim(conn: psycopg.Connection, table: str) -> int:
    """The database's own dispatch limit: a bare batched claim that deletes 1000 due rows per transaction."""
    total = 0
    while True:
        cur = conn.execute(
            f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} WHERE due_at_us <= %s "
            "ORDER BY due_at_us, id LIMIT 1000 FOR UPDATE SKIP LOCKED) RETURNING *",
            [to_us(utcnow())],
        )
        got = len(cur.fetchall())
        conn.commit()
        total += got
        if not got:
            return total


def reference_store(conn: psycopg.Connection, table: str, rows: list[tuple]) -> None:
    """The reference store: one INSERT per message, one transaction each."""
    for row in rows:
        conn.execute(f"INSERT INTO {table} ({COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s)", row)
        conn.commit()


def reference_dispatch(conn: psycopg.Connection, table: str, queue_table: str) -> int:
    """The reference poller: per message, fetch the oldest due row with a row lock (skip locked),
    send it (insert into the queue table), remove it, commit."""
    done = 0
    while True:
        row = conn.execute(
            f"SELECT id, message_id, destination, body, headers, due_at_us FROM {table} WHERE due_at_us <= %s "
            "ORDER BY due_at_us LIMIT 1 FOR UPDATE SKIP LOCKED",
            [to_us(utcnow())],
        ).fetchone()
        if row is None:
            conn.commit()
            return done
        now = to_us(utcnow())
        conn.execute(
            f"INSERT INTO {queue_table} (queue, message_id, body, headers, due_at_us, enqueued_at_us, visible_at_us, "
            "receive_count) VALUES (%s, %s, %s, %s, %s, %s, %s, 0)",
            (row[2], row[1], row[3], row[4], row[5], now, now),
        )
        conn.execute(f"DELETE FROM {table} WHERE id = %s", [row[0]])
        conn.commit()
        done += 1


def pyplot():
    """matplotlib's pyplot drawing to files, or None (saying how to install it) when it is missing."""
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib: .venv/bin/pip install matplotlib", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def peak_rss_mb() -> float:
    """This process's own high-water mark (ru_maxrss would include the parent's: it survives exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def pump_child(url: str, schema: str, table: str) -> None:
    """Run in its own process, so its peak RSS is the pump's alone."""
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    transport = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    started = time.perf_counter()
    result = Pump(store, transport, PumpConfig(batch_size=1000)).run(stop_when_idle=True)
    elapsed = time.perf_counter() - started
    print(json.dumps({
        "dispatched": result.stats.dispatched,
        "rate": result.stats.dispatched / elapsed,
        "peak_rss_mb": peak_rss_mb(),
    }))


def run_child(url: str, schema: str, table: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", url, schema, table], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("DELAY_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--messages", type=int, default=200_000, help="messages for the store and pump rates")
    parser.add_argument("--reference-messages", type=int, default=10_000, help="messages for the (slow) reference loop")
    parser.add_argument("--memory-rows", type=int, default=1_000_000, help="backlog for the bounded-memory check")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "store.json")
    parser.add_argument("--plot", type=Path, help="write a bar chart of the rates (needs matplotlib)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return pump_child(*args.child)

    schema = f"adp_bench_{uuid.uuid4().hex[:8]}"
    table, qt = f"{schema}.delayed_messages", f"{schema}.delayed_messages_queue_messages"
    store = SqlDelayedMessageStore(args.url, schema=schema)
    store.create_schema()
    transport = SqlTableTransport(args.url, schema=schema, table_prefix="delayed_messages_")
    transport.provision("orders")
    conn = psycopg.connect(libpq(args.url))
    results: dict = {"machine": machine(args.url)}

    def truncate() -> None:
        conn.execute(f"TRUNCATE {table}, {qt}")
        conn.commit()

    try:
        n, m = args.messages, args.reference_messages
        log(f"raw COPY of {n} rows")
        results["raw_insert"] = n / timed(lambda: raw_copy(conn, table, raw_rows(n)))
        log("raw batched claim")
        results["raw_claim"] = n / timed(lambda: raw_claim(conn, table))
        truncate()

        log(f"our store: {n} messages in batches of 1000")
        results["store"] = n / store_rate(store, new_messages(n))  # the messages are freed before the pump runs
        log(f"our pump: {n} due messages -> SQL queue table (same database, exactly once)")
        pump = run_child(args.url, schema, "delayed_messages")
        assert pump["dispatched"] == n, pump
        results["pump"] = pump["rate"]
        results["pump_rss_small_mb"] = pump["peak_rss_mb"]
        truncate()

        log(f"reference store: {m} messages, one per transaction")
        results["reference_store"] = m / timed(lambda: reference_store(conn, table, raw_rows(m)))
        log(f"reference dispatch: {m} messages, one per transaction")
        dispatched = []
        results["reference_pump"] = m / timed(lambda: dispatched.append(reference_dispatch(conn, table, qt)))
        assert dispatched == [m], dispatched
        truncate()

        log(f"bounded memory: loading a backlog of {args.memory_rows} rows")
        for start in range(0, args.memory_rows, 100_000):
            raw_copy(conn, table, raw_rows(min(100_000, args.memory_rows - start), start))
        log("bounded memory: pump over the whole backlog")
        big = run_child(args.url, schema, "delayed_messages")
        assert big["dispatched"] == args.memory_rows, big
        results["pump_rss_big_mb"] = big["peak_rss_mb"]
        results["pump_big"] = big["rate"]
    finally:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        conn.commit()
        conn.close()

    report(results, args)


def report(r: dict, args) -> None:
    rows = [
        ("store (msg/s)", r["store"], r["reference_store"], r["raw_insert"], "COPY, 1000 rows/txn"),
        ("dispatch store -> SQL queue (msg/s)", r["pump"], r["reference_pump"], r["raw_claim"],
         "bare claim, 1000 rows/txn"),
    ]
    print(f"\n{describe(r['machine'])}\n{args.messages:,} messages of {len(BODY)} B (reference loop: "
          f"{args.reference_messages:,}), one run\n")
    print("| measure | ours | reference (one row per transaction) | ours / reference | raw limit of the database |")
    print("|---|---:|---:|---:|---:|")
    for name, ours, ref, raw, how in rows:
        print(f"| {name} | {ours:,.0f} | {ref:,.0f} | {ours / ref:.1f}x | {raw:,.0f} ({how}) |")
    print(f"| pump peak RSS, {args.messages:,} due | {r['pump_rss_small_mb']:.0f} MB | | | |")
    print(f"| pump peak RSS, {args.memory_rows:,} due | {r['pump_rss_big_mb']:.0f} MB "
          f"({r['pump_big']:,.0f} msg/s) | | | |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(r, indent=2))
    if args.plot:
        plt = pyplot()
        if plt is None:
            return
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = ["store", "dispatch"]
        for i, (key, name) in enumerate([(0, "reference"), (1, "ours"), (2, "raw limit")]):
            values = [[row[2], row[1], row[3]][key] for row in rows]
            ax.bar([x + i * 0.27 for x in range(2)], values, width=0.27, label=name)
        ax.set_xticks([x + 0.27 for x in range(2)], labels)
        ax.set_ylabel("messages / s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
