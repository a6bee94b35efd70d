"""The one check for typed parameters: ints and numbers in a range, never a bool, with an error that says what
was wrong and what is allowed."""

import math

import pytest

from airflow_delay_provider.core.checks import check_int, check_number
from airflow_delay_provider.core.errors import DelayError, InvalidInputError


def test_an_int_in_range_is_returned_and_anything_else_says_the_range():
    assert check_int("batch_size", 10, 1, 10_000) == 10
    for bad in (0, 10_001, True, 5.0, "5", None):
        with pytest.raises(InvalidInputError, match=rf"^batch_size must be an int in 1\.\.10000, got {bad!r}$"):
            check_int("batch_size", bad, 1, 10_000)
    with pytest.raises(InvalidInputError, match=r"^n must be an int >= 1, got 0$"):
        check_int("n", 0, 1)
    with pytest.raises(InvalidInputError, match=r"^n must be an int <= 3, got 4$"):
        check_int("n", 4, high=3)


def test_the_unit_hint_and_error_class_are_the_callers():
    with pytest.raises(DelayError, match=r"^queue_delay must be an int in 1\.\.900 seconds \(SQS's limit\), got 901$"):
        check_int("queue_delay", 901, 1, 900, unit="seconds", hint="SQS's limit", error=DelayError)


def test_a_number_must_be_finite_and_not_a_bool():
    assert check_number("jitter", 0.5, 0, 1) == 0.5 and check_number("jitter", 1, 0, 1) == 1
    for bad in (math.nan, math.inf, -math.inf, True, "0.5", 1.5):
        with pytest.raises(InvalidInputError, match=r"^jitter must be a fraction in 0\.\.1, got "):
            check_number("jitter", bad, 0, 1, what="a fraction")


def test_above_is_exclusive_and_low_inclusive():
    assert check_number("t", 0.001, above=0) == 0.001
    with pytest.raises(InvalidInputError, match=r"^t must be a number > 0, got 0$"):
        check_number("t", 0, above=0)
    assert check_number("w", 0, 0, hint="0 turns it off") == 0
    with pytest.raises(InvalidInputError, match=r"^w must be a number >= 0 \(0 turns it off\), got -1$"):
        check_number("w", -1, 0, hint="0 turns it off")
