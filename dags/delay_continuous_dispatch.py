"""Deliver every stored message at its due time: the pump runs in the triggerer, always on."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator

INTERVAL = timedelta(minutes=10)

with DAG(
    dag_id="delay_continuous_dispatch",
    schedule=INTERVAL,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    # Each run dispatches a little longer than the interval, so the next one is up before it stops:
    # there is always a dispatcher, and two at once share the store safely (claims skip locked rows).
    max_active_runs=2,
    default_args={"retries": 3, "retry_delay": timedelta(seconds=10)},
    params={
        "dispatch_seconds": Param(int((INTERVAL + timedelta(minutes=1)).total_seconds()), type="integer", minimum=1,
                                  maximum=86_400, title="Dispatch for (seconds)",
                                  description="How long this run dispatches; scheduled runs overlap the next one"),
    },
    tags=["delay", "dispatch"],
    doc_md="""
### Continuous dispatch

Unpause this DAG and every message in the store (connection `delay_store_default`) is delivered at
its due time, to within milliseconds. Each run's task defers at once: the dispatch pump runs in the
triggerer, sleeping until the next due time (woken by LISTEN/NOTIFY on PostgreSQL when a sooner
message is stored), so no worker slot is held while waiting and no message waits for a task to be
resumed. Runs start every ten minutes and dispatch for eleven, so one is always running; the task
resumes only to report its counts (dispatched, retried, dead-lettered, lateness p50/p99, per
destination). A manual run dispatches for `dispatch_seconds`.

To serve only some destinations (one store, several teams), set `destinations=[...]` or
`destination_prefix="team-a."`; for a SQL-table destination in another database, RabbitMQ or SQS, set
`transport` and `transport_conn_id` as on every operator of this provider.
""",
) as dag:
    DispatchDueMessagesOperator(
        task_id="dispatch",
        deferrable=True,
        max_runtime="{{ params.dispatch_seconds }}",
        delivery_policy="http",
    )
