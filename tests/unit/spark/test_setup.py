"""Submitting the sweep: machine checks, arguments, environment and outcome (no Spark, no Java needed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from datetime import UTC, datetime

import pytest

from airflow_delay_provider.core.errors import DelayProviderError
from airflow_delay_provider.spark import pythons, setup
from airflow_delay_provider.spark.setup import SparkSetupError
from airflow_delay_provider.spark.sweep import parse_args


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A machine with spark-submit in `tmp_path/bin` and Java on PATH; the test takes parts away."""
    found = {"spark-submit": str(tmp_path / "bin" / "spark-submit"), "java": "/usr/bin/java"}
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, path=None: found.get(name))
    return found


def test_the_machine_check_returns_spark_submits_directory_and_says_how_to_install_what_is_missing(machine, tmp_path):
    jar = tmp_path / "postgresql.jar"
    assert setup.check_machine(uses_jdbc=False, jdbc_jar=str(jar)) == str(tmp_path / "bin")  # no jar needed
    with pytest.raises(SparkSetupError, match="apt-get install libpostgresql-jdbc-java"):
        setup.check_machine(uses_jdbc=True, jdbc_jar=str(jar))
    jar.write_bytes(b"")
    assert setup.check_machine(uses_jdbc=True, jdbc_jar=str(jar)) == str(tmp_path / "bin")
    del machine["java"]
    with pytest.raises(SparkSetupError, match="openjdk-17-jre-headless"):
        setup.check_machine(uses_jdbc=False)
    del machine["spark-submit"]
    with pytest.raises(SparkSetupError, match="spark-submit was not found"):
        setup.check_machine(uses_jdbc=False)
    assert issubclass(SparkSetupError, DelayProviderError)


def test_java_home_stands_in_for_java_on_path(machine, monkeypatch, tmp_path):
    del machine["java"]
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\n")
    java.chmod(0o755)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk"))
    assert setup.check_machine(uses_jdbc=False) == str(tmp_path / "bin")


def test_a_missing_spark_connection_is_defined_on_the_given_master(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_UNIT", raising=False)
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_UNIT_YARN", raising=False)
    assert setup.resolve_target("spark_unit", "local[2]") == setup.SparkTarget("local[2]", "client")
    assert json.loads(os.environ["AIRFLOW_CONN_SPARK_UNIT"]) == {"conn_type": "spark", "host": "local[2]"}
    # It exists now: its master wins.
    assert setup.resolve_target("spark_unit", "spark://elsewhere:7077").master == "local[2]"
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_UNIT_YARN",
                       json.dumps({"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "cluster"}}))
    target = setup.resolve_target("spark_unit_yarn", "local[2]")
    assert (target.kind, target.cluster_mode, target.one_host) == ("yarn", True, False)
    assert setup.resolve_target("spark_unit_yarn", None, deploy_mode="client").deploy_mode == "client"


def test_no_fallback_when_the_connection_cannot_be_read_or_master_is_none(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_UNIT_BAD", "{not json")
    with pytest.raises(SparkSetupError, match="could not be read .*EnvironmentVariablesBackend raised"):
        setup.resolve_target("spark_unit_bad", "local[2]")
    assert os.environ["AIRFLOW_CONN_SPARK_UNIT_BAD"] == "{not json"  # not replaced by a local master
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_UNIT_NONE", raising=False)
    with pytest.raises(SparkSetupError, match="is not defined .*master=None"):
        setup.resolve_target("spark_unit_none", None)
    assert "AIRFLOW_CONN_SPARK_UNIT_NONE" not in os.environ


@pytest.mark.parametrize(("master", "one_host"), [
    ("local[2]", True), ("spark://127.0.0.1:7077", True), ("spark://localhost:7077,127.0.0.2:7078", True),
    ("spark://10.0.0.5:7077", False), ("spark://127.0.0.1:7077,node2:7077", False), ("yarn", False),
    ("k8s://https://127.0.0.1:6443", False)])
def test_a_master_runs_every_executor_here_only_when_it_is_local_or_a_loopback_standalone(master, one_host):
    assert setup.SparkTarget(master).one_host is one_host


def test_an_unreachable_standalone_master_is_named(monkeypatch):
    from tests.services import free_port

    port = free_port()
    with pytest.raises(SparkSetupError, match=rf"spark://127.0.0.1:{port} \(connection 'c'\) is unreachable"):
        setup.check_master_reachable(setup.SparkTarget(f"spark://127.0.0.1:{port}"), "c", timeout=2)
    setup.check_master_reachable(setup.SparkTarget("yarn"), "c")  # nothing to check: spark-submit asks YARN


STORE = {"url": "postgresql+psycopg://u:pw@127.0.0.1:5432/db", "table": "t", "schema": None}


@pytest.mark.parametrize(("store", "transport", "said"), [
    (STORE, {"kind": "sql", "url": STORE["url"]}, "the store's host '127.0.0.1' is a loopback address"),
    ({"url": "postgresql+psycopg://u@/db"}, {"kind": "sqs", "client": {}}, "Unix socket"),
    ({"url": "sqlite:////tmp/store.db"}, {"kind": "sqs", "client": {}}, "SQLite file on this machine"),
    ({"url": "postgresql+psycopg://u@db.internal/db"}, {"kind": "rabbitmq", "host": "localhost"},
     "the RabbitMQ host 'localhost' is a loopback address"),
    ({"url": "postgresql+psycopg://u@db.internal/db"}, {"kind": "rabbitmq", "host": None}, "'127.0.0.1' (the default)"),
    ({"url": "postgresql+psycopg://u@db.internal/db"},
     {"kind": "sqs", "client": {"endpoint_url": "http://127.0.0.1:5000"}}, "SQS endpoint"),
])
def test_a_cluster_sweep_refuses_hosts_only_this_machine_reaches(store, transport, said):
    from airflow_delay_provider.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=re.escape(said)) as raised:
        setup.check_reachable_hosts(setup.SparkTarget("yarn"), store, transport, allow_loopback_hosts=False)
    assert "allow_loopback_hosts=True" in str(raised.value) and ":pw@" not in str(raised.value)
    setup.check_reachable_hosts(setup.SparkTarget("yarn"), store, transport, allow_loopback_hosts=True)
    setup.check_reachable_hosts(setup.SparkTarget("spark://127.0.0.1:7077"), store, transport, False)
    reachable = {"url": "postgresql+psycopg://u:pw@db.internal/db"}
    setup.check_reachable_hosts(setup.SparkTarget("yarn"), reachable, {"kind": "rabbitmq", "host": "mq"}, False)


@pytest.fixture
def no_python_settings(monkeypatch, tmp_path):
    for name in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_LOCAL_IP", "SPARK_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.setenv("AIRFLOW_DELAY_EXECUTOR_ENV_CACHE", str(tmp_path / "cache"))


def test_on_a_local_master_both_sides_run_this_python_and_nothing_is_shipped(no_python_settings):
    got = pythons.executor_setup(setup.SparkTarget("local[2]"), "auto", "/opt/spark/bin", env_vars={"PATH": "x"})
    assert got.archives is None
    assert got.conf == {"spark.pyspark.python": sys.executable, "spark.pyspark.driver.python": sys.executable}
    assert got.env_vars["PATH"].startswith("/opt/spark/bin" + os.pathsep)
    assert got.env_vars["SPARK_LOCAL_IP"] == "127.0.0.1"


def test_on_a_cluster_the_executors_run_the_shipped_archive_and_the_driver_this_python(no_python_settings):
    got = pythons.executor_setup(setup.SparkTarget("spark://10.0.0.5:7077"), "auto", "/opt/spark/bin",
                               archives="hdfs:///other.zip#other", conf={"spark.executor.memory": "1g"})
    shipped, alias = got.archives.split(",")[1].split("#")
    assert got.archives.startswith("hdfs:///other.zip#other,") and alias == "environment"
    assert os.path.isfile(shipped) and shipped.startswith(os.environ["AIRFLOW_DELAY_EXECUTOR_ENV_CACHE"])
    assert got.conf == {"spark.executor.memory": "1g", "spark.pyspark.python": "./environment/bin/python",
                        "spark.pyspark.driver.python": sys.executable}
    assert "SPARK_LOCAL_IP" not in got.env_vars  # executors elsewhere must reach the driver
    assert f"executors run the node's Python {VERSION} with the packages of the archive {shipped} (built in" \
        in got.description
    again = pythons.executor_setup(setup.SparkTarget("spark://10.0.0.5:7077"), "auto", "/opt/spark/bin")
    assert again.archives == f"{shipped}#environment" and "(cached" in again.description


def test_in_cluster_mode_the_driver_runs_the_archive_too_and_env_vars_stay_clean(no_python_settings, tmp_path):
    archive = tmp_path / "env.tar.gz"
    archive.write_bytes(b"")
    got = pythons.executor_setup(setup.SparkTarget("yarn", "cluster"), str(archive), "/opt/spark/bin")
    assert got.archives == f"{archive}#environment"
    assert got.conf == {"spark.pyspark.python": "./environment/bin/python",
                        "spark.pyspark.driver.python": "./environment/bin/python"}
    assert got.env_vars == {}  # on YARN they become the application master's environment
    assert os.environ["PATH"].startswith("/opt/spark/bin" + os.pathsep)  # spark-submit found by the hook


VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"
LAUNCHER = "./environment/bin/python"


def test_a_python_the_user_chose_for_the_executors_runs_with_the_archive_on_its_path(no_python_settings):
    target = setup.SparkTarget("spark://10.0.0.5:7077")
    got = pythons.executor_setup(target, "auto", "/b", env_vars={"PYSPARK_PYTHON": "/opt/py/bin/python"})
    # Spark runs the archive's launcher, which runs that Python (and only that one) with the archive's packages.
    assert got.archives.endswith("#environment") and got.conf["spark.pyspark.python"] == LAUNCHER
    assert got.conf["spark.executorEnv.AIRFLOW_DELAY_EXECUTOR_PYTHON"] == "/opt/py/bin/python"
    assert got.conf["spark.executorEnv.AIRFLOW_DELAY_EXECUTOR_PYTHON_FROM"] == "PYSPARK_PYTHON in env_vars"
    assert "executors run /opt/py/bin/python (PYSPARK_PYTHON in env_vars) with the packages of the archive " \
        in got.description
    chosen = pythons.executor_setup(target, "auto", "/b", conf={"spark.pyspark.python": "python3"})
    assert chosen.conf["spark.pyspark.python"] == LAUNCHER
    assert chosen.conf["spark.executorEnv.AIRFLOW_DELAY_EXECUTOR_PYTHON"] == "python3"
    assert "(spark.pyspark.python in conf)" in chosen.description
    launcher = pythons.executor_setup(target, "auto", "/b", conf={"spark.pyspark.python": LAUNCHER})
    assert "spark.executorEnv.AIRFLOW_DELAY_EXECUTOR_PYTHON" not in launcher.conf  # the launcher is no choice


def test_with_nothing_shipped_what_the_user_sets_for_the_pythons_stays_as_it_is(no_python_settings, monkeypatch):
    target = setup.SparkTarget("spark://10.0.0.5:7077")
    got = pythons.executor_setup(target, None, "/b", conf={"spark.pyspark.python": "/x/python",
                                                          "spark.pyspark.driver.python": sys.executable})
    assert got.archives is None and got.conf == {"spark.pyspark.python": "/x/python",
                                                 "spark.pyspark.driver.python": sys.executable}
    assert "executors run /x/python (spark.pyspark.python in conf), with nothing shipped" in got.description
    monkeypatch.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
    got = pythons.executor_setup(target, None, "/b")
    assert got.conf == {} and "the cluster's default Python" in got.description
    assert f"runs {sys.executable} (PYSPARK_DRIVER_PYTHON in this process's environment)" in got.description


@pytest.fixture
def other_python(tmp_path):
    """A Python of another minor version, as far as anyone asking it can tell (this machine has one Python)."""
    python = tmp_path / "other" / "python3.9"
    python.parent.mkdir()
    python.write_text('#!/bin/sh\nexec python3 -c "print(\'3.9\')"\n')
    python.chmod(0o755)
    return python


def test_where_every_executor_runs_here_a_chosen_python_of_another_version_is_refused_before_submitting(
        no_python_settings, other_python):
    from airflow_delay_provider.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=rf"PYSPARK_PYTHON in env_vars names {other_python}, a Python 3.9.*"
                                                rf"built for Python {VERSION}"):
        pythons.executor_setup(setup.SparkTarget("spark://127.0.0.1:7077"), "auto", "/b",
                             env_vars={"PYSPARK_PYTHON": str(other_python)})
    # Elsewhere the nodes' Python is not this machine's: the launcher checks it there (test_environment.py).
    pythons.executor_setup(setup.SparkTarget("spark://10.0.0.5:7077"), "auto", "/b",
                         env_vars={"PYSPARK_PYTHON": str(other_python)})


def test_where_nothing_is_shipped_a_chosen_python_without_the_sweep_is_refused_before_submitting(
        no_python_settings, monkeypatch, tmp_path):
    from airflow_delay_provider.core.errors import InvalidInputError
    from tests.helpers import bare_python

    bare = bare_python(tmp_path / "bare") / "python"
    monkeypatch.setenv("PYSPARK_PYTHON", str(bare))
    with pytest.raises(InvalidInputError, match=rf"PYSPARK_PYTHON in this process's environment names {bare}, which "
                                                r"cannot import the sweep .*No module named 'airflow_delay_provider'"):
        pythons.executor_setup(setup.SparkTarget("local[2]"), "auto", "/b")
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)  # this one has it
    assert f"executors run {sys.executable} (PYSPARK_PYTHON in this process's environment), with nothing shipped;" \
        in pythons.executor_setup(setup.SparkTarget("local[2]"), "auto", "/b").description
    monkeypatch.delenv("PYSPARK_PYTHON")
    monkeypatch.setenv("PYSPARK_DRIVER_PYTHON", str(bare))  # the driver runs here in client mode, on any master
    with pytest.raises(InvalidInputError, match="PYSPARK_DRIVER_PYTHON in this process's environment"):
        pythons.executor_setup(setup.SparkTarget("yarn"), None, "/b")


def test_spark_submit_of_the_pyspark_package_finds_its_spark_home_whatever_python_the_user_chose(no_python_settings):
    from airflow_delay_provider.spark.local_cluster import spark_home

    # PySpark's spark-submit looks for its home with $PYSPARK_PYTHON, which may be a Python without PySpark.
    bin_dir = os.path.dirname(sys.executable)
    got = pythons.executor_setup(setup.SparkTarget("local[2]"), "auto", bin_dir)
    assert got.env_vars["SPARK_HOME"] == str(spark_home())
    assert "SPARK_HOME" not in pythons.executor_setup(setup.SparkTarget("local[2]"), "auto", "/opt/spark/bin").env_vars


def test_a_missing_archive_is_named_with_how_to_build_it(no_python_settings, tmp_path):
    from airflow_delay_provider.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="python -m airflow_delay_provider.spark.environment -o"):
        pythons.executor_setup(setup.SparkTarget("yarn"), str(tmp_path / "none.tar.gz"), "/b")
    assert pythons.executor_setup(setup.SparkTarget("yarn"), "s3a://bucket/env.tar.gz", "/b").archives == \
        "s3a://bucket/env.tar.gz#environment"


def test_the_arguments_are_what_the_application_parses():
    before, after = datetime(2026, 1, 2, tzinfo=UTC), datetime(2026, 1, 1, tzinfo=UTC)
    common = dict(reader="jdbc", lease_seconds=30.0, partitions=4, batch_size=500, number_of_retries=2,
                  error_queue="dead", destination_policies={"q": {"healthyRetryPolicy": {"numRetries": 1}}})
    args = parse_args(setup.application_args("c1", before, after, delivery_policy={"x": 1}, max_seconds=60.0,
                                             **common))
    assert (args.claim_id, args.due_before, args.due_from, args.reader) == ("c1", before.isoformat(),
                                                                           after.isoformat(), "jdbc")
    assert (args.lease_seconds, args.partitions, args.batch_size, args.number_of_retries, args.error_queue,
            args.max_seconds) == (30.0, 4, 500, 2, "dead", 60.0)
    assert json.loads(args.destination_policies) == common["destination_policies"]
    assert json.loads(args.delivery_policy) == {"x": 1}
    plain = setup.application_args("c2", before, None, **common)
    assert not {"--due-from", "--max-seconds", "--delivery-policy"} & set(plain)


def test_the_outcome_is_the_records_summary_only_when_the_sweep_finished():
    assert setup.finished_summary({"status": "done", "summary": {"dispatched": 3}}, "c", None) == {
        "dispatched": 3, "status": "done"}
    with pytest.raises(DelayProviderError, match="reached max_duration .60 s. and released 7 message"):
        setup.finished_summary({"status": "timed_out", "summary": {"released": 7}}, "c", 60)
    for record in (None, {"status": "running", "summary": None}):
        with pytest.raises(DelayProviderError, match="did not finish"):
            setup.finished_summary(record, "c", None)

