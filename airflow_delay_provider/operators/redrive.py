"""RedriveDeadLettersOperator: move dead letters from the error queue back into the store, due now."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from airflow.sdk import Context

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.message import check_destination
from airflow_delay_provider.core.redrive import parse_rate
from airflow_delay_provider.core.requests import parse_count
from airflow_delay_provider.operators.backlog import as_list
from airflow_delay_provider.operators.base import DelayOperatorBase


class RedriveDeadLettersOperator(DelayOperatorBase):
    """Redrive dead letters: messages the pump gave up on and sent to the error queue go back into the
    store for their original destination (its `x-delay-failed-destination` header), due now, their
    failures reset, the failure headers removed and an `x-delay-redriven` count added; the next
    dispatch delivers them. Each leaves the error queue only once the store has it (at least once).
    Messages not selected stay in the error queue; one the pump did not dead-letter (no such header)
    is skipped and stays too. Returns counts: redriven (per destination), skipped (with why), left.

    Fix what made them fail first (provision the destination, correct the consumer): a message that
    fails again is dead-lettered again, with its redrive count.

    :param error_queue: the error queue to redrive from, on the operator's transport (templated).
    :param destination: only dead letters of this original destination (templated).
    :param message_ids: only these message ids, a list or comma-separated text (templated).
    :param max_messages: stop after redriving this many (templated).
    :param max_per_second: redrive at most this many per second (templated), so a large error queue
        does not flood a destination that just recovered.
    """

    template_fields: Sequence[str] = ("error_queue", "destination", "message_ids", "max_messages",
                                      "max_per_second")
    ui_color = "#f4e1d2"

    def __init__(self, *, error_queue: str = "error", destination: str | None = None, message_ids: Any = None,
                 max_messages: int | str | None = None, max_per_second: float | str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error_queue, self.destination, self.message_ids = error_queue, destination, message_ids
        self.max_messages, self.max_per_second = max_messages, max_per_second
        if not any("{{" in str(v) for v in (error_queue, destination, message_ids, max_messages, max_per_second)):
            self._arguments()  # nothing templated: a bad value fails when the DAG is parsed

    def _arguments(self) -> dict[str, Any]:
        arguments = {"error_queue": check_destination(self.error_queue), "destination": self.destination or None,
                     "message_ids": as_list(self.message_ids, "message_ids"),
                     "max_messages": parse_count("max_messages", self.max_messages),
                     "max_per_second": parse_rate(self.max_per_second)}
        Selector.build(arguments["message_ids"], arguments["destination"], allow_everything=True)
        return arguments

    def execute(self, context: Context) -> dict:
        arguments = self._arguments()
        transport = self.get_transport()
        try:
            self.log.info("Redriving dead letters of %s on %s (%s)", arguments["error_queue"], transport.where,
                          {k: v for k, v in arguments.items() if v is not None and k != "error_queue"} or "all")
            result = self.hook.redrive(transport, **arguments)
        finally:
            transport.close()
        self.log.info("Redrive: %s", json.dumps({k: v for k, v in result.items() if k != "skipped_messages"}))
        return result
