"""The `delay` scheme of Airflow's common MessageQueueTrigger (the [messaging] extra): registered in the provider
info, found by the trigger's provider lookup, and the same trigger as `dag_run_asset()` / `watched_asset()`."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest
from airflow.sdk.module_loading import import_string
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.get_provider_info import get_provider_info
from airflow_delay_provider.queues.delay import SCHEME, DelayMessageQueueProvider
from airflow_delay_provider.triggers.asset import DueMessageEventTrigger, DueMessageQueueTrigger, watched_asset
from tests.unit.triggers.conftest import _next_event, _subscribe


def _common(**kwargs):
    from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger

    return MessageQueueTrigger(scheme="delay", **kwargs)


def test_the_scheme_is_registered_where_airflow_looks_for_message_queue_providers():
    from airflow.providers.common.messaging.triggers.msg_queue import MESSAGE_QUEUE_PROVIDERS
    from airflow.providers_manager import ProvidersManager

    path = "airflow_delay_provider.queues.delay.DelayMessageQueueProvider"
    assert get_provider_info()["queues"] == [path]
    manager = ProvidersManager()
    manager.initialize_providers_queues()
    assert path in manager.queue_class_names
    matching = [p for p in MESSAGE_QUEUE_PROVIDERS if p.scheme_matches(SCHEME)]
    assert [type(p) for p in matching] == [DelayMessageQueueProvider]  # no other provider claims "delay"
    assert SCHEME == "delay" and not DelayMessageQueueProvider().scheme_matches("sqs")


def test_an_asset_name_or_an_event_destination_gives_the_trigger_watched_asset_gives():
    by_name = _common(destination="order_timeout", delay_store_conn_id="store", batch_size=5, run_dag_id="reminder")
    classpath, kwargs = by_name.serialize()
    assert import_string(classpath) is DueMessageQueueTrigger and issubclass(DueMessageQueueTrigger,
                                                                            DueMessageEventTrigger)
    common = watched_asset("order_timeout", delay_store_conn_id="store", batch_size=5,
                           run_dag_id="reminder").watchers[0].trigger
    assert kwargs == common.serialize()[1]  # the same arguments, destination included
    assert kwargs["destination"] == "airflow.asset.order_timeout"
    # Rebuilt by the triggerer from what was serialised: the same again (the prefix is not added twice).
    assert DueMessageQueueTrigger(**kwargs).serialize() == (classpath, kwargs)
    assert _common(destination="airflow.asset.order_timeout").trigger.destination == "airflow.asset.order_timeout"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"destination": "order_timeout", "batch_size": 0}, "batch_size"),
    ({"destination": "bad\nname"}, "destination"),
    ({"destination": "order_timeout", "lease_seconds": 1}, "lease_seconds"),
])
def test_bad_arguments_fail_when_the_dag_is_parsed_with_the_same_message(kwargs, match):
    with pytest.raises(InvalidInputError, match=match) as common:
        _common(**kwargs).serialize()  # as the dag-processor does
    with pytest.raises(InvalidInputError, match=match) as own:
        DueMessageEventTrigger(**{**kwargs, "destination": "airflow.asset." + kwargs["destination"]})
    assert str(common.value).split(":")[0] == str(own.value).split(":")[0]


def test_a_due_message_becomes_one_event_through_the_common_trigger(store_conn):
    conn_id, store, _ = store_conn
    due = utcnow() - timedelta(seconds=0.1)
    store.store([DelayedMessage("airflow.asset.order_timeout", json.dumps({"order": 7}).encode(), due, {}, "o-7")])
    trigger = _common(destination="order_timeout", delay_store_conn_id=conn_id, min_event_interval=0,
                      poll_interval=0.2, lease_seconds=5).trigger

    async def scenario():
        manager = SharedStreamManager(ack_timeout=30)
        key, stream = await _subscribe(manager, trigger)
        event, seq = await _next_event(stream, manager, key)
        manager.confirm_persisted([seq])
        await manager.unsubscribe(1, key)
        return event.payload

    payload = asyncio.run(scenario())
    assert (payload["message_id"], payload["body"], payload["destination"]) == (
        "o-7", {"order": 7}, "airflow.asset.order_timeout")
    assert store.get("o-7") is None  # acknowledged once Airflow confirmed the event persisted
