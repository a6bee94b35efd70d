"""Metrics through Airflow's own Stats (StatsD or OpenTelemetry, as the deployment's [metrics] section says).

Names, with `[metrics] statsd_prefix` (default `airflow`) in front; `<destination>` has every
character outside letters, digits, `_` and `-` replaced by `_`:

- ``delay_provider.sent.<destination>`` (counter): messages scheduled (stored, or handed to a broker with a delay)
- ``delay_provider.dispatch.<destination>.dispatched`` (counter): delivered to the destination
- ``delay_provider.dispatch.<destination>.failed`` (counter): failed attempts (retried by the policy, or
  dead-lettered)
- ``delay_provider.dispatch.<destination>.dead_lettered`` (counter): sent to the error queue
- ``delay_provider.dispatch.<destination>.released`` (counter): handed back untouched during a transport outage
- ``delay_provider.dispatch.lateness_p50_ms``, ``..._p99_ms`` (gauge): dispatch lateness of the last run
- ``delay_provider.store.<destination>.scheduled`` (gauge): stored, not yet dispatched (a queue's
  NumberOfMessagesDelayed)
- ``delay_provider.store.<destination>.due`` (gauge): stored and already due: the dispatch backlog
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from airflow.sdk.observability.stats import Stats

PREFIX = "delay_provider"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def metric_name(*parts: str) -> str:
    """A StatsD-safe name: dots separate the parts, nothing inside a part can add one."""
    return ".".join([PREFIX, *(_UNSAFE.sub("_", part) for part in parts)])[:250]


def count_sent(counts: Mapping[str, int]) -> None:
    for destination, n in counts.items():
        Stats.incr(metric_name("sent", destination), n)


def count_dispatch(summary: Mapping) -> None:
    """Counters from a dispatch or sweep summary (`destinations`: destination -> outcome -> count)."""
    for destination, outcomes in (summary.get("destinations") or {}).items():
        for outcome, n in outcomes.items():
            Stats.incr(metric_name("dispatch", destination, outcome), n)
    for p in ("p50", "p99"):
        seconds = summary.get(f"lateness_{p}_seconds")
        if seconds is not None:
            Stats.gauge(metric_name("dispatch", f"lateness_{p}_ms"), round(seconds * 1000, 1))


def gauge_backlog(kind: str, counts: Mapping[str, int]) -> None:
    """`kind` is `scheduled` or `due`."""
    for destination, n in counts.items():
        Stats.gauge(metric_name("store", destination, kind), n)
