"""Moving pending messages between the store and a transport that delays natively, both ways.

Either way a message leaves its old home only after its new one has it: `hand_over` removes a
batch from the store in the transaction that claimed it, after the transport confirmed it;
`take_back` acknowledges a batch on the transport after the store committed it. A crash in between
leaves a message in both (the receiving side skips ids it has), never in neither.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.ports import DelayedMessageStore, Transport
from airflow_delay_provider.core.pump import END_OF_TIME

log = logging.getLogger(__name__)


def hand_over(store: DelayedMessageStore, transport: Transport, batch_size: int = 1000) -> dict[str, Any]:
    """Move every stored message, due or not, to a transport that delays natively (a migration).

    The transport receives each message with its original due time, so the remaining delay is
    kept. Messages it refuses stay stored; the move stops when a whole batch is refused.
    """
    moved = refused = 0
    errors: dict[str, str] = {}
    transport.use_clock(store.clock)  # the due times it receives are on the store's clock
    while True:
        with store.claim_due(END_OF_TIME, batch_size) as claim:
            if not claim.messages:
                break
            failures = transport.send(claim.messages)
            claim.remove([m.message_id for m in claim.messages if m.message_id not in failures])
            moved += len(claim.messages) - len(failures)
            errors.update((mid, f"{type(e).__name__}: {e}") for mid, e in list(failures.items())[:10])
        if failures and len(failures) == len(claim.messages):
            refused = len(failures)
            break
    if errors:
        log.warning("hand-over left %d message(s) stored; first errors: %s", refused, errors)
    return {"moved": moved, "left_in_store": refused, "errors": dict(list(errors.items())[:10])}


def take_back(store: DelayedMessageStore, transport: Transport, batch_size: int = 500) -> dict[str, int]:
    """Move the messages the transport holds until due into `store`, keeping their due times.

    Each batch is acknowledged on the transport only after the store committed it (at least once;
    the store skips ids it has). A message that cannot be read back goes to the transport's poison
    queue. When the store fails, the batch goes back to waiting on the transport and the error is raised.
    """
    if not transport.can_take_back:
        raise InvalidInputError(f"transport {transport.name!r} holds no delayed messages to take back")
    moved = poisoned = 0
    transport.use_clock(store.clock)  # "still waiting for its due time" on the store's clock, as the pump sees it
    while held := transport.take_held(batch_size):
        messages = [h.message for h in held if h.message is not None]
        stored = [h.receipt for h in held if h.message is not None]
        poison = [h.receipt for h in held if h.message is None]
        unsettled = stored + poison
        try:
            store.store(messages, deduplicate=False)  # their ids were recorded when first sent
            transport.ack_held(stored)
            unsettled = poison
            transport.poison_held(poison)
        except BaseException:
            _release(transport, unsettled)
            raise
        moved += len(messages)
        poisoned += len(poison)
    return {"moved": moved, "poisoned": poisoned}


def _release(transport: Transport, receipts: list[Any]) -> None:
    """Best effort: what is not released now goes back when the transport closes."""
    try:
        transport.release_held(receipts)
    except Exception as exc:
        log.warning("could not put %d taken message(s) back; they go back when the transport closes: %s",
                    len(receipts), exc)
