"""What becomes of a message whose delivery failed: stored again for a retry, or dead-lettered.

One rule for every consumer of due messages (the pump, the asset-event producer): the failed attempt
is counted; a message whose failure is final (its destination does not exist, a subscriber rejected
it) or that has used its delivery policy's retries goes to the error queue, with headers saying where
it came from, when, why and after how many attempts; any other is stored again, due after the
policy's backoff for that attempt, and keeps the time of its first failure. The jitter is drawn from
a generator seeded by the message id and the attempt, so settling the same failure twice (a batch
settled again after a store error) retries it at the same time.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from airflow_delay_provider.core.errors import DestinationNotFoundError, UnavailableError
from airflow_delay_provider.core.message import HEADER_FIRST_FAILED_AT, HEADER_GAVE_UP, DelayedMessage
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.core.stats import PumpStats


@dataclass(frozen=True)
class Retry:
    """Store the message again, due at `at`."""

    at: datetime
    #: The message's headers with the time of its first failure, when they do not have it yet (else None:
    #: the stored headers stay as they are).
    headers: dict[str, str] | None


@dataclass(frozen=True)
class DeadLetter:
    """Send `message` (the failed one, addressed to the error queue) and remove the original."""

    message: DelayedMessage


def settle_failure(message: DelayedMessage, reason: str, policy: DeliveryPolicy, error_queue: str, now: datetime,
                   jitter: float, final: bool = False) -> Retry | DeadLetter:
    """The settlement of one failed delivery of `message` (`message.failures` counts the earlier ones).

    :param reason: why this attempt failed, for the dead letter's failure-reason header.
    :param policy: the destination's delivery policy (its retries and backoff).
    :param error_queue: where a dead letter goes.
    :param now: the time of the failure, on the clock due times are kept on.
    :param jitter: the fraction of the backoff to randomise (see DeliveryPolicy.jittered).
    :param final: no retry whatever the policy says.
    """
    attempts = message.failures + 1
    if final or attempts > policy.num_retries:
        marked = {**message.headers, HEADER_GAVE_UP: policy.gave_up(attempts, final)}
        failed = DelayedMessage.trusted(message.destination, message.body, message.due_at, marked,
                                        message.message_id, attempts)
        return DeadLetter(failed.dead_lettered(error_queue, f"{reason} (after {attempts} attempt(s))", now))
    delay = policy.jittered(policy.delay_before(attempts), jitter, random.Random(f"{message.message_id}:{attempts}"))
    headers = None if HEADER_FIRST_FAILED_AT in message.headers else {
        **message.headers, HEADER_FIRST_FAILED_AT: now.isoformat()}
    return Retry(now + timedelta(seconds=delay), headers)


@dataclass
class FailedBatch:
    """The failed deliveries of one batch, as settle_failure sorted them: the retries (each one's new due time,
    and the headers to store where the first failure is recorded now) and the dead letters to send."""

    retries: dict[str, datetime] = field(default_factory=dict)
    headers: dict[str, dict[str, str]] = field(default_factory=dict)
    dead: list[DelayedMessage] = field(default_factory=list)
    #: Why each failed, for the delivery history.
    reasons: dict[str, str] = field(default_factory=dict)

    def add(self, message_id: str, outcome: Retry | DeadLetter, reason: str = "") -> None:
        self.reasons[message_id] = reason
        if isinstance(outcome, DeadLetter):
            self.dead.append(outcome.message)
            return
        self.retries[message_id] = outcome.at
        if outcome.headers is not None:
            self.headers[message_id] = outcome.headers


def sort_outcomes(messages: Iterable[DelayedMessage], failures: Mapping[str, Exception], sent_at: datetime,
                  stats: PumpStats, policy_for: Callable[[str], DeliveryPolicy], error_queue: str,
                  jitter: float) -> tuple[list[str], FailedBatch, Exception | None]:
    """The outcome of a batch's sends, counted into `stats`: the ids delivered, the failed deliveries as
    `settle_failure` sorts them (a retry, or a dead letter to send), and the last error that was not the message's
    own (an outage, a refusal), or None.

    An outage (UnavailableError) is not the message's fault: it stays stored as it was (its claim restores it) and
    the pump's dispatch breaker decides how long to keep trying. A destination that does not exist is final."""
    delivered: list[str] = []
    failed = FailedBatch()
    transient: Exception | None = None
    for m in messages:
        exc = failures.get(m.message_id)
        if exc is None:
            delivered.append(m.message_id)
            stats.dispatched += 1
            stats.count(m.destination, "dispatched")
            stats.lateness.add((sent_at - m.due_at).total_seconds())
            continue
        if isinstance(exc, UnavailableError):
            transient = exc
            stats.released += 1
            stats.count(m.destination, "released")
            continue
        stats.count(m.destination, "failed")
        missing = isinstance(exc, DestinationNotFoundError)
        if not missing:
            transient = exc
        reason = f"destination not found: {exc}" if missing else f"{type(exc).__name__}: {exc}"
        # A retry is itself a delayed message: stored, it survives restarts and holds no worker.
        failed.add(m.message_id, settle_failure(m, reason, policy_for(m.destination), error_queue, sent_at, jitter,
                                                final=missing), reason)
    return delivered, failed, transient
