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

--rig runs the same rows as users deploy them: the deployment rig (api-server, scheduler, dag-processor and
triggerer as separate processes with homes of their own, LocalExecutor, a PostgreSQL metadata database), one
continuous dispatcher DAG per team, each run triggered through the REST API and deferred to the one triggerer.
Connections are the triggerer's own (found by its processes' client ports), and the event loop's lag is what
Airflow's watchdog logs there. The rows add up: a row's dispatchers keep running into the next.

One PostgreSQL schema and Airflow home of its own, removed at the end (also on Ctrl-C or SIGTERM).

    .venv/bin/python bench/bench_dispatchers.py
    .venv/bin/python bench/bench_dispatchers.py --rig        # the rig table of docs/benchmarks/dispatchers.md
    .venv/bin/python bench/bench_dispatchers.py --dispatchers 1,10,50,100 --messages 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

import psutil

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


def log_row(row: dict) -> None:
    log(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k != "lateness"))


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

    async def messages(self, n: int) -> list[float]:
        """Send --messages single messages to random teams of the first n, one every --interval s; their lateness
        (seconds) once delivered, or after a minute, those delivered by then."""
        loop, prefix = asyncio.get_running_loop(), f"n{n}-"
        for k in range(self.args.messages):
            await loop.run_in_executor(self.sending, self.send, f"team-{random.randrange(n)}-orders", f"{prefix}{k}")
            await asyncio.sleep(self.args.interval)
        late: list[float] = []
        waited = time.monotonic()
        while len(late) < self.args.messages and time.monotonic() - waited < 60:
            await asyncio.sleep(0.2)
            late = await asyncio.to_thread(self.lateness, prefix)
        return late

    def lateness_fields(self, late: list[float]) -> dict:
        """A row's delivery figures: how many of the messages sent arrived, and how late (seconds)."""
        return {"delivered": len(late), "sent": self.args.messages,
                "lateness_p50": percentile(late, 50) if late else None,
                "lateness_p99": percentile(late, 99) if late else None, "lateness_max": max(late, default=None),
                "lateness": sorted(late)}

    async def run(self, n: int) -> dict:
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
        late = await self.messages(n)
        stop.set()
        await probe
        for task in tasks:  # as the triggerer cancels a trigger: run()'s finally closes its store
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        after = await asyncio.to_thread(self.backends)
        row = {"dispatchers": n, "connections": held, "listening": listening, "lag_p50": percentile(lags, 50),
               "lag_p99": percentile(lags, 99), "lag_max": max(lags), "airflow_blocked": blocked(watchdog),
               "listening_after_close": after[1], **self.lateness_fields(late)}
        log_row(row)
        return row


#: The rig's dispatchers: one DAG per team, each a continuous deferrable dispatcher of its team's destinations.
RIG_DAGS = '''
from airflow.sdk import DAG
from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator

for team in range({teams}):
    with DAG(dag_id=f"bench_team_{{team}}", schedule=None, catchup=False) as dag:
        DispatchDueMessagesOperator(task_id="dispatch", deferrable=True, max_runtime={seconds},
                                    delay_store_conn_id="{conn_id}", destination_prefix=f"team-{{team}}-",
                                    transport="sql", poll_interval={poll_interval})
    globals()[dag.dag_id] = dag
'''
#: What Airflow's triggerer logs when its watchdog finds the event loop blocked (TriggerRunner.block_watchdog).
BLOCKED_LOG = "Triggerer's async thread was blocked"


class RigBench(Bench):
    """The same rows on the deployment rig: a triggerer of its own (separate scheduler, dag-processor, api-server,
    LocalExecutor workers, a PostgreSQL metadata database), each dispatcher a DAG run triggered through the REST
    API. The rows add up: the dispatchers of one row keep running into the next."""

    def __init__(self, args) -> None:
        super().__init__(args)
        self.tmp = Path(tempfile.mkdtemp(prefix="adp-bench-dispatchers-rig-"))
        self.airflow = None
        self.started = 0  # dispatchers running so far

    def setup(self) -> None:
        from tests.deployment.rig import Deployment

        super().setup()
        dags = self.tmp / "dags"
        dags.mkdir()
        (dags / "bench_teams.py").write_text(RIG_DAGS.format(
            teams=max(self.args.dispatchers), seconds=3600, conn_id=CONN_ID, poll_interval=self.args.poll_interval))
        env = {}
        if self.args.blocked_threshold is not None:
            env["AIRFLOW__TRIGGERER__BLOCKED_MAIN_THREAD_WARNING_THRESHOLD"] = str(self.args.blocked_threshold)
        connection = json.loads(os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"])
        self.airflow = Deployment(self.tmp / "rig", dags, connections={CONN_ID: connection}, env=env)
        log("starting the deployment")
        self.airflow.start()
        self.airflow.wait_dags([f"bench_team_{i}" for i in range(max(self.args.dispatchers))], timeout=300)

    def teardown(self) -> None:
        if self.airflow is not None:
            self.airflow.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
        super().teardown()

    def triggerer_backends(self) -> tuple[int, int, int]:
        """(the triggerer's backends on the store's database with the store's application_name, those of them that
        LISTEN, and all its backends there): found by the client ports of the triggerer's processes."""
        ports = []
        for process in self.airflow._tree(self.airflow.pid("triggerer")):
            with contextlib.suppress(psutil.Error):
                ports += [c.laddr.port for c in process.net_connections("tcp") if c.raddr and c.raddr.port == 5432]
        with self.admin.connect() as conn:
            return tuple(conn.execute(text(
                "SELECT count(*) FILTER (WHERE application_name = :app), count(*) FILTER (WHERE "
                "application_name = :app AND query LIKE 'LISTEN %'), count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND client_port = ANY(:ports)"),
                {"app": self.app, "ports": ports}).one())

    def settled(self) -> bool:
        """No backend of the stores busy (each dispatcher in its wait, not reading or dispatching)."""
        with self.admin.connect() as conn:
            return not conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = :app AND state = 'active' "
                "AND query NOT LIKE 'LISTEN %'"), {"app": self.app}).scalar()

    async def run(self, n: int) -> dict:
        airflow, started = self.airflow, time.monotonic()
        runs = {}
        for i in range(self.started, n):  # as users start them: through the REST API
            airflow.unpause(f"bench_team_{i}")
            runs[i] = airflow.trigger(f"bench_team_{i}")
        for i, run_id in runs.items():
            airflow.wait_trigger_assigned(f"bench_team_{i}", run_id, "dispatch", timeout=300)
        self.started = n
        quiet = 0
        while quiet < 3:  # three reads in a row, a second apart
            if time.monotonic() - started > 600:
                raise RuntimeError(f"the {n} dispatchers did not settle in 600 s")
            quiet = quiet + 1 if await asyncio.to_thread(self.settled) else 0
            await asyncio.sleep(1)
        log(f"{n} dispatcher(s) deferred and waiting after {time.monotonic() - started:.1f} s")
        held, listening, everything = await asyncio.to_thread(self.triggerer_backends)
        log_from = airflow.log_size("triggerer")
        late = await self.messages(n)
        with open(airflow.log_path("triggerer"), errors="replace") as f:
            f.seek(log_from)
            reported = f.read().count(BLOCKED_LOG)
        row = {"dispatchers": n, "connections": held, "listening": listening, "triggerer_connections": everything,
               "airflow_blocked": reported, **self.lateness_fields(late)}
        log_row(row)
        return row


def lateness(row: dict) -> str:
    if row["lateness_p50"] is None:
        return "-"
    return f"{row['lateness_p50'] * 1000:.0f} / {row['lateness_p99'] * 1000:.0f} / {row['lateness_max'] * 1000:.0f} ms"


def report_rig(bench: RigBench, info: dict) -> None:
    args = bench.args
    print(f"\n{describe(info)}")
    print(f"The deployment rig (api-server, scheduler, dag-processor and triggerer as separate processes with homes of "
          f"their own, LocalExecutor, a PostgreSQL metadata database): N continuous dispatcher DAGs (deferrable, SQL-"
          f"table queues, poll interval {args.poll_interval:g} s), each run triggered through the REST API, all "
          f"deferred to the one triggerer; {args.messages} single messages of 200 B per N to random teams, one every "
          f"{args.interval:g} s, each due 1-2 s after it was stored. Connections: the triggerer's backends on the "
          "store's database (found by its processes' client ports) while every dispatcher waits, with the store's "
          "application_name (LISTEN among them) and in all (its Airflow metadata connections are to another "
          "database); blocked: the times the triggerer logged its async thread blocked (Airflow's own watchdog, "
          "`[triggerer] blocked_main_thread_warning_threshold`"
          f"{'' if args.blocked_threshold is None else f' set to {args.blocked_threshold:g} s'}).\n")
    print("| dispatchers | store connections while waiting (LISTEN) | all on the store's database | "
          "blocked (Airflow) | lateness p50 / p99 / max | delivered |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in bench.rows:
        print(f"| {r['dispatchers']} | {r['connections']} ({r['listening']}) | {r['triggerer_connections']} | "
              f"{r['airflow_blocked']} | {lateness(r)} | {r['delivered']}/{r['sent']} |")


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
          "lateness p50 / p99 / max | delivered |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in bench.rows:
        print(f"| {r['dispatchers']} | {r['connections']} ({r['listening']}) | {r['lag_p50'] * 1000:.1f} / "
              f"{r['lag_p99'] * 1000:.1f} / {r['lag_max'] * 1000:.0f} ms | {r['airflow_blocked']} | {lateness(r)} | "
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
    parser.add_argument("--rig", action="store_true",
                        help="on the deployment rig: each dispatcher a DAG run in a triggerer of its own")
    parser.add_argument("--blocked-threshold", type=float, default=None,
                        help="with --rig: the triggerer's blocked_main_thread_warning_threshold (default Airflow's)")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, interrupt)
    bench = RigBench(args) if args.rig else Bench(args)
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
    (report_rig if args.rig else report)(bench, info)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": info, "rows": bench.rows}, indent=2))


if __name__ == "__main__":
    main()
