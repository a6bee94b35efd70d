"""Who may use the backlog page and on which store: the page's settings (`[delay_provider] ui_*`), Airflow's auth
manager asked about DAGs, the store's hook, and the audit of each action. Shared by the page's endpoints
(ui/app.py, ui/dead_letters.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Any

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.core_api.security import GetUserDep
from airflow.configuration import conf
from fastapi import Depends, HTTPException, Request, status
from pydantic import BaseModel

from airflow_delay_provider import audit
from airflow_delay_provider.core.errors import ConnectionTypeError, DelayProviderError, InvalidInputError
from airflow_delay_provider.hooks.delay_store import DEFAULT_CONN_ID, DelayStoreHook
from airflow_delay_provider.hooks.transport import transport_hook, transport_options


def option(key: str, default: str | None = None) -> str | None:
    return conf.get("delay_provider", key, fallback=None) or default


def conn_id() -> str:
    """The `delay_store` connection the page operates: `[delay_provider] ui_conn_id`, else the default."""
    return option("ui_conn_id", DEFAULT_CONN_ID)


class StoreConfigurationError(DelayProviderError):
    """The page's store connection cannot be used (undefined, malformed, or naming a table that is not a
    store): the deployment's to fix, so a server error, not the 400 of the user's own input."""


@dataclass(frozen=True)
class Route:
    """A transport, its connection (None: the transport's default) and its error queue: where dead letters are."""

    transport: str
    conn_id: str | None
    error_queue: str

    @property
    def key(self) -> str:
        """How the page names it: a digest, so the page shows no connection's name (as its errors show none)."""
        return hashlib.sha1(f"{self.transport}\0{self.conn_id or ''}\0{self.error_queue}".encode()).hexdigest()[:12]

    def shown(self) -> dict[str, str]:
        """What the page shows of it."""
        return {"key": self.key, "transport": self.transport, "error_queue": self.error_queue}

    def open(self, store: DelayStoreHook) -> Any:
        """Its transport, opened; the caller closes it."""
        return transport_hook(self.transport, self.conn_id, store).get_transport(
            **transport_options(self.transport, {}))


def routes(store: DelayStoreHook) -> list[Route]:
    """Where the dead letters are: `[delay_provider] ui_transport` (with `ui_transport_conn_id` and
    `ui_error_queue`) when it is set, else every transport, connection and error queue that provisioning and the
    dispatchers recorded in the store (stores/routes.py), the most recently seen first."""
    kind = option("ui_transport")
    if kind is not None:
        return [Route(kind, option("ui_transport_conn_id"), option("ui_error_queue", "error") or "error")]
    return [Route(r["transport"], r["conn_id"], r["error_queue"]) for r in store.checked_store().routes.routes()]


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


def hook(request: Request) -> DelayStoreHook:
    """The hook of the page's store, its connection resolved and its tables checked, never created nor changed (an
    action needs them up to date, which the connection's `auto_migrate` lets it do): whatever fails here is the
    deployment's, never the user's input."""
    return _checked(writes=request.method != "GET")


def reading_hook() -> DelayStoreHook:
    """`hook` for a POST that only reads (a count before an action): the store as it is, never migrated."""
    return _checked(writes=False)


def _checked(writes: bool) -> DelayStoreHook:
    store_hook = DelayStoreHook(conn_id())
    try:
        store_hook.checked_store(writes=writes)
    except ConnectionTypeError:
        raise  # said as it is (`not_usable`): it names the connection and the type the store needs
    except InvalidInputError as exc:
        raise StoreConfigurationError(f"the [delay_provider] ui_conn_id connection {conn_id()!r} cannot be used: "
                                      f"{exc}") from exc
    return store_hook


Store = Annotated[DelayStoreHook, Depends(hook)]
ReadingStore = Annotated[DelayStoreHook, Depends(reading_hook)]


def audited(action: str, user: BaseUser, body: BaseModel, result: dict[str, Any]) -> dict[str, Any]:
    """The result, once the action is in Airflow's audit log with its user and counts."""
    audit.record(action, user.get_name(), "page", conn_id(), body.model_dump(), result)
    return result
