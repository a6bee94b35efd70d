"""Relay SQS delays longer than 15 minutes: one bounded, deferrable relay task per endpoint, every 10 minutes."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG

from airflow_delay_provider.operators.delay import RelayDelayedMessagesOperator

ENDPOINTS = ["orders"]

with DAG(
    dag_id="delay_sqs_relay",
    schedule=timedelta(minutes=10),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["delay", "sqs"],
    doc_md="""
### The SQS relay

For each endpoint with unrestricted delays, a task long-polls its `-delay.fifo` queue for up to ten
minutes, sending each message back for another 15-minute cycle or on to the endpoint with the rest
of its delay. While the delay queue has nothing to relay the task waits in the triggerer. Runs do
not overlap (`max_active_runs=1`); a run that was missed is not made up (`catchup=False`), since the
delay queue keeps its messages for 4 days.
""",
) as dag:
    for endpoint in ENDPOINTS:
        RelayDelayedMessagesOperator(
            task_id=f"relay_{endpoint}",
            endpoint=endpoint,
            max_runtime=timedelta(minutes=10),
            deferrable=True,
        )
