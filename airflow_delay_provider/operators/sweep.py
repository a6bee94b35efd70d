"""BulkSweepOperator: the Spark provider's SparkSubmitOperator running the bulk sweep application."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import Context

from airflow_delay_provider import metrics
from airflow_delay_provider.core.checks import check_int, check_number
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.pump import PumpConfig
from airflow_delay_provider.core.requests import parse_moment
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.extras import optional_feature_error
from airflow_delay_provider.operators.base import DelayOperatorBase
from airflow_delay_provider.spark import sweep as sweep_app
from airflow_delay_provider.spark.pythons import executor_setup
from airflow_delay_provider.spark.secret import SecretFile, driver_secret
from airflow_delay_provider.spark.setup import (
    SparkSetupError,
    application_args,
    check_machine,
    check_master_reachable,
    check_reachable_hosts,
    finished_summary,
    resolve_target,
)

try:
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
except ImportError as error:  # installed without the [spark] extra
    raise optional_feature_error("spark", error) from error

__all__ = ["APPLICATION", "READERS", "BulkSweepOperator", "SparkSetupError"]  # SparkSetupError: its old home

APPLICATION = str(Path(sweep_app.__file__).with_name("sweep_app.py"))
READERS = sweep_app.READERS


class BulkSweepOperator(DelayOperatorBase, SparkSubmitOperator):
    """Dispatch the due messages of a window on Spark: every message due in [due_from, due_before)
    (and already due) is claimed under a lease and sent by parallel partitions through the transport
    with the delivery policy; the task returns the sweep's summary (counts per destination
    and outcome, rows/s).

    Safe to re-run for the same window (catchup, backfill): delivered messages are gone from the
    store, so a re-run dispatches nothing twice. When the task is killed (marked failed, or its worker
    stops it), spark-submit is stopped and the sweep's rows are released at once instead of at the end
    of the lease.

    Store and transport arguments are those of the other operators (`delay_store_conn_id`, `table`,
    `db_schema`, `transport`, `transport_conn_id`, `transport_options`); the other SparkSubmitOperator
    arguments (`jars`, `conf`, `env_vars`, `archives`, `executor_memory`, ...) pass through; a Python they
    (or PYSPARK_PYTHON in this worker's environment) choose is the one that runs, with the archive of
    `executor_env` on its path. Connection secrets reach the driver in a file
    only its owner can read, deleted when the task ends (in cluster mode on Kubernetes: the Kubernetes
    Secret `connections_secret`), never in an argument or environment variable of any command line nor
    in a file shipped with the application; executors connect to the store and the broker themselves, so
    their hosts must be reachable from the cluster's nodes.

    :param due_before: the end of the window, exclusive: an aware datetime or ISO string (templated);
        required.
    :param due_from: the start of the window, inclusive (templated); default: no lower bound.
    :param delivery_policy: the default delivery policy: a delivery-policy JSON, a dict or a built-in name,
        as DispatchDueMessagesOperator takes; default: `number_of_retries` immediate retries.
    :param destination_policies: `{destination: policy}`; a destination's policy here comes first, then
        the one stored for it (by provisioning or a send), then `delivery_policy`.
    :param number_of_retries: immediate retries (0..100) when no delivery policy applies.
    :param error_queue: where exhausted messages go.
    :param batch_size: messages each partition sends and settles at a time (1..10,000).
    :param partitions: how many partitions read the window in parallel (an int >= 0; default 0: twice
        Spark's default parallelism); a policy's throttle is shared among them.
    :param lease_seconds: how long the claimed rows stay the sweep's without progress (seconds, >= 5;
        default 600): the lease is renewed only while rows are being settled, so a stalled sweep's rows
        go to the next sweep or a pump after this long.
    :param max_duration: stop after this long (seconds or a timedelta; None: no limit), release the
        rows not yet sent and fail the task, so a retry sweeps the rest of the window.
    :param reader: how the partitions get their rows: `"direct"` (what `"auto"`, the default, picks)
        has each partition lease its share of the window and read it from the store with its own
        connection, so no message passes through Spark's JVM; `"jdbc"` and `"python"` lease the whole
        window first and have Spark read it, through `jdbc_jar` (PostgreSQL only) or PySpark's Python
        data source over SQLAlchemy.
    :param jdbc_jar: the PostgreSQL JDBC driver jar for `reader="jdbc"` (default
        /usr/share/java/postgresql.jar, from Debian's libpostgresql-jdbc-java).
    :param master: the Spark master to run on when no secrets backend defines the connection `conn_id`
        (default `local[2]`; None: fail instead); a connection a backend fails to read fails the task.
    :param conn_id: the Spark connection spark-submit uses (default `spark_default`).
    :param executor_env: the Python environment the executors run in: `"auto"` (default) ships an archive
        of this environment's sweep code and drivers (no Airflow; built once and cached) when the master
        is not local, so nodes need only Java and a Python of this minor version (the one PYSPARK_PYTHON or
        `spark.pyspark.python` names, if set); on a local master the executors run this Python. A path or
        URL ships that archive (built with `python -m airflow_delay_provider.spark.environment`); None ships
        nothing (the nodes have it installed).
    :param allow_loopback_hosts: run on a cluster even though the store's or broker's host is a loopback
        address or a local socket or file, which executors on other machines cannot reach (default: refuse).
    :param connections_secret: on Kubernetes in cluster mode, the Kubernetes Secret (in the driver's namespace)
        holding the connections under the key `connections.json` (written by `python -m
        airflow_delay_provider.spark.secret`); the driver's pod mounts it. Without it, and in YARN or standalone
        cluster mode, the task fails before anything is claimed: the connections never go with the application.
    """

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, "due_before", "due_from")
    ui_color = "#f4a460"

    def __init__(
        self,
        *,
        due_before: Any,
        due_from: Any = None,
        delivery_policy: DeliveryPolicy | dict | str | None = None,
        destination_policies: dict[str, DeliveryPolicy | dict | str] | None = None,
        number_of_retries: int = 0,
        error_queue: str = "error",
        batch_size: int = 1000,
        partitions: int = 0,
        lease_seconds: float = 600.0,
        max_duration: float | timedelta | None = None,
        reader: str = "auto",
        jdbc_jar: str = sweep_app.DEFAULT_JDBC_JAR,
        master: str | None = "local[2]",
        conn_id: str = "spark_default",
        executor_env: str | None = "auto",
        allow_loopback_hosts: bool = False,
        connections_secret: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("name", "airflow-delay-sweep")
        super().__init__(application=APPLICATION, conn_id=conn_id, **kwargs)
        if reader not in READERS:
            raise InvalidInputError(f"reader {reader!r} is not supported; choose one of {list(READERS)}")
        check_int("partitions", partitions, 0, hint="0: twice Spark's parallelism")
        check_number("lease_seconds", lease_seconds, 5)
        if isinstance(max_duration, timedelta):
            max_duration = max_duration.total_seconds()
        if max_duration is not None:
            check_number("max_duration", max_duration, above=0, what="a timedelta, None or a number of seconds")
        self.max_duration = max_duration
        self._claim_id: str | None = None
        # Checked when the DAG is parsed, like the dispatch operator's.
        PumpConfig(batch_size=batch_size, number_of_retries=number_of_retries, error_queue=error_queue)
        self._set_policies(delivery_policy, destination_policies)
        self.due_before = due_before
        self.due_from = due_from
        self.number_of_retries = number_of_retries
        self.error_queue = error_queue
        self.batch_size = batch_size
        self.partitions = partitions
        self.lease_seconds = lease_seconds
        self.reader = reader
        self.jdbc_jar = jdbc_jar
        self.master = master
        self.executor_env = executor_env
        self.allow_loopback_hosts = allow_loopback_hosts
        self.connections_secret = connections_secret
        self._secret: SecretFile | None = None

    def execute(self, context: Context) -> dict:
        due_before = parse_moment(self.due_before, "due_before")
        if due_before is None:
            raise InvalidInputError("due_before is required: the end of the window to sweep")
        due_from = parse_moment(self.due_from, "due_from")
        store = self.hook.get_store()
        try:
            claim_id = self._submit(context, store, due_before, due_from)
        finally:
            store.close()
        summary = finished_summary(store.sweep_record(claim_id), claim_id, self.max_duration)
        metrics.count_dispatch(summary)
        self.log.info("Sweep %s: %s", claim_id, json.dumps(summary))
        return summary

    def _submit(self, context: Context, store, due_before, due_from) -> str:
        """Check where the sweep goes, set spark-submit up and run it; returns the claim id."""
        reader = sweep_app.resolve_reader(self.reader, store)
        bin_dir = check_machine(uses_jdbc=reader == "jdbc", jdbc_jar=self.jdbc_jar)
        target = resolve_target(self._conn_id, self.master, self._deploy_mode)
        check_master_reachable(target, self._conn_id)
        store_spec, transport_spec = self.hook.store_spec(), self.transport_spec()
        check_reachable_hosts(target, store_spec, transport_spec, self.allow_loopback_hosts)
        driver = driver_secret(target, self.conf or {}, self.connections_secret)  # before anything is claimed
        pythons = executor_setup(target, self.executor_env, bin_dir, conf=self.conf, env_vars=self.env_vars,
                                 archives=self._archives, with_arrow=reader != "direct")
        self.conf, self.env_vars, self._archives = pythons.conf, pythons.env_vars, pythons.archives
        self.conf = {**self.conf, **driver.conf}
        self.log.info("Spark: %s; %s", pythons.description, driver.description)
        if reader == "jdbc":
            self.jars = ",".join(filter(None, [self.jars, self.jdbc_jar]))

        claim_id = self._claim_id = uuid.uuid4().hex
        secret_file = driver.path
        if secret_file is None:  # the driver runs here, in client mode: a file of its own, never shipped
            self._secret = SecretFile({"store": store_spec, "transport": transport_spec}, claim_id)
            secret_file = self._secret.path
        # Set after templates were rendered, so nothing here is stored as a rendered field.
        self.application_args = application_args(
            claim_id, due_before, due_from, reader=reader, lease_seconds=self.lease_seconds,
            partitions=self.partitions, batch_size=self.batch_size, number_of_retries=self.number_of_retries,
            error_queue=self.error_queue, max_seconds=self.max_duration, secret_file=secret_file,
            destination_policies={d: p.to_dict() for d, p in self.destination_policies.items()},
            delivery_policy=None if self.delivery_policy is None else self.delivery_policy.to_dict())
        self.log.info("Sweeping messages due in [%s, %s) from %r through %s, claim %s",
                      due_from.isoformat() if due_from else "-", due_before.isoformat(), store, self.transport,
                      claim_id)
        try:
            super().execute(context)
        except Exception:
            self._log_record(store, claim_id)
            raise
        finally:
            if self._secret is not None:
                self._secret.remove()
        return claim_id

    def on_kill(self) -> None:
        """Stop spark-submit, then release the sweep's rows now rather than when its lease expires.

        A row a partition is still sending stays locked by it until that batch settles; the release
        waits for it (up to the store's lock_timeout), so no row is both sent and released."""
        super().on_kill()
        if self._secret is not None:
            self._secret.remove()
        if self._claim_id is None:
            return
        store = self.hook.get_store()
        try:
            released = store.finish_sweep(self._claim_id, "killed", {"claim_id": self._claim_id, "status": "killed"})
            self.log.info("Sweep %s killed: %d message(s) released to the dispatchers", self._claim_id, released)
        except Exception as exc:  # the lease still expires
            self.log.warning("Sweep %s killed; its rows are released when its lease expires (%s)", self._claim_id, exc)
        finally:
            store.close()

    def _log_record(self, store, claim_id: str) -> None:
        try:
            record = store.sweep_record(claim_id)
        except Exception as exc:  # the submit's own error matters more
            record = f"unreadable ({exc})"
        self.log.error("Sweep %s failed; its record: %s", claim_id, record or "none (it never started)")
