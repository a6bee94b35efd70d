"""Delayed DAG runs written the common way: an asset watched by Airflow's MessageQueueTrigger, scheme `delay`."""

from __future__ import annotations

import itertools
from datetime import datetime

from airflow.sdk import DAG, Asset, AssetWatcher, task

from airflow_delay_provider.extras import optional_feature_error
from airflow_delay_provider.triggers.asset import dag_run_asset_name, message_payloads

try:
    from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
except ImportError as error:  # the [messaging] extra: the error says which pip line brings it
    raise optional_feature_error("messaging", error) from error

DAG_ID = "delay_message_queue_target"
# The asset ScheduleDagRunOperator(dag_id=DAG_ID) sends to: `delayed_dag_run.delay_message_queue_target`.
ASSET = dag_run_asset_name(DAG_ID)

due_messages = Asset(ASSET, watchers=[AssetWatcher(
    name=f"{ASSET}.due_messages",
    # One run per due message: the next is handed over once the previous one's run exists.
    trigger=MessageQueueTrigger(scheme="delay", destination=ASSET, run_dag_id=DAG_ID),
)])

with DAG(
    dag_id=DAG_ID,
    schedule=[due_messages],
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["delay", "example"],
    doc_md="""
### Delayed runs through Airflow's common message-queue trigger

The asset `delayed_dag_run.delay_message_queue_target` is watched by
`MessageQueueTrigger(scheme="delay", destination=..., run_dag_id=...)`, the event-driven form Airflow's
providers share (`apache-airflow-providers-common-messaging`, this package's `[messaging]` extra). Behind the
`delay` scheme is the same trigger as `dag_run_asset()`'s: each message due on the store's destination
`airflow.asset.delayed_dag_run.delay_message_queue_target` becomes an asset event at its due time, and so
a run of this DAG. `ScheduleDagRunOperator(dag_id="delay_message_queue_target", conf=..., delay_seconds=...)`
schedules one; `destination` may also name any asset (`"order_timeout"` watches `airflow.asset.order_timeout`).

Unpause this DAG: while it is paused, Airflow runs no watcher for its asset and the messages wait in the store.
""",
) as dag:

    @task
    def handle(triggering_asset_events=None) -> list[dict]:
        handled = []
        for payload in message_payloads(itertools.chain(*triggering_asset_events.values())):
            print(f"message {payload['message_id']} due {payload['due_at']}: {payload['body']}")
            handled.append({"message_id": payload["message_id"], "due_at": payload["due_at"]})
        return handled

    handle()
