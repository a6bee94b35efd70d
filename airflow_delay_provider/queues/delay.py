"""The `delay` scheme of Airflow's common message-queue trigger: event-driven DAGs written the common way,

    from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
    from airflow.sdk import Asset, AssetWatcher

    trigger = MessageQueueTrigger(scheme="delay", destination="order_timeout")
    order_timeout = Asset("order_timeout", watchers=[AssetWatcher(name="order_timeout.due", trigger=trigger)])

get one asset event per due message of the store, as `watched_asset("order_timeout")` gives: the trigger behind
both is DueMessageEventTrigger (here its DueMessageQueueTrigger form, which also takes an asset's name). Listed
under `queues` in the provider info; needs the `messaging` extra (apache-airflow-providers-common-messaging).
"""

from __future__ import annotations

from airflow_delay_provider.extras import optional_feature_error
from airflow_delay_provider.triggers.asset import DueMessageQueueTrigger

try:
    from airflow.providers.common.messaging.providers.base_provider import BaseMessageQueueProvider
except ImportError as error:
    raise optional_feature_error("messaging", error) from error

#: The scheme DAG authors name: `MessageQueueTrigger(scheme=SCHEME, destination=..., ...)`.
SCHEME = "delay"


class DelayMessageQueueProvider(BaseMessageQueueProvider):
    """Matches `scheme="delay"`; the trigger's keyword arguments are DueMessageEventTrigger's (`destination`,
    `delay_store_conn_id`, `run_dag_id`, ...)."""

    scheme = SCHEME

    def trigger_class(self) -> type[DueMessageQueueTrigger]:
        return DueMessageQueueTrigger
