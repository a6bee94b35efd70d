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

import asyncio
import base64
import json
import logging
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Hashable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome, SharedStreamProducer

from airflow_delay_provider.core.breakers import CircuitBreaker
from airflow_delay_provider.core.errors import CriticalError, InvalidInputError
from airflow_delay_provider.core.message import HEADER_FIRST_FAILED_AT, DelayedMessage, check_destination
from airflow_delay_provider.core.retry_policy import DeliveryPolicy, PolicyError
from airflow_delay_provider.hooks.delay_store import DEFAULT_CONN_ID, DelayStoreMixin
from airflow_delay_provider.stores.event_leases import EVENT_PREFIX, is_event_destination
from airflow_delay_provider.triggers.base import SerializedFields

log = logging.getLogger(__name__)

__all__ = [
    "DAG_RUN_ASSET_PREFIX", "EVENT_PREFIX", "DueMessageEventTrigger", "asset_destination", "dag_run_asset",
    "dag_run_asset_name", "event_payload", "message_payloads", "watched_asset",
]

#: A target DAG's asset is named `delayed_dag_run.<dag_id>` (see dag_run_asset).
DAG_RUN_ASSET_PREFIX = "delayed_dag_run."
#: The default delivery policy of an event destination: 3 retries, 20 s apart (SNS's HTTP default).
DEFAULT_POLICY = DeliveryPolicy()
_MAX_BACKOFF_SECONDS = 30.0
#: After a failed renewal of the event claim's lease.
_RENEW_RETRY_SECONDS = 1.0


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


def _decode_body(body: bytes) -> tuple[Any, str]:
    """A body as the event carries it: parsed JSON, else UTF-8 text, else base64."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return base64.b64encode(body).decode("ascii"), "base64"
    try:
        return json.loads(text), "json"
    except ValueError:
        return text, "text"


def event_payload(message: DelayedMessage) -> dict[str, Any]:
    """The payload of the event a due message becomes (natively JSON: Airflow stores it as is)."""
    body, encoding = _decode_body(message.body)
    return {"message_id": message.message_id, "destination": message.destination,
            "due_at": message.due_at.isoformat(), "headers": dict(message.headers), "body": body,
            "body_encoding": encoding, "attempt": message.failures + 1}


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise InvalidInputError(f"{name} must be a number of seconds in {low:g}..{high:g}, got {value!r}")
    return float(value)


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
        super().__init__(delay_store_conn_id=delay_store_conn_id, table=table, db_schema=db_schema, **kwargs)
        check_destination(destination)
        if not is_event_destination(destination):
            raise InvalidInputError(
                f"destination {destination!r} is not an event destination: its name must start with "
                f"{EVENT_PREFIX!r} (dispatchers leave those to asset watchers); use asset_destination(asset name)")
        if not delay_store_conn_id:
            raise InvalidInputError("delay_store_conn_id must name a `delay_store` connection")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 1000:
            raise InvalidInputError(f"batch_size must be an int in 1..1000, got {batch_size!r}")
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
                await producer.advance([AdvanceItem(message, AdvanceOutcome(acked=1, failed=0))])
        finally:
            await stream.aclose()
            await producer.aclose()


class DueMessageProducer(SharedStreamProducer):
    """Leases due messages of the trigger's destination, yields them, and settles them in `advance()`."""

    def __init__(self, trigger: DueMessageEventTrigger) -> None:
        self.trigger = trigger
        self.store: Any = None
        self.claim_id = "events-" + uuid.uuid4().hex[:24]
        self._claimed = False
        self._renewer: asyncio.Task | None = None
        self._policies: dict[str, DeliveryPolicy] = {}
        self.breaker = CircuitBreaker(f"settling the asset events of {trigger.destination}",
                                      trigger.time_to_trigger_store_circuit_breaker)
        self.counts = {"handed_over": 0, "acknowledged": 0, "retried": 0, "dead_lettered": 0, "released": 0,
                       "taken_over": 0}

    # -- the stream ---------------------------------------------------------------------------------
    async def _open(self) -> None:
        t = self.trigger
        self.store = await t.hook.aget_store()
        await asyncio.to_thread(self.store.create_schema)
        await asyncio.to_thread(self.store.open_event_claim, self.claim_id, t.destination, t.lease_seconds)
        self._claimed = True
        self._renewer = asyncio.create_task(self._renew(), name=f"lease renewal {self.claim_id}")
        log.info("handing over due messages of %s as asset events (claim %s, lease %.0f s)", t.destination,
                 self.claim_id, t.lease_seconds)

    async def open_stream(self) -> AsyncIterator[tuple[Any, Any]]:
        t = self.trigger
        backoff = 1.0
        while self.store is None or not self._claimed:
            try:
                await self._open()
            except CriticalError:
                raise
            except Exception as exc:  # the store is down or the connection is missing: keep trying
                log.warning("could not open the store for %s (%s); retrying in %.0f s", t.destination, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_SECONDS)
        last_event = -math.inf
        backoff = 1.0
        # Spaced events are leased one at a time, each when it may go: a message waiting for its turn stays
        # unleased, so it can still be cancelled or rescheduled.
        gated = t.run_dag_id is not None
        limit = 1 if gated or t.min_event_interval > 0 else t.batch_size
        while True:
            wait = last_event + t.min_event_interval - time.monotonic()
            if wait > 0 and not gated:
                await asyncio.sleep(wait)
            try:
                messages, taken_over = await asyncio.to_thread(
                    self.store.lease_events, self.claim_id, t.destination, limit)
            except CriticalError:
                raise
            except Exception as exc:
                log.warning("could not lease due messages of %s (%s); retrying in %.0f s", t.destination, exc,
                            backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_SECONDS)
                continue
            backoff = 1.0
            if taken_over:
                self.counts["taken_over"] += taken_over
                log.warning("took over %d message(s) of %s whose lease ran out (a triggerer that stopped before "
                            "they were acknowledged): handing them over again", taken_over, t.destination)
            for message in messages:
                runs_before = await self._run_count() if gated else None
                last_event = time.monotonic()
                self.counts["handed_over"] += 1
                yield event_payload(message), message
                if runs_before is not None:
                    await self._await_run(runs_before)
                elif gated:  # the run count cannot be read: space events instead
                    await asyncio.sleep(t.min_event_interval)
            if messages:
                continue
            await self._sleep()

    async def _sleep(self) -> None:
        """Until the next due time, a lease running out, or `poll_interval`; a sooner message wakes it."""
        t = self.trigger
        try:
            now = await asyncio.to_thread(self.store.clock)
            wake = [now + timedelta(seconds=t.poll_interval)]
            for moment in await asyncio.gather(asyncio.to_thread(self.store.next_event_due, t.destination),
                                               asyncio.to_thread(self.store.lease_expiry, t.destination)):
                if moment is not None:
                    wake.append(moment)
            if min(wake) <= now:  # due rows another producer's lease transaction holds this instant
                await asyncio.sleep(0.05)
                return
            await self.store.wait_async(min(wake))
        except CriticalError:
            raise
        except Exception as exc:
            log.warning("could not read the store for %s (%s)", t.destination, exc)
            await asyncio.sleep(1.0)

    async def _run_count(self) -> int | None:
        """How many runs the trigger's `run_dag_id` has (the triggerer's Execution API), or None where it
        cannot be asked (not in a triggerer, or the API failed)."""
        try:
            from airflow.sdk.execution_time import task_runner
            from airflow.sdk.execution_time.comms import GetDRCount

            comms = getattr(task_runner, "SUPERVISOR_COMMS", None)
            if comms is None:
                return None
            answer = await comms.asend(GetDRCount(dag_id=self.trigger.run_dag_id))
            count = getattr(answer, "count", None)
            return count if isinstance(count, int) else None
        except Exception as exc:  # noqa: BLE001 - spacing takes over
            log.warning("could not count the runs of %s (%s); spacing events by %s s instead", self.trigger.run_dag_id,
                        exc, self.trigger.min_event_interval)
            return None

    async def _await_run(self, before: int) -> None:
        """Until `run_dag_id` has more than `before` runs (the run for the event just handed over), or
        `run_timeout`: Airflow 3.3 gives an asset event recorded while a run is queued no run of its own."""
        t = self.trigger
        deadline = time.monotonic() + t.run_timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            count = await self._run_count()
            if count is None:
                await asyncio.sleep(t.min_event_interval)
                return
            if count > before:
                return
        log.warning("no new run of %s within %.0f s of handing a message over (paused, at max_active_runs, or "
                    "scheduled on more than this asset?); handing the next one over anyway", t.run_dag_id,
                    t.run_timeout)

    async def _renew(self) -> None:
        t = self.trigger
        wait = t.lease_seconds / 3
        while True:
            await asyncio.sleep(wait)
            try:
                if not await asyncio.to_thread(self.store.renew_lease, self.claim_id, t.lease_seconds):
                    log.error("the event claim %s of %s was ended elsewhere; its messages will be handed over again",
                              self.claim_id, t.destination)
                wait = t.lease_seconds / 3
            except Exception as exc:  # noqa: BLE001 - keep renewing: the lease still has two thirds left
                # Again soon, not a third later: an outage may meet that attempt too, and the lease would lapse.
                wait = min(t.lease_seconds / 3, _RENEW_RETRY_SECONDS)
                log.warning("could not renew the lease of %s (%s); trying again in %.0f s", self.claim_id, exc, wait)

    # -- settling -----------------------------------------------------------------------------------
    async def advance(self, batch: Sequence[AdvanceItem]) -> None:
        """Settle resolved events (see `settle`), riding store errors out: Airflow ends the whole stream when this
        raises, and the events it recorded would be handed over again. The same batch is settled again after
        each wait of the circuit breaker, without repeating what the store already took; meanwhile Airflow
        advances no other batch and the renewer keeps the lease. The breaker trips (CriticalError) when the
        errors last `time_to_trigger_store_circuit_breaker`."""
        settlement = _Settlement(batch)
        while True:
            try:
                await asyncio.to_thread(self._settle, settlement)
            except CriticalError:
                raise
            except Exception as exc:
                log.warning("could not settle %d event(s) of %s (%s); settling them again, none is handed over "
                            "again meanwhile", len(batch), self.trigger.destination, exc)
                # The breaker's wait blocks: in a thread, so that the event loop (the renewer) runs on.
                await asyncio.to_thread(self.breaker.failure, exc)
                continue
            self.breaker.success()
            return

    def settle(self, batch: Sequence[AdvanceItem]) -> None:
        """Settle resolved events once (a store error is raised): recorded ones are deleted; failed or rejected
        ones are retried by the delivery policy (dead-lettered after the last attempt); ones no subscriber took
        are released."""
        self._settle(_Settlement(batch))

    def _settle(self, s: _Settlement) -> None:
        """The steps of the settlement not done yet, each marked done as soon as the store took it."""
        if s.recorded:
            self.counts["acknowledged"] += self.store.ack_events(self.claim_id, s.recorded)
            s.recorded = []
        if s.released:
            self.counts["released"] += self.store.release_events(self.claim_id, s.released)
            s.released = []
        if s.failed:
            self._plan(s)
        if s.dead:
            self._dead_letter(s)
        if s.dead_lettered:
            self.counts["dead_lettered"] += self.store.ack_events(self.claim_id, s.dead_lettered)
            s.dead_lettered = []
        if s.retries:
            self.counts["retried"] += self.store.retry_events(self.claim_id, s.retries, s.headers)
            s.retries, s.headers = {}, {}

    def _policy(self, destination: str) -> DeliveryPolicy:
        if destination not in self._policies:
            policy = None
            if self.trigger.delivery_policy is not None:
                policy = DeliveryPolicy.parse(self.trigger.delivery_policy)
            else:
                stored = self.store.policies().get(destination)
                if stored is not None:
                    try:
                        policy = DeliveryPolicy.from_dict(stored)
                    except PolicyError as exc:
                        log.error("ignoring the stored delivery policy of %s: %s", destination, exc)
            self._policies[destination] = policy or DEFAULT_POLICY
        return self._policies[destination]

    def _plan(self, s: _Settlement) -> None:
        """Split the failed events into retries and messages to dead-letter, by their delivery policy."""
        now = self.store.clock()
        retries: dict[str, datetime] = {}
        headers: dict[str, dict[str, str]] = {}
        dead: list[DelayedMessage] = []
        for message, outcome in s.failed:
            attempts = message.failures + 1
            policy = self._policy(message.destination)
            if outcome.rejected or attempts > policy.num_retries:
                why = "rejected by a subscriber" if outcome.rejected else "the event was not recorded"
                failed_message = DelayedMessage.trusted(message.destination, message.body, message.due_at,
                                                        message.headers, message.message_id, attempts)
                dead.append(failed_message.dead_lettered(
                    self.trigger.error_queue, f"{why} (after {attempts} attempt(s))", now))
                continue
            rng = random.Random(f"{message.message_id}:{attempts}")
            delay = policy.jittered(policy.delay_before(attempts), 0.1, rng)
            retries[message.message_id] = now + timedelta(seconds=delay)
            if HEADER_FIRST_FAILED_AT not in message.headers:
                headers[message.message_id] = {**message.headers, HEADER_FIRST_FAILED_AT: now.isoformat()}
            log.warning("the event of message %s (%s) was not recorded; attempt %d, retrying at %s",
                        message.message_id, message.destination, attempts, retries[message.message_id].isoformat())
        s.failed, s.dead, s.retries, s.headers = [], dead, retries, headers

    def _dead_letter(self, s: _Settlement) -> None:
        """Send the settlement's dead messages to the error queue; those that could not go stay stored, due again
        at once (retried, never lost)."""
        t = self.trigger
        failures = self._send_to_error_queue(s.dead)
        now = self.store.clock()
        for m in s.dead:
            if m.message_id in failures:
                log.error("could not dead-letter %s to %s (%s); it stays stored", m.message_id, m.destination,
                          failures[m.message_id])
                s.retries[m.message_id] = now
            else:
                log.warning("message %s for %s dead-lettered to %s: %s", m.message_id, t.destination, m.destination,
                            m.headers.get("x-delay-failure-reason"))
                s.dead_lettered.append(m.message_id)
        s.dead = []

    def _send_to_error_queue(self, dead: list[DelayedMessage]) -> dict[str, Exception]:
        """The failures of sending `dead`; all of them when the transport cannot even be opened."""
        from airflow_delay_provider.hooks.transport import transport_hook

        t = self.trigger
        try:
            transport = transport_hook(t.transport, t.transport_conn_id, t.hook, t.db_schema).get_transport()
        except Exception as exc:  # noqa: BLE001 - kept stored and due again: retried, never lost
            return {m.message_id: exc for m in dead}
        try:
            return transport.send(dead)
        except Exception as exc:  # noqa: BLE001 - kept stored and due again: retried, never lost
            return {m.message_id: exc for m in dead}
        finally:
            try:
                transport.close()
            except Exception as exc:  # noqa: BLE001 - what was sent is sent: settle it as such
                log.warning("could not close the transport of %s: %s", t.error_queue, exc)

    async def aclose(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
        if self.store is None:
            return
        store, self.store = self.store, None
        try:
            if self._claimed:
                released = await asyncio.to_thread(store.close_event_claim, self.claim_id, dict(self.counts))
                if released:
                    log.info("released %d message(s) of %s not yet acknowledged: they are handed over again",
                             released, self.trigger.destination)
        finally:
            await store.aclose()


class _Settlement:
    """One advance() batch, settled in steps: each step's list is emptied once the store took it, so settling the
    batch again after a store error repeats no acknowledgement, release, retry nor dead-letter."""

    def __init__(self, batch: Sequence[AdvanceItem]) -> None:
        self.recorded: list[str] = []
        self.released: list[str] = []
        self.failed: list[tuple[DelayedMessage, AdvanceOutcome]] = []
        for item in batch:
            message, outcome = item.broker_payload, item.outcome
            if outcome.is_clean:
                self.recorded.append(message.message_id)
            elif outcome.failed or outcome.rejected:
                self.failed.append((message, outcome))
            else:
                self.released.append(message.message_id)  # nobody was subscribed: not an attempt
        # The failed ones, once planned (DueMessageProducer._plan):
        self.dead: list[DelayedMessage] = []
        self.dead_lettered: list[str] = []  # sent to the error queue, still to delete
        self.retries: dict[str, datetime] = {}
        self.headers: dict[str, dict[str, str]] = {}
