"""The bulk sweep with a real `spark-submit --master local[2]` on the real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.spark import sweep as sweep_app
from tests.conftest import RABBIT_HOST, RABBIT_PORT
from tests.helpers import consume_ids, drain, make_store, make_transport
from tests.waiting import wait_for

APP = Path(sweep_app.__file__).with_name("sweep_app.py")
SPARK_SUBMIT = Path(sys.executable).with_name("spark-submit")


@pytest.fixture(scope="module")
def spark_ready():
    if not SPARK_SUBMIT.exists():
        pytest.fail(f"{SPARK_SUBMIT} is missing: install the spark extra (`make test` does)", pytrace=False)
    if not Path(sweep_app.DEFAULT_JDBC_JAR).exists():
        pytest.fail(f"{sweep_app.DEFAULT_JDBC_JAR} is missing: apt-get install libpostgresql-jdbc-java "
                    "(`make test` does)", pytrace=False)


def submit(store_spec: dict, transport_spec: dict, *args: str, wait: bool = True):
    """spark-submit the sweep on local[2]; returns (return code, summary, output) or the running process."""
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               **{sweep_app.SECRET_ENV: sweep_app.encode_secret(store_spec, transport_spec)})
    command = [str(SPARK_SUBMIT), "--master", "local[2]", "--jars", sweep_app.DEFAULT_JDBC_JAR,
               "--conf", "spark.ui.enabled=false", "--driver-memory", "1g", str(APP), *args]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    if not wait:
        return proc
    output, _ = proc.communicate(timeout=300)
    summaries = [line[len(sweep_app.SUMMARY_MARKER):] for line in output.splitlines()
                 if line.startswith(sweep_app.SUMMARY_MARKER)]
    return proc.returncode, json.loads(summaries[-1]) if summaries else None, output


def due_messages(n: int, destination: str, seconds_ago: float = 5.0, prefix: str = "m") -> list[DelayedMessage]:
    due = utcnow() - timedelta(seconds=seconds_ago)
    return [DelayedMessage(destination, f"body-{i}".encode(), due, {"n": str(i)}, f"{prefix}-{i}") for i in range(n)]


def specs(url, schema, table, transport: dict) -> tuple[dict, dict]:
    return {"url": url, "table": table, "schema": schema}, transport


# "auto" is the direct reader: partitions lease and read their rows themselves; JDBC reads them through Spark.
@pytest.mark.parametrize(("reader", "used"), [("auto", "direct"), ("jdbc", "jdbc")])
def test_sweep_delivers_20000_exactly_once_to_sql_dead_letters_and_a_rerun_dispatches_nothing(spark_ready, pg,
                                                                                              reader, used):
    url, schema, table = pg
    store = make_store(*pg)
    transport = make_transport(*pg, "orders", "refunds", "error")  # "gone" has no queue: destination not found
    store.store(due_messages(12_000, "orders") + due_messages(8_000, "refunds", prefix="r")
                + due_messages(5, "gone", prefix="g"))
    later = DelayedMessage("orders", b"later", utcnow() + timedelta(hours=1), message_id="later")
    store.store([later])
    window_end = (utcnow() + timedelta(minutes=1)).isoformat()
    sql = {"kind": "sql", "url": url, "schema": schema, "table_prefix": f"{table}_"}

    code, summary, output = submit(*specs(*pg, sql), "--due-before", window_end, "--partitions", "3",
                                   "--delivery-policy", "http", "--reader", reader)
    assert code == 0, output[-3000:]
    assert summary["reader"] == used and summary["partitions"] == 3 and summary["status"] == "done"
    assert summary["destinations"] == {"orders": {"dispatched": 12_000}, "refunds": {"dispatched": 8_000},
                                       "gone": {"failed": 5, "dead_lettered": 5}}
    ids = Counter(m.message_id for q in ("orders", "refunds") for m in drain(transport, q))
    assert len(ids) == 20_000 and set(ids.values()) == {1}
    dead = drain(transport, "error")
    assert sorted(m.message_id for m in dead) == [f"g-{i}" for i in range(5)]
    assert dead[0].headers["x-delay-failed-destination"] == "gone"
    assert store.count_scheduled() == {"orders": 1}  # due in an hour: not swept early
    record = store.sweep_record(summary["claim_id"])
    assert record["status"] == "done" and record["claimed"] == 20_005 and record["summary"]["released"] == 0
    assert summary["claimed"] == 20_005 and summary["taken_over"] == 0

    code, again, output = submit(*specs(*pg, sql), "--due-before", window_end, "--reader", reader)
    assert code == 0, output[-3000:]
    assert (again["claimed"], again["dispatched"]) == (0, 0)
    assert transport.depth("orders")["visible"] == 0 and store.get("later") is not None


def test_sweep_beside_a_pump_to_rabbitmq_loses_nothing_and_repeats_only_what_was_handed_back(
        spark_ready, pg, rabbit, rabbit_vhost):
    n = 20_000
    store = make_store(*pg)
    rabbit.provision("orders")
    rabbit.provision("error")
    store.store(due_messages(n, "orders"))
    # A slow pump (500/s) runs through the whole sweep, so both take a share of the same rows. However long
    # spark-submit takes to start, the pump cannot drain them all first: once it has sent 1000, it claims
    # nothing more until the sweep has leased rows of its own.
    claim_due = store.claim_due

    def claim_due_once_the_sweep_leases(*args, **kwargs):
        if store.count_scheduled().get("orders", 0) <= n - 1000:
            wait_for(lambda: (store.sweep_record("beside") or {}).get("claimed", 0) > 0, 300, "the sweep to lease")
        return claim_due(*args, **kwargs)

    store.claim_due = claim_due_once_the_sweep_leases
    pump = Pump(store, rabbit, PumpConfig(batch_size=100),
                policy=DeliveryPolicy.from_dict({"throttlePolicy": {"maxReceivesPerSecond": 500}}))
    results = {}
    worker = threading.Thread(target=lambda: results.update(r=pump.run(deadline=utcnow() + timedelta(seconds=90),
                                                                       stop_when_idle=True)))
    worker.start()
    spec = {"kind": "rabbitmq", "host": RABBIT_HOST, "port": RABBIT_PORT, "virtual_host": rabbit_vhost,
            "login": "guest", "password": "guest", "prefix": rabbit.names.prefix}
    code, summary, output = submit(*specs(*pg, spec), "--due-before", (utcnow() + timedelta(minutes=1)).isoformat(),
                                   "--partitions", "2", "--claim-id", "beside")
    worker.join(120)
    assert code == 0, output[-3000:]
    pumped = results["r"].stats.dispatched
    assert summary["dispatched"] > 0 and pumped > 0, (summary, pumped)
    assert summary["dispatched"] + pumped == n
    received = consume_ids(rabbit.parameters, "orders", n, quiet=15)
    assert len(received) == n, n - len(received)  # nothing lost
    # At least once into RabbitMQ: a batch whose confirms do not come in time (a broker slowed by a loaded machine:
    # "no confirm within 30 s" in one CI run) is handed back and sent again, so its messages may arrive twice.
    # Anything else arriving twice is a defect: every copy beyond the first must be a released message's.
    twice = sum(c - 1 for c in received.values())
    released = results["r"].stats.released + summary.get("released", 0)
    assert twice <= released, (twice, released, received.most_common(3))
    assert store.count_scheduled() == {}


def backlog(pg, n: int, queue: str = "orders", table_prefix: str | None = None):
    """`n` due messages for `queue` in the test's store; the store, the queue tables (the test's own, or
    those of `table_prefix`) and their transport spec for the sweep."""
    url, schema, table = pg
    store = make_store(*pg)
    prefix = table_prefix or f"{table}_"
    transport = make_transport(url, schema, prefix[:-1], queue, "error")
    store.store(due_messages(n, queue))
    return store, transport, {"kind": "sql", "url": url, "schema": schema, "table_prefix": prefix}


def test_killed_sweep_is_taken_over_after_its_lease_and_nothing_is_lost(spark_ready, pg):
    n = 20_000
    store, transport, sql = backlog(pg, n)
    window_end = (utcnow() + timedelta(minutes=1)).isoformat()
    slow = json.dumps({"throttlePolicy": {"maxReceivesPerSecond": 2000}})  # ~10 s: time to kill it mid-run
    # The direct reader, with both partitions running at once: each leases its whole range before sending.
    proc = submit(*specs(*pg, sql), "--due-before", window_end, "--lease-seconds", "5", "--claim-id", "first",
                  "--delivery-policy", slow, "--partitions", "2", wait=False)

    def both_leased_and_2000_delivered() -> bool:
        # A partition whose task has not started yet holds no lease: its rows would be swept afresh, not taken over.
        delivered = transport.depth("orders")["visible"]  # read first: rows only move from leased to delivered
        return delivered >= 2000 and store.backlog()["totals"]["in_flight"] + delivered >= n

    try:
        wait_for(lambda: proc.poll() is not None or both_leased_and_2000_delivered(), 120,
                 "both partitions to lease their rows and the sweep to deliver 2000")
        assert proc.poll() is None, "the sweep ended before it could be killed: " + proc.stdout.read()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):  # spark-submit and everything it started
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    delivered_before = transport.depth("orders")["visible"]
    assert 0 < delivered_before < n
    assert store.sweep_record("first")["status"] == "running"  # it never finished
    wait_for(lambda: store.backlog()["totals"]["in_flight"] == 0, 30, "its lease to run out")  # nothing holds rows

    # The Python data source reads this time (the reader PostgreSQL uses without the JDBC jar, and SQLite).
    code, summary, output = submit(*specs(*pg, sql), "--due-before", window_end, "--claim-id", "second",
                                   "--reader", "python", "--partitions", "2")
    assert code == 0, output[-3000:]
    assert summary["reader"] == "python" and summary["taken_over"] == n - delivered_before == summary["dispatched"]
    ids = Counter(m.message_id for m in drain(transport, "orders"))
    # The SQL transport shares the store's database: even the killed partitions' batches rolled back.
    assert len(ids) == n and set(ids.values()) == {1}
    assert store.count_scheduled() == {}


@pytest.mark.parametrize(("reader", "used"), [("auto", "direct"), ("python", "python")])
def test_operator_sweeps_the_embedded_sqlite_store_and_returns_the_summary(spark_ready, run_dag, reader, used):
    from airflow.sdk import DAG

    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.operators.sweep import BulkSweepOperator

    table = f"sweep_sqlite_{reader}"
    hook = DelayStoreHook(table=table)  # the default connection: this run's SQLite store
    store = hook.get_store()
    store.create_schema()
    transport = hook.get_transport()
    queue = f"sweep.{reader}"
    for name in (queue, "error"):
        transport.provision(name)
    store.store(due_messages(500, queue, prefix="op"))
    with DAG(f"test_bulk_sweep_sqlite_{reader}", schedule=None, catchup=False) as dag:
        BulkSweepOperator(task_id="sweep", due_before=(utcnow() + timedelta(minutes=1)).isoformat(),
                          table=table, partitions=2, reader=reader, conf={"spark.ui.enabled": "false"})
    state, states, values = run_dag(dag)
    assert state == "success", states
    summary = values["sweep"]
    assert summary["reader"] == used and summary["status"] == "done"
    assert summary["destinations"] == {queue: {"dispatched": 500}}
    assert sorted(m.message_id for m in drain(transport, queue)) == sorted(f"op-{i}" for i in range(500))
    assert queue not in store.count_scheduled()


def test_operator_says_how_to_install_what_is_missing(monkeypatch, tmp_path):
    import shutil

    from airflow_delay_provider.core.errors import InvalidInputError
    from airflow_delay_provider.operators.sweep import BulkSweepOperator, SparkSetupError
    from airflow_delay_provider.spark import setup

    assert SparkSetupError is setup.SparkSetupError  # still importable from the operator's module
    op = BulkSweepOperator(task_id="s", due_before="2026-01-01T00:00:00+00:00", jdbc_jar=str(tmp_path / "none.jar"))
    with pytest.raises(SparkSetupError, match="apt-get install libpostgresql-jdbc-java"):
        setup.check_machine(uses_jdbc=True, jdbc_jar=op.jdbc_jar)
    assert setup.check_machine(uses_jdbc=False, jdbc_jar=op.jdbc_jar)  # SQLite needs no jar
    monkeypatch.delenv("JAVA_HOME", raising=False)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which",
                        lambda name, path=None: None if name == "java" else real_which(name, path=path))
    with pytest.raises(SparkSetupError, match="openjdk-17-jre-headless"):
        setup.check_machine(uses_jdbc=False, jdbc_jar=op.jdbc_jar)
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)
    with pytest.raises(SparkSetupError, match="spark-submit was not found"):
        setup.check_machine(uses_jdbc=False, jdbc_jar=op.jdbc_jar)
    for bad in ({"transport": "kafka"}, {"reader": "odbc"}, {"partitions": -1}, {"lease_seconds": 1},
                {"batch_size": 0}, {"delivery_policy": {"healthyRetryPolicy": {"numRetries": 101}}}):
        with pytest.raises(InvalidInputError):
            BulkSweepOperator(task_id="bad", due_before="2026-01-01T00:00:00+00:00", **bad)


def test_a_sweep_stops_at_its_max_duration_and_releases_what_it_did_not_send(spark_ready, pg):
    n = 20_000
    store, transport, sql = backlog(pg, n)
    slow = json.dumps({"throttlePolicy": {"maxReceivesPerSecond": 1000}})  # 20 s at least: it cannot finish
    code, summary, output = submit(*specs(*pg, sql), "--due-before", (utcnow() + timedelta(minutes=1)).isoformat(),
                                   "--claim-id", "bounded", "--max-seconds", "4", "--delivery-policy", slow)
    assert code == 0, output[-3000:]
    assert summary["status"] == "timed_out" and summary["released"] > 0, summary
    assert summary["dispatched"] + summary["released"] == n
    assert store.sweep_record("bounded")["status"] == "timed_out"
    # Released at once, not at the end of the lease: a pump sends the rest straight away.
    assert store.count_scheduled() == {"orders": summary["released"]}
    Pump(store, transport).run(stop_when_idle=True)
    ids = Counter(m.message_id for m in drain(transport, "orders"))
    assert len(ids) == n and set(ids.values()) == {1}


def test_the_lease_is_renewed_only_while_rows_are_being_settled(pg):
    url, schema, table = pg
    store = make_store(*pg)
    store.store(due_messages(10, "orders"))
    store.start_sweep("keeper", utcnow() + timedelta(minutes=1), None, lease_seconds=3)

    def lease_until() -> int:
        return store.sweep_record("keeper")["lease_until_us"]

    rounds = _Rounds(store)  # a keeper's round starts by reading the sweep's progress
    keeper = sweep_app.LeaseKeeper(rounds, "keeper", lease_seconds=3, total=10, interval=0.5)
    keeper.start()
    try:
        first = lease_until()
        rounds.wait_started(rounds.started + 4)  # three whole rounds since, without progress
        assert lease_until() == first, "a sweep that settles nothing must let its lease run out"
        with store.engine.begin() as conn:  # a partition settles some of its rows
            conn.execute(store.table.delete().where(store.table.c.message_id.in_(["m-0", "m-1"])))
        rounds.wait_started(rounds.started + 2)  # the first round that starts after it is over
        assert lease_until() > first
    finally:
        keeper.stop()


class _Rounds:
    """The store as a LeaseKeeper uses it, counting its rounds (each starts with sweep_progress)."""

    def __init__(self, store) -> None:
        self.store = store
        self.started = 0
        self._changed = threading.Condition()

    def sweep_progress(self, claim_id: str):
        with self._changed:
            self.started += 1
            self._changed.notify_all()
        return self.store.sweep_progress(claim_id)

    def renew_lease(self, claim_id: str, lease_seconds: float) -> bool:
        return self.store.renew_lease(claim_id, lease_seconds)

    def wait_started(self, n: int, timeout: float = 30) -> None:
        """Until round `n` has started (so rounds before it are over)."""
        with self._changed:
            assert self._changed.wait_for(lambda: self.started >= n, timeout), f"the keeper is stuck at {self.started}"


def test_killing_the_sweep_task_releases_its_rows_at_once(spark_ready, pg, monkeypatch):
    from airflow_delay_provider.operators.sweep import BulkSweepOperator
    from tests.integration.test_airflow import _pg_conn

    url, schema, table = pg
    # The hook's queue tables, which other tests of this run share: a destination of this test's own.
    queue = f"kill_{uuid.uuid4().hex[:8]}"
    n = 20_000
    store, transport, _ = backlog(pg, n, queue, table_prefix="delay_")
    conn_id = _pg_conn(monkeypatch, schema, table)
    op = BulkSweepOperator(task_id="sweep", due_before=(utcnow() + timedelta(minutes=1)).isoformat(),
                           delay_store_conn_id=conn_id, lease_seconds=600, partitions=2,
                           delivery_policy={"throttlePolicy": {"maxReceivesPerSecond": 1000}},
                           conf={"spark.ui.enabled": "false"})
    errors = []
    runner = threading.Thread(target=lambda: _capture(errors, op.execute, {}), daemon=True)
    runner.start()
    wait_for(lambda: transport.depth(queue)["visible"] >= 1000 or not runner.is_alive(), 120,
             "the sweep to deliver 1000")
    assert runner.is_alive(), f"the sweep ended before it could be killed: {errors}"
    op.on_kill()
    runner.join(60)
    assert not runner.is_alive() and errors, "execute should fail once spark-submit is killed"
    record = store.sweep_record(op._claim_id)
    assert record["status"] in ("killed", "failed")
    left = store.count_scheduled().get(queue, 0)
    assert left > 0
    # None of them is still held under the 600 s lease: a pump takes them now.
    Pump(store, transport).run(stop_when_idle=True)
    ids = Counter(m.message_id for m in drain(transport, queue))
    assert len(ids) == n and set(ids.values()) == {1}


def _capture(errors: list, call, *args) -> None:
    try:
        call(*args)
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        errors.append(exc)


#: Reads the claim through the JDBC reader once per store spec (a JSON file) and prints what each gave.
_JDBC_READS = """
import json, sys
from pyspark.sql import SparkSession
from airflow_delay_provider.spark.sweep import read_claim, store_from_spec
with open(sys.argv[1]) as f:
    job = json.load(f)
spark = SparkSession.builder.getOrCreate()
got = {}
for name, spec in job["stores"].items():
    try:
        got[name] = read_claim(spark, store_from_spec(spec), job["claim_id"], job["ranges"], "jdbc").count()
    except Exception as exc:
        got[name] = "failed: " + str(exc)
spark.stop()
print("READS " + json.dumps(got))
"""


def test_the_jdbc_reader_connects_with_the_stores_sslmode(spark_ready, pg, tmp_path):
    """This server has no TLS: a store URL asking for it must fail the JDBC read as it fails psycopg, and one
    that disables or only prefers it must read. Without the URL's sslmode pgjdbc would prefer TLS and read."""
    url, schema, table = pg
    store = make_store(*pg)
    store.store(due_messages(50, "orders"))
    store.start_sweep("tls", utcnow() + timedelta(minutes=1), lease_seconds=600)
    low, high, _ = store.claimed_range("tls")
    key_password = f"kp-{uuid.uuid4().hex}"
    stores = {mode: {"url": f"{url}?sslmode={mode}&lock_timeout=10s" + (f"&sslpassword={key_password}"
                                                                        if mode == "require" else ""),
                     "table": table, "schema": schema} for mode in ("disable", "prefer", "require")}
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"stores": stores, "claim_id": "tls", "ranges": [[low, high]]}))
    job.chmod(0o600)
    script = tmp_path / "jdbc_reads.py"
    script.write_text(_JDBC_READS)
    ran = subprocess.run([str(SPARK_SUBMIT), "--master", "local[1]", "--jars", sweep_app.DEFAULT_JDBC_JAR,
                          "--conf", "spark.ui.enabled=false", str(script), str(job)],
                         # As the operator runs it: PySpark's spark-submit finds its Spark home with the venv's Python.
                         env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1",
                                  PATH=f"{SPARK_SUBMIT.parent}{os.pathsep}{os.environ.get('PATH', '')}"),
                         capture_output=True, text=True, timeout=300)
    reads = [line[len("READS "):] for line in ran.stdout.splitlines() if line.startswith("READS ")]
    assert ran.returncode == 0 and reads, ran.stdout[-3000:] + ran.stderr[-3000:]
    got = json.loads(reads[-1])
    assert got["disable"] == 50 and got["prefer"] == 50, got
    assert got["require"].startswith("failed: the JDBC reader could not read the store at jdbc:postgresql://") \
        and "(sslmode: require)" in got["require"] and "The server does not support SSL" in got["require"], got
    assert key_password not in ran.stdout + ran.stderr  # nor in Spark's log
