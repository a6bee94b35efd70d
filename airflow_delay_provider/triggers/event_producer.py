"""The producer behind DueMessageEventTrigger: leases due messages of one event destination, yields them as
event payloads, and settles them once the triggerer has recorded (or failed to record) their events.

Each advance() batch is settled in steps (acknowledged, released, retried or dead-lettered by the
destination's delivery policy, see core.settlement), each step marked done as soon as the store took it,
so settling a batch again after a store error repeats nothing. A store outage while settling is ridden
out under a circuit breaker; the event claim's lease is renewed every third of its length meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from airflow_delay_provider.compat import shared_stream
from airflow_delay_provider.core.breakers import CircuitBreaker
from airflow_delay_provider.core.errors import CriticalError, StoreNotReadyError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.retry_policy import DeliveryPolicy, PolicyError
from airflow_delay_provider.core.settlement import FailedBatch, Retry, settle_failure

if TYPE_CHECKING:
    from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome

    from airflow_delay_provider.triggers.asset import DueMessageEventTrigger

log = logging.getLogger(__name__)

#: The default delivery policy of an event destination: 3 retries, 20 s apart (SNS's HTTP default).
DEFAULT_POLICY = DeliveryPolicy()
#: The fraction of a retry's backoff that is randomised, so events failed together are not retried together.
RETRY_JITTER = 0.1
_MAX_BACKOFF_SECONDS = 30.0
#: After a failed renewal of the event claim's lease.
_RENEW_RETRY_SECONDS = 1.0


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


# Airflow 3.2 has no shared streams: the producer is never built there (DueMessageEventTrigger refuses to be).
_Producer: Any = shared_stream.SharedStreamProducer if shared_stream else object


class DueMessageProducer(_Producer):
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
        # Created or upgraded only where the connection's auto_migrate allows it; otherwise StoreNotReadyError.
        await asyncio.to_thread(t.hook.prepare_for_writes, self.store)
        if t.run_dag_id is not None:
            # Asked once before the claim opens (after it, messages are handed over): the first request builds the
            # triggerer's in-process API, 8-12 s of imports on a loaded machine, which otherwise held up the first
            # due message's run.
            await self._run_count()
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
            except StoreNotReadyError as exc:  # not provisioned yet: said once a minute, no failure of the store
                await asyncio.to_thread(self.breaker.not_ready, exc)
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
            self.counts["dead_lettered"] += self.store.ack_events(
                self.claim_id, s.dead_lettered, failures={m: s.why.get(m, "") for m in s.dead_lettered})
            s.dead_lettered = []
        if s.retries:
            self.counts["retried"] += self.store.retry_events(
                self.claim_id, s.retries, s.headers, failures={m: s.why.get(m, "") for m in s.retries})
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
        failed = FailedBatch()
        for message, outcome in s.failed:
            why = "rejected by a subscriber" if outcome.rejected else "the event was not recorded"
            settled = settle_failure(message, why, self._policy(message.destination), self.trigger.error_queue, now,
                                     RETRY_JITTER, final=outcome.rejected)
            failed.add(message.message_id, settled)
            s.why[message.message_id] = why
            if isinstance(settled, Retry):
                log.warning("the event of message %s (%s) was not recorded; attempt %d, retrying at %s",
                            message.message_id, message.destination, message.failures + 1, settled.at.isoformat())
        s.failed, s.dead, s.retries, s.headers = [], failed.dead, failed.retries, failed.headers

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
                s.why[m.message_id] = f"could not dead-letter it: {failures[m.message_id]}"
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
        self.why: dict[str, str] = {}  # each failed message's failure, for the delivery history
