"""Which partition a message goes to (stores/tables.py), without a database: `_soon`, an hour's partition, `_far`."""

from __future__ import annotations

import random

import pytest

from airflow_delay_provider.stores.tables import (
    FIRST_HOUR,
    HOUR_US,
    LATER,
    RING_HOURS,
    SOON,
    SOON_US,
    hour_tier,
    ring_until,
    tier_of,
)

NOW = 1_795_000_000 * 1_000_000 + 1_234_567  # a moment inside an hour (µs since the epoch)


def test_without_the_hours_partitions_there_are_two_tiers():
    assert tier_of(NOW + SOON_US, NOW) == SOON
    assert tier_of(NOW + SOON_US + 1, NOW) == LATER
    assert tier_of(NOW + 30 * 86_400_000_000, NOW) == LATER


def test_a_day_ahead_goes_to_its_hours_partition_and_beyond_the_reach_to_far():
    assert tier_of(NOW + SOON_US + 1, NOW, ring=True) == hour_tier(NOW + SOON_US + 1)
    assert tier_of(NOW + 86_400_000_000, NOW, ring=True) == hour_tier(NOW + 86_400_000_000)  # every day-long delay
    last = ring_until(NOW) - 1
    assert tier_of(last, NOW, ring=True) == FIRST_HOUR + (last // HOUR_US) % RING_HOURS
    assert tier_of(ring_until(NOW), NOW, ring=True) == LATER
    assert tier_of(NOW - 1, NOW, ring=True) == SOON


@pytest.mark.parametrize("seed", range(5))
def test_no_send_goes_to_the_partition_of_the_hour_past(seed):
    """The hour just past rests (empty, truncated) until its partition serves the hour `RING_HOURS` later: no send
    at any moment of the current hour reaches it, and the hours in reach each have their own partition."""
    rng = random.Random(seed)
    for _ in range(2_000):
        now = rng.randrange(0, 2**52)
        resting = hour_tier((now // HOUR_US - 1) * HOUR_US)
        due = now + rng.randrange(SOON_US + 1, ring_until(now) - now)
        tier = tier_of(due, now, ring=True)
        assert FIRST_HOUR <= tier < FIRST_HOUR + RING_HOURS and tier != resting
    hours = {hour_tier(NOW + h * HOUR_US) for h in range(RING_HOURS - 1)}
    assert len(hours) == RING_HOURS - 1 and hour_tier((NOW // HOUR_US - 1) * HOUR_US) not in hours


def test_the_hours_partitions_are_vacuumed_at_a_fifth_of_their_rows_dead_not_at_a_fiftieth():
    """Truncated once their hour is past, they are vacuumed only to keep the dead entries the move passes over few:
    at 100,000 + 20% of their rows dead, not 10,000 + 2% (which near the end of an hour, with few rows left, would
    call for a pass over every index of a partition of millions every few seconds)."""
    from airflow_delay_provider.stores.upkeep import Thresholds

    t = Thresholds()
    assert t.work(2_000_000, 60_000, 0) == ["vacuum"]
    assert t.work(2_000_000, 60_000, 0, emptied=True) == []
    assert t.work(2_000_000, 500_001, 0, emptied=True) == ["vacuum"]
    assert t.work(1_000, 90_000, 0, emptied=True) == []
