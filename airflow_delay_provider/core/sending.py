"""Sending through a broker's own delays: every destination checked first, ids de-duplicated, outages
retried under a circuit breaker, and each confirmed id recorded at once."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Protocol

from airflow_delay_provider.core.breakers import CircuitBreaker, call_with_breaker
from airflow_delay_provider.core.delays import seconds_until
from airflow_delay_provider.core.duplicates import SKIP, check_natively
from airflow_delay_provider.core.errors import DelayProviderError, UnavailableError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.ports import Transport

log = logging.getLogger(__name__)


class SentIds(Protocol):
    """Where ids accepted within the de-duplication window are kept (the store's `<table>_ids`)."""

    def unseen(self, message_ids: Sequence[str]) -> list[str]: ...

    def remember_sent(self, message_ids: Sequence[str]) -> None: ...


def send_natively(ids: SentIds, transport: Transport, batch: Sequence[DelayedMessage], breaker: CircuitBreaker,
                  on_duplicate: str = SKIP) -> int:
    """Hand `batch` to the broker's own delay mechanism; returns how many were sent.

    A broker cannot change or withdraw a message once it has it: `on_duplicate` other than ``skip`` is refused
    (InvalidInputError naming the mode and the transport) before anything is sent.

    Ids accepted within the de-duplication window are skipped, and each id the broker confirms is
    recorded at once, so a retried task sends none of them twice. A missing destination is found
    before anything is sent. A message the broker refuses fails the call after the others are
    recorded; an outage is retried until the breaker gives up."""
    check_natively(on_duplicate, transport.name)
    now = transport.clock()
    for m in batch:  # a delay the broker cannot carry refuses the send before anything is sent
        transport.check_delay(m, seconds_until(m.due_at, now))
    fresh = set(call_with_breaker(breaker, lambda: ids.unseen([m.message_id for m in batch]),
                                  retry_on=(UnavailableError,)))
    if len(fresh) < len(batch):
        log.info("%d message(s) were already sent with the same ids: not sent again", len(batch) - len(fresh))
    for destination in sorted({m.destination for m in batch}):
        call_with_breaker(breaker, partial(transport.depth, destination), retry_on=(UnavailableError,))
    pending = [m for m in batch if m.message_id in fresh]
    # The broker's outage has a breaker of its own: the store answering between attempts is no sign the
    # broker is back, so its success must not keep disarming the broker's timer.
    sending = breaker.like(f"sending through {transport.name}")
    confirmed = 0
    while pending:
        try:
            failures = transport.send(pending)
        except UnavailableError as exc:
            failures = {m.message_id: exc for m in pending}
        sent = [m.message_id for m in pending if m.message_id not in failures]
        if sent:
            call_with_breaker(breaker, partial(ids.remember_sent, sent), retry_on=(UnavailableError,))
            confirmed += len(sent)
        refused = {mid: e for mid, e in failures.items() if not isinstance(e, UnavailableError)}
        if refused:
            raise DelayProviderError(
                f"{len(refused)} of {len(batch)} message(s) were refused by {transport.name} (the "
                f"{confirmed} confirmed ones are recorded and a retry will not send them again): "
                + "; ".join(f"{mid}: {e}" for mid, e in list(refused.items())[:5])
            )
        pending = [m for m in pending if m.message_id in failures]
        if not pending:
            break
        if sent:  # progress: the broker is taking messages, the rest go on the next attempt
            sending.success()
        sending.failure(next(iter(failures.values())))
    now = transport.clock()  # the delays' descriptions below, after the sends
    for m in batch[:20]:
        if (how := transport.describe_delay(seconds_until(m.due_at, now), m.destination)) is not None:
            log.info("%s: %s", m.message_id, how)
    return len(fresh)
