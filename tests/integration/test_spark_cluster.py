"""The sweep on a Spark standalone cluster: a master and two workers as their own JVMs on 127.0.0.1, whose
executors run a Python that has neither this package nor its dependencies; the operator ships them the
executors' environment. And no secret on any process's command line, whatever the deploy target."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import threading
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

import psutil
import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.spark.local_cluster import LocalCluster
from tests import helpers
from tests.conftest import QUICK_JVM, RABBIT_HOST, RABBIT_PORT, _rabbitmqctl
from tests.helpers import consume_ids, drain, make_store
from tests.integration.test_airflow import _pg_conn
from tests.integration.test_spark import due_messages

N = 100_000
EXECUTOR_CONF = {"spark.executor.memory": "512m", "spark.ui.enabled": "false",
                 "spark.executor.extraJavaOptions": QUICK_JVM}
#: What executors must not find in their Python: the archive brings them.
SHIPPED = ("airflow_delay_provider", "sqlalchemy", "psycopg", "pika", "boto3")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A Python of this minor version with nothing installed: what a cluster node has."""
    where = tmp_path_factory.mktemp("bare")
    python = helpers.bare_python(where) / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for module in SHIPPED:
        found = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, cwd=where)
        assert found.returncode != 0, f"the bare Python can import {module}: the test would prove nothing"
    return python


@pytest.fixture(scope="module")
def cluster(bare_python, tmp_path_factory):
    """The cluster: its workers' executors find the bare Python first on PATH, and no venv of ours."""
    from tests.integration.test_spark import SPARK_SUBMIT

    if not SPARK_SUBMIT.exists():
        pytest.fail(f"{SPARK_SUBMIT} is missing: install the spark extra (`make test` does)", pytrace=False)
    with LocalCluster(workers=2, cores=1, memory="1g", path=f"{bare_python.parent}:/usr/bin:/bin",
                      env={"SPARK_DAEMON_JAVA_OPTS": QUICK_JVM}) as running:
        yield running


@pytest.fixture
def spark_conn(cluster, monkeypatch, tmp_path_factory):
    conn_id = f"spark_cluster_{uuid.uuid4().hex[:6]}"
    host, port = cluster.master_url.rsplit(":", 1)
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "spark", "host": host,
                                                                     "port": int(port)}))
    # The archive is built once for the module, into a cache of this run's own.
    monkeypatch.setenv("AIRFLOW_DELAY_EXECUTOR_ENV_CACHE", str(tmp_path_factory.getbasetemp() / "executor-env"))
    return conn_id


def secret_forms(secret: str) -> set[str]:
    """A secret as it could show up: in clear, URL-quoted, and base64-encoded at each alignment."""
    forms = {secret, quote(secret, safe="")}
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + secret.encode()).decode()
        forms.add(encoded[4 if shift else 0:-4])  # the characters that depend on the secret alone
    return {f for f in forms if len(f) >= 8}


class CommandLines(threading.Thread):
    """Every distinct command line on this machine while it runs (each process is every node here), and the
    Python workers that ran in a directory under `where` (another test's local Spark runs its own beside)."""

    def __init__(self, where: Path) -> None:
        super().__init__(daemon=True)
        self.where = where
        self.seen: set[str] = set()
        self.workers: set[str] = set()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            for proc in psutil.process_iter(["cmdline", "cwd"]):
                line = " ".join(proc.info["cmdline"] or ())
                self.seen.add(line)
                if "pyspark.daemon" in line and Path(proc.info["cwd"] or "/").is_relative_to(self.where):
                    self.workers.add(line)

    def __enter__(self) -> CommandLines:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.join()


def sweep_operator(conn_id: str, store_conn: str, **kwargs):
    from airflow_delay_provider.operators.sweep import BulkSweepOperator

    return BulkSweepOperator(task_id="sweep", due_before=(utcnow() + timedelta(minutes=1)).isoformat(),
                             conn_id=conn_id, delay_store_conn_id=store_conn, partitions=4, conf=EXECUTOR_CONF,
                             **kwargs)


def run_watched(op, secrets: list[str], bare_python: Path, cluster: LocalCluster) -> dict:
    """Run the operator while watching every command line; checks none holds a secret and that the
    executors' Python workers (those in the cluster's directories) ran on the bare Python."""
    with CommandLines(cluster.directory) as lines:
        summary = op.execute({})
    leaks = {form for line in lines.seen for s in secrets for form in secret_forms(s) if form in line}
    assert not leaks, f"secrets on a command line: {leaks}"
    # The launcher (a shell script, seen before it execs) and the bare Python it runs: nothing else.
    workers = lines.workers - {"/bin/sh ./environment/bin/python -m pyspark.daemon pyspark.worker"}
    assert workers and all(line.startswith(f"{bare_python} ") for line in workers), workers
    assert not Path(op._secret.directory).exists(), "the secret file outlived the sweep"
    return summary


def test_the_sweep_moves_100000_rows_exactly_once_on_executors_without_the_package(cluster, spark_conn, bare_python,
                                                                                   pg, monkeypatch):
    url, schema, table = pg
    password = f"pw-{uuid.uuid4().hex}"  # the server trusts the loopback: a password it ignores, to look for
    store_conn = _pg_conn(monkeypatch, schema, table, password=password)
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    hook = DelayStoreHook(store_conn)
    store, transport = hook.get_store(), hook.get_transport()
    store.create_schema()
    queue = f"cluster_{uuid.uuid4().hex[:8]}"
    transport.provision(queue)
    store.store(due_messages(N, queue))

    op = sweep_operator(spark_conn, store_conn)
    summary = run_watched(op, [password], bare_python, cluster)

    assert summary["status"] == "done" and summary["destinations"] == {queue: {"dispatched": N}}
    assert summary["claimed"] == N and summary["released"] == 0
    ids = Counter(m.message_id for m in drain(transport, queue))
    assert len(ids) == N and set(ids.values()) == {1}
    assert store.count_scheduled() == {} and store.sweep_record(op._claim_id)["status"] == "done"


def test_a_python_the_user_chose_for_the_executors_runs_with_the_shipped_archive(cluster, spark_conn, bare_python,
                                                                                   pg, monkeypatch, capsys):
    """PYSPARK_PYTHON in the Airflow worker's environment names the nodes' own Python, which has nothing of the
    sweep: that Python runs, with the archive's packages on its path."""
    url, schema, table = pg
    store_conn = _pg_conn(monkeypatch, schema, table)
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    hook = DelayStoreHook(store_conn)
    store, transport = hook.get_store(), hook.get_transport()
    store.create_schema()
    queue = f"chosen_{uuid.uuid4().hex[:8]}"
    transport.provision(queue)
    n = 20_000
    store.store(due_messages(n, queue))
    monkeypatch.setenv("PYSPARK_PYTHON", str(bare_python))

    op = sweep_operator(spark_conn, store_conn)
    capsys.readouterr()
    summary = run_watched(op, [], bare_python, cluster)  # its Python workers ran the bare Python

    assert summary["status"] == "done" and summary["destinations"] == {queue: {"dispatched": n}}, summary
    ids = Counter(m.message_id for m in drain(transport, queue))
    assert len(ids) == n and set(ids.values()) == {1}
    said = [line for line in capsys.readouterr().out.splitlines() if "Spark: executors run" in line]  # the task log
    assert said and f"executors run {bare_python} (PYSPARK_PYTHON in this process's environment) with the " \
        "packages of the archive" in said[0], said


@pytest.fixture
def rabbit_user(rabbit_vhost):
    """A RabbitMQ user of this test's own with a random password, on its vhost."""
    user, password = f"adp_{uuid.uuid4().hex[:8]}", f"rb-{uuid.uuid4().hex}"
    _rabbitmqctl("add_user", user, password)
    _rabbitmqctl("set_permissions", "-p", rabbit_vhost, user, ".*", ".*", ".*")
    yield user, password
    _rabbitmqctl("delete_user", user)


def test_the_sweep_sends_100000_at_least_once_to_rabbitmq_from_executors_without_the_package(
        cluster, spark_conn, bare_python, pg, monkeypatch, rabbit_vhost, rabbit_user):
    from airflow_delay_provider.hooks.rabbitmq import RabbitMQDelayHook

    url, schema, table = pg
    user, password = rabbit_user
    rabbit_conn = f"rabbit_{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{rabbit_conn.upper()}", json.dumps(
        {"conn_type": "rabbitmq", "host": RABBIT_HOST, "port": RABBIT_PORT, "login": user, "password": password,
         "schema": rabbit_vhost, "extra": {"prefix": f"d{uuid.uuid4().hex[:6]}"}}))
    store_conn = _pg_conn(monkeypatch, schema, table)
    store = make_store(*pg)
    rabbit = RabbitMQDelayHook(rabbit_conn).get_transport()
    rabbit.provision("orders")
    store.store(due_messages(N, "orders"))

    op = sweep_operator(spark_conn, store_conn, transport="rabbitmq", transport_conn_id=rabbit_conn)
    summary = run_watched(op, [password], bare_python, cluster)

    assert summary["status"] == "done" and summary["released"] == 0
    assert summary["destinations"]["orders"]["dispatched"] == N
    ids = consume_ids(rabbit.parameters, "orders", N, quiet=60)
    assert len(ids) == N, f"{N - len(ids)} missing"  # at least once: a redelivered batch may repeat
    assert store.count_scheduled() == {}
    rabbit.close()


def test_an_unreachable_master_fails_the_task_and_claims_nothing(pg, monkeypatch):
    from airflow_delay_provider.spark.setup import SparkSetupError
    from tests.services import free_port

    url, schema, table = pg
    store = make_store(*pg)
    store.store(due_messages(10, "orders"))
    conn_id = f"spark_gone_{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}",
                       json.dumps({"conn_type": "spark", "host": "spark://127.0.0.1", "port": free_port()}))
    op = sweep_operator(conn_id, _pg_conn(monkeypatch, schema, table))
    with pytest.raises(SparkSetupError, match=r"unreachable .*Connection refused.*start it"):
        op.execute({})
    assert op._claim_id is None and store.count_scheduled() == {"orders": 10}


def test_a_spark_connection_that_cannot_be_read_fails_instead_of_running_locally(pg, monkeypatch):
    from airflow_delay_provider.spark.setup import SparkSetupError

    url, schema, table = pg
    store = make_store(*pg)
    store.store(due_messages(10, "orders"))
    conn_id = f"spark_broken_{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", '{"conn_type": "spark", "host": ')  # cut short
    op = sweep_operator(conn_id, _pg_conn(monkeypatch, schema, table))
    with pytest.raises(SparkSetupError, match=f"connection '{conn_id}' could not be read "
                       r"\(EnvironmentVariablesBackend raised JSONDecodeError\)"):
        op.execute({})
    assert op._claim_id is None and store.count_scheduled() == {"orders": 10}


class _Submitted(Exception):
    """Stops the operator where spark-submit would start."""


TARGETS = {
    "standalone-client": {"conn_type": "spark", "host": "spark://127.0.0.1"},  # on a port that listens
    "yarn-client": {"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "client", "queue": "q"}},
    "yarn-cluster": {"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "cluster"}},
    "k8s-client": {"conn_type": "spark", "host": "k8s://https://kube.internal:6443",
                   "extra": {"deploy-mode": "client", "namespace": "sweeps"}},
    "k8s-cluster": {"conn_type": "spark", "host": "k8s://https://kube.internal:6443",
                    "extra": {"deploy-mode": "cluster", "namespace": "sweeps"}},
}
#: The Kubernetes Secret the k8s-cluster target's driver reads the connections from.
K8S_SECRET = "sweep-connections"


@pytest.mark.parametrize("transport", ["sql", "rabbitmq", "sqs"])
@pytest.mark.parametrize("target", [t for t in TARGETS if t != "yarn-cluster"])  # refused: see below
def test_no_secret_is_in_the_spark_submit_command_or_its_environment(target, transport, pg, monkeypatch,
                                                                     tmp_path_factory):
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    url, schema, table = pg
    make_store(*pg)
    passwords = {"store": f"pw-{uuid.uuid4().hex}", "rabbitmq": f"rb-{uuid.uuid4().hex}",
                 "sqs": f"aws-{uuid.uuid4().hex}", "token": f"tok-{uuid.uuid4().hex}"}
    store_conn = _pg_conn(monkeypatch, schema, table, password=passwords["store"])
    conn_id = f"spark_{uuid.uuid4().hex[:6]}"
    master = socket.create_server(("127.0.0.1", 0))  # the standalone master's port: it must accept connections
    spark = {**TARGETS[target], "port": master.getsockname()[1]} if target == "standalone-client" else TARGETS[target]
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(spark))
    monkeypatch.setenv("AIRFLOW_DELAY_EXECUTOR_ENV_CACHE", str(tmp_path_factory.getbasetemp() / "executor-env"))
    kwargs: dict = {}
    if transport == "rabbitmq":
        kwargs = {"transport": "rabbitmq", "transport_conn_id": "rabbit_secret"}
        monkeypatch.setenv("AIRFLOW_CONN_RABBIT_SECRET", json.dumps(
            {"conn_type": "rabbitmq", "host": "mq.internal", "login": "sweeper", "password": passwords["rabbitmq"]}))
    elif transport == "sqs":
        kwargs = {"transport": "sqs", "transport_conn_id": "aws_secret"}
        monkeypatch.setenv("AIRFLOW_CONN_AWS_SECRET", json.dumps(
            {"conn_type": "aws", "login": "AKIDEXAMPLE", "password": passwords["sqs"],
             "extra": {"region_name": "eu-west-1", "aws_session_token": passwords["token"]}}))
    captured: dict = {}

    def submit(self, context):
        hook = self._get_hook()
        captured["command"] = hook._build_spark_submit_command(self.application)
        captured["env"] = hook._env or {}
        captured["file"] = Path(self._secret.path).read_text() if self._secret else None  # client mode's own file
        raise _Submitted

    monkeypatch.setattr(SparkSubmitOperator, "execute", submit)
    if target.startswith("k8s"):
        # The Spark provider asks for the Kubernetes provider's client module on k8s masters (not installed here);
        # building the command does not use it.
        from airflow.providers.apache.spark.hooks import spark_submit

        monkeypatch.setattr(spark_submit, "kube_client", object(), raising=False)
    cluster_mode = target.endswith("cluster")
    if cluster_mode:
        kwargs["connections_secret"] = K8S_SECRET
    op = sweep_operator(conn_id, store_conn, allow_loopback_hosts=True, **kwargs)  # the store is this machine's
    with master, pytest.raises(_Submitted):
        op.execute({})

    command, env = " ".join(captured["command"]), json.dumps(captured["env"])
    secrets = [passwords["store"]] + ([passwords["rabbitmq"]] if transport == "rabbitmq" else []) + (
        [passwords["sqs"], passwords["token"]] if transport == "sqs" else [])
    for secret in secrets:
        assert cluster_mode or secret in captured["file"]  # the file carries it...
        assert not [f for f in secret_forms(secret) if f in command or f in env], (secret, command)  # ...nothing else
    secret_arg = captured["command"][captured["command"].index("--secret-file") + 1]
    # Nothing goes with the application: spark-submit would upload it (on Kubernetes to an upload path that is
    # never cleaned). The driver in the cluster reads the Kubernetes Secret mounted in its pod.
    assert "--files" not in captured["command"]
    if cluster_mode:
        assert op._secret is None and secret_arg == "/opt/airflow-delay/connections/connections.json"
        assert f"spark.kubernetes.driver.secrets.{K8S_SECRET}=/opt/airflow-delay/connections" in command
    else:
        assert secret_arg == op._secret.path and not Path(op._secret.directory).exists()
    assert "spark.pyspark.python=./environment/bin/python" in command and "#environment" in command


@pytest.mark.parametrize(("target", "said"), [
    ("yarn-cluster", "NodeManagers"), ("k8s-cluster", "spark.kubernetes.file.upload.path")])
def test_a_cluster_mode_that_would_ship_the_connections_file_is_refused_before_anything_is_claimed(
        target, said, pg, monkeypatch):
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    from airflow_delay_provider.spark.setup import SparkSetupError

    store = make_store(*pg)
    store.store(due_messages(10, "orders"))
    conn_id = f"spark_{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(TARGETS[target]))
    submitted = []
    monkeypatch.setattr(SparkSubmitOperator, "execute", lambda self, context: submitted.append(self))
    if target.startswith("k8s"):  # as above: not used to resolve the target
        from airflow.providers.apache.spark.hooks import spark_submit

        monkeypatch.setattr(spark_submit, "kube_client", object(), raising=False)
    op = sweep_operator(conn_id, _pg_conn(monkeypatch, *pg[1:]), allow_loopback_hosts=True)
    with pytest.raises(SparkSetupError, match=said) as refused:
        op.execute({})
    assert "client" in str(refused.value)
    assert not submitted and op._claim_id is None and op._secret is None
    assert store.count_scheduled() == {"orders": 10}
