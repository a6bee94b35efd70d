"""Where the sweep's driver reads the connections: a file of its owner's here, or a Kubernetes Secret mounted
in the driver's pod; never a file spark-submit uploads (no Spark, no Java needed)."""

from __future__ import annotations

import json
import os

import pytest

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.spark import secret
from airflow_delay_provider.spark.setup import SparkSetupError, SparkTarget
from airflow_delay_provider.spark.sweep import load_secret


def test_the_secret_file_is_its_owners_only_and_goes_away():
    written = secret.SecretFile({"store": {"url": "postgresql://u:pw@h/db"}, "transport": {}}, "c1")
    assert os.stat(written.path).st_mode & 0o777 == 0o600 and os.stat(written.directory).st_mode & 0o777 == 0o700
    assert load_secret(written.path)["store"]["url"] == "postgresql://u:pw@h/db"
    written.remove()
    assert not os.path.exists(written.directory)


@pytest.mark.parametrize("master", ["local[2]", "spark://10.0.0.5:7077", "yarn", "k8s://https://kube:6443"])
def test_in_client_mode_the_driver_reads_a_file_of_this_task_and_nothing_is_shipped(master):
    where = secret.driver_secret(SparkTarget(master, "client"), {}, connections_secret="ignored-here")
    assert where.path is None and where.conf == {}  # the task's own file: the driver runs here


def test_on_kubernetes_in_cluster_mode_the_driver_reads_the_secret_mounted_in_its_pod():
    target = SparkTarget("k8s://https://kube:6443", "cluster")
    where = secret.driver_secret(target, {"spark.executor.memory": "1g"}, connections_secret="sweep-connections")
    assert where.conf == {"spark.kubernetes.driver.secrets.sweep-connections": "/opt/airflow-delay/connections"}
    assert where.path == "/opt/airflow-delay/connections/connections.json"
    assert "Kubernetes Secret 'sweep-connections'" in where.description
    # Mounted already by the user's conf: read where they put it.
    mine = secret.driver_secret(target, {"spark.kubernetes.driver.secrets.sweep-connections": "/etc/sweep/"},
                                connections_secret="sweep-connections")
    assert mine.conf == {} and mine.path == "/etc/sweep/connections.json"
    with pytest.raises(InvalidInputError, match="not a Kubernetes Secret's name"):
        secret.driver_secret(target, {}, connections_secret="Sweep=x")


def test_without_a_secret_kubernetes_cluster_mode_is_refused_naming_what_to_set():
    with pytest.raises(SparkSetupError) as refused:
        secret.driver_secret(SparkTarget("k8s://https://kube:6443", "cluster"), {}, connections_secret=None)
    said = str(refused.value)
    assert "spark.kubernetes.file.upload.path" in said and "connections_secret=" in said
    assert "deploy-mode" in said and "client" in said


@pytest.mark.parametrize(("master", "why"), [
    ("yarn", "NodeManagers"), ("spark://10.0.0.5:7077", "standalone"), ("mesos://m:5050", "mesos://m:5050")])
def test_cluster_mode_elsewhere_is_refused_saying_to_run_the_driver_here(master, why):
    with pytest.raises(SparkSetupError, match=why) as refused:
        secret.driver_secret(SparkTarget(master, "cluster"), {}, connections_secret="sweep-connections")
    assert "deploy-mode" in str(refused.value) and "client" in str(refused.value)


def test_the_secrets_content_is_what_the_operator_would_write(monkeypatch, tmp_path):
    from airflow_delay_provider.operators.sweep import BulkSweepOperator

    monkeypatch.setenv("AIRFLOW_CONN_SECRET_STORE", json.dumps(
        {"conn_type": "delay_store", "host": "db.internal", "login": "u", "password": "pw", "schema": "app",
         "extra": {"db_schema": "delays"}}))
    monkeypatch.setenv("AIRFLOW_CONN_SECRET_MQ", json.dumps(
        {"conn_type": "rabbitmq", "host": "mq.internal", "login": "sweeper", "password": "rb"}))
    out = tmp_path / "connections.json"
    assert secret.main(["-o", str(out), "--delay-store-conn-id", "secret_store", "--table", "msgs",
                        "--transport", "rabbitmq", "--transport-conn-id", "secret_mq"]) == 0
    assert os.stat(out).st_mode & 0o777 == 0o600
    op = BulkSweepOperator(task_id="s", due_before="2026-01-01T00:00:00+00:00", delay_store_conn_id="secret_store",
                           table="msgs", transport="rabbitmq", transport_conn_id="secret_mq")
    assert json.loads(out.read_text()) == {"store": op.hook.store_spec(), "transport": op.transport_spec()}
    with pytest.raises(FileExistsError):  # never over a file that may be someone else's
        secret.main(["-o", str(out), "--delay-store-conn-id", "secret_store"])
