"""Send a delayed message from the Airflow UI: the trigger form asks for everything and checks it."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_delay_provider.dag_params import deliver_at_param, delivery_policy_param, reject_unknown_conf
from airflow_delay_provider.operators.send import SendDelayedMessageOperator

with DAG(
    dag_id="delay_manual_send",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["delay", "manual"],
    default_args={"pre_execute": reject_unknown_conf},
    params={
        "transport": Param("sql", enum=["sql", "rabbitmq", "sqs"], title="Transport",
                           description="sql: the delayed-message store; rabbitmq/sqs: the broker's own delays"),
        "destination": Param("demo.orders", type="string", minLength=1, maxLength=199,
                             pattern=r"^[^\s*#]+$", title="Destination queue"),
        "body": Param('{"order": 1}', type="string", title="Body", description="Sent as UTF-8 text"),
        "delay_seconds": Param(60, type="integer", minimum=0, maximum=315576000, title="Delay (seconds)",
                               description="0..604800 (7 days), or up to the store connection's max_delay_seconds "
                                           "(at most ten years); ignored when Deliver at is set"),
        "deliver_at": deliver_at_param(),
        "queue_delay_seconds": Param(None, type=["null", "integer"], minimum=0, maximum=315576000,
                                     title="Queue-level delay", description="Applies when the message has none"),
        # A built-in's name or a policy as JSON, stored for the destination (sql transport).
        "retry_policy": delivery_policy_param(),
        "message_id": Param(None, type=["null", "string"], minLength=1, maxLength=200, title="Message id",
                            description="Empty: one derived from this run. Give one to address a message sent before"),
        "on_duplicate": Param("skip", enum=["skip", "replace", "keep_earliest", "replace_body"],
                              title="If the id is already scheduled",
                              description="skip: leave it; replace: this send's time and body replace it (a "
                                          "debounce); keep_earliest: the one due first stays; replace_body: new body, "
                                          "same time. Only skip for rabbitmq/sqs"),
    },
    doc_md="""
### Send a delayed message by hand

Trigger this DAG from the UI: the form refuses a delay outside 0..315,576,000 s (ten years; the store
connection's `max_delay_seconds`, 7 days by default, is checked when the task runs), an empty destination or
one with spaces, `*` or `#`, an unknown transport, a deliver-at that is not a timestamp with a timezone,
and a retry policy that is neither a built-in's name nor a JSON object (a JSON policy is checked in full
before anything is sent); a run
triggered with a conf key that is not one of these fields (a typo such as `delay`) fails before
anything is sent. The task returns the message id. With a **message id** of a message still scheduled,
**If the id is already scheduled** says what this send does to it: `replace` moves it to this send's time
with this body (send it again on each activity for "remind me 30 minutes after the last one"),
`keep_earliest` keeps whichever is due first, `replace_body` changes the body only; `skip` leaves it. A
message already delivered is not sent again within the store's de-duplication window, whatever the mode.
With `transport=sql` the message waits in the store (connection `delay_store_default`) until a dispatcher
sends it when due
(`delay_continuous_dispatch`); with `rabbitmq` or `sqs` the broker delays it itself (connections
`rabbitmq_default`, `aws_default`).
""",
) as dag:
    SendDelayedMessageOperator(
        task_id="send",
        transport="{{ params.transport }}",
        destination="{{ params.destination }}",
        body="{{ params.body }}",
        delay_seconds="{{ '' if params.deliver_at else params.delay_seconds }}",
        deliver_at="{{ params.deliver_at or '' }}",
        queue_delay_seconds="{{ params.queue_delay_seconds if params.queue_delay_seconds is not none else '' }}",
        delivery_policy="{{ '' if params.retry_policy == 'task default' else params.retry_policy }}",
        message_id="{{ params.message_id or '' }}",
        on_duplicate="{{ params.on_duplicate }}",
    )
