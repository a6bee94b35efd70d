"""Where the Delayed messages page lives: its mount in the api-server, its route in the UI, and links to it.

Kept apart from the plugin so that a task's extra link (see `airflow_delay_provider.links`) builds the page's
URL without importing Airflow's plugin machinery.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlencode, urlsplit

from airflow.configuration import conf

#: Where the api-server mounts the page and its JSON endpoints (under `[api] base_url`'s path).
URL_PREFIX = "/delay-backlog"
#: The page's route in the UI: <base_url>/plugin/delayed-messages shows it in a frame.
URL_ROUTE = "delayed-messages"


def root() -> str:
    """The path of `[api] base_url` ("/" when unset), ending in "/"."""
    path = urlsplit(conf.get("api", "base_url", fallback="") or "").path or "/"
    return path if path.endswith("/") else path + "/"


def page_url(destination: str | None = None, message_ids: Iterable[str] = ()) -> str:
    """The page in its place in Airflow's UI, showing only `destination`'s messages and only `message_ids` (each
    filter when given). Airflow 3.3's UI loads `/plugin/<route>/<path>?<query>` as the frame's `/<path>?<query>`,
    so the filters reach the page, which reads them from its URL."""
    query = [("destination", destination)] if destination else []
    query += [("message_id", m) for m in message_ids]
    return (f"{root()}plugin/{URL_ROUTE}{root()}{URL_PREFIX.strip('/')}/"
            + (f"?{urlencode(query)}" if query else ""))
