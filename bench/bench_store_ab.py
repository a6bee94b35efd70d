"""A/B benchmark of storing: an earlier commit's store() beside the working tree's, in turns, in one run.

Each round runs one child process per side (the earlier commit from a git worktree of it, the working tree from
here) on a store of its own in a schema of this run's, and measures:

- `new`: sends of new ids, 1,000 a call, due in two hours (an hour's partition), the default window (a day);
- `new, window 0`: the same with de-duplication off;
- `re-sent`: sends of ids already stored (the path that falls back from COPY);
- `expiry`: one expiry of the ids table (a window of 1 s) over the ids of the messages sent, with a tenth of
  them still stored past their due time (a paused destination's).

The table gives each side's median over the rounds and the ratio working tree / earlier commit: a ratio survives a
noisy machine, an absolute rate does not. The PostgreSQL settings the run read are printed with it.

`--expiry-ids N` also times the expiry at a user's scale, in this checkout, on the same rows: N expired ids and
stored messages past their due time (10,000, then 300,000: a paused destination's backlog), the plain DELETE of
ids past the window (what the expiry was before schema version 10) beside the expiry that keeps the ids of those
messages, each in a transaction rolled back.

    python bench/bench_store_ab.py --base HEAD~1 --rounds 3 --expiry-ids 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = os.environ.get("DELAY_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
FIGURES = ("new", "new, window 0", "re-sent", "expiry")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def child(url: str, schema: str, messages: int) -> dict:
    """One side's figures, with the package importable from the checkout it runs in."""
    from datetime import timedelta

    from airflow_delay_provider.core.delays import utcnow
    from airflow_delay_provider.core.message import DelayedMessage
    from airflow_delay_provider.core.pump import Pump
    from airflow_delay_provider.stores.sql import SqlDelayedMessageStore, to_us
    from airflow_delay_provider.testing import InMemoryTransport

    def transport() -> InMemoryTransport:
        memory = InMemoryTransport()
        memory.provision("orders")
        return memory

    def store_of(window: float) -> SqlDelayedMessageStore:
        store = SqlDelayedMessageStore(url, table=f"ab_{uuid.uuid4().hex[:10]}", schema=schema,
                                       dedup_window_seconds=window)
        store.create_schema()
        return store

    def batches(ids: list[str], destination: str = "orders", seconds: float = 7_200) -> list[list[DelayedMessage]]:
        due = utcnow() + timedelta(seconds=seconds)
        return [[DelayedMessage(destination, b"x" * 200, due, message_id=i) for i in ids[k:k + 1000]]
                for k in range(0, len(ids), 1000)]

    def rate(store: SqlDelayedMessageStore, sends: list[list[DelayedMessage]], expect: int) -> float:
        started = time.perf_counter()
        stored = sum(store.store(batch) for batch in sends)
        took = time.perf_counter() - started
        assert stored == expect, (stored, expect)
        return sum(len(b) for b in sends) / took

    figures = {}
    ids = [uuid.uuid4().hex for _ in range(messages)]
    store = store_of(86_400)
    figures["new"] = rate(store, batches(ids), messages)
    figures["re-sent"] = rate(store, batches(ids[:messages // 10]), 0)
    figures["new, window 0"] = rate(store_of(0), batches([uuid.uuid4().hex for _ in range(messages)]), messages)
    # Ids accepted a while ago with a window of 1 s: all expired; a tenth still stored after their due time.
    short = store_of(1)
    paused = [uuid.uuid4().hex for _ in range(messages // 10)]
    rate(short, batches(paused, "paused", -60), len(paused))
    short.set_paused(["paused"], True)
    rate(short, batches([uuid.uuid4().hex for _ in range(messages)], seconds=-60), messages)
    Pump(short, transport()).run(stop_when_idle=True)  # delivered: their ids only wait for the expiry
    short.accepted._expired_at = -float("inf")
    started = time.perf_counter()
    with short.engine.begin() as conn:  # 2 s on: past the window of every id
        short.accepted.expire(conn, to_us(short.clock()) + 2_000_000)
    figures["expiry"] = 1 / (time.perf_counter() - started)  # expiries per second: higher is better, as the rest
    return figures


def expiry_at_scale(url: str, schema: str, ids_n: int, overdue: tuple[int, ...] = (10_000, 300_000)) -> list[str]:
    """The expiry's cost with `ids_n` expired ids and `overdue` messages stored past their due time (table rows)."""
    from sqlalchemy import text

    from airflow_delay_provider.stores.sql import SqlDelayedMessageStore, to_us

    rows = []
    for overdue_n in overdue:
        store = SqlDelayedMessageStore(url, table=f"ex_{uuid.uuid4().hex[:10]}", schema=schema, dedup_window_seconds=1)
        store.create_schema()
        now = to_us(store.clock())
        ids, messages = store.qualified(store.tables.ids.name), store.qualified(store.table_name)
        log(f"expiry: {ids_n:,} ids, {overdue_n:,} messages past their due time")
        with store.engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {ids} SELECT 'x' || g, :old FROM generate_series(1, :n) g"),
                         {"old": now - 10_000_000, "n": ids_n})
            conn.execute(text(f"INSERT INTO {messages} (message_id, destination, body, headers, due_at_us, "
                              "stored_at_us, tier) SELECT 'x' || g, 'paused', '\\x00', '{}', :due - g, :old, 0 "
                              "FROM generate_series(1, :n) g"), {"due": now - 5_000_000, "old": now - 10_000_000,
                                                                 "n": overdue_n})
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in (ids, messages):
                conn.exec_driver_sql(f"VACUUM ANALYZE {table}")
        took = {}
        for name in ("plain DELETE", "keeping overdue"):
            with store.engine.connect() as conn, conn.begin() as tx:
                started = time.perf_counter()
                if name == "plain DELETE":
                    conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
                    conn.execute(text(f"DELETE FROM {ids} WHERE seen_at_us < :cutoff"), {"cutoff": now - 1_000_000})
                else:
                    store.accepted._expired_at = -float("inf")
                    store.accepted.expire(conn, now)
                took[name] = time.perf_counter() - started
                tx.rollback()
        rows.append(f"| {ids_n:,} | {overdue_n:,} | {took['plain DELETE'] * 1000:,.0f} | "
                    f"{took['keeping overdue'] * 1000:,.0f} | {took['keeping overdue'] / took['plain DELETE']:.2f}x |")
    return rows


def settings(url: str) -> dict[str, str]:
    import psycopg

    names = ("server_version", "autovacuum", "shared_buffers", "synchronous_commit", "fsync", "work_mem")
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        return {n: conn.execute("SELECT setting FROM pg_settings WHERE name = %s", (n,)).fetchone()[0]
                for n in names}


def run_side(checkout: Path, url: str, schema: str, messages: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", url, schema, str(messages)],
                         cwd=checkout, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--base", default="HEAD~1", help="the earlier commit (default: HEAD~1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--expiry-ids", type=int, default=0, help="also time the expiry at this many ids")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        url, schema, n = args.child
        print(json.dumps(child(url, schema, int(n))))
        return
    import psycopg

    libpq = args.url.replace("postgresql+psycopg://", "postgresql://")
    schema = f"bench_ab_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    base = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                   capture_output=True)
    results: dict[str, dict[str, list[float]]] = {"base": {}, "tree": {}}
    scale: list[str] = []
    try:
        for r in range(args.rounds):
            for side, checkout in (("base", base), ("tree", ROOT)):
                log(f"round {r + 1} of {args.rounds}: {side}")
                for name, value in run_side(checkout, args.url, schema, args.messages).items():
                    results[side].setdefault(name, []).append(value)
        if args.expiry_ids:
            sys.path.insert(0, str(ROOT))
            scale = expiry_at_scale(args.url, schema, args.expiry_ids)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base], capture_output=True,
                            text=True).stdout.strip()
    print(f"PostgreSQL: {', '.join(f'{k}={v}' for k, v in settings(args.url).items())}")
    print(f"{args.messages:,} messages a side, {args.rounds} rounds, medians; per second (expiry: expiries per s)")
    print(f"| figure | {commit} | working tree | ratio |\n|---|---:|---:|---:|")
    for name in FIGURES:
        a, b = statistics.median(results["base"][name]), statistics.median(results["tree"][name])
        print(f"| {name} | {a:,.1f} | {b:,.1f} | {b / a:.2f}x |")
    if scale:
        print("\nThe expiry at scale, this checkout, the same rows (ms)")
        print("| expired ids | stored past their due time | plain DELETE | keeping those ids | ratio |")
        print("|---:|---:|---:|---:|---:|")
        print("\n".join(scale))


if __name__ == "__main__":
    main()
