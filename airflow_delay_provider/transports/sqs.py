"""Amazon SQS: native delays up to 15 minutes, and unrestricted delays through a `-delay.fifo` relay queue.

A delay of at most `NATIVE_MAX_DELAY` (900 s, exactly 900 included) is SQS's own DelaySeconds on
the destination. A longer one goes to the destination's FIFO delay queue, whose queue-level delay
is Q (900 s by default), carrying the full delay in a message attribute; the relay (`relay_once`)
receives it after Q and either sends it back with the remaining delay, or, once the remainder
fits, hands it to the destination with DelaySeconds = remainder.

A FIFO destination (`orders.fifo`) takes no per-message delay: a message due now goes straight to it
(group from the `x-message-group-id` header, default `default`; deduplication id = message id), any
other goes through its delay queue `orders-fifo-delay`, a standard queue where each hop carries its own
DelaySeconds (at most Q), and is handed over with no delay once due.

The boto3 client comes from the amazon provider's SqsHook (an `aws` connection; `endpoint_url`
in its extra points at moto in tests). Headers travel as one JSON message attribute, so any
number of them fits SQS's limit of 10 attributes per message.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import json
import logging
import math
import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from airflow_delay_provider.core.delays import seconds_until, utcnow, whole_seconds
from airflow_delay_provider.core.errors import (
    DelayError,
    DestinationNotFoundError,
    InvalidInputError,
    InvalidMessageError,
    InvalidNameError,
    UnavailableError,
)
from airflow_delay_provider.core.message import (
    HEADER_DUE_AT,
    HEADER_FAILED_AT,
    HEADER_FAILED_DESTINATION,
    HEADER_FAILURE_REASON,
    HEADER_FAILURES,
    HEADER_FIRST_FAILED_AT,
    DelayedMessage,
    check_destination,
)
from airflow_delay_provider.core.ports import ReceivedMessage, Transport
from airflow_delay_provider.core.throttle import TokenBucket

log = logging.getLogger(__name__)

NATIVE_MAX_DELAY = 900
DELAY_QUEUE_SUFFIX = "-delay.fifo"
#: The delay queue of a FIFO endpoint: a standard queue, so each hop carries its own DelaySeconds.
FIFO_DELAY_QUEUE_SUFFIX = "-fifo-delay"
#: The header naming a message's group on a FIFO destination (SQS's MessageGroupId).
HEADER_MESSAGE_GROUP = "x-message-group-id"
#: The group of a message without that header: one group per queue keeps the whole queue in order,
#: which is what a FIFO queue is chosen for; name a group per key (a customer, an order) for parallel consumers.
DEFAULT_MESSAGE_GROUP = "default"
#: How long a relayed message that neither its destination nor the error queue takes stays hidden
#: before the relay tries it again: no tight loop, and it is kept until its retention ends.
REFUSED_RETRY_SECONDS = 900
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
    """The delay queue of endpoint `name`: `<prefix><name>-delay.fifo` (a FIFO queue), or for a FIFO endpoint
    `<prefix><stem>.fifo` the standard queue `<prefix><stem>-fifo-delay` (it takes the per-message delays a
    FIFO queue refuses). Characters outside [A-Za-z0-9_-] are replaced by '-' (the `.fifo` kept).

    Over the names SQS allows an endpoint, no two endpoints share a delay queue, and `queue_name()` refuses
    an endpoint named like one. Raises InvalidNameError when the result would be longer than SQS's 80 characters.
    """
    full = f"{prefix}{name}"
    if _is_fifo(full):
        result = _UNSAFE.sub("-", full.removesuffix(".fifo")) + FIFO_DELAY_QUEUE_SUFFIX
        added = len(FIFO_DELAY_QUEUE_SUFFIX) - len(".fifo")  # the endpoint's own `.fifo` counts in its name
    else:
        result = _UNSAFE.sub("-", f"{full}-delay") + ".fifo"
        added = len(DELAY_QUEUE_SUFFIX)
    if len(result) > MAX_QUEUE_NAME:
        raise InvalidNameError(
            f"delay queue name {result!r} has {len(result)} characters; SQS allows {MAX_QUEUE_NAME}, so the endpoint "
            f"name may have at most {MAX_QUEUE_NAME - len(prefix) - added} characters with prefix {prefix!r}"
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


#: USD per SQS request (a FIFO request's list price), for the relay's cost estimates.
PRICE_PER_REQUEST = 0.0000005


def estimate_cost(delay_seconds: int | float, price_per_request: float = PRICE_PER_REQUEST,
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


#: Codes of a request SQS refused for what a message holds (its size, contents or parameters): the sender's
#: fault, which sending again cannot mend. Anything else (throttling, a server error, no answer) is an outage.
_REFUSALS = frozenset({
    "BatchRequestTooLong", "InvalidParameterValue", "InvalidMessageContents", "MissingParameter",
    "MissingRequiredParameter", "InvalidAttributeName", "InvalidAttributeValue", "UnsupportedOperation",
    "InvalidBatchEntryId", "BatchEntryIdsNotDistinct", "TooManyEntriesInBatchRequest", "EmptyBatchRequest",
})


def _refused(exc: Exception) -> bool:
    if not isinstance(exc, ClientError):
        return False
    err = exc.response.get("Error", {})
    # The query protocol's code and the JSON protocol's name it differently: either counts.
    codes = (str(err.get("Code", "")), str(err.get("QueryErrorCode", "")))
    return any(c.removeprefix("AWS.SimpleQueueService.").removesuffix("Exception") in _REFUSALS for c in codes)


def _is_fifo(queue: str) -> bool:
    return queue.endswith(".fifo")


def check_message_group_id(group: object, field: str = HEADER_MESSAGE_GROUP) -> str:
    """`group` if SQS takes it as a MessageGroupId; otherwise an error naming `field` and the rule."""
    if not isinstance(group, str) or not _FIFO_ID.fullmatch(group):
        raise InvalidMessageError(
            f"{field} is {group!r:.60}; an SQS message group id is 1-128 characters of A-Z, a-z, 0-9 and the "
            "punctuation !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    return group


def _message_group(headers: dict[str, str], message_id: str) -> str:
    group = headers.get(HEADER_MESSAGE_GROUP, DEFAULT_MESSAGE_GROUP)
    return check_message_group_id(group, f"message {message_id}: header {HEADER_MESSAGE_GROUP!r}")


def _final_fields(queue: str, message_id: str, headers: dict[str, str], delay: int = 0) -> dict[str, Any]:
    """What a message carries into the queue it is delivered to: on a FIFO queue its group and, for
    deduplication, its message id (a FIFO queue takes no per-message delay); on a standard queue its
    DelaySeconds, even 0 (without it SQS applies the queue's default delay to a message due now)."""
    if _is_fifo(queue):
        return {"MessageGroupId": _message_group(headers, message_id), "MessageDeduplicationId": _fifo_id(message_id)}
    return {"DelaySeconds": delay}


def _sqs_now_ms(response: dict) -> int | None:
    """SQS's clock when it answered, in ms: the response's Date header, cut to the second (so never after
    SQS's now); None without one."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return int(email.utils.parsedate_to_datetime(date).timestamp()) * 1000
    except (TypeError, ValueError):
        return None


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
        arguments (region_name, endpoint_url, credentials: none means this machine's own), `assume_role`
        a role to assume from them (see `assumed_role_session`); the rest are this class's options."""
        import boto3  # botocore alone cannot build clients

        client_args = {k: v for k, v in (spec.get("client") or {}).items() if v is not None}
        options = {k: v for k, v in spec.items() if k not in ("kind", "client", "assume_role")}
        if spec.get("assume_role"):
            session = assumed_role_session(client_args, spec["assume_role"])
            client_args = {k: v for k, v in client_args.items() if k in ("region_name", "endpoint_url")}
        else:
            session = boto3.session.Session()
        s3 = session.client("s3", **client_args) if options.get("large_body_bucket") else None
        return cls(session.client("sqs", **client_args), s3_client=s3, **options)

    def __repr__(self) -> str:
        return f"SqsTransport(endpoint={self.client.meta.endpoint_url!r}, prefix={self.prefix!r})"

    def describe_delay(self, seconds: int, destination: str | None = None) -> str:
        if destination is not None and _is_fifo(destination):  # no per-message delay: all of it in the delay queue
            if seconds <= 0:
                return f"{seconds} s = straight to the FIFO queue"
            hops = math.ceil(seconds / self.queue_delay)
            return (f"{seconds} s = {hops} hop(s) of at most {self.queue_delay} s through "
                    f"{delay_queue_name(destination, self.prefix)!r}, then handed over with no delay; "
                    f"relay cost about ${2 * hops * PRICE_PER_REQUEST:.6f}")
        plan = delay_plan(seconds, self.queue_delay)
        how = ("native DelaySeconds" if plan.native
               else f"{plan.fifo_cycles} cycle(s) through the delay queue, then {plan.final_delay} s")
        return f"{seconds} s = {how}; relay cost about ${estimate_cost(seconds, queue_delay=self.queue_delay):.6f}"

    def queue_name(self, endpoint: str) -> str:
        """The endpoint's queue: `<prefix><endpoint>`; a name another endpoint's delay queue has is refused."""
        name = check_queue_name(f"{self.prefix}{endpoint}")
        if name.endswith((DELAY_QUEUE_SUFFIX, FIFO_DELAY_QUEUE_SUFFIX)):
            raise InvalidNameError(
                f"SQS queue name {name!r} is reserved for delay queues: an endpoint's name may not end in "
                f"{DELAY_QUEUE_SUFFIX!r} (the delay queue of a standard endpoint) or {FIFO_DELAY_QUEUE_SUFFIX!r} "
                "(that of a FIFO endpoint)")
        return name

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
        """The endpoint queue (optionally with a queue-level delay; a FIFO one, `<name>.fifo`, with
        FifoQueue), for unrestricted delays its delay queue (`-delay.fifo`: FIFO, DelaySeconds = Q; a FIFO
        endpoint's `-fifo-delay`: standard; both retention 14 days, an existing one updated to these), and
        with a `large_body_bucket` the bucket's rule expiring bodies. Idempotent.

        A FIFO queue gets no queue-level delay: SQS would add it to every message, a due one too, and no
        per-message delay can override it there; the provider's senders keep it (the store adds it to
        the due time of each message sent to that endpoint)."""
        name = self.queue_name(endpoint)
        fifo = _is_fifo(name)
        attributes = {"FifoQueue": "true"} if fifo else {}
        if queue_delay_seconds:
            if isinstance(queue_delay_seconds, bool) or not isinstance(queue_delay_seconds, int) \
                    or not 0 <= queue_delay_seconds <= NATIVE_MAX_DELAY:
                # moto accepts more; real SQS does not: check here so tests mean what production does
                raise DelayError(f"queue_delay_seconds must be an int in 0..{NATIVE_MAX_DELAY} on SQS, "
                                 f"got {queue_delay_seconds!r}")
            if not fifo:
                attributes["DelaySeconds"] = str(queue_delay_seconds)
        try:
            self._urls[name] = self.client.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
            summary = {"transport": self.name, "endpoint": endpoint, "queue": name}
            if unrestricted:
                delay_queue = delay_queue_name(endpoint, self.prefix)
                self._urls[delay_queue] = self._create_or_update(delay_queue, self._delay_queue_attributes(fifo))
                summary["delay_queue"] = delay_queue
        except ClientError as exc:
            raise InvalidInputError(f"SQS refused to create the queues of {endpoint!r}: {_aws_error(exc)}") from None
        except BotoCoreError as exc:
            raise UnavailableError(f"could not reach SQS: {_aws_error(exc)}") from None
        if self.large_body_bucket:
            summary["body_expiration_days"] = self._expire_bodies()
        return summary

    def _delay_queue_attributes(self, fifo_endpoint: bool) -> dict[str, str]:
        retention = {"MessageRetentionPeriod": str(DELAY_QUEUE_RETENTION)}
        if fifo_endpoint:  # a standard queue: each hop carries its own DelaySeconds
            return retention
        return {"FifoQueue": "true", "DelaySeconds": str(self.queue_delay), **retention}

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
        """Start-up check of the delay queue: present, delay >= Q (a FIFO endpoint's standard delay queue: any,
        each hop sets its own), retention longer than the longest wait there, no redrive policy. A retention
        too short to outlast `max_relay_downtime` is a warning (logged and in the report's `warnings`): a
        relay down that long would lose messages silently."""
        fifo_endpoint = _is_fifo(self.queue_name(endpoint))  # a name SQS cannot have says so, not "missing"
        queue = delay_queue_name(endpoint, self.prefix)
        try:
            url = self._url(queue)
        except DestinationNotFoundError:
            takes = ("delayed messages (a FIFO queue takes no per-message delay)" if fifo_endpoint
                     else f"delays over {NATIVE_MAX_DELAY} s")
            raise DestinationNotFoundError(
                f"delay queue {queue!r} is missing: {endpoint!r} cannot take {takes}; "
                "provision it with unrestricted delays"
            ) from None
        attrs = self.client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
        delay, retention = int(attrs.get("DelaySeconds", 0)), int(attrs.get("MessageRetentionPeriod", 0))
        # The longest a message waits there before the relay sees it: a hop is at most Q on a FIFO endpoint's.
        wait = self.queue_delay if fifo_endpoint else delay
        problems = []
        if not fifo_endpoint and delay < self.queue_delay:
            problems.append(f"DelaySeconds is {delay}, must be at least {self.queue_delay}")
        if retention <= wait:
            problems.append(f"MessageRetentionPeriod is {retention}, must be longer than {wait} s or every message "
                            f"expires before the relay sees it (provisioning sets {DELAY_QUEUE_RETENTION})")
        if attrs.get("RedrivePolicy"):
            problems.append("it has a RedrivePolicy; a delay queue must not dead-letter its messages")
        if problems:
            raise InvalidInputError(f"delay queue {queue!r} is misconfigured: " + "; ".join(problems))
        warnings = []
        if retention - wait < self.max_relay_downtime:
            warnings.append(
                f"MessageRetentionPeriod is {retention} s, so a relay down for more than {retention - wait} s loses "
                f"messages, less than max_relay_downtime ({self.max_relay_downtime:g} s); provision the endpoint again "
                f"to raise it to {DELAY_QUEUE_RETENTION} s (SQS's maximum)")
            log.warning("delay queue %s: %s", queue, warnings[-1])
        return {"delay_queue": queue, "delay_seconds": delay, "retention_seconds": retention,
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
        """Send to each message's queue in batches. A message SQS refuses (too large for the queue, say) fails
        alone, with InvalidInputError; an outage fails, with UnavailableError, only what SQS did not take."""
        now = self.clock()
        failures: dict[str, Exception] = {}
        by_queue: dict[str, list[tuple[DelayedMessage, dict]]] = {}
        for m in messages:
            try:
                queue, entry = self._entry(m, now)
            except (InvalidInputError, UnavailableError) as exc:  # bad name, size or group; S3 unreachable
                failures[m.message_id] = exc
                continue
            by_queue.setdefault(queue, []).append((m, entry))
        for queue, entries in by_queue.items():
            try:
                url = self._url(queue)
            except DestinationNotFoundError as missing:
                error = missing
                destination = entries[0][0].destination
                if queue != self.queue_name(destination):
                    takes = ("delayed messages only through it (a FIFO queue takes no per-message delay)"
                             if _is_fifo(destination) else "delays longer than 15 minutes")
                    error = DestinationNotFoundError(
                        f"destination {destination!r} does not accept {takes}: its delay queue {queue!r} does not "
                        "exist; provision it with unrestricted delays"
                    )
                failures.update({m.message_id: error for m, _ in entries})
                continue
            refused = self._send_entries(url, queue, [(m.message_id, entry) for m, entry in entries])
            failures.update({entries[i][0].message_id: error for i, error in refused.items()})
        return failures

    def _entry(self, m: DelayedMessage, now: datetime) -> tuple[str, dict]:
        """The queue and the SendMessageBatch entry of a message, checked before its body goes anywhere."""
        delay = seconds_until(m.due_at, now)
        queue = self.queue_name(m.destination)
        fifo = _is_fifo(queue)
        attributes = {
            ATTR_MESSAGE_ID: {"DataType": "String", "StringValue": m.message_id},
            ATTR_DUE_AT: {"DataType": "String", "StringValue": m.due_at.isoformat()},
        }
        if m.headers:
            attributes[ATTR_HEADERS] = {"DataType": "String", "StringValue": json.dumps(m.headers)}
        # A FIFO group is checked now, not at the hand-over.
        final = _final_fields(queue, m.message_id, m.headers, delay)
        if delay == 0 or not fifo and delay <= self.queue_delay:
            return queue, {"MessageBody": self._body(m, attributes), "MessageAttributes": attributes, **final}
        if not self.unrestricted:
            reason = (f"{queue!r} is a FIFO queue, which takes no per-message delay" if fifo
                      else f"it exceeds {self.queue_delay} s")
            raise DelayError(
                f"message {m.message_id} has a delay of {delay} s, and {reason}: this sender has unrestricted delays "
                "disabled; enable them (unrestricted=True) and provision the destination's delay queue"
            )
        # The relay keeps the rest of the delay: the full delay travels in an attribute.
        attributes[ATTR_DELAY] = {"DataType": "Number", "StringValue": str(delay)}
        entry = {"MessageBody": self._body(m, attributes), "MessageAttributes": attributes}
        if fifo:  # its delay queue is a standard one: each hop at most Q
            entry["DelaySeconds"] = min(delay, self.queue_delay)
        else:  # a FIFO delay queue, its own DelaySeconds Q: no per-message delay
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

    def _send_entries(self, url: str, queue: str, entries: list[tuple[str, dict]]) -> dict[int, Exception]:
        """Send `(message id, entry)` pairs to one queue in batches of at most 10 entries and 1 MiB; returns the
        failures by position. A message SQS refuses fails alone (InvalidInputError). An outage (a server error,
        throttling, no answer) fails (UnavailableError) the rest from where it struck, never what SQS took."""
        failures: dict[int, Exception] = {}
        settled: set[int] = set()  # taken by SQS, or refused
        for chunk in _chunks([entry for _, entry in entries]):
            outage = self._send_chunk(url, queue, entries, chunk, failures, settled)
            if outage is not None:
                failures.update({i: outage for i in range(len(entries)) if i not in settled})
                break
        return failures

    def _send_chunk(self, url: str, queue: str, entries: list[tuple[str, dict]], chunk: list[int],
                    failures: dict[int, Exception], settled: set[int]) -> Exception | None:
        """One SendMessageBatch of the entries at `chunk`; the outage that stopped it, or None."""
        try:
            result = self.client.send_message_batch(
                QueueUrl=url, Entries=[{"Id": str(n), **entries[i][1]} for n, i in enumerate(chunk)])
        except (ClientError, BotoCoreError) as exc:
            if _not_found(exc):
                return DestinationNotFoundError(f"SQS queue {queue!r} does not exist")
            if not _refused(exc):
                return UnavailableError(f"could not send to SQS queue {queue!r}: {_aws_error(exc)}")
            if len(chunk) == 1:
                failures[chunk[0]] = InvalidInputError(
                    f"SQS queue {queue!r} refused message {entries[chunk[0]][0]}: {_aws_error(exc)}")
                settled.add(chunk[0])
                return None
            # SQS refused the whole batch for one message's fault without naming it: each alone, so the
            # good ones go once and the bad one is named.
            for i in chunk:
                if (outage := self._send_chunk(url, queue, entries, [i], failures, settled)) is not None:
                    return outage
            return None
        for failed in result.get("Failed", []):
            i = chunk[int(failed["Id"])]
            error = f"{failed.get('Code')}: {failed.get('Message')}"
            if failed.get("SenderFault") is False:
                failures[i] = UnavailableError(f"SQS queue {queue!r} could not take message {entries[i][0]}: {error}")
            else:
                failures[i] = InvalidInputError(f"SQS queue {queue!r} refused message {entries[i][0]}: {error}")
        settled.update(chunk)
        return None

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
                   throttle: TokenBucket | None = None, error_queue: str = "error") -> RelayCounts:
        """One long poll of the endpoint's delay queue; every message received is sent on and deleted.

        remaining = delay - (now - SentTimestamp), all on SQS's clock: now is the later of the message's
        ApproximateFirstReceiveTimestamp and the receive response's Date header (whole seconds, cut), so a
        host clock that runs ahead never makes a message early. Above Q (a FIFO endpoint: above 0): back to
        the delay queue; else to the destination, with DelaySeconds = remaining on a standard one, with no
        delay (its group and deduplication id) on a FIFO one, in due order. Sends are batched per queue,
        then the handled messages deleted in one batch; a send that failed for an outage is made visible
        again at once. A message SQS refuses for good (too large for the destination, say) is logged as an
        error and dead-lettered to `error_queue` as the pump does (headers say where it was going and why);
        when that fails too it stays in the delay queue, hidden for REFUSED_RETRY_SECONDS.
        """
        delay_queue = delay_queue_name(endpoint, self.prefix)
        delay_url = self._url(delay_queue)
        destination = self.queue_name(endpoint)
        dest_url = self._url(destination)
        fifo_endpoint = _is_fifo(destination)
        try:
            response = self.client.receive_message(
                QueueUrl=delay_url, MaxNumberOfMessages=BATCH_SIZE, WaitTimeSeconds=wait_time_seconds,
                VisibilityTimeout=visibility_timeout, MessageAttributeNames=["All"], AttributeNames=["All"],
            )
        except (ClientError, BotoCoreError) as exc:
            raise UnavailableError(
                f"could not receive from the delay queue of {endpoint!r}: {_aws_error(exc)}") from None
        got = response.get("Messages", [])
        counts = RelayCounts()
        if not got:
            return counts
        answered_ms = _sqs_now_ms(response) or 0
        back, onward, done = [], [], []
        for m in got:
            attrs = m.get("Attributes", {})
            sent = int(attrs["SentTimestamp"])
            # SQS's now: this receive's time, or for a redelivery (first received long ago) the response's.
            now_ms = max(int(attrs.get("ApproximateFirstReceiveTimestamp", sent)), answered_ms)
            remaining = float(_attr(m, ATTR_DELAY) or 0) - (now_ms - sent) / 1000
            attributes = dict(m.get("MessageAttributes", {}))
            entry = {"MessageBody": m["Body"], "MessageAttributes": attributes}
            source = _message_id(m)
            if remaining > (0 if fifo_endpoint else self.queue_delay):
                # Milliseconds carried along, so rounding happens once, at the hand-over.
                attributes[ATTR_DELAY] = {"DataType": "Number", "StringValue": f"{remaining:.3f}"}
                if fifo_endpoint:  # a standard delay queue: this hop's own delay, at most Q
                    entry["DelaySeconds"] = whole_seconds(min(remaining, self.queue_delay))
                else:
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
                headers = json.loads(_attr(m, ATTR_HEADERS) or "{}")
                try:
                    entry.update(_final_fields(destination, source, headers,
                                               whole_seconds(remaining, negative_is_now=True)))
                except InvalidInputError as exc:  # a group header SQS refuses (sent before it was checked)
                    if self._refused_for_good(m, endpoint, destination, exc, error_queue, delay_url, counts):
                        done.append(m)
                    continue
                onward.append((m, entry))
        # Handed over in due order: one receive may hold several messages of a FIFO group.
        onward.sort(key=lambda pair: _due_ms(pair[0]))
        if throttle is not None and onward:
            # The destination's maxReceivesPerSecond: what may not go yet comes back in a second.
            allowed = throttle.take_up_to(len(onward))
            for m, _ in onward[allowed:]:
                self.client.change_message_visibility(QueueUrl=delay_url, ReceiptHandle=m["ReceiptHandle"],
                                                      VisibilityTimeout=1)
                counts.held += 1
            onward = onward[:allowed]
        for url, queue, entries, counter in ((delay_url, delay_queue, back, "relayed"),
                                             (dest_url, destination, onward, "handed_over")):
            if not entries:
                continue
            failures = self._send_entries(url, queue, [(_message_id(m), entry) for m, entry in entries])
            for i, (m, _) in enumerate(entries):
                error = failures.get(i)
                if error is None:
                    setattr(counts, counter, getattr(counts, counter) + 1)
                    done.append(m)
                elif isinstance(error, (UnavailableError, DestinationNotFoundError)):
                    counts.failed += 1  # SQS's trouble, not the message's: tried again on the next receive
                    self.client.change_message_visibility(
                        QueueUrl=delay_url, ReceiptHandle=m["ReceiptHandle"], VisibilityTimeout=0)
                elif self._refused_for_good(m, endpoint, queue, error, error_queue, delay_url, counts):
                    done.append(m)
        self._delete(delay_url, done)
        return counts

    def _refused_for_good(self, m: dict, endpoint: str, queue: str, error: Exception, error_queue: str,
                          delay_url: str, counts: RelayCounts) -> bool:
        """A relayed message SQS will never take as it is: to the error queue, as the pump dead-letters (True:
        the caller deletes it), or when that fails too, hidden in the delay queue for a while (False)."""
        message_id = _message_id(m)
        problem = self._dead_letter(m, endpoint, error, error_queue)
        if problem is None:
            counts.dead_lettered += 1
            log.error("relay of %r: SQS queue %r refused message %s for good, dead-lettered to %r: %s",
                      endpoint, queue, message_id, error_queue, error)
            return True
        counts.failed += 1
        log.error("relay of %r: SQS queue %r refused message %s for good (%s), and it could not be dead-lettered "
                  "(%s): it stays in the delay queue, tried again in %d s", endpoint, queue, message_id, error,
                  problem, REFUSED_RETRY_SECONDS)
        try:
            self.client.change_message_visibility(QueueUrl=delay_url, ReceiptHandle=m["ReceiptHandle"],
                                                  VisibilityTimeout=REFUSED_RETRY_SECONDS)
        except (ClientError, BotoCoreError) as exc:  # back after its visibility timeout, and tried again then
            log.warning("could not hide message %s in the delay queue of %r: %s", message_id, endpoint,
                        _aws_error(exc))
        return False

    def _dead_letter(self, m: dict, endpoint: str, error: Exception, error_queue: str) -> str | None:
        """Send a relayed message, body and attributes as they are, to the error queue with the pump's
        dead-letter headers; None when it went, else why not."""
        message_id = _message_id(m)
        headers = json.loads(_attr(m, ATTR_HEADERS) or "{}")
        failed_at = self.clock().isoformat()
        headers.setdefault(HEADER_FIRST_FAILED_AT, failed_at)
        headers.update({HEADER_FAILED_DESTINATION: endpoint, HEADER_FAILED_AT: failed_at,
                        HEADER_FAILURE_REASON: str(error)[:1000], HEADER_FAILURES: "1"})
        attributes = {k: v for k, v in m.get("MessageAttributes", {}).items() if k not in (ATTR_DELAY, ATTR_CYCLE)}
        attributes[ATTR_HEADERS] = {"DataType": "String", "StringValue": json.dumps(headers)}
        try:
            queue = self.queue_name(error_queue)
            entry = {"MessageBody": m["Body"], "MessageAttributes": attributes,
                     **_final_fields(queue, message_id, headers)}
            url = self._url(queue)
        except (InvalidInputError, DestinationNotFoundError, UnavailableError) as exc:
            return str(exc)
        failure = self._send_entries(url, queue, [(message_id, entry)]).get(0)
        return None if failure is None else str(failure)

    def relay_until(self, endpoint: str, deadline: datetime, totals: RelayCounts, wait_time_seconds: int = 20,
                    max_per_second: float | None = None, until_idle: bool = False, error_queue: str = "error") -> str:
        """Relay the endpoint's delay queue (`relay_once` after `relay_once`, adding to `totals`) until
        `deadline`, each long poll shortened so none outlasts it. Returns why it stopped: `"deadline"`, or
        with `until_idle`, `"idle"` as soon as the delay queue has no visible message (a caller may then
        wait elsewhere, e.g. a deferred task on SqsDelayQueueTrigger, instead of paying for empty polls).

        `max_per_second` caps the hand-overs to the endpoint (a delivery policy's maxReceivesPerSecond);
        its token bucket lasts for this call. `error_queue` takes what SQS refuses for good (see `relay_once`)."""
        throttle = TokenBucket(max_per_second) if max_per_second else None
        while (left := (deadline - utcnow()).total_seconds()) > 0:
            if until_idle and self.lifecycle(endpoint, delay_queue=True)["visible"] == 0:
                return "idle"
            totals.add(self.relay_once(endpoint, min(wait_time_seconds, max(0, int(left))), throttle=throttle,
                                       error_queue=error_queue))
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
    dead_lettered: int = 0  # refused by SQS for good (too large for the destination, say): in the error queue

    def add(self, other: RelayCounts) -> None:
        self.relayed += other.relayed
        self.handed_over += other.handed_over
        self.failed += other.failed
        self.held += other.held
        self.dead_lettered += other.dead_lettered


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


def _entry_bytes(entry: dict) -> int:
    """An entry's size as SQS counts it against its limits: the body, and each attribute's name, type and value."""
    size = len(entry["MessageBody"].encode())
    for name, value in entry.get("MessageAttributes", {}).items():
        size += len(name.encode()) + len(value["DataType"].encode())
        size += len(value.get("StringValue", "").encode()) + len(value.get("BinaryValue", b""))
    return size


def _chunks(entries: list[dict]) -> Iterator[list[int]]:
    """Positions of `entries` in batches of at most 10 entries and 1 MiB (SQS's limits of one batch)."""
    chunk: list[int] = []
    size = 0
    for i, entry in enumerate(entries):
        n = _entry_bytes(entry)
        if chunk and (len(chunk) == BATCH_SIZE or size + n > MAX_BATCH_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(i)
        size += n
    if chunk:
        yield chunk


def _due_ms(message: dict) -> float:
    """A received message's due time (ms), for handing a batch over in due order; unknown ones last."""
    due = _attr(message, ATTR_DUE_AT)
    try:
        return datetime.fromisoformat(due).timestamp() * 1000 if due else math.inf
    except ValueError:
        return math.inf


def _message_id(message: dict) -> str:
    """The provider's id of a received message (SQS's own for one sent by something else)."""
    return _attr(message, ATTR_MESSAGE_ID) or message["MessageId"]


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


def assumed_role_session(client_args: dict, role: dict):
    """A boto3 session whose credentials come from assuming `role["role_arn"]` (with `role["kwargs"]`, through
    `role["sts_endpoint_url"]`) from the base credentials in `client_args` (or this machine's own when it has
    none), refreshed by botocore before they expire: a sweep outlives any one set of them."""
    import boto3
    import botocore.session
    from botocore.credentials import AssumeRoleCredentialFetcher, DeferredRefreshableCredentials

    region = client_args.get("region_name")
    base = boto3.session.Session(region_name=region, **{k: v for k, v in client_args.items() if k.startswith("aws_")})
    fetcher = AssumeRoleCredentialFetcher(
        client_creator=partial(base._session.create_client, region_name=region,
                               endpoint_url=role.get("sts_endpoint_url")),
        source_credentials=base._session.get_credentials(),
        role_arn=role["role_arn"],
        extra_args=dict(role.get("kwargs") or {}),
    )
    core = botocore.session.get_session()
    core._credentials = DeferredRefreshableCredentials(method="assume-role", refresh_using=fetcher.fetch_credentials)
    return boto3.session.Session(botocore_session=core, region_name=region)
