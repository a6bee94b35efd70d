"""Soak benchmark: hours of continuous churn on one PostgreSQL store, minute by minute.

One run, one PostgreSQL schema of its own (dropped at the end, also on Ctrl-C or an error). It measures the
maximum rate the three parts below carry through together (a sender storing messages due at once as fast as
it can, the pump and the consumer, for 30 s, all on this machine), then runs them for --minutes: the sender
storing messages at half that rate with mixed delays (80% 1-60 s, 15% 1-60 min, 5% 1 h-1 day), the pump
(exactly once into the SQL-table queue, as a dispatch task runs it, with the store's own upkeep) and a
consumer that receives and acks. Before it starts, the store is filled (COPY) with the backlog those sends
would have built up over the previous day, so the backlog stays level while it runs.

Every minute it prints and records: the messages the pump claimed (rows it inserted into the queue table) and
the consumer received, lateness p50/p99 (the queue row's enqueued time minus its due time, both on the
database's clock), rows and dead rows of the messages table, its size with its indexes, the vacuums and
analyses of it so far (by autovacuum or the store's upkeep), the queue table's rows, dead rows and size, the
blocks of the messages table and its indexes read from outside PostgreSQL's shared buffers per 1,000 claimed,
the WAL written and the machine's CPU use. The store's upkeep passes (what, when, how long) go to the JSON.
At the end it checks that every message sent was delivered once or is still stored, and none early, and
prints ten minutes against ten (`compared`): the first ten after the first turn of the hour against the same
minutes an hour later when the run is long enough (up to 130 minutes, by when it starts in its hour), else the
first and last ten, which then compare a store not yet in its steady state with one that is.

--hold-snapshot MINUTE:SECONDS opens a REPEATABLE READ transaction in another session at the start of that minute
and holds its snapshot that long (as a backup, a report or an index rebuild does): no row deleted meanwhile can
be vacuumed, and the minutes show what that costs the pump and the consumer.

    .venv/bin/python bench/bench_soak.py --minutes 130 --plot docs/bench_soak.png  # docs/benchmarks/soak.md
    .venv/bin/python bench/bench_soak.py                                          # 3 minutes (make bench)
    .venv/bin/python bench/bench_soak.py --minutes 6 --hold-snapshot 2:90         # a snapshot held for 90 s
    .venv/bin/python bench/bench_soak.py --minutes 12 --explain-over 1000         # plans of statements >= 1 s
                                                           # (started 10 minutes before the hour: its turn)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
import psycopg
from sqlalchemy import event

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import pgserver  # noqa: E402
from bench_store import TABLE_AND_PARTITIONS, finish, libpq, peak_rss_mb, pyplot  # noqa: E402
from bench_throughput import Children, interrupt, log, percentile, save_figure  # noqa: E402
from machine import describe, machine  # noqa: E402

from airflow_delay_provider.core.message import DelayedMessage  # noqa: E402
from airflow_delay_provider.core.pump import Pump, PumpConfig  # noqa: E402
from airflow_delay_provider.stores import tiers as tiers_module  # noqa: E402
from airflow_delay_provider.stores import upkeep as upkeep_module  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore, to_us  # noqa: E402
from airflow_delay_provider.stores.tables import tier_of  # noqa: E402
from airflow_delay_provider.stores.upkeep import HOLDS_BACK_VACUUM  # noqa: E402
from airflow_delay_provider.transports.sql import SqlTableTransport  # noqa: E402

QUEUE = "orders"
BODY = b"x" * 200
PREFIX = "soak_"
#: (share, low, high, log-uniform?) of the delays in seconds.
DELAYS = ((0.80, 1, 60, False), (0.15, 60, 3_600, False), (0.05, 3_600, 86_400, True))
#: The prefilled messages' due times start this many seconds after they are written: the pump's start.
STARTUP_S = 10
MEAN_DELAY = sum(share * ((high - low) / math.log(high / low) if logu else (low + high) / 2)
                 for share, low, high, logu in DELAYS)


def delay(rng: random.Random) -> float:
    pick = rng.random()
    for share, low, high, logu in DELAYS:
        if pick < share:
            return math.exp(rng.uniform(math.log(low), math.log(high))) if logu else rng.uniform(low, high)
        pick -= share
    return DELAYS[-1][2]


def pending_delay(rng: random.Random) -> float:
    """How long until a message stored by the steady sends of the past day is due: the class by its share of
    the backlog (share x mean delay), then the time left, whose density falls as P(delay > x)."""
    weights = [share * ((high - low) / math.log(high / low) if logu else (low + high) / 2)
               for share, low, high, logu in DELAYS]
    _, low, high, logu = rng.choices(DELAYS, weights)[0]
    # A delay drawn in proportion to its length, then a uniform point of it.
    length = rng.uniform(low, high) if logu else math.sqrt(rng.uniform(low * low, high * high))
    return rng.uniform(0, length)


# -- children ------------------------------------------------------------------------------------------
def child(spec: dict) -> None:
    {"send": send, "pump": pump, "consume": consume}[spec["role"]](spec)


def send(spec: dict) -> None:
    """Store `rate` messages a second (as fast as it can without one) in batches of 100, with the mixed delays
    (or due at once), ids numbered (they sort by time, as default ids do)."""
    store = SqlDelayedMessageStore(spec["url"], schema=spec["schema"])
    rng = random.Random(1)
    deadline = time.monotonic() + spec["seconds"]
    started = time.monotonic()
    sent = 0
    prefix = spec.get("prefix", "soak-")
    print("ready", flush=True)
    while time.monotonic() < deadline:
        now = store.clock()
        batch = [DelayedMessage(QUEUE, BODY, now + timedelta(seconds=0 if spec.get("due_now") else delay(rng)), {},
                                f"{prefix}{sent + i:012d}") for i in range(100)]
        store.store(batch)
        sent += len(batch)
        ahead = sent / spec["rate"] - (time.monotonic() - started) if spec.get("rate") else 0
        if ahead > 0:
            time.sleep(ahead)
    print(json.dumps({"sent": sent}), flush=True)


class UpkeepRecords(logging.Handler):
    """The store's upkeep passes (vacuums, analyses, index rebuilds, how long each took) and truncations, with their
    times, for the result; each is also printed, so a run shows them as they come."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.records.append((record.created, message))
        log(f"pump: {message}")


def pump(spec: dict) -> None:
    store = SqlDelayedMessageStore(spec["url"], schema=spec["schema"])
    if spec.get("explain_over_ms"):
        explain_slow_statements(store.engine, spec["explain_over_ms"])
    transport = SqlTableTransport(spec["url"], schema=spec["schema"], table_prefix=PREFIX)
    upkeep = UpkeepRecords()
    # The upkeep's passes, and the truncation of each hour's partition once its hour is past.
    for name in (upkeep_module.__name__, tiers_module.__name__):
        logging.getLogger(name).addHandler(upkeep)
        logging.getLogger(name).setLevel(logging.INFO)
    print("ready", flush=True)
    result = Pump(store, transport, PumpConfig(batch_size=1000)).run(
        deadline=datetime.fromtimestamp(spec["deadline"], UTC))
    print(json.dumps({"dispatched": result.stats.dispatched, "peak_rss_mb": peak_rss_mb(),
                      "upkeep": upkeep.records}), flush=True)


def explain_slow_statements(engine, over_ms: float) -> None:
    """Log the plan of each of the pump's statements that runs `over_ms` or longer into PostgreSQL's server log
    (auto_explain, loaded in each of the pump's sessions: a superuser's, as the benchmark's is), and each
    temporary file they write, with its size and statement."""

    @event.listens_for(engine, "connect")
    def _load(dbapi_connection, _record) -> None:
        with dbapi_connection.cursor() as cursor:
            # With the rows and buffers of each node (no timing, which costs every statement more).
            cursor.execute(f"LOAD 'auto_explain'; SET auto_explain.log_min_duration = {float(over_ms)}; "
                           "SET auto_explain.log_nested_statements = on; SET auto_explain.log_analyze = on; "
                           "SET auto_explain.log_buffers = on; SET auto_explain.log_timing = off; "
                           "SET log_temp_files = 0")
        dbapi_connection.commit()

    engine.dispose()  # sessions opened before this would not log


def consume(spec: dict) -> None:
    """Receive and ack; every minute print the minute's count and lateness percentiles; track ids in a
    bitmap (the sender numbers them) to count duplicates."""
    transport = SqlTableTransport(spec["url"], schema=spec["schema"], table_prefix=PREFIX)
    seen = bytearray(spec["max_ids"] // 8 + 1)
    duplicates = early = received = 0
    minute: list[float] = []
    worst: tuple[float, str] = (-math.inf, "")
    minute_end = time.monotonic() + 60
    deadline = time.monotonic() + spec["seconds"]
    print("ready", flush=True)
    while time.monotonic() < deadline:
        batch = transport.receive(QUEUE, max_messages=1000, visibility_timeout=600)
        for m in batch:
            n = int(m.message_id.removeprefix("soak-")) if m.message_id.startswith("soak-") else None
            if n is not None:
                if seen[n >> 3] & (1 << (n & 7)):
                    duplicates += 1
                seen[n >> 3] |= 1 << (n & 7)
            late = (m.enqueued_at - m.due_at).total_seconds() * 1000
            early += late < 0
            minute.append(late)
            if late > worst[0]:
                worst = (late, m.enqueued_at.isoformat())
        received += len(batch)
        if batch:
            transport.ack(QUEUE, [m.receipt for m in batch])
        else:
            time.sleep(0.005)
        if time.monotonic() >= minute_end:
            minute.sort()
            print(json.dumps({"minute": len(minute), "p50": percentile(minute, 0.5) if minute else None,
                              "p99": percentile(minute, 0.99) if minute else None,
                              # When the latest message of the minute was enqueued: where to look for a stall.
                              "worst_ms": worst[0] if minute else None, "worst_at": worst[1]}), flush=True)
            minute, minute_end, worst = [], minute_end + 60, (-math.inf, "")
    counted = sum(bin(b).count("1") for b in seen)
    print(json.dumps({"received": received, "distinct_numbered": counted, "duplicates": duplicates,
                      "early": early}), flush=True)


# -- the run -------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, args) -> None:
        self.args = args
        self.schema = f"adp_soak_{uuid.uuid4().hex[:8]}"
        self.children = Children()
        self.r: dict = {"minutes": args.minutes, "delays": [list(d) for d in DELAYS], "mean_delay_s": MEAN_DELAY}

    def spec(self, **fields) -> dict:
        return {"url": self.args.pg_url, "schema": self.schema, **fields}

    def start(self, spec: dict) -> subprocess.Popen:
        return self.children.start(spec, script=__file__)

    def setup(self) -> None:
        self.store = SqlDelayedMessageStore(self.args.pg_url, schema=self.schema)
        self.store.create_schema()
        self.queue = SqlTableTransport(self.args.pg_url, schema=self.schema, table_prefix=PREFIX)
        self.queue.provision(QUEUE)
        self.conn = psycopg.connect(libpq(self.args.pg_url), autocommit=True)

    def teardown(self) -> None:
        finish(self.args.pg_url, self.schema, self.children, self.store.close, self.queue.close, self.conn.close)
        log(f"dropped schema {self.schema}")

    def max_rate(self, seconds: int = 30) -> float:
        """The most the three parts carry through together on this machine (where they share the CPUs, as in the
        soak): a sender storing messages due at once as fast as it can, the pump and the consumer, for `seconds`;
        the rate at which messages reached the consumer."""
        deadline = time.time() + seconds
        consumer = self.start(self.spec(role="consume", seconds=seconds, max_ids=8))
        pumper = self.start(self.spec(role="pump", deadline=deadline, explain_over_ms=self.args.explain_over))
        sender = self.start(self.spec(role="send", seconds=seconds, due_now=True, prefix="max-"))
        sent = Children.result(sender, seconds + 120)["sent"]
        Children.result(pumper, seconds + 120)
        received = Children.result(consumer, seconds + 120)["received"]
        log(f"maximum: {sent / seconds:,.0f} msg/s stored, {received / seconds:,.0f} msg/s through to the consumer")
        self.r["max_stored_rate"] = sent / seconds
        for table in (self.queue.messages, self.store.table, self.store.tables.ids):
            self.conn.execute(f"TRUNCATE {table.fullname}")
        return received / seconds

    def prefill(self, rate: float) -> int:
        """COPY the backlog a day of sends at `rate` would leave: rate x mean delay messages (or --prefill). The
        farthest are written first and each chunk's due times count from when it is written, plus `STARTUP_S`, so
        none is overdue before the pump has started: a pump that starts late on due messages is a restart, not the
        churn this measures (in a run without it the first minute's p99 was the 1.0-1.5 s the pump took to start)."""
        n = int(rate * MEAN_DELAY) if self.args.prefill is None else self.args.prefill
        rng = random.Random(2)
        offsets = sorted((int(pending_delay(rng) * 1_000_000) for _ in range(n)), reverse=True)
        body = "\\\\x" + BODY.hex()
        started = time.perf_counter()
        table = self.store.table.fullname
        with psycopg.connect(libpq(self.args.pg_url)) as conn:
            for done in range(0, n, 100_000):
                now = to_us(self.store.clock())
                start = now + STARTUP_S * 1_000_000
                rows = io.StringIO()
                for i in range(done, min(n, done + 100_000)):
                    tier = tier_of(start + offsets[i], now, ring=True)  # the partition store() would choose
                    rows.write(f"fill-{i:012d}\t{QUEUE}\t{body}\t{{}}\t{start + offsets[i]}\t{now}\t0\t{tier}\n")
                with conn.cursor().copy(f"COPY {table} (message_id, destination, body, headers, due_at_us, "
                                        "stored_at_us, failures, tier) FROM STDIN") as copy:
                    copy.write(rows.getvalue())
                conn.commit()
        log(f"prefill: {n:,} messages in {time.perf_counter() - started:.0f} s")
        return n

    def sample(self) -> dict:
        # A partitioned table (the store's messages: `_soon`, and `_later`'s `_far` and hours) counts as the sum of
        # its partitions.
        stats = ("SELECT sum(n_live_tup)::int8, sum(n_dead_tup)::int8, sum(vacuum_count + autovacuum_count)::int8, "
                 "sum(analyze_count + autoanalyze_count)::int8, sum(pg_total_relation_size(relid))::int8, "
                 f"sum(n_tup_ins)::int8 FROM pg_stat_user_tables WHERE relid IN {TABLE_AND_PARTITIONS}")
        row = self.conn.execute(stats, {"t": self.store.table.fullname}).fetchone()
        # The partition of the messages due within minutes: where the claims work.
        soon = self.conn.execute(stats, {"t": self.store.tables.soon.fullname}).fetchone()
        queue = self.conn.execute(stats, {"t": self.queue.messages.fullname}).fetchone()
        ids = self.conn.execute(stats, {"t": self.store.tables.ids.fullname}).fetchone()
        # The oldest snapshot any session of the database holds: no row deleted after it can be vacuumed (the
        # sessions the upkeep's warning names).
        oldest = self.conn.execute("SELECT coalesce(max(extract(epoch FROM now() - xact_start)), 0) FROM "
                                   f"pg_stat_activity WHERE {HOLDS_BACK_VACUUM}").fetchone()[0]
        # Blocks of the messages table and its indexes read from outside PostgreSQL's shared buffers (the OS cache
        # or the disk) and found in them; the WAL position; checkpoints; the machine's CPU time by kind.
        io_ = self.conn.execute(
            "SELECT sum(heap_blks_read)::int8, sum(heap_blks_hit)::int8, sum(idx_blks_read)::int8, "
            f"sum(idx_blks_hit)::int8 FROM pg_statio_user_tables WHERE relid IN {TABLE_AND_PARTITIONS}",
            {"t": self.store.table.fullname}).fetchone()
        # Full page images: the first change to a page after a checkpoint writes the whole page to the WAL.
        wal, checkpoints, fpi = self.conn.execute(
            "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn, checkpoints_timed + checkpoints_req, "
            "(SELECT wal_fpi FROM pg_stat_wal) FROM pg_stat_bgwriter").fetchone()
        cpu = psutil.cpu_times()
        # What reached the disk (reads the page cache did not serve), and how much memory the page cache had.
        disk = psutil.disk_io_counters()
        return {"disk_read": disk.read_bytes, "disk_written": disk.write_bytes,
                "page_cache_gb": getattr(psutil.virtual_memory(), "cached", 0) / 2**30,
                "heap_read": io_[0], "heap_hit": io_[1], "idx_read": io_[2], "idx_hit": io_[3], "wal": float(wal),
                "checkpoints": checkpoints, "fpi": fpi, "cpu_idle": cpu.idle, "cpu_iowait": getattr(cpu, "iowait", 0.0),
                "cpu_total": sum(cpu),
                "rows": row[0], "dead": row[1], "vacuums": row[2], "analyses": row[3], "size_mb": row[4] / 2**20,
                "soon_rows": soon[0], "soon_dead": soon[1], "soon_mb": soon[4] / 2**20,
                # Ids accepted within the de-duplication window (a day by default): they grow for a day.
                "ids_mb": ids[4] / 2**20,
                # What the pump moved: rows inserted into the queue table (the consumer's pace is its own).
                "queue_inserts": queue[5], "queue_rows": queue[0], "queue_dead": queue[1],
                "queue_vacuums": queue[2], "queue_mb": queue[4] / 2**20, "oldest_snapshot_s": float(oldest)}

    @staticmethod
    def per_minute(before: dict, after: dict) -> dict:
        """The minute's share of the counters sampled at its start and end."""
        claimed = max(after["queue_inserts"] - before["queue_inserts"], 1) / 1000
        cpu = after["cpu_total"] - before["cpu_total"] or 1.0
        return {"heap_reads_per_k": (after["heap_read"] - before["heap_read"]) / claimed,
                "idx_reads_per_k": (after["idx_read"] - before["idx_read"]) / claimed,
                "heap_hits_per_k": (after["heap_hit"] - before["heap_hit"]) / claimed,
                "idx_hits_per_k": (after["idx_hit"] - before["idx_hit"]) / claimed,
                "wal_mb": (after["wal"] - before["wal"]) / 2**20,
                "disk_read_mb": (after["disk_read"] - before["disk_read"]) / 2**20,
                "disk_written_mb": (after["disk_written"] - before["disk_written"]) / 2**20,
                "checkpoints_in_minute": after["checkpoints"] - before["checkpoints"],
                "fpi_per_k": (after["fpi"] - before["fpi"]) / claimed,
                "cpu_busy": 1 - (after["cpu_idle"] - before["cpu_idle"] + after["cpu_iowait"] - before["cpu_iowait"])
                / cpu,
                "cpu_iowait_share": (after["cpu_iowait"] - before["cpu_iowait"]) / cpu}

    def hold_snapshot(self, at: float, seconds: float) -> None:
        """In a thread: at `at` (time.monotonic()) open a REPEATABLE READ transaction, read, hold it `seconds`."""

        def hold() -> None:
            time.sleep(max(0.0, at - time.monotonic()))
            with psycopg.connect(libpq(self.args.pg_url)) as conn:
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                conn.execute(f"SELECT count(*) FROM {self.queue.queues.fullname}").fetchone()
                log(f"holding a snapshot for {seconds:.0f} s")
                time.sleep(seconds)
            log("snapshot released")

        threading.Thread(target=hold, daemon=True).start()

    def watch_statements(self, stop: threading.Event, over_ms: float = 300.0) -> None:
        """In a thread: every 100 ms, the statements on this run's schema that have run longer than `over_ms`
        (what the pump, the sender, the consumer or the upkeep waits on, and on whom), kept as
        `self.r["slow_statements"]`, one entry per statement with the longest time seen; a lateness spike beside
        none of them is a stall outside the database."""
        seen: dict[tuple[int, str], dict] = {}
        query = ("SELECT pid, query_start::text, extract(epoch FROM now() - query_start) * 1000, wait_event_type, "
                 "wait_event, left(regexp_replace(query, '\\s+', ' ', 'g'), 160), pg_blocking_pids(pid) FROM "
                 "pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() AND (position(%s in query) > 0 "
                 # A commit names no table: one that waits is the WAL's flush (a checkpoint's writes beside it).
                 "OR ltrim(upper(query)) LIKE 'COMMIT%%') "
                 "AND now() - query_start > make_interval(secs => %s)")
        holder = ("SELECT coalesce(nullif(application_name, ''), backend_type), state, "
                  "left(regexp_replace(query, '\\s+', ' ', 'g'), 160) FROM pg_stat_activity WHERE pid = %s")
        with psycopg.connect(libpq(self.args.pg_url), autocommit=True) as conn:
            while not stop.wait(0.1):
                with contextlib.suppress(psycopg.Error):
                    for pid, start, ms, wait_type, wait, text_, blockers in conn.execute(
                            query, [self.schema, over_ms / 1000]).fetchall():
                        entry = seen.setdefault((pid, start), {"pid": pid, "start": start, "query": text_,
                                                               "waits": [], "blocked_by": []})
                        entry["ms"] = float(ms)
                        if wait and f"{wait_type}:{wait}" not in entry["waits"]:
                            entry["waits"].append(f"{wait_type}:{wait}")
                        for blocker in blockers or ():
                            if blocker not in entry["blocked_by"]:
                                entry["blocked_by"].append(blocker)
                                # Who holds the lock, and at what: the blocker's statement as it is now.
                                held = conn.execute(holder, [blocker]).fetchone() or (None, None, None)
                                entry.setdefault("blockers", []).append(
                                    {"pid": blocker, **dict(zip(("application", "state", "query"), held, strict=True))})
        self.r["slow_statements"] = sorted(seen.values(), key=lambda e: e["start"])

    def run(self) -> None:
        top = self.args.rate or self.max_rate() / 2
        if not self.args.rate:
            self.r["max_rate"] = top * 2
            log(f"sending at half the maximum, {top:,.0f} msg/s")
        self.r["rate"] = top
        self.r["prefilled"] = self.prefill(top)
        seconds = self.args.minutes * 60
        deadline = time.time() + seconds + 5
        sent_max = int(top * (seconds + 60)) + 1000
        consumer = self.start(self.spec(role="consume", seconds=seconds + 30, max_ids=sent_max))
        pumper = self.start(self.spec(role="pump", deadline=deadline, explain_over_ms=self.args.explain_over))
        sender = self.start(self.spec(role="send", rate=top, seconds=seconds))
        minutes = []
        stop_watching = threading.Event()
        watcher = threading.Thread(target=self.watch_statements, args=(stop_watching,), daemon=True)
        watcher.start()
        previous, at = self.sample(), time.monotonic()
        if self.args.hold_snapshot:
            minute, held = (float(x) for x in self.args.hold_snapshot.split(":"))
            self.r["held_snapshot"] = {"minute": minute, "seconds": held}
            self.hold_snapshot(at + (minute - 1) * 60, held)
        for m in range(self.args.minutes):
            line = json.loads(consumer.stdout.readline())
            sampled = self.sample()
            claimed = sampled["queue_inserts"] - previous["queue_inserts"]
            seconds, at = time.monotonic() - at, time.monotonic()
            row = {"minute": m + 1, "ended_utc": datetime.now(UTC).strftime("%H:%M"),
                   "claimed": claimed, "rate": claimed / seconds, "received": line["minute"] / 60,
                   "p50_ms": line["p50"], "p99_ms": line["p99"], "worst_ms": line.get("worst_ms"),
                   "worst_at": line.get("worst_at"), **sampled, **self.per_minute(previous, sampled)}
            previous = sampled
            minutes.append(row)
            log(f"minute {m + 1}: claimed {row['rate']:,.0f} msg/s, received {row['received']:,.0f} msg/s, lateness "
                f"p50 {row['p50_ms'] or 0:.0f} ms p99 {row['p99_ms'] or 0:.0f} ms (worst "
                f"{row['worst_ms'] or 0:.0f} ms, enqueued {row['worst_at']}), {row['rows']:,} rows, "
                f"{row['dead']:,} dead, {row['size_mb']:,.0f} MB ({row['soon_rows']:,} rows, {row['soon_dead']:,} "
                f"dead, {row['soon_mb']:,.0f} MB due soon), {row['vacuums']} vacuums, {row['analyses']} "
                f"analyses; queue {row['queue_rows']:,} rows, {row['queue_dead']:,} dead, {row['queue_mb']:,.0f} "
                f"MB; ids {row['ids_mb']:,.0f} MB; oldest snapshot {row['oldest_snapshot_s']:.0f} s; per 1,000 "
                f"claimed: {row['heap_reads_per_k']:.0f} heap and {row['idx_reads_per_k']:.0f} index blocks read "
                f"from outside shared buffers; WAL {row['wal_mb']:,.0f} MB, {row['fpi_per_k']:.0f} full page images "
                f"per 1,000 claimed; {row['checkpoints_in_minute']} checkpoints; disk {row['disk_read_mb']:,.0f} MB "
                f"read, {row['disk_written_mb']:,.0f} MB written, page cache {row['page_cache_gb']:.1f} GB; CPU "
                f"{row['cpu_busy'] * 100:.0f}% busy, {row['cpu_iowait_share'] * 100:.1f}% iowait")
        stop_watching.set()
        watcher.join(10)
        sent = Children.result(sender, 120)["sent"]
        pumped = Children.result(pumper, 120)
        self.r["upkeep"] = pumped["upkeep"]
        got = Children.result(consumer, 120)
        # Every numbered message was received or is still stored (not due yet) or waits in the queue.
        stored = self.conn.execute(f"SELECT count(*) FROM {self.store.table.fullname} WHERE message_id LIKE "
                                   "'soak-%%'").fetchone()[0]
        queued = self.conn.execute(f"SELECT count(*) FROM {self.queue.messages.fullname} WHERE message_id LIKE "
                                   "'soak-%%'").fetchone()[0]
        self.r |= {"minutes_table": minutes, "sent": sent, "stored_at_end": stored, "queued_at_end": queued,
                   "lost": sent - got["distinct_numbered"] - stored - queued, "duplicates": got["duplicates"],
                   "early": got["early"], "pump_peak_rss_mb": pumped["peak_rss_mb"]}


def print_blocks(rows: list[dict], size: int = 10) -> None:
    """The minutes in blocks of `size`: mean rates, and the range of every other column over the block."""

    def span(part: list[dict], key: str, fmt: str, unit: str = "") -> str:
        values = [x.get(key) or 0 for x in part]
        low, high = format(min(values), fmt), format(max(values), fmt)
        return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"

    print("\n| minutes | claimed msg/s | received msg/s | lateness p50 | p99 | rows | dead rows | table + indexes | "
          "due soon: rows, size | queue table | ids table |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        millions = [dict(x, rows_m=x["rows"] / 1e6, dead_k=x["dead"] / 1e3, soon_k=x.get("soon_rows", 0) / 1e3)
                    for x in part]
        print(f"| {part[0]['minute']}-{part[-1]['minute']} | {statistics.mean(x['rate'] for x in part):,.0f} | "
              f"{statistics.mean(x['received'] for x in part):,.0f} | {span(part, 'p50_ms', ',.0f', ' ms')} | "
              f"{span(part, 'p99_ms', ',.0f', ' ms')} | {span(millions, 'rows_m', ',.2f', ' M')} | "
              f"{span(millions, 'dead_k', ',.0f', ' k')} | {span(part, 'size_mb', ',.0f', ' MB')} | "
              f"{span(millions, 'soon_k', ',.0f', ' k')}, {span(part, 'soon_mb', ',.0f', ' MB')} | "
              f"{span(part, 'queue_mb', ',.0f', ' MB')} | {span(part, 'ids_mb', ',.0f', ' MB')} |")


def compared(rows: list[dict], span: int = 10) -> tuple[list[dict], list[dict], str]:
    """The two blocks of minutes the report compares, and a sentence on which they are.

    The store does not start in its steady state: the prefill puts into the current hour's partition only the
    messages due in the rest of that hour, none yet moved out of it, where a store that has run for a day holds
    there the space of every message moved out since the hour began. From the first turn of the hour on it is
    as a day of sends would leave it (the hour past's partition truncated, the next one filled by the prefill
    and the sends since), and its partitions' sizes and the vacuums' work rise through each hour and fall at
    its turn. So blocks an hour apart after the first turn show drift; the first and last of a shorter run
    compare different points of hours that are not alike."""
    hours = [row.get("ended_utc", "")[:2] for row in rows]
    # The first minute that began after the turn (the one before it ended past it).
    turn = next((i + 1 for i, h in enumerate(hours) if h != hours[0]), None)
    if turn is not None and hours[0] and turn + 60 + span <= len(rows):
        return (rows[turn:turn + span], rows[turn + 60:turn + 60 + span],
                f"Compared: the first {span} minutes after the first turn of the hour (minute {turn + 1} on) and "
                f"the same minutes an hour later.")
    span = min(span, max(1, len(rows) // 3))
    need = (f"at least {turn + 60 + span} minutes from this start" if turn is not None and hours[0]
            else "at least 70 minutes past the first turn of the hour")
    return (rows[:span], rows[-span:],
            f"Compared: the first and last {span} minutes. The first lie before the first turn of the hour, when the "
            f"current hour's partition held only what the prefill put there: not the store's steady state (for "
            f"blocks an hour apart after the turn, run {need}).")


def report(r: dict) -> None:
    print(f"\n{describe(r['machine'])}")
    # Every setting that differs from what PostgreSQL ships, read at run time: autovacuum=off too.
    tuned = dict(r["machine"].get("postgresql_settings", {}))
    rows = r["minutes_table"]
    print(f"{r['minutes']} minutes; sends at {r['rate']:,.0f} msg/s"
          + (f" (half the maximum that a sender, the pump and the consumer carried through together on this machine, "
             f"{r['max_rate']:,.0f} msg/s)"
             if "max_rate" in r else "")
          + f"; delays 80% 1-60 s, 15% 1-60 min, 5% 1 h-1 day (mean {r['mean_delay_s']:,.0f} s); store prefilled "
          f"with {r['prefilled']:,} messages (the backlog of a day of such sends: rate x mean delay, unless --prefill "
          "said otherwise); PostgreSQL " + (", ".join(f"{k}={v}" for k, v in tuned.items()) or "as shipped")
          + (f"; a snapshot held for {r['held_snapshot']['seconds']:.0f} s from the start of minute "
             f"{r['held_snapshot']['minute']:.0f}" if r.get("held_snapshot") else "") + ".\n")
    print("| minute | claimed msg/s | received msg/s | lateness p50 | p99 | rows | dead rows | table + indexes | "
          "due soon: rows / dead / MB | vacuums | analyses | queue rows | queue dead | queue MB | ids table MB | "
          "oldest snapshot | blocks read per 1,000 claimed (heap / index) | WAL MB | CPU busy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['minute']} | {row['rate']:,.0f} | {row['received']:,.0f} | {row['p50_ms'] or 0:.0f} ms | "
              f"{row['p99_ms'] or 0:.0f} ms | {row['rows']:,} | {row['dead']:,} | {row['size_mb']:,.0f} MB | "
              f"{row.get('soon_rows', 0):,} / {row.get('soon_dead', 0):,} / {row.get('soon_mb', 0):,.0f} | "
              f"{row['vacuums']} | {row['analyses']} | {row['queue_rows']:,} | {row['queue_dead']:,} | "
              f"{row['queue_mb']:,.0f} | {row['ids_mb']:,.0f} | {row.get('oldest_snapshot_s', 0):.0f} s | "
              f"{row['heap_reads_per_k']:,.0f} / {row['idx_reads_per_k']:,.0f} | "
              f"{row['wal_mb']:,.0f} | {row['cpu_busy'] * 100:.0f}% |")
    print_blocks(rows)
    first, last, where = compared(rows)
    span = len(first)

    def mean(part, key):
        values = [x[key] for x in part if x[key] is not None]
        return statistics.mean(values) if values else 0.0

    def ends(part: list[dict]) -> str:  # the minutes' ends on the clock, where recorded
        return f" ({part[0]['ended_utc']}-{part[-1]['ended_utc']} UTC)" if "ended_utc" in part[0] else ""

    print(f"\n{where}\n")
    print(f"| first {span} min{ends(first)} vs last {span}{ends(last)} | first | last | last / first |")
    print("|---|---:|---:|---:|")
    for row in rows:
        row["bytes_per_row"] = row["size_mb"] * 2**20 / max(row["rows"], 1)
    for key, label in (("rate", "claimed msg/s"), ("received", "received msg/s"), ("p99_ms", "lateness p99 (ms)"),
                       ("heap_reads_per_k", "heap blocks read per 1,000 claimed"),
                       ("idx_reads_per_k", "index blocks read per 1,000 claimed"),
                       ("wal_mb", "WAL MB a minute"),
                       ("fpi_per_k", "full page images in the WAL per 1,000 claimed"), ("cpu_busy", "CPU busy (share)"),
                       ("size_mb", "table + indexes (MB)"),
                       ("bytes_per_row", "table + indexes per stored message (bytes)")):
        a, b = mean(first, key), mean(last, key)
        print(f"| {label} | {a:,.1f} | {b:,.1f} | {b / a if a else 0:.2f} |")
    slow = [e for e in r.get("slow_statements", ())
            if not e["query"].lstrip().upper().startswith(("VACUUM", "ANALYZE", "REINDEX", "CREATE INDEX"))]
    if slow:
        print("\nStatements other than the upkeep's that ran longer than 300 ms (when, how long, waiting on what, "
              "blocked by):")
        for e in slow:
            print(f"- {e['start']} {e['ms']:,.0f} ms pid {e['pid']} {e['waits'] or '-'} {e['blocked_by'] or '-'}: "
                  f"{e['query'][:100]}")
            for b in e.get("blockers", ()):
                print(f"  - blocked by pid {b['pid']} ({b.get('application') or 'gone'}, {b.get('state') or '-'}): "
                      f"{(b.get('query') or '')[:100]}")
    print(f"\nsent {r['sent']:,}; lost {r['lost']}, duplicates {r['duplicates']}, early {r['early']}; "
          f"{r['stored_at_end']:,} still stored (not due), {r['queued_at_end']:,} in the queue at the end; "
          f"pump peak RSS {r['pump_peak_rss_mb']:.0f} MB")


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    rows = r["minutes_table"]
    x = [row["minute"] for row in rows]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    axes[0].plot(x, [row["rate"] for row in rows], label="claimed (pump)")
    axes[0].plot(x, [row["received"] for row in rows], label="received (consumer)")
    axes[0].set_title("msg/s")
    axes[0].legend(fontsize=7)
    axes[1].plot(x, [row["p50_ms"] for row in rows], label="p50")
    axes[1].plot(x, [row["p99_ms"] for row in rows], label="p99")
    axes[1].set_title("lateness (ms)")
    axes[1].legend(fontsize=7)
    axes[2].plot(x, [row["size_mb"] for row in rows], label="table + indexes (MB)")
    axes[2].plot(x, [row["dead"] / 1000 for row in rows], label="dead rows (thousands)")
    axes[2].set_title("size and dead rows")
    axes[2].legend(fontsize=7)
    axes[3].plot(x, [row["heap_reads_per_k"] for row in rows], label="heap")
    axes[3].plot(x, [row["idx_reads_per_k"] for row in rows], label="indexes")
    axes[3].set_title("blocks read past shared buffers / 1,000 claimed")
    axes[3].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("minute")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pgserver.add_arguments(parser)
    parser.add_argument("--minutes", type=int, default=3)
    parser.add_argument("--rate", type=float, help="messages per second to send (default: half the measured maximum)")
    parser.add_argument("--prefill", type=int, help="messages stored before it starts (default: the backlog of a "
                        "day of sends, rate x mean delay)")
    parser.add_argument("--hold-snapshot", metavar="MINUTE:SECONDS",
                        help="hold a snapshot in another session from the start of MINUTE for SECONDS")
    parser.add_argument("--explain-over", metavar="MS", type=float,
                        help="log the plan, rows and buffers of each pump statement that runs MS or longer "
                        "(PostgreSQL's server log)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    signal.signal(signal.SIGTERM, interrupt)
    with pgserver.server(args):
        soak = Soak(args)
        try:
            soak.setup()
            soak.r["machine"] = machine(args.pg_url)
            soak.run()
        finally:
            soak.teardown()
        report(soak.r)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(soak.r, indent=2, default=str))
        log(f"wrote {args.json}")
        if args.plot:
            plot(soak.r, args.plot)


if __name__ == "__main__":
    main()
