"""Migration both ways over the in-memory fakes: nothing leaves its old home before its new one has it."""

from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import DestinationNotFoundError, InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.migration import hand_over, take_back
from airflow_delay_provider.testing import InMemoryStore, InMemoryTransport


def later(n: int, destination: str = "orders") -> list[DelayedMessage]:
    start = utcnow() + timedelta(hours=1)
    return [DelayedMessage(destination, f"b-{i}".encode(), start + timedelta(seconds=i), {"k": str(i)}, f"m-{i}")
            for i in range(n)]


def provisioned() -> InMemoryTransport:
    transport = InMemoryTransport()
    transport.provision("orders")
    return transport


def test_hand_over_moves_every_stored_message_due_or_not_keeping_due_times():
    store, transport = InMemoryStore(), provisioned()
    pending = later(5)
    store.store([*pending, DelayedMessage("orders", b"now", utcnow() - timedelta(seconds=1), message_id="due")])
    assert hand_over(store, transport, batch_size=2) == {"moved": 6, "left_in_store": 0, "errors": {}}
    assert store.count_scheduled() == {}
    # The due one is delivered at once; the others wait in the transport for their own due times.
    assert transport.depth("orders") == {"visible": 1, "in_flight": 0, "scheduled": 5}
    taken = [h.message for h in transport.take_held(10)]
    assert sorted(taken, key=lambda m: m.message_id) == pending  # same ids, bodies, headers and due times


def test_hand_over_counts_remaining_delays_on_the_stores_clock():
    # The store's clock (the database's) runs a minute ahead of this host's: a message due by the store's
    # clock is due on the transport too, not held for another minute by the host's.
    store = InMemoryStore(clock=lambda: utcnow() + timedelta(seconds=60))
    transport = provisioned()
    store.store([DelayedMessage("orders", b"x", store.clock() - timedelta(seconds=1), message_id="due")])
    store.store([DelayedMessage("orders", b"y", store.clock() + timedelta(hours=1), message_id="later")])
    assert hand_over(store, transport)["moved"] == 2
    assert transport.depth("orders") == {"visible": 1, "in_flight": 0, "scheduled": 1}


def test_hand_over_leaves_refused_messages_stored_and_stops_at_a_batch_refused_whole():
    store, transport = InMemoryStore(), provisioned()
    store.store([*later(3), DelayedMessage("nowhere", b"x", utcnow(), message_id="lost")])
    result = hand_over(store, transport, batch_size=10)
    assert result["moved"] == 3 and store.count_scheduled() == {"nowhere": 1}
    assert "DestinationNotFoundError" in result["errors"]["lost"]
    # A batch refused as a whole ends the move instead of claiming the same messages forever.
    assert hand_over(store, transport) == {"moved": 0, "left_in_store": 1, "errors": result["errors"]}


def test_take_back_moves_held_messages_into_the_store_and_unreadable_ones_to_poison():
    store, transport = InMemoryStore(), provisioned()
    sent = later(7)
    assert transport.send(sent) == {}
    transport.hold_unreadable(b"no headers")
    assert take_back(store, transport, batch_size=3) == {"moved": 7, "poisoned": 1}
    for m in sent:
        assert store.get(m.message_id) == m  # same id, destination, body, headers and due time
    assert transport.poisoned == [b"no headers"]
    assert transport.take_held(10) == [] and transport.depth("orders")["scheduled"] == 0


def test_take_back_leaves_due_messages_to_their_queue():
    store, transport = InMemoryStore(), provisioned()
    transport.send([DelayedMessage("orders", b"due", utcnow() - timedelta(seconds=1), message_id="due"), *later(1)])
    assert take_back(store, transport) == {"moved": 1, "poisoned": 0}
    assert [m.message_id for m in transport.receive("orders")] == ["due"]


class Recording(InMemoryTransport):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def ack_held(self, receipts):
        receipts = list(receipts)
        self.log.append(f"ack {len(receipts)}")
        return super().ack_held(receipts)


class CommitLog(InMemoryStore):
    def __init__(self, log: list[str], fail_after: int | None = None) -> None:
        super().__init__()
        self.log, self.fail_after = log, fail_after

    def store(self, messages, deduplicate=True):
        if self.fail_after is not None and len([e for e in self.log if e.startswith("commit")]) >= self.fail_after:
            raise UnavailableError("the database is down")
        stored = super().store(messages, deduplicate)
        self.log.append(f"commit {len(messages)}")
        return stored


def test_take_back_acks_a_batch_only_after_the_store_committed_it():
    log: list[str] = []
    store, transport = CommitLog(log), Recording(log)
    transport.provision("orders")
    transport.send(later(5))
    take_back(store, transport, batch_size=2)
    assert log == ["commit 2", "ack 2", "commit 2", "ack 2", "commit 1", "ack 1"]


def test_when_the_store_fails_the_batch_goes_back_to_waiting_and_nothing_is_lost():
    log: list[str] = []
    store, transport = CommitLog(log, fail_after=1), Recording(log)
    transport.provision("orders")
    transport.send(later(5))
    with pytest.raises(UnavailableError, match="database is down"):
        take_back(store, transport, batch_size=2)
    assert log == ["commit 2", "ack 2"]  # the failed batch was never acknowledged...
    assert transport.depth("orders")["scheduled"] == 3  # ... but released, not left hidden
    store.fail_after = None
    assert take_back(store, transport, batch_size=2) == {"moved": 3, "poisoned": 0}
    assert sorted(store.count_scheduled().items()) == [("orders", 5)]


def test_a_message_taken_twice_is_stored_once():
    """At least once: a batch stored but not acknowledged (a crash) comes again; the store skips its ids."""
    store, transport = InMemoryStore(), provisioned()
    transport.send(later(3))
    held = transport.take_held(10)
    store.store([h.message for h in held if h.message], deduplicate=False)
    transport.release_held([h.receipt for h in held])  # as the broker does when the channel closes unacked
    assert take_back(store, transport) == {"moved": 3, "poisoned": 0}
    assert store.count_scheduled() == {"orders": 3}


def test_taking_back_needs_a_transport_that_holds_messages():
    class Plain(InMemoryTransport):
        can_take_back = False

    with pytest.raises(InvalidInputError, match="holds no delayed messages"):
        take_back(InMemoryStore(), Plain())


def test_a_transport_refuses_what_it_cannot_hold():
    transport = provisioned()
    failures = transport.send(later(1, "nowhere"))
    assert isinstance(failures["m-0"], DestinationNotFoundError) and transport.take_held(10) == []
