"""The SQS transport's pure parts: delay-queue names, delay plans and the relay loop (no SQS needed)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import DelayError
from airflow_delay_provider.transports.sqs import (
    RelayCounts,
    SqsTransport,
    delay_plan,
    delay_queue_name,
    estimate_cost,
)


def test_delay_queue_names_and_limits():
    assert delay_queue_name("orders") == "orders-delay.fifo"
    assert delay_queue_name("destination-delay.blurb") == "destination-delay-blurb-delay.fifo"
    assert delay_queue_name("a.b c", prefix="dev.") == "dev-a-b-c-delay.fifo"
    name69 = "n" * 69
    assert len(delay_queue_name(name69)) == 80
    with pytest.raises(ValueError, match="81 characters; SQS allows 80"):
        delay_queue_name(name69 + "x")


def test_a_fifo_endpoints_delay_queue_is_a_standard_queue_of_its_own():
    assert delay_queue_name("orders.fifo") == "orders-fifo-delay"
    assert delay_queue_name("orders.fifo", prefix="dev-") == "dev-orders-fifo-delay"
    # Before, `x.fifo` and `x-fifo` shared `x-fifo-delay.fifo`; a standard endpoint keeps its name.
    assert delay_queue_name("x.fifo") != delay_queue_name("x-fifo") == "x-fifo-delay.fifo"
    name74 = "n" * 69 + ".fifo"
    assert len(delay_queue_name(name74)) == 80
    with pytest.raises(ValueError, match="81 characters; SQS allows 80, so the endpoint name may have at most 74"):
        delay_queue_name("x" + name74)


def test_batches_are_cut_at_ten_entries_or_a_mebibyte_attributes_included():
    from airflow_delay_provider.transports.sqs.transport import _chunks

    attribute = {"x-message-id": {"DataType": "String", "StringValue": "m"}}  # 12 + 6 + 1 bytes
    small = [{"MessageBody": "x", "MessageAttributes": attribute} for _ in range(25)]
    assert [len(c) for c in _chunks(small)] == [10, 10, 5]
    # Four bodies of 256 KiB are exactly 1 MiB: with their attributes, the fourth goes in the next batch.
    big = [{"MessageBody": "x" * 256 * 1024, "MessageAttributes": attribute} for _ in range(5)]
    assert list(_chunks(big)) == [[0, 1, 2], [3, 4]]
    assert list(_chunks([{"MessageBody": "x" * 256 * 1024} for _ in range(5)])) == [[0, 1, 2, 3], [4]]


def test_worked_examples_and_the_cost_of_a_year():
    assert delay_plan(845) == delay_plan(845.0)
    p = delay_plan(845)
    assert (p.native, p.fifo_cycles, p.final_delay) == (True, 0, 845)
    p = delay_plan(1925)
    assert (p.native, p.fifo_cycles, p.final_delay) == (False, 2, 125)
    assert delay_plan(900).native and not delay_plan(901).native
    assert delay_plan(1800).fifo_cycles == 1 and delay_plan(1800).final_delay == 900
    assert estimate_cost(31_536_000) == pytest.approx(0.035, abs=0.0002)
    assert estimate_cost(845) == 0
    with pytest.raises(DelayError):
        delay_plan(-1)
    with pytest.raises(DelayError, match="1..900"):
        delay_plan(10, queue_delay=1000)


def test_the_send_log_says_how_each_destination_carries_a_delay():
    t = SqsTransport(client=None, queue_delay=900)
    assert t.describe_delay(845, "orders").startswith("845 s = native DelaySeconds")
    assert t.describe_delay(1925, "orders").startswith("1925 s = 2 cycle(s) through the delay queue, then 125 s")
    # A FIFO queue takes no per-message delay: even a short one waits in the endpoint's delay queue.
    assert t.describe_delay(30, "orders.fifo") == ("30 s = 1 hop(s) of at most 900 s through 'orders-fifo-delay', "
                                                   "then handed over with no delay; relay cost about $0.000001")
    assert t.describe_delay(1925, "orders.fifo").startswith("1925 s = 3 hop(s)")
    assert t.describe_delay(0, "orders.fifo") == "0 s = straight to the FIFO queue"


class ScriptedRelay(SqsTransport):
    """A relay whose delay queue shows `visible` messages, and whose each poll relays one of them."""

    def __init__(self, visible: list[int]) -> None:
        super().__init__(client=None)
        self.visible = visible
        self.polls: list[tuple[int, object]] = []

    def lifecycle(self, endpoint: str, delay_queue: bool = False) -> dict[str, int]:
        assert delay_queue
        return {"scheduled": 0, "visible": self.visible.pop(0) if self.visible else 0, "in_flight": 0}

    def relay_once(self, endpoint, wait_time_seconds=20, visibility_timeout=30, throttle=None,
                   error_queue="error") -> RelayCounts:
        self.polls.append((wait_time_seconds, throttle))
        time.sleep(0.01)  # a long poll takes a while
        return RelayCounts(relayed=1)


def test_the_relay_loop_stops_at_its_deadline_or_when_idle_and_adds_up_its_counts():
    relay, totals = ScriptedRelay([2, 1, 0]), RelayCounts(handed_over=5)
    assert relay.relay_until("orders", utcnow() + timedelta(seconds=30), totals, until_idle=True) == "idle"
    assert totals == RelayCounts(relayed=2, handed_over=5) and len(relay.polls) == 2
    # Polls never outlast the deadline; one throttle for the whole call.
    relay = ScriptedRelay([])
    stopped = relay.relay_until("orders", utcnow() + timedelta(seconds=0.3), RelayCounts(), wait_time_seconds=20,
                                max_per_second=5)
    assert stopped == "deadline" and relay.polls
    assert all(wait == 0 for wait, _ in relay.polls) and len({id(t) for _, t in relay.polls}) == 1
    assert relay.polls[0][1].rate == 5
    relay = ScriptedRelay([])
    assert relay.relay_until("orders", utcnow() - timedelta(seconds=1), RelayCounts(), until_idle=True) == "deadline"
    assert relay.polls == []
