"""Test rig: a private Airflow home on SQLite, and the real PostgreSQL in a schema of this run's own."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.databases import admin_conninfo, drop_later, wait_for_drops
from tests.services import MotoServer
from tests.shared import FILE_GROUPS, Shared, group_of

ROOT = Path(__file__).resolve().parent.parent
PG_URL = os.environ.get("DELAY_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

# Airflow reads its configuration at import: set it before any test module imports Airflow.
# One home per pytest process (each xdist worker has its own), removed at the end of its session.
_HOME = Path(tempfile.mkdtemp(prefix="adp-airflow-"))
# A folder the whole run shares (xdist's workers inherit it from the process that starts them, which removes it).
_RUN_DIR_OWNED = "ADP_TEST_RUN_DIR" not in os.environ
if _RUN_DIR_OWNED:
    os.environ["ADP_TEST_RUN_DIR"] = tempfile.mkdtemp(prefix="adp-run-")
_RUN_DIR = Path(os.environ["ADP_TEST_RUN_DIR"])
os.environ.update(
    {
        "AIRFLOW_HOME": str(_HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_HOME / 'airflow.db'}",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        # The store every operator uses unless told otherwise: a SQLite file of this run's own.
        "AIRFLOW_CONN_DELAY_STORE_DEFAULT": json.dumps(
            {"conn_type": "delay_store", "schema": str(_HOME / "delay_store.db"), "extra": {"driver": "sqlite"}}
        ),
    }
)

#: The tests' Spark JVMs live a minute or two: C1 alone and the serial collector, since C2's compiling never pays
#: back that soon; a third less CPU for a Spark test on a 2-core machine. spark-submit's driver (and a local
#: master's executors, in the same JVM) reads SPARK_SUBMIT_OPTS; a standalone cluster's executors take it as conf.
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
os.environ.setdefault("SPARK_SUBMIT_OPTS", QUICK_JVM)

from airflow_delay_provider.compat import AIRFLOW_VERSION, shared_stream  # noqa: E402 - Airflow after its settings

# Delayed DAG runs need Airflow 3.3's shared streams; on 3.2 they are refused (tests/unit/test_compat.py checks
# that), so their own tests are not collected there, and the header says so.
NEEDS_SHARED_STREAMS = ["unit/triggers/test_asset.py", "unit/triggers/test_message_queue.py",
                        "integration/test_dag_runs.py", "deployment/test_dag_runs.py",
                        "deployment/test_dag_run_outage.py"]
collect_ignore = [] if shared_stream else NEEDS_SHARED_STREAMS


def pytest_report_header(config) -> str:
    left_out = f"; no shared streams, so not collected: {', '.join(collect_ignore)}" if collect_ignore else ""
    return f"Airflow {AIRFLOW_VERSION}{left_out}"


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down (pytest's own sessionfinish)
def pytest_sessionfinish(session, exitstatus) -> None:
    """Remove this process's Airflow home, and only it: other sessions (and workers) have theirs; stop a shared
    resource that an interrupted test left open."""
    Shared.close_unless_next(None)
    shutil.rmtree(_HOME, ignore_errors=True)
    if _RUN_DIR_OWNED and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_RUN_DIR, ignore_errors=True)


def copy_migrated_sqlite(path: Path) -> None:
    """Write an Airflow metadata database on SQLite, freshly migrated, to `path`: a copy of one that `airflow db
    migrate` made once for the whole run (it took 20-36 s of each worker's first Airflow test, on 2 cores)."""
    template = _RUN_DIR / f"airflow-{AIRFLOW_VERSION}.db"
    with open(_RUN_DIR / "migrate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process migrates; the others wait for it
        if not template.exists():
            home = Path(tempfile.mkdtemp(dir=_RUN_DIR))
            env = {**os.environ, "AIRFLOW_HOME": str(home),
                   "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}"}
            subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], check=True,
                           stdout=subprocess.DEVNULL, env=env)
            (home / "airflow.db").rename(template)
            shutil.rmtree(home)
    shutil.copyfile(template, path)


@pytest.fixture(scope="session")
def airflow_home() -> Path:
    """An Airflow metadata database for this process (migrated, once for the run)."""
    copy_migrated_sqlite(_HOME / "airflow.db")
    return _HOME


def _check_postgres() -> None:
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(PG_URL)
        with engine.connect() as conn:
            conn.execute(text("select 1"))
        engine.dispose()
    except Exception as exc:
        pytest.fail(
            f"PostgreSQL is not reachable at {PG_URL.split('@')[-1]} ({type(exc).__name__}). These tests need the real "
            "server: start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` "
            "(trust auth, database `test`), or point DELAY_TEST_PG_URL at another one.",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def pg_schema():
    """A schema of this run's own on the real PostgreSQL, dropped at the end."""
    _check_postgres()
    from sqlalchemy import create_engine, text

    schema = f"adp_test_{uuid.uuid4().hex[:10]}"
    yield schema
    engine = create_engine(PG_URL)
    # A few tables a transaction, then the schema: one DROP SCHEMA ... CASCADE of the run's hundreds of stores
    # (each with 28 partitions of messages and their indexes) takes more locks than PostgreSQL's lock table holds
    # by default ("out of shared memory": max_locks_per_transaction).
    with engine.connect() as conn:
        tables = conn.execute(text(
            "SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = :schema AND c.relkind IN ('r', 'p') AND NOT c.relispartition"),
            {"schema": schema}).scalars().all()
    for start in range(0, len(tables), 10):
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {', '.join(tables[start:start + 10])} CASCADE"))
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    engine.dispose()


@pytest.fixture(scope="session", autouse=True)
def databases_dropped():
    """The session's end waits for the databases its tests handed to the dropping thread (tests/databases.py), a
    shared deployment's included (closed here first): one not dropped fails it."""
    yield
    Shared.close_unless_next(None)
    problems = wait_for_drops()
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture(params=["sqlite", "postgres"])
def db(request, tmp_path):
    """(url, schema, table) of an empty store on each database; a fresh table name per test."""
    table = f"t_{uuid.uuid4().hex[:12]}"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}", None, table
    return PG_URL, request.getfixturevalue("pg_schema"), table


@pytest.fixture
def pg(pg_schema):
    return PG_URL, pg_schema, f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def pg_own_database():
    """(url, schema, table) of a store in a database of the test's own, dropped at the end: for what waits for every
    transaction of its database older than itself (REINDEX CONCURRENTLY), which other tests' transactions in the
    shared database, or another program's beside the run, would otherwise hold up."""
    _check_postgres()
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from airflow_delay_provider.stores.engine import get_engine

    name = f"adp_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    yield url, None, f"t_{uuid.uuid4().hex[:12]}"
    get_engine(url).dispose()
    admin.dispose()
    drop_later(admin_conninfo(PG_URL), name)


@pytest.fixture
def run_dag(airflow_home):
    """Run a DAG with dag.test() (triggers run in line) and return (state, {task_id: return value})."""

    def run(dag, conf: dict | None = None):
        from airflow.dag_processing.bundles.manager import DagBundlesManager
        from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
        from airflow.models.taskinstance import TaskInstance
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session

        DagBundlesManager().sync_bundles_to_db()
        bag = DagBag(collect_dags=False)
        bag.bag_dag(dag)
        sync_bag_to_db(bag, "dags-folder", None)
        dagrun = dag.test(run_conf=conf)
        with create_session() as session:
            rows = session.query(XComModel).filter_by(run_id=dagrun.run_id, dag_id=dag.dag_id, key="return_value")
            values = {row.task_id: row.value for row in rows}
            states = {
                ti.task_id: ti.state
                for ti in session.query(TaskInstance).filter_by(run_id=dagrun.run_id, dag_id=dag.dag_id)
            }
        return dagrun.state, states, values

    return run


RABBIT_HOST, RABBIT_PORT = "127.0.0.1", 5672


def _rabbitmqctl(*args: str) -> str:
    result = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


@pytest.fixture(scope="session")
def rabbit_available():
    import pika

    try:
        pika.BlockingConnection(pika.ConnectionParameters(RABBIT_HOST, RABBIT_PORT, connection_attempts=1)).close()
    except Exception as exc:
        pytest.fail(
            f"RabbitMQ is not reachable at {RABBIT_HOST}:{RABBIT_PORT} ({type(exc).__name__}). "
            "These tests need the real broker (guest/guest): start it with `rabbitmq-server -detached`.",
            pytrace=False,
        )


@pytest.fixture
def rabbit_vhost(rabbit_available):
    """A virtual host of this test's own on the real RabbitMQ, deleted afterwards."""
    vhost = f"adp_test_{uuid.uuid4().hex[:10]}"
    _rabbitmqctl("add_vhost", vhost)
    _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    yield vhost
    _rabbitmqctl("delete_vhost", vhost)


@pytest.fixture
def rabbit(rabbit_vhost):
    """A RabbitMQ transport under a prefix of this test's own, in this run's vhost."""
    import pika

    from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport

    params = pika.ConnectionParameters(RABBIT_HOST, RABBIT_PORT, rabbit_vhost, pika.PlainCredentials("guest", "guest"))
    transport = RabbitMQTransport(params, prefix=f"d{uuid.uuid4().hex[:6]}")
    yield transport
    transport.close()




@pytest.fixture(scope="session")
def moto_server():
    """moto's server (SQS, S3) on a free loopback port, for this run; its URL."""
    try:
        server = MotoServer()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield server.url
    server.stop()


@pytest.fixture
def aws_conn(moto_server, monkeypatch):
    """An `aws` connection pointing at moto, reset before each test; its id."""
    import json
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(moto_server + "/moto-api/reset", method="POST"), timeout=5)
    monkeypatch.setenv("AIRFLOW_CONN_AWS_MOTO", json.dumps({
        "conn_type": "aws", "login": "testing", "password": "testing",
        "extra": {"endpoint_url": moto_server, "region_name": "us-east-1"}}))
    return "aws_moto"


@pytest.fixture
def sqs_client(aws_conn):
    from airflow.providers.amazon.aws.hooks.sqs import SqsHook

    return SqsHook(aws_conn_id=aws_conn).get_conn()


_SERVICE_DIRS = ("integration", "faults", "deployment")
#: The files of minutes each (the stateful store test, Airflow's processes, Spark, the command line's processes),
#: run first, longest first: `make test` hands whole files to its workers in this order (GroupedFiles), and one of
#: these handed out near the end of a run ran on alone for minutes. A group of files sharing one resource
#: (tests/shared.py) goes out as one, where its first file would.
_LONGEST_FILES = ("test_store_model.py", "test_delivery.py", "test_spark.py", "test_browser.py",
                  "test_spark_cluster.py", "test_dag_runs.py", "test_store_readiness.py", "test_first_run.py",
                  "test_backlog_operators.py", "test_ui_plugin.py", "test_ui_looks.py", "test_dag_run_outage.py",
                  "test_smoke.py", "test_extra_links.py", "test_cli.py")
_RANK = {name: n for n, name in enumerate(_LONGEST_FILES)}


def _file_rank(item) -> tuple[int, int]:
    """Where an item's file goes: its own rank in _LONGEST_FILES, or its group's (the best of its files'), and
    then its place in the group."""
    group = group_of(item.nodeid)
    if group is None:
        return _RANK.get(item.path.name, len(_RANK)), 0
    names = [Path(file).name for file in FILE_GROUPS[group]]
    return min(_RANK.get(name, len(_RANK)) for name in names), names.index(item.path.name)


def pytest_collection_modifyitems(config, items):
    """Tests under integration/, faults/ and deployment/ need the services: marked, so that
    `make test-fast` (-m "not services") runs the rest without any. The longest files go first (the order within
    each file is kept)."""
    for item in items:
        if any(part in _SERVICE_DIRS for part in item.path.parts):
            item.add_marker(pytest.mark.services)
    items.sort(key=_file_rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` as xdist does it, but keeping the collection's order of the files (xdist would sort them by
    their number of tests, which sent the longest files, of a few slow tests each, out last), and each group of
    files that share a resource (tests/shared.py) handed to one worker as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid) or super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return GroupedFiles(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's own teardown: stop the shared resource of its group when the next test is of another."""
    try:
        return (yield)
    finally:
        Shared.close_unless_next(nextitem.nodeid if nextitem is not None else None)


@pytest.fixture
def no_region_anywhere(monkeypatch, tmp_path):
    """No AWS connection and no region in the environment nor in an AWS config file, as on a machine that never ran
    `aws configure`."""
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AIRFLOW_CONN_AWS_DEFAULT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
