"""Relay SQS delays longer than 15 minutes: one bounded, deferrable relay task per endpoint, every 10 minutes."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from airflow_delay_provider.dag_checks import skip_unless_set_up
from airflow_delay_provider.operators.provision import ProvisionDelayInfrastructureOperator
from airflow_delay_provider.operators.sqs import RelayDelayedMessagesOperator

ENDPOINTS = ["orders"]

with DAG(
    dag_id="delay_sqs_relay",
    schedule=timedelta(minutes=10),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    # Without an AWS connection (or region) every task is skipped, its log saying how to define one.
    default_args={"pre_execute": skip_unless_set_up("sqs")},
    max_active_runs=2,  # a manual run can start beside the scheduled one
    params={"relay_seconds": Param(600, type="integer", minimum=1, maximum=86_400, title="Relay for (seconds)")},
    tags=["delay", "sqs"],
    doc_md="""
### The SQS relay

For each endpoint with unrestricted delays, a task long-polls its `-delay.fifo` queue for up to ten
minutes, sending each message back for another 15-minute cycle or on to the endpoint with the rest
of its delay. While the delay queue has nothing to relay the task waits in the triggerer. At most two
runs at once (a manual run beside the scheduled one: two relays share a delay queue safely, each
message being invisible to one while the other holds it); a run that was missed is not made up
(`catchup=False`), since the delay queue keeps its messages for days. The first task makes sure each
endpoint's queues exist (idempotent), so the DAG works on a fresh deployment; connection
`aws_default`. A manual run relays for `relay_seconds`. Until an AWS connection (or a region in the
environment) is there, the tasks are skipped, each log saying how to define it.
""",
) as dag:
    provision = ProvisionDelayInfrastructureOperator(task_id="provision", transport="sqs", endpoints=ENDPOINTS,
                                                     create_store=False)
    for endpoint in ENDPOINTS:
        provision >> RelayDelayedMessagesOperator(
            task_id=f"relay_{endpoint}",
            endpoint=endpoint,
            max_runtime="{{ params.relay_seconds }}",
            deferrable=True,
        )
