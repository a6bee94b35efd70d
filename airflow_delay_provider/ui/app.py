"""The backlog page's FastAPI app: one static page and the JSON endpoints it calls, in Airflow's api-server.

Authentication is Airflow's own: every endpoint resolves the user with the api-server's `get_user`
dependency (the UI's JWT cookie, or an `Authorization: Bearer` token). Authorization asks the
configured auth manager about DAGs (any DAG, no team):

* reading (the counts, the histogram, the message list, the delivery history, its charts and a message's story)
  needs ``is_authorized_dag(method="GET")``;
* every action (POST: count, cancel, run now, reschedule, edit, pause, resume, purge, forget) needs
  ``is_authorized_dag(method="PUT")``, the permission to edit DAGs, and so do message bodies and searching them:
  readers who may not edit see sizes only.

The store is the one of the ``[delay_provider] ui_conn_id`` connection (default ``delay_store_default``).
Dead-lettered messages live on the transport, not in the store: the store knows each transport, connection
and error queue its provisioning and dispatchers use (stores/routes.py; or ``[delay_provider] ui_transport``,
``ui_transport_conn_id`` and ``ui_error_queue`` name one), and the page counts their dead letters per original
destination, and lists, redrives and deletes them (ui/dead_letters.py). Every action goes to Airflow's audit log
(airflow_delay_provider.audit).
Only the api-server imports this module (see `plugin.LazyBacklogApp`).

Errors: a 400 says what was wrong with the user's own input and what is allowed. A store that is not there
yet (or older than this release, for an action) and a connection of another type than `delay_store` are a 503
that says so and what to run: the page reads and changes nothing then, and creates nothing. Any other failure
(the store unreachable: 503; its connection or database wrong, or anything unexpected: 500; a dead-letter
count that fails) shows only an error id, and the server's log has that id with the exception: its text
may name the database's user, host, port and tables, which the page's users need not see.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.core_api.security import bearer_scheme, get_user
from fastapi import Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from airflow_delay_provider import audit
from airflow_delay_provider.core.backlog import MAX_BODY_SEARCH, MAX_IDS, MAX_PAGE
from airflow_delay_provider.core.errors import (
    ConnectionTypeError,
    DelayProviderError,
    DestinationNotFoundError,
    InvalidInputError,
    StoreNotReadyError,
    UnavailableError,
)
from airflow_delay_provider.core.history import MAX_HISTORY_PAGE
from airflow_delay_provider.hooks.delay_store import DelayStoreHook
from airflow_delay_provider.ui.access import (
    Editor,
    Reader,
    ReadingStore,
    Store,
    audited,
    conn_id,
    may_edit,
    routes,
)
from airflow_delay_provider.ui.dead_letters import add_routes as add_dead_letter_routes

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


def log_failure(exc: BaseException, doing: str) -> str:
    """Log `exc` in full under a new error id, which is all the user is shown of it; returns the id."""
    error_id = uuid.uuid4().hex[:12]
    # An outage is the store's or broker's to fix; the errors of this package say all in their message,
    # anything else gets its traceback.
    log.log(logging.WARNING if isinstance(exc, (UnavailableError, StoreNotReadyError, ConnectionTypeError))
            else logging.ERROR,
            "Delayed messages page, error id %s, %s: %s: %s", error_id, doing, type(exc).__name__, exc,
            exc_info=None if isinstance(exc, DelayProviderError) else exc)
    return error_id


def failure_response(exc: BaseException, doing: str) -> JSONResponse:
    """The answer to a request that failed for the server's reason: what kind of failure, and the error id."""
    error_id = log_failure(exc, doing)
    if isinstance(exc, UnavailableError):
        # The connection's id, never its URL: the id is the deployment's name for it, the URL holds its secrets.
        return JSONResponse({"detail": f"the delayed-message store of connection {conn_id()!r} is not reachable; "
                                       f"the server's log has the details under error id {error_id}",
                             "error_id": error_id, "conn_id": conn_id()},
                            status_code=status.HTTP_503_SERVICE_UNAVAILABLE)
    return JSONResponse({"detail": "the server could not complete the request; the server's log has the details "
                                   f"under error id {error_id}", "error_id": error_id},
                        status_code=status.HTTP_500_INTERNAL_SERVER_ERROR)


def dead_letter_counts(store: DelayStoreHook) -> dict[str, Any] | None:
    """The dead letters of every error queue the page knows of (ui/access.routes) per original destination (None when
    it knows of none): a look at up to MAX_PAGE of each, consuming nothing (`more` when there may be more). A
    transport that cannot look (RabbitMQ) says so in `error`; one that fails gives an error id there, and
    `error_id`."""
    try:
        every = routes(store)
    except DelayProviderError as exc:  # an extra of the page: the counts of the store still show
        return {"error": f"it failed; the server's log has the details under error id {log_failure(exc, 'routes')}"}
    if not every:
        return None
    first = every[0]
    report: dict[str, Any] = {"transport": first.transport, "error_queue": first.error_queue}
    per_destination: Counter[str] = Counter()
    counts = {"total": 0, "more": False}
    counted = False
    for route in every:
        try:
            transport = route.open(store)
            try:
                listing = store.dead_letters(transport, route.error_queue, limit=MAX_PAGE)
            finally:
                transport.close()
        except DestinationNotFoundError:  # no error queue yet: nothing was dead-lettered
            counted = True
            continue
        except NotImplementedError:  # the transport's nature, not a failure (see Transport.peek)
            report["error"] = f"the {route.transport} transport cannot show its error queue without consuming it"
            continue
        except Exception as exc:  # an extra of the page: the counts of the store still show
            error_id = log_failure(exc, f"counting the dead letters of {route.transport} queue {route.error_queue!r}")
            report.update(error=f"it failed; the server's log has the details under error id {error_id}",
                          error_id=error_id)
            continue
        counted = True
        per_destination.update(d["destination"] or "(unknown)" for d in listing["dead_letters"])
        counts = {"total": counts["total"] + listing["count"], "more": counts["more"] or listing["more"]}
    # Counts only where an error queue could be looked at: a failure alone is an error, not "none".
    return {**report, "per_destination": dict(per_destination), **counts} if counted else report


class Selection(BaseModel):
    """Which scheduled messages an action applies to (at least one of them: the store refuses none): ids, or a filter
    (destination, header match, due window, body text), which the store counts and changes in batches."""

    message_ids: list[str] | None = Field(None, max_length=MAX_IDS)
    destination: str | None = None
    headers: dict[str, str] | None = None
    due_from: str | None = None
    due_before: str | None = None
    body_contains: str | None = Field(None, max_length=MAX_BODY_SEARCH)


class Counting(Selection):
    """A selection and the action it is counted for (its dry run)."""

    action: Literal["cancel", "reschedule", "run_now", "pause", "resume"] = "cancel"


class Rescheduling(Selection):
    """A selection and its new due time: exactly one of an ISO time (with offset) or seconds from now."""

    deliver_at: str | None = None
    delay_seconds: float | None = None


class Edited(BaseModel):
    """The message an edit names, as the audit log records it: never its new body or headers."""

    message_id: str


class Edit(Edited):
    """One scheduled message's new body and/or headers (the due time stays)."""

    body: str | None = None
    headers: dict[str, str] | None = None


class Destinations(BaseModel):
    """The destinations a pause or a resume names."""

    destinations: list[str] = Field(min_length=1, max_length=100)


class Forget(Destinations):
    """The destinations to forget, and whether to do so although messages or dead letters remain."""

    force: bool = False


class Purge(BaseModel):
    """One destination to purge, and whether only to count what would go."""

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

    @app.exception_handler(StoreNotReadyError)
    @app.exception_handler(ConnectionTypeError)
    async def not_usable(request: Request, exc: DelayProviderError) -> JSONResponse:
        # The deployment's to fix, and its message says how: it names the connection, database, schema and
        # tables, never a password nor a statement.
        error_id = log_failure(exc, f"{request.method} {request.url.path}")
        return JSONResponse({"detail": str(exc), "error_id": error_id, "conn_id": conn_id()},
                            status_code=status.HTTP_503_SERVICE_UNAVAILABLE)

    app.add_middleware(_Failures)

    @app.get("/", include_in_schema=False)
    async def page(request: Request, bearer: Annotated[Any, Depends(bearer_scheme)]) -> Response:
        try:
            await get_user(request, None, bearer)
        except HTTPException:  # not logged in (or the session ended): Airflow's login, then back here
            return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)))
        return FileResponse(STATIC / "index.html", headers=SECURITY_HEADERS)

    app.mount("/static", _Headers(StaticFiles(directory=STATIC)), name="static")

    @app.get("/api/backlog")
    def backlog(user: Reader, store: Store, destination: str | None = None) -> dict[str, Any]:
        """Per destination: scheduled, due, in flight, paused, the due-time histogram; totals."""
        result = store.backlog(destination or None)
        return {**result, "can_edit": may_edit(user), "user": user.get_name(), "conn_id": conn_id(),
                "dead_letters": dead_letter_counts(store)}

    @app.get("/api/messages")
    def messages(
        user: Reader,
        store: Store,
        destination: str | None = None,
        header: Annotated[list[str] | None, Query()] = None,
        message_id: Annotated[list[str] | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
        after: str | None = None,
        due_from: str | None = None,
        due_before: str | None = None,
        body_contains: Annotated[str | None, Query(max_length=MAX_BODY_SEARCH)] = None,
    ) -> dict[str, Any]:
        """A page of scheduled messages, soonest first; bodies (cut short), and searching them, only for users who
        may edit."""
        can_edit = may_edit(user)
        if body_contains and not can_edit:  # a search is a way to read bodies
            raise HTTPException(status.HTTP_403_FORBIDDEN, "Forbidden: searching message bodies needs edit access "
                                                           "to DAGs, as seeing them does")
        result = store.browse(message_ids=[m for m in message_id or () if m] or None,
                              destination=destination or None,
                              headers=_headers([h for h in header or () if h.strip()]), limit=limit,
                              after=after or None, show_bodies=can_edit, due_from=due_from or None,
                              due_before=due_before or None, body_contains=body_contains or None)
        return {**result, "can_edit": can_edit}

    add_dead_letter_routes(app)

    @app.get("/api/actions")
    def actions(user: Reader, limit: Annotated[int, Query(ge=1, le=200)] = 20) -> dict[str, Any]:
        """The latest actions on this connection's store, from Airflow's audit log, newest first (a body search's
        text only for users who may see bodies)."""
        found = audit.recent(limit, conn_id())
        if not may_edit(user):
            for entry in found:
                if "body_contains" in entry["target"]:
                    entry["target"]["body_contains"] = "(hidden)"
        return {"actions": found}

    @app.get("/api/history")
    def history(
        _user: Reader,
        store: Store,
        destination: str | None = None,
        message_id: str | None = None,
        outcome: Literal["delivered", "retried", "dead_lettered", "cancelled", ""] | None = None,
        since: str | None = None,
        before: str | None = None,
        limit: Annotated[int, Query(ge=1, le=MAX_HISTORY_PAGE)] = 50,
        after: str | None = None,
    ) -> dict[str, Any]:
        """What became of messages, newest first (no bodies: every reader may see it). `next` is the cursor of the
        page after this one (`after`): a pump hands a whole batch over at one time, so `before` a page's last
        hand-over time would skip the rest of its batch."""
        return store.history(destination=destination or None, message_id=message_id or None, outcome=outcome or None,
                             since=since or None, before=before or None, limit=limit, after=after or None)

    @app.get("/api/history/chart")
    def history_chart(_user: Reader, store: Store, destination: str | None = None,
                      window: Literal["1h", "6h", "24h"] = "1h") -> dict[str, Any]:
        """Per minute: delivered, lateness p50/p99, retried, dead-lettered, cancelled."""
        return store.history_chart(destination=destination or None, window=window)

    @app.get("/api/story")
    def story(user: Reader, store: Store, message_id: Annotated[str, Query(min_length=1, max_length=200)]
              ) -> dict[str, Any]:
        """One message's story; its body (while scheduled) only for users who may edit."""
        return store.story(message_id, show_bodies=may_edit(user))

    @app.post("/api/count")
    def count(_user: Editor, store: ReadingStore, counting: Counting) -> dict[str, Any]:
        """What an action on this selection would touch (`would_<action>`, `in_flight`, `confirm`), changing
        nothing: the page shows it before the user confirms."""
        action = "reschedule" if counting.action == "run_now" else counting.action
        return store.count(**counting.model_dump(exclude={"action"}), action=action)

    @app.post("/api/cancel")
    def cancel(user: Editor, store: Store, selection: Selection) -> dict[str, Any]:
        return audited("cancel", user, selection, store.cancel(**selection.model_dump()))

    @app.post("/api/run-now")
    def run_now(user: Editor, store: Store, selection: Selection) -> dict[str, Any]:
        return audited("run_now", user, selection, store.run_now(**selection.model_dump()))

    @app.post("/api/pause-messages")
    def pause_messages(user: Editor, store: Store, selection: Selection) -> dict[str, Any]:
        """Hold the selected messages stored, never delivered, until resumed."""
        return audited("pause_messages", user, selection, store.pause_messages(**selection.model_dump()))

    @app.post("/api/resume-messages")
    def resume_messages(user: Editor, store: Store, selection: Selection) -> dict[str, Any]:
        """Release the selected paused messages to their due times (those past due go at once)."""
        return audited("resume_messages", user, selection, store.resume_messages(**selection.model_dump()))

    @app.post("/api/reschedule")
    def reschedule(user: Editor, store: Store, change: Rescheduling) -> dict[str, Any]:
        return audited("reschedule", user, change, store.reschedule(**change.model_dump()))

    @app.post("/api/edit")
    def edit(user: Editor, store: Store, change: Edit) -> dict[str, Any]:
        """Change one message's body and/or headers; the audit log names the message, never the body."""
        return audited("edit", user, Edited(message_id=change.message_id), store.edit(**change.model_dump()))

    @app.post("/api/pause")
    def pause(user: Editor, store: Store, body: Destinations) -> dict[str, Any]:
        return audited("pause", user, body, store.pause(body.destinations))

    @app.post("/api/resume")
    def resume(user: Editor, store: Store, body: Destinations) -> dict[str, Any]:
        return audited("resume", user, body, store.resume(body.destinations))

    @app.post("/api/purge")
    def purge(user: Editor, store: Store, body: Purge) -> dict[str, Any]:
        return audited("purge", user, body, store.purge(body.destination, dry_run=body.dry_run))

    @app.post("/api/forget")
    def forget(user: Editor, store: Store, body: Forget) -> dict[str, Any]:
        """Forget destinations; refused while an error queue the page knows of holds their dead letters (as while
        they have scheduled messages), unless forced."""
        opened = [(route.open(store), route.error_queue) for route in routes(store)]
        try:
            return audited("forget", user, body, store.forget(body.destinations, force=body.force,
                                                              error_queues=opened))
        finally:
            for transport, _ in opened:
                transport.close()

    return app


class _Failures:
    """Every exception no handler answered (all but the user's bad input and HTTP errors) becomes
    `failure_response`: Starlette's own last resort would re-raise it, for the server to log once more."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started or scope["type"] != "http":  # too late for an answer of its own
                raise
            await failure_response(exc, f"{scope['method']} {scope['path']}")(scope, receive, send)


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
