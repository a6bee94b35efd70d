"""Benchmark: many deferred dispatchers in one triggerer process, as the triggerer runs them.

In one process and one event loop, N `DispatchTrigger.run()` generators (default N = 1, 10, 50), each dispatching
the destinations of a team of its own (`destination_prefix="team-<i>-"`) from one store table into SQL-table
queues in the same database. For each N:

1. connections while waiting: once every dispatcher sleeps, the backends of this process (the stores' URL carries
   an application_name of this run's own), and how many of them LISTEN;
2. lateness: single messages to random teams, one every --interval s, each due 1-2 s after it is stored; a
   message's lateness is its queue row's enqueued time minus its due time (both on the database's clock);
3. event-loop lag: a task sleeps 50 ms again and again; each sleep's overshoot, while step 2 runs; and the lag as
   Airflow's triggerer reports it: its watchdog sleeps 100 ms again and again and, when one took longer than
   `[triggerer] blocked_main_thread_warning_threshold` (0.2 s by default), logs that the async thread was blocked
   and counts `triggers.blocked_main_thread`; the same watchdog runs here and its count is reported.

A send names its destination in the wake-up it sends (see listener.sooner): only the dispatcher of that team
wakes and reads its next due time again; the others sleep on.

One PostgreSQL schema and Airflow home of its own, removed at the end (also on Ctrl-C or SIGTERM).

    .venv/bin/python bench/bench_dispatchers.py
    .venv/bin/python bench/bench_dispatchers.py --dispatchers 1,10,50,100 --messages 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# Airflow reads its configuration at import: a home of this run's own (the connection comes from the environment).
HOME = Path(tempfile.mkdtemp(prefix="adp-bench-airflow-"))
os.environ.update({"AIRFLOW_HOME": str(HOME), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                   "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{HOME / 'airflow.db'}",
                   "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING"})  # no line per dispatched stretch

from machine import describe, machine  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402
from sqlalchemy.pool import NullPool  # noqa: E402

from airflow_delay_provider.core.message import DelayedMessage  # noqa: E402
from airflow_delay_provider.core.pump import Pump  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore  # noqa: E402
from airflow_delay_provider.transports.sql import SqlTableTransport  # noqa: E402
from airflow_delay_provider.triggers.delay_store import DispatchTrigger  # noqa: E402

CONN_ID = "adp_bench_dispatchers"
LAG_TICK = 0.05


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Waits:
    """How many dispatchers sleep right now, on a wait after their first (the first only opens the listener)."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}
        self.inside: set[int] = set()

    def asleep(self) -> int:
        return sum(1 for i in self.inside if self.calls[i] > 1)


class CountedTrigger(DispatchTrigger):
    """DispatchTrigger whose store's waits are counted in `waits` (it behaves the same otherwise)."""

    waits = Waits()

    def open_pump(self) -> Pump:
        pump = super().open_pump()
        store, wait_async, waits = pump.store, pump.store.wait_async, self.waits

        async def counted(until):
            waits.calls[id(store)] = waits.calls.get(id(store), 0) + 1
            waits.inside.add(id(store))
            try:
                await wait_async(until)
            finally:
                waits.inside.discard(id(store))

        store.wait_async = counted
        return pump


def percentile(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1] if len(values) > 1 else values[0]


async def lag_probe(lags: list[float], stop: asyncio.Event, tick: float = LAG_TICK) -> None:
    while not stop.is_set():
        started = time.monotonic()
        await asyncio.sleep(tick)
        lags.append(time.monotonic() - started - tick)


def blocked(watchdog: list[float]) -> int:
    """How many times Airflow's triggerer watchdog (100 ms sleeps, TriggerRunner.block_watchdog) would have
    reported its async thread blocked, at the configured threshold."""
    from airflow.configuration import conf

    threshold = conf.getfloat("triggerer", "blocked_main_thread_warning_threshold")
    return sum(1 for lag in watchdog if lag + 0.1 > threshold)


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.schema = f"adp_bench_{uuid.uuid4().hex[:8]}"
        self.app = f"adp_bench_{uuid.uuid4().hex[:8]}"  # this process's stores' backends
        base = make_url(args.pg_url)
        self.url = base.update_query_dict({"application_name": self.app})
        self.admin = create_engine(args.pg_url, poolclass=NullPool)
        # The sender and the bench's own reads are not the dispatchers' connections.
        sender_url = base.update_query_dict({"application_name": f"{self.app}_sender"})
        self.sender = SqlDelayedMessageStore(sender_url, schema=self.schema)
        self.sending = ThreadPoolExecutor(1)  # not the loop's default executor, which the triggers' stretches fill
        self.rows: list[dict] = []

    def setup(self) -> None:
        with self.admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        self.sender.create_schema()
        queues = SqlTableTransport(self.sender.url, schema=self.schema)
        for i in range(max(self.args.dispatchers)):
            queues.provision(f"team-{i}-orders")
        os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps({
            "conn_type": "delay_store",
            "extra": {"url": self.url.render_as_string(hide_password=False), "db_schema": self.schema}})

    def teardown(self) -> None:
        self.sending.shutdown()
        with self.admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.admin.dispose()

    def backends(self) -> tuple[int, int]:
        """(backends of this process's dispatchers, those of them that LISTEN)."""
        with self.admin.connect() as conn:
            return tuple(conn.execute(text(
                "SELECT count(*), count(*) FILTER (WHERE query LIKE 'LISTEN %') FROM pg_stat_activity "
                "WHERE application_name = :app"), {"app": self.app}).one())

    def send(self, destination: str, message_id: str) -> int:
        due = self.sender.clock() + timedelta(seconds=random.uniform(1.0, 2.0))
        self.sender.store([DelayedMessage(destination, b"x" * 200, due, message_id=message_id)])
        return 1

    def lateness(self, prefix: str) -> list[float]:
        with self.admin.connect() as conn:
            return list(conn.execute(text(
                f'SELECT (enqueued_at_us - due_at_us) / 1e6::float8 FROM "{self.schema}".delay_queue_messages '
                "WHERE message_id LIKE :prefix"), {"prefix": f"{prefix}%"}).scalars())

    async def run(self, n: int) -> dict:
        loop = asyncio.get_running_loop()
        waits = CountedTrigger.waits = Waits()
        deadline = (self.sender.clock() + timedelta(minutes=30)).isoformat()
        triggers = [CountedTrigger(delay_store_conn_id=CONN_ID, db_schema=self.schema, deadline=deadline,
                                   destination_prefix=f"team-{i}-", poll_interval=self.args.poll_interval)
                    for i in range(n)]

        async def first(trigger):
            async for event in trigger.run():
                return event

        started = time.monotonic()
        tasks = [asyncio.create_task(first(t)) for t in triggers]
        while waits.asleep() < n:
            if time.monotonic() - started > 120:
                raise RuntimeError(f"only {waits.asleep()} of {n} dispatchers sleep after 120 s")
            await asyncio.sleep(0.05)
        log(f"{n} dispatcher(s) asleep after {time.monotonic() - started:.1f} s")
        held, listening = await asyncio.to_thread(self.backends)
        lags: list[float] = []
        watchdog: list[float] = []
        stop = asyncio.Event()
        probe = asyncio.gather(lag_probe(lags, stop), lag_probe(watchdog, stop, 0.1))
        prefix = f"n{n}-"
        for k in range(self.args.messages):
            await loop.run_in_executor(self.sending, self.send, f"team-{random.randrange(n)}-orders", f"{prefix}{k}")
            await asyncio.sleep(self.args.interval)
        late: list[float] = []
        waited = time.monotonic()
        while len(late) < self.args.messages and time.monotonic() - waited < 30:
            await asyncio.sleep(0.2)
            late = await asyncio.to_thread(self.lateness, prefix)
        stop.set()
        await probe
        for task in tasks:  # as the triggerer cancels a trigger: run()'s finally closes its store
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        after = await asyncio.to_thread(self.backends)
        row = {"dispatchers": n, "connections": held, "listening": listening, "lag_p50": percentile(lags, 50),
               "lag_p99": percentile(lags, 99), "lag_max": max(lags), "airflow_blocked": blocked(watchdog),
               "delivered": len(late),
               "sent": self.args.messages, "lateness_p50": percentile(late, 50) if late else None,
               "lateness_p99": percentile(late, 99) if late else None, "listening_after_close": after[1]}
        log(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        return row


def report(bench: Bench, info: dict) -> None:
    args = bench.args
    print(f"\n{describe(info)}")
    print(f"One process, one event loop: N DispatchTrigger.run() generators (SQL-table queues, poll interval "
          f"{args.poll_interval:g} s); {args.messages} single messages of 200 B per N to random teams, one every "
          f"{args.interval:g} s, each due 1-2 s after it was stored. Connections: backends with this process's "
          f"application_name while every dispatcher sleeps (the pool's, shared by all, and LISTEN); loop lag: "
          f"overshoot of {LAG_TICK * 1000:.0f} ms sleeps while the messages flow; blocked: the times Airflow's "
          "triggerer watchdog would have logged its async thread blocked (triggers.blocked_main_thread).\n")
    print("| dispatchers | connections while waiting (LISTEN) | loop lag p50 / p99 / max | blocked (Airflow) | "
          "lateness p50 / p99 | delivered |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in bench.rows:
        late = "-" if r["lateness_p50"] is None else \
            f"{r['lateness_p50'] * 1000:.0f} / {r['lateness_p99'] * 1000:.0f} ms"
        print(f"| {r['dispatchers']} | {r['connections']} ({r['listening']}) | {r['lag_p50'] * 1000:.1f} / "
              f"{r['lag_p99'] * 1000:.1f} / {r['lag_max'] * 1000:.0f} ms | {r['airflow_blocked']} | {late} | "
              f"{r['delivered']}/{r['sent']} |")


def interrupt(_signum, _frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so the finally blocks drop the schema."""
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg-url", default=os.environ.get("DELAY_BENCH_PG_URL",
                                                           "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--dispatchers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 10, 50],
                        help="dispatcher counts, one row each (default 1,10,50)")
    parser.add_argument("--messages", type=int, default=100, help="single messages per row")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between two messages")
    parser.add_argument("--poll-interval", type=float, default=30.0, help="the triggers' longest sleep")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, interrupt)
    bench = Bench(args)
    try:
        bench.setup()
        info = machine(args.pg_url)

        async def rows() -> None:
            for n in args.dispatchers:
                log(f"{n} dispatcher(s), {args.messages} messages")
                bench.rows.append(await bench.run(n))

        asyncio.run(rows())
    finally:
        bench.teardown()
        shutil.rmtree(HOME, ignore_errors=True)
    report(bench, info)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": info, "rows": bench.rows}, indent=2))


if __name__ == "__main__":
    main()
