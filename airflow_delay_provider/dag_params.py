"""Checks for DAGs that take their input from a trigger form or a run's conf: Params whose schemas refuse bad values
when the run is triggered (the form, the REST API, the CLI), and a check of the conf's keys."""

from __future__ import annotations

from typing import Any

from airflow.sdk import Param

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.retry_policy import BUILT_IN_POLICIES

#: An ISO-8601 date-time with a timezone (what `deliver_at` takes; the form's date picker sends `...T10:00:00.000Z`).
#: Airflow checks a schema's `format: date-time` only where the optional package rfc3339-validator is installed:
#: a pattern is checked by every install.
DATE_TIME_PATTERN = (r"^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])[Tt ]([01]\d|2[0-3]):[0-5]\d(:[0-5]\d(\.\d{1,6})?)?"
                     r"([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)$")
#: The value of `delivery_policy_param` that leaves the task's own policy in force.
TASK_DEFAULT_POLICY = "task default"


def deliver_at_param(**kwargs: Any) -> Param:
    """An optional due time: null, or an ISO-8601 date-time with a timezone (the form shows a date picker)."""
    kwargs.setdefault("title", "Deliver at")
    kwargs.setdefault("description", "An ISO timestamp with a timezone, e.g. 2026-12-24T18:00:00+00:00; "
                                     "in the past means now")
    return Param(None, type=["null", "string"], format="date-time", pattern=DATE_TIME_PATTERN, **kwargs)


def delivery_policy_param(default: str = TASK_DEFAULT_POLICY, **kwargs: Any) -> Param:
    """A delivery policy: a built-in's name (offered in the form), `task default`, or a policy as JSON text (an
    object: checked in full when the task runs, before anything is sent)."""
    names = [TASK_DEFAULT_POLICY, *BUILT_IN_POLICIES]
    kwargs.setdefault("title", "Retry policy")
    kwargs.setdefault("description", "A built-in delivery policy, or one as JSON, e.g. "
                                     '{"healthyRetryPolicy": {"numRetries": 5, "minDelayTarget": 10, '
                                     '"maxDelayTarget": 300, "backoffFunction": "exponential"}}')
    pattern = r"^(" + "|".join(names) + r"|\s*\{[\s\S]*\}\s*)$"  # names hold no pattern syntax
    return Param(default, type="string", examples=names, pattern=pattern, **kwargs)


def reject_unknown_conf(context: Any) -> None:
    """Fail a task whose run was triggered with conf keys the DAG has no param for.

    Airflow validates the values of known params but keeps unknown keys silently, so a misspelt key
    (`{"delay": 5}` for `delay_seconds`) would run with the default. Use it as
    `default_args={"pre_execute": reject_unknown_conf}`: the first task fails before anything is sent.
    """
    conf = getattr(context.get("dag_run"), "conf", None) or {}
    known = set(context["dag"].params)
    unknown = sorted(set(conf) - known)
    if unknown:
        raise InvalidInputError(f"unknown key(s) in the run's conf: {unknown}; this DAG accepts {sorted(known)}")
