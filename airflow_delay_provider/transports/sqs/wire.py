"""What the SQS transport, its relay and its large bodies share: the message attributes the provider
writes and how to read them back, SQS's batch size, AWS errors turned into one line or a code, and
requests tried again while SQS throttles them."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as NoAnswerError

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

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The waits (seconds) before each new try of a request SQS throttled or did not answer: about 3 s in all,
#: well inside the visibility timeout of what a relay pass received (30 s by default).
BACKOFF_SECONDS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)

#: Codes (without SQS's prefix and "Exception") of a request SQS did not serve now but may in a moment.
_TRANSIENT_CODES = frozenset({
    "Throttling", "Throttled", "RequestThrottled", "TooManyRequests", "RequestLimitExceeded", "SlowDown",
    "KmsThrottled", "RequestTimeout", "PriorRequestNotComplete", "ServiceUnavailable", "InternalError",
    "InternalFailure",
})


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


def _codes(exc: ClientError) -> list[str]:
    """An error's code as the query protocol and as the JSON protocol name it (either may be the one that
    counts), without SQS's prefix and "Exception" suffix."""
    err = exc.response.get("Error", {})
    return [str(err.get(key, "")).removeprefix("AWS.SimpleQueueService.").removesuffix("Exception")
            for key in ("Code", "QueryErrorCode")]


def _transient(exc: Exception) -> bool:
    """True when the same request may succeed in a moment: throttled, SQS's own trouble (HTTP 5xx), no answer."""
    if isinstance(exc, (NoAnswerError, HTTPClientError)):
        return True
    if not isinstance(exc, ClientError):
        return False
    if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) in (429, 500, 502, 503, 504):
        return True
    return any(c in _TRANSIENT_CODES for c in _codes(exc))


class Backoff:
    """Makes requests, each tried again after the next of BACKOFF_SECONDS (jittered, so relays throttled
    together do not come back together) while SQS fails it for a moment. The waits are shared by every
    request made through one Backoff: a relay pass's deletes wait about 3 s at most, then the last error
    is raised."""

    def __init__(self, waits: tuple[float, ...] = BACKOFF_SECONDS) -> None:
        self._waits = list(waits)

    def __call__(self, request: Callable[..., T], /, **kwargs: Any) -> T:
        while True:
            try:
                return request(**kwargs)
            except (ClientError, BotoCoreError) as exc:
                if not self._waits or not _transient(exc):
                    raise
                wait = self._waits.pop(0) * random.uniform(0.5, 1.0)
                log.info("SQS did not serve %s (%s): trying again in %.2f s",
                         getattr(exc, "operation_name", "a request"), _aws_error(exc), wait)
                time.sleep(wait)
