"""Provisioning and checking an SQS endpoint's queues: the endpoint queue, its delay queue (the relay's input)
and the large-body bucket's expiry rule. Functions of the transport (`SqsTransport.provision`, `verify` and
`check_delay_queue` call them)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from airflow_delay_provider.core.checks import check_int
from airflow_delay_provider.core.errors import (
    DelayError,
    DestinationNotFoundError,
    InvalidInputError,
    InvalidNameError,
    UnavailableError,
)
from airflow_delay_provider.transports.sqs.naming import (
    NATIVE_MAX_DELAY,
    _is_fifo,
    delay_queue_name,
)
from airflow_delay_provider.transports.sqs.wire import _aws_error, _code, _transient

if TYPE_CHECKING:
    from airflow_delay_provider.transports.sqs.transport import SqsTransport

log = logging.getLogger("airflow_delay_provider.transports.sqs.transport")

DELAY_QUEUE_RETENTION = 1_209_600  # 14 days, SQS's maximum


def provision(transport: SqsTransport, endpoint: str, queue_delay_seconds: int | None = None,
              unrestricted: bool = True) -> dict[str, Any]:
    """`SqsTransport.provision`: the endpoint's queues, created or brought up to date."""
    name = transport.queue_name(endpoint)
    fifo = _is_fifo(name)
    attributes = {"FifoQueue": "true"} if fifo else {}
    if queue_delay_seconds:
        # moto accepts more; real SQS does not: check here so tests mean what production does
        check_int("queue_delay_seconds", queue_delay_seconds, 0, NATIVE_MAX_DELAY, unit="on SQS",
                  error=DelayError)
        if not fifo:
            attributes["DelaySeconds"] = str(queue_delay_seconds)
    try:
        transport._urls[name] = transport.client.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
        summary: dict[str, Any] = {"transport": transport.name, "endpoint": endpoint, "queue": name}
        if unrestricted:
            delay_queue = delay_queue_name(endpoint, transport.prefix)
            wanted = _delay_queue_attributes(transport, fifo)
            transport._urls[delay_queue] = _create_or_update(transport, delay_queue, wanted)
            summary["delay_queue"] = delay_queue
    except ClientError as exc:
        if _transient(exc):  # throttled or a server error: try again later, nothing is wrong with the request
            raise UnavailableError(f"SQS could not create the queues of {endpoint!r} now: {_aws_error(exc)}") from None
        raise InvalidInputError(f"SQS refused to create the queues of {endpoint!r}: {_aws_error(exc)}") from None
    except BotoCoreError as exc:
        raise UnavailableError(f"could not reach SQS: {_aws_error(exc)}") from None
    if transport.bodies.bucket:
        summary["body_expiration_days"] = transport.bodies.expire()
    return summary

def _delay_queue_attributes(transport: SqsTransport, fifo_endpoint: bool) -> dict[str, str]:
    retention = {"MessageRetentionPeriod": str(DELAY_QUEUE_RETENTION)}
    if fifo_endpoint:  # a standard queue: each hop carries its own DelaySeconds
        return retention
    return {"FifoQueue": "true", "DelaySeconds": str(transport.queue_delay), **retention}

def _create_or_update(transport: SqsTransport, queue: str, attributes: dict[str, str]) -> str:
    try:
        created: str = transport.client.create_queue(QueueName=queue, Attributes=attributes)["QueueUrl"]
        return created
    except ClientError as exc:
        if _code(exc) not in ("QueueAlreadyExists", "QueueNameExists"):
            raise
    # Made earlier with other attributes (an older 4-day retention, another Q): bring it up to date.
    url: str = transport.client.get_queue_url(QueueName=queue)["QueueUrl"]
    transport.client.set_queue_attributes(QueueUrl=url,
                                     Attributes={k: v for k, v in attributes.items() if k != "FifoQueue"})
    return url

def verify(transport: SqsTransport, endpoints: Iterable[str]) -> dict[str, Any]:
    """The provisioning report of these endpoints: `complete`, `missing` and `different` (misconfigured) queues,
    and each delay queue's report (`check_delay_queue`) under `endpoints`."""
    report: dict[str, Any] = {"missing": [], "different": [], "endpoints": {}}
    for endpoint in endpoints:
        try:
            transport._url(transport.queue_name(endpoint))
            report["endpoints"][endpoint] = check_delay_queue(transport, endpoint)
        except DestinationNotFoundError:
            report["missing"].append(endpoint)
        except InvalidNameError:
            raise
        except InvalidInputError as exc:
            report["different"].append(endpoint)
            report["endpoints"][endpoint] = {"ok": False, "problem": str(exc)}
    report["complete"] = not report["missing"] and not report["different"]
    return report

def check_delay_queue(transport: SqsTransport, endpoint: str) -> dict[str, Any]:
    """`SqsTransport.check_delay_queue`: the relay's start-up check of the delay queue."""
    fifo_endpoint = _is_fifo(transport.queue_name(endpoint))  # a name SQS cannot have says so, not "missing"
    queue = delay_queue_name(endpoint, transport.prefix)
    try:
        url = transport._url(queue)
    except DestinationNotFoundError:
        takes = ("delayed messages (a FIFO queue takes no per-message delay)" if fifo_endpoint
                 else f"delays over {NATIVE_MAX_DELAY} s")
        raise DestinationNotFoundError(
            f"delay queue {queue!r} is missing: {endpoint!r} cannot take {takes}; "
            "provision it with unrestricted delays"
        ) from None
    try:
        attrs = transport.client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    except (ClientError, BotoCoreError) as exc:
        raise UnavailableError(f"could not read the attributes of delay queue {queue!r}: {_aws_error(exc)}") from None
    delay, retention = int(attrs.get("DelaySeconds", 0)), int(attrs.get("MessageRetentionPeriod", 0))
    # The longest a message waits there before the relay sees it: a hop is at most Q on a FIFO endpoint's.
    wait = transport.queue_delay if fifo_endpoint else delay
    problems = []
    if not fifo_endpoint and delay < transport.queue_delay:
        problems.append(f"DelaySeconds is {delay}, must be at least {transport.queue_delay}")
    if retention <= wait:
        problems.append(f"MessageRetentionPeriod is {retention}, must be longer than {wait} s or every message "
                        f"expires before the relay sees it (provisioning sets {DELAY_QUEUE_RETENTION})")
    if attrs.get("RedrivePolicy"):
        problems.append("it has a RedrivePolicy; a delay queue must not dead-letter its messages")
    if problems:
        raise InvalidInputError(f"delay queue {queue!r} is misconfigured: " + "; ".join(problems))
    warned = []
    if retention - wait < transport.max_relay_downtime:
        warned.append(
            f"MessageRetentionPeriod is {retention} s, so a relay down for more than {retention - wait} s loses "
            f"messages, less than max_relay_downtime ({transport.max_relay_downtime:g} s); provision the endpoint "
            f"again to raise it to {DELAY_QUEUE_RETENTION} s (SQS's maximum)")
        log.warning("delay queue %s: %s", queue, warned[-1])
    return {"delay_queue": queue, "delay_seconds": delay, "retention_seconds": retention,
            "max_relay_downtime": transport.max_relay_downtime, "warnings": warned, "ok": True}
