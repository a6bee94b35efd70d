"""The delivery history's pure rules: grouping a settled batch, the checks of its inputs, the per-minute chart's
nearest-rank quantiles and a message's story."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.history import (
    CANCELLED,
    DEAD_LETTERED,
    DELIVERED,
    MAX_DETAIL,
    RETRIED,
    Delivery,
    Settled,
    check_history_days,
    check_outcome,
    check_window,
    entries_of,
    minute_series,
    rank,
    settled_groups,
    story_report,
)
from airflow_delay_provider.core.message import DelayedMessage

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_a_batch_is_grouped_by_outcome_and_failure():
    groups = settled_groups(["a", "b"], {"c": "boom", "d": "boom", "e": "other"}, {"f": "x" * 900})
    assert groups[0] == Settled(DELIVERED, ("a", "b"))
    assert sorted((g.outcome, g.message_ids, g.detail) for g in groups[1:]) == [
        (DEAD_LETTERED, ("f",), "x" * MAX_DETAIL), (RETRIED, ("c", "d"), "boom"), (RETRIED, ("e",), "other")]
    assert settled_groups([], {}, {}) == []
    assert settled_groups([], {"g": ""}, {}) == [Settled(RETRIED, ("g",), None)]  # a failure without words


def test_entries_count_this_attempt_but_not_for_a_cancel():
    messages = {m.message_id: m for m in (DelayedMessage.trusted("q", b"", T0, {}, "a", 2),
                                          DelayedMessage.trusted("q", b"", T0, {}, "b", 0))}
    done = entries_of([Settled(RETRIED, ("a",), "why"), Settled(CANCELLED, ("b",))], messages,
                      T0 + timedelta(seconds=1), {"a": T0 - timedelta(hours=1)})
    assert [(e.message_id, e.outcome, e.attempts, e.detail, e.lateness) for e in done] == [
        ("a", RETRIED, 3, "why", 1.0), ("b", CANCELLED, 0, None, 1.0)]
    assert done[0].as_dict()["stored_at"] == (T0 - timedelta(hours=1)).isoformat() and done[1].stored_at is None
    assert done[0].as_dict()["lateness_ms"] == 1000.0


@pytest.mark.parametrize("value", [-1, 91, 1.5, True, "7", None])
def test_history_days_must_be_whole_days_from_0_to_90(value):
    with pytest.raises(InvalidInputError, match=r"history_days must be an int in 0\.\.90 .*0 turns it off"):
        check_history_days(value)


def test_windows_and_outcomes_say_what_is_allowed():
    assert check_window("24h") == 86_400 and check_outcome("") is None and check_outcome(DELIVERED) == DELIVERED
    with pytest.raises(InvalidInputError, match="window must be one of 1h, 6h, 24h, got '2d'"):
        check_window("2d")
    with pytest.raises(InvalidInputError, match="outcome must be one of delivered, retried, dead_lettered, cancelled"):
        check_outcome("lost")


@given(st.lists(st.integers(0, 5_000_000), min_size=1, max_size=300), st.floats(0.01, 1.0))
def test_the_nearest_rank_is_the_smallest_value_with_that_share_at_or_below_it(values, q):
    ordered = sorted(values)
    chosen = ordered[rank(len(values), q) - 1]
    assert sum(v <= chosen for v in values) >= q * len(values)
    assert sum(v < chosen for v in values) < q * len(values)


def test_the_chart_counts_each_minute_and_leaves_out_empty_ones():
    def entry(second: int, late_ms: int, outcome: str = DELIVERED) -> Delivery:
        handed = T0 + timedelta(seconds=second)
        return Delivery(f"m{second}", "q", handed - timedelta(milliseconds=late_ms), handed, 1, outcome)

    entries = [entry(1, 5), entry(2, 1), entry(3, 900), entry(61, 2, RETRIED), entry(62, 3, DEAD_LETTERED),
               entry(200, 7), entry(4000, 1)]
    points = minute_series(entries, T0, T0 + timedelta(minutes=10))
    assert [(p["minute"], p["delivered"], p["p50_ms"], p["p99_ms"], p["retried"], p["dead_lettered"])
            for p in points] == [
        (T0.isoformat(), 3, 5.0, 900.0, 0, 0),
        ((T0 + timedelta(minutes=1)).isoformat(), 0, None, None, 1, 1),
        ((T0 + timedelta(minutes=3)).isoformat(), 1, 7.0, 7.0, 0, 0)]


def test_a_story_says_where_a_message_is():
    delivered = Delivery("a", "q", T0, T0 + timedelta(seconds=1), 2, DELIVERED, stored_at=T0 - timedelta(days=1))
    retried = Delivery("a", "q", T0, T0, 1, RETRIED, "boom", T0 - timedelta(days=1))
    story = story_report("a", None, [delivered, retried], 7)
    assert story["state"] == DELIVERED and [h["outcome"] for h in story["history"]] == [RETRIED, DELIVERED]
    assert story["stored_at"] == (T0 - timedelta(days=1)).isoformat() and story["history_days"] == 7
    row = {"message_id": "a", "stored_at": T0.isoformat()}
    assert story_report("a", row, [retried], 7)["state"] == "scheduled"
    assert story_report("zz", None, [], 7) == {"message_id": "zz", "state": "unknown", "scheduled": None,
                                              "stored_at": None, "history": [], "history_days": 7}
