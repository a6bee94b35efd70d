"""The delivery history: what became of each message a pump handled, kept for a number of days.

Every settlement writes one entry per message (delivered, retried, dead-lettered), and a cancel one per message
it removes, in the transaction that settles it: the history says what the store did, never what it was about to
do. An entry holds no body (a viewer may read the history) and no credentials; `detail` is the failure that a
retry or a dead letter answers.

The charts are per minute: how many were delivered and the p50/p99 of their lateness (the time from the due time
to the hand-over), computed from the entries themselves, so they agree with the list beside them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from airflow_delay_provider.core.checks import check_int
from airflow_delay_provider.core.delays import from_us, to_us
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.message import DelayedMessage

DELIVERED = "delivered"
RETRIED = "retried"
DEAD_LETTERED = "dead_lettered"
CANCELLED = "cancelled"
OUTCOMES = (DELIVERED, RETRIED, DEAD_LETTERED, CANCELLED)

#: How many days of history a store keeps unless its connection says otherwise (`history_days`; 0: none).
DEFAULT_HISTORY_DAYS = 7
#: The longest retention a connection may ask for: the history is for operating, not an archive.
MAX_HISTORY_DAYS = 90
#: The windows a chart may cover, in seconds, by name.
CHART_WINDOWS = {"1h": 3_600, "6h": 21_600, "24h": 86_400}
#: The most entries one read of the history returns.
MAX_HISTORY_PAGE = 1_000
#: The longest failure text an entry keeps (a broker's error can be long; the dead letter keeps all of it).
MAX_DETAIL = 500
MINUTE_US = 60_000_000


def check_history_days(value: object, where: str = "") -> int:
    """The retention in whole days, 0 (no history) to MAX_HISTORY_DAYS."""
    return check_int(f"{where}history_days", value, 0, MAX_HISTORY_DAYS,
                     hint=f"days of delivery history to keep (default {DEFAULT_HISTORY_DAYS}; 0 turns it off)")


def check_window(window: object) -> int:
    """A chart window's length in seconds, from its name."""
    if window not in CHART_WINDOWS:
        raise InvalidInputError(f"window must be one of {', '.join(CHART_WINDOWS)}, got {window!r}")
    return CHART_WINDOWS[str(window)]


def check_outcome(outcome: object) -> str | None:
    if outcome is None or outcome == "":
        return None
    if outcome not in OUTCOMES:
        raise InvalidInputError(f"outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
    return str(outcome)


@dataclass(frozen=True)
class Delivery:
    """One entry of the history: what became of one message at `handed_at`."""

    message_id: str
    destination: str
    due_at: datetime
    handed_at: datetime
    attempts: int
    outcome: str
    detail: str | None = None
    stored_at: datetime | None = None

    @property
    def lateness(self) -> float:
        """Seconds from the due time to the hand-over (negative: a run-now or a cancel before it was due)."""
        return (self.handed_at - self.due_at).total_seconds()

    def as_dict(self) -> dict[str, Any]:
        """Plain data for XCom, the CLI and the page: times in ISO 8601, lateness in milliseconds."""
        return {"message_id": self.message_id, "destination": self.destination, "outcome": self.outcome,
                "due_at": self.due_at.isoformat(), "handed_at": self.handed_at.isoformat(),
                "lateness_ms": round(self.lateness * 1000, 3), "attempts": self.attempts, "detail": self.detail,
                "stored_at": self.stored_at.isoformat() if self.stored_at else None}


class HistoryPage(NamedTuple):
    """A page of the history and the cursor of the next (None: no more)."""

    entries: list[Delivery]
    next: str | None = None


def _detail(text: str | None) -> str | None:
    return None if text is None else text[:MAX_DETAIL]


@dataclass(frozen=True)
class Settled:
    """Messages of one batch that met the same outcome, for the same reason (`detail`)."""

    outcome: str
    message_ids: tuple[str, ...]
    detail: str | None = None


def settled_groups(delivered: Iterable[str], retried: Mapping[str, str], dead: Mapping[str, str]) -> list[Settled]:
    """A settled batch's outcomes, grouped: the ids delivered, and those stored again for a retry or dead-lettered,
    by failure. Messages in none of them (an outage leaves them stored as they were) have no entry."""
    groups = [Settled(DELIVERED, tuple(delivered))] if delivered else []
    for outcome, failed in ((RETRIED, retried), (DEAD_LETTERED, dead)):
        by_reason: dict[str, list[str]] = {}
        for message_id, reason in failed.items():
            by_reason.setdefault(_detail(reason) or "", []).append(message_id)
        groups += [Settled(outcome, tuple(ids), reason or None) for reason, ids in by_reason.items()]
    return [g for g in groups if g.message_ids]


def entries_of(groups: Iterable[Settled], messages: Mapping[str, DelayedMessage], handed_at: datetime,
               stored_at: Mapping[str, datetime | None] | None = None) -> list[Delivery]:
    """The entries of settled groups, from the messages as they were claimed (a retry's attempt is its failures
    so far plus this one; a cancel's, its failures so far)."""
    entries = []
    for group in groups:
        for message_id in group.message_ids:
            m = messages[message_id]
            attempts = m.failures if group.outcome == CANCELLED else m.failures + 1
            entries.append(Delivery(message_id, m.destination, m.due_at, handed_at, attempts, group.outcome,
                                    group.detail, (stored_at or {}).get(message_id)))
    return entries


def rank(n: int, quantile: float) -> int:
    """The 1-based rank of the nearest-rank quantile of n values (the same rule the SQL stores apply)."""
    return max(1, math.ceil(quantile * n))


def minute_series(entries: Iterable[Delivery], since: datetime, until: datetime) -> list[dict[str, Any]]:
    """Per minute from `since` to `until`: delivered, dead-lettered and retried counts and the p50/p99 lateness
    (milliseconds, nearest rank) of the delivered ones; minutes with no entry are left out."""
    late: dict[int, list[int]] = {}
    others: dict[int, dict[str, int]] = {}
    for e in entries:
        if not since <= e.handed_at < until:
            continue
        minute = to_us(e.handed_at) // MINUTE_US
        if e.outcome == DELIVERED:
            late.setdefault(minute, []).append(round(e.lateness * 1_000_000))
        else:
            counts = others.setdefault(minute, {})
            counts[e.outcome] = counts.get(e.outcome, 0) + 1
    return [series_point(m, *lateness_stats(sorted(late.get(m, []))), others.get(m, {}))
            for m in sorted(late.keys() | others.keys())]


def lateness_stats(lateness_us: list[int]) -> tuple[int, int | None, int | None]:
    """(count, p50, p99) of sorted lateness values (microseconds), nearest rank; None for no values."""
    n = len(lateness_us)
    if not n:
        return 0, None, None
    return n, lateness_us[rank(n, 0.5) - 1], lateness_us[rank(n, 0.99) - 1]


def series_point(minute: int, delivered: int, p50_us: int | None, p99_us: int | None,
                 others: Mapping[str, int]) -> dict[str, Any]:
    """One minute of a chart: the delivered count, their lateness p50/p99 (microseconds) and the other counts."""

    def ms(us: int | None) -> float | None:
        return None if us is None else round(us / 1000, 3)

    return {"minute": from_us(minute * MINUTE_US).isoformat(), "delivered": delivered, "p50_ms": ms(p50_us),
            "p99_ms": ms(p99_us), "dead_lettered": int(others.get(DEAD_LETTERED, 0)),
            "retried": int(others.get(RETRIED, 0)), "cancelled": int(others.get(CANCELLED, 0))}


def story_report(message_id: str, scheduled: Mapping[str, Any] | None, entries: Iterable[Delivery],
                 kept_days: int) -> dict[str, Any]:
    """A message's story: where it is now (`scheduled`, its row when still stored) and what became of each of its
    attempts, oldest first; `state` sums it up."""
    steps = sorted(entries, key=lambda e: e.handed_at)
    if scheduled is not None:
        state = "held" if scheduled.get("held") else "scheduled"
    elif steps:
        state = steps[-1].outcome
    else:
        state = "unknown"
    stored = next((e.stored_at for e in steps if e.stored_at is not None), None)
    return {"message_id": message_id, "state": state, "scheduled": dict(scheduled) if scheduled else None,
            "stored_at": stored.isoformat() if stored else (scheduled or {}).get("stored_at"),
            "history": [e.as_dict() for e in steps], "history_days": kept_days}
