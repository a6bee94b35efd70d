"""Delivery retry policies (SNS-style): four phases of retries, a backoff function, and throttling.

A policy says how long to wait before each retry of a failed dispatch:

1. immediate phase: `numNoDelayRetries` retries, no delay;
2. pre-backoff phase: `numMinDelayRetries` retries, `minDelayTarget` apart;
3. backoff phase: the remaining `numRetries - numNoDelayRetries - numMinDelayRetries -
   numMaxDelayRetries` retries, from `minDelayTarget` up to `maxDelayTarget`, shaped by the
   backoff function;
4. post-backoff phase: `numMaxDelayRetries` retries, `maxDelayTarget` apart.

Backoff functions, for k backoff retries i = 0..k-1, x = i / (k - 1), from min m to max M (each
starts exactly at m, ends exactly at M and never decreases; with one backoff retry it is m):

- linear:      m + (M - m) * x                                   (equal steps)
- arithmetic:  m + (M - m) * i(i+1) / ((k-1)k)                   (steps growing by a constant)
- geometric:   m + (M - m) * (1 - 2^-i) / (1 - 2^-(k-1))         (each step half the one before)
- exponential: m * (M/m)^x                                       (a constant ratio between delays;
               with m = 0: (M+1)^x - 1, a constant ratio of delay + 1)
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from airflow_delay_provider.core.errors import InvalidInputError

BACKOFF_FUNCTIONS = ("arithmetic", "exponential", "geometric", "linear")
MAX_RETRIES = 100
MAX_DELAY_TARGET = 3600
#: The built-in policies' names (SNS's, for its endpoint kinds).
BUILT_IN_POLICIES = ("sqs", "lambda", "smtp", "sms", "mobile-push", "http")

_RETRY_KEYS = {
    "minDelayTarget": "min_delay_target",
    "maxDelayTarget": "max_delay_target",
    "numRetries": "num_retries",
    "numNoDelayRetries": "num_no_delay_retries",
    "numMinDelayRetries": "num_min_delay_retries",
    "numMaxDelayRetries": "num_max_delay_retries",
    "backoffFunction": "backoff_function",
}


class PolicyError(InvalidInputError):
    """A delivery policy attribute is missing its allowed range or shape."""


def _int(name: str, value: Any, low: int, high: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f"{low}..{high}" if high is not None else f">= {low}"
        raise PolicyError(f"{name} is {value}; allowed: {allowed}")
    return value


@dataclass(frozen=True)
class DeliveryPolicy:
    min_delay_target: int = 20
    max_delay_target: int = 20
    num_retries: int = 3
    num_no_delay_retries: int = 0
    num_min_delay_retries: int = 0
    num_max_delay_retries: int = 0
    backoff_function: str = "linear"
    max_receives_per_second: int | None = None
    #: The built-in policies (SNS's own per protocol) exceed the limits of custom (HTTP) ones.
    builtin: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.builtin:
            return
        _int("numRetries", self.num_retries, 0, MAX_RETRIES)
        _int("maxDelayTarget", self.max_delay_target, 0, MAX_DELAY_TARGET)
        _int("minDelayTarget", self.min_delay_target, 0, None)
        if self.min_delay_target > self.max_delay_target:
            raise PolicyError(f"minDelayTarget ({self.min_delay_target}) is above maxDelayTarget "
                              f"({self.max_delay_target}); allowed: minDelayTarget <= maxDelayTarget (either one "
                              "left out is 20 s)")
        phases = 0
        for name in ("numNoDelayRetries", "numMinDelayRetries", "numMaxDelayRetries"):
            phases += _int(name, getattr(self, _RETRY_KEYS[name]), 0, None)
        if phases > self.num_retries:
            raise PolicyError(
                f"numNoDelayRetries + numMinDelayRetries + numMaxDelayRetries is {phases}; allowed: at most "
                f"numRetries ({self.num_retries})")
        if self.backoff_function not in BACKOFF_FUNCTIONS:
            raise PolicyError(f"backoffFunction is {self.backoff_function!r}; "
                              f"allowed: one of {list(BACKOFF_FUNCTIONS)}")
        if self.max_receives_per_second is not None:
            _int("maxReceivesPerSecond", self.max_receives_per_second, 1, None)

    # -- JSON ----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any) -> DeliveryPolicy:
        """The delivery-policy JSON: `healthyRetryPolicy` (missing attributes take the defaults) and an optional
        `throttlePolicy.maxReceivesPerSecond`."""
        if not isinstance(data, dict):
            raise PolicyError(f"a delivery policy must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"healthyRetryPolicy", "throttlePolicy"}
        if unknown:
            raise PolicyError(f"unknown delivery policy section(s) {sorted(unknown)}; "
                              "allowed: healthyRetryPolicy, throttlePolicy")
        # null means absent; any other non-object (0, "", []) is an error, not "no attributes"
        retry = {} if data.get("healthyRetryPolicy") is None else data["healthyRetryPolicy"]
        throttle = {} if data.get("throttlePolicy") is None else data["throttlePolicy"]
        if not isinstance(retry, dict) or not isinstance(throttle, dict):
            raise PolicyError("healthyRetryPolicy and throttlePolicy must be JSON objects")
        unknown = (set(retry) - set(_RETRY_KEYS)) | (set(throttle) - {"maxReceivesPerSecond"})
        if unknown:
            raise PolicyError(f"unknown delivery policy attribute(s) {sorted(unknown)}; allowed: {sorted(_RETRY_KEYS)} "
                              "and throttlePolicy.maxReceivesPerSecond")
        kwargs = {_RETRY_KEYS[k]: v for k, v in retry.items()}
        if "maxReceivesPerSecond" in throttle:
            kwargs["max_receives_per_second"] = throttle["maxReceivesPerSecond"]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, dict[str, int | str]]:
        data: dict[str, dict[str, int | str]] = {
            "healthyRetryPolicy": {k: getattr(self, v) for k, v in _RETRY_KEYS.items()}
        }
        if self.max_receives_per_second is not None:
            data["throttlePolicy"] = {"maxReceivesPerSecond": self.max_receives_per_second}
        return data

    # -- the schedule ------------------------------------------------------------------------------
    @property
    def num_backoff_retries(self) -> int:
        return self.num_retries - self.num_no_delay_retries - self.num_min_delay_retries - self.num_max_delay_retries

    @property
    def total_attempts(self) -> int:
        """Retries the policy allows, as SNS counts them (numRetries)."""
        return self.num_retries

    def retry_delays(self, jitter: float = 0.0, seed: int | None = None) -> list[float]:
        """Seconds to wait before each retry, in order: numRetries of them. With `jitter` (a fraction),
        each delay is spread reproducibly by `seed`, never outside [minDelayTarget, maxDelayTarget]."""
        m, big = float(self.min_delay_target), float(self.max_delay_target)
        delays = (
            [0.0] * self.num_no_delay_retries
            + [m] * self.num_min_delay_retries
            + backoff(self.backoff_function, self.num_backoff_retries, m, big)
            + [big] * self.num_max_delay_retries
        )
        if jitter:
            rng = random.Random(seed)
            delays = [self.jittered(d, jitter, rng) for d in delays]
        return delays

    def delay_before(self, retry: int) -> float:
        """Seconds before retry number `retry` (1-based), without building the whole list."""
        if not 1 <= retry <= self.num_retries:
            raise PolicyError(f"retry {retry} is outside this policy's 1..{self.num_retries}")
        i = retry - 1
        if i < self.num_no_delay_retries:
            return 0.0
        i -= self.num_no_delay_retries
        if i < self.num_min_delay_retries:
            return float(self.min_delay_target)
        i -= self.num_min_delay_retries
        if i < self.num_backoff_retries:
            return _backoff_at(self.backoff_function, i, self.num_backoff_retries,
                               float(self.min_delay_target), float(self.max_delay_target))
        return float(self.max_delay_target)

    def phase_of(self, retry: int) -> str:
        """The phase retry number `retry` (1-based) belongs to: immediate, pre-backoff, backoff or post-backoff."""
        if not 1 <= retry <= self.num_retries:
            raise PolicyError(f"retry {retry} is outside this policy's 1..{self.num_retries}")
        bounds = (("immediate", self.num_no_delay_retries), ("pre-backoff", self.num_min_delay_retries),
                  ("backoff", self.num_backoff_retries))
        left = retry
        for name, count in bounds:
            if left <= count:
                return name
            left -= count
        return "post-backoff"

    def gave_up(self, attempts: int, final: bool) -> str:
        """Why a message was dead-lettered after `attempts` attempts, as its dead letter's header says it: a final
        failure, no retries at all, or the last phase whose retries it used up."""
        if final:
            return "final failure: not retried"
        if self.num_retries == 0:
            return "the policy allows no retries"
        return (f"{self.phase_of(self.num_retries)} phase: all {self.num_retries} retries used "
                f"({attempts} attempts)")

    def total_duration(self) -> float:
        """Seconds from the first failure to the last retry."""
        m, big = float(self.min_delay_target), float(self.max_delay_target)
        return (self.num_min_delay_retries * m + sum(backoff(self.backoff_function, self.num_backoff_retries, m, big))
                + self.num_max_delay_retries * big)

    def jittered(self, delay: float, fraction: float = 0.1, rng: random.Random | None = None) -> float:
        """`delay` spread by up to +/- `fraction`, never outside [minDelayTarget, maxDelayTarget]
        (an immediate retry stays immediate)."""
        if delay <= 0:
            return 0.0
        rng = rng or random.Random()
        spread = delay * (1 + rng.uniform(-fraction, fraction))
        return min(max(spread, float(self.min_delay_target)), float(self.max_delay_target))

    def phase_table(self) -> str:
        """The phase table of this policy, for task logs."""
        rows = [
            ("immediate", self.num_no_delay_retries, "no delay"),
            ("pre-backoff", self.num_min_delay_retries, f"{self.min_delay_target} s apart"),
            ("backoff", self.num_backoff_retries,
             f"{self.backoff_function}, {self.min_delay_target} s to {self.max_delay_target} s"),
            ("post-backoff", self.num_max_delay_retries, f"{self.max_delay_target} s apart"),
        ]
        lines = ["phase         retries  delays"] + [f"{p:<13} {n:>7}  {d}" for p, n, d in rows]
        throttle = f"; at most {self.max_receives_per_second}/s" if self.max_receives_per_second else ""
        lines.append(f"total         {self.total_attempts:>7}  over {_human(self.total_duration())}{throttle}")
        return "\n".join(lines)

    # -- built-ins and shorthands --------------------------------------------------------------------
    @classmethod
    def for_endpoint(cls, kind: str) -> DeliveryPolicy:
        """SNS's built-in policies: sqs, lambda, smtp, sms, mobile-push; http takes the defaults."""
        if kind in ("sqs", "lambda"):
            return cls(1, 20, 100_015, 3, 2, 100_000, "exponential", builtin=True)
        if kind in ("smtp", "sms", "mobile-push"):
            return cls(10, 600, 50, 0, 2, 38, "exponential", builtin=True)
        if kind == "http":
            return cls()
        raise PolicyError(f"no built-in policy {kind!r}; choose one of {list(BUILT_IN_POLICIES)}")

    @classmethod
    def immediate(cls, number_of_retries: int) -> DeliveryPolicy:
        """The external store's flat NumberOfRetries: that many retries, at once."""
        n = _int("number_of_retries", number_of_retries, 0, MAX_RETRIES)
        return cls(0, 0, n, n, 0, 0)

    @classmethod
    def parse(cls, value: Any) -> DeliveryPolicy:
        """A policy from what a DAG author writes: a DeliveryPolicy, a built-in name, a dict or JSON text."""
        if isinstance(value, DeliveryPolicy):
            return value
        if isinstance(value, str):
            text = value.strip()
            if not text.startswith("{"):
                return cls.for_endpoint(text)
            import json

            try:
                value = json.loads(text)
            except ValueError as exc:
                raise PolicyError(f"delivery policy is not valid JSON: {exc}") from None
        return cls.from_dict(value)

    @classmethod
    def parse_each(cls, policies: Mapping[str, Any] | None) -> dict[str, DeliveryPolicy]:
        """Policies per destination (`destination_policies`); an error names the destination."""
        if policies is None:
            return {}
        if not isinstance(policies, Mapping):
            raise PolicyError(f"destination_policies must map destination names to policies, got {policies!r}")
        parsed = {}
        for destination, value in policies.items():
            try:
                parsed[destination] = cls.parse(value)
            except PolicyError as exc:
                raise PolicyError(f"destination_policies[{destination!r}]: {exc}") from None
        return parsed

    def with_throttle(self, per_second: int | None) -> DeliveryPolicy:
        return replace(self, max_receives_per_second=per_second)


def backoff(function: str, k: int, low: float, high: float) -> list[float]:
    return [_backoff_at(function, i, k, low, high) for i in range(k)]


def _backoff_at(function: str, i: int, k: int, low: float, high: float) -> float:
    if k <= 1:
        return low
    last = k - 1
    if i >= last:
        return high  # exactly the maximum, whatever floating point says
    if function == "linear":
        return low + (high - low) * i / last
    if function == "arithmetic":
        return low + (high - low) * i * (i + 1) / (last * k)
    if function == "geometric":
        return low + (high - low) * (1 - 2.0**-i) / (1 - 2.0**-last)
    # exponential. typeshed types float ** float as Any (a negative base gives a complex); these bases are > 0
    if low > 0:
        growth: float = (high / low) ** (i / last)
        return low * growth
    grown: float = (high + 1) ** (i / last)
    return grown - 1


def _human(seconds: float) -> str:
    for unit, size in (("days", 86_400), ("hours", 3_600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
