"""Benchmark: what the move and the look of `_later` cost over the dead entries the move leaves, on PostgreSQL.

Every 5 s the process that moves messages due within a minute out of `_later` (stores/tiers.py) runs a move and a
look at `_later`'s due index. The rows it moved out of the current hour's partition stay in that index as dead
entries until a vacuum removes them. This stores --dead messages into one hour's partition and moves them all out
(leaving as many dead entries), with --live messages due after them, then times, each the median of --repeat:

- the look and an empty move as they run, from where the last look's reading says no movable row lies below
  (`LaterMessages.start_us`);
- the same from the index's beginning (the look as it runs once a minute, and as both ran before the bound),
  the reference;
- the same from the index's beginning after a VACUUM of the partition: the cost with no dead entry at all, what
  the hours' vacuums bought before.

One PostgreSQL schema of its own, dropped at the end. PostgreSQL as shipped.

    .venv/bin/python bench/bench_later_start.py                  # 1,000,000 dead entries
    .venv/bin/python bench/bench_later_start.py --dead 100000    # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_store import libpq, log  # noqa: E402
from machine import describe, machine  # noqa: E402

from airflow_delay_provider.core.message import DelayedMessage  # noqa: E402
from airflow_delay_provider.stores import tiers  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore  # noqa: E402

BODY = b"x" * 200
MINUTE_US = 60_000_000


def timed(call: Callable[[], object], repeat: int) -> float:
    """The median of `repeat` calls, in ms."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg-url", default=os.environ.get("DELAY_BENCH_PG_URL",
                                                           "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--dead", type=int, default=1_000_000, help="rows moved out before the timings")
    parser.add_argument("--live", type=int, default=100_000, help="rows left in `_later`, due after them")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    about = machine(args.pg_url)
    schema = f"adp_bench_{uuid.uuid4().hex[:8]}"
    store = SqlDelayedMessageStore(args.pg_url, table="delayed_messages", schema=schema)
    try:
        store.create_schema()
        store.later.start = lambda: None  # this benchmark runs the moves itself
        # Dead rows due 60-90 minutes ahead, live ones 130-140 minutes ahead; the move takes what is due within
        # 2 hours, and sends are taken to be due at least 100 minutes after the clock (the mark), so the bound
        # passes the dead entries as it passes the last half-minute's in a store running for real.
        now = store.clock()
        for part, (n, low_min, high_min) in (("dead", (args.dead, 60, 90)), ("live", (args.live, 130, 140))):
            step = (high_min - low_min) * 60 / n
            for i in range(0, n, 10_000):
                store.store([DelayedMessage("orders", BODY, now + timedelta(minutes=low_min, seconds=(i + j) * step),
                                            {}, f"{part}-{i + j}") for j in range(min(10_000, n - i))])
            log(f"stored {n:,} {part} rows")
        tiers.SOON_US, tiers.CLEAR_US = 120 * MINUTE_US, 100 * MINUTE_US
        started, moved = time.perf_counter(), 0
        while taken := store.later.move_batch(tiers.MOVE_BATCH):
            moved += taken
        log(f"moved {moved:,} rows out in {time.perf_counter() - started:.0f} s: {args.dead:,} dead entries")
        store.later.look()
        store.later.look()  # the second look has the first's mark: the start passes the dead entries
        later = store.later
        bound = later.start_us

        def from_beginning(call: Callable[[], object]) -> Callable[[], object]:
            def run() -> None:
                later.start_us, later._next_full = 0, 0.0  # a full look, and a move from 0
                call()
            return run

        def bounded(call: Callable[[], object]) -> Callable[[], object]:
            def run() -> None:
                later.start_us, later._next_full, later._full_again = bound, float("inf"), False
                call()
            return run

        def move() -> None:
            assert later.move_batch(tiers.MOVE_BATCH) == 0

        def look_and_move_rows() -> dict[str, float]:
            return {"look": timed(rows_look, args.repeat), "move": timed(rows_move, args.repeat)}

        results = {}
        rows_look, rows_move = bounded(later.look), bounded(move)
        results["from the bound (as it runs)"] = look_and_move_rows()
        rows_look, rows_move = from_beginning(later.look), from_beginning(move)
        results["from the index's beginning (the reference)"] = look_and_move_rows()
        with psycopg.connect(libpq(args.pg_url), autocommit=True) as conn:
            for leaf in store.tables.hours:
                conn.execute(f"VACUUM {store.qualified(leaf.name)}")
        log("vacuumed the hours' partitions")
        results["from the index's beginning, after a VACUUM (no dead entry)"] = look_and_move_rows()
    finally:
        with contextlib.suppress(Exception):
            store.close()
        with psycopg.connect(libpq(args.pg_url), autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        log(f"dropped schema {schema}")
    print(f"\n{describe(about)}")
    print(f"{args.dead:,} rows moved out of `_later` (dead entries in its due index), {args.live:,} left due after "
          f"them; each figure the median of {args.repeat}; PostgreSQL as shipped.\n")
    print("| the move and the look read `_later`'s due index | look (ms) | move, nothing to take (ms) |")
    print("|---|---:|---:|")
    for label, row in results.items():
        print(f"| {label} | {row['look']:,.1f} | {row['move']:,.1f} |")


if __name__ == "__main__":
    main()
