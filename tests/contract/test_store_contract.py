"""One contract for every delayed-message store: the in-memory fake, SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.testing import InMemoryStore


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def store(request, tmp_path):
    if request.param == "memory":
        yield InMemoryStore()
        return
    from tests.helpers import make_store

    if request.param == "sqlite":
        url, schema = f"sqlite:///{tmp_path / 'contract.db'}", None
    else:
        from tests.conftest import PG_URL

        url, schema = PG_URL, request.getfixturevalue("pg_schema")
    store = make_store(url, schema, f"c_{uuid.uuid4().hex[:12]}")
    yield store
    store.close()


def msg(n: int, seconds: float = 0.0, destination: str = "orders") -> DelayedMessage:
    return DelayedMessage(destination, f"body-{n}".encode(), utcnow() + timedelta(seconds=seconds), {"n": str(n)},
                          f"m-{n}")


def test_only_due_messages_are_claimed_oldest_first_and_settled_ones_leave(store):
    assert store.store([msg(1, -2), msg(2, -5), msg(3, 60)]) == 3
    with store.claim_due(store.clock(), limit=10) as claim:
        assert [m.message_id for m in claim.messages] == ["m-2", "m-1"]
        assert claim.remove(["m-2"]) == 1
    # m-1 was neither removed nor retried: it is back, due as before.
    assert store.count_scheduled() == {"orders": 2}
    assert store.next_due() < utcnow()


def test_a_claim_hands_a_message_out_once_and_an_error_releases_the_batch(store):
    store.store([msg(n, -1) for n in range(5)])
    with store.claim_due(store.clock(), limit=3) as first:
        if store.concurrent_claims:
            with store.claim_due(store.clock(), limit=10) as second:
                assert {m.message_id for m in second.messages}.isdisjoint(m.message_id for m in first.messages)
                second.remove([m.message_id for m in second.messages])
        first_ids = [m.message_id for m in first.messages]
    with pytest.raises(RuntimeError), store.claim_due(store.clock(), limit=10) as claim:
        assert claim.messages
        raise RuntimeError("the transport failed mid-batch")
    left = store.count_scheduled().get("orders", 0)
    assert left == (3 if store.concurrent_claims else 5) and len(first_ids) == 3


def test_a_retry_counts_the_failure_and_reschedules(store):
    store.store([msg(1, -1)])
    later = utcnow() + timedelta(seconds=30)
    with store.claim_due(store.clock(), limit=10) as claim:
        claim.retry({"m-1": later}, {"m-1": {"n": "1", "why": "broker down"}})
    with store.claim_due(store.clock(), limit=10) as claim:
        assert claim.messages == []
    assert store.next_due() == later
    with store.claim_due(later + timedelta(seconds=1), limit=10) as claim:
        [m] = claim.messages
        assert m.failures == 1 and m.headers["why"] == "broker down" and m.body == b"body-1"
        claim.remove(["m-1"])
    assert store.count_scheduled() == {}


def test_ids_are_stored_once_and_a_window_and_exclusions_bound_the_claim(store):
    assert store.store([msg(1, -1), msg(1, -1), msg(2, -1, "refunds")]) == 2
    assert store.store([msg(1, -1)]) == 0
    with store.claim_due(store.clock(), limit=10, exclude=["refunds"]) as claim:
        assert [m.message_id for m in claim.messages] == ["m-1"]
    cutoff = utcnow() - timedelta(seconds=10)
    with store.claim_due(store.clock(), limit=10, due_before=cutoff) as claim:
        assert claim.messages == []
    assert store.count_scheduled() == {"orders": 1, "refunds": 1}
    assert store.next_due("refunds") is not None and store.next_due("nowhere") is None


def test_a_sooner_message_wakes_a_waiting_store(store):
    woke = threading.Event()

    def wait():
        store.wait(utcnow() + timedelta(seconds=20))
        woke.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    store.store([msg(1, -1)])
    # Woken by the store (PostgreSQL's NOTIFY, the fake's condition) or by its short poll (SQLite).
    assert woke.wait(5.0)
