"""skip_unless_set_up: an example DAG's task needing a service besides the store is skipped, saying what is missing
and how to define it, only while the service is absent; a defined connection always runs the task."""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowSkipException

from airflow_delay_provider.dag_checks import skip_unless_set_up


def _skip_reason(check) -> str:
    with pytest.raises(AirflowSkipException) as info:
        check({})
    return str(info.value)


def test_a_missing_rabbitmq_connection_skips_with_how_to_define_it(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_RABBITMQ_DEFAULT", raising=False)
    reason = _skip_reason(skip_unless_set_up("rabbitmq"))
    assert "RabbitMQ is not set up (no connection 'rabbitmq_default')" in reason
    assert "AIRFLOW_CONN_RABBITMQ_DEFAULT='{\"conn_type\": \"rabbitmq\"" in reason and "Admin > Connections" in reason
    monkeypatch.setenv("AIRFLOW_CONN_RABBITMQ_DEFAULT", json.dumps({"conn_type": "rabbitmq", "host": "h"}))
    assert skip_unless_set_up("rabbitmq")({}) is None
    # Another connection id is the one checked and named.
    assert "no connection 'rabbit_b'" in _skip_reason(skip_unless_set_up("rabbitmq", "rabbit_b"))


def test_sqs_is_skipped_without_a_connection_or_a_region_only(monkeypatch, no_region_anywhere):
    reason = _skip_reason(skip_unless_set_up("sqs"))
    assert "Amazon SQS is not set up (no connection 'aws_default', and no AWS region in the environment)" in reason
    assert """AIRFLOW_CONN_AWS_DEFAULT='{"conn_type": "aws", "extra": {"region_name": "eu-west-1"}}'""" in reason
    # The amazon provider works without a connection from the environment's region and credentials: no skip.
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert skip_unless_set_up("sqs")({}) is None
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps({"conn_type": "aws"}))
    assert skip_unless_set_up("sqs")({}) is None


def test_spark_is_skipped_without_a_connection_on_a_worker_without_java(monkeypatch, tmp_path):
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_DEFAULT", raising=False)
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no java (spark-submit is found beside this Python)
    reason = _skip_reason(skip_unless_set_up("spark"))
    assert "Spark is not set up (no connection 'spark_default', and no local Spark on this worker: Java was not " \
           "found" in reason
    assert "AIRFLOW_CONN_SPARK_DEFAULT='{\"conn_type\": \"spark\", \"host\": \"spark://" in reason
    # A defined connection runs the task (and fails it there if the cluster is not reachable).
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    assert skip_unless_set_up("spark")({}) is None


def test_an_unknown_service_is_refused_when_the_dag_is_parsed():
    with pytest.raises(ValueError, match=r"service 'kafka' is not one of \['rabbitmq', 'spark', 'sqs'\]"):
        skip_unless_set_up("kafka")
