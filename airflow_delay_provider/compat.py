"""What the provider needs from the Airflow it runs in: Airflow 3.2 and 3.3 are supported.

Everything works the same on both minors except delayed DAG runs. They rely on the triggerer's shared streams
in **ack mode** (`airflow.triggers.shared_stream`, new in Airflow 3.3): a due message is deleted only after
Airflow confirms that its asset event was recorded, so a triggerer that dies in between hands it over again.
Airflow 3.2's triggerer would take each event without that confirmation, and a crash would lose it; rather than
run with that weaker guarantee, `DueMessageEventTrigger` and `ScheduleDagRunOperator` refuse to be built there,
with `AirflowVersionError` saying why and what to use instead.
"""

from __future__ import annotations

from types import ModuleType

import airflow

from airflow_delay_provider.core.errors import DelayProviderError

#: The installed Airflow's version string.
AIRFLOW_VERSION: str = airflow.__version__

shared_stream: ModuleType | None
try:
    from airflow.triggers import shared_stream
except ImportError:  # Airflow 3.2
    shared_stream = None


class AirflowVersionError(DelayProviderError, RuntimeError):
    """A feature of the provider needs a newer Airflow than the installed one."""


def require_shared_streams(feature: str) -> None:
    """Raise AirflowVersionError, naming `feature`, unless this Airflow has the triggerer's shared streams."""
    if shared_stream is None:
        raise AirflowVersionError(
            f"{feature} needs Airflow 3.3 or later, and this is Airflow {AIRFLOW_VERSION}: delayed DAG runs rely "
            "on the triggerer's shared-stream ack mode (a due message is deleted only after Airflow recorded its "
            "asset event), which Airflow 3.3 added. Upgrade Airflow, or deliver the due messages to a queue "
            "instead (SendDelayedMessageOperator and a dispatcher work on Airflow 3.2).")
