"""DueMessageEventTrigger and its producer on a SQLite store: payloads, event leases, and Airflow's own
shared-stream manager in ack mode (airflow/triggers/shared_stream.py) driving it as the triggerer does."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from datetime import timedelta
from types import SimpleNamespace

import pytest
from airflow.sdk.module_loading import import_string
from airflow.triggers.base import BaseEventTrigger
from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome, SharedStreamManager

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import CriticalError, InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.hooks.delay_store import DelayStoreHook
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.triggers.asset import (
    DueMessageEventTrigger,
    DueMessageProducer,
    asset_destination,
    dag_run_asset,
    event_payload,
    message_payloads,
    watched_asset,
)
from tests.unit.triggers.conftest import _next_event, _subscribe
from tests.waiting import wait_for

DEST = "airflow.asset.unit.runs"


def _trigger(conn_id: str, **kwargs) -> DueMessageEventTrigger:
    kwargs = {"min_event_interval": 0, "poll_interval": 0.2, "lease_seconds": 5, **kwargs}
    return DueMessageEventTrigger(destination=DEST, delay_store_conn_id=conn_id, **kwargs)


def _message(i: int, due_in: float = -0.1, body: bytes | None = None) -> DelayedMessage:
    return DelayedMessage(DEST, body if body is not None else json.dumps({"n": i}).encode(),
                          utcnow() + timedelta(seconds=due_in), {"k": str(i)}, f"run-{i}")


# -- payloads and helpers --------------------------------------------------------------------------------------
def test_the_payload_carries_id_headers_and_the_body_decoded_when_it_is_json():
    due = utcnow()
    payload = event_payload(DelayedMessage(DEST, b'{"order": 7}', due, {"h": "v"}, "m-1"))
    assert payload == {"message_id": "m-1", "destination": DEST, "due_at": due.isoformat(), "headers": {"h": "v"},
                       "body": {"order": 7}, "body_encoding": "json", "attempt": 1}
    assert event_payload(DelayedMessage(DEST, b"plain", due))["body"] == "plain"
    binary = event_payload(DelayedMessage(DEST, b"\xff\x00", due))
    assert (binary["body"], binary["body_encoding"]) == ("/wA=", "base64")
    json.dumps(binary)  # natively JSON: the triggerer stores it as it is


def test_message_payloads_keeps_one_per_message_id_in_due_order_and_skips_other_events():
    late, early = event_payload(_message(2, 5)), event_payload(_message(1, 1))
    events = [SimpleNamespace(extra={"from_trigger": True, "payload": late}),
              SimpleNamespace(extra={"from_trigger": True, "payload": early}),
              SimpleNamespace(extra={"from_trigger": True, "payload": late}),  # a duplicate hand-over
              SimpleNamespace(extra={}),  # a task's outlet event
              {"extra": {"payload": {"no": "id"}}}]
    assert [p["message_id"] for p in message_payloads(events)] == ["run-1", "run-2"]


def test_assets_and_destinations_follow_the_naming_rule():
    asset = dag_run_asset("invoice_reminder", lease_seconds=30)
    assert asset.name == "delayed_dag_run.invoice_reminder"
    trigger = asset.watchers[0].trigger
    assert isinstance(trigger, BaseEventTrigger)
    assert trigger.destination == "airflow.asset.delayed_dag_run.invoice_reminder" and trigger.lease_seconds == 30
    assert watched_asset("orders.timeouts").watchers[0].trigger.destination == asset_destination("orders.timeouts")
    with pytest.raises(InvalidInputError, match="must start with 'airflow.asset.'"):
        DueMessageEventTrigger(destination="orders.cancel")
    with pytest.raises(InvalidInputError, match="lease_seconds"):
        DueMessageEventTrigger(destination=DEST, lease_seconds=1)
    with pytest.raises(InvalidInputError, match="numRetries"):
        DueMessageEventTrigger(destination=DEST, delivery_policy={"healthyRetryPolicy": {"numRetries": 500}})
    with pytest.raises(InvalidInputError):
        dag_run_asset("has space")


def test_it_serialises_to_plain_kwargs_rebuilds_and_hashes_stably():
    trigger = DueMessageEventTrigger(destination=DEST, delivery_policy=DeliveryPolicy.immediate(2))
    classpath, kwargs = trigger.serialize()
    json.dumps(kwargs)  # plain data, connection ids only
    again = import_string(classpath)(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    assert BaseEventTrigger.hash(classpath, kwargs) == BaseEventTrigger.hash(*again.serialize())
    assert trigger.shared_stream_key() == again.shared_stream_key() is not None


# -- the store's event leases ---------------------------------------------------------------------------------
def test_pumps_and_sweeps_leave_event_destinations_alone(store_conn):
    _, store, _ = store_conn
    store.store([_message(1), DelayedMessage("orders", b"x", utcnow() - timedelta(seconds=1), {}, "o-1")])
    with store.claim_due(utcnow(), 100) as claim:
        assert [m.message_id for m in claim.messages] == ["o-1"]
        claim.remove(["o-1"])
    assert store.next_due() is None  # nothing a pump could take
    assert store.start_sweep("sweep1", utcnow() + timedelta(seconds=1))["claimed"] == 0
    assert store.next_event_due(DEST) is not None


def test_a_lease_hands_each_message_to_one_claim_and_an_expired_lease_is_taken_over(store_conn):
    _, store, _ = store_conn
    store.store([_message(i) for i in range(3)] + [_message(9, due_in=60)])
    store.open_event_claim("events-a", DEST, lease_seconds=30)
    store.open_event_claim("events-b", DEST, lease_seconds=30)
    leased, taken = store.lease_events("events-a", DEST, 2)
    assert [m.message_id for m in leased] == ["run-0", "run-1"] and taken == 0
    assert [m.message_id for m in store.lease_events("events-b", DEST, 10)[0]] == ["run-2"]  # not a's, not future
    assert store.ack_events("events-b", ["run-0"]) == 0  # only the holder acknowledges
    assert store.backlog()["destinations"][DEST]["in_flight"] == 3
    # a's producer dies after a last, short renewal: once it runs out, b takes its messages over
    assert store.renew_lease("events-a", 0.5)
    wait_for(lambda: store.backlog()["destinations"][DEST]["in_flight"] == 1, 10, "a's lease to run out")
    leased, taken = store.lease_events("events-b", DEST, 10)
    assert {m.message_id for m in leased} == {"run-0", "run-1"} and taken == 2
    assert store.ack_events("events-a", ["run-0"]) == 0
    assert store.ack_events("events-b", ["run-0", "run-2"]) == 2
    assert store.close_event_claim("events-b") == 1  # run-1 goes back at once
    assert store.get("run-1").failures == 0 and store.next_event_due(DEST) is not None


def test_retry_counts_a_failure_and_makes_the_message_due_later(store_conn):
    _, store, _ = store_conn
    store.store([_message(1)])
    store.open_event_claim("events-r", DEST, 30)
    store.lease_events("events-r", DEST, 10)
    later = utcnow() + timedelta(seconds=20)
    assert store.retry_events("events-r", {"run-1": later}, {"run-1": {"k": "1", "x": "y"}}) == 1
    again = store.get("run-1")
    assert again.failures == 1 and again.headers["x"] == "y" and abs((again.due_at - later).total_seconds()) < 0.01
    assert store.lease_events("events-r", DEST, 10)[0] == []  # not due yet


# -- the producer, as the shared-stream manager drives it in ack mode ------------------------------------------
def test_a_message_is_deleted_only_after_airflow_confirms_its_event_persisted(store_conn):
    conn_id, store, _ = store_conn
    store.store([_message(1), _message(2)])

    async def scenario():
        manager = SharedStreamManager(ack_timeout=30)
        key, stream = await _subscribe(manager, _trigger(conn_id))
        event, seq = await _next_event(stream, manager, key)
        assert event.payload["message_id"] == "run-1" and event.payload["body"] == {"n": 1}
        assert seq is not None  # ack mode: the event gates the broker advance
        second, seq2 = await _next_event(stream, manager, key)  # moving on closes run-1's window
        await asyncio.sleep(0.3)
        assert store.get("run-1") is not None  # handed over, not yet persisted: still stored (leased)
        manager.confirm_persisted([seq])  # the supervisor stored the asset event
        await _until(lambda: store.get("run-1") is None)
        assert store.get("run-2") is not None
        await manager.unsubscribe(1, key)  # the trigger stops with run-2 unconfirmed: released, handed over again
        return second.payload["message_id"]

    assert asyncio.run(scenario()) == "run-2"
    assert store.get("run-2") is not None and store.next_event_due(DEST) is not None
    assert store.event_claims(DEST) == []


def test_an_event_never_recorded_is_retried_then_dead_lettered(store_conn):
    conn_id, store, queues = store_conn
    store.store([_message(1)])
    policy = {"healthyRetryPolicy": {"numRetries": 1, "numNoDelayRetries": 1, "minDelayTarget": 0,
                                     "maxDelayTarget": 0}}

    async def scenario():
        manager = SharedStreamManager(ack_timeout=0.3)  # no confirmation comes: each attempt times out
        trigger = _trigger(conn_id, delivery_policy=policy)
        attempts = []
        for trigger_id in (1, 2):  # a failed trigger is started again by the triggerer
            key, stream = await _subscribe(manager, trigger, trigger_id)
            event, _ = await _next_event(stream, manager, key, trigger_id)
            attempts.append(event.payload["attempt"])
            with pytest.raises(Exception, match="did not finish processing"):
                await asyncio.wait_for(anext(stream), 5)
            await manager.unsubscribe(trigger_id, key)
            if trigger_id == 1:
                await _until(lambda: store.get("run-1") is not None and store.get("run-1").failures == 1)
        return attempts

    assert asyncio.run(scenario()) == [1, 2]
    dead = _until_sync(lambda: queues.receive("error", max_messages=10))
    assert [m.message_id for m in dead] == ["run-1"]
    assert dead[0].headers["x-delay-failed-destination"] == DEST
    assert "not recorded (after 2 attempt(s))" in dead[0].headers["x-delay-failure-reason"]
    assert store.get("run-1") is None
    # Its story: retried after the first attempt, dead-lettered after the second, never delivered.
    story = [(e.outcome, e.attempts, e.detail) for e in store.delivery_history(message_id="run-1").entries]
    assert story == [("retried", 1, "the event was not recorded"), ("dead_lettered", 2, "the event was not recorded")]


def test_it_wakes_for_a_message_stored_later_and_paces_events(store_conn):
    conn_id, store, _ = store_conn

    async def scenario():
        manager = SharedStreamManager(ack_timeout=30)
        key, stream = await _subscribe(manager, _trigger(conn_id, min_event_interval=0.5))
        store.store([_message(1, due_in=0.6), _message(2, due_in=0.6)])
        first, seq = await _next_event(stream, manager, key)
        at_first = utcnow()
        second, seq2 = await _next_event(stream, manager, key)
        gap = (utcnow() - at_first).total_seconds()
        await manager.unsubscribe(1, key)
        return first.payload, gap, at_first

    first, gap, at_first = asyncio.run(scenario())
    assert at_first.isoformat() >= first["due_at"]  # never before its due time
    assert gap >= 0.45


def test_run_without_a_shared_stream_acknowledges_each_event_it_hands_over(store_conn):
    conn_id, store, _ = store_conn
    store.store([_message(1)])

    async def scenario():
        gen = _trigger(conn_id).run()
        event = await asyncio.wait_for(anext(gen), 10)
        assert store.get("run-1") is not None
        task = asyncio.ensure_future(anext(gen))  # resuming acknowledges the first event
        await _until(lambda: store.get("run-1") is None)
        task.cancel()  # the trigger is cancelled while it waits: its claim ends
        with pytest.raises(asyncio.CancelledError):
            await task
        return event.payload["message_id"]

    assert asyncio.run(scenario()) == "run-1"
    assert store.event_claims(DEST) == []


def test_settle_releases_events_nobody_took(store_conn):
    conn_id, store, _ = store_conn
    store.store([_message(1)])
    producer = DueMessageProducer(_trigger(conn_id))
    producer.store = store
    store.open_event_claim(producer.claim_id, DEST, 30)
    [message], _ = store.lease_events(producer.claim_id, DEST, 10)
    producer.settle([AdvanceItem(message, AdvanceOutcome(acked=0, failed=0))])
    assert store.get("run-1").failures == 0 and store.lease_events(producer.claim_id, DEST, 10)[0]


class Outage(SqlDelayedMessageStore):
    """A store whose settling statements fail as in a database outage: `down[name]` more calls of each (-1: all)."""

    SETTLING = ("ack_events", "release_events", "retry_events")

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.down = dict.fromkeys(self.SETTLING, 0)
        self.failed: Counter[str] = Counter()

    def _outage(self, name: str) -> None:
        if self.down[name]:
            self.down[name] -= 1
            self.failed[name] += 1
            raise UnavailableError(f"could not {name}: the database is not reachable")

    def ack_events(self, *args, **kwargs):
        self._outage("ack_events")
        return super().ack_events(*args, **kwargs)

    def release_events(self, *args, **kwargs):
        self._outage("release_events")
        return super().release_events(*args, **kwargs)

    def retry_events(self, *args, **kwargs):
        self._outage("retry_events")
        return super().retry_events(*args, **kwargs)


@pytest.fixture
def outage(store_conn, monkeypatch):
    """The store of `store_conn` as an Outage, which every trigger's producer gets."""
    conn_id, store, _ = store_conn
    flaky = Outage(str(store.url))
    monkeypatch.setattr(DelayStoreHook, "get_store", lambda hook: flaky)
    return conn_id, flaky


def test_a_store_outage_while_acknowledging_is_ridden_out_and_hands_nothing_over_again(outage):
    conn_id, store = outage
    store.store([_message(1), _message(2)])
    store.down["ack_events"] = 2

    async def scenario():
        manager = SharedStreamManager(ack_timeout=30)
        key, stream = await _subscribe(manager, _trigger(conn_id))
        first, seq = await _next_event(stream, manager, key)
        manager.confirm_persisted([seq])
        second, seq = await _next_event(stream, manager, key)  # run-1 resolved: its acknowledgement fails twice
        manager.confirm_persisted([seq])
        store.store([_message(3)])
        third, _ = await _next_event(stream, manager, key)  # the stream lives on, handing over only new messages
        await _until(lambda: store.get("run-1") is None and store.get("run-2") is None)
        await manager.unsubscribe(1, key)
        return [e.payload["message_id"] for e in (first, second, third)]

    assert asyncio.run(scenario()) == ["run-1", "run-2", "run-3"]
    assert store.failed["ack_events"] == 2  # the outage did hit the settlement
    assert store.get("run-3") is not None and store.event_claims(DEST) == []  # unconfirmed: released


@pytest.mark.parametrize(("outcome", "statement"), [
    (AdvanceOutcome(acked=1, failed=0), "ack_events"),  # recorded: deleted
    (AdvanceOutcome(acked=0, failed=0), "release_events"),  # nobody subscribed: given back untouched
    (AdvanceOutcome(acked=0, failed=1), "retry_events"),  # not recorded: one more attempt, later
])
def test_advance_retries_the_same_batch_through_a_store_outage_and_settles_it_once(outage, outcome, statement):
    conn_id, store = outage
    store.store([_message(1)])
    producer = DueMessageProducer(_trigger(conn_id))
    producer.store = store
    store.open_event_claim(producer.claim_id, DEST, 30)
    [message], _ = store.lease_events(producer.claim_id, DEST, 10)
    store.down[statement] = 2
    asyncio.run(asyncio.wait_for(producer.advance([AdvanceItem(message, outcome)]), 30))
    assert store.failed[statement] == 2
    stored = store.get("run-1")
    if statement == "ack_events":
        assert stored is None
    elif statement == "release_events":
        assert stored.failures == 0 and store.lease_events(producer.claim_id, DEST, 10)[0]  # free again
    else:
        assert stored.failures == 1 and stored.due_at > message.due_at  # one attempt counted, not two
    assert producer.counts[{"ack_events": "acknowledged", "release_events": "released",
                            "retry_events": "retried"}[statement]] == 1


def test_advance_trips_loudly_when_the_outage_outlasts_the_breaker_and_loses_nothing(outage):
    conn_id, store = outage
    store.store([_message(1)])
    producer = DueMessageProducer(_trigger(conn_id, time_to_trigger_store_circuit_breaker=1))
    producer.store = store
    store.open_event_claim(producer.claim_id, DEST, 30)
    [message], _ = store.lease_events(producer.claim_id, DEST, 10)
    store.down["ack_events"] = -1
    item = AdvanceItem(message, AdvanceOutcome(acked=1, failed=0))
    with pytest.raises(CriticalError, match=r"settling the asset events of .* kept failing .*allowed: 1 s"):
        asyncio.run(asyncio.wait_for(producer.advance([item]), 30))
    assert store.failed["ack_events"] >= 2 and store.get("run-1") is not None  # still stored, still leased
    assert store.close_event_claim(producer.claim_id) == 1  # handed over again by the next producer


def test_a_dead_letter_whose_acknowledgement_meets_an_outage_is_sent_once(outage, store_conn):
    conn_id, store = outage
    queues = store_conn[2]
    store.store([_message(1)])
    producer = DueMessageProducer(_trigger(conn_id, delivery_policy=DeliveryPolicy.immediate(0)))
    producer.store = store
    store.open_event_claim(producer.claim_id, DEST, 30)
    [message], _ = store.lease_events(producer.claim_id, DEST, 10)
    store.down["ack_events"] = 2  # sent to the error queue, then deleting it fails for a while
    asyncio.run(asyncio.wait_for(producer.advance([AdvanceItem(message, AdvanceOutcome(acked=0, failed=1))]), 30))
    assert store.failed["ack_events"] == 2 and store.get("run-1") is None
    assert [m.message_id for m in queues.receive("error", max_messages=10)] == ["run-1"]  # once, not per attempt
    assert producer.counts["dead_lettered"] == 1


def test_an_error_queue_that_cannot_be_opened_keeps_the_message_stored_and_due_again(store_conn):
    conn_id, store, queues = store_conn
    store.store([_message(1)])
    trigger = _trigger(conn_id, delivery_policy=DeliveryPolicy.immediate(0), transport_conn_id="no_such_store")
    producer = DueMessageProducer(trigger)
    producer.store = store
    store.open_event_claim(producer.claim_id, DEST, 30)
    [message], _ = store.lease_events(producer.claim_id, DEST, 10)
    before = utcnow()
    asyncio.run(asyncio.wait_for(producer.advance([AdvanceItem(message, AdvanceOutcome(acked=0, failed=1))]), 30))
    kept = store.get("run-1")
    assert kept is not None and kept.failures == 1 and kept.due_at <= utcnow() + timedelta(seconds=1)
    assert kept.due_at >= before - timedelta(seconds=1)
    assert [m.message_id for m in store.lease_events(producer.claim_id, DEST, 10)[0]] == ["run-1"]  # due again
    assert queues.receive("error", max_messages=10) == [] and producer.counts["dead_lettered"] == 0


def test_a_claim_never_takes_back_rows_it_handed_over_when_its_lease_ran_out(store_conn):
    """An outage longer than the lease stops the renewals: the producer's own rows (handed over, settled once the
    store is back) must not be leased to it a second time, which would hand them over again."""
    _, store, _ = store_conn
    store.store([_message(1)])
    store.open_event_claim("events-a", DEST, lease_seconds=0.2)
    assert [m.message_id for m in store.lease_events("events-a", DEST, 10)[0]] == ["run-1"]
    _until_sync(lambda: store.event_claims(DEST) == [])  # the lease ran out
    assert store.lease_events("events-a", DEST, 10) == ([], 0)
    assert store.renew_lease("events-a", 30)  # the store is back: the renewer extends the lease
    assert store.ack_events("events-a", ["run-1"]) == 1


def test_a_failed_renewal_is_tried_again_within_a_second_not_a_third_of_the_lease_later(store_conn):
    """Outages of a few seconds each may meet two renewals a third of the lease apart, and the claim would lapse
    (another producer could take its rows over); after a failure the renewer tries again within a second."""
    conn_id, store, _ = store_conn
    producer = DueMessageProducer(_trigger(conn_id, lease_seconds=15))
    producer.store = store
    store.open_event_claim(producer.claim_id, DEST, 15)
    attempts: list[float] = []
    renew = store.renew_lease

    def failing_twice(claim_id, lease_seconds):
        attempts.append(time.monotonic())
        if len(attempts) <= 2:
            raise UnavailableError("the store is down")
        return renew(claim_id, lease_seconds)

    store.renew_lease = failing_twice

    async def scenario() -> None:
        renewer = asyncio.create_task(producer._renew())
        await _until(lambda: len(attempts) >= 3, timeout=30)
        renewer.cancel()

    asyncio.run(scenario())
    # The first a third of the lease after the claim opened, then retries a second apart: renewed 7 s into a 15 s
    # lease, where a third of it between attempts would have come at its very end.
    assert all(later - earlier < 3 for earlier, later in zip(attempts, attempts[1:], strict=False)), attempts
    assert store.event_claims(DEST)  # renewed: live


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _until_sync(produce, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := produce()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


# -- ScheduleDagRunOperator ------------------------------------------------------------------------------------
def _ti(run_id: str = "run-a"):
    return {"ti": SimpleNamespace(dag_id="scheduler", run_id=run_id, task_id="schedule", map_index=-1)}


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"conf": {}, "delay_seconds": 5}, "exactly one of dag_id"),
    ({"dag_id": "t", "asset": "a", "delay_seconds": 5}, "exactly one of dag_id"),
    ({"dag_id": "t", "conf": {"when": utcnow()}, "delay_seconds": 5}, "JSON-serialisable"),
    ({"dag_id": "t", "conf": {"x": float("nan")}, "delay_seconds": 5}, "JSON-serialisable"),
    ({"dag_id": "t", "conf": ["not", "a", "dict"], "delay_seconds": 5}, "must be a dict"),
    ({"dag_id": "t", "conf": {"x": "y" * 70_000}, "delay_seconds": 5}, "at most 65536"),
    ({"dag_id": "t", "delay_seconds": -1}, "delay_seconds must be >= 0 seconds"),
    # The store connection's longest delay is read when the task runs: a DAG file is held to ten years.
    ({"dag_id": "t", "delay_seconds": 315_576_001}, "315576000"),
    ({"dag_id": "t", "deliver_at": "tomorrow"}, "deliver_at must be an ISO-8601"),
    ({"dag_id": "t", "delay_seconds": 5, "deliver_at": "2030-01-01T00:00:00+00:00"}, "not both"),
    ({"dag_id": "t"}, "give delay_seconds"),
    ({"dag_id": "has space", "delay_seconds": 5}, "dag_id must be a DAG id"),
])
def test_schedule_refuses_bad_input_when_the_dag_is_parsed(kwargs, error):
    from airflow_delay_provider.operators.schedule import ScheduleDagRunOperator

    with pytest.raises(InvalidInputError, match=error):
        ScheduleDagRunOperator(task_id="schedule", **kwargs)


def test_schedule_stores_one_message_due_later_with_the_conf_and_returns_its_id(store_conn):
    from airflow_delay_provider.operators.schedule import ScheduleDagRunOperator

    conn_id, store, _ = store_conn
    op = ScheduleDagRunOperator(task_id="schedule", dag_id="invoice_reminder", conf={"order_id": "42"},
                                delay_seconds=1800, delay_store_conn_id=conn_id)
    before = utcnow()
    message_id = op.execute(_ti())
    stored = store.get(message_id)
    assert stored.destination == "airflow.asset.delayed_dag_run.invoice_reminder"
    assert json.loads(stored.body) == {"order_id": "42"}
    assert stored.headers["x-airflow-dag-id"] == "invoice_reminder"
    assert 1799 <= (stored.due_at - before).total_seconds() <= 1802
    assert op.execute(_ti()) == message_id and store.count_scheduled() == {stored.destination: 1}  # a retry
    rendered = ScheduleDagRunOperator(task_id="schedule", asset="orders.timeouts", conf='{"a": 1}',
                                      deliver_at="2000-01-01T00:00:00+00:00", delay_store_conn_id=conn_id)
    other = store.get(rendered.execute(_ti("run-b")))
    assert other.destination == "airflow.asset.orders.timeouts" and other.due_at <= utcnow()  # past: now


def test_schedule_with_a_message_id_debounces_the_run(store_conn):
    """Each change of order 42 schedules its reminder 30 minutes later with the latest conf (`replace`): one run, due
    30 minutes after the last change; `keep_earliest` keeps the sooner; `skip` leaves it."""
    from airflow_delay_provider.operators.schedule import ScheduleDagRunOperator

    conn_id, store, _ = store_conn

    def schedule(run: str, delay: int, mode: str, n: int) -> None:
        ScheduleDagRunOperator(task_id="schedule", dag_id="invoice_reminder", conf={"change": n},
                               delay_seconds=delay, message_id="reminder-order-42", on_duplicate=mode,
                               delay_store_conn_id=conn_id).execute(_ti(run))

    schedule("run-a", 1800, "replace", 1)
    first = store.get("reminder-order-42").due_at
    schedule("run-b", 1800, "replace", 2)
    moved = store.get("reminder-order-42")
    assert json.loads(moved.body) == {"change": 2} and moved.due_at > first
    schedule("run-c", 3600, "keep_earliest", 3)
    schedule("run-d", 60, "skip", 4)
    assert store.get("reminder-order-42") == moved and sum(store.count_scheduled().values()) == 1
    schedule("run-e", 60, "keep_earliest", 5)
    sooner = store.get("reminder-order-42")
    assert json.loads(sooner.body) == {"change": 5} and sooner.due_at < moved.due_at


def test_schedule_refuses_an_unknown_dag_or_asset_at_send_time_and_stores_nothing(store_conn, monkeypatch):
    from airflow.sdk.exceptions import ErrorType
    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.comms import ErrorResponse, GetAssetByName, GetDag

    from airflow_delay_provider.operators.schedule import ScheduleDagRunOperator

    conn_id, store, _ = store_conn
    known_dags, known_assets = {"known"}, {"delayed_dag_run.known", "orders.timeouts"}

    class Comms:
        def send(self, msg):
            if isinstance(msg, GetDag):
                return SimpleNamespace(dag_id=msg.dag_id, is_paused=False) if msg.dag_id in known_dags else \
                    ErrorResponse(error=ErrorType.API_SERVER_ERROR, detail={"status_code": 404})
            if isinstance(msg, GetAssetByName):
                return SimpleNamespace(name=msg.name) if msg.name in known_assets else \
                    ErrorResponse(error=ErrorType.ASSET_NOT_FOUND, detail={"name": msg.name})
            raise AssertionError(msg)

    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", Comms(), raising=False)

    def send(**target):
        return ScheduleDagRunOperator(task_id="schedule", delay_seconds=60, delay_store_conn_id=conn_id,
                                      **target).execute(_ti(str(target)))

    with pytest.raises(InvalidInputError, match="unknown DAG 'nope'"):
        send(dag_id="nope")
    known_dags.add("unscheduled")
    with pytest.raises(InvalidInputError, match=r"not scheduled on the asset .*dag_run_asset\('unscheduled'\)"):
        send(dag_id="unscheduled")
    with pytest.raises(InvalidInputError, match="unknown asset 'typo'"):
        send(asset="typo")
    assert store.count_scheduled() == {}
    assert send(dag_id="known") and send(asset="orders.timeouts")
    assert sum(store.count_scheduled().values()) == 2


def test_a_templated_conf_is_checked_once_rendered(store_conn):
    from airflow_delay_provider.operators.schedule import ScheduleDagRunOperator

    conn_id, _, _ = store_conn
    op = ScheduleDagRunOperator(task_id="schedule", dag_id="t", conf="{{ params.conf }}",
                                delay_seconds="{{ params.delay }}", delay_store_conn_id=conn_id, check_target=False)
    op.conf, op.delay_seconds = "not json", "5"
    with pytest.raises(InvalidInputError, match="JSON text of an object"):
        op.execute(_ti())
    op.conf, op.delay_seconds = "{}", "999999"
    with pytest.raises(InvalidInputError, match="604800"):
        op.execute(_ti())


def test_with_run_dag_id_the_next_message_waits_for_the_run_of_the_previous_one(store_conn, monkeypatch):
    """Airflow 3.3 gives an event recorded while a run is queued no run of its own: the producer hands the next
    message over only once the target DAG's run count grew (GetDRCount, as the triggerer answers it)."""
    from airflow.sdk.execution_time import task_runner
    from airflow.sdk.execution_time.comms import GetDRCount

    conn_id, store, _ = store_conn
    runs = {"count": 3}
    asked = []

    class Comms:
        async def asend(self, msg):
            assert isinstance(msg, GetDRCount) and msg.dag_id == "target"
            asked.append(msg)
            return SimpleNamespace(count=runs["count"])

    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", Comms(), raising=False)
    store.store([_message(1), _message(2)])

    async def scenario():
        manager = SharedStreamManager(ack_timeout=30)
        trigger = _trigger(conn_id, run_dag_id="target", min_event_interval=30)
        key, stream = await _subscribe(manager, trigger)
        first, seq = await _next_event(stream, manager, key)
        manager.confirm_persisted([seq])
        pending = asyncio.ensure_future(_next_event(stream, manager, key))
        await asyncio.sleep(1.0)
        assert not pending.done()  # no run for the first message yet: the second waits (unleased)
        assert store.backlog()["destinations"][DEST]["in_flight"] <= 1
        started = time.monotonic()
        runs["count"] = 4  # the scheduler created the first message's run
        second, _ = await pending
        waited = time.monotonic() - started
        await manager.unsubscribe(1, key)
        return first.payload["message_id"], second.payload["message_id"], waited

    first, second, waited = asyncio.run(scenario())
    # Far sooner than the 30 s spacing (a 0.25 s poll, with room for a loaded machine): the run was the gate.
    assert (first, second) == ("run-1", "run-2") and waited < 10.0
    assert len(asked) >= 3
    assert dag_run_asset("target").watchers[0].trigger.run_dag_id == "target"


def test_with_run_dag_id_the_run_count_is_asked_once_the_stream_opens_before_anything_is_due(store_conn, monkeypatch):
    """The triggerer builds the API that answers GetDRCount at its first request, seconds of imports: asked when
    the stream opens, that happens while nothing is due, not at the first due message."""
    from airflow.sdk.execution_time import task_runner

    conn_id, store, _ = store_conn
    asked = []

    class Comms:
        async def asend(self, msg):
            asked.append(msg.dag_id)
            return SimpleNamespace(count=0)

    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", Comms(), raising=False)

    async def scenario():
        manager = SharedStreamManager(ack_timeout=30)
        key, stream = await _subscribe(manager, _trigger(conn_id, run_dag_id="target"))
        pending = asyncio.ensure_future(_next_event(stream, manager, key))
        while not asked:
            await asyncio.sleep(0.05)
        done = pending.done()
        pending.cancel()
        await manager.unsubscribe(1, key)
        return done

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) is False  # asked, with no event: nothing was due
    assert asked == ["target"] and store.count_scheduled() == {}
