"""One check for the typed parameters every layer takes: an int or a number in a range, never a bool.

bool is an int subclass, so `True` would pass as 1 wherever only `isinstance(x, int)` is asked; a DAG
author's `batch_size=True` is a mistake, and the error says what was wrong and what is allowed.
"""

from __future__ import annotations

import math

from airflow_delay_provider.core.errors import InvalidInputError


def _allowed(low: float | None, high: float | None, above: float | None) -> str:
    if low is not None and high is not None:
        return f" in {low:g}..{high:g}"
    if above is not None:
        return f" > {above:g}"
    if low is not None:
        return f" >= {low:g}"
    return f" <= {high:g}" if high is not None else ""


def check_int(name: str, value: object, low: int | None = None, high: int | None = None, *, unit: str = "",
              hint: str = "", error: type[Exception] = InvalidInputError) -> int:
    """`value` if it is an int (not a bool) in `low`..`high` (either may be open); else `error` saying
    "<name> must be an int <range>[ <unit>][ (<hint>)], got <value>"."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) \
            or (high is not None and value > high):
        note = f" ({hint})" if hint else ""
        raise error(f"{name} must be an int{_allowed(low, high, None)}{unit and ' ' + unit}{note}, got {value!r}")
    return value


def check_number(name: str, value: object, low: float | None = None, high: float | None = None, *,
                 above: float | None = None, what: str = "a number", hint: str = "",
                 error: type[Exception] = InvalidInputError) -> float:
    """`value` if it is a finite int or float (not a bool) in `low`..`high`, and more than `above` when given;
    else `error` saying "<name> must be <what> <range>[ (<hint>)], got <value>"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (low is not None and value < low) or (high is not None and value > high) \
            or (above is not None and value <= above):
        note = f" ({hint})" if hint else ""
        raise error(f"{name} must be {what}{_allowed(low, high, above)}{note}, got {value!r}")
    return value
