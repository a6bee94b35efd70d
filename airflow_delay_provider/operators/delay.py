"""The operators under their earlier module path: DAGs that import them from here keep working.

Each operator lives in a module of its own: provision, send, dispatch, migrate, and the SQS relay in sqs (imported
when asked for: it needs the [amazon] extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_delay_provider.operators.base import DelayOperatorBase
from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator
from airflow_delay_provider.operators.migrate import MigrateDelayedMessagesOperator
from airflow_delay_provider.operators.provision import ProvisionDelayInfrastructureOperator
from airflow_delay_provider.operators.send import SendDelayedMessageOperator

if TYPE_CHECKING:
    from airflow_delay_provider.operators.sqs import RelayDelayedMessagesOperator

__all__ = [
    "DelayOperatorBase",
    "DispatchDueMessagesOperator",
    "MigrateDelayedMessagesOperator",
    "ProvisionDelayInfrastructureOperator",
    "RelayDelayedMessagesOperator",
    "SendDelayedMessageOperator",
]


def __getattr__(name: str) -> Any:
    if name == "RelayDelayedMessagesOperator":
        from airflow_delay_provider.operators.sqs import RelayDelayedMessagesOperator

        return RelayDelayedMessagesOperator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
