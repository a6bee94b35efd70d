"""What the SQS transport, its relay and its large bodies share: the message attributes the provider
writes and how to read them back, SQS's batch size, and AWS errors turned into one line or a code."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import ClientError

from airflow_delay_provider.core.message import HEADER_DUE_AT

BATCH_SIZE = 10
#: Message attributes the provider writes; everything the caller gave travels in ATTR_HEADERS.
ATTR_MESSAGE_ID = "x-message-id"
ATTR_HEADERS = "x-headers"
ATTR_DUE_AT = HEADER_DUE_AT
ATTR_DELAY = "x-delay-seconds"
ATTR_ENCODING = "x-body-encoding"
ATTR_BODY_S3 = "x-body-s3"
ATTR_CYCLE = "x-relay-cycle"


def _attr(message: dict[str, Any], name: str) -> str | None:
    value = message.get("MessageAttributes", {}).get(name)
    return None if value is None else value.get("StringValue")


def _aws_error(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        return f"{err.get('Code', 'ClientError')}: {err.get('Message', '')}"
    return f"{type(exc).__name__}: {exc}"


def _code(exc: Exception) -> str:
    return exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""
