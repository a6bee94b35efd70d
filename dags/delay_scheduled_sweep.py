"""Dispatch each five-minute window's due messages once: the sweep to use with backfills."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, DeltaDataIntervalTimetable

from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator

with DAG(
    dag_id="delay_scheduled_sweep",
    # An explicit data-interval timetable: each run has a real window [start, end), five minutes long.
    schedule=DeltaDataIntervalTimetable(timedelta(minutes=5)),
    start_date=datetime(2026, 1, 1),
    catchup=False,  # unpausing runs the latest window only; past windows are a backfill away
    max_active_runs=1,
    tags=["delay", "scheduled"],
    doc_md="""
### Window sweep of the delayed-message store

Each run dispatches the messages due in its own data interval, `[data_interval_start,
data_interval_end)`, and stops when that window is empty: every window is swept by exactly one run,
so re-running or backfilling windows dispatches nothing twice (a delivered message is gone from the
store). Messages are delivered at the end of their window, up to five minutes late: for delivery at
the due time use `delay_continuous_dispatch`; use this DAG to clear windows the continuous
dispatcher missed (it was paused, its deployment was down):

```sh
airflow backfill create --dag-id delay_scheduled_sweep \\
    --from-date 2026-11-20T00:00:00+00:00 --to-date 2026-11-20T06:00:00+00:00
```

A manual run (no data interval) sweeps everything already due. Unpausing does not start a catch-up
of past windows (`catchup=False`). Retries follow the built-in `http` delivery policy.
""",
) as dag:
    DispatchDueMessagesOperator(
        task_id="dispatch",
        # A manual run has no data interval: then everything due by the time the run was triggered.
        due_from="{{ data_interval_start if data_interval_start is defined else '' }}",
        due_before="{{ data_interval_end if data_interval_end is defined else dag_run.run_after }}",
        max_runtime=timedelta(minutes=30),
        delivery_policy="http",
    )
