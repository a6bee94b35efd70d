"""Checks for DAGs that take their input from a trigger form or a run's conf."""

from __future__ import annotations

from typing import Any

from airflow_delay_provider.core.errors import InvalidInputError


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
