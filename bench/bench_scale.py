"""Benchmark: dispatch with millions of messages due later already stored, on PostgreSQL as shipped.

One run, one PostgreSQL schema and one RabbitMQ vhost of its own (dropped at the end, also on Ctrl-C or
an error). For each backlog size (default 0, 1,000,000 and 10,000,000 messages due between one hour and
seven days later, written by COPY into the store as `store()` leaves it: messages, remembered ids and
destinations), a burst of 20,000 messages of 200 B due at one instant is stored and dispatched by a pump
that was already running, asleep, in a process of its own:

- `store()` rate of the burst (20 calls of 1,000, as a DAG task sends);
- the pump's rate (first claim to last commit) as a ratio to the empty store's in the same run;
- the first delivery after the due time (a consumer process records arrival times) and the last;
- the pump process's peak RSS;
- missing, duplicated and early deliveries (must all be 0);
- what the pump's sessions were doing while the burst ran (sampled every 20 ms: the wait event, or CPU, and
  the statement) and the most dirty and writeback memory the kernel held, in each burst's log line and the JSON.

Each figure is the median of --repeat bursts (default 5). A burst on a second store of the same database, kept
empty, runs just before or after each one (alternately), and a ratio "vs empty" is the median of the pairs'
ratios: this machine's speed drifts from minute to minute, and a pair measured seconds apart shares the drift
(at size 0 both stores are empty, so that row's ratios show what is left: the noise of single bursts). Each
burst's log line also counts the full page images the WAL took and the checkpoints that started while the pump
drained it. Each size is measured right after the fill (nobody
runs ANALYZE or VACUUM by hand: the pump's own upkeep starts as it would in a deployment) and again once the
store's upkeep has analysed the table ("settled"). At the largest size it also times the backlog calls the UI
makes (browse, backlog histogram, cancel) and drains a burst with 1, 2 and 4 pump processes, each with its
own connections as pumps on separate hosts would have.

    .venv/bin/python bench/bench_scale.py                              # 0, 1M, 10M (about 25-30 minutes)
    .venv/bin/python bench/bench_scale.py --sizes 0,200000 --pumps 1,2  # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import random
import signal
import statistics
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import pgserver  # noqa: E402
from bench_rabbitmq import rabbitmqctl  # noqa: E402
from bench_store import TABLE_AND_PARTITIONS, libpq, peak_rss_mb, pyplot  # noqa: E402
from bench_throughput import (  # noqa: E402
    BODY,
    QUEUE,
    TABLE_PREFIX,
    WARMUP,
    Children,
    consume_rabbitmq,
    consume_sql,
    interrupt,
    log,
    make_transport,
    percentile,
    rmq_params,
    save_figure,
    warm_up,
)
from machine import describe, machine  # noqa: E402

from airflow_delay_provider.core.backlog import Selector  # noqa: E402
from airflow_delay_provider.core.delays import utcnow  # noqa: E402
from airflow_delay_provider.core.message import DelayedMessage  # noqa: E402
from airflow_delay_provider.core.pump import Pump, PumpConfig  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore, to_us  # noqa: E402
from airflow_delay_provider.stores.tables import tier_of  # noqa: E402
from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport  # noqa: E402
from airflow_delay_provider.transports.sql import SqlTableTransport  # noqa: E402

BATCH = 1000
HEADERS = '{"content-type":"application/json"}'
#: The backlog's destinations (the burst goes to QUEUE): a store serves many.
FILL_DESTINATIONS = [f"later-{i:02d}" for i in range(20)]
HOUR_US = 3_600_000_000


# -- children -----------------------------------------------------------------------------------------
#: The application_name of the pump that drains each burst (what `watching_pump` samples).
BURST_PUMP = "adp-scale-burst-pump"


def with_app_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


def kernel_dirty_mb() -> tuple[float, float]:
    """The kernel's dirty and writeback memory (/proc/meminfo), MB; zeros where there is no /proc."""
    found = {"Dirty": 0.0, "Writeback": 0.0}
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, _, value = line.partition(":")
            if name in found:
                found[name] = int(value.split()[0]) / 1024
    return found["Dirty"], found["Writeback"]


def schedstat_ms(pid: int) -> dict[str, tuple[float, float]]:
    """Each thread's time on a CPU and waiting for one on the run queue (ms since it started;
    /proc/<pid>/task/*/schedstat), by thread id; empty once the process is gone or where there is no /proc."""
    threads = {}
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                on_cpu, on_queue, _ = stat.read().split()
                threads[task] = (int(on_cpu) / 1e6, int(on_queue) / 1e6)
    return threads


def waits_text(waits: dict[str, int]) -> str:
    """Samples by wait and statement, most first: `CPU in WITH claimed AS ... 41, IO:WALSync in COMMIT 3`."""
    return ", ".join(f"{k} {n}" for k, n in sorted(waits.items(), key=lambda kv: -kv[1])) or "no sample"


def child(spec: dict) -> None:
    # The store's upkeep says what it did (ANALYZE, VACUUM, summing up the backlog counts) and when: beside the
    # bursts' log lines, what ran at the same time.
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("airflow_delay_provider.stores").setLevel(logging.INFO)
    role = spec["role"]
    result = {"consume_rabbitmq": consume_rabbitmq, "consume_sql": consume_sql}.get(role, run_pump)(spec)
    print(json.dumps(result), flush=True)


def run_pump(spec: dict) -> dict:
    """A pump asleep until the burst falls due (woken by the store), or draining on the parent's "go";
    it records when each claim that took messages began and ended."""
    store = SqlDelayedMessageStore(spec["url"], schema=spec["schema"])
    transport = make_transport(spec)
    warm_up(store, transport)
    claims: list[tuple[float, float, int]] = []
    claim_due = store.claim_due

    @contextmanager
    def timed_claim(*args, **kwargs):
        started = time.time()
        with claim_due(*args, **kwargs) as claim:
            yield claim
        if claim.messages:
            claims.append((started, time.time(), len(claim.messages)))

    store.claim_due = timed_claim
    if hasattr(transport, "move_due"):  # into SQL queues of the same database the pump moves rows instead
        move_due = transport.move_due

        def timed_move(*args, **kwargs):
            started = time.time()
            moved = move_due(*args, **kwargs)
            if moved:
                claims.append((started, time.time(), sum(n for _, _, n in moved)))
            return moved

        transport.move_due = timed_move
    pump = Pump(store, transport, PumpConfig(batch_size=BATCH))
    print("ready", flush=True)
    if spec["mode"] == "drain":
        if sys.stdin.readline().strip() != "go":
            return {"dispatched": 0, "aborted": True}
        result = pump.run(stop_when_idle=True)
    else:
        result = pump.run(deadline=datetime.fromtimestamp(spec["deadline"], UTC), max_messages=spec["n"])
    transport.close()
    store.close()
    return {"dispatched": result.stats.dispatched, "first_claim": min((c[0] for c in claims), default=None),
            "last_commit": max((c[1] for c in claims), default=None), "peak_rss_mb": peak_rss_mb()}


class ScaleChildren(Children):
    def start(self, spec: dict, stdin: bool = False):
        return super().start(spec, stdin, script=__file__)


# -- the run ------------------------------------------------------------------------------------------
@dataclass
class Target:
    """A store and its SQL-table queue, in a schema of their own: the one filled, or the empty one each burst is
    paired with."""

    schema: str
    store: SqlDelayedMessageStore
    sql: SqlTableTransport

    @classmethod
    def create(cls, url: str, schema: str) -> Target:
        store = SqlDelayedMessageStore(url, schema=schema)
        store.create_schema()
        sql = SqlTableTransport(url, schema=schema, table_prefix=TABLE_PREFIX)
        sql.provision(QUEUE)
        return cls(schema, store, sql)

    def close(self) -> None:
        for close in (self.store.close, self.sql.close):
            with contextlib.suppress(Exception):
                close()


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.n = args.burst
        self.schema = f"adp_scale_{uuid.uuid4().hex[:8]}"
        self.vhost = f"adp_scale_{uuid.uuid4().hex[:8]}"
        self.children = ScaleChildren()
        self.stored = 0  # messages due later in the store now
        self.r: dict = {"burst": self.n, "body_bytes": len(BODY), "batch_size": BATCH, "sizes": {}}

    def spec(self, **fields) -> dict:
        return {"url": self.args.pg_url, "schema": self.schema, "host": self.args.host, "vhost": self.vhost,
                "queue": QUEUE, "batch_size": BATCH, "timeout": self.args.timeout, **fields}

    def setup(self) -> None:
        rabbitmqctl("add_vhost", self.vhost)
        rabbitmqctl("set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*")
        self.filled = Target.create(self.args.pg_url, self.schema)
        self.empty = Target.create(self.args.pg_url, f"{self.schema}_empty")
        self.store, self.sql = self.filled.store, self.filled.sql
        self.rmq = RabbitMQTransport(rmq_params(self.args.host, self.vhost))
        self.rmq.provision(QUEUE)
        self.rmq.provision(WARMUP)
        self.conn = psycopg.connect(libpq(self.args.pg_url), autocommit=True)
        self.store.register_destinations(FILL_DESTINATIONS)

    def teardown(self) -> None:
        self.children.kill_all()
        for close in (self.rmq.close, self.filled.close, self.empty.close, self.conn.close):
            with contextlib.suppress(Exception):
                close()
        try:
            with psycopg.connect(libpq(self.args.pg_url), autocommit=True) as conn:
                # The store's upkeep (a VACUUM of millions of rows) may still run in a backend of its own.
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                             "AND position(%s in query) > 0", [self.schema])
                conn.execute("SET lock_timeout = '60s'")
                conn.execute(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")
                conn.execute(f"DROP SCHEMA IF EXISTS {self.schema}_empty CASCADE")
        finally:
            rabbitmqctl("delete_vhost", self.vhost)
        log(f"dropped schemas {self.schema} and {self.schema}_empty and vhost {self.vhost}")

    # -- the backlog
    def fill(self, target: int) -> dict:
        """COPY messages due 1 h to 7 days later (random times) with their remembered ids, as store() leaves
        them, until `target` are stored; no ANALYZE or VACUUM afterwards."""
        add = target - self.stored
        if add <= 0:
            return {}
        now = to_us(utcnow())
        body = "\\\\x" + BODY.hex()
        rng = random.Random(target)
        started = time.perf_counter()
        chunk = 100_000
        messages, ids = self.store.table.fullname, self.store.tables.ids.fullname
        with psycopg.connect(libpq(self.args.pg_url)) as conn:
            for done in range(0, add, chunk):
                size = min(chunk, add - done)
                keys = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(size)]
                rows = io.StringIO()
                for key in keys:
                    due = now + HOUR_US + rng.randrange(167 * HOUR_US)
                    # Due an hour or more later: where store() puts them, the partition of their hour within a day
                    # or so, `_far` beyond it.
                    tier = tier_of(due, now, ring=True)
                    rows.write(f"{key}\t{rng.choice(FILL_DESTINATIONS)}\t{body}\t{HEADERS}\t{due}\t{now}\t0\t{tier}\n")
                with conn.cursor().copy(f"COPY {messages} (message_id, destination, body, headers, due_at_us, "
                                        "stored_at_us, failures, tier) FROM STDIN") as copy:
                    copy.write(rows.getvalue())
                with conn.cursor().copy(f"COPY {ids} (message_id, seen_at_us) FROM STDIN") as copy:
                    copy.write("".join(f"{key}\t{now}\n" for key in keys))
                conn.commit()
                if (done // chunk) % 10 == 9:
                    rate = (done + size) / (time.perf_counter() - started)
                    log(f"fill: {self.stored + done + size:,} of {target:,} stored, {rate:,.0f} rows/s, "
                        f"ETA {(add - done - size) / rate:.0f} s")
        self.stored = target
        seconds = time.perf_counter() - started
        log(f"fill: {add:,} messages in {seconds:.0f} s")
        return {"fill_seconds": seconds, "fill_rows_per_s": add / seconds, **self.sizes()}

    def sizes(self) -> dict:
        """Bytes of the messages table (heap + TOAST) and of its indexes, and of the ids table with its."""
        out = {}
        for key, table in (("messages", self.store.table), ("ids", self.store.tables.ids)):
            # The messages table is partitioned (`_soon`, `_later`): its partitions' sizes.
            heap, index = self.conn.execute(
                f"SELECT sum(pg_table_size(r)), sum(pg_indexes_size(r)) FROM {TABLE_AND_PARTITIONS} AS p(r)",
                {"t": table.fullname}).fetchone()
            out[f"{key}_table_mb"], out[f"{key}_index_mb"] = heap / 2**20, index / 2**20
        return out

    def settle(self) -> dict:
        """Wait until the messages table's statistics are fresh again, analysed by the store's own upkeep (what
        every running pump calls; this process calls it as a pump would) or by autovacuum where it is on."""
        started = time.perf_counter()
        # The fill went to the partitions of `_later`: each that holds rows analysed since, as the upkeep's
        # thresholds have it (a fifth of the rows changed for the hours still filling, 2% for the others).
        query = ("SELECT relname, n_live_tup, n_mod_since_analyze, coalesce(last_analyze, last_autoanalyze) IS NOT "
                 "NULL FROM pg_stat_user_tables WHERE relid IN (SELECT relid FROM pg_partition_tree(%s::regclass) "
                 "WHERE isleaf) AND n_live_tup > 0")
        thresholds = self.store.maintenance.thresholds

        def fresh() -> bool:
            growing = {t.name for t in self.store.later.growing()}
            return all(analysed and not thresholds.work(live, 0, modified, growing=name in growing)
                       for name, live, modified, analysed in self.conn.execute(
                           query, [self.store.tables.later.fullname]).fetchall())

        while time.perf_counter() - started < self.args.settle_timeout:
            self.store.upkeep()
            if fresh():
                break
            time.sleep(1)
        else:
            log("settle: the statistics were not fresh in time; measuring anyway")
        if self.store.maintenance.thread is not None:
            self.store.maintenance.thread.join()
        waited = time.perf_counter() - started
        log(f"settle: {waited:.0f} s until the store's upkeep had analysed the table")
        return {"settle_seconds": waited}

    def store_random_ids(self) -> tuple[float, float]:
        """store() rate of messages with random ids (uuid4, as a sender that names its own may use), due later."""
        due = utcnow() + timedelta(hours=2)
        messages = [DelayedMessage(FILL_DESTINATIONS[0], BODY, due, {}, str(uuid.uuid4())) for _ in range(self.n)]
        wal = self.wal()
        started = time.perf_counter()
        for i in range(0, self.n, BATCH):
            self.store.store(messages[i: i + BATCH])
        self.stored += self.n
        return self.n / (time.perf_counter() - started), self.wal(wal)

    def wal_counters(self) -> tuple[int, int]:
        """The full page images the WAL has taken and the checkpoints started, since the server's statistics
        were reset."""
        return self.conn.execute(
            "SELECT (SELECT wal_fpi FROM pg_stat_wal), "
            "(SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter)").fetchone()

    def wal(self, since=None):
        """The WAL position now, or the MiB written since `since`."""
        if since is None:
            return self.conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        return float(self.conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)",
                                       [since]).fetchone()[0]) / 2**20

    # -- one burst
    def burst(self, kind: str, target: Target) -> dict:
        """Store a burst due `lead` seconds later while a pump sleeps; measure store(), the pump, arrivals."""
        lead = self.args.lead
        deadline = time.time() + lead + self.args.timeout
        pump = self.children.start(self.spec(role="pump", transport=kind, mode="sleep", deadline=deadline, n=self.n,
                                             url=with_app_name(self.args.pg_url, BURST_PUMP), schema=target.schema))
        if kind == "rabbitmq":
            consumer = self.children.start(self.spec(role="consume_rabbitmq", n=self.n, linger=0.5,
                                                     want_arrivals=True))
        else:
            consumer = self.children.start(self.spec(role="consume_sql", n=self.n, linger=0.5, want_arrivals=True,
                                                     poll_ms=1.0, schema=target.schema), stdin=True)
        due_at = utcnow() + timedelta(seconds=lead)
        due = due_at.timestamp()
        if kind == "sql":
            consumer.stdin.write(f"{due!r}\n")
            consumer.stdin.flush()
        # Default ids, as a sender that names none gets.
        messages = [DelayedMessage(QUEUE, BODY, due_at, {"content-type": "application/json"}) for _ in range(self.n)]
        wal = self.wal()
        with self.watching_pump(pump.pid) as watched:
            started = time.perf_counter()
            for i in range(0, self.n, BATCH):
                target.store.store(messages[i: i + BATCH])
            store_rate = self.n / (time.perf_counter() - started)
            wal_mb = self.wal(wal)
            fpi, checkpoints = self.wal_counters()
            if time.time() > due - 0.5:
                log(f"warning: the burst was stored only {due - time.time():.2f} s before its due time; raise --lead")
            got = Children.result(consumer, self.args.timeout + lead + 30)
            pumped = Children.result(pump, 60)
            fpi_after, checkpoints_after = self.wal_counters()
        late = sorted((t - due) * 1000 for t in got["arrivals"].values())
        row = {"store_rate": store_rate, "store_wal_mb": wal_mb, "first_ms": late[0] if late else None,
               "p99_ms": percentile(late, 0.99) if late else None, "last_ms": late[-1] if late else None,
               "missing": self.n - got["distinct"], "duplicates": got["duplicates"],
               "early": sum(1 for x in late if x < 0), "pump_peak_rss_mb": pumped.get("peak_rss_mb"),
               "drain_fpi": fpi_after - fpi, "drain_checkpoints": checkpoints_after - checkpoints, **watched}
        if got.get("first_enqueued") is not None:  # the SQL queue says when the pump inserted (database clock)
            row["first_enqueued_ms"] = (got["first_enqueued"] - due) * 1000
        if pumped.get("first_claim"):
            row["pump_rate"] = pumped["dispatched"] / (pumped["last_commit"] - pumped["first_claim"])
            row["first_claim_ms"] = (pumped["first_claim"] - due) * 1000  # when the pump began the first claim
        self.clear_queue(kind, target)
        over = f"{self.stored:,}" if target is self.filled else "the empty store"
        if not late:  # nothing to rate: say what happened instead of a table built on it
            raise RuntimeError(
                f"burst -> {kind} over {over}: nothing delivered within {self.args.timeout + lead + 30:.0f} s of the "
                f"due time ({row['missing']:,} missing); the pump's sessions: {waits_text(row['pump_waits'])}")
        log(f"burst -> {kind} over {over}: store {store_rate:,.0f} msg/s, pump "
            f"{row.get('pump_rate', 0):,.0f} msg/s, first claim {row.get('first_claim_ms', math.nan):.1f} ms, first "
            f"{row['first_ms']:.1f} ms, last {row['last_ms']:.0f} ms "
            f"after due, rss {row['pump_peak_rss_mb']}, missing {row['missing']}, duplicates {row['duplicates']}, "
            f"early {row['early']}; the pump's sessions: {waits_text(row['pump_waits'])}; on a CPU / waiting for one: "
            f"pump {row['pump_cpu_ms']:,.0f} / {row['pump_runqueue_ms']:,.0f} ms, its sessions "
            f"{row['sessions_cpu_ms']:,.0f} / {row['sessions_runqueue_ms']:,.0f} ms; while it drained, "
            f"{row['drain_fpi']:,} full page images and {row['drain_checkpoints']} checkpoint(s) started; "
            f"kernel dirty / "
            f"writeback at most {row['dirty_mb']:,.0f} / {row['writeback_mb']:,.0f} MB")
        return row

    @contextmanager
    def watching_pump(self, pump_pid: int):
        """While a burst runs: every 20 ms, what the burst pump's active sessions wait on (PostgreSQL's wait event,
        or `CPU` for none) in which statement, and the most dirty and writeback memory the kernel held (what a
        bulk load leaves to be written, which a checkpoint's fsync then waits for). "CPU" is also a session the
        kernel has not run yet: the time the pump process and its sessions spent on a CPU and waiting for one
        (the run queue, /proc's schedstat) over the burst tells the two apart."""
        watched = {"pump_waits": {}, "dirty_mb": 0.0, "writeback_mb": 0.0}
        stop = threading.Event()
        # By (process, thread): a thread that ends during the burst keeps its last reading.
        first: dict[tuple[int, str], tuple[float, float]] = {}
        last: dict[tuple[int, str], tuple[float, float]] = {}

        def note(pid: int) -> None:
            for task, now in schedstat_ms(pid).items():
                first.setdefault((pid, task), now)
                last[(pid, task)] = now

        def sample() -> None:
            waits = watched["pump_waits"]
            with psycopg.connect(libpq(self.args.pg_url), autocommit=True) as conn:
                while not stop.wait(0.02):
                    note(pump_pid)
                    # Every session of the pump, idle ones too: their counters start before the burst.
                    for pid, state, kind, event, query in conn.execute(
                            "SELECT pid, state, wait_event_type, wait_event, "
                            "left(regexp_replace(query, '\\s+', ' ', 'g'), 40) "
                            "FROM pg_stat_activity WHERE application_name = %s", [BURST_PUMP]).fetchall():
                        note(pid)
                        if state == "active":
                            key = f"{f'{kind}:{event}' if event else 'CPU'} in {query}"
                            waits[key] = waits.get(key, 0) + 1
                    dirty, writeback = kernel_dirty_mb()
                    watched["dirty_mb"] = max(watched["dirty_mb"], dirty)
                    watched["writeback_mb"] = max(watched["writeback_mb"], writeback)

        thread = threading.Thread(target=sample, name="watch-pump", daemon=True)
        thread.start()
        try:
            yield watched
        finally:
            stop.set()
            thread.join()
            for key, mine in (("pump", lambda pid: pid == pump_pid), ("sessions", lambda pid: pid != pump_pid)):
                tasks = [t for t in last if mine(t[0])]
                watched[f"{key}_cpu_ms"] = sum(last[t][0] - first[t][0] for t in tasks)
                watched[f"{key}_runqueue_ms"] = sum(last[t][1] - first[t][1] for t in tasks)

    def bursts(self, kind: str) -> dict:
        """--repeat bursts into the filled store, each paired with one into the empty store (before it, then
        after the next, and so on): the median of each figure (sums of missing, duplicated and early), the
        median of the pairs' ratios, and each run."""
        runs, empty_runs = [], []
        for i in range(self.args.repeat):
            for target in (self.empty, self.filled) if i % 2 == 0 else (self.filled, self.empty):
                (empty_runs if target is self.empty else runs).append(self.burst(kind, target))
        row = {key: statistics.median(r[key] for r in runs)
               for key in ("store_rate", "store_wal_mb", "first_ms", "p99_ms", "last_ms")}
        for key in ("pump_rate", "first_enqueued_ms"):
            if all(key in r for r in runs):
                row[key] = statistics.median(r[key] for r in runs)
        row |= {key: sum(r[key] for r in runs) for key in ("missing", "duplicates", "early")}
        row["pump_peak_rss_mb"] = max(r["pump_peak_rss_mb"] for r in runs)
        for key, rate in (("ratio", "pump_rate"), ("store_ratio", "store_rate")):
            pairs = [r[rate] / e[rate] for r, e in zip(runs, empty_runs, strict=True) if r.get(rate) and e.get(rate)]
            if pairs:
                row[key], row[f"{key}s"] = statistics.median(pairs), pairs
        row["runs"], row["empty_runs"] = runs, empty_runs
        row["empty_pump_rate"] = statistics.median(e.get("pump_rate", 0) for e in empty_runs)
        row["empty_first_ms"] = statistics.median(e["first_ms"] for e in empty_runs)
        row["missing"] += sum(e["missing"] for e in empty_runs)
        row["duplicates"] += sum(e["duplicates"] for e in empty_runs)
        row["early"] += sum(e["early"] for e in empty_runs)
        return row

    def clear_queue(self, kind: str, target: Target | None = None) -> None:
        if kind == "sql":
            self.conn.execute(f"TRUNCATE {(target or self.filled).sql.messages.fullname}")

    # -- the UI's calls
    def ui_calls(self) -> dict:
        out = {}
        victims = [r[0] for r in self.conn.execute(
            f"SELECT message_id FROM {self.store.table.fullname} TABLESAMPLE SYSTEM (0.01) LIMIT 10")]
        calls = {
            "browse (first page, all)": lambda: self.store.browse(Selector.build(allow_everything=True), limit=50),
            "browse (one destination)": lambda: self.store.browse(Selector.build(destination=FILL_DESTINATIONS[3]),
                                                                  limit=50),
            "browse (due in a window)": lambda: self.store.browse(Selector.build(
                due_from=utcnow() + timedelta(days=3), due_before=utcnow() + timedelta(days=3, hours=1),
                allow_everything=True), limit=50),
            "backlog histogram (all)": lambda: self.store.backlog(),
            "backlog histogram (one destination)": lambda: self.store.backlog(FILL_DESTINATIONS[5]),
        }
        if victims:
            calls["cancel 10 messages by id"] = lambda: self.store.cancel(Selector.build(message_ids=victims))
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            out[name] = (time.perf_counter() - started) * 1000
            log(f"ui: {name}: {out[name]:.0f} ms")
        self.stored -= len(victims)
        return out

    # -- several pumps
    def many_pumps(self, kind: str) -> dict:
        rows = {}
        for count in self.args.pumps:
            messages = [DelayedMessage(QUEUE, BODY, utcnow() - timedelta(seconds=1), {}) for _ in range(self.n)]
            for i in range(0, self.n, BATCH):
                self.store.store(messages[i: i + BATCH])
            consumer = None
            if kind == "rabbitmq":
                consumer = self.children.start(self.spec(role="consume_rabbitmq", n=self.n, linger=1.0,
                                                         want_arrivals=False))
            named = with_app_name(self.args.pg_url, "adp-scale-pump")
            pumps = [self.children.start(self.spec(role="pump", transport=kind, mode="drain", url=named), stdin=True)
                     for _ in range(count)]
            for p in pumps:
                p.stdin.write("go\n")
                p.stdin.flush()
            connections = self.connections_while(pumps)
            results = [Children.result(p, self.args.timeout + 30) for p in pumps]
            took = [x for x in results if x["first_claim"]]
            elapsed = max(x["last_commit"] for x in took) - min(x["first_claim"] for x in took)
            if consumer is not None:
                got = Children.result(consumer, self.args.timeout + 30)
                delivered, distinct = got["received"], got["distinct"]
            else:
                delivered, distinct = self.conn.execute(
                    f"SELECT count(*), count(DISTINCT message_id) FROM {self.sql.messages.fullname}").fetchone()
            self.clear_queue(kind)
            rows[count] = {"rate": sum(x["dispatched"] for x in results) / elapsed, "duplicates": delivered - distinct,
                           "missing": self.n - distinct, "connections": connections}
            log(f"{count} pump(s) -> {kind} over {self.stored:,}: {rows[count]['rate']:,.0f} msg/s, "
                f"{rows[count]['duplicates']} duplicates, {rows[count]['missing']} missing")
        return rows

    def connections_while(self, procs) -> int:
        """The most PostgreSQL connections the pump processes held at once while they ran (they name themselves
        through application_name), sampled every 20 ms."""
        most = 0
        while any(p.poll() is None for p in procs):
            most = max(most, self.conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                                               "'adp-scale-pump'").fetchone()[0])
            time.sleep(0.02)
        return most

    # -- the whole run
    def run(self) -> None:
        for size in self.args.sizes:
            entry = self.r["sizes"].setdefault(size, {})
            entry |= self.fill(size)
            entry["sizes"] = self.sizes()
            for phase in ("fresh", "settled") if size else ("fresh",):
                if phase == "settled":
                    entry |= self.settle()
                for kind in self.args.transports:
                    entry[f"{phase}_{kind}"] = self.bursts(kind)
                rate, wal_mb = self.store_random_ids()
                entry[f"{phase}_random_ids_store_rate"], entry[f"{phase}_random_ids_wal_mb"] = rate, wal_mb
                log(f"store() with random ids over {self.stored:,}: {rate:,.0f}/s, {wal_mb:.0f} MiB of WAL")
        biggest = self.r["sizes"][max(self.args.sizes)]
        biggest["ui_ms"] = self.ui_calls()
        biggest["pumps"] = {kind: self.many_pumps(kind) for kind in self.args.transports}


def report(r: dict) -> None:
    print(f"\n{describe(r['machine'])}")
    print(f"Burst of {r['burst']:,} messages of {r['body_bytes']} B due at one instant, with N messages due 1 h to "
          "7 days later already in the store (written by COPY); PostgreSQL with its default settings. Each burst "
          "is paired with one into a second store of the same database, kept empty, just before or after it; a "
          "ratio \"vs empty\" is the median of the pairs' ratios (each pair's in brackets). At size 0 both stores "
          "are empty: those ratios are the noise of single bursts.\n")
    print("| stored later | when | destination | store() msg/s | vs empty | pump msg/s | vs empty | first after due "
          "(consumer; pump's insert) | the empty store's first, same minutes | "
          "last after due | pump peak RSS | missing / dup / early |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for size, entry in r["sizes"].items():
        for key, row in entry.items():
            if not key.startswith(("fresh_", "settled_")) or not isinstance(row, dict):
                continue
            phase, kind = key.split("_", 1)
            when = "empty" if not size else ("right after the fill" if phase == "fresh" else "settled")
            inserted = f"; {row['first_enqueued_ms']:.1f} ms" if "first_enqueued_ms" in row else ""
            print(f"| {int(size):,} | {when} | {kind} | {row['store_rate']:,.0f} | {_ratio(row, 'store_ratio')} | "
                  f"{row.get('pump_rate', 0):,.0f} | {_ratio(row, 'ratio')} | {row['first_ms']:.1f} ms{inserted} | "
                  f"{row.get('empty_first_ms', math.nan):.1f} ms | "
                  f"{row['last_ms']:.0f} ms | {row['pump_peak_rss_mb']:.0f} MB | "
                  f"{row['missing']} / {row['duplicates']} / {row['early']} |")
    print(f"\n| stored later | when | store() msg/s, random ids (uuid4) | vs empty | WAL per {r['burst']:,} | "
          "WAL per burst of default (time-ordered) ids |")
    print("|---:|---|---:|---:|---:|---:|")
    empty = r["sizes"][min(r["sizes"], key=int)]["fresh_random_ids_store_rate"]
    for size, entry in r["sizes"].items():
        for phase in ("fresh", "settled"):
            if f"{phase}_random_ids_store_rate" in entry:
                rate = entry[f"{phase}_random_ids_store_rate"]
                ordered = entry.get(f"{phase}_sql", {}).get("store_wal_mb", 0)
                print(f"| {int(size):,} | {phase} | {rate:,.0f} | {rate / empty:.2f}x | "
                      f"{entry.get(f'{phase}_random_ids_wal_mb', 0):.0f} MiB | {ordered:.0f} MiB |")
    print("\n| stored later | fill time | rows/s | messages table + TOAST | its indexes | ids table | its indexes |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size, entry in r["sizes"].items():
        if not int(size):
            continue
        s = entry["sizes"]
        print(f"| {int(size):,} | {entry['fill_seconds']:.0f} s | {entry['fill_rows_per_s']:,.0f} | "
              f"{s['messages_table_mb']:,.0f} MB | {s['messages_index_mb']:,.0f} MB | {s['ids_table_mb']:,.0f} MB | "
              f"{s['ids_index_mb']:,.0f} MB |")
    size, biggest = max(r["sizes"].items(), key=lambda kv: int(kv[0]))
    print(f"\n| UI call with {int(size):,} stored | ms (target < 1000) |")
    print("|---|---:|")
    for name, ms in biggest["ui_ms"].items():
        print(f"| {name} | {ms:.0f} |")
    print(f"\n| pump processes, {r['burst']:,} due, {int(size):,} stored later | destination | msg/s | vs 1 pump | "
          "duplicates | missing | PostgreSQL connections of all pumps (most at once) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for kind, rows in biggest["pumps"].items():
        one = rows[min(rows)]["rate"]
        for count, row in rows.items():
            print(f"| {count} | {kind} | {row['rate']:,.0f} | {row['rate'] / one:.2f}x | {row['duplicates']} | "
                  f"{row['missing']} | {row.get('connections', '')} |")


def _ratio(row: dict, key: str) -> str:
    if key not in row:
        return ""
    return f"{row[key]:.2f}x ({' / '.join(f'{x:.2f}' for x in row.get(f'{key}s', []))})"


def plot(r: dict, path: Path) -> None:
    """Left: the pump's rate against the empty store's in the same minutes (median of the pairs, and their range);
    right: the first delivery after the due time, the filled store's and the empty one's."""
    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for kind, marker in (("sql", "o"), ("rabbitmq", "s")):
        for phase, style in (("fresh", "-"), ("settled", "--")):
            points = [(int(size), e.get(f"{phase}_{kind}") or e.get(f"fresh_{kind}"))
                      for size, e in r["sizes"].items()]
            points = [(s, row) for s, row in points if row and "ratio" in row]
            xs = [max(s, 1) for s, _ in points]
            ratios = [row["ratio"] for _, row in points]
            spread = [[y - min(row["ratios"]) for y, (_, row) in zip(ratios, points, strict=True)],
                      [max(row["ratios"]) - y for y, (_, row) in zip(ratios, points, strict=True)]]
            axes[0].errorbar(xs, ratios, yerr=spread, fmt=f"{marker}{style}", capsize=3, label=f"{kind}, {phase}")
            line, = axes[1].plot(xs, [row["first_ms"] for _, row in points], style, marker=marker,
                                 label=f"{kind}, {phase}")
            axes[1].plot(xs, [row.get("empty_first_ms", math.nan) for _, row in points], ":", marker=marker,
                         color=line.get_color(), alpha=0.5, label=f"{kind}, {phase}: the empty store")
    axes[0].axhline(0.9, color="grey", linewidth=0.8)
    axes[1].axhline(15, color="grey", linewidth=0.8)
    for ax, title in ((axes[0], "pump rate vs the empty store, same minutes"),
                      (axes[1], "first delivery after due (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("messages due later in the store")
        ax.set_title(title)
        ax.legend(fontsize=6)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="RabbitMQ host (rabbitmqctl must reach the same broker)")
    pgserver.add_arguments(parser)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1_000_000, 10_000_000])
    parser.add_argument("--burst", type=int, default=20_000)
    parser.add_argument("--transports", type=lambda s: s.split(","), default=["sql", "rabbitmq"])
    parser.add_argument("--pumps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=5,
                        help="bursts per size, phase and destination (medians), each paired with one on the empty "
                        "store")
    parser.add_argument("--lead", type=float, default=3.0, help="seconds between storing a burst and its due time")
    parser.add_argument("--settle-timeout", type=float, default=900.0,
                        help="seconds to wait for autovacuum before the settled measure")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.sizes[0] != 0:
        args.sizes.insert(0, 0)  # the ratios need the empty store
    signal.signal(signal.SIGTERM, interrupt)
    with pgserver.server(args):
        bench = Bench(args)
        try:
            bench.setup()
            bench.r["machine"] = machine(args.pg_url, rabbitmq=True)
            bench.run()
        finally:
            bench.teardown()
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(bench.r, indent=2, default=str))  # what there is, also after an error
            log(f"wrote {args.json}")
        report(bench.r)
        if args.plot:
            plot(bench.r, args.plot)


if __name__ == "__main__":
    main()
