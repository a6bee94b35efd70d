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

import json
import logging
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime
from functools import partial
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from airflow_delay_provider.core.checks import check_int, check_number
from airflow_delay_provider.core.delays import UTC, seconds_until
from airflow_delay_provider.core.errors import (
    DelayError,
    DestinationNotFoundError,
    InvalidInputError,
    InvalidNameError,
    UnavailableError,
)
from airflow_delay_provider.core.message import DelayedMessage, check_destination
from airflow_delay_provider.core.ports import ReceivedMessage, Transport
from airflow_delay_provider.core.throttle import TokenBucket
from airflow_delay_provider.transports.sqs import provisioning, relay
from airflow_delay_provider.transports.sqs.bodies import BODY_EXPIRATION_DAYS, MAX_BODY_BYTES, Bodies, _decode_body
from airflow_delay_provider.transports.sqs.naming import (
    DELAY_QUEUE_SUFFIX,
    FIFO_DELAY_QUEUE_SUFFIX,
    NATIVE_MAX_DELAY,
    PRICE_PER_REQUEST,
    _check_queue_delay,
    _dedup_id,
    _fifo_id,
    _final_fields,
    _is_fifo,
    check_queue_name,
    delay_plan,
    delay_queue_name,
    estimate_cost,
)
from airflow_delay_provider.transports.sqs.relay import RelayCounts
from airflow_delay_provider.transports.sqs.wire import (
    ATTR_BODY_S3,
    ATTR_DELAY,
    ATTR_DUE_AT,
    ATTR_HEADERS,
    ATTR_MESSAGE_ID,
    BATCH_SIZE,
    Backoff,
    _attr,
    _aws_error,
    _code,
    _codes,
)

log = logging.getLogger(__name__)

#: The longest the relay may be down by default: check_delay_queue() warns when the delay queue's retention is shorter.
MAX_RELAY_DOWNTIME = 7 * 86_400
MAX_BATCH_BYTES = 1024 * 1024  # SQS's message and batch limit (1 MiB)
#: A receipt of a message whose body is in S3 carries the object too, so any process can ack it.
RECEIPT_S3 = " s3://"


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
    return isinstance(exc, ClientError) and any(c in _REFUSALS for c in _codes(exc))


class SqsTransport(Transport):
    """Sends each message to arrive at its due time: natively up to 900 s, through `-delay.fifo` beyond."""

    name = "sqs"
    delays_natively = True

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
        if large_body_bucket and s3_client is None:
            raise InvalidInputError("large_body_bucket needs an S3 client (SqsDelayHook.get_transport makes one)")
        check_number("max_relay_downtime", max_relay_downtime, above=0, what="a number of seconds")
        check_int("body_expiration_days", body_expiration_days, 1)
        self.max_relay_downtime = max_relay_downtime
        self.bodies = Bodies(s3_client, large_body_bucket, prefix, max_body_bytes, body_expiration_days)
        self._urls: dict[str, str] = {}
        #: Copies received after another copy's ack had deleted their shared S3 body, deleted unseen.
        self.duplicates_dropped = 0

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> SqsTransport:
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

    @property
    def s3(self) -> Any:
        """The S3 client large bodies go through (held by `bodies`; setting it replaces theirs)."""
        return self.bodies.s3

    @s3.setter
    def s3(self, client: Any) -> None:
        self.bodies.s3 = client

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

    def check_delay(self, message: DelayedMessage, seconds: int) -> None:
        self.bodies.check_delay(message, seconds)

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

    # -- provisioning (provisioning.py) ---------------------------------------------------------------
    def provision(self, endpoint: str, queue_delay_seconds: int | None = None,
                  unrestricted: bool = True) -> dict[str, Any]:
        """The endpoint queue (optionally with a queue-level delay; a FIFO one, `<name>.fifo`, with
        FifoQueue), for unrestricted delays its delay queue (`-delay.fifo`: FIFO, DelaySeconds = Q; a FIFO
        endpoint's `-fifo-delay`: standard; both retention 14 days, an existing one updated to these), and
        with a `large_body_bucket` the bucket's rule expiring bodies. Idempotent.

        A FIFO queue gets no queue-level delay: SQS would add it to every message, a due one too, and no
        per-message delay can override it there; the provider's senders keep it (the store adds it to
        the due time of each message sent to that endpoint)."""
        return provisioning.provision(self, endpoint, queue_delay_seconds, unrestricted)

    def verify(self, endpoints: str | Iterable[str] = ()) -> dict[str, Any]:
        """The provisioning report of these endpoints, as every transport gives it: `complete`, `missing` and
        `different` (misconfigured) queues, and each delay queue's report (`check_delay_queue`) under
        `endpoints`.

        A single name (a str) is deprecated: it returned `check_delay_queue`'s report instead, and still
        does, with a DeprecationWarning, until the next minor release."""
        if isinstance(endpoints, str):
            warnings.warn("SqsTransport.verify(name) is deprecated: call check_delay_queue(name) for one delay "
                          "queue's check, or verify([name]) for the provisioning report",
                          DeprecationWarning, stacklevel=2)
            return self.check_delay_queue(endpoints)
        return provisioning.verify(self, endpoints)

    def check_delay_queue(self, endpoint: str) -> dict[str, Any]:
        """Start-up check of the delay queue: present, delay >= Q (a FIFO endpoint's standard delay queue: any,
        each hop sets its own), retention longer than the longest wait there, no redrive policy. A retention
        too short to outlast `max_relay_downtime` is a warning (logged and in the report's `warnings`): a
        relay down that long would lose messages silently."""
        return provisioning.check_delay_queue(self, endpoint)

    def depth(self, endpoint: str) -> dict[str, int]:
        """The endpoint queue's messages: visible, in flight, scheduled (raises DestinationNotFoundError
        when it is missing)."""
        return self.lifecycle(endpoint)

    def lifecycle(self, endpoint: str, delay_queue: bool = False) -> dict[str, int]:
        """A queue's messages as SQS counts them: scheduled (delayed), visible, in flight."""
        name = delay_queue_name(endpoint, self.prefix) if delay_queue else self.queue_name(endpoint)
        try:
            attrs = self.client.get_queue_attributes(QueueUrl=self._url(name), AttributeNames=[
                "ApproximateNumberOfMessagesDelayed", "ApproximateNumberOfMessages",
                "ApproximateNumberOfMessagesNotVisible",
            ])["Attributes"]
        except (ClientError, BotoCoreError) as exc:
            if _not_found(exc):  # deleted since its url was looked up
                self._urls.pop(name, None)
                raise DestinationNotFoundError(f"SQS queue {name!r} does not exist") from None
            raise UnavailableError(f"could not count the messages of SQS queue {name!r}: {_aws_error(exc)}") from None
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
        by_queue: dict[str, list[tuple[DelayedMessage, dict[str, Any]]]] = {}
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

    def _entry(self, m: DelayedMessage, now: datetime) -> tuple[str, dict[str, Any]]:
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
            return queue, {"MessageBody": self.bodies.body(m, attributes), "MessageAttributes": attributes, **final}
        if not self.unrestricted:
            reason = (f"{queue!r} is a FIFO queue, which takes no per-message delay" if fifo
                      else f"it exceeds {self.queue_delay} s")
            raise DelayError(
                f"message {m.message_id} has a delay of {delay} s, and {reason}: this sender has unrestricted delays "
                "disabled; enable them (unrestricted=True) and provision the destination's delay queue"
            )
        # The relay keeps the rest of the delay: the full delay travels in an attribute.
        attributes[ATTR_DELAY] = {"DataType": "Number", "StringValue": str(delay)}
        entry: dict[str, Any] = {"MessageBody": self.bodies.body(m, attributes), "MessageAttributes": attributes}
        if fifo:  # its delay queue is a standard one: each hop at most Q
            entry["DelaySeconds"] = min(delay, self.queue_delay)
        else:  # a FIFO delay queue, its own DelaySeconds Q: no per-message delay
            entry["MessageDeduplicationId"] = _dedup_id(m.message_id, 0)
            entry["MessageGroupId"] = _fifo_id(m.message_id)
        return delay_queue_name(m.destination, self.prefix), entry

    def _send_entries(self, url: str, queue: str, entries: list[tuple[str, dict[str, Any]]]) -> dict[int, Exception]:
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

    def _send_chunk(self, url: str, queue: str, entries: list[tuple[str, dict[str, Any]]], chunk: list[int],
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
        queue = self.queue_name(endpoint)
        url = self._url(queue)
        try:
            got = self.client.receive_message(
                QueueUrl=url, MaxNumberOfMessages=min(max_messages, 10), VisibilityTimeout=int(visibility_timeout),
                MessageAttributeNames=["All"], AttributeNames=["All"], WaitTimeSeconds=0,
            ).get("Messages", [])
        except (ClientError, BotoCoreError) as exc:  # nothing was taken: receiving again later is safe
            raise UnavailableError(f"could not receive from SQS queue {queue!r}: {_aws_error(exc)}") from None
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
                    message = _received(endpoint, m, self.bodies.peek(pointer) if pointer else None)
                    if pointer and not message.body:
                        message.extra.update(body_missing=True, body_s3=pointer)
                    seen.setdefault(m["MessageId"], replace(message, receipt=None))  # once, if the walk is slow
        except (ClientError, BotoCoreError) as exc:
            raise UnavailableError(f"could not peek at SQS queue {endpoint!r}: {_aws_error(exc)}") from None
        finally:
            self._show(url, handles)
        return list(seen.values())

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

    def _large_body(self, url: str, m: dict[str, Any], pointer: str) -> bytes | None:
        """The body from S3, or None when it is gone: the message is then deleted, not delivered."""
        message_id = _attr(m, ATTR_MESSAGE_ID) or m["MessageId"]
        body = self.bodies.read(pointer, message_id)
        if body is not None:
            return body
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
        bucket's lifecycle rule expires what a failed delete leaves). A delete SQS throttles is tried again
        after a backoff (an unacked message comes back, a duplicate for the consumer); when it still
        fails, UnavailableError: the messages of that batch and after it were not deleted."""
        queue = self.queue_name(endpoint)
        url = self._url(queue)
        parts = [str(r).partition(RECEIPT_S3) for r in receipts]  # (handle, separator, pointer)
        deleted = 0
        retry = Backoff()  # one budget of waits for the whole ack
        for i in range(0, len(parts), BATCH_SIZE):
            chunk = parts[i : i + BATCH_SIZE]
            try:
                result = retry(self.client.delete_message_batch, QueueUrl=url, Entries=[
                    {"Id": str(n), "ReceiptHandle": r[0]} for n, r in enumerate(chunk)])
            except (ClientError, BotoCoreError) as exc:
                raise UnavailableError(
                    f"could not delete {len(parts) - i} of {len(parts)} received message(s) from SQS queue "
                    f"{queue!r} ({deleted} deleted before): {_aws_error(exc)}") from None
            deleted += len(result.get("Successful", []))
            for ok in result.get("Successful", []):
                pointer = chunk[int(ok["Id"])][2]
                if pointer:  # delivered: its large body is no longer needed
                    self.bodies.delete(pointer)
        return deleted

    # -- the relay: the delay queue's consumer (relay.py) ----------------------------------------
    def relay_once(self, endpoint: str, wait_time_seconds: int = 20, visibility_timeout: int = 30,
                   throttle: TokenBucket | None = None, error_queue: str = "error") -> RelayCounts:
        """One long poll of the endpoint's delay queue; every message received is sent on and deleted
        (see `relay.relay_once`)."""
        return relay.relay_once(self, endpoint, wait_time_seconds, visibility_timeout, throttle, error_queue)

    def relay_until(self, endpoint: str, deadline: datetime, totals: RelayCounts, wait_time_seconds: int = 20,
                    max_per_second: float | None = None, until_idle: bool = False, error_queue: str = "error") -> str:
        """Relay the endpoint's delay queue until `deadline`, or with `until_idle` until it has no visible
        message; returns `"deadline"` or `"idle"` (see `relay.relay_until`)."""
        return relay.relay_until(self, endpoint, deadline, totals, wait_time_seconds, max_per_second, until_idle,
                                 error_queue)


def _entry_bytes(entry: dict[str, Any]) -> int:
    """An entry's size as SQS counts it against its limits: the body, and each attribute's name, type and value."""
    size = len(entry["MessageBody"].encode())
    for name, value in entry.get("MessageAttributes", {}).items():
        size += len(name.encode()) + len(value["DataType"].encode())
        size += len(value.get("StringValue", "").encode()) + len(value.get("BinaryValue", b""))
    return size


def _chunks(entries: list[dict[str, Any]]) -> Iterator[list[int]]:
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


def _received(endpoint: str, m: dict[str, Any], body: bytes | None = None,
              receipt: str | None = None) -> ReceivedMessage:
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


def assumed_role_session(client_args: dict[str, Any], role: dict[str, Any]) -> Any:
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
