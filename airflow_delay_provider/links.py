"""Extra links of the send and dispatch tasks: the Delayed messages page, filtered to what the task worked on.

Airflow 3 works a task's links out on its worker when the task ends, and stores them (an XCom per link) for
the UI's task-instance page, which shows each as a button. The links are paths on the UI's own origin
(under `[api] base_url`'s path): the page in its place in the UI (Browse > Delayed messages), its filters in
the frame's query, as `/plugin/<route>/<path of the page>?...` hands them to the page in Airflow 3.3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperatorLink

from airflow_delay_provider.core.requests import destinations_of, parse_destinations, parse_messages
from airflow_delay_provider.ui.paths import page_url

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

#: At most this many message ids go into a link (a batch of more links to its destination only): a URL of a
#: few kilobytes at most, which every browser and proxy passes.
MAX_LINKED_IDS = 50


class SentMessagesLink(BaseOperatorLink):
    """SendDelayedMessageOperator's link: the messages the task stored, on their destination's view of the page.
    A send through a broker's own delays (RabbitMQ, SQS) keeps nothing in the store, so it has no link."""

    name = "Delayed messages"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow_delay_provider.transports.registry import transport_class

        if transport_class(str(getattr(operator, "transport", "sql"))).delays_natively:
            return ""
        from airflow.sdk.execution_time.xcom import XCom

        sent = XCom.get_value(ti_key=ti_key, key="return_value")  # the id, or the batch's ids
        ids = [sent] if isinstance(sent, str) else [str(i) for i in sent or ()]
        destinations = _destinations(operator)
        destination = destinations[0] if len(destinations) == 1 else None
        return page_url(destination, ids if 0 < len(ids) <= MAX_LINKED_IDS else ())


class DestinationsLink(BaseOperatorLink):
    """DispatchDueMessagesOperator's link: the page, on the task's destination when it dispatches one (all of
    them when it dispatches several, a prefix or everything: the page filters by one destination)."""

    name = "Delayed messages"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        destinations = parse_destinations(getattr(operator, "destinations", None)) or []
        return page_url(destinations[0] if len(destinations) == 1 else None)


def _destinations(operator: Any) -> list[str]:
    """The destinations a send task's (rendered) arguments name: its `destination`, or its batch's."""
    items = [{}] if operator.messages is None else parse_messages(operator.messages)
    return sorted(destinations_of(items, {"destination": operator.destination}))
