"""Dispatch due messages every five minutes; each run sweeps exactly its data interval."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG

from airflow_delay_provider.operators.delay import DispatchDueMessagesOperator

with DAG(
    dag_id="delay_scheduled_sweep",
    schedule=timedelta(minutes=5),
    start_date=datetime(2026, 1, 1),
    catchup=True,
    max_active_runs=4,
    tags=["delay", "scheduled"],
    doc_md="""
### Scheduled sweep of the delayed-message store

Every five minutes a run dispatches the messages due before the end of its data interval
(`due_before = data_interval_end`), deferring in the triggerer until each is due. With catchup on,
runs missed during downtime are created and each sweeps only its own interval, so a backfill
(`airflow backfill create --dag-id delay_scheduled_sweep ...`) dispatches nothing twice: a message
belongs to the one interval its due time falls in, and a delivered message is gone from the store.
Retries follow the `http` default policy; change `delivery_policy` for others.
""",
) as dag:
    DispatchDueMessagesOperator(
        task_id="dispatch",
        due_before="{{ data_interval_end }}",
        deferrable=True,
        max_runtime=timedelta(minutes=30),
        delivery_policy="http",
    )
