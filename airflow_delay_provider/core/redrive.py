"""Dead letters: what the pump gave up on, listed from the error queue, redriven into the store or deleted.

The pump sends a message it gives up on to the error queue, with headers saying where it was going,
when it failed first and last, how often and why (`DelayedMessage.dead_lettered`). A listing peeks
at the queue (`Transport.peek`: nothing is consumed, and no delivery counted). A redrive receives
from the queue and, for each message it selects, stores it again for its original destination, due
now, with its failures reset, the failure headers removed and an `x-delay-redriven` count; it acks
the message on the error queue only once the store has committed. A crash in between stores it again
(at least once; the store skips an id that is stored right now). Messages it does not select stay
in the error queue: released at the end where the transport can (`Releasable`), otherwise visible
again once their visibility timeout ends. A deletion selects and settles as a redrive does, and acks what it
selects without storing it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from airflow_delay_provider.core.backlog import BODY_PREVIEW_BYTES, MAX_PAGE, Selector, preview
from airflow_delay_provider.core.checks import check_int
from airflow_delay_provider.core.errors import DestinationNotFoundError, InvalidInputError
from airflow_delay_provider.core.message import (
    HEADER_DUE_AT,
    HEADER_FAILED_AT,
    HEADER_FAILED_DESTINATION,
    HEADER_FAILURE_REASON,
    HEADER_FAILURES,
    HEADER_FIRST_FAILED_AT,
    HEADER_GAVE_UP,
    DelayedMessage,
)
from airflow_delay_provider.core.ports import DelayedMessageStore, ReceivedMessage, Transport
from airflow_delay_provider.core.requests import parse_count
from airflow_delay_provider.core.throttle import TokenBucket

log = logging.getLogger(__name__)

#: How many times a message was redriven; the pump's own headers from its last failure are removed.
HEADER_REDRIVEN = "x-delay-redriven"
FAILURE_HEADERS = frozenset({HEADER_FAILED_DESTINATION, HEADER_FAILED_AT, HEADER_FIRST_FAILED_AT,
                             HEADER_FAILURE_REASON, HEADER_FAILURES, HEADER_DUE_AT, HEADER_GAVE_UP})
#: A filtered listing looks at up to this many messages of the error queue to find its matches.
SCAN_LIMIT = MAX_PAGE
#: How long a redrive keeps what it received hidden from other readers while it works.
HOLD_SECONDS = 300.0
#: Messages received per call (SQS takes 10 at most; the transport caps it).
BATCH_SIZE = 100
#: Skipped messages listed by id and reason in a redrive's report (all are counted).
MAX_SKIPPED_SHOWN = 100


@runtime_checkable
class Releasable(Protocol):
    """A transport that can make received, unacked messages visible again at once."""

    def release(self, endpoint: str, receipts: Iterable[Any]) -> int: ...


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def describe(message: ReceivedMessage, body_bytes: int = BODY_PREVIEW_BYTES) -> dict[str, Any]:
    """A dead letter as a listing shows it: where it was going, its attempts, its first and last failure
    and last error (None where the headers do not say), a body preview and every header."""
    h = message.headers
    return {
        "message_id": message.message_id,
        "destination": h.get(HEADER_FAILED_DESTINATION),
        "attempts": _int(h.get(HEADER_FAILURES)),
        "first_failed_at": h.get(HEADER_FIRST_FAILED_AT, h.get(HEADER_FAILED_AT)),
        "last_failed_at": h.get(HEADER_FAILED_AT),
        "last_error": h.get(HEADER_FAILURE_REASON),
        "gave_up": h.get(HEADER_GAVE_UP),
        "redriven": _int(h.get(HEADER_REDRIVEN)) or 0,
        "enqueued_at": message.enqueued_at.isoformat(),
        **preview(message.body, body_bytes),
        "headers": dict(h),
    }


def _selects(selector: Selector, message: ReceivedMessage) -> bool:
    return ((not selector.message_ids or message.message_id in selector.message_ids)
            and (selector.destination is None
                 or message.headers.get(HEADER_FAILED_DESTINATION) == selector.destination))


def list_dead_letters(transport: Transport, error_queue: str = "error", destination: Any = None,
                      message_ids: Any = None, limit: int = 50,
                      body_bytes: int = BODY_PREVIEW_BYTES) -> dict[str, Any]:
    """Up to `limit` dead letters of `error_queue`, oldest first, consuming nothing; filtered by original
    destination and/or message ids, among the first SCAN_LIMIT messages of the queue."""
    check_int("limit", limit, 1, MAX_PAGE)
    selector = Selector.build(message_ids, destination, allow_everything=True)
    filtered = bool(selector.message_ids or selector.destination)
    scan = max(limit, SCAN_LIMIT) if filtered else limit
    peeked = transport.peek(error_queue, scan)
    matched = [m for m in peeked if _selects(selector, m)]
    return {
        "error_queue": error_queue,
        "selector": selector.describe(),
        "dead_letters": [describe(m, body_bytes) for m in matched[:limit]],
        "count": min(len(matched), limit),
        "scanned": len(peeked),
        # More may match: beyond the page, or beyond what was looked at.
        "more": len(matched) > limit or len(peeked) == scan,
    }


def parse_rate(value: Any) -> float | None:
    """A rate in messages per second (a number > 0, or its rendered text), or None for no limit."""
    if value in (None, ""):
        return None
    try:
        rate = float(value)
    except (TypeError, ValueError):
        rate = -1.0
    if isinstance(value, bool) or not 0 < rate < math.inf:
        raise InvalidInputError(f"max_per_second must be a number > 0, got {value!r}")
    return rate


def as_redriven(message: ReceivedMessage, now: datetime) -> DelayedMessage | str:
    """The dead letter as a message for its original destination, due `now`, or why it cannot be one."""
    destination = message.headers.get(HEADER_FAILED_DESTINATION)
    if not destination:
        return (f"no {HEADER_FAILED_DESTINATION} header: the pump did not dead-letter it, so its destination "
                "is unknown")
    if not message.message_id:
        return "no message id"
    headers = {k: v for k, v in message.headers.items() if k not in FAILURE_HEADERS}
    headers[HEADER_REDRIVEN] = str((_int(message.headers.get(HEADER_REDRIVEN)) or 0) + 1)
    try:
        return DelayedMessage(destination, message.body, now, headers, message.message_id, failures=0)
    except InvalidInputError as exc:
        return f"cannot be stored again: {exc}"


class _Run:
    """One redrive's counts, its unsettled receipts, and its progress log."""

    def __init__(self, error_queue: str, selector: Selector, clock: Callable[[], float],
                 progress_interval: float) -> None:
        self.error_queue, self.selector, self.clock = error_queue, selector, clock
        self.progress_interval = progress_interval
        self.started = self.last_report = clock()
        self.redriven = self.already_stored = 0
        self.destinations: dict[str, int] = {}
        self.skipped: dict[str, str] = {}  # message id: why
        self.left: set[str] = set()  # ids of those left in the error queue
        self.done_ids: set[str] = set()

    def rate(self) -> float:
        return self.redriven / max(self.clock() - self.started, 1e-9)

    def progress(self, final: bool = False) -> None:
        if final or self.clock() - self.last_report >= self.progress_interval:
            self.last_report = self.clock()
            log.info("redrive from %s%s: %d redriven (%.1f msg/s), %d skipped, %d left in the error queue",
                     self.error_queue, " done" if final else "", self.redriven, self.rate(), len(self.skipped),
                     len(self.left))

    def report(self) -> dict[str, Any]:
        return {
            "error_queue": self.error_queue,
            "selector": self.selector.describe(),
            "redriven": self.redriven,
            "skipped": len(self.skipped),
            "left": len(self.left),
            "already_stored": self.already_stored,
            "destinations": dict(sorted(self.destinations.items())),
            "skipped_messages": [{"message_id": mid, "reason": why}
                                 for mid, why in list(self.skipped.items())[:MAX_SKIPPED_SHOWN]],
            "seconds": round(self.clock() - self.started, 3),
            "per_second": round(self.rate(), 1),
        }


def redrive(store: DelayedMessageStore, transport: Transport, error_queue: str = "error",
            destination: Any = None, message_ids: Any = None, max_messages: Any = None,
            max_per_second: Any = None, *, hold_seconds: float = HOLD_SECONDS, progress_interval: float = 10.0,
            clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
            ) -> dict[str, Any]:
    """Move dead letters of `error_queue` back into the store, due now (see the module's doc): all of them,
    or those of one original `destination` and/or with the given `message_ids`; at most `max_messages`,
    at most `max_per_second`. Returns counts: redriven (per destination), skipped (with why), left."""
    selector = Selector.build(message_ids, destination, allow_everything=True)
    limit = parse_count("max_messages", max_messages)
    rate = parse_rate(max_per_second)
    bucket = TokenBucket(rate, clock=clock) if rate else None
    run = _Run(error_queue, selector, clock, progress_interval)
    wanted = set(selector.message_ids)
    received: dict[Any, None] = {}  # receipts received and not yet acked, in order
    provisioned = _Provisioned(transport)
    try:
        while (limit is None or run.redriven < limit) and not (wanted and wanted <= run.done_ids):
            n = BATCH_SIZE if limit is None else min(BATCH_SIZE, limit - run.redriven)
            batch = transport.receive(error_queue, n if rate is None else min(n, math.ceil(rate)),
                                      visibility_timeout=hold_seconds)
            received.update((m.receipt, None) for m in batch)
            if not batch or all(m.message_id in run.left or m.message_id in run.skipped for m in batch):
                break  # empty, or back to messages seen already (their hold ended): the whole queue was read
            now = store.clock()
            chosen: list[tuple[ReceivedMessage, DelayedMessage]] = []
            for m in batch:
                message = as_redriven(m, now) if _selects(selector, m) else None
                if isinstance(message, DelayedMessage) and not provisioned(message.destination):
                    message = (f"its destination {message.destination!r} is not provisioned on the {transport.name} "
                               "transport, so it would be dead-lettered again: provision it, then redrive (it stays "
                               "in the error queue)")
                if isinstance(message, DelayedMessage) and (limit is None or run.redriven + len(chosen) < limit):
                    chosen.append((m, message))
                elif isinstance(message, str):
                    run.skipped[m.message_id] = message
                    run.done_ids.add(m.message_id)
                else:
                    run.left.add(m.message_id)
            while chosen:
                take = len(chosen) if bucket is None else bucket.take_up_to(len(chosen))
                if not take:
                    sleep(min(1.0 / (rate or 1.0), 1.0))
                    continue
                part, chosen = chosen[:take], chosen[take:]
                _commit(store, transport, run, part)
                for m, _ in part:
                    received.pop(m.receipt, None)
                run.progress()
    finally:
        _release(transport, error_queue, list(received))
    run.progress(final=True)
    return run.report()


class _Provisioned:
    """Whether the transport has a destination (its depth answers), asked once per destination and run. Only a
    transport's own "does not exist" holds a message back: one that cannot tell (an outage, a broker that
    declares queues on first use) lets the redrive go on, as before."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.known: dict[str, bool] = {}

    def __call__(self, destination: str) -> bool:
        if destination not in self.known:
            try:
                self.transport.depth(destination)
                self.known[destination] = True
            except DestinationNotFoundError:
                self.known[destination] = False
            except Exception as exc:  # noqa: BLE001 - cannot tell: not a reason to hold the message back
                log.debug("could not check that %r is provisioned (%s); redriving it", destination, exc)
                self.known[destination] = True
        return self.known[destination]


def _release(transport: Transport, error_queue: str, receipts: list[Any]) -> None:
    """Give back what the run received and did not redrive; a transport that cannot release returns
    them when their visibility timeout ends (or, RabbitMQ, when its channel closes)."""
    if not receipts or not isinstance(transport, Releasable):
        return
    try:
        transport.release(error_queue, receipts)
    except Exception as exc:  # they come back on their own; the run's outcome (or error) matters more
        log.warning("could not release %d message(s) of %s (they return when their hold ends): %s",
                    len(receipts), error_queue, exc)


def _commit(store: DelayedMessageStore, transport: Transport, run: _Run,
            part: list[tuple[ReceivedMessage, DelayedMessage]]) -> None:
    """Store, then ack: a message leaves the error queue only once the store has it."""
    # Its id was accepted before: skip only ids stored right now (a crash between store and ack).
    stored = store.store([message for _, message in part], deduplicate=False)
    transport.ack(run.error_queue, [m.receipt for m, _ in part])
    run.redriven += len(part)
    run.already_stored += len(part) - stored
    for m, message in part:
        run.destinations[message.destination] = run.destinations.get(message.destination, 0) + 1
        run.done_ids.add(m.message_id)
        run.left.discard(m.message_id)


def _summary(message: ReceivedMessage) -> dict[str, Any]:
    """A dead letter as a deletion lists it: which one, where it was going, and why it failed."""
    full = describe(message, body_bytes=0)
    return {key: full[key] for key in ("message_id", "destination", "attempts", "last_failed_at", "last_error")}


def delete_dead_letters(transport: Transport, error_queue: str = "error", destination: Any = None,
                        message_ids: Any = None, everything: bool = False, dry_run: bool = True, *,
                        hold_seconds: float = HOLD_SECONDS) -> dict[str, Any]:
    """Delete dead letters of `error_queue`: those of one original `destination` and/or with the given
    `message_ids`, or, with `everything`, all of them. `dry_run` (the default) deletes nothing and lists what
    would go, looking without consuming (among the first SCAN_LIMIT messages: `more` says whether there may be
    others); a transport that cannot look so refuses it, saying why. Otherwise messages are received and the
    selected ones acked, the others released (as a redrive leaves what it does not select)."""
    selector = Selector.build(message_ids, destination, allow_everything=True)
    chosen = bool(selector.message_ids or selector.destination)
    if chosen == everything:
        raise InvalidInputError("select the dead letters to delete by message_ids and/or destination, or all of them "
                                "with everything=True" + (" (not both)" if everything else ""))
    if dry_run:
        peeked = transport.peek(error_queue, SCAN_LIMIT)
        matched = [m for m in peeked if _selects(selector, m)]
        return {"error_queue": error_queue, "selector": selector.describe(), "dry_run": True,
                "would_delete": len(matched), "dead_letters": [_summary(m) for m in matched[:MAX_SKIPPED_SHOWN]],
                "scanned": len(peeked), "more": len(peeked) == SCAN_LIMIT}
    wanted = set(selector.message_ids)
    deleted: dict[str, int] = {}
    gone: set[str] = set()
    left: dict[Any, None] = {}  # receipts of those received and not selected: released at the end
    left_ids: set[str] = set()
    try:
        while not (wanted and wanted <= gone):
            batch = transport.receive(error_queue, BATCH_SIZE, visibility_timeout=hold_seconds)
            left.update((m.receipt, None) for m in batch if not _selects(selector, m))
            if not batch or all(m.message_id in left_ids for m in batch):
                break  # empty, or back to messages seen already (their hold ended): the whole queue was read
            selected = [m for m in batch if _selects(selector, m)]
            left_ids.update(m.message_id for m in batch if not _selects(selector, m))
            transport.ack(error_queue, [m.receipt for m in selected])
            for m in selected:
                name = m.headers.get(HEADER_FAILED_DESTINATION) or "(unknown)"
                deleted[name] = deleted.get(name, 0) + 1
                gone.add(m.message_id)
    finally:
        _release(transport, error_queue, list(left))
    return {"error_queue": error_queue, "selector": selector.describe(), "dry_run": False,
            "deleted": sum(deleted.values()), "destinations": dict(sorted(deleted.items())), "left": len(left_ids)}
