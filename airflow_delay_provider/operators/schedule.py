"""ScheduleDagRunOperator: start a DAG run later, durably, with a conf, through the store and an asset watcher."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import BaseOperator, Context

from airflow_delay_provider import metrics
from airflow_delay_provider.compat import require_shared_streams
from airflow_delay_provider.core.breakers import CircuitBreaker, call_with_breaker
from airflow_delay_provider.core.delays import MAX_DELAY_SECONDS, DelayLimits
from airflow_delay_provider.core.duplicates import SKIP, check_on_duplicate
from airflow_delay_provider.core.errors import InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import stable_message_id
from airflow_delay_provider.core.requests import (
    PARSE_TIME_LIMITS,
    PARSE_TIME_NOW,
    build_message,
    check_conf,
    parse_moment,
    resolved_at_run_time,
)
from airflow_delay_provider.hooks.delay_store import DelayStoreMixin
from airflow_delay_provider.operators.base import run_time
from airflow_delay_provider.triggers.asset import asset_destination, dag_run_asset_name

#: Headers every scheduled run's message carries.
HEADER_DAG_ID = "x-airflow-dag-id"
HEADER_ASSET = "x-airflow-asset"
HEADER_SCHEDULED_BY = "x-airflow-scheduled-by"


def _templated(value: Any) -> bool:
    """Known only when the task runs (Jinja text, an XComArg): checked then, not when the DAG is parsed."""
    return resolved_at_run_time(value)


def _asset_name(asset: Any) -> str | None:
    if asset is None or asset == "":
        return None
    name = getattr(asset, "name", asset)
    if not isinstance(name, str) or not name.strip():
        raise InvalidInputError(f"asset must be an Asset or an asset name, got {asset!r}")
    return name


class ScheduleDagRunOperator(DelayStoreMixin, BaseOperator):
    """Start a run of a DAG later (after `delay_seconds`, or at `deliver_at`) with `conf`; returns the message id,
    which `CancelDelayedMessagesOperator` and `RescheduleDelayedMessagesOperator` take to cancel, move or run it now.

    The run is a message in the store, due at that time, to the event destination of the target's asset; the
    asset's watcher (`DueMessageEventTrigger`) turns it into an asset event at the due time, and the scheduler
    starts the DAG scheduled on the asset. The target reads the conf from `triggering_asset_events` (the event's
    `extra["payload"]["body"]`; `message_payloads()` gives them, de-duplicated).

    :param dag_id: the target DAG, scheduled on `dag_run_asset(dag_id)` (templated). Give this or `asset`.
    :param asset: the target asset (an Asset or its name) watched by a DueMessageEventTrigger on
        `asset_destination(name)`; every DAG scheduled on it runs (templated).
    :param conf: the run's conf: a JSON-serialisable dict (or rendered JSON text), at most 64 KiB (templated).
    :param delay_seconds: seconds from now, 0..604,800 (7 days) unless the store connection's `max_delay_seconds`
        allows more (up to ten years); int, float (rounded up) or timedelta (templated).
    :param deliver_at: the due time instead: an aware datetime or ISO text; the past means now (templated).
    :param message_id: the message id (default: derived from the task instance, so a retried task schedules the
        same run, once).
    :param on_duplicate: what scheduling a run whose message id the store holds does (templated): ``skip`` (the
        default: the run stays as scheduled), ``replace`` (the new time and conf replace it: a debounce, "run 30
        minutes after the last change"), ``keep_earliest`` (the run due first stays) or ``replace_body`` (the conf
        changes, the time stays). Give `message_id` to address one run from several tasks or DAG runs.
    :param check_target: at send time, refuse a DAG or an asset Airflow does not know (default True).
    :param time_to_trigger_store_circuit_breaker: how long (s) the store may be unreachable before the task fails.
    """

    template_fields: Sequence[str] = ("dag_id_to_run", "asset", "conf", "delay_seconds", "deliver_at", "message_id",
                                      "on_duplicate")
    template_fields_renderers = {"conf": "json"}
    ui_color = "#e8f0d2"

    def __init__(
        self,
        *,
        dag_id: str | None = None,
        asset: Any = None,
        conf: dict[str, Any] | str | None = None,
        delay_seconds: int | float | timedelta | str | None = None,
        deliver_at: datetime | str | None = None,
        message_id: str | None = None,
        on_duplicate: str = SKIP,
        check_target: bool = True,
        time_to_trigger_store_circuit_breaker: float = 30.0,
        **kwargs: Any,
    ) -> None:
        require_shared_streams("ScheduleDagRunOperator (delayed DAG runs)")
        super().__init__(**kwargs)
        # `dag_id` is the operator's own DAG's id on BaseOperator: the target's is kept as dag_id_to_run.
        self.dag_id_to_run = dag_id
        self.asset = _asset_name(asset) if asset is not None and not isinstance(asset, str) else asset
        self.conf = conf
        self.delay_seconds = delay_seconds
        self.deliver_at = deliver_at
        self.message_id = message_id
        self.on_duplicate = on_duplicate
        if not _templated(on_duplicate):
            check_on_duplicate(on_duplicate)
        self.check_target = check_target
        self.time_to_trigger_store_circuit_breaker = time_to_trigger_store_circuit_breaker
        # Whatever is not templated is checked when the DAG is parsed.
        if (dag_id in (None, "")) == (asset in (None, "")):
            raise InvalidInputError("give the target as exactly one of dag_id (a DAG scheduled on "
                                    "dag_run_asset(dag_id)) or asset (an asset with a DueMessageEventTrigger watcher)")
        self._target(partial_ok=True)
        if not _templated(conf) and not isinstance(conf, str):
            check_conf(conf)
        if not _templated(delay_seconds) and not _templated(deliver_at):
            self._build(PARSE_TIME_NOW, parse_only=True, limits=PARSE_TIME_LIMITS)
        elif not _templated(delay_seconds) and delay_seconds not in (None, ""):  # beside a templated deliver_at
            build_message({"destination": "airflow.asset.x", "delay_seconds": delay_seconds}, PARSE_TIME_NOW,
                          limits=PARSE_TIME_LIMITS)
        elif not _templated(deliver_at):
            parse_moment(deliver_at)

    def _target(self, partial_ok: bool = False) -> tuple[str | None, str, str]:
        """(target dag id or None, asset name, destination); templated parts are left for rendering."""
        if self.dag_id_to_run not in (None, ""):
            if partial_ok and _templated(self.dag_id_to_run):
                return None, "", ""
            name = dag_run_asset_name(self.dag_id_to_run)
            return self.dag_id_to_run, name, asset_destination(name)
        if partial_ok and _templated(self.asset):
            return None, "", ""
        name = _asset_name(self.asset)
        return None, name, asset_destination(name)

    def _build(self, now: datetime, parse_only: bool = False, destination: str = "airflow.asset.x",
               body: str = "{}", headers: dict[str, str] | None = None, default_id: str | None = None,
               limits: DelayLimits | None = None):
        if self.deliver_at not in (None, "") and parse_only:
            parse_moment(self.deliver_at)  # only the format: the time may be past when the task runs
            if self.delay_seconds not in (None, ""):
                raise InvalidInputError("give either delay_seconds or deliver_at, not both")
            return None
        if self.deliver_at in (None, "") and self.delay_seconds in (None, ""):
            raise InvalidInputError(f"give delay_seconds (0..{MAX_DELAY_SECONDS} unless the store connection's "
                                    "max_delay_seconds says more) or deliver_at: when the run starts")
        item = {"destination": destination, "body": body, "headers": headers or {},
                "delay_seconds": self.delay_seconds, "deliver_at": self.deliver_at,
                "message_id": self.message_id or default_id}
        return build_message(item, now, limits=limits)

    def execute(self, context: Context) -> str:
        target_dag, asset_name, destination = self._target()
        conf = check_conf(self.conf)
        if self.check_target:
            check_target(target_dag, asset_name, self.log)
        ti = context["ti"]
        origin = (ti.dag_id, ti.run_id, ti.task_id, getattr(ti, "map_index", -1))
        store = self.hook.get_store()
        breaker = CircuitBreaker("storing the delayed run", self.time_to_trigger_store_circuit_breaker)

        def guarded(call):
            return call_with_breaker(breaker, call, retry_on=(UnavailableError,))

        guarded(lambda: self.hook.prepare_for_writes(store))  # created only where auto_migrate allows it
        headers = {HEADER_ASSET: asset_name, HEADER_SCHEDULED_BY: "/".join(map(str, origin))}
        if target_dag:
            headers[HEADER_DAG_ID] = target_dag
        message = self._build(guarded(store.clock), destination=destination,
                              body=json.dumps(conf, separators=(",", ":")), headers=headers,
                              default_id=stable_message_id(*origin, "dag-run", at=run_time(context)),
                              limits=self.hook.delay_limits)
        on_duplicate = check_on_duplicate(self.on_duplicate or SKIP)
        stored = guarded(lambda: store.store([message], on_duplicate=on_duplicate))
        what = f"DAG {target_dag!r}" if target_dag else f"the DAGs scheduled on asset {asset_name!r}"
        if stored:
            self.log.info("Scheduled a run of %s at %s (message %s, destination %s, on_duplicate=%s)", what,
                          message.due_at.isoformat(), message.message_id, destination, on_duplicate)
        else:
            self.log.info("The run of %s with message id %s was already scheduled (a retried task) or started, or "
                          "kept by on_duplicate=%s: nothing stored", what, message.message_id, on_duplicate)
        metrics.count_sent({destination: 1})
        return message.message_id


def check_target(dag_id: str | None, asset_name: str, log: Any = None) -> None:
    """Refuse, before anything is stored, a target Airflow does not know: through the task's Execution API
    (the worker has no metadata database), GetDag for a DAG and GetAssetByName for its asset."""
    try:
        from airflow.sdk.execution_time.comms import ErrorResponse, GetAssetByName, GetDag
        from airflow.sdk.execution_time.task_runner import SUPERVISOR_COMMS
    except ImportError:  # not in a task (a unit test): nothing to ask
        return
    comms = SUPERVISOR_COMMS
    if comms is None:
        return

    def ask(message: Any) -> Any:
        try:
            answer = comms.send(message)
        except Exception as exc:  # noqa: BLE001 - a 404 comes back as an error of the API client
            return exc
        return answer

    def why(answer: Any) -> str:
        detail = getattr(answer, "detail", None) or getattr(answer, "error", None) or answer
        return f" (Airflow answered: {str(detail)[:200]})" if detail is not None else ""

    if dag_id:
        dag = ask(GetDag(dag_id=dag_id))
        if dag is None or isinstance(dag, (ErrorResponse, Exception)):
            raise InvalidInputError(f"unknown DAG {dag_id!r}: no DAG of that id is known to Airflow (is its file in "
                                    f"the dags folder, and parsed without import errors?){why(dag)}; nothing was "
                                    "scheduled")
        if getattr(dag, "is_paused", False) and log is not None:
            log.warning("DAG %r is paused: its asset watcher is not running, so the message waits in the store and "
                        "the run starts once the DAG is unpaused (and its file parsed again)", dag_id)
    asset = ask(GetAssetByName(name=asset_name))
    if asset is None or isinstance(asset, (ErrorResponse, Exception)):
        if dag_id:
            raise InvalidInputError(
                f"DAG {dag_id!r} is not scheduled on the asset {asset_name!r}: define it with "
                f"`schedule=dag_run_asset({dag_id!r})` (airflow_delay_provider.triggers.asset); nothing was scheduled")
        raise InvalidInputError(f"unknown asset {asset_name!r}: no DAG declares it; define it with "
                                f"watched_asset({asset_name!r}) in the DAG scheduled on it{why(asset)}; nothing was "
                                "scheduled")
