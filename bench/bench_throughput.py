"""Benchmark: the dispatch pump against the raw limits of the broker and the database, side by side.

One run, one PostgreSQL schema and one RabbitMQ vhost of its own (both dropped at the end, also on
Ctrl-C or an error). The scenario: N messages of 200 B (default 20,000) all due at one instant.
It measures, in the same run:

1. raw limits: pika with 1,000 publisher confirms in flight into a quorum queue, into a classic
   queue (both declared here with `x-queue-type`) and into a quorum queue declared with the
   arguments provisioning gives an endpoint; the database's bare batched claim (DELETE ... RETURNING,
   1,000 rows per transaction) on a table of the same size;
2. the pump -> a RabbitMQ quorum queue provisioned by RabbitMQTransport.provision, no consumer;
3. the same with a consumer draining the queue in another process (prefetch 1,000, acks in batches);
4. the pump -> the SQL-table queue in the same database (exactly once);
   the raw quorum and the bare claim and 2., 3. and 4. are measured in --repeat rounds that alternate
   raw limit and pump, reported as medians with each round's figure, each ratio target as the median
   of the rounds' ratios (a round's figures are back to back); every fill of the
   store is followed by ANALYZE (see Bench.fill);
5. the first delivery after the due time of an N burst, over --runs runs: a pump already running and
   asleep in another process is woken by the store, a consumer process records arrival times
   (time.time() in both processes, the due time as an epoch timestamp), for RabbitMQ and the SQL queue;
6. 1, 2 and 4 pump processes draining the same N into the SQL-table queue and into RabbitMQ, with the
   number of duplicates (ids delivered more than once).

Every pump and publisher connection is opened before its clock starts (a running pump has its
connections open). Progress goes to stderr, the tables to stdout, the figures to --json.

    .venv/bin/python bench/bench_throughput.py                          # 20,000 messages, 5 latency runs
    .venv/bin/python bench/bench_throughput.py --messages 5000 --runs 1 --plot docs/bench_throughput.png

`--history-ab ROUNDS` runs only the pump with the delivery history on and off in alternation (RabbitMQ and the SQL-table
queue), and times the page's reads of the history it left.

    .venv/bin/python bench/bench_throughput.py --pg default --history-ab 5 --json bench/results/history.json

`--ab COMMIT` runs only the first delivery of a burst (bench/first_delivery.py): COMMIT's package and the working
tree's in turns, `--ab-rounds` bursts each, with the ratios of their medians; `--graphile` adds graphile-worker's
run of the same burst to each round; `--plot` draws each round's figures. No RabbitMQ is needed for it.

    .venv/bin/python bench/bench_throughput.py --pg default --ab 16253c2 --ab-rounds 7 --graphile \
        --plot docs/bench_first_delivery.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pika
import psycopg
import sqlalchemy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import first_delivery  # noqa: E402
import pgserver  # noqa: E402
from bench_rabbitmq import rabbitmqctl, raw_windowed  # noqa: E402
from bench_store import libpq, peak_rss_mb, pyplot, raw_claim  # noqa: E402
from machine import describe, machine, postgresql, settings_text  # noqa: E402

from airflow_delay_provider.core.delays import utcnow  # noqa: E402
from airflow_delay_provider.core.message import DelayedMessage  # noqa: E402
from airflow_delay_provider.core.pump import Pump, PumpConfig  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore  # noqa: E402
from airflow_delay_provider.transports.rabbitmq import (  # noqa: E402
    DELIVERY_LIMIT,
    Names,
    RabbitMQTransport,
    endpoint_arguments,
)
from airflow_delay_provider.transports.sql import SqlTableTransport  # noqa: E402

BODY = b"x" * 200
QUEUE = "orders"  # the pump's destination, on both transports
WARMUP = "warmup"  # a queue that opens a pump's publisher connection before its clock starts
TABLE_PREFIX = "delayed_messages_"  # the SQL queue tables beside the store's (bench_store's layout)
BATCH = 1000


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rmq_params(host: str, vhost: str) -> pika.ConnectionParameters:
    return pika.ConnectionParameters(host, 5672, vhost, pika.PlainCredentials("guest", "guest"))


def burst(n: int, due_at: datetime) -> list[DelayedMessage]:
    return [DelayedMessage(QUEUE, BODY, due_at, {}, uuid.uuid4().hex) for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(round(q * len(ordered))) - 1))]


# -- child processes --------------------------------------------------------------------------------
def child(spec: dict) -> None:
    """Consumers and pumps run in processes of their own: none of them steals the GIL of another."""
    role = spec["role"]
    if role == "consume_rabbitmq":
        result = consume_rabbitmq(spec)
    elif role == "consume_sql":
        result = consume_sql(spec)
    else:
        result = run_pump(spec)
    print(json.dumps(result), flush=True)


def consume_rabbitmq(spec: dict) -> dict:
    """basic_consume with prefetch 1,000 and one multiple-ack per 100 deliveries; stops `linger`
    seconds after the last of the `n` ids arrived (duplicates would come meanwhile) or at the timeout."""
    connection = pika.BlockingConnection(rmq_params(spec["host"], spec["vhost"]))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=1000)
    arrivals: dict[str, float] = {}
    state = {"received": 0, "unacked": 0, "done": False}

    def on_message(ch, method, properties, _body) -> None:
        now = time.time()
        state["received"] += 1
        arrivals.setdefault(properties.message_id, now)
        state["unacked"] += 1
        if state["unacked"] >= 100:
            ch.basic_ack(method.delivery_tag, multiple=True)
            state["unacked"] = 0
        if len(arrivals) >= spec["n"] and not state["done"]:
            state["done"] = True
            if state["unacked"]:
                ch.basic_ack(method.delivery_tag, multiple=True)
                state["unacked"] = 0
            connection.call_later(spec["linger"], channel.stop_consuming)

    channel.basic_consume(spec["queue"], on_message)
    connection.call_later(spec["timeout"], channel.stop_consuming)
    print("ready", flush=True)
    channel.start_consuming()
    connection.close()
    return consumed(arrivals, state["received"], spec["want_arrivals"])


def consume_sql(spec: dict) -> dict:
    """Polls SqlTableTransport.receive (1,000 at a time) and acks what it got, as the tests consume.
    Polling starts 50 ms before the due time (read from stdin), so what the consumer adds is its poll
    interval, not the CPU of idle polling taken from the pump."""
    transport = SqlTableTransport(spec["url"], schema=spec["schema"], table_prefix=TABLE_PREFIX)
    transport.depth(spec["queue"])  # opens the pooled connection now, not at the first poll
    print("ready", flush=True)
    due = float(sys.stdin.readline())
    time.sleep(max(0.0, due - 0.05 - time.time()))
    arrivals, enqueued, _, received = first_delivery.poll(transport, spec["queue"], spec["n"], spec["timeout"],
                                                       spec["poll_ms"], spec["linger"])
    return {**consumed(arrivals, received, spec["want_arrivals"]), "first_enqueued": min(enqueued, default=None)}


def consumed(arrivals: dict[str, float], received: int, want_arrivals: bool) -> dict:
    times = arrivals.values()
    return {"received": received, "distinct": len(arrivals), "duplicates": received - len(arrivals),
            "first": min(times, default=None), "last": max(times, default=None),
            "arrivals": arrivals if want_arrivals else None, "peak_rss_mb": peak_rss_mb()}


def make_transport(spec: dict):
    if spec["transport"] == "sql":
        return SqlTableTransport(spec["url"], schema=spec["schema"], table_prefix=TABLE_PREFIX)
    return RabbitMQTransport(rmq_params(spec["host"], spec["vhost"]))


def warm_up(store: SqlDelayedMessageStore, transport) -> None:
    """Open the store's connection (and clock offset) and, on RabbitMQ, the publisher connection."""
    store.next_due()
    if isinstance(transport, RabbitMQTransport):
        failures = transport.send([DelayedMessage(WARMUP, b"w", utcnow(), {}, uuid.uuid4().hex)])
        assert not failures, failures


def run_pump(spec: dict) -> dict:
    """mode "drain": start on the parent's "go" (so several pumps start together), stop when idle;
    mode "sleep": run until the deadline, asleep whenever nothing is due, woken by the store."""
    store = SqlDelayedMessageStore(spec["url"], schema=spec["schema"])
    transport = make_transport(spec)
    warm_up(store, transport)
    pump = Pump(store, transport, PumpConfig(batch_size=spec["batch_size"]))
    print("ready", flush=True)
    if spec["mode"] == "drain":
        if sys.stdin.readline().strip() != "go":
            return {"dispatched": 0, "aborted": True}
        started = time.time()
        result = pump.run(stop_when_idle=True)
    else:
        started = time.time()
        result = pump.run(deadline=datetime.fromtimestamp(spec["deadline"], UTC))
    ended = time.time()
    transport.close()
    store.close()
    return {"dispatched": result.stats.dispatched, "started": started, "ended": ended, "reason": result.reason,
            "peak_rss_mb": peak_rss_mb()}


class Children:
    """The processes this run started: each is waited for or killed, never left behind."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, spec: dict, stdin: bool = False, script: str = __file__) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, script, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True)
        self.procs.append(proc)
        line = proc.stdout.readline().strip()
        if line != "ready":
            proc.kill()
            raise RuntimeError(f"child {spec['role']} did not start (said {line!r}; see its stderr above)")
        return proc

    @staticmethod
    def result(proc: subprocess.Popen, timeout: float) -> dict:
        out, _ = proc.communicate(timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"a child process failed with exit code {proc.returncode} (see its stderr above)")
        return json.loads(out.splitlines()[-1])

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# -- the run ----------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.n = args.messages
        self.schema = f"adp_bench_{uuid.uuid4().hex[:8]}"
        self.vhost = f"adp_bench_{uuid.uuid4().hex[:8]}"
        self.params = rmq_params(args.host, self.vhost)
        self.children = Children()
        self.r: dict = {"messages": self.n, "body_bytes": len(BODY), "batch_size": BATCH}

    def spec(self, **fields) -> dict:
        return {"url": self.args.pg_url, "schema": self.schema, "host": self.args.host, "vhost": self.vhost,
                "queue": QUEUE, "batch_size": BATCH, "timeout": self.args.timeout, **fields}

    def setup(self) -> None:
        rabbitmqctl("add_vhost", self.vhost)
        rabbitmqctl("set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*")
        self.store = SqlDelayedMessageStore(self.args.pg_url, schema=self.schema)
        self.store.create_schema()
        self.sql = SqlTableTransport(self.args.pg_url, schema=self.schema, table_prefix=TABLE_PREFIX)
        self.sql.provision(QUEUE)
        self.rmq = RabbitMQTransport(self.params)
        self.r["provisioned"] = self.rmq.provision(QUEUE)
        self.rmq.provision(WARMUP)
        self.conn = psycopg.connect(libpq(self.args.pg_url), autocommit=False)
        # No heartbeats on the admin connection: it idles while children work and pika answers none meanwhile.
        self.admin = pika.BlockingConnection(pika.ConnectionParameters(
            self.args.host, 5672, self.vhost, self.params.credentials, heartbeat=0))
        self.channel = self.admin.channel()

    def teardown(self) -> None:
        self.children.kill_all()
        for close in (lambda: self.rmq.close(), lambda: self.store.close(), lambda: self.admin.close(),
                      lambda: self.conn.close()):
            with contextlib.suppress(Exception):  # half-built or already gone: the drops below still run
                close()
        try:
            with psycopg.connect(libpq(self.args.pg_url), autocommit=True) as conn:
                conn.execute("SET lock_timeout = '30s'")
                conn.execute(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")
        finally:
            rabbitmqctl("delete_vhost", self.vhost)
        log(f"dropped schema {self.schema} and vhost {self.vhost}")

    # -- helpers
    def reset(self) -> None:
        """Empty store, id and queue tables: every measure starts from the same table state."""
        tables = ", ".join(t.fullname for t in (self.store.table, self.store.tables.ids, self.sql.messages))
        self.conn.execute(f"TRUNCATE {tables}")
        self.conn.commit()
        self.channel.queue_purge(QUEUE)
        self.channel.queue_purge(WARMUP)

    def fill(self, due_at: datetime | None = None) -> None:
        """N messages due at one instant (a second ago: due on every clock), stored 1,000 per call, then the table
        analysed, as autovacuum leaves a store table in use: without statistics the planner's choice for a freshly
        filled table (sequential scan and sort, or the due index) depends on when autovacuum last ran, which made
        the same claim swing between about 90k and 150k rows/s from run to run."""
        messages = burst(self.n, due_at or utcnow() - timedelta(seconds=1))
        for i in range(0, self.n, BATCH):
            self.store.store(messages[i : i + BATCH])
        self.conn.execute(f"ANALYZE {self.store.table.fullname}")
        self.conn.commit()

    def pump(self, transport) -> tuple[float, float, float]:
        """Drain the store in this process; returns (rate, started, ended) with wall clock times."""
        pump = Pump(self.store, transport, PumpConfig(batch_size=BATCH))
        started, t0 = time.time(), time.perf_counter()
        result = pump.run(stop_when_idle=True)
        elapsed = time.perf_counter() - t0
        assert result.stats.dispatched == self.n, result.stats.summary()
        return self.n / elapsed, started, started + elapsed

    def queue_types(self) -> dict[str, dict]:
        out = subprocess.run(["rabbitmqctl", "-q", "list_queues", "-p", self.vhost, "name", "type", "arguments",
                              "--formatter", "json"], capture_output=True, text=True, check=True, timeout=60).stdout
        return {q["name"]: {"type": q["type"], "arguments": q["arguments"]} for q in json.loads(out)}

    # -- 1. raw limits
    def raw_limits(self) -> None:
        declared = {"raw.quorum": {"x-queue-type": "quorum"}, "raw.classic": {"x-queue-type": "classic"},
                    # what provisioning gives an endpoint: delivery limit, dead-lettering at least once
                    "raw.endpoint": endpoint_arguments(Names(), DELIVERY_LIMIT)}
        for queue, arguments in declared.items():
            self.channel.queue_declare(queue, durable=True, arguments=arguments)
        types = self.queue_types()
        self.r["queues"] = types
        for queue in declared:
            # A first publish to a new queue pays for its start (for a quorum queue, its Raft log): not a limit.
            raw_windowed(self.params, queue, min(self.n, 1000), window=1000)
            self.channel.queue_purge(queue)
        for queue in ("raw.classic", "raw.endpoint"):  # raw.quorum is measured beside the pump (paired_rounds)
            log(f"raw: pika, {BATCH} confirms in flight -> {queue} ({types[queue]['type']}), {self.n} messages")
            self.r[f"raw_{queue.split('.')[1]}"] = raw_windowed(self.params, queue, self.n, window=1000)
            self.channel.queue_delete(queue)  # frees the broker's memory before the pump runs

    # -- 2, 3, 4. raw limits and the pump in alternation
    def paired_rounds(self) -> None:
        """--repeat rounds of: raw pika -> raw.quorum, the pump -> RabbitMQ without and with a consumer, the bare
        claim, the pump -> the SQL-table queue; each figure is the median of its rounds, so that one slow round
        (a checkpoint, the broker's own housekeeping) does not decide a target."""
        runs: dict[str, list[float]] = {"raw_quorum": [], "pump_rabbitmq": [], "pump_rabbitmq_consumed": [],
                                        "consumer_rabbitmq": [], "raw_claim": [], "pump_sql": []}
        warm_up(self.store, self.rmq)
        for round_ in range(1, self.args.repeat + 1):
            log(f"round {round_}/{self.args.repeat}: raw pika -> raw.quorum ({self.r['queues']['raw.quorum']['type']}),"
                f" pump -> RabbitMQ {QUEUE} ({self.r['queues'][QUEUE]['type']}) without and with a consumer, bare "
                "claim, pump -> SQL-table queue")
            runs["raw_quorum"].append(raw_windowed(self.params, "raw.quorum", self.n, window=1000))
            self.channel.queue_purge("raw.quorum")
            self.reset()
            self.fill()
            runs["pump_rabbitmq"].append(self.pump(self.rmq)[0])
            pumped, received = self.consumed_pump()
            runs["pump_rabbitmq_consumed"].append(pumped)
            runs["consumer_rabbitmq"].append(received)
            self.reset()
            self.fill()
            started = time.perf_counter()
            claimed = raw_claim(self.conn, self.store.table.fullname)
            runs["raw_claim"].append(claimed / (time.perf_counter() - started))
            assert claimed == self.n, claimed
            self.reset()
            self.fill()
            runs["pump_sql"].append(self.pump(self.sql)[0])
        self.channel.queue_delete("raw.quorum")
        for key, values in runs.items():
            self.r[key] = statistics.median(values)
            self.r[f"{key}_runs"] = values
        # A round's raw limit and pump are back to back, so a slow spell of the machine lowers both.
        for pump, raw in (("pump_rabbitmq", "raw_quorum"), ("pump_sql", "raw_claim")):
            ratios = [p / x for p, x in zip(runs[pump], runs[raw], strict=True)]
            self.r[f"{pump}_ratio"] = statistics.median(ratios)
            self.r[f"{pump}_ratio_runs"] = ratios

    def consumed_pump(self) -> tuple[float, float]:
        """The pump -> RabbitMQ with a consumer draining the queue in another process: (the pump's rate, the
        rate at which the consumer received all of them, from the pump's start)."""
        self.reset()
        self.fill()
        consumer = self.children.start(self.spec(role="consume_rabbitmq", n=self.n, linger=0.0, want_arrivals=False))
        rate, started, _ended = self.pump(self.rmq)
        got = Children.result(consumer, self.args.timeout + 30)
        assert got["distinct"] == self.n, got
        return rate, self.n / (got["last"] - started)

    # -- the delivery history's cost (--history-ab)
    def history_rounds(self, rounds: int) -> None:
        """The pump with the delivery history on (7 days) and off (0), in alternation on one store, into RabbitMQ
        (the claim's settlement inserts the batch's entries) and into the SQL-table queue (the move's own statement
        does); each round's ratio is its on/off pair's, the figure the median of the rounds'. Then the reads the page
        makes, timed on the history those rounds left."""
        runs: dict[str, list[float]] = {f"{kind}_{state}": [] for kind in ("rabbitmq", "sql")
                                        for state in ("on", "off")}
        warm_up(self.store, self.rmq)
        for round_ in range(1, rounds + 1):
            for kind, transport in (("rabbitmq", self.rmq), ("sql", self.sql)):
                for state in ("on", "off") if round_ % 2 else ("off", "on"):  # neither always goes first
                    self.store.history.days = 7 if state == "on" else 0
                    self.reset()
                    self.fill()
                    runs[f"{kind}_{state}"].append(self.pump(transport)[0])
                    log(f"round {round_}/{rounds}: pump -> {kind}, history {state}: "
                        f"{runs[f'{kind}_{state}'][-1]:,.0f} msg/s")
        for key, values in runs.items():
            self.r[f"history_{key}"] = statistics.median(values)
            self.r[f"history_{key}_runs"] = values
        for kind in ("rabbitmq", "sql"):
            ratios = [on / off for on, off in zip(runs[f"{kind}_on"], runs[f"{kind}_off"], strict=True)]
            self.r[f"history_{kind}_ratio"] = statistics.median(ratios)
            self.r[f"history_{kind}_ratio_runs"] = ratios
        self.store.history.days = 7
        now = self.store.clock()
        sample = self.store.history.entries(limit=1)[0][0].message_id
        reads = {"entries": lambda: self.store.history.entries(limit=50),
                 "chart_1h": lambda: self.store.history.chart(None, now - timedelta(hours=1), now),
                 "chart_1h_destination": lambda: self.store.history.chart(QUEUE, now - timedelta(hours=1), now),
                 "story": lambda: self.store.history.entries(message_id=sample, oldest_first=True)}
        timed = {}
        for name, read in reads.items():
            took = []
            for _ in range(3):
                t0 = time.perf_counter()
                read()
                took.append((time.perf_counter() - t0) * 1000)
            timed[name] = statistics.median(took)
        stored = self.conn.execute(f"SELECT coalesce(sum(n), 0) FROM {self.store.history.table.fullname}").fetchone()[0]
        self.conn.commit()
        self.r["history_reads_ms"] = timed
        self.r["history_rows"] = stored

    # -- 5. first delivery after the due time
    def latency(self, kind: str) -> None:
        self.reset()
        lead = self.args.lead
        # The runs' pump: started once, asleep until the store wakes it; killed after the last run.
        deadline = time.time() + self.args.runs * (lead + self.args.timeout) + 60
        pump = self.children.start(self.spec(role="pump", transport=kind, mode="sleep", deadline=deadline))
        time.sleep(0.5)  # its first store.wait() only opens the LISTEN connection; let it fall asleep
        runs = []
        for run in range(self.args.runs):
            # The consumer starts before the due time is chosen: its start-up eats none of the lead.
            if kind == "rabbitmq":
                consumer = self.children.start(self.spec(role="consume_rabbitmq", n=self.n, linger=0.0,
                                                         want_arrivals=True))
            else:
                consumer = self.children.start(self.spec(role="consume_sql", n=self.n, linger=0.0, want_arrivals=True,
                                                         poll_ms=self.args.poll_ms), stdin=True)
            due_at = utcnow() + timedelta(seconds=lead)
            due = due_at.timestamp()
            if kind == "sql":
                consumer.stdin.write(f"{due!r}\n")
                consumer.stdin.flush()
            messages = burst(self.n, due_at)
            self.store.store(messages)  # one transaction: the whole burst is there at once
            stored_before_due = due - time.time()
            if stored_before_due < 0.5:
                log(f"warning: the burst was stored only {stored_before_due:.2f} s before its due time; raise --lead")
            got = Children.result(consumer, self.args.timeout + lead + 30)
            late = [(t - due) * 1000 for t in got["arrivals"].values()]
            runs.append({"first_ms": min(late), "p50_ms": percentile(late, 0.5), "p99_ms": percentile(late, 0.99),
                         "last_ms": max(late), "missing": self.n - got["distinct"], "duplicates": got["duplicates"],
                         "early": sum(1 for x in late if x < 0), "stored_s_before_due": stored_before_due})
            if got.get("first_enqueued") is not None:  # the SQL queue says when the pump inserted
                runs[-1]["first_enqueued_ms"] = (got["first_enqueued"] - due) * 1000
            log(f"latency {kind} run {run + 1}: first {min(late):.1f} ms, p50 {runs[-1]['p50_ms']:.0f} ms, "
                f"last {max(late):.0f} ms after due")
            self.reset()
        pump.kill()  # asleep until its deadline: nothing in flight
        pump.wait()
        self.r[f"latency_{kind}"] = {"runs": runs, "first_p50_ms": statistics.median(r["first_ms"] for r in runs)}

    # -- 6. several pumps on one store
    def many_pumps(self, kind: str) -> None:
        rows = {}
        for count in self.args.pumps:
            self.reset()
            self.fill()
            log(f"{count} pump process(es) -> {kind}, {self.n} messages")
            consumer = None
            if kind == "rabbitmq":
                consumer = self.children.start(self.spec(role="consume_rabbitmq", n=self.n, linger=1.0,
                                                         want_arrivals=False))
            pumps = [self.children.start(self.spec(role="pump", transport=kind, mode="drain"), stdin=True)
                     for _ in range(count)]
            for p in pumps:  # all set up and connected: start them together
                p.stdin.write("go\n")
                p.stdin.flush()
            results = [Children.result(p, self.args.timeout + 30) for p in pumps]
            dispatched = sum(x["dispatched"] for x in results)
            elapsed = max(x["ended"] for x in results) - min(x["started"] for x in results)
            if consumer is not None:
                got = Children.result(consumer, self.args.timeout + 30)
                delivered, distinct = got["received"], got["distinct"]
            else:
                t = self.sql.messages.fullname
                query = f"SELECT count(*), count(DISTINCT message_id) FROM {t}"
                delivered, distinct = self.conn.execute(query).fetchone()
                self.conn.commit()
            rows[count] = {"rate": dispatched / elapsed, "dispatched": dispatched, "delivered": delivered,
                           "duplicates": delivered - distinct, "missing": self.n - distinct,
                           "per_pump": [x["dispatched"] for x in results],
                           "pump_peak_rss_mb": max(x["peak_rss_mb"] for x in results)}
            log(f"{count} pump(s) -> {kind}: {rows[count]['rate']:,.0f} msg/s, {rows[count]['duplicates']} duplicates")
        self.r[f"pumps_{kind}"] = rows


def header(bench: Bench) -> dict:
    """Machine and versions, read from the machine, the servers and the libraries."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or platform.machine())
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem_kb = next((int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemTotal:")), 0)
    server = bench.admin._impl.server_properties  # what the broker says of itself on connecting
    version = server.get("version", "?")
    pg, settings = postgresql(bench.args.pg_url)
    return {"cpus": os.cpu_count(), "cpu_model": model, "ram_gib": round(mem_kb / 1024 / 1024, 1),
            "load_average_at_start": os.getloadavg()[0], "python": platform.python_version(),
            "postgresql": pg, "postgresql_settings": settings,
            "rabbitmq": version.decode() if isinstance(version, bytes) else version,
            "pika": pika.__version__, "psycopg": psycopg.__version__, "sqlalchemy": sqlalchemy.__version__,
            "platform": platform.platform()}


def report(r: dict, args) -> None:
    m, q = r["machine"], r["queues"]
    print(f"\n{m['cpus']} CPUs ({m['cpu_model']}), {m['ram_gib']} GiB RAM, load average "
          f"{m['load_average_at_start']:.1f} at start ({m.get('load_average_at_end', 0):.1f} at end); "
          f"Python {m['python']}, PostgreSQL {m['postgresql']} ({settings_text(m.get('postgresql_settings', {}))}), "
          f"RabbitMQ {m['rabbitmq']}, pika {m['pika']}, "
          f"psycopg {m['psycopg']}, SQLAlchemy {m['sqlalchemy']}")
    levels = sorted({v["type"] for name, v in q.items() if name.startswith("delay.level-")})
    endpoint = ", ".join(f"{a[0]}={a[2]}" for a in q[QUEUE]["arguments"])
    print(f"{r['messages']:,} messages of {r['body_bytes']} B, all due at one instant, persistent; pump batches of "
          f"{r['batch_size']:,}. Queue types as the broker lists them: "
          + ", ".join(f"`{name}` {q[name]['type']}" for name in ("raw.quorum", "raw.classic", "raw.endpoint", QUEUE))
          + f" (provisioned with {endpoint}); delay levels {'/'.join(levels)}\n")
    rq = r["raw_quorum"]
    rows = [  # (measure, key of its figure in r, ratio)
        (f"raw: pika, 1,000 confirms in flight -> `raw.quorum` ({q['raw.quorum']['type']})", "raw_quorum", "100%"),
        (f"raw: pika, 1,000 confirms in flight -> `raw.classic` ({q['raw.classic']['type']})", "raw_classic",
         f"{r['raw_classic'] / rq:.0%} of raw quorum"),
        (f"raw: pika, 1,000 confirms in flight -> `raw.endpoint` ({q['raw.endpoint']['type']}, the endpoint's "
         "arguments: delivery limit, dead-lettering at least once)", "raw_endpoint",
         f"{r['raw_endpoint'] / rq:.0%} of raw quorum"),
        ("raw: bare batched claim (DELETE ... RETURNING, 1,000 rows/txn)", "raw_claim", "100%"),
        (f"**pump -> RabbitMQ `{QUEUE}` ({q[QUEUE]['type']}, provisioned), no consumer**", "pump_rabbitmq",
         f"{paired(r, 'pump_rabbitmq')} of raw quorum (target >= 70%)"),
        (f"pump -> RabbitMQ `{QUEUE}`, consumer draining: pump rate", "pump_rabbitmq_consumed",
         f"{r['pump_rabbitmq_consumed'] / rq:.0%} of raw quorum"),
        (f"pump -> RabbitMQ `{QUEUE}`, consumer draining: all received (pump start to last arrival)",
         "consumer_rabbitmq", f"{r['consumer_rabbitmq'] / rq:.0%} of raw quorum"),
        ("**pump -> SQL-table queue (same database, exactly once)**", "pump_sql",
         f"{paired(r, 'pump_sql')} of bare claim (target >= 50%)"),
    ]
    print(f"Figures with rounds are the median of {len(r['raw_quorum_runs'])} rounds; each round measures the raw "
          "limit and then the pump, and a target's ratio is the median of the rounds' ratios (each round's in "
          "brackets).\n")
    print("| measure | msg/s | ratio | rounds |")
    print("|---|---:|---:|---|")
    for name, key, ratio in rows:
        each = " / ".join(f"{x:,.0f}" for x in r.get(f"{key}_runs", []))
        print(f"| {name} | {r[key]:,.0f} | {ratio} | {each} |")

    print(f"\n| pump processes on one store, {r['messages']:,} due | msg/s | vs 1 pump | duplicates | missing | "
          "peak RSS of a pump |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, label in (("sql", "SQL-table queue"), ("rabbitmq", "RabbitMQ (consumer counts)")):
        rows6 = r.get(f"pumps_{kind}") or {}
        one = rows6.get(1, {}).get("rate")
        for count, row in rows6.items():
            ratio = f"{row['rate'] / one:.2f}x" if one else ""
            print(f"| {count} -> {label} | {row['rate']:,.0f} | {ratio} | {row['duplicates']} | {row['missing']} | "
                  f"{row['pump_peak_rss_mb']:.0f} MB |")

    print(f"\n| {r['messages']:,} burst, pump asleep and woken by the store | first delivery after due, p50 of "
          f"{args.runs} run(s) | each run's first | all messages p50 / p99 (last run) | missing | early |")
    print("|---|---:|---|---:|---:|---:|")
    for kind, label in (("rabbitmq", "store -> pump -> RabbitMQ, basic_consume"),
                        ("sql", f"store -> pump -> SQL-table queue, receive polled every {args.poll_ms:g} ms")):
        lat = r.get(f"latency_{kind}")
        if not lat:
            continue
        last = lat["runs"][-1]
        firsts = ", ".join(f"{x['first_ms']:.1f}" for x in lat["runs"])
        print(f"| {label} | {lat['first_p50_ms']:.1f} ms (target <= 15 ms) | {firsts} ms | "
              f"{last['p50_ms']:.0f} / {last['p99_ms']:.0f} ms | {sum(x['missing'] for x in lat['runs'])} | "
              f"{sum(x['early'] for x in lat['runs'])} |")
    runs = (r.get("latency_sql") or {}).get("runs", [])
    enqueued = [x["first_enqueued_ms"] for x in runs if "first_enqueued_ms" in x]
    if enqueued:
        print(f"\nSQL-table queue: the pump inserted the first row {statistics.median(enqueued):.1f} ms after the due "
              "time (p50 of the runs, from the row's enqueued_at, on the database's clock); the rest is the commit "
              "and the consumer's poll.")


def history_report(r: dict) -> None:
    m = r["machine"]
    print(f"\n{m['cpus']} CPUs ({m['cpu_model']}), load average {m['load_average_at_start']:.1f} at start "
          f"({m.get('load_average_at_end', 0):.1f} at end); PostgreSQL {m['postgresql']} "
          f"({settings_text(m.get('postgresql_settings', {}))}), RabbitMQ {m['rabbitmq']}")
    print(f"{r['messages']:,} messages of {r['body_bytes']} B due at once, pump batches of {r['batch_size']:,}; "
          f"history on (7 days) and off (0) in alternation, {len(r['history_sql_on_runs'])} rounds.\n")
    print("| pump -> | history on, msg/s | history off, msg/s | on / off (target >= 0.90) | rounds' ratios |")
    print("|---|---:|---:|---:|---|")
    for kind, label in (("rabbitmq", "RabbitMQ quorum queue (the settlement inserts the entries)"),
                        ("sql", "SQL-table queue (the move's statement inserts them)")):
        each = " / ".join(f"{x:.2f}" for x in r[f"history_{kind}_ratio_runs"])
        print(f"| {label} | {r[f'history_{kind}_on']:,.0f} | {r[f'history_{kind}_off']:,.0f} | "
              f"{r[f'history_{kind}_ratio']:.2f} | {each} |")
    reads = r["history_reads_ms"]
    print(f"\nReads of the page on {r['history_rows']:,} entries (median of 3, ms): recent 50 "
          f"{reads['entries']:.1f}, chart of the last hour {reads['chart_1h']:.1f} (all destinations), "
          f"{reads['chart_1h_destination']:.1f} (one), a message's story {reads['story']:.1f}.")


def history_plot(r: dict, path: Path) -> None:
    """Each round's rate with the history on and off, per transport."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, (kind, label) in zip(axes, (("rabbitmq", "pump -> RabbitMQ"), ("sql", "pump -> SQL-table queue")),
                                 strict=True):
        on, off = r[f"history_{kind}_on_runs"], r[f"history_{kind}_off_runs"]
        rounds = range(1, len(on) + 1)
        ax.bar([x - 0.2 for x in rounds], off, 0.4, label="history off", color="0.6")
        ax.bar([x + 0.2 for x in rounds], on, 0.4, label="history on", color="tab:blue")
        ax.set_title(f"{label}: on/off {r[f'history_{kind}_ratio']:.2f}")
        ax.set_xlabel("round")
        ax.set_ylabel("messages / s")
        ax.set_xticks(list(rounds))
    axes[0].legend(loc="lower left")
    fig.suptitle(f"{r['messages']:,} due at once, history on and off in alternation")
    save_figure(fig, path)


def ab_plot(r: dict, path: Path) -> None:
    """--ab: each round's first insert and first delivery after T, and the drain rates, per side."""
    plt = pyplot()
    if plt is None:
        return
    sides = [("base", r["commit"], "0.6"), ("tree", "working tree", "tab:blue")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, (figure, label) in zip(axes, (("first_insert_ms", "pump's first insert after T (ms)"),
                                          ("first_delivery_ms", "first delivery after T (ms)"),
                                          ("drain_rate", "drain rate from T, delivered (msg/s)")), strict=True):
        for i, (side, name, color) in enumerate(sides):
            values = [run[figure] for run in r["runs"][side]]
            ax.bar([x + 1 + (i - 0.5) * 0.4 for x in range(len(values))], values, 0.4, label=name, color=color)
        if figure == "drain_rate" and r["runs"].get("graphile"):
            rates = [run["drain_rate"] for run in r["runs"]["graphile"]]
            ax.plot(range(1, len(rates) + 1), rates, "o--", color="tab:orange", label="graphile-worker, jobs run")
        ax.set_title(f"{label}\nratio of medians {r['ratios'][figure]:.2f}x", fontsize=9)
        ax.set_xlabel("round")
    axes[2].legend(loc="lower left", fontsize=8)
    fig.suptitle(f"{r['messages']:,} due at one instant T, {r['commit']} beside the working tree, in turns")
    save_figure(fig, path)


def paired(r: dict, pump: str) -> str:
    """The median of the rounds' pump/raw ratios (see Bench.paired_rounds), with each round's."""
    return f"{r[f'{pump}_ratio']:.0%} ({' / '.join(f'{x:.0%}' for x in r[f'{pump}_ratio_runs'])})"


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    bars = [("raw pika -> quorum", r["raw_quorum"], "raw"), ("raw pika -> classic", r["raw_classic"], "raw"),
            ("raw pika -> quorum, endpoint args", r["raw_endpoint"], "raw"),
            ("pump -> RabbitMQ quorum, no consumer", r["pump_rabbitmq"], "pump"),
            ("pump -> RabbitMQ quorum, consumer on", r["pump_rabbitmq_consumed"], "pump"),
            ("consumer received all", r["consumer_rabbitmq"], "consumer"),
            ("raw bare claim (PostgreSQL)", r["raw_claim"], "raw"), ("pump -> SQL-table queue", r["pump_sql"], "pump")]
    for kind, label in (("sql", "SQL queue"), ("rabbitmq", "RabbitMQ")):
        for count, row in (r.get(f"pumps_{kind}") or {}).items():
            bars.append((f"{count} pump process(es) -> {label}", row["rate"], "pump"))
    colors = {"raw": "0.6", "pump": "tab:blue", "consumer": "tab:green"}
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(bars) + 1))
    ax.barh(range(len(bars)), [b[1] for b in bars], color=[colors[b[2]] for b in bars])
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("messages / s")
    ax.set_title(f"{r['messages']:,} messages of {r['body_bytes']} B due at once (grey: raw limits)")
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    log(f"wrote {path}")


def interrupt(_signum, _frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so the finally blocks drop the schema and the vhost."""
    raise KeyboardInterrupt


def first_delivery_ab(args) -> None:
    """--ab: the burst's first delivery on an earlier commit and the working tree, in one run on one server."""
    signal.signal(signal.SIGTERM, interrupt)
    with pgserver.server(args):
        info = machine(args.pg_url)
        r = first_delivery.ab(args.pg_url, args.ab, args.ab_rounds, args.messages, args.ab_lead, args.poll_ms,
                              args.timeout, args.graphile)
        r["machine"] = {**info, "load_average_at_end": round(os.getloadavg()[0], 2)}
    print(describe(info) + f" (load average {r['machine']['load_average_at_end']} at end)\n")
    print(first_delivery.report(r))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"first_delivery_ab": r}, indent=2, default=str))
    log(f"wrote {args.json}")
    if args.plot:
        ab_plot(r, args.plot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="RabbitMQ host (rabbitmqctl must reach the same broker)")
    pgserver.add_arguments(parser)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5, help="latency runs per path")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds of raw limits and pumps, with and without a consumer (medians reported)")
    parser.add_argument("--pumps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4],
                        help="pump process counts for the several-pumps rows (default 1,2,4)")
    parser.add_argument("--multi-transports", default="sql,rabbitmq", help="transports of the several-pumps rows")
    parser.add_argument("--lead", type=float, default=3.0, help="seconds between storing a burst and its due time")
    parser.add_argument("--poll-ms", type=float, default=1.0, help="the SQL-queue consumer's pause between empty polls")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any one drain may take")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "throughput.json")
    parser.add_argument("--plot", type=Path, help="write a bar chart of the rates (needs matplotlib)")
    parser.add_argument("--ab", metavar="COMMIT", help="only the first delivery of a burst: COMMIT's package beside "
                        "the working tree's, in turns (see bench/first_delivery.py)")
    parser.add_argument("--ab-rounds", type=int, default=5, help="bursts of each side with --ab")
    parser.add_argument("--ab-lead", type=float, default=24.0, help="seconds a burst is stored ahead with --ab")
    parser.add_argument("--graphile", action="store_true", help="with --ab, graphile-worker's run of the same burst "
                        "in each round (bench/graphile, installed with npm ci)")
    parser.add_argument("--history-ab", type=int, metavar="ROUNDS", help="only the pump with the delivery history "
                        "on and off, in alternation, ROUNDS rounds into RabbitMQ and the SQL-table queue")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.ab:
        return first_delivery_ab(args)

    # A SIGTERM unwinds like Ctrl-C, so the schema and vhost are dropped either way.
    signal.signal(signal.SIGTERM, interrupt)
    with pgserver.server(args):
        bench = Bench(args)
        try:
            bench.setup()
            bench.r["machine"] = header(bench)
            if args.history_ab:
                bench.history_rounds(args.history_ab)
                bench.r["machine"]["load_average_at_end"] = os.getloadavg()[0]
                history_report(bench.r)
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(bench.r, indent=2, default=str))
                if args.plot:
                    history_plot(bench.r, args.plot)
                return
            bench.raw_limits()
            bench.paired_rounds()
            for kind in ("rabbitmq", "sql"):
                log(f"latency: {args.runs} run(s) of a {args.messages} burst through {kind}")
                bench.latency(kind)
            for kind in args.multi_transports.split(","):
                bench.many_pumps(kind.strip())
            bench.r["machine"]["load_average_at_end"] = os.getloadavg()[0]
        finally:
            bench.teardown()
        report(bench.r, args)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(bench.r, indent=2, default=str))
        log(f"wrote {args.json}")
        if args.plot:
            plot(bench.r, args.plot)


if __name__ == "__main__":
    main()
