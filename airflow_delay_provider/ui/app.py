"""The backlog page's FastAPI app: one static page and the JSON endpoints it calls, in Airflow's api-server.

Authentication is Airflow's own: every endpoint resolves the user with the api-server's `get_user`
dependency (the UI's JWT cookie, or an `Authorization: Bearer` token). Authorization asks the
configured auth manager about DAGs (any DAG, no team):

* reading (the counts, the histogram, the message list) needs ``is_authorized_dag(method="GET")``;
* every action (POST: cancel, run now, pause, resume, purge) needs ``is_authorized_dag(method="PUT")``,
  the permission to edit DAGs, and so do message bodies: readers who may not edit see sizes only.

The store is the one of the ``[delay_provider] ui_conn_id`` connection (default ``delay_store_default``).
Dead-lettered messages live on the transport, not in the store: with ``[delay_provider] ui_transport``
set (sql, rabbitmq or sqs; ``ui_transport_conn_id`` and ``ui_error_queue``, default ``error``, as the
pump's), the page also counts the error queue's dead letters per original destination.
Only the api-server imports this module (see `plugin.LazyBacklogApp`).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.core_api.security import GetUserDep, bearer_scheme, get_user
from airflow.configuration import conf
from fastapi import Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from airflow_delay_provider.core.backlog import MAX_IDS, MAX_PAGE
from airflow_delay_provider.core.errors import (
    DelayProviderError,
    DestinationNotFoundError,
    InvalidInputError,
    UnavailableError,
)
from airflow_delay_provider.hooks.delay_store import DEFAULT_CONN_ID, DelayStoreHook
from airflow_delay_provider.hooks.transport import transport_hook, transport_options

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
#: The page loads nothing but its own files, and only Airflow's UI (same origin) may frame it.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _option(key: str, default: str | None = None) -> str | None:
    return conf.get("delay_provider", key, fallback=None) or default


def conn_id() -> str:
    """The `delay_store` connection the page operates: `[delay_provider] ui_conn_id`, else the default."""
    return _option("ui_conn_id", DEFAULT_CONN_ID)


def dead_letter_counts(store: DelayStoreHook) -> dict[str, Any] | None:
    """The dead letters of `[delay_provider] ui_transport`'s error queue per original destination (None when
    no transport is set): a look at up to MAX_PAGE of them, consuming nothing (`more` when there may be
    more). A transport that cannot look (RabbitMQ) or cannot be reached gives `error` instead."""
    kind = _option("ui_transport")
    if kind is None:
        return None
    queue = _option("ui_error_queue", "error")
    report: dict[str, Any] = {"transport": kind, "error_queue": queue}
    try:
        transport = transport_hook(kind, _option("ui_transport_conn_id"), store).get_transport(
            **transport_options(kind, {}))
        try:
            listing = store.dead_letters(transport, queue, limit=MAX_PAGE)
        finally:
            transport.close()
    except DestinationNotFoundError:  # no error queue yet: nothing was dead-lettered
        return {**report, "per_destination": {}, "total": 0, "more": False}
    except (DelayProviderError, NotImplementedError) as exc:
        return {**report, "error": str(exc)}
    except Exception as exc:  # an extra of the page: the counts of the store still show
        log.warning("Could not count the dead letters of %s queue %r", kind, queue, exc_info=True)
        return {**report, "error": f"{type(exc).__name__}: {exc}"}
    per_destination = Counter(d["destination"] or "(unknown)" for d in listing["dead_letters"])
    return {**report, "per_destination": dict(per_destination), "total": listing["count"], "more": listing["more"]}


def may_read(user: BaseUser) -> bool:
    return get_auth_manager().is_authorized_dag(method="GET", user=user)


def may_edit(user: BaseUser) -> bool:
    return get_auth_manager().is_authorized_dag(method="PUT", user=user)


def reader(user: GetUserDep) -> BaseUser:
    if not may_read(user):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "Forbidden: the delayed messages need read access to DAGs")
    return user


def editor(request: Request, user: GetUserDep) -> BaseUser:
    if not may_edit(user):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "Forbidden: acting on delayed messages needs edit access "
                                                       "to DAGs")
    # With SameSite=lax cookies a cross-site POST carries no session; JSON-only bodies also keep plain
    # HTML forms (which cannot send application/json) from reaching the actions.
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, "send the action as application/json")
    return user


Reader = Annotated[BaseUser, Depends(reader)]
Editor = Annotated[BaseUser, Depends(editor)]


def hook() -> DelayStoreHook:
    return DelayStoreHook(conn_id())


class Selection(BaseModel):
    """Which scheduled messages an action applies to (at least one of them: the store refuses none)."""

    message_ids: list[str] | None = Field(None, max_length=MAX_IDS)
    destination: str | None = None
    headers: dict[str, str] | None = None


class Destinations(BaseModel):
    destinations: list[str] = Field(min_length=1, max_length=100)


class Purge(BaseModel):
    destination: str
    dry_run: bool = True


def _headers(values: list[str]) -> dict[str, str]:
    """`key=value` query values as a header match."""
    match = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key.strip():
            raise InvalidInputError(f"a header match is key=value, got {value!r:.80}")
        match[key.strip()] = val.strip()
    return match


def create_app() -> FastAPI:
    app = FastAPI(title="Delayed messages backlog", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(InvalidInputError)
    async def invalid(_request: Request, exc: InvalidInputError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_400_BAD_REQUEST)

    @app.exception_handler(UnavailableError)
    async def unavailable(_request: Request, exc: UnavailableError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)

    @app.get("/", include_in_schema=False)
    async def page(request: Request, bearer: Annotated[Any, Depends(bearer_scheme)]) -> Response:
        try:
            await get_user(request, None, bearer)
        except HTTPException:  # not logged in (or the session ended): Airflow's login, then back here
            return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)))
        return FileResponse(STATIC / "index.html", headers=SECURITY_HEADERS)

    app.mount("/static", _Headers(StaticFiles(directory=STATIC)), name="static")

    @app.get("/api/backlog")
    def backlog(user: Reader, destination: str | None = None) -> dict[str, Any]:
        """Per destination: scheduled, due, in flight, paused, the due-time histogram; totals."""
        store = hook()
        result = store.backlog(destination or None)
        return {**result, "can_edit": may_edit(user), "user": user.get_name(), "conn_id": conn_id(),
                "dead_letters": dead_letter_counts(store)}

    @app.get("/api/messages")
    def messages(
        user: Reader,
        destination: str | None = None,
        header: Annotated[list[str] | None, Query()] = None,
        message_id: Annotated[list[str] | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
        after: str | None = None,
    ) -> dict[str, Any]:
        """A page of scheduled messages, soonest first; bodies (cut short) only for users who may edit."""
        can_edit = may_edit(user)
        result = hook().browse(message_ids=[m for m in message_id or () if m] or None,
                               destination=destination or None,
                               headers=_headers([h for h in header or () if h.strip()]), limit=limit,
                               after=after or None, show_bodies=can_edit)
        return {**result, "can_edit": can_edit}

    @app.post("/api/cancel")
    def cancel(_user: Editor, selection: Selection) -> dict[str, Any]:
        return hook().cancel(**selection.model_dump())

    @app.post("/api/run-now")
    def run_now(_user: Editor, selection: Selection) -> dict[str, Any]:
        return hook().run_now(**selection.model_dump())

    @app.post("/api/pause")
    def pause(_user: Editor, body: Destinations) -> dict[str, Any]:
        return hook().pause(body.destinations)

    @app.post("/api/resume")
    def resume(_user: Editor, body: Destinations) -> dict[str, Any]:
        return hook().resume(body.destinations)

    @app.post("/api/purge")
    def purge(_user: Editor, body: Purge) -> dict[str, Any]:
        return hook().purge(body.destination, dry_run=body.dry_run)

    return app


class _Headers:
    """The static files with the page's security headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      *((k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items())]
            await send(message)

        await self.app(scope, receive, with_headers)
