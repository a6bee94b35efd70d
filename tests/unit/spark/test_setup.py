"""Submitting the sweep: machine checks, arguments, environment and outcome (no Spark, no Java needed)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import UTC, datetime

import pytest

from airflow_delay_provider.core.errors import DelayProviderError
from airflow_delay_provider.spark import setup
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
    assert setup.ensure_master("spark_unit", "local[2]") is True
    assert json.loads(os.environ["AIRFLOW_CONN_SPARK_UNIT"]) == {"conn_type": "spark", "host": "local[2]"}
    assert setup.ensure_master("spark_unit", "spark://elsewhere:7077") is True  # it exists now: its host wins
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_UNIT_YARN", json.dumps({"conn_type": "spark", "host": "yarn"}))
    assert setup.ensure_master("spark_unit_yarn", "local[2]") is False


def test_the_environment_puts_spark_submit_first_and_runs_executors_on_this_python(monkeypatch):
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    env = setup.submit_env("/opt/spark/bin", True, {"SECRET": "s", "PATH": "ignored"})
    assert env["SECRET"] == "s" and env["PATH"].startswith("/opt/spark/bin" + os.pathsep)
    assert env["PYSPARK_PYTHON"] == sys.executable and env["SPARK_LOCAL_IP"] == "127.0.0.1"
    assert "SPARK_LOCAL_IP" not in setup.submit_env("/opt/spark/bin", False)
    monkeypatch.setenv("SPARK_LOCAL_IP", "10.0.0.5")  # the deployment's own choice stays
    assert "SPARK_LOCAL_IP" not in setup.submit_env("/opt/spark/bin", True)


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
