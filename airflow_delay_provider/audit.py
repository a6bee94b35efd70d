"""Every action on delayed messages in Airflow's audit log (Browse > Audit Log, the `log` table), where Airflow
records its own UI and CLI actions: who, which action, on what (ids, destinations, headers: never a body), through
which connection, and how many messages it touched.

The page and `airflow delayed-messages` record theirs once the action is done, with its counts (Airflow's own CLI
record of the command line comes beside it). Dry runs change nothing and are not recorded. A task has no access to
Airflow's database in Airflow 3, so the backlog operators' actions are in their task logs and XCom instead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

#: The audit log's event of an action is this prefix and its name: `delayed_messages.cancel`.
EVENT_PREFIX = "delayed_messages."
#: What a result counts, by the key that holds it (a list of ids, a number, or numbers per destination).
_COUNTED = ("cancelled", "rescheduled", "edited", "paused", "resumed", "changed", "forgotten", "purged", "redriven",
            "deleted", "unknown")
#: The parts of a request that say what it acted on.
_TARGET = ("message_id", "message_ids", "destination", "destinations", "headers", "due_from", "due_before",
           "body_contains", "deliver_at", "delay_seconds", "force", "error_queue", "everything")


def counts(result: Mapping[str, Any]) -> dict[str, int]:
    """How many messages (or destinations) an action's result says it touched, per kind."""
    found = {}
    complete = result.get("counts") if isinstance(result.get("counts"), Mapping) else {}
    for key in _COUNTED:
        # A report's lists of ids stop at LISTED; its `counts` are complete.
        value = complete.get(key, result.get(key))
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (list, tuple, set)):
            found[key] = len(value)
        elif isinstance(value, int):
            found[key] = value
        elif isinstance(value, Mapping):
            found[key] = sum(v for v in value.values() if isinstance(v, int) and not isinstance(v, bool))
    return found


def target_of(request: Mapping[str, Any]) -> dict[str, Any]:
    """What an action was asked to act on, without anything else of the request; header values that look secret
    are masked as Airflow masks them."""
    from airflow.sdk._shared.secrets_masker import redact

    target = {k: request[k] for k in _TARGET if request.get(k) not in (None, [], {}, "")}
    if isinstance(target.get("headers"), Mapping):
        target["headers"] = {k: redact(v, k) for k, v in target["headers"].items()}
    return {k: str(v) if k in ("deliver_at", "due_from", "due_before") else v for k, v in target.items()}


def record(action: str, owner: str, source: str, conn_id: str | None, request: Mapping[str, Any],
           result: Mapping[str, Any]) -> bool:
    """Add one entry to Airflow's audit log for an action done; returns whether it was written. A dry run is not
    recorded. A failure to write is logged, never raised: the action is done and its result stands."""
    if result.get("dry_run"):
        return False
    extra = {"source": source, "conn_id": conn_id, "target": target_of(request), "counts": counts(result)}
    try:
        from airflow.models import Log
        from airflow.utils.session import create_session

        with create_session() as session:
            session.add(Log(event=EVENT_PREFIX + action, owner=owner, owner_display_name=owner,
                            extra=json.dumps(extra, default=str)))
        return True
    except Exception as exc:  # noqa: BLE001 - the audit log's database is down: say so, the action stands
        log.error("could not record %s%s by %s in Airflow's audit log (%s): %s", EVENT_PREFIX, action, owner,
                  type(exc).__name__, json.dumps(extra, default=str))
        return False


def recent(limit: int = 50, conn_id: str | None = None) -> list[dict[str, Any]]:
    """The latest actions in Airflow's audit log, newest first (those of `conn_id` only, if given)."""
    from airflow.models import Log
    from airflow.utils.session import create_session
    from sqlalchemy import select

    found = []
    where = [Log.event.like(EVENT_PREFIX + "%")]
    if conn_id is not None:
        # The connection as record() writes it into `extra`; quotes inside other values are escaped there, so no
        # header value can fake it. Checked again below, on the parsed JSON.
        where.append(Log.extra.contains(f'"conn_id": {json.dumps(conn_id)}', autoescape=True))
    with create_session() as session:
        rows = session.execute(select(Log.dttm, Log.event, Log.owner, Log.extra).where(*where)
                               .order_by(Log.dttm.desc(), Log.id.desc()).limit(limit)).all()
    for when, event, owner, extra in rows:
        try:
            details = json.loads(extra or "{}")
        except ValueError:
            details = {}
        if conn_id is not None and details.get("conn_id") != conn_id:
            continue
        found.append({"when": when.isoformat() if when else None, "action": event.removeprefix(EVENT_PREFIX),
                      "user": owner, "source": details.get("source"), "target": details.get("target", {}),
                      "counts": details.get("counts", {})})
        if len(found) >= limit:
            break
    return found
