"""The target of delayed DAG runs: an ordinary asset-scheduled DAG, started once per due message."""

from __future__ import annotations

import itertools
from datetime import datetime

from airflow.sdk import DAG, task

from airflow_delay_provider.triggers.asset import dag_run_asset, message_payloads

with DAG(
    dag_id="delay_dag_run_target",
    schedule=dag_run_asset("delay_dag_run_target"),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["delay", "example"],
    doc_md="""
### The target of a delayed run

Scheduled on `dag_run_asset("delay_dag_run_target")`: the asset `delayed_dag_run.delay_dag_run_target`,
whose watcher (`DueMessageEventTrigger`, in the triggerer) turns each message due on the store's
destination `airflow.asset.delayed_dag_run.delay_dag_run_target` into an asset event at its due time.
`ScheduleDagRunOperator(dag_id="delay_dag_run_target", ...)` (see `delay_dag_run_scheduler`) schedules them.

**cancel_if_unpaid** reads every event of the run from `triggering_asset_events`: usually one, but
Airflow puts events that reach the scheduler before it creates a run into one run, and a triggerer
crash can hand a message over twice. `message_payloads()` keeps one payload per message id; each
payload's `body` is the conf the run was scheduled with, `message_id` identifies it, `due_at` is when
it was due. The action is idempotent (a status condition), so a message handled twice changes nothing.

Unpause this DAG: while it is paused, Airflow runs no watcher for its asset and the messages wait in
the store (the watcher starts when the dag-processor next parses this file after unpausing).
""",
) as dag:

    @task
    def cancel_if_unpaid(triggering_asset_events=None) -> list[dict]:
        handled = []
        for payload in message_payloads(itertools.chain(*triggering_asset_events.values())):
            conf = payload["body"]
            # The shop's real action goes here, keyed by the order (and the message id): idempotent.
            print(f"message {payload['message_id']} due {payload['due_at']}: order {conf.get('order_id')} "
                  f"timed out, cancelling it unless paid")
            handled.append({"message_id": payload["message_id"], "due_at": payload["due_at"], "conf": conf})
        return handled

    cancel_if_unpaid()
