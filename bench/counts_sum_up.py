"""What one sum-up of the backlog counts costs after a bulk load: seconds, WAL and full page images.

The counts' triggers add a row per destination and ten-minute slot for each statement that writes messages, so a
`COPY` of 10,000,000 messages due over a week in chunks of 100,000 (as bench_scale.py fills) leaves about 1.8
million rows of changes, which the store's upkeep then sums up in one statement. This writes that many rows into a
store of its own schema (20 destinations, rows spread over a week of slots as that fill's are), runs a
`CHECKPOINT` (as the checkpoints right after a fill do, so every page the sum-up changes is written whole to the
WAL), and times `sum_up_counts` as the upkeep runs it. The schema is dropped at the end.

    .venv/bin/python bench/counts_sum_up.py --rows 1800000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_store import libpq  # noqa: E402
from machine import describe, machine  # noqa: E402

from airflow_delay_provider.stores.sql import SqlDelayedMessageStore  # noqa: E402

#: A week of ten-minute slots, as the scale benchmark's fill spreads due times (1 h to 7 days).
SLOTS = 1_002
DESTINATIONS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg-url", default=os.environ.get("DELAY_BENCH_PG_URL",
                                                           "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--rows", type=int, default=1_800_000, help="rows of changes to sum up")
    args = parser.parse_args()
    schema = f"adp_sum_up_{uuid.uuid4().hex[:8]}"
    store = SqlDelayedMessageStore(args.pg_url, schema=schema)
    with psycopg.connect(libpq(args.pg_url), autocommit=True) as conn:
        try:
            store.create_schema()
            counts = store.tables.counts.fullname
            conn.execute(f"INSERT INTO {counts} (destination, slot, n) SELECT 'later-' || (i %% %s), "
                         "3000000 + (i / %s) %% %s, 5 FROM generate_series(1, %s) AS i",
                         [DESTINATIONS, DESTINATIONS, SLOTS, args.rows])
            pages = conn.execute("SELECT pg_relation_size(%s::regclass) / 8192", [counts]).fetchone()[0]
            conn.execute("CHECKPOINT")
            wal, fpi = conn.execute("SELECT pg_current_wal_insert_lsn(), wal_fpi FROM pg_stat_wal").fetchone()
            started = time.perf_counter()
            with store.engine.begin() as sa:
                replaced = store.controls.counts.sum_up_counts(sa)
            took = time.perf_counter() - started
            wal_mib, fpi_after = conn.execute(
                "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s) / 1048576.0, wal_fpi FROM pg_stat_wal",
                [wal]).fetchone()
            left = conn.execute(f"SELECT count(*) FROM {counts}").fetchone()[0]
        finally:
            store.close()
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    print(describe(machine(args.pg_url)))
    print("\n| rows of changes | their pages | summed up into | seconds | WAL | full page images |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {replaced:,} | {pages:,} | {left:,} | {took:.1f} | {wal_mib:.0f} MiB | {fpi_after - fpi:,} |")


if __name__ == "__main__":
    main()
