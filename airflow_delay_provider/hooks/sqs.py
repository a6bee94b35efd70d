"""SqsDelayHook: the amazon provider's SqsHook, opening the SQS delay transport on an `aws` connection."""

from __future__ import annotations

from typing import Any

from airflow.providers.amazon.aws.hooks.sqs import SqsHook

from airflow_delay_provider.transports.sqs import NATIVE_MAX_DELAY, SqsTransport


class SqsDelayHook(SqsHook):
    """An SqsHook (same `aws` connection: credentials, region, `endpoint_url`) that also builds the transport."""

    def get_transport(self, prefix: str = "", queue_delay: int = NATIVE_MAX_DELAY, **options: Any) -> SqsTransport:
        return SqsTransport(self.get_conn(), prefix=prefix, queue_delay=queue_delay, **options)
