"""The pump over the in-memory fakes: no database or broker, the same rules as on the real ones."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import CriticalError, UnavailableError
from airflow_delay_provider.core.message import HEADER_FAILURES, DelayedMessage
from airflow_delay_provider.core.pump import REHEARSAL_SECONDS, Pump, PumpConfig
from airflow_delay_provider.testing import InMemoryStore, InMemoryTransport


class Flaky(InMemoryTransport):
    """Refuses each message's first `times` sends to `orders` (a delivery failure), or is down altogether."""

    def __init__(self, times: int = 0, down: bool = False) -> None:
        super().__init__()
        self.times, self.down, self.sends = times, down, {}

    def send(self, messages, connection=None):
        if self.down:
            raise UnavailableError("the broker is down")
        refused = {}
        for m in messages:
            if m.destination != "orders":
                continue
            self.sends[m.message_id] = self.sends.get(m.message_id, 0) + 1
            if self.sends[m.message_id] <= self.times:
                refused[m.message_id] = RuntimeError("503 from the endpoint")
        sent = super().send([m for m in messages if m.message_id not in refused])
        return {**refused, **sent}


def setup(transport: InMemoryTransport, n: int = 50, destination: str = "orders",
          store: InMemoryStore | None = None) -> InMemoryStore:
    store = store or InMemoryStore()
    for queue in ("orders", "error"):
        transport.provision(queue)
    store.store([DelayedMessage(destination, b"x", utcnow() - timedelta(seconds=1), message_id=f"m-{i}")
                 for i in range(n)])
    return store


def received(transport: InMemoryTransport, queue: str) -> list:
    return transport.receive(queue, max_messages=10_000)


def test_each_due_message_is_delivered_once_and_leaves_the_store():
    transport = InMemoryTransport()
    store = setup(transport, 500)
    result = Pump(store, transport, PumpConfig(batch_size=64)).run(stop_when_idle=True)
    assert result.reason == "drained" and result.stats.dispatched == 500
    assert sorted(m.message_id for m in received(transport, "orders")) == sorted(f"m-{i}" for i in range(500))
    assert store.count_scheduled() == {}


class Sizes(InMemoryTransport):
    """Records the size of each batch sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def send(self, messages, connection=None):
        self.sizes.append(len(messages))
        return super().send(messages, connection)


def test_batches_start_small_after_a_wake_and_grow_to_the_batch_size():
    transport = Sizes()
    store = setup(transport, 700)
    Pump(store, transport, PumpConfig(batch_size=200, first_batch_size=10)).run(stop_when_idle=True)
    assert transport.sizes == [200, 200, 200, 100]  # a backlog at the start: full batches
    # A burst due while the pump sleeps: it wakes at the due time, and the head of the burst goes out first.
    transport.sizes.clear()
    due = utcnow() + timedelta(seconds=1.0)  # one instant for all of them
    store.store([DelayedMessage("orders", b"x", due, message_id=f"b-{i}") for i in range(100)])
    result = Pump(store, transport, PumpConfig(batch_size=200, first_batch_size=10)).run(max_messages=100)
    assert result.stats.dispatched == 100 and transport.sizes == [10, 20, 40, 30]


def test_a_run_woken_by_its_caller_starts_as_after_the_pumps_own_wait():
    """A trigger waits for due times on its event loop and then runs the pump (`woken=True`): the burst's head goes
    first in a small batch, and no upkeep starts before the burst is handled; a run not woken starts with full
    batches and its upkeep, as on a backlog."""
    for woken, sizes, upkeep_first in ((True, [10, 20, 40, 80, 50], False), (False, [200], True)):
        transport, store = Sizes(), Upkept()
        transport.provision("orders")
        store.store([DelayedMessage("orders", b"x", utcnow(), message_id=f"b-{i}") for i in range(200)])
        result = Pump(store, transport, PumpConfig(batch_size=200, first_batch_size=10)).run(
            stop_when_idle=True, woken=woken)
        assert result.stats.dispatched == 200 and transport.sizes == sizes, (woken, transport.sizes)
        assert (store.events[0] == "upkeep") is upkeep_first, store.events
        assert store.events.index("upkeep") > store.events.index("claim") or upkeep_first


class Sent(InMemoryTransport):
    """Records each message sent and when."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.sent_at: list = []

    def send(self, messages, connection=None):
        self.ids.extend(m.message_id for m in messages)
        self.sent_at.extend(utcnow() for _ in messages)
        return super().send(messages, connection)


class Upkept(InMemoryStore):
    """Records the pump's claims (with what each took), waits (with until when), reads ahead of a wake and upkeep
    calls in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.waits: list = []
        self.claimed: list[int] = []
        self.ready: list = []

    def upkeep(self) -> None:
        self.events.append("upkeep")

    def wait(self, until) -> None:
        self.events.append("wait")
        self.waits.append(until)
        super().wait(until)

    def ready_for(self, due) -> None:
        self.events.append("ready")
        self.ready.append(due)

    @contextmanager
    def claim_due(self, *args, **kwargs):
        self.events.append("claim")
        with super().claim_due(*args, **kwargs) as claim:
            self.claimed.append(len(claim.messages))
            yield claim


def _burst(transport: InMemoryTransport, store: InMemoryStore, n: int, ahead: float, after: float):
    """`n` messages due `ahead` seconds from now at one instant (`b-0`...), and a pump run until `after` seconds
    past it; returns the due time and the pump's result."""
    transport.provision("orders")
    due = utcnow() + timedelta(seconds=ahead)
    store.store([DelayedMessage("orders", b"x", due, message_id=f"b-{i}") for i in range(n)])
    result = Pump(store, transport, PumpConfig(batch_size=200, first_batch_size=10)).run(
        deadline=due + timedelta(seconds=after))
    return due, result


def test_a_pump_woken_at_a_due_time_claims_the_burst_before_any_upkeep_and_starts_it_before_it_sleeps():
    store = Upkept()
    _, result = _burst(InMemoryTransport(), store, 100, 0.3, 0.5)
    assert result.stats.dispatched == 100
    # After the wait until the due time itself (the one before it ends the rehearsal's claim, which takes nothing).
    woke = len(store.events) - store.events[::-1].index("wait", store.events[::-1].index("upkeep"))
    after = store.events[woke:]
    upkeep = after.index("upkeep")
    # The burst's claims (10, 20, 40, 30 and those that find nothing left), then the upkeep, then the sleep.
    assert set(after[:upkeep]) == {"claim"} and upkeep >= 4
    assert after[upkeep + 1] == "wait"


def test_a_pump_runs_the_wakes_first_claim_once_just_before_the_due_time_and_claims_the_burst_at_it():
    """The rehearsal: a wake REHEARSAL_SECONDS early reads ahead (`ready_for`) and claims once, finding nothing due
    yet, so the claim at the due time runs what was just run; no message goes out before it is due."""
    transport, store = Sent(), Upkept()
    due, result = _burst(transport, store, 30, 0.6, 0.4)
    assert result.stats.dispatched == 30
    assert store.ready == [due]
    ready = store.events.index("ready")
    assert store.waits[store.events[:ready].count("wait") - 1] == due - timedelta(seconds=REHEARSAL_SECONDS)
    assert store.events[ready + 1:ready + 3] == ["claim", "wait"]
    rehearsal = store.events[:ready + 1].count("claim")
    assert store.claimed[rehearsal] == 0 and store.claimed[rehearsal + 1] == 10  # nothing, then the head at T
    assert store.waits[store.events[:ready + 3].count("wait") - 1] == due
    assert min(transport.sent_at) >= due


def test_what_falls_due_before_the_rehearsal_is_taken_by_it_without_a_second_sleep():
    transport, store = Sent(), Upkept()
    early: list = []

    def store_one_due_already(due) -> None:  # due before the rehearsal, stored without waking the pump
        early.append(due - timedelta(seconds=REHEARSAL_SECONDS + 0.05))
        InMemoryStore.store(store, [DelayedMessage("orders", b"x", early[0], message_id="early")])

    store.ready_for = store_one_due_already
    due, result = _burst(transport, store, 1, 0.6, 0.4)
    assert result.stats.dispatched == 2
    got = dict(zip(transport.ids, transport.sent_at, strict=True))
    assert early[0] <= got["early"] < due <= got["b-0"]


def test_a_message_stored_due_sooner_during_the_wait_before_the_rehearsal_is_claimed_at_its_own_time():
    transport = Sent()
    transport.provision("orders")
    store = Upkept()
    due = utcnow() + timedelta(seconds=1.5)
    store.store([DelayedMessage("orders", b"x", due, message_id="later")])
    sooner = utcnow() + timedelta(seconds=0.5)
    threading.Timer(0.2, lambda: store.store([DelayedMessage("orders", b"x", sooner, message_id="sooner")])).start()
    result = Pump(store, transport).run(deadline=due + timedelta(seconds=0.3))
    assert result.stats.dispatched == 2
    got = dict(zip(transport.ids, transport.sent_at, strict=True))
    assert sooner <= got["sooner"] < sooner + timedelta(seconds=0.3) and got["later"] >= due
    assert store.ready == [sooner, due]


def test_failures_are_retried_then_delivered_and_exhausted_ones_dead_lettered():
    transport = Flaky(times=2)
    store = setup(transport, 10)
    Pump(store, transport, PumpConfig(number_of_retries=2)).run(stop_when_idle=True)
    assert len(received(transport, "orders")) == 10  # third attempt succeeds
    transport = Flaky(times=5)
    store = setup(transport, 10)
    Pump(store, transport, PumpConfig(number_of_retries=2)).run(stop_when_idle=True)
    dead = received(transport, "error")
    assert len(dead) == 10 and received(transport, "orders") == []
    assert {m.headers[HEADER_FAILURES] for m in dead} == {"3"}  # 1 try + 2 retries
    assert set(transport.sends.values()) == {3}


def test_an_unknown_destination_is_dead_lettered_at_once():
    transport = InMemoryTransport()
    store = setup(transport, 3, destination="nowhere")
    Pump(store, transport, PumpConfig(number_of_retries=5)).run(stop_when_idle=True)
    assert len(received(transport, "error")) == 3


def test_a_broker_outage_trips_the_breaker_and_loses_nothing():
    transport = Flaky(down=True)
    store = setup(transport, 20)
    with pytest.raises(CriticalError, match="dispatching kept failing"):
        Pump(store, transport, PumpConfig(time_to_trigger_dispatch_circuit_breaker=0.3)).run(stop_when_idle=True)
    assert store.count_scheduled() == {"orders": 20}  # every message released untouched, no retry spent
    transport.down = False
    Pump(store, transport).run(stop_when_idle=True)
    assert len(received(transport, "orders")) == 20


class Pipelined(InMemoryTransport):
    """A transport that keeps a batch in flight while the pump claims the next (as RabbitMQ does); each send
    takes `pause` seconds."""

    pipelined = True

    def __init__(self, pause: float = 0.0) -> None:
        super().__init__()
        self.pause = pause

    def send(self, messages, connection=None):
        time.sleep(self.pause)
        return super().send(messages, connection)


class ClaimThreads(InMemoryStore):
    """Records the thread of each claim and can fail the claims taken in the worker thread."""

    def __init__(self, fail_ahead: int = 0) -> None:
        super().__init__()
        self.threads: list[str] = []
        self.fail_ahead = fail_ahead

    def claim_due(self, now, limit, due_before=None, exclude=()):
        name = threading.current_thread().name
        self.threads.append(name)
        if name.startswith("pump-claim") and self.fail_ahead:
            self.fail_ahead -= 1
            raise UnavailableError("the database went away")
        return super().claim_due(now, limit, due_before, exclude)


def test_the_next_batch_is_claimed_in_a_worker_thread_while_one_is_in_flight():
    transport = Pipelined()
    store = setup(transport, 1000, store=ClaimThreads())
    result = Pump(store, transport, PumpConfig(batch_size=100)).run(stop_when_idle=True)
    assert result.stats.dispatched == 1000 and store.count_scheduled() == {}
    ids = [m.message_id for m in received(transport, "orders")]
    assert sorted(ids) == sorted(f"m-{i}" for i in range(1000))  # each once
    assert sum(t.startswith("pump-claim") for t in store.threads) >= 5  # most batches were claimed ahead
    assert not [t for t in threading.enumerate() if t.name.startswith("pump-claim")]  # it ends with the run


def test_a_batch_claimed_ahead_is_handed_back_untouched_when_the_pump_stops():
    transport = Pipelined(pause=0.05)
    store = setup(transport, 1000, store=ClaimThreads())
    result = Pump(store, transport, PumpConfig(batch_size=100)).run(deadline=utcnow() + timedelta(seconds=0.3))
    assert result.reason == "deadline" and 0 < result.stats.dispatched < 1000
    sent = {m.message_id for m in received(transport, "orders")}
    left = store.count_scheduled()
    assert len(sent) == result.stats.dispatched and left == {"orders": 1000 - len(sent)}  # none lost or sent twice
    assert not store._claims  # no claim is left open
    assert all(store.get(f"m-{i}").failures == 0 for i in range(1000) if f"m-{i}" not in sent)


def test_a_store_failure_in_the_worker_thread_counts_as_a_failed_claim_and_loses_nothing():
    transport = Pipelined()
    store = setup(transport, 600, store=ClaimThreads(fail_ahead=2))
    result = Pump(store, transport, PumpConfig(batch_size=100)).run(stop_when_idle=True)
    assert result.stats.dispatched == 600 and store.count_scheduled() == {}
    assert len({m.message_id for m in received(transport, "orders")}) == 600
    assert store.fail_ahead == 0  # both failures happened, and the pump claimed again


class CountFails(InMemoryStore):
    """A store whose count_scheduled (read only by the progress report) fails while `down`; not threaded, so the
    count runs in the pump's loop and every report meets the failure."""

    threaded_claims = False

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.count_failures = 0

    def count_scheduled(self, due_before=None):
        if self.down:
            self.count_failures += 1
            raise UnavailableError("the database went away")
        return super().count_scheduled(due_before)


def test_a_store_error_in_the_progress_report_is_ridden_out():
    transport = InMemoryTransport()
    store = setup(transport, 300, store=CountFails())
    # A report after every batch: each of them meets the failing count.
    result = Pump(store, transport, PumpConfig(batch_size=50, progress_interval_seconds=0)).run(stop_when_idle=True)
    assert result.reason == "drained" and result.stats.dispatched == 300
    assert store.count_failures >= 5  # the reports did run, and failed
    assert sorted(m.message_id for m in received(transport, "orders")) == sorted(f"m-{i}" for i in range(300))
    store.down = False
    assert store.count_scheduled() == {}


class CountHeld(InMemoryStore):
    """A store whose first count (the progress report's) is held until let through, as a count of millions of
    rows is slow."""

    def __init__(self) -> None:
        super().__init__()
        self.counting, self.go = threading.Event(), threading.Event()
        self.counted = 0

    def count_scheduled(self, due_before=None):
        if not self.counting.is_set():
            self.counting.set()
            self.go.wait(30)
        self.counted += 1
        return super().count_scheduled(due_before)


def test_a_slow_count_for_the_progress_report_holds_up_no_claim():
    transport = InMemoryTransport()
    store = setup(transport, 300, store=CountHeld())
    result = Pump(store, transport, PumpConfig(batch_size=50, progress_interval_seconds=0)).run(stop_when_idle=True)
    counted_meanwhile = store.counted
    store.go.set()
    assert store.counting.is_set()  # a report did start a count
    assert result.reason == "drained" and result.stats.dispatched == 300
    # The pump drained the store while the count was held, and started no other count beside it.
    assert counted_meanwhile == 0
    assert len({m.message_id for m in received(transport, "orders")}) == 300


class Gate(InMemoryTransport):
    """Holds each send until let through; says when the first has started."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.go = threading.Event(), threading.Event()

    def send(self, messages, connection=None):
        self.started.set()
        assert self.go.wait(30)
        return super().send(messages, connection)


def test_stop_settles_the_batch_in_hand_and_claims_no_other():
    """What a cancelled trigger asks of the pump running in its thread: no claim after the batch in hand."""
    transport = Gate()
    store = setup(transport, 500)
    pump = Pump(store, transport, PumpConfig(batch_size=100))
    results = []
    runner = threading.Thread(target=lambda: results.append(pump.run()))  # no deadline: it would run on
    runner.start()
    assert transport.started.wait(30)
    pump.stop()
    transport.go.set()
    runner.join(30)
    assert not runner.is_alive(), "the pump went on after stop()"
    (result,) = results
    delivered = received(transport, "orders")
    assert result.reason == "stopped" and 0 < result.stats.dispatched < 500
    assert len(delivered) == result.stats.dispatched  # the batch in hand was settled, nothing more sent
    assert sum(store.count_scheduled().values()) == 500 - len(delivered)  # and the rest is still stored


class Poison(InMemoryTransport):
    """Refuses every message whose id is in `refused` (each time; not its dead letter), delivers the rest; counts the
    batches sent."""

    def __init__(self, refused=()) -> None:
        super().__init__()
        self.refused = set(refused)
        self.batches = 0

    def send(self, messages, connection=None):
        self.batches += 1
        refused = {m.message_id: RuntimeError("422 from the endpoint") for m in messages
                   if m.message_id in self.refused and m.destination != "error"}
        return {**refused, **super().send([m for m in messages if m.message_id not in refused])}


def _held_pump(store, transport, clock, batch_size: int, number_of_retries: int = 0) -> Pump:
    """A pump on the test's clock: its breakers' time is the clock's, and nothing sleeps."""
    return clock.hold_breakers(Pump(store, transport, PumpConfig(batch_size=batch_size,
                                                                 number_of_retries=number_of_retries),
                                    clock=clock.clock))


def test_a_pump_delivering_all_but_a_third_of_every_batch_never_trips_its_breaker():
    """Every batch has messages the transport refuses (dead-lettered, no retries) and delivers the rest, for two
    minutes: the pump goes on; before, the breaker was never disarmed and the pump stopped after 30 s."""
    from tests.helpers import HeldClock

    clock = HeldClock()
    store, transport = InMemoryStore(clock=clock.clock), Poison()
    for queue in ("orders", "error"):
        transport.provision(queue)
    pump = _held_pump(store, transport, clock, batch_size=3)
    for second in range(120):
        ids = [f"m-{second}-{i}" for i in range(3)]
        transport.refused.add(ids[0])
        store.store([DelayedMessage("orders", b"x", clock.now, message_id=i) for i in ids])
        pump.run(stop_when_idle=True)
        clock.advance(1)
    assert len(received(transport, "orders")) == 240 and len(received(transport, "error")) == 120


def test_a_message_refused_again_after_the_pump_waited_longer_than_the_breaker_allows_does_not_trip_it():
    """One message refused, nothing else due: its retry comes a minute later, after the pump slept; the wait is no
    outage (before, the breaker armed at the first failure tripped at the second, 60 s on)."""
    from airflow_delay_provider.core.retry_policy import DeliveryPolicy
    from tests.helpers import HeldClock

    clock = HeldClock()
    store, transport = InMemoryStore(clock=clock.clock), Poison(["m"])
    for queue in ("orders", "error"):
        transport.provision(queue)
    pump = _held_pump(store, transport, clock, batch_size=10)
    pump.by_destination.policy = DeliveryPolicy(min_delay_target=60, max_delay_target=60, num_retries=3)
    store.store([DelayedMessage("orders", b"x", clock.now, message_id="m")])
    for _ in range(4):
        pump.run(stop_when_idle=True)
        clock.advance(61)
    assert [m.message_id for m in received(transport, "error")] == ["m"]


def test_a_transport_refusing_every_message_of_a_backlog_still_trips_the_breaker():
    from tests.helpers import HeldClock

    clock = HeldClock()
    store = InMemoryStore(clock=clock.clock)
    transport = Poison(f"m-{i}" for i in range(10_000))
    for queue in ("orders", "error"):
        transport.provision(queue)
    pump = _held_pump(store, transport, clock, batch_size=10, number_of_retries=100)
    pump.dispatch_breaker._sleep = lambda seconds: clock.advance(seconds)  # each failure waits, as it would
    store.store([DelayedMessage("orders", b"x", clock.now, message_id=f"m-{i}") for i in range(10_000)])
    with pytest.raises(CriticalError, match="dispatching kept failing"):
        pump.run(stop_when_idle=True)
    assert received(transport, "orders") == [] and 30 <= transport.batches <= 40


class HistoryFails(InMemoryStore):
    """A store whose first batches fail to record their history with a driver's error, which the store's claim
    reports in its own words as it unwinds (as the SQL store's translation does): a second exception."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    @contextmanager
    def claim_due(self, now, limit, due_before=None, exclude=()):
        try:
            with super().claim_due(now, limit, due_before, exclude) as claim:
                store = self

                def record(_handed_at, _groups):
                    if store.failures:
                        store.failures -= 1
                        raise OSError("server closed the connection unexpectedly")

                claim.record = record
                yield claim
        except OSError as exc:
            raise UnavailableError(f"could not claim due messages ({exc})") from None


def test_a_settlement_the_store_fails_releases_the_batch_and_the_pump_goes_on():
    store, transport = HistoryFails(failures=1), InMemoryTransport()
    transport.provision("q")
    store.store([DelayedMessage("q", b"x", utcnow() - timedelta(seconds=1), {}, f"m-{i}") for i in range(5)])
    result = Pump(store, transport, PumpConfig(batch_size=5), sleep=lambda s: None).run(stop_when_idle=True)
    # The batch released, and the pump on to the end: before, the second exception stopped it.
    assert store.failures == 0 and store.count_scheduled() == {}
    assert {m.message_id for m in received(transport, "q")} >= {f"m-{i}" for i in range(5)}
    assert result.reason == "drained"
