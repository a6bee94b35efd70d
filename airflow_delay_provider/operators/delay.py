"""The operators under their earlier module path: DAGs that import them from here keep working.

Each operator lives in a module of its own: provision, send, dispatch, migrate, and the SQS relay in sqs.
"""

from airflow_delay_provider.operators.base import DelayOperatorBase
from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator
from airflow_delay_provider.operators.migrate import MigrateDelayedMessagesOperator
from airflow_delay_provider.operators.provision import ProvisionDelayInfrastructureOperator
from airflow_delay_provider.operators.send import SendDelayedMessageOperator
from airflow_delay_provider.operators.sqs import RelayDelayedMessagesOperator

__all__ = [
    "DelayOperatorBase",
    "DispatchDueMessagesOperator",
    "MigrateDelayedMessagesOperator",
    "ProvisionDelayInfrastructureOperator",
    "RelayDelayedMessagesOperator",
    "SendDelayedMessageOperator",
]
