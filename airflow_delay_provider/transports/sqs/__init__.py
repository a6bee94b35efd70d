"""Amazon SQS delays: native up to 15 minutes, longer ones through each endpoint's delay queue and its relay.

One module per role: `transport` (`SqsTransport`: provisioning, sending, receiving), `naming` (queue names,
FIFO id rules, delay plans and their cost), `bodies` (body encoding, and bodies too large for SQS kept in S3),
`relay` (the consumer of the delay queues) and `wire` (the message attributes and AWS errors they share).
The names below are what other code imports from here.
"""

from airflow_delay_provider.core.errors import missing_extra

try:
    import botocore  # noqa: F401
except ImportError as error:  # installed without the [amazon] extra
    raise missing_extra("amazon", error) from error

# After the check above, each import names what it takes (the reference resolves them).
from airflow_delay_provider.transports.sqs.naming import (  # noqa: E402
    DELAY_QUEUE_SUFFIX,
    FIFO_DELAY_QUEUE_SUFFIX,
    HEADER_MESSAGE_GROUP,
    MAX_QUEUE_NAME,
    NATIVE_MAX_DELAY,
    DelayPlan,
    check_message_group_id,
    check_queue_name,
    delay_plan,
    delay_queue_name,
    estimate_cost,
)
from airflow_delay_provider.transports.sqs.relay import RelayCounts  # noqa: E402
from airflow_delay_provider.transports.sqs.transport import MAX_BATCH_BYTES, SqsTransport  # noqa: E402
from airflow_delay_provider.transports.sqs.wire import ATTR_MESSAGE_ID, BATCH_SIZE  # noqa: E402

__all__ = [
    "ATTR_MESSAGE_ID",
    "BATCH_SIZE",
    "DELAY_QUEUE_SUFFIX",
    "FIFO_DELAY_QUEUE_SUFFIX",
    "HEADER_MESSAGE_GROUP",
    "MAX_BATCH_BYTES",
    "MAX_QUEUE_NAME",
    "NATIVE_MAX_DELAY",
    "DelayPlan",
    "RelayCounts",
    "SqsTransport",
    "check_message_group_id",
    "check_queue_name",
    "delay_plan",
    "delay_queue_name",
    "estimate_cost",
]
