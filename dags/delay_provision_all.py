"""Provision every transport's delay infrastructure from one config: SQL store, RabbitMQ levels, SQS queues."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG

from airflow_delay_provider.dag_checks import skip_unless_set_up
from airflow_delay_provider.operators.provision import ProvisionDelayInfrastructureOperator

#: The one place that says what exists. Each key is a transport; a transport left out is not touched.
CONFIG = {
    "sql": {
        "endpoints": ["orders.cancel", "billing.retry"],
        "destination_policies": {"billing.retry": "http"},
    },
    "rabbitmq": {
        "transport_conn_id": "rabbitmq_default",
        "endpoints": ["orders.cancel", "billing.retry"],
    },
    "sqs": {
        "transport_conn_id": "aws_default",
        "transport_options": {"prefix": "prod-"},
        "endpoints": ["orders-cancel"],
        "endpoint_options": {"unrestricted": True},
    },
}

with DAG(
    dag_id="delay_provision_all",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["delay", "provisioning"],
    doc_md="""
### Provision all transports from one config

`CONFIG` at the top of this file lists, per transport, the endpoints to create and their options;
one task per transport creates what is missing and leaves the rest alone (every step is
idempotent, so re-running is safe):

- **sql**: the store's tables (messages, policies, sweeps, ...) and a row per endpoint in the
  shared queue tables, plus the `error` queue; `destination_policies` are stored beside the messages, so every
  dispatch task and Spark sweep retries those destinations the same way;
- **rabbitmq**: the 28 delay levels, the delivery exchange with its `unroutable` safety net, the
  poison queue, and each endpoint's queue and binding; then `verify_rabbitmq` checks it all
  without changing anything (it fails the run if something is missing or declared differently);
- **sqs**: each endpoint's queue and, for unrestricted delays, its `-delay.fifo` relay queue.

Trigger it after a deployment or when an endpoint is added. Connections: `delay_store_default`
(the delayed-message store, one for every component), `rabbitmq_default`, `aws_default`. A broker whose
connection is not defined is skipped, its task's log saying how to define it (`skip_unless_set_up`), so
the run succeeds on a deployment with the store only; leave the check out where a broker must be there.
""",
) as dag:
    tasks = {}
    for transport, options in CONFIG.items():
        # The store is always there; a broker is provisioned once its connection is defined.
        check = None if transport == "sql" else skip_unless_set_up(transport, options.get("transport_conn_id"))
        tasks[transport] = ProvisionDelayInfrastructureOperator(
            task_id=f"provision_{transport}", transport=transport, create_store=transport == "sql",
            pre_execute=check, **options
        )
    if "rabbitmq" in CONFIG:
        verify = ProvisionDelayInfrastructureOperator(
            task_id="verify_rabbitmq", transport="rabbitmq", verify=True, create_store=False,
            transport_conn_id=CONFIG["rabbitmq"].get("transport_conn_id"), endpoints=CONFIG["rabbitmq"]["endpoints"],
        )
        tasks["rabbitmq"] >> verify
