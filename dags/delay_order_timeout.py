"""An order timeout: place an order, schedule a cancellation check, and take the check back when the order is paid."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta

from airflow.sdk import DAG, Param, task

from airflow_delay_provider.dag_params import reject_unknown_conf
from airflow_delay_provider.operators.backlog import CancelDelayedMessagesOperator
from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator
from airflow_delay_provider.operators.provision import ProvisionDelayInfrastructureOperator
from airflow_delay_provider.operators.send import SendDelayedMessageOperator

QUEUE = "orders.cancel-check"


def _orders():
    """The shop's order table, here in the embedded database beside the delay store."""
    from sqlalchemy import Column, MetaData, String, Table

    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    store = DelayStoreHook().get_store()
    table = Table("demo_orders", MetaData(), Column("order_id", String(64), primary_key=True),
                  Column("status", String(16), nullable=False))
    table.metadata.create_all(store.engine)
    return store.engine, table


with DAG(
    dag_id="delay_order_timeout",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["delay", "example"],
    default_args={"pre_execute": reject_unknown_conf},
    params={
        "timeout_seconds": Param(5, type="integer", minimum=1, maximum=604800, title="Payment timeout (s)"),
        "pay": Param(False, type="boolean", title="Pay the order before the timeout"),
    },
    doc_md="""
### Cancel an unpaid order after a timeout; take the timeout back when it is paid

1. **place_order** records an order as `unpaid`.
2. **schedule_check** sends a cancellation check for the order, delayed by `timeout_seconds`; its
   XCom is the check's message id.
3. **paid_in_time** branches on `pay` (the customer paying before the timeout):
   - paid: **pay_order** marks the order paid and **cancel_check** cancels the scheduled check by its
     message id, so it is never delivered. Its report says whether the cancel won: `cancelled`, or
     `gone` when the check had already been delivered (the payment came too late).
   - unpaid: **dispatch** delivers the check when it is due (deferring meanwhile), and
     **cancel_if_unpaid** consumes it and cancels the order if it is still unpaid. The check carries
     the order id and the status condition, so a check delivered twice, or after a late payment,
     changes nothing.
""",
) as dag:
    provision = ProvisionDelayInfrastructureOperator(task_id="provision", endpoints=[QUEUE])

    @task
    def place_order(run_id: str | None = None) -> str:
        engine, orders = _orders()
        order_id = "order-" + hashlib.sha1(run_id.encode()).hexdigest()[:12]
        with engine.begin() as conn:
            conn.execute(orders.delete().where(orders.c.order_id == order_id))
            conn.execute(orders.insert().values(order_id=order_id, status="unpaid"))
        return order_id

    @task.branch
    def paid_in_time(params: dict | None = None) -> str:
        return "pay_order" if params["pay"] else "dispatch"

    @task
    def pay_order(order_id: str) -> str:
        engine, orders = _orders()
        with engine.begin() as conn:
            conn.execute(orders.update().where(orders.c.order_id == order_id).values(status="paid"))
        return order_id

    order = place_order()
    check = SendDelayedMessageOperator(
        task_id="schedule_check",
        destination=QUEUE,
        body='{"order_id": "{{ ti.xcom_pull(task_ids=\'place_order\') }}"}',
        delay_seconds="{{ params.timeout_seconds }}",
    )
    dispatch = DispatchDueMessagesOperator(
        task_id="dispatch",
        destinations=[QUEUE],  # this shop's checks only: other DAGs' messages are theirs to dispatch
        due_before="{{ ti.xcom_pull(task_ids='schedule_check', key='due_before') }}",  # the check's due time
        deferrable=True,
        max_runtime=timedelta(hours=1),
    )

    @task
    def cancel_if_unpaid(order_id: str) -> dict:
        from airflow_delay_provider.hooks.delay_store import DelayStoreHook

        engine, orders = _orders()
        transport = DelayStoreHook().get_transport()
        outcome = None
        for message in transport.receive(QUEUE, max_messages=100):
            checked = json.loads(message.body)["order_id"]
            with engine.begin() as conn:
                cancelled = conn.execute(
                    orders.update().where(orders.c.order_id == checked, orders.c.status == "unpaid")
                    .values(status="cancelled")
                ).rowcount
            transport.ack(QUEUE, [message.receipt])
            if checked == order_id:
                outcome = "cancelled" if cancelled else "left alone"
        with engine.connect() as conn:
            status = conn.execute(orders.select().where(orders.c.order_id == order_id)).one().status
        return {"order_id": order_id, "check": outcome, "status": status}

    cancel_check = CancelDelayedMessagesOperator(
        task_id="cancel_check",
        message_ids="{{ ti.xcom_pull(task_ids='schedule_check') }}",
    )

    paid = pay_order(order)
    provision >> order >> check >> paid_in_time() >> [paid, dispatch]
    paid >> cancel_check
    dispatch >> cancel_if_unpaid(order)
