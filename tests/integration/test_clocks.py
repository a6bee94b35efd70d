"""Hosts whose clocks disagree: every time a transport computes or compares is on one clock per path.

RabbitMQ's remaining delays count from the clock given by use_clock() (the store's); the SQL transport's times are
its database's, whatever the clock of the host that sends, receives, peeks, releases or counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta
from unittest.mock import patch

from sqlalchemy import func, select

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore, from_us
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.helpers import collect, make_store, messages

#: How far apart two clocks on the same database may read: the offset is measured to within half a round trip.
TOLERANCE = 2.0


def skewed(seconds: float) -> Callable[[], datetime]:
    return lambda: utcnow() + timedelta(seconds=seconds)


class Host:
    """The SQL transport as a host whose clock is `seconds` off sees the queue tables of this test: whatever reads
    now there reads it off, the transport's local clock and the module's utcnow alike (so a time taken from the
    host's clock directly shows)."""

    def __init__(self, pg, seconds: float) -> None:
        url, schema, table = pg
        self.clock = skewed(seconds)
        self.transport = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_", local_clock=self.clock)
        self.provision("orders")

    def __getattr__(self, name: str):
        attribute = getattr(self.transport, name)
        if not callable(attribute):
            return attribute

        def on_this_host(*args, **kwargs):
            with patch("airflow_delay_provider.transports.sql.utcnow", self.clock):
                return attribute(*args, **kwargs)

        return on_this_host


def database_now(transport) -> datetime:
    with transport.engine.connect() as conn:
        return conn.execute(select(func.clock_timestamp())).scalar()


def apart(a: datetime, b: datetime) -> float:
    return abs((a - b).total_seconds())


def receive_within(transport, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while not (got := transport.receive("orders")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


# -- RabbitMQ: native delays ---------------------------------------------------------------------------------
def test_a_native_delay_counts_from_the_stores_clock_not_the_hosts(rabbit):
    rabbit.provision("timed")
    store_clock = skewed(60)  # the store's (the database's) clock runs 60 s ahead of this host's
    rabbit.use_clock(store_clock)
    due = store_clock() + timedelta(seconds=2)
    sent = utcnow()
    assert rabbit.send([DelayedMessage("timed", b"x", due, {}, "skew-1")]) == {}
    got = collect(rabbit, "timed", 1, timeout=15)
    assert got, "not delivered within 15 s of its due time: the delay was counted on this host's clock"
    [(arrived, m)] = got
    assert 1.5 <= (arrived - sent).total_seconds() <= 5.0, (arrived - sent).total_seconds()
    # Received on the transport's clock too, so lateness (enqueued_at - due_at) compares like with like.
    assert apart(m.enqueued_at, store_clock()) < TOLERANCE and m.due_at == due


# -- the SQL transport: every time on its database's clock ---------------------------------------------------
def test_a_message_sent_from_a_host_ahead_is_visible_at_once_on_a_host_behind(pg):
    ahead, behind = Host(pg, 30), Host(pg, -30)
    assert ahead.send(messages(1)) == {}
    now = database_now(behind)
    assert behind.depth("orders") == {"visible": 1, "in_flight": 0}
    assert [m.message_id for m in behind.peek("orders")] == ["m-0"]
    [m] = behind.receive("orders")
    assert apart(m.enqueued_at, now) < TOLERANCE, f"enqueued at {m.enqueued_at}, the database says {now}"
    with ahead.engine.connect() as conn:
        created = conn.execute(select(ahead.queues.c.created_at_us)).scalar()
    assert apart(from_us(created), now) < TOLERANCE + 1


def test_a_received_message_stays_hidden_for_its_visibility_timeout_on_every_host(pg):
    behind, ahead = Host(pg, -30), Host(pg, 30)
    assert behind.send(messages(1)) == {}
    [taken] = behind.receive("orders", visibility_timeout=3)
    hidden = time.monotonic()
    # A host 60 s ahead of the receiver must not see it before the receiver's 3 s are up.
    assert ahead.receive("orders") == [] and ahead.peek("orders") == []
    assert ahead.depth("orders") == {"visible": 0, "in_flight": 1}
    [again] = receive_within(ahead, timeout=15)
    waited = time.monotonic() - hidden
    assert 2.5 <= waited <= 3 + TOLERANCE, f"visible again after {waited:.1f} s, not 3"
    assert (again.message_id, again.receive_count) == (taken.message_id, 2)


def test_a_released_message_is_visible_at_once_on_every_host(pg):
    ahead, behind = Host(pg, 30), Host(pg, -30)
    assert ahead.send(messages(1)) == {}
    [taken] = ahead.receive("orders", visibility_timeout=600)
    assert ahead.release("orders", [taken.receipt]) == 1
    assert behind.depth("orders") == {"visible": 1, "in_flight": 0}
    assert [m.message_id for m in behind.peek("orders")] == ["m-0"]
    assert [m.message_id for m in behind.receive("orders")] == ["m-0"]


def test_sent_and_moved_messages_are_on_one_clock(pg):
    """move_due stamps moved rows on the database's clock inside the database; rows a skewed host sends must agree,
    or a receiver sees one kind early or late and the queue's times cannot be compared."""
    url, schema, table = pg
    store = make_store(url, schema, table)
    behind, ahead = Host(pg, -30), Host(pg, 30)
    store.store(messages(1, start=1))
    assert [(d, n) for d, _, n in ahead.move_due(store, store.clock(), 10)] == [("orders", 1)]
    assert ahead.send(messages(1)) == {}
    now = database_now(behind)
    got = {m.message_id: m for m in behind.receive("orders")}  # the host behind sees both at once
    assert set(got) == {"m-0", "m-1"}
    assert apart(got["m-0"].enqueued_at, got["m-1"].enqueued_at) < TOLERANCE
    assert all(apart(m.enqueued_at, now) < TOLERANCE for m in got.values())


def test_the_sql_transport_keeps_its_times_on_its_database_clock_whatever_use_clock_says(pg):
    """use_clock gives the store's clock for remaining delays; the SQL transport has none, and its visibility times
    must agree with every other reader of its tables, so they stay on its database's clock."""
    plain = Host(pg, 0)
    given = Host(pg, 0).transport.use_clock(skewed(60))
    assert given.send(messages(1)) == {}
    assert apart(given.clock(), database_now(plain)) < TOLERANCE
    [taken] = given.receive("orders", visibility_timeout=2)
    hidden = time.monotonic()
    assert plain.receive("orders") == []
    [again] = receive_within(plain, timeout=15)
    assert 1.5 <= time.monotonic() - hidden <= 2 + TOLERANCE and again.message_id == taken.message_id


class SluggishWhileMeasured:
    """This host's clock, as a busy host reads it: each reading is taken, then the process is held up for a while
    before it goes on (so a request sent right after a reading leaves late), while `measuring`."""

    def __init__(self, hold: float = 0.05) -> None:
        self.hold, self.measuring = hold, True

    def __call__(self) -> datetime:
        now = utcnow()
        if self.measuring:
            time.sleep(self.hold)
        return now


def test_the_database_clock_is_never_read_ahead_of_the_database(pg):
    """The offset to the database's clock is measured over a round trip that may be lopsided (a request that left
    late, a reply read at once): taking the middle of the round trip then reads the database's clock ahead of
    itself, and a pump would claim, and a broker deliver, a message before it is due. Whatever the round trip,
    the store's clock may run behind the database's, never ahead."""
    url, schema, table = pg
    host = SluggishWhileMeasured()
    store = SqlDelayedMessageStore(url, table=table, schema=schema, local_clock=host)
    store.clock()  # measures the offset, each reading held up for 50 ms
    host.measuring = False
    for _ in range(20):
        estimate = store.clock()
        assert estimate <= database_now(store), "the store's clock ran ahead of the database's"


def lagging_transport(pg) -> SqlTableTransport:
    """The SQL transport of a busy host, which read the reply of its clock measurement half a second late: its
    estimate of the database clock lags the database's (and the store's) by that much until measured again."""
    url, schema, table = pg
    measuring = [True]

    def read_late() -> datetime:
        if measuring[0]:
            time.sleep(0.5)
        return utcnow()

    transport = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_", local_clock=read_late)
    transport.provision("orders")
    assert transport.clock() < database_now(transport) - timedelta(seconds=0.4)  # the estimate lags
    measuring[0] = False
    return transport


def test_a_moved_message_is_visible_at_once_though_this_hosts_estimate_of_the_database_clock_lags(pg):
    """A move stamps rows with the database's clock; the transport's estimate of that clock may lag it by a whole
    round trip of its measurement (a busy host), so comparing visibility times with the estimate hid rows just
    moved until the estimate caught up. Visibility is compared with the database's own clock."""
    store = make_store(*pg)
    transport = lagging_transport(pg)
    # Due a second ago: the store's own estimate of the database clock may lag the host's by its round trip.
    store.store(messages(1, delay=-1))
    assert [(d, n) for d, _, n in transport.move_due(store, store.clock(), 10)] == [("orders", 1)]
    assert transport.depth("orders") == {"visible": 1, "in_flight": 0}
    assert [m.message_id for m in transport.peek("orders")] == ["m-0"]
    assert [m.message_id for m in transport.receive("orders")] == ["m-0"]


def test_a_claimed_message_sent_through_send_is_never_stamped_before_its_due_time(pg):
    """A pump sends what the move into the queue table left (rows that fell due after it, throttled destinations)
    with `send`, which stamped the rows with the transport's estimate of the database clock. That estimate may lag
    the store's, by which the claim found the message due, by the round trip of its measurement: in a soak on a
    busy machine 1,826 of 19.6 million messages were stamped enqueued before their due time."""
    store = make_store(*pg)
    transport = lagging_transport(pg)
    store.store(messages(1, delay=-0.2))  # due by the store's clock, not yet by the transport's estimate
    with store.claim_due(store.clock(), 10) as claim:
        assert [m.message_id for m in claim.messages] == ["m-0"]
        assert transport.send(claim.messages) == {}
        claim.remove(["m-0"])
    [m] = transport.receive("orders")
    assert m.enqueued_at >= m.due_at, f"enqueued {(m.due_at - m.enqueued_at).total_seconds():.3f} s before due"
