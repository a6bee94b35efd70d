"""Amazon SQS: native delays up to 15 minutes, and unrestricted delays through a `-delay.fifo` relay queue.

A delay of at most `NATIVE_MAX_DELAY` (900 s, exactly 900 included) is SQS's own DelaySeconds on
the destination. A longer one goes to the destination's FIFO delay queue, whose queue-level delay
is Q (900 s by default), carrying the full delay in a message attribute; the relay (`relay_once`)
receives it after Q and either sends it back with the remaining delay, or, once the remainder
fits, hands it to the destination with DelaySeconds = remainder.

The boto3 client comes from the amazon provider's SqsHook (an `aws` connection; `endpoint_url`
in its extra points at moto in tests). Headers travel as one JSON message attribute, so any
number of them fits SQS's limit of 10 attributes per message.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from airflow_delay_provider.core.delays import seconds_until, utcnow, whole_seconds
from airflow_delay_provider.core.errors import (
    DelayError,
    DestinationNotFoundError,
    InvalidInputError,
    InvalidNameError,
    UnavailableError,
)
from airflow_delay_provider.core.message import HEADER_DUE_AT, DelayedMessage, check_destination
from airflow_delay_provider.core.ports import ReceivedMessage, Transport
from airflow_delay_provider.core.throttle import TokenBucket

log = logging.getLogger(__name__)

NATIVE_MAX_DELAY = 900
DELAY_QUEUE_SUFFIX = "-delay.fifo"
DELAY_QUEUE_RETENTION = 1_209_600  # 14 days, SQS's maximum
#: The longest the relay may be down by default: verify() warns when the delay queue's retention is shorter.
MAX_RELAY_DOWNTIME = 7 * 86_400
#: Large bodies expire after the longest delay the operators take (7 days), plus the longest a
#: destination queue keeps a message (14 days), plus a relay outage as long as the delay queue's retention.
BODY_EXPIRATION_DAYS = 35
BODY_KEY_PREFIX = "delay-bodies/"
MAX_QUEUE_NAME = 80
BATCH_SIZE = 10
MAX_BATCH_BYTES = 1024 * 1024  # SQS's message and batch limit (1 MiB)
#: Message attributes the provider writes; everything the caller gave travels in ATTR_HEADERS.
ATTR_MESSAGE_ID = "x-message-id"
ATTR_HEADERS = "x-headers"
ATTR_DUE_AT = HEADER_DUE_AT
ATTR_DELAY = "x-delay-seconds"
ATTR_ENCODING = "x-body-encoding"
ATTR_BODY_S3 = "x-body-s3"
ATTR_CYCLE = "x-relay-cycle"
#: A receipt of a message whose body is in S3 carries the object too, so any process can ack it.
RECEIPT_S3 = " s3://"
#: Bodies above this go to S3: SQS's old 256 KiB limit, which every SQS (and moto) accepts.
MAX_BODY_BYTES = 256 * 1024 - 8 * 1024  # room left for the attributes
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def delay_queue_name(name: str, prefix: str = "") -> str:
    """`<prefix><name>-delay.fifo`, characters outside [A-Za-z0-9_-] replaced by '-' (the `.fifo` kept).

    Raises ValueError when the result would be longer than SQS's 80 characters.
    """
    full = f"{prefix}{name}{DELAY_QUEUE_SUFFIX}"
    stem = full[: -len(".fifo")]
    result = _UNSAFE.sub("-", stem) + ".fifo"
    if len(result) > MAX_QUEUE_NAME:
        raise InvalidNameError(
            f"delay queue name {result!r} has {len(result)} characters; SQS allows {MAX_QUEUE_NAME}, so the endpoint "
            f"name may have at most {MAX_QUEUE_NAME - len(prefix) - len(DELAY_QUEUE_SUFFIX)} characters "
            f"with prefix {prefix!r}"
        )
    return result


def check_queue_name(name: str) -> str:
    stem = name.removesuffix(".fifo") if isinstance(name, str) else ""
    if not stem or len(name) > MAX_QUEUE_NAME or _UNSAFE.search(stem):
        raise InvalidNameError(
            f"SQS queue name {name!r} is not allowed: 1-{MAX_QUEUE_NAME} characters of A-Z, a-z, 0-9, '-' and '_' "
            "(a FIFO queue ends in .fifo)"
        )
    return name


def _check_queue_delay(queue_delay: object) -> int:
    if isinstance(queue_delay, bool) or not isinstance(queue_delay, int) or not 1 <= queue_delay <= NATIVE_MAX_DELAY:
        raise DelayError(
            f"queue_delay must be an int in 1..{NATIVE_MAX_DELAY} seconds (SQS's limit), got {queue_delay!r}")
    return queue_delay


@dataclass(frozen=True)
class DelayPlan:
    """How a delay is carried: natively, or `fifo_cycles` passes through the delay queue, then `final_delay`."""

    delay: int
    native: bool
    fifo_cycles: int
    final_delay: int

    def requests(self) -> int:
        """SQS requests the relay spends: a receive and a send per FIFO cycle."""
        return 2 * self.fifo_cycles


def delay_plan(delay_seconds: int | float, queue_delay: int = NATIVE_MAX_DELAY) -> DelayPlan:
    """845 -> native, 0 cycles, 845 s; 1,925 (Q = 900) -> 2 cycles, then 125 s on the destination."""
    delay = whole_seconds(delay_seconds)
    q = _check_queue_delay(queue_delay)
    if delay <= q:  # Q is the threshold: 900 in production, a few seconds in tests
        return DelayPlan(delay, True, 0, delay)
    cycles = math.ceil((delay - q) / q)
    return DelayPlan(delay, False, cycles, delay - cycles * q)


def estimate_cost(delay_seconds: int | float, price_per_request: float = 0.0000005,
                  queue_delay: int = NATIVE_MAX_DELAY) -> float:
    """USD the relay spends on one message: two FIFO requests per cycle (long polling not counted)."""
    if isinstance(price_per_request, bool) or not isinstance(price_per_request, (int, float)) or price_per_request < 0:
        raise InvalidInputError(f"price_per_request must be a number >= 0, got {price_per_request!r}")
    return delay_plan(delay_seconds, queue_delay).requests() * price_per_request


# -- the transport ------------------------------------------------------------------------------
def _aws_error(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        return f"{err.get('Code', 'ClientError')}: {err.get('Message', '')}"
    return f"{type(exc).__name__}: {exc}"


def _code(exc: Exception) -> str:
    return exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""


def _not_found(exc: Exception) -> bool:
    return _code(exc) in ("AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist", "NonExistentQueue")


def _is_fifo(queue: str) -> bool:
    return queue.endswith(".fifo")


class SqsTransport(Transport):
    """Sends each message to arrive at its due time: natively up to 900 s, through `-delay.fifo` beyond."""

    name = "sqs"

    def __init__(
        self,
        client: Any,
        prefix: str = "",
        queue_delay: int = NATIVE_MAX_DELAY,
        large_body_bucket: str | None = None,
        s3_client: Any = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        unrestricted: bool = True,
        max_relay_downtime: int | float = MAX_RELAY_DOWNTIME,
        body_expiration_days: int = BODY_EXPIRATION_DAYS,
    ) -> None:
        self.client = client
        self.unrestricted = unrestricted
        self.prefix = prefix
        self.queue_delay = _check_queue_delay(queue_delay)
        self.large_body_bucket = large_body_bucket
        self.s3 = s3_client
        self.max_body_bytes = max_body_bytes
        if large_body_bucket and s3_client is None:
            raise InvalidInputError("large_body_bucket needs an S3 client (SqsDelayHook.get_transport makes one)")
        if isinstance(max_relay_downtime, bool) or not isinstance(max_relay_downtime, (int, float)) \
                or not max_relay_downtime > 0:
            raise InvalidInputError(f"max_relay_downtime must be a number of seconds > 0, got {max_relay_downtime!r}")
        if isinstance(body_expiration_days, bool) or not isinstance(body_expiration_days, int) \
                or body_expiration_days < 1:
            raise InvalidInputError(f"body_expiration_days must be an int >= 1, got {body_expiration_days!r}")
        self.max_relay_downtime = max_relay_downtime
        self.body_expiration_days = body_expiration_days
        self._urls: dict[str, str] = {}
        #: Copies received after another copy's ack had deleted their shared S3 body, deleted unseen.
        self.duplicates_dropped = 0

    @classmethod
    def from_spec(cls, spec: dict) -> SqsTransport:
        """A transport from plain data (a Spark sweep has no Airflow): `client` holds boto3 client
        arguments (region_name, endpoint_url, credentials); the rest are this class's options."""
        import boto3  # botocore alone cannot build clients

        session = boto3.session.Session()
        client_args = {k: v for k, v in (spec.get("client") or {}).items() if v is not None}
        options = {k: v for k, v in spec.items() if k not in ("kind", "client")}
        s3 = session.client("s3", **client_args) if options.get("large_body_bucket") else None
        return cls(session.client("sqs", **client_args), s3_client=s3, **options)

    def __repr__(self) -> str:
        return f"SqsTransport(endpoint={self.client.meta.endpoint_url!r}, prefix={self.prefix!r})"

    def describe_delay(self, seconds: int) -> str:
        plan = delay_plan(seconds, self.queue_delay)
        how = ("native DelaySeconds" if plan.native
               else f"{plan.fifo_cycles} cycle(s) through the delay queue, then {plan.final_delay} s")
        return f"{seconds} s = {how}; relay cost about ${estimate_cost(seconds, queue_delay=self.queue_delay):.6f}"

    def queue_name(self, endpoint: str) -> str:
        return check_queue_name(f"{self.prefix}{endpoint}")

    def check_endpoint(self, endpoint: str, unrestricted: bool = True, **options: Any) -> str:
        self.queue_name(check_destination(endpoint))
        if unrestricted:
            delay_queue_name(endpoint, self.prefix)
        return endpoint

    def _url(self, queue: str) -> str:
        if queue not in self._urls:
            try:
                self._urls[queue] = self.client.get_queue_url(QueueName=queue)["QueueUrl"]
            except (ClientError, BotoCoreError) as exc:
                if _not_found(exc):
                    raise DestinationNotFoundError(f"SQS queue {queue!r} does not exist") from None
                raise UnavailableError(f"could not reach SQS for queue {queue!r}: {_aws_error(exc)}") from None
        return self._urls[queue]

    # -- provisioning ------------------------------------------------------------------------------
    def provision(self, endpoint: str, queue_delay_seconds: int | None = None, unrestricted: bool = True) -> dict:
        """The endpoint queue (optionally with a queue-level delay), for unrestricted delays its
        `-delay.fifo` queue (FIFO, DelaySeconds = Q, retention 14 days; an existing one is updated
        to these), and with a `large_body_bucket` the bucket's rule expiring bodies. Idempotent."""
        name = self.queue_name(endpoint)
        attributes = {}
        if queue_delay_seconds:
            if isinstance(queue_delay_seconds, bool) or not isinstance(queue_delay_seconds, int) \
                    or not 0 <= queue_delay_seconds <= NATIVE_MAX_DELAY:
                # moto accepts more; real SQS does not: check here so tests mean what production does
                raise DelayError(f"queue_delay_seconds must be an int in 0..{NATIVE_MAX_DELAY} on SQS, "
                                 f"got {queue_delay_seconds!r}")
            attributes["DelaySeconds"] = str(queue_delay_seconds)
        try:
            self._urls[name] = self.client.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
            summary = {"transport": self.name, "endpoint": endpoint, "queue": name}
            if unrestricted:
                fifo = delay_queue_name(endpoint, self.prefix)
                self._urls[fifo] = self._create_or_update(fifo, {
                    "FifoQueue": "true",
                    "DelaySeconds": str(self.queue_delay),
                    "MessageRetentionPeriod": str(DELAY_QUEUE_RETENTION),
                })
                summary["delay_queue"] = fifo
        except ClientError as exc:
            raise InvalidInputError(f"SQS refused to create the queues of {endpoint!r}: {_aws_error(exc)}") from None
        except BotoCoreError as exc:
            raise UnavailableError(f"could not reach SQS: {_aws_error(exc)}") from None
        if self.large_body_bucket:
            summary["body_expiration_days"] = self._expire_bodies()
        return summary

    def _create_or_update(self, queue: str, attributes: dict[str, str]) -> str:
        try:
            return self.client.create_queue(QueueName=queue, Attributes=attributes)["QueueUrl"]
        except ClientError as exc:
            if _code(exc) not in ("QueueAlreadyExists", "QueueNameExists"):
                raise
        # Made earlier with other attributes (an older 4-day retention, another Q): bring it up to date.
        url = self.client.get_queue_url(QueueName=queue)["QueueUrl"]
        self.client.set_queue_attributes(QueueUrl=url,
                                         Attributes={k: v for k, v in attributes.items() if k != "FifoQueue"})
        return url

    def _expire_bodies(self) -> int:
        """A lifecycle rule expiring this prefix's large bodies: those whose message was never acked
        (a send that failed after the upload, a message that expired) would otherwise stay forever."""
        bucket, key_prefix = self.large_body_bucket, f"{self.prefix}{BODY_KEY_PREFIX}"
        rule_id = f"airflow-delay-provider {key_prefix}"
        try:
            try:
                current = self.s3.get_bucket_lifecycle_configuration(Bucket=bucket)
            except ClientError as exc:
                if _code(exc) != "NoSuchLifecycleConfiguration":
                    raise
                current = {}
            # A put replaces the bucket's whole configuration: keep every rule but ours.
            rules = [r for r in current.get("Rules", []) if r.get("ID") != rule_id]
            rules.append({"ID": rule_id, "Status": "Enabled", "Filter": {"Prefix": key_prefix},
                          "Expiration": {"Days": self.body_expiration_days}})
            extra = {k: current[k] for k in ("TransitionDefaultMinimumObjectSize",) if current.get(k)}
            self.s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": rules}, **extra)
        except ClientError as exc:
            raise InvalidInputError(
                f"could not set the expiry of large bodies on S3 bucket {bucket!r} (it must exist and allow "
                f"s3:GetLifecycleConfiguration and s3:PutLifecycleConfiguration): {_aws_error(exc)}") from None
        except BotoCoreError as exc:
            raise UnavailableError(f"could not reach S3: {_aws_error(exc)}") from None
        return self.body_expiration_days

    def verify(self, endpoints: str | Iterable[str] = ()) -> dict:
        """For one endpoint, the relay's start-up check of its delay queue (below); for several, the
        provisioning report: `complete`, `missing` and `different` (misconfigured) queues, and each
        delay queue's report under `endpoints`."""
        if isinstance(endpoints, str):
            return self._verify_delay_queue(endpoints)
        report: dict[str, Any] = {"missing": [], "different": [], "endpoints": {}}
        for endpoint in endpoints:
            try:
                self._url(self.queue_name(endpoint))
                report["endpoints"][endpoint] = self._verify_delay_queue(endpoint)
            except DestinationNotFoundError:
                report["missing"].append(endpoint)
            except InvalidNameError:
                raise
            except InvalidInputError as exc:
                report["different"].append(endpoint)
                report["endpoints"][endpoint] = {"ok": False, "problem": str(exc)}
        report["complete"] = not report["missing"] and not report["different"]
        return report

    def _verify_delay_queue(self, endpoint: str) -> dict:
        """Start-up check of the delay queue: present, delay >= Q, retention longer than the delay, no
        redrive policy. A retention too short to outlast `max_relay_downtime` is a warning (logged and
        in the report's `warnings`): a relay down that long would lose messages silently."""
        self.queue_name(endpoint)  # a name SQS cannot have says so, not "missing"
        fifo = delay_queue_name(endpoint, self.prefix)
        try:
            url = self._url(fifo)
        except DestinationNotFoundError:
            raise DestinationNotFoundError(
                f"delay queue {fifo!r} is missing: {endpoint!r} cannot take delays over {NATIVE_MAX_DELAY} s; "
                "provision it with unrestricted delays"
            ) from None
        attrs = self.client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
        delay, retention = int(attrs.get("DelaySeconds", 0)), int(attrs.get("MessageRetentionPeriod", 0))
        problems = []
        if delay < self.queue_delay:
            problems.append(f"DelaySeconds is {delay}, must be at least {self.queue_delay}")
        if retention <= delay:
            problems.append(f"MessageRetentionPeriod is {retention}, must be longer than DelaySeconds or every message "
                            f"expires before the relay sees it (provisioning sets {DELAY_QUEUE_RETENTION})")
        if attrs.get("RedrivePolicy"):
            problems.append("it has a RedrivePolicy; a delay queue must not dead-letter its messages")
        if problems:
            raise InvalidInputError(f"delay queue {fifo!r} is misconfigured: " + "; ".join(problems))
        warnings = []
        if retention - delay < self.max_relay_downtime:
            warnings.append(
                f"MessageRetentionPeriod is {retention} s, so a relay down for more than {retention - delay} s loses "
                f"messages, less than max_relay_downtime ({self.max_relay_downtime:g} s); provision the endpoint again "
                f"to raise it to {DELAY_QUEUE_RETENTION} s (SQS's maximum)")
            log.warning("delay queue %s: %s", fifo, warnings[-1])
        return {"delay_queue": fifo, "delay_seconds": delay, "retention_seconds": retention,
                "max_relay_downtime": self.max_relay_downtime, "warnings": warnings, "ok": True}

    def depth(self, endpoint: str) -> dict[str, int]:
        """The endpoint queue's messages: visible, in flight, scheduled (raises DestinationNotFoundError
        when it is missing)."""
        return self.lifecycle(endpoint)

    def lifecycle(self, endpoint: str, delay_queue: bool = False) -> dict[str, int]:
        """A queue's messages as SQS counts them: scheduled (delayed), visible, in flight."""
        name = delay_queue_name(endpoint, self.prefix) if delay_queue else self.queue_name(endpoint)
        attrs = self.client.get_queue_attributes(QueueUrl=self._url(name), AttributeNames=[
            "ApproximateNumberOfMessagesDelayed", "ApproximateNumberOfMessages",
            "ApproximateNumberOfMessagesNotVisible",
        ])["Attributes"]
        return {
            "scheduled": int(attrs.get("ApproximateNumberOfMessagesDelayed", 0)),
            "visible": int(attrs.get("ApproximateNumberOfMessages", 0)),
            "in_flight": int(attrs.get("ApproximateNumberOfMessagesNotVisible", 0)),
        }

    # -- sending ------------------------------------------------------------------------------------
    def send(self, messages: Sequence[DelayedMessage], connection: Any = None) -> dict[str, Exception]:
        now = utcnow()
        failures: dict[str, Exception] = {}
        by_queue: dict[str, list[tuple[DelayedMessage, dict]]] = {}
        for m in messages:
            try:
                queue, entry = self._entry(m, now)
            except (InvalidInputError, UnavailableError) as exc:  # bad name or size; S3 unreachable
                failures[m.message_id] = exc
                continue
            by_queue.setdefault(queue, []).append((m, entry))
        for queue, entries in by_queue.items():
            try:
                url = self._url(queue)
            except DestinationNotFoundError as missing:
                error = missing
                if queue.endswith(DELAY_QUEUE_SUFFIX):
                    error = DestinationNotFoundError(
                        f"destination {entries[0][0].destination!r} does not accept delays longer than 15 minutes: "
                        f"its delay queue {queue!r} does not exist; provision it with unrestricted delays"
                    )
                failures.update({m.message_id: error for m, _ in entries})
                continue
            failures.update(self._send_batches(url, entries))
        return failures

    def _entry(self, m: DelayedMessage, now: datetime) -> tuple[str, dict]:
        delay = seconds_until(m.due_at, now)
        attributes = {
            ATTR_MESSAGE_ID: {"DataType": "String", "StringValue": m.message_id},
            ATTR_DUE_AT: {"DataType": "String", "StringValue": m.due_at.isoformat()},
        }
        if m.headers:
            attributes[ATTR_HEADERS] = {"DataType": "String", "StringValue": json.dumps(m.headers)}
        entry = {"MessageBody": self._body(m, attributes), "MessageAttributes": attributes}
        if delay <= self.queue_delay:
            queue = self.queue_name(m.destination)
            if not _is_fifo(queue):  # FIFO queues refuse a per-message delay
                # Even 0: without it SQS applies the queue's default delay to a message due now.
                entry["DelaySeconds"] = delay
            return queue, entry
        if not self.unrestricted:
            raise DelayError(
                f"a delay of {delay} s exceeds {self.queue_delay} s and this sender has unrestricted delays disabled; "
                "enable them (unrestricted=True) and provision the destination's delay queue"
            )
        # Beyond SQS's limit: the FIFO delay queue, full delay in an attribute, no per-message delay.
        attributes[ATTR_DELAY] = {"DataType": "Number", "StringValue": str(delay)}
        entry["MessageDeduplicationId"] = _dedup_id(m.message_id, 0)
        entry["MessageGroupId"] = _fifo_id(m.message_id)
        return delay_queue_name(m.destination, self.prefix), entry

    def _body(self, m: DelayedMessage, attributes: dict) -> str:
        """The SQS body; one over the size limit goes to S3 and the message carries a pointer."""
        body = _encode_body(m.body, attributes)
        if len(body.encode()) <= self.max_body_bytes:
            return body
        if not self.large_body_bucket:
            raise InvalidInputError(
                f"message {m.message_id} has a body of {len(body.encode())} bytes; SQS takes {self.max_body_bytes}: "
                "set large_body_bucket to carry larger bodies through S3"
            )
        key = f"{self.prefix}{BODY_KEY_PREFIX}{uuid.uuid4().hex}"
        try:
            self.s3.put_object(Bucket=self.large_body_bucket, Key=key, Body=m.body)
        except (ClientError, BotoCoreError) as exc:
            raise UnavailableError(
                f"could not store the large body of {m.message_id} in S3: {_aws_error(exc)}") from None
        attributes.pop(ATTR_ENCODING, None)
        attributes[ATTR_BODY_S3] = {"DataType": "String", "StringValue": f"{self.large_body_bucket}/{key}"}
        return json.dumps({"s3": f"{self.large_body_bucket}/{key}"})

    def _send_batches(self, url: str, entries: list[tuple[DelayedMessage, dict]]) -> dict[str, Exception]:
        failures: dict[str, Exception] = {}
        for chunk in _chunks(entries):
            batch = [{"Id": str(i), **entry} for i, (_, entry) in enumerate(chunk)]
            try:
                result = self.client.send_message_batch(QueueUrl=url, Entries=batch)
            except (ClientError, BotoCoreError) as exc:
                raise UnavailableError(f"SQS send_message_batch failed: {_aws_error(exc)}") from None
            for failed in result.get("Failed", []):
                m = chunk[int(failed["Id"])][0]
                error = f"{failed.get('Code')}: {failed.get('Message')}"
                error_type = UnavailableError if failed.get("SenderFault") is False else InvalidInputError
                failures[m.message_id] = error_type(f"SQS refused message {m.message_id}: {error}")
        return failures

    # -- receiving ----------------------------------------------------------------------------------
    def receive(self, endpoint: str, max_messages: int = 10, visibility_timeout: float = 30.0) -> list[ReceivedMessage]:
        url = self._url(self.queue_name(endpoint))
        got = self.client.receive_message(
            QueueUrl=url, MaxNumberOfMessages=min(max_messages, 10), VisibilityTimeout=int(visibility_timeout),
            MessageAttributeNames=["All"], AttributeNames=["All"], WaitTimeSeconds=0,
        ).get("Messages", [])
        received = []
        for m in got:
            pointer = _attr(m, ATTR_BODY_S3)
            if not pointer:
                received.append(_received(endpoint, m))
                continue
            body = self._large_body(url, m, pointer)
            if body is not None:
                received.append(_received(endpoint, m, body, receipt=f"{m['ReceiptHandle']}{RECEIPT_S3}{pointer}"))
        return received

    can_peek = True

    #: How long peek() hides what it received while it walks the queue; then they are made visible again.
    PEEK_HIDE_SECONDS = 30

    def peek(self, endpoint: str, max_messages: int = 10) -> list[ReceivedMessage]:
        """Receive up to `max_messages` (hidden while peek walks the queue), then make them visible again
        at once. SQS counts each receive (ApproximateReceiveCount), so a queue with a RedrivePolicy is
        refused: peeking could move a message to its dead-letter queue. A large body is read from S3
        (an empty body when it is gone, with `extra["body_missing"]`); nothing is deleted."""
        url = self._url(self.queue_name(endpoint))
        try:
            attrs = self.client.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy"])
        except (ClientError, BotoCoreError) as exc:
            raise UnavailableError(f"could not read the attributes of SQS queue {endpoint!r}: {_aws_error(exc)}"
                                   ) from None
        if attrs.get("Attributes", {}).get("RedrivePolicy"):
            raise NotImplementedError(
                f"cannot peek at SQS queue {endpoint!r}: it has a RedrivePolicy, and every receive counts toward "
                "its maxReceiveCount, so looking could move messages to its dead-letter queue")
        seen: dict[str, ReceivedMessage] = {}
        handles: list[str] = []
        try:
            while len(seen) < max_messages:
                got = self.client.receive_message(
                    QueueUrl=url, MaxNumberOfMessages=min(max_messages - len(seen), BATCH_SIZE),
                    VisibilityTimeout=self.PEEK_HIDE_SECONDS, MessageAttributeNames=["All"],
                    AttributeNames=["All"], WaitTimeSeconds=0,
                ).get("Messages", [])
                if not got:
                    break
                for m in got:
                    handles.append(m["ReceiptHandle"])
                    pointer = _attr(m, ATTR_BODY_S3)
                    message = _received(endpoint, m, self._peek_body(pointer) if pointer else None)
                    if pointer and not message.body:
                        message.extra.update(body_missing=True, body_s3=pointer)
                    seen.setdefault(m["MessageId"], replace(message, receipt=None))  # once, if the walk is slow
        except (ClientError, BotoCoreError) as exc:
            raise UnavailableError(f"could not peek at SQS queue {endpoint!r}: {_aws_error(exc)}") from None
        finally:
            self._show(url, handles)
        return list(seen.values())

    def _peek_body(self, pointer: str) -> bytes:
        bucket, key = pointer.split("/", 1)
        try:
            return self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except (ClientError, BotoCoreError, AttributeError):
            return b""  # gone (or no S3 client): the listing says so; nothing is deleted while peeking

    def release(self, endpoint: str, receipts: Iterable[Any]) -> int:
        """Make received, unacked messages visible again now (their visibility timeout set to 0)."""
        url = self._url(self.queue_name(endpoint))
        return self._show(url, [str(r).partition(RECEIPT_S3)[0] for r in receipts])

    def _show(self, url: str, handles: list[str]) -> int:
        """Set the visibility timeout of received messages to 0, in batches; returns how many were shown."""
        shown = 0
        for i in range(0, len(handles), BATCH_SIZE):
            chunk = handles[i : i + BATCH_SIZE]
            try:
                result = self.client.change_message_visibility_batch(QueueUrl=url, Entries=[
                    {"Id": str(n), "ReceiptHandle": h, "VisibilityTimeout": 0} for n, h in enumerate(chunk)])
            except (ClientError, BotoCoreError) as exc:  # they come back when their visibility timeout ends
                log.warning("could not make %d message(s) visible again: %s", len(chunk), _aws_error(exc))
                continue
            shown += len(result.get("Successful", []))
        return shown

    def _large_body(self, url: str, m: dict, pointer: str) -> bytes | None:
        """The body from S3, or None when it is gone: the message is then deleted, not delivered."""
        bucket, key = pointer.split("/", 1)
        message_id = _attr(m, ATTR_MESSAGE_ID) or m["MessageId"]
        try:
            return self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if _code(exc) not in ("NoSuchKey", "404"):
                raise UnavailableError(
                    f"could not read the large body of {message_id} from S3: {_aws_error(exc)}") from None
        except BotoCoreError as exc:
            raise UnavailableError(
                f"could not read the large body of {message_id} from S3: {_aws_error(exc)}") from None
        # Copies of one message share its object (a relay re-send under at-least-once), and the
        # first copy's ack deleted it: this one was delivered already. (Or the lifecycle rule
        # expired it, and there is nothing left to deliver.)
        log.warning("dropping a copy of message %s: its body %s is gone from S3 "
                    "(another copy was acked, or it expired)", message_id, pointer)
        self.duplicates_dropped += 1
        try:
            self.client.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
        except (ClientError, BotoCoreError) as exc:  # it comes back after its visibility timeout, and goes then
            log.warning("could not delete the copy of message %s: %s", message_id, _aws_error(exc))
        return None

    def ack(self, endpoint: str, receipts: Iterable[Any]) -> int:
        """Delete received messages, and the S3 bodies of those that had one (best effort: the
        bucket's lifecycle rule expires what a failed delete leaves)."""
        url = self._url(self.queue_name(endpoint))
        parts = [str(r).partition(RECEIPT_S3) for r in receipts]  # (handle, separator, pointer)
        deleted = 0
        for i in range(0, len(parts), BATCH_SIZE):
            chunk = parts[i : i + BATCH_SIZE]
            result = self.client.delete_message_batch(
                QueueUrl=url, Entries=[{"Id": str(n), "ReceiptHandle": r[0]} for n, r in enumerate(chunk)])
            deleted += len(result.get("Successful", []))
            for ok in result.get("Successful", []):
                pointer = chunk[int(ok["Id"])][2]
                if pointer:  # delivered: its large body is no longer needed
                    self._delete_body(pointer)
        return deleted

    def _delete_body(self, pointer: str) -> None:
        bucket, key = pointer.split("/", 1)
        try:
            self.s3.delete_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            log.warning("could not delete the large body %s from S3 (its lifecycle rule will): %s", pointer,
                        _aws_error(exc))

    # -- the relay: the delay queue's consumer ---------------------------------------------------
    def relay_once(self, endpoint: str, wait_time_seconds: int = 20, visibility_timeout: int = 30,
                   throttle: TokenBucket | None = None) -> RelayCounts:
        """One long poll of the endpoint's delay queue; every message received is sent on and deleted.

        remaining = delay - (ApproximateFirstReceiveTimestamp - SentTimestamp), both the broker's
        clock (the local clock only for a redelivery). Above Q: back to the delay queue; else to the
        destination with DelaySeconds = remaining. Sends are batched per queue, then the handled
        messages deleted in one batch; a failed send is made visible again at once.
        """
        fifo_url = self._url(delay_queue_name(endpoint, self.prefix))
        destination = self.queue_name(endpoint)
        dest_url = self._url(destination)
        try:
            got = self.client.receive_message(
                QueueUrl=fifo_url, MaxNumberOfMessages=BATCH_SIZE, WaitTimeSeconds=wait_time_seconds,
                VisibilityTimeout=visibility_timeout, MessageAttributeNames=["All"], AttributeNames=["All"],
            ).get("Messages", [])
        except (ClientError, BotoCoreError) as exc:
            raise UnavailableError(
                f"could not receive from the delay queue of {endpoint!r}: {_aws_error(exc)}") from None
        counts = RelayCounts()
        if not got:
            return counts
        now_ms = utcnow().timestamp() * 1000
        back, onward = [], []
        for m in got:
            attrs = m.get("Attributes", {})
            sent = int(attrs["SentTimestamp"])
            received = now_ms if int(attrs.get("ApproximateReceiveCount", "1")) > 1 else int(
                attrs.get("ApproximateFirstReceiveTimestamp", sent))
            remaining = float(_attr(m, ATTR_DELAY) or 0) - (received - sent) / 1000
            attributes = dict(m.get("MessageAttributes", {}))
            entry = {"MessageBody": m["Body"], "MessageAttributes": attributes}
            source = _attr(m, ATTR_MESSAGE_ID) or m["MessageId"]
            if remaining > self.queue_delay:
                # Milliseconds carried along, so rounding happens once, at the hand-over.
                attributes[ATTR_DELAY] = {"DataType": "Number", "StringValue": f"{remaining:.3f}"}
                cycle = int(_attr(m, ATTR_CYCLE) or 0) + 1
                attributes[ATTR_CYCLE] = {"DataType": "Number", "StringValue": str(cycle)}
                # One id per message and cycle: re-sending the same cycle (a relay that died before
                # its delete) is dropped by SQS within 5 minutes, while the next cycle is new even when Q < 5 min.
                entry["MessageDeduplicationId"] = _dedup_id(source, cycle)
                entry["MessageGroupId"] = attrs.get("MessageGroupId") or _fifo_id(source)
                back.append((m, entry))
            else:
                attributes.pop(ATTR_DELAY, None)
                attributes.pop(ATTR_CYCLE, None)
                if not _is_fifo(destination):
                    # Even 0: without it SQS applies the destination's default delay to an overdue message.
                    entry["DelaySeconds"] = whole_seconds(remaining, negative_is_now=True)
                onward.append((m, entry))
        if throttle is not None and onward:
            # The destination's maxReceivesPerSecond: what may not go yet comes back in a second.
            allowed = throttle.take_up_to(len(onward))
            for m, _ in onward[allowed:]:
                self.client.change_message_visibility(QueueUrl=fifo_url, ReceiptHandle=m["ReceiptHandle"],
                                                      VisibilityTimeout=1)
                counts.held += 1
            onward = onward[:allowed]
        done = []
        for url, entries, counter in ((fifo_url, back, "relayed"), (dest_url, onward, "handed_over")):
            if not entries:
                continue
            batch = [{"Id": str(i), **entry} for i, (_, entry) in enumerate(entries)]
            result = self.client.send_message_batch(QueueUrl=url, Entries=batch)
            failed = {int(f["Id"]) for f in result.get("Failed", [])}
            for i, (m, _) in enumerate(entries):
                if i in failed:
                    counts.failed += 1
                    self.client.change_message_visibility(
                        QueueUrl=fifo_url, ReceiptHandle=m["ReceiptHandle"], VisibilityTimeout=0)
                else:
                    setattr(counts, counter, getattr(counts, counter) + 1)
                    done.append(m)
        self._delete(fifo_url, done)
        return counts

    def relay_until(self, endpoint: str, deadline: datetime, totals: RelayCounts, wait_time_seconds: int = 20,
                    max_per_second: float | None = None, until_idle: bool = False) -> str:
        """Relay the endpoint's delay queue (`relay_once` after `relay_once`, adding to `totals`) until
        `deadline`, each long poll shortened so none outlasts it. Returns why it stopped: `"deadline"`, or
        with `until_idle`, `"idle"` as soon as the delay queue has no visible message (a caller may then
        wait elsewhere, e.g. a deferred task on SqsDelayQueueTrigger, instead of paying for empty polls).

        `max_per_second` caps the hand-overs to the endpoint (a delivery policy's maxReceivesPerSecond);
        its token bucket lasts for this call."""
        throttle = TokenBucket(max_per_second) if max_per_second else None
        while (left := (deadline - utcnow()).total_seconds()) > 0:
            if until_idle and self.lifecycle(endpoint, delay_queue=True)["visible"] == 0:
                return "idle"
            totals.add(self.relay_once(endpoint, min(wait_time_seconds, max(0, int(left))), throttle=throttle))
        return "deadline"

    def _delete(self, url: str, messages: list[dict]) -> None:
        """Delete in one batch; retry failures one by one (an expired receipt handle means it is gone)."""
        if not messages:
            return
        result = self.client.delete_message_batch(
            QueueUrl=url, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])
        for failed in result.get("Failed", []):
            try:
                self.client.delete_message(QueueUrl=url, ReceiptHandle=messages[int(failed["Id"])]["ReceiptHandle"])
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "ReceiptHandleIsInvalid":
                    raise



@dataclass
class RelayCounts:
    relayed: int = 0  # back to the delay queue for another cycle
    handed_over: int = 0  # to the destination with the rest of the delay
    failed: int = 0  # made visible again, to be relayed on a later receive
    held: int = 0  # held back by the destination's throttle, back in a second

    def add(self, other: RelayCounts) -> None:
        self.relayed += other.relayed
        self.handed_over += other.handed_over
        self.failed += other.failed
        self.held += other.held


#: Characters SQS keeps in a body (XML 1.0's); it refuses others or replaces them with U+FFFD.
_SQS_TEXT = re.compile("[\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]*")


def _encode_body(body: bytes, attributes: dict) -> str:
    """SQS bodies are text: UTF-8 as is when SQS keeps every character, anything else base64 with an
    attribute saying so."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and _SQS_TEXT.fullmatch(text):
        return text
    attributes[ATTR_ENCODING] = {"DataType": "String", "StringValue": "base64"}
    return base64.b64encode(body).decode("ascii")


def _decode_body(message: dict) -> bytes:
    if _attr(message, ATTR_ENCODING) == "base64":
        return base64.b64decode(message["Body"])
    return message["Body"].encode("utf-8")


_FIFO_ID = re.compile(r"[A-Za-z0-9!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]{1,128}")


def _fifo_id(value: str) -> str:
    """FIFO dedup and group ids allow 128 characters of a limited set: the value when it fits, else
    its SHA-256 (cutting or replacing characters could make two ids one, and SQS drop a message)."""
    return value if _FIFO_ID.fullmatch(value) else hashlib.sha256(value.encode()).hexdigest()


def _dedup_id(message_id: str, cycle: int) -> str:
    return _fifo_id(f"{message_id}:{cycle}")


def _chunks(entries: list[tuple[DelayedMessage, dict]]):
    """Batches of at most 10 entries and at most 1 MiB of bodies."""
    chunk, size = [], 0
    for item in entries:
        body = len(item[1]["MessageBody"].encode())
        if chunk and (len(chunk) == BATCH_SIZE or size + body > MAX_BATCH_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += body
    if chunk:
        yield chunk


def _attr(message: dict, name: str) -> str | None:
    value = message.get("MessageAttributes", {}).get(name)
    return None if value is None else value.get("StringValue")


def _received(endpoint: str, m: dict, body: bytes | None = None, receipt: str | None = None) -> ReceivedMessage:
    attrs = m.get("Attributes", {})
    sent = int(attrs.get("SentTimestamp", "0")) / 1000
    due = _attr(m, ATTR_DUE_AT)
    return ReceivedMessage(
        message_id=_attr(m, ATTR_MESSAGE_ID) or m["MessageId"],
        destination=endpoint,
        body=_decode_body(m) if body is None else body,
        headers=json.loads(_attr(m, ATTR_HEADERS) or "{}"),
        receipt=receipt or m["ReceiptHandle"],
        enqueued_at=datetime.fromtimestamp(sent, tz=UTC),
        due_at=datetime.fromisoformat(due) if due else None,
        receive_count=int(attrs.get("ApproximateReceiveCount", "1")),
    )
