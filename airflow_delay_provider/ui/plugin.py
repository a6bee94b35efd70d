"""The Airflow plugin of the backlog page: a FastAPI app in the api-server and a link in the UI's Browse menu.

Airflow loads it through the `airflow.plugins` entry point, in every configuration; the provider info
does not list it (with ``[core] lazy_discover_providers = False`` Airflow would load it twice).

Every Airflow process imports plugins (a task runner too, for macros and listeners), so this module stays
light: the FastAPI app and Airflow's api-server security are imported on the first request only.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from airflow_delay_provider.ui.paths import URL_PREFIX, URL_ROUTE, root

_root = root  # its name before paths.py


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
            "href": f"{root()}{URL_PREFIX.strip('/')}/",
            "icon": f"{root()}{URL_PREFIX.strip('/')}/static/icon.svg",
            "url_route": URL_ROUTE,
            "category": "browse",
            "destination": "nav",
        }
    ]
