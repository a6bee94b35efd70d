"""Delayed DAG runs need Airflow 3.3's shared streams: without them (Airflow 3.2) they are refused when built,
naming the Airflow they need, and nothing else of the provider changes."""

from __future__ import annotations

import pytest

from airflow_delay_provider import compat
from airflow_delay_provider.compat import AirflowVersionError
from airflow_delay_provider.core.errors import DelayProviderError


@pytest.fixture
def without_shared_streams(monkeypatch):
    """This Airflow as 3.2 is, if it is newer: `make test-compat` runs the tests on a real 3.2 too."""
    monkeypatch.setattr(compat, "shared_stream", None)
    monkeypatch.setattr(compat, "AIRFLOW_VERSION", "3.2.2")


def test_the_trigger_and_the_operator_of_delayed_dag_runs_refuse_to_be_built_and_say_why(without_shared_streams):
    from airflow_delay_provider.operators.schedule import ScheduleDagRunOperator
    from airflow_delay_provider.triggers.asset import DueMessageEventTrigger, dag_run_asset

    for build in (lambda: DueMessageEventTrigger(destination="airflow.asset.orders"),
                  lambda: dag_run_asset("order_timeout"),
                  lambda: ScheduleDagRunOperator(task_id="later", dag_id="order_timeout", delay_seconds=60)):
        with pytest.raises(AirflowVersionError) as refused:
            build()
        assert isinstance(refused.value, DelayProviderError)
        message = str(refused.value)
        assert "needs Airflow 3.3 or later, and this is Airflow 3.2.2" in message
        assert "SendDelayedMessageOperator and a dispatcher" in message


def test_what_does_not_need_shared_streams_is_built_as_before(without_shared_streams):
    from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator
    from airflow_delay_provider.operators.send import SendDelayedMessageOperator

    send = SendDelayedMessageOperator(task_id="send", destination="orders", body="{}", delay_seconds=60)
    dispatch = DispatchDueMessagesOperator(task_id="dispatch", deferrable=True)
    assert (send.destination, dispatch.deferrable) == ("orders", True)


@pytest.mark.skipif(compat.shared_stream is None, reason="this Airflow has no shared streams: the test above is real")
def test_on_airflow_3_3_the_trigger_is_built():
    from airflow_delay_provider.triggers.asset import DueMessageEventTrigger

    trigger = DueMessageEventTrigger(destination="airflow.asset.orders")
    assert trigger.shared_stream_key()[-1] == "airflow.asset.orders"
