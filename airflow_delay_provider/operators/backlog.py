"""Operators for the backlog: cancel, reschedule (or run now), pause/resume and purge scheduled messages.

Each is a call on DelayStoreHook's backlog methods and returns that call's JSON report. A selector names
message ids, or a filter: a destination, a header match, a due window and/or a body text; one with none of them is
refused (when the DAG is parsed if nothing is templated, else when the task runs), so a missing XCom never cancels
everything.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from airflow_delay_provider.core.backlog import Selector, new_due_time
from airflow_delay_provider.core.delays import LONGEST_MAX_DELAY_SECONDS, utcnow
from airflow_delay_provider.core.errors import DelayProviderError, InvalidInputError
from airflow_delay_provider.hooks.delay_store import DelayStoreMixin
from airflow_delay_provider.operators.base import DelayOperatorBase


def _templated(*values: Any) -> bool:
    return any("{{" in str(v) for v in values if v is not None)


def as_list(value: Any, field: str) -> Any:
    """A rendered template gives text: a JSON or Python list (`['a', 'b']`, as an XCom of a list renders),
    one id, or ids separated by commas."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return _literal(text, field)
    return [part.strip() for part in text.split(",") if part.strip()]


def as_dict(value: Any, field: str) -> Any:
    """A rendered dict (`{'order-id': '42'}`) or `key=value` pairs separated by commas."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        return None
    if text.startswith("{"):
        return _literal(text, field)
    pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
    if any(len(p) != 2 for p in pairs):
        raise InvalidInputError(f"{field} must be a dict or key=value pairs separated by commas, got {value!r}")
    return {k.strip(): v.strip() for k, v in pairs}


def _literal(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        try:
            return ast.literal_eval(text)  # literals only: evaluates no code
        except (ValueError, SyntaxError):
            raise InvalidInputError(f"{field} could not be read as a list or dict: {text[:80]!r}") from None


class _BacklogOperator(DelayStoreMixin, BaseOperator):
    """The selector arguments, checked when the DAG is parsed where nothing is templated. By ids, the change is one
    transaction; by a filter (no ids), it works in batches (10,000 messages per transaction).

    :param message_ids: ids of scheduled messages (a send task's XCom, e.g.
        ``"{{ ti.xcom_pull(task_ids='send') }}"``), a list or comma-separated text (templated).
    :param destination: only this destination's messages; alone, every message of it (templated).
    :param headers: only messages whose headers include these, e.g. ``{"order-id": "42"}`` (templated).
    :param due_from: only messages due at or after this aware datetime or ISO time (templated).
    :param due_before: only messages due before this aware datetime or ISO time (templated).
    :param body_contains: only messages whose body contains this text (UTF-8; case matters) (templated).
    :param dry_run: only count what it would change (``would_cancel`` or ``would_reschedule``); change nothing.
    :param max_messages: by a filter, count first and fail the task, changing nothing, when more match (a guard
        against a filter wider than meant); None: no limit.
    """

    template_fields: Sequence[str] = ("message_ids", "destination", "headers", "due_from", "due_before",
                                      "body_contains")
    ui_color = "#f4e1d2"
    #: The hook's word for this change in a count (`would_<action>`).
    counted_as = "cancel"

    def __init__(self, *, message_ids: Any = None, destination: str | None = None, headers: Any = None,
                 due_from: Any = None, due_before: Any = None, body_contains: str | None = None,
                 dry_run: bool = False, max_messages: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.message_ids, self.destination, self.headers = message_ids, destination, headers
        self.due_from, self.due_before, self.body_contains = due_from, due_before, body_contains
        self.dry_run, self.max_messages = dry_run, max_messages
        if max_messages is not None and (isinstance(max_messages, bool) or not isinstance(max_messages, int)
                                         or max_messages < 0):
            raise InvalidInputError(f"max_messages must be a whole number >= 0 or None, got {max_messages!r}")
        if not _templated(message_ids, destination, headers, due_from, due_before, body_contains):
            self._selector()

    def _selector(self) -> dict[str, Any]:
        selector = {"message_ids": as_list(self.message_ids, "message_ids"), "destination": self.destination,
                    "headers": as_dict(self.headers, "headers"), "due_from": self.due_from or None,
                    "due_before": self.due_before or None, "body_contains": self.body_contains or None}
        Selector.build(**selector)  # refuses an empty or malformed selector with a clear error
        return selector

    def _guard(self, selector: dict[str, Any]) -> None:
        """`max_messages`: a filter that matches more fails the task before anything changes."""
        if self.max_messages is None or selector["message_ids"]:
            return
        counted = self.hook.count(**selector, action=self.counted_as)
        n = counted[f"would_{self.counted_as}"]
        if n > self.max_messages:
            raise DelayProviderError(f"the filter {json.dumps(counted['selector'])} matches {n} scheduled messages, "
                                     f"more than max_messages={self.max_messages}: nothing was changed")


class CancelDelayedMessagesOperator(_BacklogOperator):
    """Cancel scheduled messages so they are never delivered; returns which were cancelled, which a running
    sweep holds (`in_flight`: not cancelled), and of the ids asked for, which were already `gone`
    (delivered, dead-lettered, cancelled before, or sent natively to a broker's delay, which cannot be
    cancelled) or `unknown`. Cancelling twice reports the second time as gone.

    :param fail_if_not_cancelled: fail the task when an id asked for was not cancelled (the caller lost
        the race to a delivery); default False: report it.
    """

    def __init__(self, *, fail_if_not_cancelled: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_if_not_cancelled = fail_if_not_cancelled

    def execute(self, context: Context) -> dict:
        selector = self._selector()
        if self.dry_run:
            return self.hook.count(**selector)
        self._guard(selector)
        result = self.hook.cancel(**selector)
        self.log.info("Cancel %s: %s", result["selector"], json.dumps(result["counts"]))
        if self.fail_if_not_cancelled and any(result.get(k) for k in ("in_flight", "gone", "unknown")):
            raise DelayProviderError(f"not every message was cancelled: {json.dumps(result['counts'])}")
        return result


class RescheduleDelayedMessagesOperator(_BacklogOperator):
    """Move scheduled messages to a new due time (never before now), or make them due now.

    :param deliver_at: the new due time: an aware datetime or ISO string (templated).
    :param delay_seconds: the new due time as seconds from now, 0..604,800 (or the store connection's
        `max_delay_seconds`); 0 runs them now (templated).
        Give exactly one of the two.
    """

    template_fields: Sequence[str] = (*_BacklogOperator.template_fields, "deliver_at", "delay_seconds")

    def __init__(self, *, deliver_at: Any = None, delay_seconds: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deliver_at, self.delay_seconds = deliver_at, delay_seconds
        if not _templated(deliver_at, delay_seconds) and deliver_at is None:
            # The connection's longest delay is read when the task runs; a DAG file is held to the most any allows.
            new_due_time(utcnow(), None, delay_seconds, LONGEST_MAX_DELAY_SECONDS)

    counted_as = "reschedule"

    def execute(self, context: Context) -> dict:
        selector = self._selector()
        if not self.dry_run:
            self._guard(selector)
        result = self.hook.reschedule(**selector, deliver_at=self.deliver_at, delay_seconds=self.delay_seconds,
                                      dry_run=self.dry_run)
        if self.dry_run:
            return result
        self.log.info("Reschedule %s to %s: %s", result["selector"], result["due_at"], json.dumps(result["counts"]))
        return result


class PauseDelayedMessagesOperator(_BacklogOperator):
    """Pause scheduled messages by ids or a filter: they stay stored with their due times and are never delivered
    until resumed (`ResumeDelayedMessagesOperator`), whatever their due time; the destination's other and new
    messages go on as usual (`PauseDestinationOperator` pauses a whole destination). Returns which were paused,
    which a running sweep holds (`in_flight`: not paused) and, of the ids asked for, which were `gone` or
    `unknown`; a filter's result also counts `already_paused`. Idempotent."""

    counted_as = "pause"

    def execute(self, context: Context) -> dict:
        return self._hold(self.hook.pause_messages, "Paused")

    def _hold(self, change: Any, verb: str) -> dict:
        selector = self._selector()
        if not self.dry_run:
            self._guard(selector)
        result = change(**selector, dry_run=self.dry_run)
        if not self.dry_run:
            self.log.info("%s %s: %s", verb, result["selector"], json.dumps(result["counts"]))
        return result


class ResumeDelayedMessagesOperator(PauseDelayedMessagesOperator):
    """Resume paused messages by ids or a filter: each is due at its due time again, and one whose due time passed
    while it was paused is delivered at once. Idempotent. Arguments as CancelDelayedMessagesOperator's."""

    counted_as = "resume"

    def execute(self, context: Context) -> dict:
        return self._hold(self.hook.resume_messages, "Resumed")


class PauseDestinationOperator(DelayStoreMixin, BaseOperator):
    """Pause destinations: pumps and new sweeps leave their messages stored (due ones wait, counted as
    paused) until resumed; batches claimed before the pause still finish. Idempotent.

    :param destinations: the destinations, a list or comma-separated text (templated); each must be known
        to the store (provisioned or sent to).
    """

    template_fields: Sequence[str] = ("destinations",)
    ui_color = "#f4e1d2"
    pause = True

    def __init__(self, *, destinations: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.destinations = destinations
        if not _templated(destinations) and not as_list(destinations, "destinations"):
            raise InvalidInputError("destinations must name at least one destination to pause or resume")

    def execute(self, context: Context) -> dict:
        names = as_list(self.destinations, "destinations")
        result = self.hook.pause(names) if self.pause else self.hook.resume(names)
        self.log.info("%s: %s", "Paused" if self.pause else "Resumed", json.dumps(result))
        return result


class ResumeDestinationOperator(PauseDestinationOperator):
    """Resume paused destinations: pumps take their waiting messages oldest first, within each destination's
    throttle. Idempotent. Arguments as PauseDestinationOperator."""

    pause = False


class PurgeDelayedMessagesOperator(DelayStoreMixin, BaseOperator):
    """Remove every scheduled message of one destination; by default only count them (dry run).

    :param destination: the destination to purge, named (templated); required.
    :param dry_run: True (default) counts what would go and removes nothing.
    """

    template_fields: Sequence[str] = ("destination",)
    ui_color = "#f4e1d2"

    def __init__(self, *, destination: str, dry_run: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not destination:
            raise InvalidInputError("destination must name the destination to purge")
        self.destination, self.dry_run = destination, dry_run

    def execute(self, context: Context) -> dict:
        result = self.hook.purge(self.destination, dry_run=self.dry_run)
        self.log.info("Purge of %s: %s", self.destination, json.dumps(result))
        return result


class ForgetDestinationsOperator(DelayOperatorBase):
    """Forget destinations (a mistyped name, a retired one): no longer listed in the backlog, the page or the
    known destinations of an error; their pause, policy, queue delay and throttle go.

    Refused while they have scheduled messages or dead letters in `error_queue` (on the operator's transport,
    when it can look without consuming), unless `force`: then the scheduled messages are purged and the dead
    letters stay in the error queue, named in the result.

    :param destinations: the destinations, a list or comma-separated text (templated); each must be known.
    :param force: forget them even so (see above).
    :param error_queue: the error queue whose dead letters are looked for (templated).
    """

    template_fields: Sequence[str] = ("destinations", "error_queue")
    ui_color = "#f4e1d2"

    def __init__(self, *, destinations: Any, force: bool = False, error_queue: str = "error", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.destinations, self.force, self.error_queue = destinations, force, error_queue
        if not _templated(destinations) and not as_list(destinations, "destinations"):
            raise InvalidInputError("destinations must name at least one destination to forget")

    def execute(self, context: Context) -> dict:
        transport = self.get_transport()
        try:
            result = self.hook.forget(as_list(self.destinations, "destinations"), force=self.force,
                                      transport=transport, error_queue=self.error_queue)
        finally:
            transport.close()
        self.log.info("Forgot: %s", json.dumps(result))
        return result
