"""Fault scenarios against the real services: pumps and relays killed, connections cut, backends terminated.

Each scenario returns a `FaultCounts` (messages, faults injected, delivered, lost, early, duplicates,
wall time), so the tests assert on them and bench/bench_faults.py prints them. Plain Python (no pytest).

- `pump_faults("rabbitmq", ...)`: a PostgreSQL store drained by two pump processes into RabbitMQ, both
  reached through TCP proxies; pumps are killed with SIGKILL (and started again), the proxies cut every
  RabbitMQ and every PostgreSQL connection (and refuse new ones for a moment), and the pumps' backends
  are terminated with pg_terminate_backend. At least once: duplicates bounded by the batches in flight.
- `pump_faults("sql", ...)`: the same faults (no broker) with a SQL-table queue in the store's database:
  exactly once.
- `sqs_relay_faults(...)`: long delays through an SQS `-delay.fifo` relay (moto's server) whose process
  is killed mid-cycle, between handing messages on and deleting them.

A message is early when a consumer in this process receives it before the due time written in its
body (microseconds, on this host's clock, which is also the database's and the brokers' here).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

from tests.faults.proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
PG_URL = os.environ.get("DELAY_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
RABBIT_PORT = 5672
log = logging.getLogger("tests.faults")


class ServiceUnavailable(RuntimeError):
    """A service the scenarios need is not running; the message says how to start it."""


def check_postgres(url: str = PG_URL) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    try:
        engine = create_engine(url, poolclass=NullPool)
        with engine.connect() as conn:
            conn.execute(text("select 1"))
        engine.dispose()
    except Exception as exc:
        raise ServiceUnavailable(
            f"PostgreSQL is not reachable at {url.split('@')[-1]} ({type(exc).__name__}). Start it with "
            "`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` (trust auth, database "
            "`test`), or point DELAY_TEST_PG_URL at another one."
        ) from None


def check_rabbitmq() -> None:
    import pika

    try:
        pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", RABBIT_PORT, connection_attempts=1)).close()
    except Exception as exc:
        raise ServiceUnavailable(
            f"RabbitMQ is not reachable at 127.0.0.1:{RABBIT_PORT} ({type(exc).__name__}). Start it with "
            "`rabbitmq-server -detached` (user guest/guest)."
        ) from None


@dataclass
class FaultCounts:
    scenario: str
    messages: int
    kills: int = 0
    cuts: int = 0  # proxy cuts of every open connection (RabbitMQ and PostgreSQL), outages included
    terminations: int = 0  # pg_terminate_backend of the pumps' backends
    outages: int = 0  # cuts followed by refusing new connections for a moment
    delivered: int = 0  # distinct messages received
    lost: int = 0
    early: int = 0
    duplicates: int = 0  # deliveries beyond the first of a message
    duplicate_bound: int = 0  # what at-least-once allows for these faults
    left_in_store: int = 0
    dead_lettered: int = 0
    unexpected: int = 0  # deliveries of ids never sent
    wall_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # pumps or relays that died by themselves
    notes: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"{self.scenario}: {self.messages} messages, {self.kills} kills, {self.cuts} cuts "
                f"({self.outages} with refusals), {self.terminations} terminations -> delivered {self.delivered}, "
                f"lost {self.lost}, early {self.early}, duplicates {self.duplicates} (bound {self.duplicate_bound}), "
                f"left in store {self.left_in_store}, dead-lettered {self.dead_lettered}, "
                f"{self.wall_seconds:.1f} s; errors: {self.errors or 'none'}; {json.dumps(self.notes, default=str)}")


COLUMNS = ("scenario", "messages", "kills", "cuts", "terminations", "delivered", "lost", "early", "duplicates",
           "duplicate_bound", "wall_seconds")


def markdown_table(results: list[FaultCounts]) -> str:
    head = ["scenario", "messages", "kills (-9)", "connection cuts", "pg_terminate_backend", "delivered", "lost",
            "early", "duplicates", "at-least-once bound", "wall time"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in results:
        cells = [r.scenario, f"{r.messages:,}", r.kills,
                 f"{r.cuts} ({r.outages} with refusals)" if r.outages else r.cuts,
                 f"{r.terminations} ({r.notes.get('backends_terminated', 0)} backends)" if r.terminations else 0,
                 f"{r.delivered:,}", r.lost, r.early, r.duplicates, r.duplicate_bound,
                 f"{r.wall_seconds:.0f} s"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


# -- processes ------------------------------------------------------------------------------------------
class Workers:
    """Worker processes (tests/faults/worker.py) in numbered slots: started, killed, started again, reaped."""

    def __init__(self, kind: str, spec: dict, logdir: Path, pipe_stdout: bool = False) -> None:
        self.kind, self.spec, self.logdir, self.pipe_stdout = kind, spec, logdir, pipe_stdout
        self.procs: dict[int, subprocess.Popen] = {}
        self.started = 0
        self.killed = 0
        self.results: list[dict] = []
        self.errors: list[str] = []
        self._files: dict[int, tuple[Path, Path]] = {}

    def start(self, slot: int) -> subprocess.Popen:
        self.started += 1
        out = self.logdir / f"{self.kind}-{self.started}.out"
        err = self.logdir / f"{self.kind}-{self.started}.err"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(err, "wb") as err_file:
            if self.pipe_stdout:
                proc = subprocess.Popen([sys.executable, str(WORKER), self.kind, json.dumps(self.spec)], cwd=ROOT,
                                        env=env, stdout=subprocess.PIPE, stderr=err_file, text=True, bufsize=1)
            else:
                with open(out, "wb") as out_file:
                    proc = subprocess.Popen([sys.executable, str(WORKER), self.kind, json.dumps(self.spec)], cwd=ROOT,
                                            env=env, stdout=out_file, stderr=err_file)
        self.procs[slot] = proc
        self._files[proc.pid] = (out, err)
        return proc

    def kill(self, slot: int) -> None:
        proc = self.procs.pop(slot)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            self.killed += 1
        proc.wait(10)
        self._reap(proc, killed=True)

    def alive(self) -> list[int]:
        """Slots whose process still runs; those that ended by themselves are reaped (result or error)."""
        for slot, proc in list(self.procs.items()):
            if proc.poll() is not None:
                del self.procs[slot]
                self._reap(proc, killed=False)
        return sorted(self.procs)

    def _reap(self, proc: subprocess.Popen, killed: bool) -> None:
        out, err = self._files.pop(proc.pid)
        if killed:
            return
        lines = out.read_text().splitlines() if out.exists() else []
        if proc.returncode == 0 and lines:
            self.results.append(json.loads(lines[-1]))
        else:
            tail = err.read_text()[-3000:] if err.exists() else ""
            self.errors.append(f"{self.kind} pid {proc.pid} exited with code {proc.returncode}: {tail}")

    def stop_all(self) -> None:
        for slot in list(self.procs):
            proc = self.procs.pop(slot)
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def _pg_url_through(url: str, port: int, application_name: str) -> str:
    from sqlalchemy.engine import make_url

    through = make_url(url).set(host="127.0.0.1", port=port).update_query_dict({"application_name": application_name})
    return through.render_as_string(hide_password=False)


def _terminate_backends(engine, application_name: str, patience: float = 5.0) -> int:
    """pg_terminate_backend of every backend of `application_name`; waits up to `patience` seconds for
    one to exist (right after another fault the pumps may be between connections)."""
    from sqlalchemy import text

    deadline = time.monotonic() + patience
    while True:
        with engine.connect() as conn:
            n = conn.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                  "WHERE application_name = :app AND pid <> pg_backend_pid()"),
                             {"app": application_name}).scalar()
        if n or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


# -- consumers -----------------------------------------------------------------------------------------
class Received:
    """Every delivery a consumer saw: (message id, receipt time in µs on this host's clock, body)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int, bytes]] = []
        self.ids: set[str] = set()
        self.last_at = time.monotonic()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def add(self, message_id: str, receipt_us: int, body: bytes) -> None:
        self.records.append((message_id, receipt_us, body))
        self.ids.add(message_id)
        self.last_at = time.monotonic()


def _now_us() -> int:
    from airflow_delay_provider.core.delays import utcnow
    from airflow_delay_provider.stores.sql import to_us

    return to_us(utcnow())


def _consume_rabbitmq(vhost: str, queue: str, received: Received) -> None:
    import pika

    try:
        params = pika.ConnectionParameters("127.0.0.1", RABBIT_PORT, vhost, pika.PlainCredentials("guest", "guest"))
        connection = pika.BlockingConnection(params)
        channel = connection.channel()

        def on_message(_ch, _method, properties, body):
            received.add(properties.message_id, _now_us(), body)

        channel.basic_consume(queue, on_message, auto_ack=True)
        while not received.stop.is_set():
            connection.process_data_events(time_limit=0.05)
        connection.close()
    except BaseException as exc:  # reported by the scenario
        received.error = exc


def _receive_until_stopped(transport, queue: str, received: Received, max_messages: int,
                           visibility_timeout: float, idle: float) -> None:
    """Receive and ack until the scenario stops the consumer, recording each receipt time."""
    try:
        while not received.stop.is_set():
            batch = transport.receive(queue, max_messages=max_messages, visibility_timeout=visibility_timeout)
            at = _now_us()  # after the receive: everything it returned had been sent by then
            for m in batch:
                received.add(m.message_id, at, m.body)
            if batch:
                transport.ack(queue, [m.receipt for m in batch])
            else:
                time.sleep(idle)
    except BaseException as exc:
        received.error = exc


def _consume_sql(url: str, schema: str, prefix: str, queue: str, received: Received) -> None:
    from airflow_delay_provider.transports.sql import SqlTableTransport

    try:
        transport = SqlTableTransport(url, schema=schema, table_prefix=prefix)
    except BaseException as exc:
        received.error = exc
        return
    _receive_until_stopped(transport, queue, received, max_messages=1000, visibility_timeout=300, idle=0.01)


def _tally(counts: FaultCounts, received: Received, expected: set[str]) -> None:
    """Delivered, lost, duplicates and early deliveries from what the consumer saw."""
    per_id = Counter(mid for mid, _, _ in received.records)
    counts.unexpected = sum(n for mid, n in per_id.items() if mid not in expected)
    counts.delivered = len(expected & set(per_id))
    counts.lost = len(expected) - counts.delivered
    counts.duplicates = sum(n - 1 for mid, n in per_id.items() if mid in expected)
    earliest = 0
    for _mid, at, body in received.records:
        due_us = int(body.split()[1])
        if at < due_us:
            counts.early += 1
            earliest = max(earliest, due_us - at)
    if counts.early:
        counts.notes["earliest_ms"] = round(earliest / 1000, 3)
    if received.error is not None:
        counts.errors.append(f"the consumer failed: {type(received.error).__name__}: {received.error}")


def _wait(condition: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


# -- pumps under fire ------------------------------------------------------------------------------------
#: Seconds from storing the messages to the first due time of the spread (the pumps start meanwhile).
LEAD_SECONDS = 2.0
RABBITMQ_PLAN = ("kill", "rabbit_cut", "pg_cut", "terminate", "kill", "rabbit_outage", "pg_cut", "rabbit_cut",
                 "kill", "pg_outage", "terminate", "rabbit_cut", "pg_cut")
SQL_PLAN = ("kill", "pg_cut", "terminate", "kill", "pg_cut", "pg_outage", "kill", "pg_cut", "terminate", "pg_cut")


def pump_faults(
    transport: str,
    schema: str,
    vhost: str | None = None,
    pg_url: str = PG_URL,
    messages: int = 20_000,
    pumps: int = 2,
    batch_size: int = 500,
    due_now: float = 0.3,
    spread: float = 12.0,
    plan: tuple[str, ...] | None = None,
    min_gap: float = 0.5,
    outage_seconds: float = 1.5,
    timeout: float = 150.0,
    seed: int = 7,
) -> FaultCounts:
    """Messages in a PostgreSQL store (`schema`, a table of their own), `due_now` of them due already, the
    rest over the next `spread` seconds, drained by `pumps` pump processes into `transport` ("rabbitmq",
    in `vhost`, or "sql": a queue table in the same schema) while the faults of `plan` hit them, spread
    evenly over the due times (so messages are due and flowing at each fault)."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    from airflow_delay_provider.core.message import DelayedMessage
    from airflow_delay_provider.stores.sql import SqlDelayedMessageStore, from_us, to_us

    if transport not in ("rabbitmq", "sql"):
        raise ValueError(f"transport must be rabbitmq or sql, got {transport!r}")
    if transport == "rabbitmq" and not vhost:
        raise ValueError("the rabbitmq scenario needs a vhost of its own")
    if plan is None:
        plan = RABBITMQ_PLAN if transport == "rabbitmq" else SQL_PLAN
    started = time.monotonic()
    run = uuid.uuid4().hex[:8]
    table = f"f_{run}"
    prefix = f"{table}_" if transport == "sql" else f"f{run}"
    app = f"adp_fault_{run}"
    counts = FaultCounts(f"store -> {'RabbitMQ' if transport == 'rabbitmq' else 'SQL table (same database)'}, "
                         f"{pumps} pumps", messages)
    store = SqlDelayedMessageStore(pg_url, table=table, schema=schema)
    store.create_schema()
    admin = create_engine(pg_url, poolclass=NullPool)
    direct = None
    received = Received()
    consumer = None
    logdir = Path(tempfile.mkdtemp(prefix="adp-faults-"))
    workers: Workers | None = None
    proxies: list[TcpProxy] = []
    try:
        # The messages: some due already, the rest over the spread; the due time travels in the body.
        rng = random.Random(seed)
        now = store.clock()
        flow_start = time.monotonic() + LEAD_SECONDS  # when the spread of due times begins
        batch = []
        for i in range(messages):
            if i < messages * due_now:
                due = now - timedelta(seconds=1)
            else:
                due = now + timedelta(seconds=LEAD_SECONDS + spread * rng.random())
            due = from_us(to_us(due))
            batch.append(DelayedMessage("orders", f"{i} {to_us(due)}".encode(), due, {"i": str(i)}, f"{run}-{i}"))
        for i in range(0, messages, 5000):
            store.store(batch[i:i + 5000])
        expected = {m.message_id for m in batch}
        del batch

        pg_proxy = TcpProxy(store.url.port or 5432, store.url.host or "127.0.0.1", name="postgresql")
        proxies.append(pg_proxy)
        through = _pg_url_through(pg_url, pg_proxy.port, app)
        spec = {"store_url": through, "schema": schema, "table": table, "transport": transport, "prefix": prefix,
                "batch_size": batch_size}
        if transport == "rabbitmq":
            import pika

            from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport

            amqp_proxy = TcpProxy(RABBIT_PORT, name="rabbitmq")
            proxies.append(amqp_proxy)
            spec.update(amqp_port=amqp_proxy.port, vhost=vhost)
            params = pika.ConnectionParameters("127.0.0.1", RABBIT_PORT, vhost, pika.PlainCredentials("guest", "guest"))
            direct = RabbitMQTransport(params, prefix=prefix)
            direct.provision("orders")
            direct.provision("error")
            consumer = threading.Thread(target=_consume_rabbitmq, args=(vhost, "orders", received), daemon=True)
        else:
            from airflow_delay_provider.transports.sql import SqlTableTransport

            direct = SqlTableTransport(pg_url, schema=schema, table_prefix=prefix)
            direct.provision("orders")
            direct.provision("error")
            consumer = threading.Thread(target=_consume_sql, args=(pg_url, schema, prefix, "orders", received),
                                        daemon=True)
        consumer.start()
        workers = Workers("pump", spec, logdir)
        for slot in range(pumps):
            workers.start(slot)
        deadline = started + timeout

        # The faults, spread over the due times, once messages arrive (the pumps are mid-flow).
        rabbit_cuts = pg_cuts = 0
        connections_cut = 0
        after_drain = 0
        last_fault = 0.0
        ok = _wait(lambda: len(received.ids) >= messages * 0.02 or time.monotonic() > deadline, timeout)
        if not ok or time.monotonic() > deadline:
            counts.errors.append("no message arrived before the first fault")
            plan = ()
        for j, fault in enumerate(plan):
            at = max(flow_start + spread * (j + 0.5) / len(plan), last_fault + min_gap)
            time.sleep(max(0.0, at - time.monotonic()))
            if time.monotonic() > deadline:
                counts.errors.append(f"the faults were not done after {timeout:.0f} s")
                break
            _keep_running(workers, pumps)
            if not sum(store.count_scheduled().values()):
                after_drain += 1  # nothing left to dispatch: this one does not count as "while they flow"
            if fault == "kill":
                slot = counts.kills % pumps
                if slot in workers.procs:
                    workers.kill(slot)
                    counts.kills += 1
                workers.start(slot)
            elif fault in ("rabbit_cut", "rabbit_outage"):
                if fault == "rabbit_outage":
                    amqp_proxy.refuse_for(outage_seconds)
                    counts.outages += 1
                connections_cut += _cut(amqp_proxy)
                rabbit_cuts += 1
            elif fault in ("pg_cut", "pg_outage"):
                if fault == "pg_outage":
                    pg_proxy.refuse_for(outage_seconds)
                    counts.outages += 1
                connections_cut += _cut(pg_proxy)
                pg_cuts += 1
            elif fault == "terminate":
                counts.notes["backends_terminated"] = (counts.notes.get("backends_terminated", 0)
                                                       + _terminate_backends(admin, app))
                counts.terminations += 1
            else:
                raise ValueError(f"unknown fault {fault!r}")
            last_fault = time.monotonic()
            log.info("fault %d %s at %d delivered", j, fault, len(received.ids))
        counts.cuts = rabbit_cuts + pg_cuts
        counts.notes.update(rabbit_cuts=rabbit_cuts, pg_cuts=pg_cuts, connections_cut=connections_cut,
                            faults_after_drain=after_drain)

        # The pumps drain the store and exit; one that ended by itself is reported and replaced while
        # messages are left, so the counts below still say what was delivered.
        while time.monotonic() < deadline:
            if not workers.alive():
                if not sum(store.count_scheduled().values()):
                    break
                workers.start(0)
            time.sleep(0.1)
        else:
            counts.errors.append(f"the pumps were still running after {timeout:.0f} s")

        # Everything still travelling (the broker's 1 s delay level, say) arrives, then a quiet moment.
        def settled() -> bool:
            if len(received.ids & expected) < messages:
                return False
            if transport == "rabbitmq":
                queues = ["orders"] + [direct.names.level(n) for n in range(3)]
                if any(direct.depth(q)["visible"] for q in queues):
                    return False
            elif sum(direct.depth("orders").values()):
                return False
            return time.monotonic() - received.last_at > 1.0

        _wait(settled, max(5.0, deadline - time.monotonic()), step=0.1)
        received.stop.set()
        consumer.join(10)
        _tally(counts, received, expected)
        counts.left_in_store = sum(store.count_scheduled().values())
        counts.dead_lettered = sum(direct.depth("error").values())
        counts.errors.extend(workers.errors)
        stats = workers.results
        if transport == "rabbitmq":
            # At least once: a kill catches the batches one pump has in flight (two: it pipelines), a cut or a
            # termination those of every pump. The SQL table joins the claim's transaction: exactly once.
            counts.duplicate_bound = batch_size * 2 * (counts.kills + pumps * (counts.cuts + counts.terminations))
        counts.notes.update(
            pump_processes=workers.started,
            pump_exits=dict(Counter(r.get("reason") for r in stats)),
            released=sum(r.get("released", 0) for r in stats),
            exactly_once=sorted({r.get("exactly_once") for r in stats}),
            pipelined=sorted({r.get("pipelined") for r in stats}),
            proxied_connections=sum(p.accepted for p in proxies),
            refused_connections=sum(p.refused for p in proxies),
        )
    finally:
        received.stop.set()
        if workers is not None:
            workers.stop_all()
        if consumer is not None:
            consumer.join(10)
        for proxy in proxies:
            proxy.close()
        _discard(logdir, counts)
        if direct is not None and hasattr(direct, "close"):
            direct.close()
        store.close()
        admin.dispose()
        counts.wall_seconds = round(time.monotonic() - started, 1)
    return counts


def _cut(proxy: TcpProxy, patience: float = 5.0) -> int:
    """Cut every connection through the proxy, once there is one (right after another fault the pumps
    may be waiting out their breakers, connected to nothing); returns how many were cut."""
    _wait(lambda: proxy.open_connections() > 0, patience)
    return proxy.cut()


def _discard(logdir: Path, counts: FaultCounts) -> None:
    """The workers' output is kept only when something failed (the errors quote it anyway)."""
    if counts.errors:
        counts.notes["worker_logs"] = str(logdir)
    else:
        shutil.rmtree(logdir, ignore_errors=True)


def _keep_running(workers: Workers, pumps: int) -> None:
    """Before each fault: every slot has a process (one that ended by itself is reported and replaced)."""
    alive = workers.alive()
    for slot in range(pumps):
        if slot not in alive:
            workers.start(slot)


# -- the SQS relay killed mid-cycle ---------------------------------------------------------------------
def sqs_relay_faults(
    moto_url: str,
    messages: int = 200,
    queue_delay: int = 1,
    min_delay: float = 4.0,
    max_delay: float = 9.0,
    due_now: float = 0.1,
    kills: int = 4,
    visibility_timeout: int = 2,
    pause: float = 0.3,
    timeout: float = 120.0,
    seed: int = 11,
) -> FaultCounts:
    """Messages delayed `min_delay`..`max_delay` s through a relay with a queue-level delay of `queue_delay`
    (so most go round the `-delay.fifo` queue several times); the relay process is killed `kills` times,
    all but the last right after it handed a receive on and before it deleted the originals."""
    import boto3

    from airflow_delay_provider.core.delays import utcnow
    from airflow_delay_provider.core.message import DelayedMessage
    from airflow_delay_provider.stores.sql import from_us, to_us
    from airflow_delay_provider.transports.sqs import SqsTransport

    started = time.monotonic()
    run = uuid.uuid4().hex[:8]
    endpoint = f"f{run}"
    counts = FaultCounts("SQS relay (moto), long delays", messages)
    logdir = Path(tempfile.mkdtemp(prefix="adp-faults-"))

    def client():
        return boto3.client("sqs", endpoint_url=moto_url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    transport = SqsTransport(client(), queue_delay=queue_delay)
    transport.provision(endpoint)
    received = Received()

    def consume() -> None:
        reader = SqsTransport(client(), queue_delay=queue_delay)
        _receive_until_stopped(reader, endpoint, received, max_messages=10, visibility_timeout=60, idle=0.1)

    pause_file = logdir / "pause"
    spec = {"endpoint_url": moto_url, "endpoint": endpoint, "queue_delay": queue_delay,
            "visibility_timeout": visibility_timeout, "pause": pause, "pause_file": str(pause_file)}
    workers = Workers("relay", spec, logdir, pipe_stdout=True)
    consumer = threading.Thread(target=consume, daemon=True)
    lines: list[tuple[int, str]] = []  # (pid, line) from every relay process
    readers: dict[int, threading.Thread] = {}

    def start_relay() -> subprocess.Popen:
        proc = workers.start(0)

        def read(proc=proc) -> None:
            with proc.stdout:
                for line in proc.stdout:
                    lines.append((proc.pid, line.strip()))

        readers[proc.pid] = threading.Thread(target=read, daemon=True)
        readers[proc.pid].start()
        return proc

    def marks(pid: int) -> list[str]:
        return [line for p, line in lines if p == pid]

    try:
        rng = random.Random(seed)
        consumer.start()
        proc = start_relay()  # already relaying while the rest is sent
        # Ten at a time (one SQS batch), each due time taken just before its send: moto takes FIFO sends
        # slowly, and a message that waited for its turn would otherwise be due before it is sent.
        expected = set()
        failures = {}
        for first in range(0, messages, 10):
            now = utcnow()
            chunk = []
            for i in range(first, min(first + 10, messages)):
                due = now if i < messages * due_now else now + timedelta(seconds=rng.uniform(min_delay, max_delay))
                due = from_us(to_us(due))
                chunk.append(DelayedMessage(endpoint, f"{i} {to_us(due)}".encode(), due, {"i": str(i)}, f"{run}-{i}"))
            expected.update(m.message_id for m in chunk)
            failures.update(transport.send(chunk))
        log.info("sent %d messages in %.1f s", messages, time.monotonic() - started)
        if failures:
            counts.errors.append(f"{len(failures)} sends failed: {next(iter(failures.values()))}")
        deadline = started + timeout
        mid_cycle = 0
        for k in range(kills):
            if k < kills - 1:
                # Right after a receive was handed on (sent back or to the destination), before its delete.
                seen = len(marks(proc.pid))
                pause_file.touch()
                ok = _wait(lambda proc=proc, seen=seen: any(m.startswith("handled") for m in marks(proc.pid)[seen:])
                           or time.monotonic() > deadline or proc.poll() is not None, timeout)
                if not ok or proc.poll() is not None or time.monotonic() > deadline:
                    counts.errors.append(f"relay made no progress before kill {k}")
                    break
            else:
                time.sleep(0.7)  # and once wherever it happens to be
            pid = proc.pid
            workers.kill(0)
            pause_file.unlink(missing_ok=True)
            counts.kills += 1
            readers[pid].join(5)  # everything it printed before it died
            after = marks(pid)
            if after and after[-1].startswith("handled"):
                mid_cycle += 1
            proc = start_relay()
            time.sleep(1.0)
        counts.notes["killed_between_send_and_delete"] = mid_cycle
        log.info("%d kills done at %.1f s, %d delivered", counts.kills, time.monotonic() - started, len(received.ids))

        def settled() -> bool:
            if len(received.ids & expected) < messages:
                return False
            if sum(transport.lifecycle(endpoint, delay_queue=True).values()) \
                    or sum(transport.lifecycle(endpoint).values()):
                return False
            return time.monotonic() - received.last_at > 1.0

        if not _wait(settled, max(5.0, deadline - time.monotonic()), step=0.2):
            counts.errors.append(f"not settled after {timeout:.0f} s")
        workers.alive()
        received.stop.set()
        consumer.join(10)
        _tally(counts, received, expected)
        counts.errors.extend(workers.errors)
        counts.duplicate_bound = 10 * counts.kills  # one receive (at most 10 messages) in the relay's hands
        counts.notes["relay_processes"] = workers.started
        tallies = [line.split()[1:] for _pid, line in lines if line.startswith("counts ")]
        counts.notes["relayed_back"] = sum(int(t[0]) for t in tallies)  # another cycle in the delay queue
        counts.notes["handed_over"] = sum(int(t[1]) for t in tallies)
        counts.notes["relay_send_failures"] = sum(int(t[2]) for t in tallies)
    finally:
        received.stop.set()
        workers.stop_all()
        if consumer.is_alive():
            consumer.join(10)
        _discard(logdir, counts)
        counts.wall_seconds = round(time.monotonic() - started, 1)
    return counts
