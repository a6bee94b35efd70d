"""The dispatch pump (the external store's poller, in batches): claim due messages, send them, remove them.

A batch is claimed inside one store transaction. Delivered messages are removed in that same
transaction, so a crash anywhere releases the claim and the batch is dispatched again (at least
once); when the transport writes into the store's own database it joins the transaction and the
dispatch is exactly once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

from airflow_delay_provider.core.breakers import CircuitBreaker, RateBreaker
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import CriticalError, StoreNotReadyError, UnavailableError
from airflow_delay_provider.core.history import settled_groups
from airflow_delay_provider.core.message import HEADER_FAILED_DESTINATION, DelayedMessage
from airflow_delay_provider.core.ports import Claim, DelayedMessageStore, Transport
from airflow_delay_provider.core.progress import ProgressReport
from airflow_delay_provider.core.pump_config import END_OF_TIME, PumpConfig, PumpResult
from airflow_delay_provider.core.pump_policies import DestinationPolicies
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.core.settlement import sort_outcomes
from airflow_delay_provider.core.stats import PumpStats, moved_stats

log = logging.getLogger(__name__)

#: While the only due rows are held elsewhere, the pump looks again after this long, doubling each time.
MIN_HELD_BACKOFF_SECONDS = 0.005
MAX_HELD_BACKOFF_SECONDS = 1.0
#: How long after a wake the pump starts no upkeep while it finds work (seconds), at most; see `Pump._run`.
QUIET_AFTER_WAKE_SECONDS = 5.0
#: How long before a due time it sleeps until the pump runs the wake's first batch once (seconds); see `_rehearse`.
REHEARSAL_SECONDS = 0.1


@dataclass
class _InFlight:
    """A claimed batch whose sends have started: `wait` returns the failures, `stack` ends the claim."""

    stack: ExitStack
    claim: Claim
    messages: list[DelayedMessage]  # those sent; the claim's others were held back by a throttle
    wait: Callable[[], dict[str, Exception]]


class _Failed(Enum):
    """What _begin gives when the store failed: an Enum member, so `is _FAILED` narrows the type."""

    FAILED = "failed"


_FAILED = _Failed.FAILED


def _release(stack: ExitStack, exc: BaseException) -> None:
    """End a claim with an error: rolled back, its rows stay stored. The store may report the failure again in its
    own words (a lost connection, translated as it unwinds): the same failure, which the caller handles, not a new
    one to stop the pump for."""
    try:
        stack.__exit__(type(exc), exc, exc.__traceback__)
    except Exception as again:
        if again is not exc:
            log.debug("releasing the claim after %s: %s", type(exc).__name__, again)


def _outage(messages: list[DelayedMessage], exc: Exception) -> dict[str, Exception]:
    """A whole batch failed: an outage, whatever the exception says; no message is to blame."""
    outage = exc if isinstance(exc, UnavailableError) else UnavailableError(f"{type(exc).__name__}: {exc}")
    return {m.message_id: outage for m in messages}


class Pump:
    """Claims due messages from a store in batches and sends them through a transport, until told to stop (`run`).

    Per-destination policies and throttles are `by_destination` (core/pump_policies.py); the progress line is
    `progress` (core/progress.py); a failed delivery is settled by core/settlement.py."""

    def __init__(
        self,
        store: DelayedMessageStore,
        transport: Transport,
        config: PumpConfig | None = None,
        policy: DeliveryPolicy | None = None,
        policies: Mapping[str, DeliveryPolicy] | None = None,
        clock: Callable[[], datetime] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        throttle_share: float = 1.0,
    ) -> None:
        self.store = store
        self.transport = transport
        self.config = config or PumpConfig()
        self._clock = clock or store.clock  # due times are compared on the store's clock
        # The flat number_of_retries is the shorthand for that many immediate retries. Several pumps splitting one
        # destination's rate (a sweep's partitions) each take a share, where the store cannot keep one bucket for
        # all of them (SQLite); on PostgreSQL they share its bucket.
        self.by_destination = DestinationPolicies(
            store, policy or DeliveryPolicy.immediate(self.config.number_of_retries), policies or {}, self._clock,
            throttle_share)
        self._stopping = threading.Event()
        transport.use_clock(self._clock)  # and a native delay (a retry's, a sweep's) counts from it too
        self.exactly_once = transport.joins(store)
        c = self.config
        self.fetch_breaker = CircuitBreaker("fetching due messages", c.time_to_trigger_fetch_circuit_breaker,
                                            sleep=sleep)
        self.dispatch_breaker = CircuitBreaker("dispatching", c.time_to_trigger_dispatch_circuit_breaker, sleep=sleep)
        self.recovery_breaker = RateBreaker("handling failed dispatches", c.maximum_recovery_failures_per_second)
        # Two claims open at once need a store that allows it and a transport that can wait later.
        self.pipelined = transport.pipelined and store.concurrent_claims and not self.exactly_once
        # Pipelined on a store that allows it, the next batch is claimed in a worker thread while the batch in
        # flight is confirmed: the database's time and the broker's overlap (run() starts the thread).
        self.claims_ahead = self.pipelined and store.threaded_claims
        self._claimer: ThreadPoolExecutor | None = None
        self._ahead: Future[tuple[ExitStack, Claim]] | None = None
        # Set by run(): the transport moves due messages inside the store's database itself (see _move).
        self._moves = False
        self._exclusions: set[str] | None = None
        self._inflight: _InFlight | None = None
        self.progress = ProgressReport(store, self._clock)

    def from_host_time(self, moment: datetime) -> datetime:
        """A time on this host's clock (a task's deadline) as a time on the pump's (the store's) clock."""
        return moment + (self._clock() - utcnow())

    def policy_for(self, destination: str) -> DeliveryPolicy:
        """The task's policy for the destination, else the one stored for it, else the task's default."""
        return self.by_destination.policy_for(destination)

    def move_exclusions(self) -> set[str] | None:
        """The destinations a transport's move must leave to claims (core/pump_policies.py)."""
        return self.by_destination.move_exclusions()

    # -- one batch -------------------------------------------------------------------------
    def dispatch_batch(self, limit: int | None = None, due_before: datetime | None = None) -> PumpStats | None:
        """Claim, send and settle one batch. Returns its counts (batches == 0 when nothing was due),
        or None when the store failed and the batch was released (the fetch breaker counts it)."""
        inflight = self._begin(limit or self.config.batch_size, due_before)
        if inflight is None:
            return PumpStats()
        if inflight is _FAILED:
            return None
        return self._finish(inflight)

    def _claim(self, limit: int, due_before: datetime | None, exclude: set[str]) -> tuple[ExitStack, Claim]:
        """Enter a claim of up to `limit` due messages; its stack ends it (commit, or rollback on an error)."""
        stack = ExitStack()
        try:
            return stack, stack.enter_context(self.store.claim_due(self._clock(), limit, due_before, exclude))
        except BaseException as exc:
            stack.__exit__(type(exc), exc, exc.__traceback__)
            raise

    def _claim_ahead(self, due_before: datetime | None) -> None:
        """Start claiming the next full batch in the worker thread (see `claims_ahead`)."""
        if self._claimer is not None and self._ahead is None:
            self._ahead = self._claimer.submit(self._claim, self.config.batch_size, due_before,
                                               self.by_destination.throttled_out())

    def _release_ahead(self) -> None:
        """Hand back a batch claimed ahead and not sent: rolled back, its rows stay stored untouched."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.exception() is not None:
            return
        stack, _ = ahead.result()
        stack.__exit__(CriticalError, CriticalError("a batch claimed ahead was not sent"), None)

    def _begin(self, limit: int, due_before: datetime | None) -> _InFlight | _Failed | None:
        """Claim a batch (or take the one claimed ahead) and start sending it. None: nothing due; _FAILED: the
        store failed."""
        self.dispatch_breaker.attempt()
        stack = ExitStack()
        try:
            self.store.check_ready()  # cheap once provisioned
            self.transport.check_ready()
            ahead, self._ahead = self._ahead, None
            if ahead is not None:
                stack, claim = ahead.result()
            else:
                stack, claim = self._claim(limit, due_before, self.by_destination.throttled_out())
            if not claim.messages:
                stack.close()
                self.fetch_breaker.success()
                # Nothing to send now: no outage to measure. A retry that fails after the pump waited for it arms
                # the dispatch breaker afresh, instead of counting the wait as failing time.
                self.dispatch_breaker.success()
                return None
            sending = self.by_destination.within_throttle(claim.messages)
            connection = claim.connection if self.exactly_once else None
            return _InFlight(stack, claim, sending, self._start_send(sending, connection))
        except BaseException as exc:
            _release(stack, exc)  # the rows stay stored
            if isinstance(exc, CriticalError) or not isinstance(exc, Exception):
                raise
            if isinstance(exc, StoreNotReadyError):  # before provisioning: a wait, no failure of the store
                self.fetch_breaker.not_ready(exc)
                return _FAILED
            log.warning("could not claim a batch, nothing was taken: %s", exc)
            self.fetch_breaker.failure(exc)
            return _FAILED

    def _finish(self, inflight: _InFlight) -> PumpStats | None:
        """Wait for the batch's sends, settle every message, commit. None: the store failed."""
        stats = PumpStats(batches=1)
        try:
            transient = self._settle(inflight.claim, inflight.messages, stats, inflight.wait())
        except BaseException as exc:
            _release(inflight.stack, exc)
            if isinstance(exc, CriticalError) or not isinstance(exc, Exception):
                raise
            log.warning("batch released, its messages stay stored and are claimed again: %s", exc)
            self.fetch_breaker.failure(exc)
            return None
        try:
            inflight.stack.close()  # commits the claim
        except CriticalError:
            raise
        except Exception as exc:
            log.warning("batch released, its messages stay stored and are claimed again: %s", exc)
            self.fetch_breaker.failure(exc)
            return None
        self.fetch_breaker.success()
        # The breaker measures an outage: a batch that delivered anything is progress, whatever else failed (the
        # policy's retries and the error queue deal with those); one that delivered nothing and failed counts.
        if transient is not None and not stats.dispatched:
            self.dispatch_breaker.failure(transient)
        else:
            self.dispatch_breaker.success()
        return stats

    def _start_send(self, messages: list[DelayedMessage], connection: Any) -> Callable[[], dict[str, Exception]]:
        """Start sending; the returned function gives the failures. A batch that fails as a whole,
        when started or while waited for, counts as an outage for each of its messages."""
        if not messages:
            return dict
        try:
            wait = self.transport.send_start(messages, connection=connection)
        except CriticalError:
            raise
        except Exception as exc:
            failures = _outage(messages, exc)
            return lambda: failures

        def outcome() -> dict[str, Exception]:
            try:
                return wait()
            except CriticalError:
                raise
            except Exception as exc:
                return _outage(messages, exc)

        return outcome

    def _settle(self, claim: Claim, messages: list[DelayedMessage], stats: PumpStats,
                failures: dict[str, Exception]) -> Exception | None:
        conn = claim.connection if self.exactly_once else None
        sent_at = self._clock()
        removed, failed, transient = sort_outcomes(messages, failures, sent_at, stats, self.policy_for,
                                                   self.config.error_queue, self.config.retry_jitter)
        delivered, dead_lettered = list(removed), {}
        if failed.dead:
            dead_failures = self._start_send(failed.dead, conn)()
            for d in failed.dead:
                error = dead_failures.get(d.message_id)
                if error is None:
                    removed.append(d.message_id)
                    dead_lettered[d.message_id] = failed.reasons.get(d.message_id, "")
                    stats.dead_lettered += 1
                    stats.count(d.headers.get(HEADER_FAILED_DESTINATION, d.destination), "dead_lettered")
                    log.warning("message %s for %s dead-lettered to %s: %s", d.message_id,
                                d.headers.get("x-delay-failed-destination"), d.destination,
                                d.headers.get("x-delay-failure-reason"))
                else:
                    # Keep it stored and due again: losing it is worse than retrying the dead-letter.
                    failed.retries[d.message_id] = sent_at
                    failed.reasons[d.message_id] = f"could not dead-letter to {d.destination}: {error}"
                    self.recovery_breaker.failure(f"could not dead-letter {d.message_id} to {d.destination}: {error}")
        claim.remove(removed)
        if failed.retries:
            claim.retry(failed.retries, failed.headers)
        claim.record(sent_at, settled_groups(delivered, {m: failed.reasons.get(m, "") for m in failed.retries},
                                             dead_lettered))
        stats.retried += len(failed.retries)
        return transient

    # -- the loop ---------------------------------------------------------------------------
    def run(
        self,
        deadline: datetime | None = None,
        max_messages: int | None = None,
        due_before: datetime | None = None,
        max_wait: float | None = None,
        stop_when_idle: bool = False,
        woken: bool = False,
    ) -> PumpResult:
        """Dispatch until the deadline, `max_messages`, or nothing is left before `due_before`.

        While nothing is due it sleeps until the next due time, but only when that is at most
        `max_wait` seconds away (None: any wait up to the deadline); otherwise it returns `idle`
        with the next due time, so a caller can defer instead of holding a worker. `woken`: the caller
        has just waited for a due time itself (a trigger, on its event loop), so the run starts as the
        pump does after its own waits: a small first batch, and no upkeep until the burst is handled.
        """
        stats = PumpStats()
        self._exclusions = self.move_exclusions()
        self._moves = self.exactly_once and self._exclusions is not None and self.transport.moves_from(self.store)
        if self.claims_ahead and not self._moves:
            self._claimer = ThreadPoolExecutor(1, thread_name_prefix="pump-claim")
        try:
            return self._run(stats, deadline, max_messages, due_before, max_wait, stop_when_idle, woken)
        finally:
            self._release_ahead()
            if self._claimer is not None:
                self._claimer.shutdown()
                self._claimer = None
            if self._inflight is not None:  # stopped by an error: release the batch still in flight
                inflight, self._inflight = self._inflight, None
                error = CriticalError("the pump stopped with a batch in flight")
                _release(inflight.stack, error)

    def stop(self) -> None:
        """Ask a `run()` in another thread to return (`stopped`) after settling the batch in hand, as a
        cancelled trigger does: no message is claimed after the call returns to its next batch. One call
        stops the pump for good."""
        self._stopping.set()

    def _step(self, limit: int, due_before: datetime | None, claim_ahead: bool = False) -> PumpStats | None:
        """One batch; when pipelining, claim and start the next batch before settling the previous one,
        so the broker confirms one batch while the store hands out the next; with `claim_ahead`, the batch
        after that is claimed in the worker thread meanwhile."""
        if self._moves:
            moved = self._move(limit, due_before)
            if moved is None or moved.dispatched >= limit:
                return moved
            # What the move left (other destinations, throttled ones) goes the usual way, claimed and settled.
            rest = self.dispatch_batch(limit - moved.dispatched, due_before)
            if rest is not None:
                moved.merge(rest)
            return moved
        if not self.pipelined:
            return self.dispatch_batch(limit, due_before)
        upcoming = self._begin(limit, due_before)
        previous, self._inflight = self._inflight, upcoming if isinstance(upcoming, _InFlight) else None
        if previous is None:
            return None if upcoming is _FAILED else PumpStats()
        if self._inflight is not None and claim_ahead:
            self._claim_ahead(due_before)
        return self._finish(previous)

    def _move(self, limit: int, due_before: datetime | None) -> PumpStats | None:
        """The exactly-once path when the destination queues are tables of the store's own database: the
        transport moves the due rows in one statement, so none passes through here (nothing can fail per
        message but a missing queue, whose rows it leaves for a claim to dead-letter). Throttled
        destinations are left to claims too. None: the store failed."""
        try:
            self.store.check_ready()  # cheap once provisioned
            self.transport.check_ready()
            moved = self.transport.move_due(self.store, self._clock(), limit, due_before, self._exclusions or ())
        except CriticalError:
            raise
        except StoreNotReadyError as exc:  # before provisioning: a wait, no failure of the store
            self.fetch_breaker.not_ready(exc)
            return None
        except Exception as exc:
            log.warning("could not move a batch, nothing was taken: %s", exc)
            self.fetch_breaker.failure(exc)
            return None
        self.fetch_breaker.success()
        return moved_stats(moved, self._clock())

    def _run(
        self,
        stats: PumpStats,
        deadline: datetime | None,
        max_messages: int | None,
        due_before: datetime | None,
        max_wait: float | None,
        stop_when_idle: bool,
        woken: bool,
    ) -> PumpResult:
        started = time.monotonic()
        last_report = started
        held_backoff = MIN_HELD_BACKOFF_SECONDS
        first = min(self.config.first_batch_size, self.config.batch_size)
        # A pump starts on a backlog in full batches; after sleeping, a burst falls due and its head goes first.
        ramp = first if woken else self.config.batch_size
        # From a wake until the work found there is done (or QUIET_AFTER_WAKE_SECONDS), no upkeep starts: a pump
        # woken at a due time found every background pass overdue at once (the store's move of `_later` and its
        # look, its tables' and the queues' checks), and their threads took the GIL and the CPU from the burst's
        # first claims. They start before the pump sleeps instead, and run while it does.
        quiet_until = time.monotonic() + QUIET_AFTER_WAKE_SECONDS if woken else -math.inf
        while True:
            if time.monotonic() >= quiet_until:
                self._upkeep()
            now = self._clock()
            in_flight = len(self._inflight.messages) if self._inflight else 0
            if deadline is not None and now >= deadline:
                self._settle_inflight(stats)
                return PumpResult(stats, "deadline", self._next_due(due_before))
            if self._stopping.is_set():
                self._settle_inflight(stats)
                return PumpResult(stats, "stopped", self._next_due(due_before))
            handled = stats.dispatched + stats.dead_lettered + in_flight
            if max_messages is not None and handled >= max_messages:
                self._settle_inflight(stats)
                return PumpResult(stats, "max_messages", self._next_due(due_before))
            limit = ramp if max_messages is None else min(ramp, max_messages - handled)
            # Claimed ahead only on a backlog in full batches, with no message count to stop at.
            batch = self._step(limit, due_before, max_messages is None and limit == self.config.batch_size)
            if batch is None:  # the store failed; the fetch breaker has waited
                continue
            stats.merge(batch)
            ramp = min(2 * ramp, self.config.batch_size)
            if time.monotonic() - last_report >= self.config.progress_interval_seconds:
                last_report = time.monotonic()
                self.progress.report(stats, started, due_before)
            if batch.batches or self._inflight is not None:
                held_backoff = MIN_HELD_BACKOFF_SECONDS
                continue
            if time.monotonic() < quiet_until:  # what the wake found is done
                quiet_until = -math.inf
                self._upkeep()
            try:
                next_due = self.store.next_due(due_before=due_before)
            except CriticalError:
                raise
            except Exception as exc:
                self.fetch_breaker.failure(exc)
                continue
            if next_due is None and (due_before is not None or stop_when_idle):
                return PumpResult(stats, "drained")
            if stop_when_idle:
                return PumpResult(stats, "idle", next_due)
            now = self._clock()
            if next_due is not None and next_due <= now:
                # Due rows exist but are held elsewhere (another pump's claim, a sweep's lease, a
                # throttle): look again soon, backing off while they stay held, without spinning.
                self.store.wait(now + timedelta(seconds=held_backoff))
                held_backoff = min(held_backoff * 2, MAX_HELD_BACKOFF_SECONDS)
                ramp, quiet_until = first, time.monotonic() + QUIET_AFTER_WAKE_SECONDS
                continue
            held_backoff = MIN_HELD_BACKOFF_SECONDS
            target = now + timedelta(seconds=self.config.max_idle_seconds)
            if next_due is not None:
                if max_wait is not None and (next_due - now).total_seconds() > max_wait:
                    return PumpResult(stats, "idle", next_due)
                target = min(target, next_due)
            elif max_wait is not None:
                return PumpResult(stats, "idle", None)
            if deadline is not None:
                target = min(target, deadline)
            if target != next_due or not self._rehearse(stats, target, due_before, first):
                self.store.wait(target)
            ramp, quiet_until = first, time.monotonic() + QUIET_AFTER_WAKE_SECONDS

    def _rehearse(self, stats: PumpStats, due: datetime, due_before: datetime | None, limit: int) -> bool:
        """Wake REHEARSAL_SECONDS before a due time and run the wake's first batch once, which finds nothing due yet
        (or what fell due meanwhile, which it takes): at the due time the claim is then a prepared statement on a
        connection just used, its scan's start just read (`ready_for`). The first claim of a burst after a sleep
        parsed and planned its statement on a connection that had not run it, a millisecond or two of the first
        message's lateness. Returns whether the pump is to go on without waiting (woken early, or work found)."""
        lead = timedelta(seconds=REHEARSAL_SECONDS)
        if due - self._clock() < 2 * lead:
            return False
        self.store.wait(due - lead)
        if self._clock() < due - lead or self._stopping.is_set():
            return True  # woken by a message due sooner: the loop reads the next due time again
        self.ready_for(due)
        batch = self._step(limit, due_before)
        if batch is not None:
            stats.merge(batch)
        if batch is None or batch.batches or self._inflight is not None:
            return True
        self.store.wait(due)
        return True

    def ready_for(self, due: datetime) -> None:
        """Read where the claims at `due` start (`DelayedMessageStore.ready_for`), for a caller about to run the
        pump then; a failure only leaves it to the claim at the due time."""
        try:
            self.store.ready_for(due)
        except Exception as exc:
            log.debug("could not read ahead of the due time: %s", exc)

    def _upkeep(self) -> None:
        self.store.upkeep()
        self.transport.upkeep()

    def _settle_inflight(self, stats: PumpStats) -> None:
        self._release_ahead()
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            done = self._finish(inflight)
            if done is not None:
                stats.merge(done)

    def _next_due(self, due_before: datetime | None) -> datetime | None:
        """The next due time for a result, where a store failure only means it is unknown."""
        try:
            return self.store.next_due(due_before=due_before)
        except Exception as exc:
            log.warning("could not read the next due time: %s", exc)
            return None


__all__ = ["END_OF_TIME", "Pump", "PumpConfig", "PumpResult", "moved_stats"]  # the names others import from here
