"""The relay: the consumer of an endpoint's delay queue. It receives what waited there, sends it back for
another pass while more of its delay is left than one pass takes, or else hands it to the destination with
the rest of its delay; what SQS refuses for good goes to the error queue, as the pump dead-letters."""

from __future__ import annotations

import email.utils
import json
import logging
import math
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from airflow_delay_provider.core.delays import utcnow, whole_seconds
from airflow_delay_provider.core.errors import DestinationNotFoundError, InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import dead_letter_headers
from airflow_delay_provider.core.throttle import TokenBucket
from airflow_delay_provider.transports.sqs.naming import (
    _dedup_id,
    _fifo_id,
    _final_fields,
    _is_fifo,
    delay_queue_name,
)
from airflow_delay_provider.transports.sqs.wire import (
    ATTR_CYCLE,
    ATTR_DELAY,
    ATTR_DUE_AT,
    ATTR_HEADERS,
    ATTR_MESSAGE_ID,
    BATCH_SIZE,
    Backoff,
    _attr,
    _aws_error,
    _codes,
)

if TYPE_CHECKING:
    from airflow_delay_provider.transports.sqs.transport import SqsTransport

log = logging.getLogger(__name__)

#: How long a relayed message that neither its destination nor the error queue takes stays hidden
#: before the relay tries it again: no tight loop, and it is kept until its retention ends.
REFUSED_RETRY_SECONDS = 900


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


def relay_once(transport: SqsTransport, endpoint: str, wait_time_seconds: int = 20, visibility_timeout: int = 30,
               throttle: TokenBucket | None = None, error_queue: str = "error") -> RelayCounts:
    """One long poll of the endpoint's delay queue; every message received is sent on and deleted.

    remaining = delay - (now - SentTimestamp), all on SQS's clock: now is the later of the message's
    ApproximateFirstReceiveTimestamp and the receive response's Date header (whole seconds, cut), so a
    host clock that runs ahead never makes a message early. Above Q (a FIFO endpoint: above 0): back to
    the delay queue; else to the destination, with DelaySeconds = remaining on a standard one, with no
    delay (its group and deduplication id) on a FIFO one, in due order. Sends are batched per queue,
    then the handled messages deleted in one batch (a throttled delete tried again within the pass; one
    that still fails raises UnavailableError, see `_delete`); a send that failed for an outage is made
    visible again at once. A message SQS refuses for good (too large for the destination, say) is logged
    as an error and dead-lettered to `error_queue` as the pump does (headers say where it was going and why);
    when that fails too it stays in the delay queue, hidden for REFUSED_RETRY_SECONDS.
    """
    client = transport.client
    delay_queue = delay_queue_name(endpoint, transport.prefix)
    delay_url = transport._url(delay_queue)
    destination = transport.queue_name(endpoint)
    dest_url = transport._url(destination)
    fifo_endpoint = _is_fifo(destination)
    try:
        response = client.receive_message(
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
        if remaining > (0 if fifo_endpoint else transport.queue_delay):
            # Milliseconds carried along, so rounding happens once, at the hand-over.
            attributes[ATTR_DELAY] = {"DataType": "Number", "StringValue": f"{remaining:.3f}"}
            if fifo_endpoint:  # a standard delay queue: this hop's own delay, at most Q
                entry["DelaySeconds"] = whole_seconds(min(remaining, transport.queue_delay))
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
                if _refused_for_good(transport, m, endpoint, destination, exc, error_queue, delay_url, counts):
                    done.append(m)
                continue
            onward.append((m, entry))
    # Handed over in due order: one receive may hold several messages of a FIFO group.
    onward.sort(key=lambda pair: _due_ms(pair[0]))
    if throttle is not None and onward:
        # The destination's maxReceivesPerSecond: what may not go yet comes back in a second.
        allowed = throttle.take_up_to(len(onward))
        for m, _ in onward[allowed:]:
            _set_visibility(client, delay_url, m, 1, endpoint)
            counts.held += 1
        onward = onward[:allowed]
    for url, queue, entries, counter in ((delay_url, delay_queue, back, "relayed"),
                                         (dest_url, destination, onward, "handed_over")):
        if not entries:
            continue
        failures = transport._send_entries(url, queue, [(_message_id(m), entry) for m, entry in entries])
        for i, (m, _) in enumerate(entries):
            error = failures.get(i)
            if error is None:
                setattr(counts, counter, getattr(counts, counter) + 1)
                done.append(m)
            elif isinstance(error, (UnavailableError, DestinationNotFoundError)):
                counts.failed += 1  # SQS's trouble, not the message's: tried again on the next receive
                _set_visibility(client, delay_url, m, 0, endpoint)
            elif _refused_for_good(transport, m, endpoint, queue, error, error_queue, delay_url, counts):
                done.append(m)
    _delete(client, delay_url, delay_queue, done)
    return counts


def _refused_for_good(transport: SqsTransport, m: dict[str, Any], endpoint: str, queue: str, error: Exception,
                      error_queue: str, delay_url: str, counts: RelayCounts) -> bool:
    """A relayed message SQS will never take as it is: to the error queue, as the pump dead-letters (True:
    the caller deletes it), or when that fails too, hidden in the delay queue for a while (False)."""
    message_id = _message_id(m)
    problem = _dead_letter(transport, m, endpoint, error, error_queue)
    if problem is None:
        counts.dead_lettered += 1
        log.error("relay of %r: SQS queue %r refused message %s for good, dead-lettered to %r: %s",
                  endpoint, queue, message_id, error_queue, error)
        return True
    counts.failed += 1
    log.error("relay of %r: SQS queue %r refused message %s for good (%s), and it could not be dead-lettered "
              "(%s): it stays in the delay queue, tried again in %d s", endpoint, queue, message_id, error,
              problem, REFUSED_RETRY_SECONDS)
    _set_visibility(transport.client, delay_url, m, REFUSED_RETRY_SECONDS, endpoint)
    return False


def _set_visibility(client: Any, url: str, m: dict[str, Any], seconds: int, endpoint: str) -> None:
    """Show a received message again in `seconds`. When SQS does not take the change (throttled, say), the
    pass goes on: the message was neither sent on nor deleted, and comes back after the receive's own
    visibility timeout, to be relayed then."""
    try:
        client.change_message_visibility(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"], VisibilityTimeout=seconds)
    except (ClientError, BotoCoreError) as exc:
        log.warning("could not set the visibility of message %s in the delay queue of %r to %d s (%s): it "
                    "comes back after its visibility timeout", _message_id(m), endpoint, seconds, _aws_error(exc))


def _dead_letter(transport: SqsTransport, m: dict[str, Any], endpoint: str, error: Exception,
                 error_queue: str) -> str | None:
    """Send a relayed message, body and attributes as they are, to the error queue with the pump's
    dead-letter headers; None when it went, else why not."""
    message_id = _message_id(m)
    headers = dead_letter_headers(json.loads(_attr(m, ATTR_HEADERS) or "{}"), endpoint, str(error), 1,
                                  transport.clock())
    attributes = {k: v for k, v in m.get("MessageAttributes", {}).items() if k not in (ATTR_DELAY, ATTR_CYCLE)}
    attributes[ATTR_HEADERS] = {"DataType": "String", "StringValue": json.dumps(headers)}
    try:
        queue = transport.queue_name(error_queue)
        entry = {"MessageBody": m["Body"], "MessageAttributes": attributes,
                 **_final_fields(queue, message_id, headers)}
        url = transport._url(queue)
    except (InvalidInputError, DestinationNotFoundError, UnavailableError) as exc:
        return str(exc)
    failure = transport._send_entries(url, queue, [(message_id, entry)]).get(0)
    return None if failure is None else str(failure)


def relay_until(transport: SqsTransport, endpoint: str, deadline: datetime, totals: RelayCounts,
                wait_time_seconds: int = 20, max_per_second: float | None = None, until_idle: bool = False,
                error_queue: str = "error") -> str:
    """Relay the endpoint's delay queue (`relay_once` after `relay_once`, adding to `totals`) until
    `deadline`, each long poll shortened so none outlasts it. Returns why it stopped: `"deadline"`, or
    with `until_idle`, `"idle"` as soon as the delay queue has no visible message (a caller may then
    wait elsewhere, e.g. a deferred task on SqsDelayQueueTrigger, instead of paying for empty polls).

    `max_per_second` caps the hand-overs to the endpoint (a delivery policy's maxReceivesPerSecond);
    its token bucket lasts for this call. `error_queue` takes what SQS refuses for good (see `relay_once`).
    Polls and counts go through the transport's own `relay_once` and `lifecycle`."""
    throttle = TokenBucket(max_per_second) if max_per_second else None
    while (left := (deadline - utcnow()).total_seconds()) > 0:
        if until_idle and transport.lifecycle(endpoint, delay_queue=True)["visible"] == 0:
            return "idle"
        totals.add(transport.relay_once(endpoint, min(wait_time_seconds, max(0, int(left))), throttle=throttle,
                                        error_queue=error_queue))
    return "deadline"


def _delete(client: Any, url: str, queue: str, messages: list[dict[str, Any]]) -> None:
    """Delete in one batch; retry failures one by one (an expired receipt handle means it is gone).

    These were sent on already: a request SQS throttled (or did not answer) goes again after a backoff,
    within this pass, since each message left behind comes back after its visibility timeout and is
    relayed again (a second copy of a hand-over to a standard queue). When it still fails, the pass
    fails with UnavailableError, not a botocore error: what was not deleted is relayed again, nothing
    is lost."""
    if not messages:
        return
    retry = Backoff()  # one budget of waits for the batch and the single deletes after it
    try:
        result = retry(client.delete_message_batch, QueueUrl=url, Entries=[
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])
    except (ClientError, BotoCoreError) as exc:
        raise _undeleted(queue, len(messages), len(messages), exc) from None
    left: list[Exception] = []
    for failed in result.get("Failed", []):
        try:
            retry(client.delete_message, QueueUrl=url, ReceiptHandle=messages[int(failed["Id"])]["ReceiptHandle"])
        except (ClientError, BotoCoreError) as exc:
            if not (isinstance(exc, ClientError) and "ReceiptHandleIsInvalid" in _codes(exc)):
                left.append(exc)
    if left:
        raise _undeleted(queue, len(left), len(messages), left[-1])


def _undeleted(queue: str, failed: int, of: int, exc: Exception) -> UnavailableError:
    return UnavailableError(
        f"could not delete {failed} of {of} message(s) relayed from SQS delay queue {queue!r}: {_aws_error(exc)}; "
        "they were sent on, and come back after their visibility timeout to be relayed again")


def _sqs_now_ms(response: dict[str, Any]) -> int | None:
    """SQS's clock when it answered, in ms: the response's Date header, cut to the second (so never after
    SQS's now); None without one."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return int(email.utils.parsedate_to_datetime(date).timestamp()) * 1000
    except (TypeError, ValueError):
        return None


def _due_ms(message: dict[str, Any]) -> float:
    """A received message's due time (ms), for handing a batch over in due order; unknown ones last."""
    due = _attr(message, ATTR_DUE_AT)
    try:
        return datetime.fromisoformat(due).timestamp() * 1000 if due else math.inf
    except ValueError:
        return math.inf


def _message_id(message: dict[str, Any]) -> str:
    """The provider's id of a received message (SQS's own for one sent by something else)."""
    return _attr(message, ATTR_MESSAGE_ID) or message["MessageId"]
