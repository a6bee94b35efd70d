"""The SQS operators and hook follow the amazon provider's conventions: `aws_conn_id` names the connection (the
relay's `transport_conn_id` still works, with a deprecation warning), and an SQS without a region says what to
create instead of botocore's NoRegionError."""

from __future__ import annotations

import json
import warnings

import pytest
from airflow.exceptions import AirflowProviderDeprecationWarning

from airflow_delay_provider.core.errors import ConnectionSetupError, InvalidInputError
from airflow_delay_provider.hooks.sqs import SqsDelayHook
from airflow_delay_provider.operators.send import SendDelayedMessageOperator
from airflow_delay_provider.operators.sqs import RelayDelayedMessagesOperator


def test_the_relay_takes_aws_conn_id_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relay = RelayDelayedMessagesOperator(task_id="relay", endpoint="orders", aws_conn_id="aws_eu")
    assert (relay.aws_conn_id, relay.transport_conn_id) == ("aws_eu", "aws_eu")
    assert relay._transport_hook().aws_conn_id == "aws_eu"


def test_the_relays_transport_conn_id_still_works_and_warns_naming_aws_conn_id():
    with pytest.warns(AirflowProviderDeprecationWarning, match="name the aws connection with aws_conn_id"):
        relay = RelayDelayedMessagesOperator(task_id="relay", endpoint="orders", transport_conn_id="aws_old")
    assert (relay.aws_conn_id, relay.transport_conn_id) == ("aws_old", "aws_old")
    assert relay._transport_hook().aws_conn_id == "aws_old"


def test_without_either_name_the_relay_uses_aws_default():
    relay = RelayDelayedMessagesOperator(task_id="relay", endpoint="orders")
    assert relay.aws_conn_id is None
    assert relay._transport_hook().aws_conn_id == "aws_default"


def test_two_different_connections_are_refused():
    with pytest.raises(InvalidInputError, match="name two connections for one transport: give aws_conn_id alone"), \
            pytest.warns(AirflowProviderDeprecationWarning):
        RelayDelayedMessagesOperator(task_id="relay", endpoint="orders", aws_conn_id="a", transport_conn_id="b")


def test_every_operator_takes_aws_conn_id_with_sqs_and_refuses_it_with_another_transport():
    send = SendDelayedMessageOperator(task_id="send", destination="orders", body="{}", delay_seconds=60,
                                      transport="sqs", aws_conn_id="aws_eu")
    assert send.transport_conn_id == "aws_eu"
    with pytest.raises(InvalidInputError, match="aws_conn_id is the connection of transport='sqs'; with "
                                                "transport='rabbitmq' name the connection with transport_conn_id"):
        SendDelayedMessageOperator(task_id="send", destination="orders", body="{}", delay_seconds=60,
                                   transport="rabbitmq", aws_conn_id="aws_eu")


def test_aws_conn_id_is_a_template_and_the_rendered_value_is_the_one_used():
    relay = RelayDelayedMessagesOperator(task_id="relay", endpoint="{{ params.endpoint }}",
                                         aws_conn_id="{{ params.conn }}")
    assert "aws_conn_id" in relay.template_fields
    relay.render_template_fields({"params": {"endpoint": "orders", "conn": "aws_rendered"}})
    assert (relay.endpoint, relay.aws_conn_id, relay.transport_conn_id) == ("orders", "aws_rendered", "aws_rendered")
    assert relay._transport_hook().aws_conn_id == "aws_rendered"


def test_a_missing_aws_default_says_what_to_create(no_region_anywhere):
    with pytest.raises(ConnectionSetupError) as raised:
        SqsDelayHook(aws_conn_id="aws_default").get_transport()
    message = str(raised.value)
    assert "the aws connection 'aws_default' is not defined" in message
    assert "airflow connections add aws_default --conn-type aws --conn-extra '{\"region_name\": " in message
    assert "or set AWS_DEFAULT_REGION" in message


def test_a_connection_without_a_region_says_where_the_region_goes(no_region_anywhere, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_AWS_NO_REGION", json.dumps(
        {"conn_type": "aws", "login": "key-id", "password": "not-a-real-secret"}))
    with pytest.raises(ConnectionSetupError) as raised:
        SqsDelayHook(aws_conn_id="aws_no_region").get_conn()
    message = str(raised.value)
    assert "the aws connection 'aws_no_region' names none: add region_name to its extra" in message
    assert "not-a-real-secret" not in message


def test_the_environments_region_is_enough_without_a_connection(no_region_anywhere, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert SqsDelayHook(aws_conn_id="aws_default").get_conn().meta.region_name == "eu-west-1"


def test_no_connection_at_all_and_no_region_says_to_set_one(no_region_anywhere):
    with pytest.raises(ConnectionSetupError, match=r"no aws connection was given \(aws_conn_id=None\) and the "
                                                   "environment names no region: set AWS_DEFAULT_REGION"):
        SqsDelayHook(aws_conn_id=None).get_conn()
