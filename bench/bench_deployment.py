"""Benchmark: lateness of delayed messages in a real Airflow deployment, and the worker slots it holds.

Starts the deployment rig (api-server, scheduler, dag-processor and triggerer as separate processes with
homes of their own, LocalExecutor, a PostgreSQL metadata database), one continuous dispatcher DAG per
path (deferrable: the pump runs in the triggerer), and measures, per path, how late messages arrive
after their due time: single messages due 2, 15, 90 and 300 s after sending, and a burst due at one
instant. Paths: store -> SQL-table queue, store -> RabbitMQ, RabbitMQ's native delay levels (no Airflow
involved: the broker's figure), store -> SQS (moto's server, which accepts only a few hundred messages
a second, so its burst is smaller), and delayed DAG runs: store -> asset watcher -> asset event -> DAG run,
measured from the due time to the run being created (messages of one delay due 4 s apart, so each gets a
run of its own). Also: the seconds a worker slot is held per minute of waiting, and the same demo under
`airflow dags test` (triggers in line, one process) for comparison.

    python bench/bench_deployment.py            # all delays (about 7 minutes)
    python bench/bench_deployment.py --quick    # 2 s and 15 s only, smaller bursts
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402
import pika  # noqa: E402

from airflow_delay_provider.core.delays import utcnow  # noqa: E402
from airflow_delay_provider.core.message import DelayedMessage  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore  # noqa: E402
from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport  # noqa: E402
from airflow_delay_provider.transports.sql import SqlTableTransport  # noqa: E402
from airflow_delay_provider.transports.sqs import ATTR_MESSAGE_ID, SqsTransport  # noqa: E402
from tests.deployment.rig import Deployment  # noqa: E402
from tests.helpers import store_connection  # noqa: E402
from tests.services import MotoServer  # noqa: E402

PG_URL = os.environ.get("DELAY_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
BODY = b"x" * 200
#: One continuous dispatcher per path, each serving only its own destinations.
DISPATCHERS = {
    "sql": ("bsql.", "sql", None),
    "rabbitmq": ("brmq.", "rabbitmq", "rabbitmq_default"),
    "sqs": ("bsqs-", "sqs", "aws_default"),
}
DAG_TEMPLATE = '''
from airflow.sdk import DAG, Param
from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator

with DAG(dag_id="bench_dispatch_{kind}", schedule=None, catchup=False,
         params={{"seconds": Param(600, type="integer")}}) as dag:
    DispatchDueMessagesOperator(task_id="dispatch", deferrable=True, max_runtime="{{{{ params.seconds }}}}",
                                destination_prefix="{prefix}", transport="{transport}",
                                transport_conn_id={conn!r})
'''


#: The target of delayed DAG runs: one run per due message of airflow.asset.delayed_dag_run.bench_dag_run.
TARGET_DAG = '''
import itertools
from airflow.sdk import DAG, task
from airflow_delay_provider.triggers.asset import dag_run_asset, message_payloads

with DAG(dag_id="bench_dag_run", schedule=dag_run_asset("bench_dag_run"), catchup=False) as dag:
    @task
    def handle(triggering_asset_events=None):
        return message_payloads(itertools.chain(*triggering_asset_events.values()))

    handle()
'''
DAG_RUN_DEST = "airflow.asset.delayed_dag_run.bench_dag_run"
DAG_RUN_LABEL = "store -> DAG run (asset event)"
#: Delayed runs of one delay are due this far apart: each more than a scheduler loop after the last.
DAG_RUN_STAGGER = 4


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rabbitmqctl(*args: str) -> str:
    return subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, text=True, timeout=60).stdout


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


class Arrivals:
    """Arrival times by message id, recorded by consumer threads, one per destination."""

    def __init__(self) -> None:
        self.at: dict[str, list] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def record(self, path: str, message_id: str, when) -> None:
        with self.lock:
            self.at.setdefault(message_id, []).append((path, when))


def consume_sql(queues: SqlTableTransport, queue: str, arrivals: Arrivals) -> None:
    while not arrivals.stop.is_set():
        batch = queues.receive(queue, max_messages=1000)
        for m in batch:  # enqueued_at: the dispatcher's insert, in its transaction
            arrivals.record("store -> SQL table", m.message_id, m.enqueued_at)
        if batch:
            queues.ack(queue, [m.receipt for m in batch])
        else:
            time.sleep(0.01)


def consume_rabbitmq(params: pika.ConnectionParameters, queue: str, path: str, arrivals: Arrivals) -> None:
    connection = pika.BlockingConnection(params)
    channel = connection.channel()
    channel.basic_qos(prefetch_count=1000)

    def on_message(ch, method, properties, _body):
        arrivals.record(path, properties.message_id, utcnow())
        ch.basic_ack(method.delivery_tag)

    channel.basic_consume(queue, on_message)
    while not arrivals.stop.is_set():
        connection.process_data_events(time_limit=0.2)
    connection.close()


def consume_sqs(client, url: str, arrivals: Arrivals) -> None:
    while not arrivals.stop.is_set():
        got = client.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                                     MessageAttributeNames=["All"], AttributeNames=["SentTimestamp"])
        messages = got.get("Messages", [])
        for m in messages:  # SentTimestamp: when SQS accepted the dispatcher's send (ms)
            sent = datetime.fromtimestamp(int(m["Attributes"]["SentTimestamp"]) / 1000, UTC)
            arrivals.record("store -> SQS (moto)", m["MessageAttributes"][ATTR_MESSAGE_ID]["StringValue"], sent)
        if messages:
            client.delete_message_batch(QueueUrl=url, Entries=[
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])


class SlotWatch:
    """Seconds the dispatcher tasks hold a worker slot (state `running`), sampled every 0.25 s."""

    def __init__(self, airflow: Deployment, runs: dict[str, str]) -> None:
        self.airflow, self.runs = airflow, runs
        self.running = 0.0
        self.watched = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        last = time.monotonic()
        while not self.stop.is_set():
            time.sleep(0.25)
            now = time.monotonic()
            try:
                states = [self.airflow.task_instance(f"bench_dispatch_{k}", r, "dispatch")["state"]
                          for k, r in self.runs.items()]
            except Exception:  # noqa: BLE001 - a missed sample
                last = now
                continue
            self.running += (now - last) * sum(s == "running" for s in states)
            self.watched += (now - last) * len(states)
            last = now


def dag_run_rows(airflow: Deployment, due: dict[str, datetime], delays, wait: float) -> tuple[list[dict], dict]:
    """Lateness from a delayed run's due time to its DAG run being created (the run's queued_at) and to its
    event being recorded (run_after: when the asset event queued the run), per delay."""
    from tests.deployment.rig import parse_time

    deadline = time.monotonic() + wait
    runs: list[dict] = []
    handled: dict[str, list[dict]] = {}
    while True:
        runs = [r for r in airflow.dag_runs("bench_dag_run", run_type="asset_triggered")
                if r["state"] in ("success", "failed")]
        handled = {}
        for run in runs:
            payloads = airflow.xcom("bench_dag_run", run["dag_run_id"], "handle") if run["state"] == "success" else []
            for p in payloads or []:
                handled.setdefault(p["message_id"], []).append(run)
        if set(due) <= set(handled) or time.monotonic() > deadline:
            break
        time.sleep(2)
    rows = []
    for d in delays:
        ids = [m for m in due if f"-d{d}-" in m]
        created = [(parse_time(handled[m][0]["queued_at"]) - due[m]).total_seconds() for m in ids if m in handled]
        recorded = [(parse_time(handled[m][0]["run_after"]) - due[m]).total_seconds() for m in ids if m in handled]
        twice = sum(len(handled[m]) > 1 for m in ids if m in handled)
        rows.append({"path": DAG_RUN_LABEL, "messages": f"due in {d} s", "n": len(ids), "delivered": len(created),
                     "early": sum(x < 0 for x in created), "twice": twice,
                     "first_ms": round(1000 * min(created), 1) if created else None,
                     "p50_ms": round(1000 * statistics.median(created), 1) if created else None,
                     "p99_ms": round(1000 * pct(created, 99), 1) if created else None,
                     "max_ms": round(1000 * max(created), 1) if created else None,
                     "event_recorded_p50_ms": round(1000 * statistics.median(recorded), 1) if recorded else None})
    several = sum(1 for r in runs if sum(r in v for v in handled.values()) > 1)
    summary: dict = {"runs": len(runs), "runs_with_several_messages": several}
    # The first due after the watcher started, apart: what the triggerer does only once (its first request to
    # the API, imports) shows there and nowhere else.
    first = min(due, key=lambda m: due[m])
    if first in handled:
        summary["first_run"] = {
            "message_id": first,
            "created_ms": round(1000 * (parse_time(handled[first][0]["queued_at"]) - due[first]).total_seconds(), 1),
            "recorded_ms": round(1000 * (parse_time(handled[first][0]["run_after"]) - due[first]).total_seconds(), 1)}
    every = [(parse_time(handled[m][0]["queued_at"]) - due[m]).total_seconds() for m in due if m in handled]
    if every:
        summary["p99_ms_all_runs"] = round(1000 * pct(every, 99), 1)
    return rows, summary


def dags_test_figure(tmp: Path) -> dict:
    """The demo under `airflow dags test` (triggers run in line): the figure `make demo` prints."""
    env = {**os.environ, "AIRFLOW_HOME": str(tmp / "dags-test")}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py")], env=env, capture_output=True, text=True,
                         timeout=600)
    figures = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].startswith("lateness_"):
            figures[parts[0]] = float(parts[1])
    return figures


def airflow_settings(parser: argparse.ArgumentParser, given: list[str]) -> dict[str, str]:
    """`--airflow-set SECTION.KEY=VALUE` as the AIRFLOW__SECTION__KEY variables of the deployment's processes."""
    settings = {}
    for item in given:
        name, sep, value = item.partition("=")
        section, dot, key = name.partition(".")
        if not (sep and dot and section.isidentifier() and key.isidentifier()):
            parser.error(f"--airflow-set {item!r}: write SECTION.KEY=VALUE, "
                         "e.g. scheduler.scheduler_idle_sleep_time=0.2")
        settings[f"AIRFLOW__{section.upper()}__{key.upper()}"] = value
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="delays of 2 and 15 s only, bursts of 1,000")
    parser.add_argument("--code", type=Path,
                        help="a checkout whose airflow_delay_provider the deployment's processes import instead of "
                             "this one's (an earlier commit, for a before/after in one sitting)")
    parser.add_argument("--per-delay", type=int, default=5, help="messages per delay and path")
    parser.add_argument("--airflow-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="an Airflow setting of every component (e.g. scheduler.scheduler_idle_sleep_time=0.2), "
                             "as AIRFLOW__SECTION__KEY; repeatable")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "deployment.json")
    args = parser.parse_args()
    settings = airflow_settings(parser, args.airflow_set)
    delays = (2, 15) if args.quick else (2, 15, 90, 300)
    burst_n = {"sql": 1000, "rabbitmq": 1000, "native": 1000, "sqs": 100} if args.quick else \
        {"sql": 10_000, "rabbitmq": 10_000, "native": 10_000, "sqs": 300}

    tmp = Path(tempfile.mkdtemp(prefix="adp-bench-deploy-"))
    schema = f"adp_bench_{uuid.uuid4().hex[:8]}"
    vhost = f"adp_bench_{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", vhost)
    rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    moto = MotoServer()
    store = SqlDelayedMessageStore(PG_URL, schema=schema)
    store.create_schema()
    queues = SqlTableTransport(PG_URL, schema=schema)
    params = pika.ConnectionParameters("127.0.0.1", 5672, vhost, pika.PlainCredentials("guest", "guest"))
    rabbit = RabbitMQTransport(params, prefix="delay")
    sqs_client = boto3.client("sqs", endpoint_url=moto.url, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
    sqs = SqsTransport(sqs_client)
    connections = {
        "delay_store_default": store_connection(PG_URL, schema),
        "rabbitmq_default": {"conn_type": "rabbitmq", "host": "127.0.0.1", "port": 5672, "login": "guest",
                             "password": "guest", "schema": vhost, "extra": {"prefix": "delay"}},
        "aws_default": {"conn_type": "aws", "login": "testing", "password": "testing",
                        "extra": {"endpoint_url": moto.url, "region_name": "us-east-1"}},
    }
    dags = tmp / "dags"
    dags.mkdir()
    for kind, (prefix, transport, conn) in DISPATCHERS.items():
        (dags / f"bench_dispatch_{kind}.py").write_text(
            DAG_TEMPLATE.format(kind=kind, prefix=prefix, transport=transport, conn=conn))
    (dags / "bench_dag_run.py").write_text(TARGET_DAG)
    destinations = {"sql": "bsql.q", "rabbitmq": "brmq.q", "native": "brmq.native", "sqs": "bsqs-q"}
    queues.provision(destinations["sql"])
    queues.provision("error")
    rabbit.provision(destinations["rabbitmq"])
    rabbit.provision(destinations["native"])
    rabbit.provision("error")
    sqs.provision(destinations["sqs"])
    sqs.provision("error")
    total = max(delays) + 120
    # Unpausing the delayed-run target starts its watcher at the file's next parse: parse often.
    airflow = Deployment(tmp / "rig", dags, connections=connections,
                         env={"AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "5", **settings,
                              **({"PYTHONPATH": str(args.code.resolve())} if args.code else {})})
    dag_run_due: dict[str, datetime] = {}
    arrivals = Arrivals()
    due: dict[str, tuple[str, object]] = {}  # message id -> (path label, due time)
    results: dict = {"delays": list(delays), "bursts": burst_n, "airflow_settings": settings}
    try:
        log("starting the deployment")
        airflow.start()
        runs = {}
        for kind in DISPATCHERS:
            airflow.unpause(f"bench_dispatch_{kind}")
            runs[kind] = airflow.trigger(f"bench_dispatch_{kind}", {"seconds": total + 60})
        for kind, run_id in runs.items():
            airflow.wait_trigger_assigned(f"bench_dispatch_{kind}", run_id, "dispatch", timeout=120)
        airflow.unpause("bench_dag_run")
        watch_deadline = time.monotonic() + 120
        while not store.event_claims(DAG_RUN_DEST):
            if time.monotonic() > watch_deadline:
                raise RuntimeError("the delayed-run target's asset watcher did not start")
            time.sleep(0.5)
        log("dispatchers and the delayed-run watcher running in the triggerer")
        slots = SlotWatch(airflow, runs)
        threads = [
            threading.Thread(target=consume_sql, args=(queues, destinations["sql"], arrivals)),
            threading.Thread(target=consume_rabbitmq,
                             args=(params, destinations["rabbitmq"], "store -> RabbitMQ", arrivals)),
            threading.Thread(target=consume_rabbitmq,
                             args=(params, destinations["native"], "RabbitMQ native levels", arrivals)),
            threading.Thread(target=consume_sqs, args=(
                sqs_client, sqs_client.get_queue_url(QueueName=destinations["sqs"])["QueueUrl"], arrivals)),
        ]
        for t in threads:
            t.start()
        labels = {"sql": "store -> SQL table", "rabbitmq": "store -> RabbitMQ", "native": "RabbitMQ native levels",
                  "sqs": "store -> SQS (moto)"}
        def send(path: str, batch: list[DelayedMessage]) -> None:
            for m in batch:
                due[m.message_id] = (labels[path], m.due_at)
            step = 1000 if path == "native" else 5000
            for i in range(0, len(batch), step):
                if path == "native":
                    assert rabbit.send(batch[i:i + step]) == {}
                else:
                    store.store(batch[i:i + step])

        # Bursts first, due well after they are all stored; then each path's single messages, timed from
        # just before they are stored, so no message is due before it exists and no burst is being
        # written while a single message falls due.
        burst_at = store.clock() + timedelta(seconds=40)
        for path, destination in destinations.items():
            send(path, [DelayedMessage(destination, BODY, burst_at, {}, f"{path}-burst-{i}")
                        for i in range(burst_n[path])])
        for path, destination in destinations.items():
            now = store.clock()
            send(path, [DelayedMessage(destination, BODY, now + timedelta(seconds=d), {}, f"{path}-d{d}-{i}")
                        for d in delays for i in range(args.per_delay)])
        now = store.clock()
        runs_batch = [DelayedMessage(DAG_RUN_DEST, b'{"bench": true}', now + timedelta(seconds=d + DAG_RUN_STAGGER * i),
                                     {}, f"dagrun-d{d}-{i}") for d in delays for i in range(args.per_delay)]
        store.store(runs_batch)
        dag_run_due.update({m.message_id: m.due_at for m in runs_batch})
        log(f"{len(due)} messages and {len(runs_batch)} delayed runs sent; waiting {max(delays)} s for the last due "
            "time")
        deadline = time.monotonic() + max(delays) + 120
        while time.monotonic() < deadline and len(arrivals.at) < len(due):
            time.sleep(1)
        log(f"{len(arrivals.at)} of {len(due)} delivered")
        arrivals.stop.set()
        slots.stop.set()
        for t in threads:
            t.join(10)
        slot_share = slots.running / slots.watched if slots.watched else 0.0
        results["worker_slot_seconds_per_minute"] = round(60 * slot_share, 2)
        rows = []
        for label in labels.values():
            mine = {m: d for m, (lbl, d) in due.items() if lbl == label}
            for group in [*(f"-d{d}-" for d in delays), "-burst-"]:
                ids = [m for m in mine if group in m]
                late = [(arrivals.at[m][0][1] - mine[m]).total_seconds() for m in ids if m in arrivals.at]
                twice = sum(len(arrivals.at[m]) > 1 for m in ids if m in arrivals.at)
                name = f"burst of {len(ids):,}" if group == "-burst-" else f"due in {group.strip('-d')} s"
                rows.append({"path": label, "messages": name, "n": len(ids), "delivered": len(late),
                             "early": sum(x < 0 for x in late), "twice": twice,
                             "first_ms": round(1000 * min(late), 1) if late else None,
                             "p50_ms": round(1000 * statistics.median(late), 1) if late else None,
                             "p99_ms": round(1000 * pct(late, 99), 1) if late else None,
                             "max_ms": round(1000 * max(late), 1) if late else None})
        log("delayed runs: waiting for the target's runs")
        run_rows, run_summary = dag_run_rows(airflow, dag_run_due, delays,
                                             wait=DAG_RUN_STAGGER * args.per_delay + 120)
        rows += run_rows
        results["dag_runs"] = run_summary
        results["rows"] = rows
    finally:
        arrivals.stop.set()
        airflow.stop()
        rabbit.close()
        moto.stop()
        with store.engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        rabbitmqctl("delete_vhost", vhost)
    log("the same demo under `airflow dags test`")
    results["dags_test"] = dags_test_figure(tmp)
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    results["versions"] = versions()
    results["code"] = str(args.code) if args.code else "this checkout"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2, default=str))
    report(results)


def versions() -> dict:
    import airflow
    import moto
    import psycopg

    with SqlDelayedMessageStore(PG_URL).engine.connect() as conn:
        pg = conn.exec_driver_sql("SHOW server_version").scalar()
    rabbit = rabbitmqctl("version").strip()
    return {"airflow": airflow.__version__, "postgresql": pg, "rabbitmq": rabbit, "moto": moto.__version__,
            "psycopg": psycopg.__version__, "pika": pika.__version__}


def report(r: dict) -> None:
    v, m = r["versions"], r["machine"]
    print(f"\nDeployment lateness: Airflow {v['airflow']} (api-server, scheduler, dag-processor, triggerer as separate "
          f"processes, LocalExecutor), PostgreSQL {v['postgresql']}, RabbitMQ {v['rabbitmq']} (quorum queues), "
          f"moto {v['moto']}; Python {m['python']}, {m['cpus']} cores, {m['platform']}; Airflow settings beyond the "
          f"rig's: {r.get('airflow_settings') or 'none'}\n")
    print("| path | messages | delivered | early | twice | first ms | p50 ms | p99 ms | max ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in r["rows"]:
        print(f"| {row['path']} | {row['messages']} | {row['delivered']}/{row['n']} | {row['early']} | "
              f"{row['twice']} | {row['first_ms']} | {row['p50_ms']} | {row['p99_ms']} | {row['max_ms']} |")
    if r.get("dag_runs"):
        late = {row["messages"]: row.get("event_recorded_p50_ms") for row in r["rows"] if row["path"] == DAG_RUN_LABEL}
        print(f"\nDelayed DAG runs: {r['dag_runs']['runs']} runs, {r['dag_runs']['runs_with_several_messages']} "
              f"carrying several messages; the rows' figures are due -> run created (queued); due -> event "
              f"recorded (run_after), p50 ms: {late}")
        first = r["dag_runs"].get("first_run")
        if first:
            print(f"First delayed run after the watcher started: run created {first['created_ms']} ms, event recorded "
                  f"{first['recorded_ms']} ms after its due time; p99 of all runs, the first included: "
                  f"{r['dag_runs'].get('p99_ms_all_runs')} ms")
    print(f"\nWorker slot held by a dispatcher: {r['worker_slot_seconds_per_minute']} s per minute of waiting "
          f"({100 * r['worker_slot_seconds_per_minute'] / 60:.1f}%)")
    d = r["dags_test"]
    print(f"`airflow dags test` (triggers in line), the demo of `make demo`: lateness p50 "
          f"{1000 * d.get('lateness_p50_seconds', float('nan')):.0f} ms, p99 "
          f"{1000 * d.get('lateness_p99_seconds', float('nan')):.0f} ms")


if __name__ == "__main__":
    main()
