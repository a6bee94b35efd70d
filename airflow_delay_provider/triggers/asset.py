"""Delayed DAG runs: due messages of the store become asset events, and asset events start DAG runs.

`DueMessageEventTrigger` is a `BaseEventTrigger` for an `AssetWatcher`: it watches one event destination
of the store (`airflow.asset.<asset name>`) and fires one `TriggerEvent` per due message, whose payload
(id, destination, due time, headers, body) Airflow records as the asset event's
`extra["payload"]`; a DAG scheduled on the asset reads it from `triggering_asset_events`.

It runs in Airflow's shared-stream **ack mode** (`create_shared_stream_producer`,
airflow/triggers/shared_stream.py): the producer leases due messages (stores/event_leases.py) and yields
them; the triggerer persists each derived event to the metadata database (`Trigger.submit_event` ->
`AssetManager.register_asset_change`) and confirms it back on its next state sync; only then does
`advance()` delete the message. A triggerer that dies before that leaves the message leased: the lease
runs out and the next producer hands it over again (at least once; the id in the payload lets a DAG
de-duplicate). An event that could not be recorded (not confirmed within `[triggerer]
shared_stream_ack_timeout`) counts as a failed attempt: the message is retried by the destination's
delivery policy and dead-lettered to the error queue after the last one. A store outage while settling is
ridden out under a circuit breaker: Airflow awaits `advance()` before the next one, so nothing recorded is
handed over again while it retries.

`dag_run_asset(dag_id)` is the asset a target DAG schedules on so that `ScheduleDagRunOperator(dag_id=...)`
can find it; `watched_asset(name)` is any asset fed by the store.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from airflow_delay_provider.compat import require_shared_streams, shared_stream
from airflow_delay_provider.core.checks import check_int, check_number
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.message import check_destination
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.hooks.delay_store import DEFAULT_CONN_ID, DelayStoreMixin
from airflow_delay_provider.stores.event_leases import EVENT_PREFIX, is_event_destination
from airflow_delay_provider.triggers.base import SerializedFields
from airflow_delay_provider.triggers.event_producer import DueMessageProducer, event_payload

if TYPE_CHECKING:
    from airflow.triggers.shared_stream import SharedStreamProducer

log = logging.getLogger(__name__)

__all__ = [
    "DAG_RUN_ASSET_PREFIX", "EVENT_PREFIX", "DueMessageEventTrigger", "DueMessageProducer", "DueMessageQueueTrigger",
    "asset_destination", "dag_run_asset", "dag_run_asset_name", "event_payload", "message_payloads", "watched_asset",
]

#: A target DAG's asset is named `delayed_dag_run.<dag_id>` (see dag_run_asset).
DAG_RUN_ASSET_PREFIX = "delayed_dag_run."


def asset_destination(asset_name: str) -> str:
    """The store destination whose due messages become events of the asset `asset_name`."""
    if not isinstance(asset_name, str) or not asset_name.strip():
        raise InvalidInputError(f"an asset name must be a non-empty string, got {asset_name!r}")
    return check_destination(EVENT_PREFIX + asset_name)


def dag_run_asset_name(dag_id: str) -> str:
    """The name of the asset a target DAG of ScheduleDagRunOperator(dag_id=...) is scheduled on."""
    if not isinstance(dag_id, str) or not dag_id or any(c.isspace() for c in dag_id):
        raise InvalidInputError(f"dag_id must be a DAG id (no spaces), got {dag_id!r}")
    return DAG_RUN_ASSET_PREFIX + dag_id


def watched_asset(name: str, *, watcher_name: str | None = None, **trigger_kwargs: Any):
    """`Asset(name)` with an AssetWatcher whose DueMessageEventTrigger watches `airflow.asset.<name>`.

    :param trigger_kwargs: the trigger's other arguments (`delay_store_conn_id`, `lease_seconds`, ...).
    """
    from airflow.sdk import Asset, AssetWatcher

    trigger = DueMessageEventTrigger(destination=asset_destination(name), **trigger_kwargs)
    return Asset(name, watchers=[AssetWatcher(name=watcher_name or f"{name}.due_messages", trigger=trigger)])


def dag_run_asset(dag_id: str, **trigger_kwargs: Any):
    """The asset a DAG schedules on to be started later by `ScheduleDagRunOperator(dag_id=...)`:
    `delayed_dag_run.<dag_id>`, watched by a DueMessageEventTrigger on `airflow.asset.delayed_dag_run.<dag_id>`.

        with DAG("invoice_reminder", schedule=dag_run_asset("invoice_reminder"), ...):
    """
    return watched_asset(dag_run_asset_name(dag_id), **{"run_dag_id": dag_id, **trigger_kwargs})


def message_payloads(events: Iterable[Any]) -> list[dict[str, Any]]:
    """The message payloads of asset events (e.g. `triggering_asset_events[asset]`, or all of them with
    `itertools.chain(*triggering_asset_events.values())`), once per message id, in due-time order.

    Events that did not come from this trigger (a task's outlet, the REST API) are left out."""
    seen: dict[str, dict[str, Any]] = {}
    for event in events:
        extra = getattr(event, "extra", None)
        if extra is None and isinstance(event, Mapping):
            extra = event.get("extra")
        payload = (extra or {}).get("payload") if isinstance(extra, Mapping) else None
        if isinstance(payload, Mapping) and isinstance(payload.get("message_id"), str):
            seen.setdefault(payload["message_id"], dict(payload))
    return sorted(seen.values(), key=lambda p: (str(p.get("due_at")), p["message_id"]))


def _positive(name: str, value: Any, low: float, high: float) -> float:
    return float(check_number(name, value, low, high, what="a number of seconds"))


class DueMessageEventTrigger(DelayStoreMixin, SerializedFields, BaseEventTrigger):
    """Fire one event per due message of an event destination of the store (for an AssetWatcher).

    :param destination: the destination to watch; must start with `airflow.asset.` (pumps and sweeps leave
        those alone): `asset_destination(asset name)`.
    :param delay_store_conn_id: the `delay_store` connection (default `delay_store_default`); the trigger is
        created by the dag-processor from the DAG file, so it names connections, never secrets.
    :param table: the store's table, if not the connection's.
    :param db_schema: the store's PostgreSQL schema, if not the connection's.
    :param batch_size: messages leased at once when `min_event_interval` is 0 (1..1000, default 10); spaced
        events are leased one at a time, when each may go.
    :param lease_seconds: how long a leased message stays reserved without the producer renewing the lease
        (renewed every third of it while the triggerer lives); after a triggerer crash, its messages are handed
        over again this long after its last renewal (5..3600, default 60).
    :param min_event_interval: seconds between two events of this destination without `run_dag_id` (0..60,
        default 2). Airflow 3.3 queues one DAG run per asset at a time: an event recorded while the asset
        already has a queued run waits for a later event (see docs/how-it-works/dag-runs.md); spacing events
        by more than a scheduler loop gives each its own run.
    :param poll_interval: longest sleep without a wake-up (seconds, default 30; PostgreSQL's LISTEN/NOTIFY
        wakes the trigger when a sooner message is stored, SQLite is re-read every half second).
    :param delivery_policy: the retry policy for events that could not be recorded, a dict or a built-in name;
        default: the policy stored for the destination, else 3 retries 20 s apart.
    :param error_queue: where a message goes after its last attempt (default `error`).
    :param transport: the transport of the error queue (default `sql`: a table in the store's database).
    :param transport_conn_id: that transport's connection, if not its default.
    :param run_dag_id: the DAG scheduled on the asset (dag_run_asset sets it): the next message is handed over
        only once this DAG has a new run for the previous one (asked through the triggerer's Execution API,
        `GetDRCount`), so each message gets a run of its own however slow the scheduler is, and messages stay
        in the store while the DAG is at `max_active_runs`; `min_event_interval` is then not used.
    :param run_timeout: how long (s) to wait for that run before handing the next message over anyway
        (default 300).
    :param time_to_trigger_store_circuit_breaker: how long (s) settling handed-over events may keep failing
        (the store unreachable) before the stream stops with an error (default 300; 1..86400). Until then the
        same events are settled again every second; stopping hands the unsettled ones over again, once the
        lease runs out.
    """

    serialized_fields = ("destination", "delay_store_conn_id", "table", "db_schema", "batch_size", "lease_seconds",
                         "min_event_interval", "poll_interval", "delivery_policy", "error_queue", "transport",
                         "transport_conn_id", "run_dag_id", "run_timeout", "time_to_trigger_store_circuit_breaker")

    def __init__(
        self,
        *,
        destination: str,
        delay_store_conn_id: str = DEFAULT_CONN_ID,
        table: str | None = None,
        db_schema: str | None = None,
        batch_size: int = 10,
        lease_seconds: float = 60.0,
        min_event_interval: float = 2.0,
        poll_interval: float = 30.0,
        delivery_policy: dict | str | None = None,
        error_queue: str = "error",
        transport: str = "sql",
        transport_conn_id: str | None = None,
        run_dag_id: str | None = None,
        run_timeout: float = 300.0,
        time_to_trigger_store_circuit_breaker: float = 300.0,
        **kwargs: Any,
    ) -> None:
        require_shared_streams("DueMessageEventTrigger (delayed DAG runs, asset watchers fed by the store)")
        super().__init__(delay_store_conn_id=delay_store_conn_id, table=table, db_schema=db_schema, **kwargs)
        check_destination(destination)
        if not is_event_destination(destination):
            raise InvalidInputError(
                f"destination {destination!r} is not an event destination: its name must start with "
                f"{EVENT_PREFIX!r} (dispatchers leave those to asset watchers); use asset_destination(asset name)")
        if not delay_store_conn_id:
            raise InvalidInputError("delay_store_conn_id must name a `delay_store` connection")
        check_int("batch_size", batch_size, 1, 1000)
        self.destination = destination
        self.batch_size = batch_size
        self.lease_seconds = _positive("lease_seconds", lease_seconds, 5, 3600)
        self.min_event_interval = _positive("min_event_interval", min_event_interval, 0, 60)
        self.poll_interval = _positive("poll_interval", poll_interval, 0.1, 3600)
        if isinstance(delivery_policy, DeliveryPolicy):
            delivery_policy = delivery_policy.to_dict()
        if delivery_policy is not None:
            DeliveryPolicy.parse(delivery_policy)  # a bad policy fails the DAG import
        self.delivery_policy = delivery_policy
        check_destination(error_queue)
        self.error_queue = error_queue
        from airflow_delay_provider.hooks.transport import check_transport

        self.transport = check_transport(transport)
        self.transport_conn_id = transport_conn_id
        if run_dag_id is not None and (not isinstance(run_dag_id, str) or not run_dag_id.strip()):
            raise InvalidInputError(f"run_dag_id must be a DAG id or None, got {run_dag_id!r}")
        self.run_dag_id = run_dag_id
        self.run_timeout = _positive("run_timeout", run_timeout, 1, 86_400)
        self.time_to_trigger_store_circuit_breaker = _positive(
            "time_to_trigger_store_circuit_breaker", time_to_trigger_store_circuit_breaker, 1, 86_400)

    # -- ack mode -----------------------------------------------------------------------------------
    def shared_stream_key(self) -> Hashable | None:
        """Watchers of one destination of one store share one producer (each gets every event)."""
        return ("airflow_delay_provider.due_messages", self.delay_store_conn_id, self.table or "",
                self.db_schema or "", self.destination)

    @classmethod
    def create_shared_stream_producer(cls, kwargs: dict[str, Any]) -> SharedStreamProducer:
        return DueMessageProducer(cls(**kwargs))

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        async for payload in shared_stream:
            yield TriggerEvent(payload)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Without shared streams (a runner that does not call shared_stream_key): the same producer, each
        message acknowledged when the runner takes its event, before the runner has persisted it, so a crash
        in between loses that event. Airflow 3.3's triggerer always runs this trigger in ack mode."""
        producer = DueMessageProducer(self)
        stream = producer.open_stream()
        try:
            async for payload, message in stream:
                yield TriggerEvent(payload)
                acked = shared_stream.AdvanceOutcome(acked=1, failed=0)
                await producer.advance([shared_stream.AdvanceItem(message, acked)])
        finally:
            await stream.aclose()
            await producer.aclose()


class DueMessageQueueTrigger(DueMessageEventTrigger):
    """DueMessageEventTrigger as the `delay` scheme of Airflow's common `MessageQueueTrigger` builds it
    (airflow_delay_provider.queues.delay): the same trigger, whose `destination` may also be an asset's name
    (`order_timeout` watches `airflow.asset.order_timeout`, where `ScheduleDagRunOperator(asset="order_timeout")`
    and `asset_destination("order_timeout")` send). Its other arguments are DueMessageEventTrigger's.

        Asset("order_timeout", watchers=[AssetWatcher(
            name="order_timeout.due", trigger=MessageQueueTrigger(scheme="delay", destination="order_timeout"))])
    """

    def __init__(self, *, destination: str, **kwargs: Any) -> None:
        if isinstance(destination, str) and destination and not is_event_destination(destination):
            destination = asset_destination(destination)
        super().__init__(destination=destination, **kwargs)
