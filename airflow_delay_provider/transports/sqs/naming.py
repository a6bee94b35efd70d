"""SQS names and delay arithmetic, with no SQS client: delay-queue names, queue-name checks, the FIFO
message-group and deduplication id rules, and how a delay is carried (its plan and relay cost)."""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

from airflow_delay_provider.core.checks import check_int, check_number
from airflow_delay_provider.core.delays import whole_seconds
from airflow_delay_provider.core.errors import DelayError, InvalidMessageError, InvalidNameError

NATIVE_MAX_DELAY = 900
DELAY_QUEUE_SUFFIX = "-delay.fifo"
#: The delay queue of a FIFO endpoint: a standard queue, so each hop carries its own DelaySeconds.
FIFO_DELAY_QUEUE_SUFFIX = "-fifo-delay"
#: The header naming a message's group on a FIFO destination (SQS's MessageGroupId).
HEADER_MESSAGE_GROUP = "x-message-group-id"
#: The group of a message without that header: one group per queue keeps the whole queue in order,
#: which is what a FIFO queue is chosen for; name a group per key (a customer, an order) for parallel consumers.
DEFAULT_MESSAGE_GROUP = "default"
MAX_QUEUE_NAME = 80
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def delay_queue_name(name: str, prefix: str = "") -> str:
    """The delay queue of endpoint `name`: `<prefix><name>-delay.fifo` (a FIFO queue), or for a FIFO endpoint
    `<prefix><stem>.fifo` the standard queue `<prefix><stem>-fifo-delay` (it takes the per-message delays a
    FIFO queue refuses). Characters outside ``[A-Za-z0-9_-]`` are replaced by '-' (the `.fifo` kept).

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
    return check_int("queue_delay", queue_delay, 1, NATIVE_MAX_DELAY, unit="seconds", hint="SQS's limit",
                     error=DelayError)


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
    check_number("price_per_request", price_per_request, 0)
    return delay_plan(delay_seconds, queue_delay).requests() * price_per_request


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


_FIFO_ID = re.compile(r"[A-Za-z0-9!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]{1,128}")


def _fifo_id(value: str) -> str:
    """FIFO dedup and group ids allow 128 characters of a limited set: the value when it fits, else
    its SHA-256 (cutting or replacing characters could make two ids one, and SQS drop a message)."""
    return value if _FIFO_ID.fullmatch(value) else hashlib.sha256(value.encode()).hexdigest()


def _dedup_id(message_id: str, cycle: int) -> str:
    return _fifo_id(f"{message_id}:{cycle}")
