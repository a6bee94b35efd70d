"""Dead letters over the in-memory fakes: listing consumes nothing, redrive stores then acks, selects, throttles."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import HEADER_FAILED_DESTINATION, HEADER_FAILURES, DelayedMessage
from airflow_delay_provider.core.ports import Transport
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.core.redrive import HEADER_REDRIVEN, list_dead_letters, redrive
from airflow_delay_provider.testing import InMemoryStore, InMemoryTransport
from tests.unit.core.test_pump import Flaky


def dead_letters(transport: Flaky, store: InMemoryStore | None = None) -> InMemoryStore:
    """Three messages for `orders` that fail three times (two retries), four for `nowhere` (never
    provisioned), and one put in the error queue by someone else (no failure headers)."""
    store = store or InMemoryStore()
    for queue in ("orders", "error"):
        transport.provision(queue)
    past = utcnow() - timedelta(seconds=1)
    store.store([DelayedMessage("orders", f"o{i}".encode(), past, {"k": str(i)}, f"o-{i}") for i in range(3)]
                + [DelayedMessage("nowhere", f"n{i}".encode(), past, {}, f"n-{i}") for i in range(4)])
    result = Pump(store, transport, PumpConfig(number_of_retries=2, retry_jitter=0),
                  sleep=lambda _: None).run(stop_when_idle=True)  # the dispatch breaker's pauses skipped
    assert result.stats.dead_lettered == 7 and store.count_scheduled() == {}
    transport.send([DelayedMessage("error", b"foreign", utcnow(), {"from": "elsewhere"}, "foreign-1")])
    return store


def test_a_listing_shows_each_dead_letter_and_consumes_nothing():
    transport = Flaky(times=99)
    dead_letters(transport)
    listing = list_dead_letters(transport, "error")
    assert listing["count"] == 8 and listing["scanned"] == 8 and not listing["more"]
    by_id = {d["message_id"]: d for d in listing["dead_letters"]}
    orders = by_id["o-1"]
    assert orders["destination"] == "orders" and orders["attempts"] == 3 and orders["redriven"] == 0
    assert "RuntimeError: 503 from the endpoint" in orders["last_error"]
    assert orders["first_failed_at"] <= orders["last_failed_at"]
    assert orders["body"] == "o1" and orders["body_bytes"] == 2 and orders["headers"]["k"] == "1"
    nowhere = by_id["n-0"]
    assert nowhere["destination"] == "nowhere" and nowhere["attempts"] == 1
    assert nowhere["first_failed_at"] == nowhere["last_failed_at"] and "not found" in nowhere["last_error"]
    assert by_id["foreign-1"]["destination"] is None and by_id["foreign-1"]["attempts"] is None
    # Nothing was taken: all still visible, and listing again shows the same.
    assert transport.depth("error") == {"visible": 8, "in_flight": 0, "scheduled": 0}
    assert list_dead_letters(transport, "error") == listing
    assert [d["message_id"] for d in list_dead_letters(transport, "error", destination="orders")["dead_letters"]] == [
        "o-0", "o-1", "o-2"]
    picked = list_dead_letters(transport, "error", destination="nowhere", message_ids=["n-3", "o-0", "n-1"])
    assert [d["message_id"] for d in picked["dead_letters"]] == ["n-1", "n-3"]
    page = list_dead_letters(transport, "error", limit=3)
    assert page["count"] == 3 and page["more"]
    with pytest.raises(InvalidInputError, match="limit"):
        list_dead_letters(transport, "error", limit=0)


def test_redrive_stores_each_for_its_destination_then_acks_and_the_pump_delivers_it():
    transport = Flaky(times=3)  # the fourth send to orders succeeds: the endpoint has recovered
    store = dead_letters(transport)
    transport.provision("nowhere")  # the missing destination is there now
    report = redrive(store, transport, "error")
    assert (report["redriven"], report["skipped"], report["left"]) == (7, 1, 0)
    assert report["destinations"] == {"nowhere": 4, "orders": 3} and report["already_stored"] == 0
    [skipped] = report["skipped_messages"]
    assert skipped["message_id"] == "foreign-1" and HEADER_FAILED_DESTINATION in skipped["reason"]
    stored = store.get("o-1")
    assert stored is not None and stored.failures == 0 and stored.destination == "orders"
    assert stored.headers == {"k": "1", HEADER_REDRIVEN: "1"}  # failure headers gone
    assert stored.due_at <= utcnow()
    # Only the foreign message is left, visible again at once (released, not waiting for a timeout).
    assert transport.depth("error") == {"visible": 1, "in_flight": 0, "scheduled": 0}
    result = Pump(store, transport).run(stop_when_idle=True)
    assert result.stats.dispatched == 7 and result.stats.dead_lettered == 0
    got = transport.receive("orders", 100) + transport.receive("nowhere", 100)
    assert Counter(m.message_id for m in got) == Counter([f"o-{i}" for i in range(3)] + [f"n-{i}" for i in range(4)])
    assert {m.headers[HEADER_REDRIVEN] for m in got} == {"1"}
    assert not any(HEADER_FAILURES in m.headers for m in got)


def test_redrive_by_destination_or_ids_leaves_the_others_listed():
    transport = Flaky(times=99)
    store = dead_letters(transport)
    transport.provision("nowhere")
    first = redrive(store, transport, "error", destination="nowhere", message_ids=["n-2", "n-0", "o-1"])
    assert (first["redriven"], first["skipped"], first["left"]) == (2, 0, 6)
    assert sorted(store.count_scheduled().items()) == [("nowhere", 2)]
    listed = [d["message_id"] for d in list_dead_letters(transport, "error")["dead_letters"]]
    assert sorted(listed) == ["foreign-1", "n-1", "n-3", "o-0", "o-1", "o-2"]
    second = redrive(store, transport, "error", destination="orders", max_messages="2")
    assert (second["redriven"], second["destinations"]) == (2, {"orders": 2})
    # Redriven again after failing again: the count goes on, attempts start over.
    Pump(store, transport, sleep=lambda _: None).run(stop_when_idle=True)
    again = {d["message_id"]: d for d in list_dead_letters(transport, "error", destination="orders")["dead_letters"]}
    assert again["o-0"]["redriven"] == 1 and again["o-0"]["attempts"] == 1 and again["o-2"]["redriven"] == 0
    third = redrive(store, transport, "error", message_ids="o-0")
    assert third["redriven"] == 1 and store.get("o-0").headers[HEADER_REDRIVEN] == "2"


def test_redrive_keeps_to_max_per_second():
    transport = Flaky(times=99)
    store = dead_letters(transport)
    transport.provision("nowhere")
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    report = redrive(store, transport, "error", destination="nowhere", max_per_second=2, clock=lambda: now[0],
                     sleep=sleep)
    assert report["redriven"] == 4
    # One token to start, then two a second: the fourth waits until 1.5 s.
    assert now[0] == pytest.approx(1.5, abs=0.01) and slept
    with pytest.raises(InvalidInputError, match="max_per_second"):
        redrive(store, transport, "error", max_per_second="0")
    with pytest.raises(InvalidInputError, match="max_messages"):
        redrive(store, transport, "error", max_messages=0)


class FailingStore(InMemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def store(self, messages, deduplicate=True):
        if self.down:
            raise UnavailableError("the store is down")
        return super().store(messages, deduplicate)


class AckFails(Flaky):
    fail_acks = False

    def ack(self, endpoint, receipts):
        if self.fail_acks and endpoint == "error":
            raise UnavailableError("lost the connection before the ack")
        return super().ack(endpoint, receipts)


def test_a_failure_before_the_store_commits_leaves_every_dead_letter_in_the_error_queue():
    transport = Flaky(times=99)
    store = dead_letters(transport, FailingStore())
    store.down = True
    with pytest.raises(UnavailableError):
        redrive(store, transport, "error")
    assert transport.depth("error")["visible"] == 8 and store.count_scheduled() == {}


def test_a_crash_between_store_and_ack_stores_nothing_twice():
    transport = AckFails(times=99)
    store = dead_letters(transport)
    transport.provision("nowhere")
    transport.fail_acks = True
    with pytest.raises(UnavailableError):
        redrive(store, transport, "error", destination="nowhere")
    assert store.count_scheduled() == {"nowhere": 4}  # stored, still in the error queue
    assert transport.depth("error")["visible"] == 8
    transport.fail_acks = False
    report = redrive(store, transport, "error", destination="nowhere")
    assert report["redriven"] == 4 and report["already_stored"] == 4
    assert store.count_scheduled() == {"nowhere": 4} and transport.depth("error")["visible"] == 4


def test_a_transport_without_peek_says_so():
    class Minimal(Transport):
        def provision(self, endpoint):
            return {}

        def send(self, messages, connection=None):
            return {}

        def receive(self, endpoint, max_messages=10, visibility_timeout=30.0):
            return []

        def ack(self, endpoint, receipts):
            return 0

        def depth(self, endpoint):
            return {"visible": 0}

    assert not Minimal.can_peek and InMemoryTransport.can_peek
    with pytest.raises(NotImplementedError, match="cannot show messages"):
        list_dead_letters(Minimal(), "error")
