"""Checks the example DAGs make before a task that needs a service besides the store: when the service is not set
up, the task is skipped, saying what is missing and how to set it up, instead of failing on the first call.

Use it as a task's `pre_execute` (``pre_execute=skip_unless_set_up("sqs")``). A service whose connection is
defined is set up, so a broken one still fails its task: only an absent one is skipped. In a DAG of your own
where the service must be there, leave the check out, so that its absence fails the run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from airflow.sdk.exceptions import AirflowSkipException

#: service -> (its default connection, what the service is called in messages)
SERVICES = {
    "rabbitmq": ("rabbitmq_default", "RabbitMQ"),
    "sqs": ("aws_default", "Amazon SQS"),
    "spark": ("spark_default", "Spark"),
}


def skip_unless_set_up(service: str, conn_id: str | None = None) -> Callable[[Any], None]:
    """A `pre_execute` callable that skips the task when `service` ("rabbitmq", "sqs" or "spark") is not set up.

    - rabbitmq: the connection `conn_id` (default `rabbitmq_default`) is defined;
    - sqs: the connection (default `aws_default`) is defined, or boto3 finds a region in the environment (the
      amazon provider then works without a connection, from the environment's credentials);
    - spark: the connection (default `spark_default`) is defined, or this worker can run a local Spark
      (spark-submit and Java; the sweep then runs on `local[2]`).
    """
    if service not in SERVICES:
        raise ValueError(f"service {service!r} is not one of {sorted(SERVICES)}")
    conn_id = conn_id or SERVICES[service][0]

    def check(context: Any = None) -> None:
        problem = missing(service, conn_id)
        if problem is not None:
            raise AirflowSkipException(f"Skipped: {SERVICES[service][1]} is not set up ({problem}). "
                                       f"{how_to_set_up(service, conn_id)}")

    check.__name__ = f"skip_unless_{service}_set_up"
    return check


def missing(service: str, conn_id: str) -> str | None:
    """What is missing for `service`, or None when it is set up (see skip_unless_set_up)."""
    if _defined(conn_id):
        return None
    absent = f"no connection {conn_id!r}"
    if service == "sqs":
        try:
            import boto3
        except ImportError:
            return f"{absent}, and boto3 is not installed: pip install 'airflow-delay-provider[amazon]'"
        if boto3.session.Session().region_name:
            return None
        return f"{absent}, and no AWS region in the environment"
    if service == "spark":
        try:
            from airflow_delay_provider.spark.setup import SparkSetupError, check_machine
        except ImportError:
            return f"{absent}, and PySpark is not installed: pip install 'airflow-delay-provider[spark]'"
        try:
            check_machine(uses_jdbc=False)
        except SparkSetupError as exc:
            return f"{absent}, and no local Spark on this worker: {exc}"
        return None
    return absent


def how_to_set_up(service: str, conn_id: str) -> str:
    """How to set `service` up: the connection as the environment variable every Airflow component reads."""
    var = f"AIRFLOW_CONN_{conn_id.upper()}"
    examples = {
        "rabbitmq": {"conn_type": "rabbitmq", "host": "rabbitmq", "port": 5672, "login": "...", "password": "..."},
        "sqs": {"conn_type": "aws", "extra": {"region_name": "eu-west-1"}},
        "spark": {"conn_type": "spark", "host": "spark://spark-master:7077"},
    }
    extra = {
        "rabbitmq": "",
        "sqs": " (credentials from the environment or the machine's role, or \"login\": an access key id and "
               "\"password\": its secret key)",
        "spark": " to run on a cluster",
    }
    return (f"To run it, define the connection {conn_id!r} for every Airflow component, for example "
            f"{var}='{json.dumps(examples[service])}'{extra[service]}, or in the UI under Admin > Connections")


def _defined(conn_id: str) -> bool:
    """Whether Airflow finds the connection (a secrets backend that fails reads as not found, as Airflow says)."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return False
    return True
