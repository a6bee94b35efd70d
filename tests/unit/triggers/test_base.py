"""The one trigger shape: serialised from declared fields, one final event, errors without secrets."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta

import pytest
from airflow.sdk.module_loading import import_string
from airflow.triggers.base import TriggerEvent

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.triggers import base
from airflow_delay_provider.triggers.base import DelayTrigger, error_message, parse_time, sleep_until_next_poll
from airflow_delay_provider.triggers.delay_store import DispatchTrigger, ScheduledMessagesTrigger
from airflow_delay_provider.triggers.sqs import SqsDelayQueueTrigger


class Scripted(DelayTrigger):
    """Returns `status`, or raises `fails`; records whether it released what it opened."""

    serialized_fields = ("status", "fails")

    def __init__(self, status: str = "done", fails: str | None = None) -> None:
        super().__init__()
        self.status = status
        self.fails = fails
        self.released = False

    async def outcome(self) -> TriggerEvent:
        if self.fails:
            raise ConnectionError(self.fails)
        return self.event(self.status, n=1)

    async def release(self) -> None:
        self.released = True


def first_event(trigger: DelayTrigger) -> dict:
    async def first():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(first())


def test_serialize_returns_the_class_path_and_the_declared_fields():
    path, kwargs = Scripted("ready").serialize()
    assert path == f"{__name__}.Scripted" and kwargs == {"status": "ready", "fails": None}
    assert import_string(path)(**kwargs).serialize() == (path, kwargs)


# What the previous version serialised (its own serialize() per class): these must still be rebuilt, to the same.
OLD_KWARGS = {
    "airflow_delay_provider.triggers.delay_store.DispatchTrigger": {
        "delay_store_conn_id": "store", "table": "t", "db_schema": "s", "transport": "sqs",
        "transport_conn_id": "aws", "transport_options": {"prefix": "p"}, "pump_config": {"batch_size": 5},
        "delivery_policy": {"healthyRetryPolicy": {"numRetries": 1}}, "destination_policies": {"q": {}},
        "due_before": "2026-01-02T00:00:00+00:00", "due_from": None, "destinations": ["q"],
        "destination_prefix": None, "deadline": "2026-01-01T00:00:00+00:00", "max_messages": 10,
        "poll_interval": 30.0},
    "airflow_delay_provider.triggers.delay_store.ScheduledMessagesTrigger": {
        "delay_store_conn_id": "delay_store_default", "table": None, "db_schema": None, "due_before": None,
        "deadline": "2026-01-01T00:00:00+00:00", "poll_interval": 5.0, "destination": "q"},
    "airflow_delay_provider.triggers.sqs.SqsDelayQueueTrigger": {
        "endpoint": "orders", "aws_conn_id": "aws_default", "transport_options": {"prefix": "dev-"},
        "deadline": "2026-01-01T00:00:00+00:00", "poll_interval": 30.0,
        "carry": {"counts": {"relayed": 1}, "deadline": "2026-01-01T00:00:00+00:00"}},
}


@pytest.mark.parametrize("path", sorted(OLD_KWARGS))
def test_triggers_serialised_by_the_previous_version_still_deserialise(path):
    kwargs = OLD_KWARGS[path]
    assert import_string(path)(**kwargs).serialize() == (path, kwargs)
    assert json.loads(json.dumps(kwargs)) == kwargs


def test_each_trigger_declares_its_constructor_arguments():
    import inspect

    for cls in (DispatchTrigger, ScheduledMessagesTrigger, SqsDelayQueueTrigger):
        assert issubclass(cls, DelayTrigger)
        assert set(cls.serialized_fields) == set(inspect.signature(cls).parameters), cls


def test_run_yields_the_outcome_once_and_releases():
    trigger = Scripted("ready")
    assert first_event(trigger) == {"status": "ready", "n": 1} and trigger.released


def test_a_failure_is_an_error_event_without_the_secrets_airflow_knows():
    from airflow.sdk.log import mask_secret

    mask_secret("Hush-secret-42")  # what reading a connection with this password does
    trigger = Scripted(fails="login refused for password Hush-secret-42")
    event = first_event(trigger)
    assert event == {"status": "error", "message": "ConnectionError: login refused for password ***"}
    assert trigger.released
    assert error_message(ValueError("plain")) == "ValueError: plain"


def test_sqs_events_carry_the_tasks_state_errors_too():
    carry = {"counts": {"relayed": 2}, "deadline": "2026-01-01T00:00:00+00:00"}
    trigger = SqsDelayQueueTrigger("orders", carry=carry)
    assert trigger.event("ready", visible=1).payload == {"status": "ready", "carry": carry, "visible": 1}
    assert trigger.error_event(RuntimeError("down")).payload == {
        "status": "error", "carry": carry, "message": "RuntimeError: down"}


def test_dispatch_errors_report_what_was_dispatched_before():
    payload = DispatchTrigger(deadline=utcnow().isoformat()).error_event(RuntimeError("down")).payload
    assert payload["status"] == "error" and payload["message"] == "RuntimeError: down"
    assert payload["summary"]["stopped_because"] == "error" and payload["summary"]["dispatched"] == 0


def test_in_a_triggerer_the_final_event_is_held(monkeypatch):
    monkeypatch.setattr(base, "MIN_SECONDS_BEFORE_EVENT", 0.3)
    trigger = Scripted()
    started = time.monotonic()
    first_event(trigger)
    assert time.monotonic() - started < 0.25  # in line (dag.test): no trigger_id, no hold
    trigger.trigger_id = 7
    started = time.monotonic()
    first_event(trigger)
    assert time.monotonic() - started >= 0.3


def test_polls_sleep_up_to_the_deadline_and_stop_after_it():
    assert parse_time(None) is None and parse_time("") is None
    assert parse_time("2026-01-01T00:00:00+00:00").year == 2026

    async def timed(poll_interval, deadline):
        started = time.monotonic()
        again = await sleep_until_next_poll(poll_interval, deadline)
        return again, time.monotonic() - started

    again, took = asyncio.run(timed(5.0, utcnow() - timedelta(seconds=1)))
    assert again is False and took < 0.1
    again, took = asyncio.run(timed(5.0, utcnow() + timedelta(seconds=0.2)))
    assert again is True and 0.1 < took < 1.0
    again, took = asyncio.run(timed(0.05, None))
    assert again is True and took < 1.0


def test_scheduled_messages_trigger_fires_drained_timeout_or_error(monkeypatch):
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook

    class Store:  # the store's count of scheduled messages, scripted
        def __init__(self, counts):
            self.counts = counts

        def check_ready(self):  # its tables are there (a store not there is an error: test_store_readiness.py)
            pass

        def count_scheduled(self, due_before, destination):
            if isinstance(self.counts, Exception):
                raise self.counts
            return self.counts

    def serve(counts):
        async def aget_store(hook):
            return Store(counts)

        monkeypatch.setattr(DelayStoreHook, "aget_store", aget_store)

    serve({})
    assert first_event(ScheduledMessagesTrigger()) == {"status": "drained"}
    serve({"q": 1})
    soon = (utcnow() + timedelta(seconds=0.2)).isoformat()
    assert first_event(ScheduledMessagesTrigger(deadline=soon, poll_interval=0.05)) == {
        "status": "timeout", "scheduled": {"q": 1}}
    serve(ConnectionError("store down"))
    assert first_event(ScheduledMessagesTrigger()) == {"status": "error", "message": "ConnectionError: store down"}
