"""Schedule a DAG run for later with a conf, and take it back: the delayed-run loop of an order timeout."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param, task

from airflow_delay_provider.dag_params import reject_unknown_conf
from airflow_delay_provider.operators.backlog import CancelDelayedMessagesOperator
from airflow_delay_provider.operators.schedule import ScheduleDagRunOperator

with DAG(
    dag_id="delay_dag_run_scheduler",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["delay", "example", "manual"],
    default_args={"pre_execute": reject_unknown_conf},
    params={
        "order_id": Param("order-1", type="string", minLength=1, maxLength=100, title="Order id"),
        "delay_seconds": Param(1800, type="integer", minimum=0, maximum=604800, title="Run the target in (s)",
                               description="0..604800 (7 days): when delay_dag_run_target starts"),
        "paid": Param(False, type="boolean", title="Paid",
                      description="The order is paid right away: the scheduled run is cancelled"),
    },
    doc_md="""
### Run a DAG later: schedule in 30 minutes, cancel when paid

Trigger it from the UI (the form is the manual way to schedule a run later):

1. **schedule_timeout** (`ScheduleDagRunOperator`) schedules a run of `delay_dag_run_target` in
   `delay_seconds` (1,800 s: 30 minutes) with the conf `{"order_id": ...}`; its XCom is the message id.
   Nothing is started now: the message waits in the store, and at its due time the target's asset
   watcher hands it to Airflow, which starts the target.
2. **paid** branches on `paid`: a paid order's **cancel_timeout** (`CancelDelayedMessagesOperator`)
   takes the scheduled run back by its message id, so the target never runs for it (`gone` in its
   report means the run had already been handed over). Moving it or starting it now:
   `RescheduleDelayedMessagesOperator(message_ids=..., delay_seconds=0)`, the CLI
   (`airflow delayed-messages run-now --id ...`) or the Delayed messages page.

Unpause `delay_dag_run_target` first. An unknown target DAG, a conf that is not JSON or a delay outside
0..604,800 s fails the task before anything is stored.
""",
) as dag:
    schedule = ScheduleDagRunOperator(
        task_id="schedule_timeout",
        dag_id="delay_dag_run_target",
        conf={"order_id": "{{ params.order_id }}"},
        delay_seconds="{{ params.delay_seconds }}",
    )

    @task.branch
    def paid(params: dict | None = None) -> str | None:
        return "cancel_timeout" if params["paid"] else None

    cancel = CancelDelayedMessagesOperator(
        task_id="cancel_timeout",
        message_ids="{{ ti.xcom_pull(task_ids='schedule_timeout') }}",
    )

    schedule >> paid() >> cancel
