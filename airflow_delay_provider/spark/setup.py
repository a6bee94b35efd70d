"""Submitting the bulk sweep application: what spark-submit needs on the machine (checked before
submitting), the application's arguments and environment, and what its record in the store says.

Each machine check fails with `SparkSetupError` saying how to install what is missing, rather than
letting spark-submit fail later with a Java stack trace. Nothing here is an operator: BulkSweepOperator
calls these, and so can a script that submits `sweep_app.py` by hand.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from datetime import datetime
from typing import Any

from airflow_delay_provider.core.errors import DelayProviderError
from airflow_delay_provider.spark.sweep import DEFAULT_JDBC_JAR

log = logging.getLogger(__name__)


class SparkSetupError(DelayProviderError):
    """spark-submit, Java or the JDBC driver jar is missing on the machine that runs the task."""


def check_machine(uses_jdbc: bool, jdbc_jar: str = DEFAULT_JDBC_JAR) -> str:
    """The directory holding spark-submit; fails with how to install what is missing. The JDBC jar is
    needed only by `reader="jdbc"` (`uses_jdbc`): the direct and Python readers read through SQLAlchemy."""
    bin_dir = os.path.dirname(sys.executable)
    # PySpark installed in this venv puts spark-submit beside the interpreter, not necessarily on PATH.
    found = shutil.which("spark-submit") or shutil.which("spark-submit", path=bin_dir)
    if found is None:
        raise SparkSetupError(
            "spark-submit was not found on PATH nor beside this Python: install PySpark "
            "(pip install 'airflow-delay-provider[spark]') or put a Spark distribution's bin/ on PATH"
        )
    java_home = os.environ.get("JAVA_HOME")
    if not (java_home and os.access(os.path.join(java_home, "bin", "java"), os.X_OK)) and not shutil.which("java"):
        raise SparkSetupError(
            "Java was not found (no JAVA_HOME, no java on PATH): Spark needs Java 17 or 21, "
            "for example apt-get install openjdk-17-jre-headless"
        )
    if uses_jdbc and not os.path.isfile(jdbc_jar):
        raise SparkSetupError(
            f"the PostgreSQL JDBC driver jar {jdbc_jar} does not exist: apt-get install "
            "libpostgresql-jdbc-java (it installs /usr/share/java/postgresql.jar), pass jdbc_jar=<path>, "
            "or use reader='direct' (the default), which needs no jar"
        )
    return os.path.dirname(found)


def ensure_master(conn_id: str, master: str) -> bool:
    """Define the Spark connection `conn_id` (in this process's environment) on `master` if it does not
    exist: a missing connection makes the Spark provider fall back to YARN. Returns True when Spark runs
    locally (then the driver only listens on loopback)."""
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception:
        log.info("No Spark connection %r: running on %s", conn_id, master)
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps({"conn_type": "spark", "host": master})
        return master.startswith("local")
    return str(conn.host or "").startswith("local")


def submit_env(bin_dir: str, local: bool, env_vars: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of spark-submit: `env_vars`, with spark-submit's directory first on PATH and
    executors running this Python (where the provider is installed)."""
    env = {
        **(env_vars or {}),
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
    }
    if local and "SPARK_LOCAL_IP" not in os.environ:
        env["SPARK_LOCAL_IP"] = "127.0.0.1"  # executors on other hosts must reach the driver
    return env


def application_args(
    claim_id: str,
    due_before: datetime,
    due_from: datetime | None,
    *,
    reader: str,
    lease_seconds: float,
    partitions: int,
    batch_size: int,
    number_of_retries: int,
    error_queue: str,
    destination_policies: dict[str, dict],
    delivery_policy: dict | None = None,
    max_seconds: float | None = None,
) -> list[str]:
    """The command line of `sweep_app.py` (see `airflow_delay_provider.spark.sweep.parse_args`); policies
    as dicts. No secret goes here: spark-submit and Airflow log the arguments."""
    args = ["--claim-id", claim_id, "--due-before", due_before.isoformat(), "--reader", reader,
            "--lease-seconds", str(lease_seconds), "--partitions", str(partitions),
            "--batch-size", str(batch_size), "--number-of-retries", str(number_of_retries),
            "--error-queue", error_queue, "--destination-policies", json.dumps(destination_policies)]
    if due_from is not None:
        args += ["--due-from", due_from.isoformat()]
    if max_seconds:
        args += ["--max-seconds", str(max_seconds)]
    if delivery_policy is not None:
        args += ["--delivery-policy", json.dumps(delivery_policy)]
    return args


def finished_summary(record: dict[str, Any] | None, claim_id: str, max_duration: float | None) -> dict:
    """The summary of a sweep whose spark-submit succeeded, from its record in the store; fails unless the
    sweep finished (a sweep that timed out released what it had not sent, which a retry sweeps)."""
    if record is not None and record["status"] == "timed_out":
        raise DelayProviderError(
            f"the sweep {claim_id} reached max_duration ({max_duration} s) and released "
            f"{record['summary'].get('released')} message(s) it had not sent: a retry of this task sweeps "
            f"them, as does any dispatcher once they are due; its summary: {json.dumps(record['summary'])}"
        )
    if record is None or record["status"] != "done":
        raise DelayProviderError(f"spark-submit succeeded but the sweep {claim_id} did not finish: {record}")
    return {**(record["summary"] or {}), "status": record["status"]}
