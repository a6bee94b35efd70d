"""The SQS transport's pure parts: delay-queue names and delay plans (no SQS needed)."""

from __future__ import annotations

import pytest

from airflow_delay_provider.core.errors import DelayError
from airflow_delay_provider.transports.sqs import delay_plan, delay_queue_name, estimate_cost


def test_delay_queue_names_and_limits():
    assert delay_queue_name("orders") == "orders-delay.fifo"
    assert delay_queue_name("destination-delay.blurb") == "destination-delay-blurb-delay.fifo"
    assert delay_queue_name("a.b c", prefix="dev.") == "dev-a-b-c-delay.fifo"
    name69 = "n" * 69
    assert len(delay_queue_name(name69)) == 80
    with pytest.raises(ValueError, match="81 characters; SQS allows 80"):
        delay_queue_name(name69 + "x")


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
