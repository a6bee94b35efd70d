"""Demo: provision, send a batch with 1-5 s delays, dispatch them (deferring until due), verify exactly once."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param, task

from airflow_delay_provider.dag_params import reject_unknown_conf
from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator
from airflow_delay_provider.operators.provision import ProvisionDelayInfrastructureOperator
from airflow_delay_provider.operators.send import SendDelayedMessageOperator

QUEUE = "demo.orders"

with DAG(
    dag_id="demo_delayed_delivery",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["delay", "demo"],
    default_args={"pre_execute": reject_unknown_conf},
    params={
        "count": Param(200, type="integer", minimum=1, maximum=100_000, title="Messages to send"),
        "max_delay": Param(5, type="integer", minimum=1, maximum=600, title="Largest delay (seconds)"),
    },
    doc_md="""
### Delayed delivery, end to end, on the embedded store

1. **provision** creates the delayed-message store and the `demo.orders` queue in the store named by
   the connection `delay_store_default` (`make demo` points it at a SQLite file).
2. **send** stores `count` messages with delays of 1..`max_delay` seconds.
3. **dispatch** defers at once: the triggerer runs the pump, delivering each message at its due time,
   until every one of them is delivered; the task resumes only to report.
4. **verify** consumes the queue and checks that every message arrived exactly once, not early,
   and reports lateness p50/p99.
""",
) as dag:
    provision = ProvisionDelayInfrastructureOperator(task_id="provision", endpoints=[QUEUE])

    @task
    def plan(params: dict | None = None) -> list[dict]:
        rng = random.Random(42)
        return [
            {"body": json.dumps({"order": n}), "delay_seconds": rng.uniform(1, params["max_delay"])}
            for n in range(params["count"])
        ]

    send = SendDelayedMessageOperator(task_id="send", destination=QUEUE, messages=plan())

    dispatch = DispatchDueMessagesOperator(
        task_id="dispatch",
        destinations=[QUEUE],  # the demo's own messages, whatever else the store holds
        # Just past the last due time the send stored (its XCom `due_before`): a fixed window, the same when
        # the task resumes after its deferral, whenever the tasks got a slot.
        due_before="{{ ti.xcom_pull(task_ids='send', key='due_before') }}",
        deferrable=True,  # the pump runs in the triggerer; the task resumes once, to report
        max_runtime=timedelta(minutes=5),
    )

    @task
    def verify(sent: list[str], dispatched: dict) -> dict:
        from airflow_delay_provider.hooks.delay_store import DelayStoreHook

        transport = DelayStoreHook().get_transport()
        received = []
        while batch := transport.receive(QUEUE, max_messages=1000):
            received.extend(batch)
            transport.ack(QUEUE, [m.receipt for m in batch])
        ids = [m.message_id for m in received]
        lateness = sorted((m.enqueued_at - m.due_at).total_seconds() for m in received)
        early = [m.message_id for m in received if m.enqueued_at < m.due_at]

        def pct(p: float) -> float | None:
            return round(lateness[min(len(lateness) - 1, int(p / 100 * len(lateness)))], 3) if lateness else None

        report = {
            "sent": len(sent),
            "delivered": len(set(ids) & set(sent)),
            "duplicates": len(ids) - len(set(ids)),
            "missing": len(set(sent) - set(ids)),
            "early": len(early),
            "lateness_p50_seconds": pct(50),
            "lateness_p99_seconds": pct(99),
            "dispatched_in": dispatched["dispatched_in"],
        }
        print("DEMO REPORT " + json.dumps(report))
        if report["missing"] or report["duplicates"] or report["early"]:
            raise RuntimeError(f"delivery was not exactly once and on time: {report}")
        return report

    provision >> send >> dispatch >> verify(send.output, dispatch.output)
