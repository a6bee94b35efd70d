"""send_natively: every retry loop ends, and what the broker accepted is recorded once."""

from datetime import timedelta

import pytest

from airflow_delay_provider.core.breakers import CircuitBreaker
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import CriticalError, DelayProviderError, InvalidInputError, UnavailableError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.core.sending import send_natively
from airflow_delay_provider.testing import InMemoryTransport


class Clock:
    """A monotonic clock whose sleeps advance it, and which refuses to loop forever."""

    def __init__(self, max_sleeps: int = 1000):
        self.now, self.sleeps, self.max_sleeps = 0.0, 0, max_sleeps

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps += 1
        assert self.sleeps < self.max_sleeps, "the send loop did not end"
        self.now += seconds


class Ids:
    def __init__(self):
        self.sent: list[str] = []

    def unseen(self, ids):
        return [i for i in ids if i not in self.sent]

    def remember_sent(self, ids):
        self.sent.extend(ids)


class Flaky(InMemoryTransport):
    """Sends what `accept(attempt, message)` allows and reports the rest as an outage (or `refuse` as refused)."""

    def __init__(self, accept, refuse=()):
        super().__init__()
        self.accept, self.refuse, self.attempts, self.delivered = accept, set(refuse), 0, []

    def send(self, messages, connection=None):
        self.attempts += 1
        failures = {}
        for m in messages:
            if m.message_id in self.refuse:
                failures[m.message_id] = InvalidInputError(f"{m.message_id} is too large")
            elif self.accept(self.attempts, m):
                self.delivered.append(m.message_id)
            else:
                failures[m.message_id] = UnavailableError("broker down")
        return failures


def batch(n):
    return [DelayedMessage("orders", b"x", utcnow() + timedelta(seconds=60), message_id=f"m{i}") for i in range(n)]


def test_an_outage_that_never_ends_trips_the_breaker_even_though_the_store_answers():
    clock = Clock()
    transport = Flaky(accept=lambda attempt, m: False)
    transport.provision("orders")
    with pytest.raises(CriticalError, match="kept failing for 30 s.*broker down"):
        send_natively(Ids(), transport, batch(3), CircuitBreaker("sending", 30, clock=clock, sleep=clock.sleep))
    assert transport.delivered == []
    assert clock.sleeps == 30  # one wait per failed attempt until the breaker trips, no more


def test_partial_progress_sends_each_message_once_and_ends():
    clock = Clock()
    ids = Ids()
    # Each attempt the broker takes one more message; the others wait for the next attempt.
    transport = Flaky(accept=lambda attempt, m: int(m.message_id[1:]) < attempt)
    transport.provision("orders")
    sent = send_natively(ids, transport, batch(5), CircuitBreaker("sending", 3, clock=clock, sleep=clock.sleep))
    assert sent == 5
    assert sorted(transport.delivered) == [f"m{i}" for i in range(5)]  # once each
    assert sorted(ids.sent) == [f"m{i}" for i in range(5)]


def test_a_refused_message_fails_the_call_after_the_others_are_recorded_once():
    clock = Clock()
    ids = Ids()
    transport = Flaky(accept=lambda attempt, m: True, refuse={"m3"})
    transport.provision("orders")
    with pytest.raises(DelayProviderError, match=r"1 of 5 message\(s\) were refused.*m3: m3 is too large"):
        send_natively(ids, transport, batch(5), CircuitBreaker("sending", 30, clock=clock, sleep=clock.sleep))
    assert sorted(transport.delivered) == ["m0", "m1", "m2", "m4"]
    assert sorted(ids.sent) == ["m0", "m1", "m2", "m4"]
    assert transport.attempts == 1 and clock.sleeps == 0
