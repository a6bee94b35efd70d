"""Sweep each hour's due messages on Spark: the bulk path for backlogs one pump cannot clear."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, DeltaDataIntervalTimetable

from airflow_delay_provider.dag_checks import skip_unless_set_up
from airflow_delay_provider.operators.sweep import BulkSweepOperator

with DAG(
    dag_id="spark_bulk_sweep",
    schedule=DeltaDataIntervalTimetable(timedelta(hours=1)),  # a real one-hour window per run
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["delay", "spark", "scheduled"],
    doc_md="""
### Bulk sweep on Spark

Each run dispatches the messages due in its data interval (`due_from = data_interval_start`,
`due_before = data_interval_end`) with a PySpark application submitted by the Spark provider's
`SparkSubmitOperator`:

1. the rows are claimed under a lease (the pump and other sweeps leave them alone; a crashed
   sweep's rows are taken over when its lease expires);
2. parallel partitions each lease their own id range of the window and read it with their own
   connections (the direct reader, the default); rows bound for SQL-table queues of the store's
   database are moved batch by batch in one statement, never read;
3. each partition sends its messages through the transport with the delivery policy
   (delivered: removed; failed: rescheduled; exhausted: the `error` queue);
4. the task returns counts per destination and outcome, and rows/s.

The Spark connection `spark_default` says where it runs: `local[2]` when no connection of that name
is defined; a `spark://` master, `k8s://` or `yarn` otherwise. On a cluster the nodes need only Java
and a Python of the Airflow worker's minor version (the task ships the executors an archive of what
they run), and must reach the store and the broker by the connections' host names. Unpausing sweeps the latest hour only
(`catchup=False`); past hours are swept with `airflow backfill create --dag-id spark_bulk_sweep
--from-date ... --to-date ...`, one run per hour, which is safe: delivered messages are gone from the
store, so a re-run of a window dispatches nothing twice. A manual run (no data interval) sweeps
everything already due. Without `spark_default` on a worker that cannot run a local Spark (no Java, no
spark-submit) the sweep is skipped, its log saying what to install or define; remove the check
(`pre_execute`) where the sweep must run.
""",
) as dag:
    BulkSweepOperator(
        task_id="sweep",
        due_from="{{ data_interval_start if data_interval_start is defined else '' }}",
        due_before="{{ data_interval_end if data_interval_end is defined else dag_run.run_after }}",
        delivery_policy="http",
        driver_memory="1g",
        conf={"spark.ui.enabled": "false"},
        pre_execute=skip_unless_set_up("spark"),
    )
