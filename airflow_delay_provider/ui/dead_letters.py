"""The backlog page's dead letters: an error queue listed with filters (original destination, ids, failure text,
dead-lettered since), looked at without consuming anything, and redriven or deleted by id, by destination or all of
them. Which error queues there are, the store knows: provisioning and every dispatcher record their transport,
connection and error queue (stores/routes.py), so the page needs no setting and no restart; `[delay_provider]
ui_transport` (with `ui_transport_conn_id` and `ui_error_queue`) names one instead. With several, the page picks
one by its `route` key (the most recently seen by default). Reading needs read access to DAGs, and bodies, like
every action, the right to edit them; each action goes to Airflow's audit log. A transport that cannot look at its
error queue without consuming it (RabbitMQ 3.10) says so, and so does a store that knows of none."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import FastAPI, Query
from pydantic import BaseModel, Field

from airflow_delay_provider.core.backlog import MAX_IDS, MAX_PAGE
from airflow_delay_provider.core.errors import DestinationNotFoundError, InvalidInputError
from airflow_delay_provider.hooks.delay_store import DelayStoreHook
from airflow_delay_provider.ui.access import Editor, Reader, Route, Store, audited, may_edit, routes

#: What the page says when it knows of no error queue to look at.
NO_TRANSPORT = ("dead letters live on a transport's error queue, and neither provisioning nor a dispatcher has said "
                "which yet: run the provisioning DAG or a dispatch task of this release (on a store at schema "
                "version 13 or later: `airflow delayed-messages db upgrade`), or set [delay_provider] ui_transport "
                "(sql, rabbitmq or sqs; ui_transport_conn_id and ui_error_queue as the pump's)")


def chosen_route(store: DelayStoreHook, key: str | None) -> tuple[Route, list[Route]]:
    """The route `key` names (None: the first, the most recently seen), and all of them."""
    found = routes(store)
    if not found:
        raise InvalidInputError(NO_TRANSPORT)
    if key is None:
        return found[0], found
    for route in found:
        if route.key == key:
            return route, found
    allowed = ", ".join(f"{r.key} ({r.transport} {r.error_queue})" for r in found)
    raise InvalidInputError(f"route must be one of {allowed}, got {key!r:.64}")


class DeadLetterSelection(BaseModel):
    """Which dead letters an action takes: by id and/or original destination, or all of them with `everything`."""

    message_ids: list[str] | None = Field(None, max_length=MAX_IDS)
    destination: str | None = None
    everything: bool = False
    #: Which error queue (a `key` of the listing's `routes`); None: the first.
    route: str | None = Field(None, max_length=64)

    def checked(self) -> DeadLetterSelection:
        chosen = bool(self.message_ids or self.destination)
        if chosen == self.everything:
            raise InvalidInputError("select the dead letters by message_ids and/or destination, or all of them with "
                                    "everything: true" + (" (not both)" if chosen else ""))
        return self


class DeadLetterDeletion(DeadLetterSelection):
    """A deletion, and whether only to count what it would delete (the default)."""

    dry_run: bool = True


def _since(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise InvalidInputError(f"since must be an ISO 8601 date-time, got {value!r:.60}") from None


def _failed_since(letter: dict[str, Any], since: datetime) -> bool:
    try:
        return datetime.fromisoformat(letter["last_failed_at"] or "") >= since
    except (ValueError, TypeError):
        return False


def add_routes(app: FastAPI) -> None:
    """The dead letters' endpoints, on the page's app (its error handlers and middleware apply)."""

    @app.get("/api/dead-letters")
    def dead_letters(
        user: Reader,
        store: Store,
        destination: str | None = None,
        message_id: Annotated[list[str] | None, Query()] = None,
        failure: str | None = None,
        since: str | None = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
        route: Annotated[str | None, Query(max_length=64)] = None,
    ) -> dict[str, Any]:
        """Dead letters of one error queue, oldest first, consuming nothing; bodies only for users who may edit.
        `routes` lists every error queue the store knows of (its `key` is what `route` takes)."""
        after = _since(since)
        try:
            chosen, every = chosen_route(store, route or None)
        except InvalidInputError as exc:
            if route:
                raise
            return {"available": False, "reason": str(exc), "dead_letters": [], "can_edit": may_edit(user),
                    "routes": []}
        kind, queue = chosen.transport, chosen.error_queue
        listed = {"route": chosen.key, "routes": [r.shown() for r in every]}
        transport = chosen.open(store)
        filtered = bool(failure or after)
        try:
            listing = store.dead_letters(transport, queue, destination=destination or None,
                                         message_ids=[m for m in message_id or () if m] or None,
                                         limit=MAX_PAGE if filtered else limit)
        except DestinationNotFoundError:  # no error queue yet: nothing was dead-lettered
            listing = {"dead_letters": [], "more": False}
        except NotImplementedError:  # the transport's nature (see Transport.peek), not a failure
            return {"available": False, "dead_letters": [], "can_edit": may_edit(user), **listed,
                    "reason": f"the {kind} transport cannot show its error queue without consuming it"}
        finally:
            transport.close()
        found = [d for d in listing["dead_letters"]
                 if (not failure or failure.lower() in (d.get("last_error") or "").lower())
                 and (after is None or _failed_since(d, after))]
        can_edit = may_edit(user)
        if not can_edit:
            found = [{**d, "body": None} for d in found]
        return {"available": True, "transport": kind, "error_queue": queue, "dead_letters": found[:limit],
                "more": listing["more"] or len(found) > limit, "can_edit": can_edit, **listed}

    @app.post("/api/dead-letters/redrive")
    def redrive(user: Editor, store: Store, body: DeadLetterSelection) -> dict[str, Any]:
        """Store the selected dead letters again for their destination, due now (those whose destination is not
        provisioned stay, skipped with the reason)."""
        body.checked()
        route, _ = chosen_route(store, body.route)
        transport, queue = route.open(store), route.error_queue
        try:
            return audited("redrive", user, body, store.redrive(
                transport, queue, destination=body.destination, message_ids=body.message_ids))
        finally:
            transport.close()

    @app.post("/api/dead-letters/delete")
    def delete(user: Editor, store: Store, body: DeadLetterDeletion) -> dict[str, Any]:
        """Delete the selected dead letters; a dry run (the default) counts what would go and deletes nothing."""
        body.checked()
        route, _ = chosen_route(store, body.route)
        transport, queue = route.open(store), route.error_queue
        try:
            return audited("delete_dead_letters", user, body, store.delete_dead_letters(
                transport, queue, destination=body.destination, message_ids=body.message_ids,
                everything=body.everything, dry_run=body.dry_run))
        finally:
            transport.close()
