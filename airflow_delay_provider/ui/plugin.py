"""The Airflow plugin of the backlog page: a FastAPI app in the api-server and a link in the UI's Browse menu.

Airflow loads it through the `airflow.plugins` entry point, in every configuration; the provider info
does not list it (with ``[core] lazy_discover_providers = False`` Airflow would load it twice).

Every Airflow process imports plugins (a task runner too, for macros and listeners), so this module stays
light: the FastAPI app and Airflow's api-server security are imported on the first request only.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from airflow.configuration import conf
from airflow.plugins_manager import AirflowPlugin

#: Where the api-server mounts the page and its JSON endpoints (under `[api] base_url`'s path).
URL_PREFIX = "/delay-backlog"
#: The page's route in the UI: <base_url>/plugin/delayed-messages shows it in a frame.
URL_ROUTE = "delayed-messages"


def _root() -> str:
    """The path of `[api] base_url` ("/" when unset), ending in "/"."""
    path = urlsplit(conf.get("api", "base_url", fallback="") or "").path or "/"
    return path if path.endswith("/") else path + "/"


class LazyBacklogApp:
    """An ASGI app that builds the FastAPI app (`ui.app.create_app`) when the first request comes."""

    def __init__(self) -> None:
        self._app = None

    async def __call__(self, scope, receive, send) -> None:
        if self._app is None:
            from airflow_delay_provider.ui.app import create_app

            self._app = create_app()
        await self._app(scope, receive, send)


class DelayBacklogPlugin(AirflowPlugin):
    """Browse > Delayed messages: the scheduled, due, paused and in-flight messages per destination."""

    name = "delay_backlog"
    fastapi_apps = [{"name": "Delayed messages backlog", "app": LazyBacklogApp(), "url_prefix": URL_PREFIX}]
    external_views = [
        {
            "name": "Delayed messages",
            "href": f"{_root()}{URL_PREFIX.strip('/')}/",
            "icon": f"{_root()}{URL_PREFIX.strip('/')}/static/icon.svg",
            "url_route": URL_ROUTE,
            "category": "browse",
            "destination": "nav",
        }
    ]
