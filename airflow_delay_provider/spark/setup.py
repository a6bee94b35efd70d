"""Submitting the bulk sweep application: what spark-submit needs on the machine (checked before
submitting), the application's arguments and environment, and what its record in the store says.

Each machine check fails with `SparkSetupError` saying how to install what is missing, rather than
letting spark-submit fail later with a Java stack trace. Nothing here is an operator: BulkSweepOperator
calls these, and so can a script that submits `sweep_app.py` by hand. The Pythons the driver and executors
run are chosen in `airflow_delay_provider.spark.pythons`, where the connections go in `.secret`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from airflow_delay_provider.core.errors import DelayProviderError, InvalidInputError
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


@dataclass(frozen=True)
class SparkTarget:
    """Where spark-submit sends the sweep: the master as the Spark provider passes it, and the deploy mode."""

    master: str
    deploy_mode: str = "client"

    @property
    def local(self) -> bool:
        return self.master.startswith("local")

    @property
    def cluster_mode(self) -> bool:
        return self.deploy_mode == "cluster"

    @property
    def kind(self) -> str:
        if self.local:
            return "local"
        if self.master.startswith("spark://"):
            return "standalone"
        if self.master.startswith("k8s://"):
            return "kubernetes"
        return "yarn" if self.master.startswith("yarn") else "other"

    def master_hosts(self) -> list[tuple[str, int]]:
        """(host, port) of each master of a standalone cluster (several with ZooKeeper recovery)."""
        if self.kind != "standalone":
            return []
        hosts = []
        for part in self.master[len("spark://"):].split(","):
            host, _, port = part.strip().rpartition(":")
            hosts.append((host.strip("[]"), int(port or 7077)) if host else (part.strip(), 7077))
        return hosts

    @property
    def one_host(self) -> bool:
        """Every executor runs on this machine: a local master, or a standalone master on loopback."""
        return self.local or bool(self.master_hosts()) and all(is_loopback(h) for h, _ in self.master_hosts())


def resolve_target(conn_id: str, master: str | None, deploy_mode: str | None = None) -> SparkTarget:
    """The Spark connection `conn_id` as spark-submit will use it. When no secrets backend defines it, it is
    defined (in this process's environment) on `master`: a missing connection makes the Spark provider fall
    back to YARN. A connection a backend fails to read (a secrets backend down, a malformed value) fails the
    task, as does a missing one when `master` is None: running a cluster's sweep on this machine instead
    would be a surprise, and a slow one."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        # Airflow reports a backend that failed as a connection not found: ask each backend again.
        failed = _failing_backends(conn_id)
        if failed:
            raise SparkSetupError(
                f"the Spark connection {conn_id!r} could not be read ({'; '.join(failed)}): fix the connection "
                f"or its secrets backend; the sweep runs on a local master only when no connection {conn_id!r} "
                f"is defined") from None
        if master is None:
            raise SparkSetupError(f"the Spark connection {conn_id!r} is not defined (and master=None: no "
                                  f"fallback): define it, or pass master='local[2]' to run on this machine") from None
        log.info("No Spark connection %r: running on %s", conn_id, master)
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps({"conn_type": "spark", "host": master})
    # The master and deploy mode exactly as the provider's hook builds spark-submit's command from them.
    resolved = SparkSubmitHook(conn_id=conn_id, deploy_mode=deploy_mode)._connection
    return SparkTarget(resolved["master"], resolved["deploy_mode"] or "client")


def _failing_backends(conn_id: str) -> list[str]:
    """The secrets backends that raise when asked for `conn_id`, by name and error type (an error's text
    could quote the value, which may hold a secret)."""
    try:
        from airflow.sdk.execution_time.supervisor import ensure_secrets_backend_loaded

        backends = ensure_secrets_backend_loaded()
    except Exception:  # an Airflow without this entry point: nothing more to learn
        return []
    failed = []
    for backend in backends:
        try:
            backend.get_connection(conn_id=conn_id)
        except Exception as exc:
            failed.append(f"{type(backend).__name__} raised {type(exc).__name__}")
    return failed


def check_master_reachable(target: SparkTarget, conn_id: str, timeout: float = 5.0) -> None:
    """Fail at once, saying so, when no master of a standalone cluster accepts connections (spark-submit
    would retry for a minute, then fail with a stack trace)."""
    hosts = target.master_hosts()
    errors = []
    for host, port in hosts:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc.strerror or exc}")
    if hosts:
        raise SparkSetupError(
            f"the Spark master {target.master} (connection {conn_id!r}) is unreachable ({'; '.join(errors)}): "
            f"start it, or point the connection at a running master")


LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def unreachable_hosts(store: dict, transport: dict) -> list[str]:
    """What in the store's and transport's specs only this machine reaches: loopback hosts, Unix sockets,
    SQLite files. Executors connect to the store and the broker themselves, from the cluster's nodes."""
    from sqlalchemy.engine import make_url

    found = []

    def database(what: str, raw: str) -> None:
        url = make_url(raw)
        if url.get_backend_name() == "sqlite":
            found.append(f"the {what} is a SQLite file on this machine ({url.database})")
        elif not url.host:
            found.append(f"the {what} connects through a Unix socket on this machine (its URL has no host)")
        elif is_loopback(url.host):
            found.append(f"the {what}'s host {url.host!r} is a loopback address")

    database("store", store["url"])
    kind = transport.get("kind")
    if kind == "sql":
        database("SQL transport", transport["url"])
    elif kind == "rabbitmq" and (is_loopback(transport.get("host")) or not transport.get("host")):
        default = "" if transport.get("host") else " (the default)"
        found.append(f"the RabbitMQ host {transport.get('host') or '127.0.0.1'!r}{default} is a loopback address")
    elif kind == "sqs":
        endpoint = (transport.get("client") or {}).get("endpoint_url")
        if endpoint and is_loopback(urlsplit(endpoint).hostname):
            found.append(f"the SQS endpoint {endpoint!r} is a loopback address")
    return found


def check_reachable_hosts(target: SparkTarget, store: dict, transport: dict, allow_loopback_hosts: bool) -> None:
    """Refuse a cluster sweep whose executors could not reach the store or broker (see unreachable_hosts)."""
    if target.one_host or allow_loopback_hosts:
        return
    found = unreachable_hosts(store, transport)
    if found:
        raise InvalidInputError(
            f"the sweep runs on {target.master}, whose executors connect to the store and the broker from other "
            f"machines, but {'; '.join(found)}: give the connections host names the cluster's nodes can reach, "
            f"or pass allow_loopback_hosts=True if every executor runs on this machine")


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
    secret_file: str | None = None,
) -> list[str]:
    """The command line of `sweep_app.py` (see `airflow_delay_provider.spark.sweep.parse_args`); policies
    as dicts. No secret goes here, only the path of the file that holds them: spark-submit and Airflow
    log the arguments, and `ps` shows them."""
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
    if secret_file is not None:
        args += ["--secret-file", secret_file]
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
