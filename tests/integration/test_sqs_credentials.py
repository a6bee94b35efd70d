"""How a Spark sweep's executors get AWS credentials: never the temporary credentials of one moment, which
would expire mid-sweep. Against moto's server (SQS and STS)."""

from __future__ import annotations

import json

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.hooks.sqs import SqsDelayHook
from airflow_delay_provider.transports.registry import from_spec
from tests.integration.test_sqs import wait_for

ROLE = "arn:aws:iam::123456789012:role/sweeper"


def _conn(monkeypatch, moto_server, conn_id: str, **fields) -> str:
    extra = {"endpoint_url": moto_server, "region_name": "us-east-1", **fields.pop("extra", {})}
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "aws", **fields, "extra": extra}))
    return conn_id


def test_a_role_is_assumed_by_the_executors_and_refreshed_before_it_expires(aws_conn, moto_server, monkeypatch):
    conn_id = _conn(monkeypatch, moto_server, "aws_role", login="base-key", password="base-secret",
                    extra={"role_arn": ROLE, "assume_role_kwargs": {"DurationSeconds": 900},
                           # The amazon provider assumes roles through STS's own endpoint, never the global one.
                           "service_config": {"sts": {"endpoint_url": moto_server}}})
    spec = SqsDelayHook(aws_conn_id=conn_id).transport_spec(prefix="cr-")
    # The connection's own long-lived keys and the role: no temporary credentials in the spec.
    assert spec["client"]["aws_access_key_id"] == "base-key" and "aws_session_token" not in spec["client"]
    assert spec["assume_role"]["role_arn"] == ROLE and spec["assume_role"]["kwargs"]["DurationSeconds"] == 900
    transport = from_spec(json.loads(json.dumps(spec)))  # as an executor gets it: plain JSON
    credentials = transport.client._request_signer._credentials
    assert credentials.method == "assume-role"
    transport.provision("orders")
    assert transport.send([DelayedMessage("orders", b"hi", utcnow(), message_id="c1")]) == {}
    assert [m.message_id for _, m in wait_for(transport, "orders", 1, timeout=30)] == ["c1"]
    # 900 s credentials are inside botocore's refresh window from the start: each use assumes the role again,
    # so nothing the executors hold can be a frozen set.
    first = credentials.get_frozen_credentials().access_key
    assert credentials.get_frozen_credentials().access_key != first


def test_keys_travel_as_given_and_none_means_the_nodes_own(aws_conn, moto_server, monkeypatch):
    spec = SqsDelayHook(aws_conn_id=aws_conn).transport_spec()
    assert spec["client"]["aws_access_key_id"] == "testing" and "assume_role" not in spec
    conn_id = _conn(monkeypatch, moto_server, "aws_node")
    spec = SqsDelayHook(aws_conn_id=conn_id).transport_spec()
    assert not {k for k in spec["client"] if k.startswith("aws_")}, spec  # the executors' own chain
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "node-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "node-secret")
    transport = from_spec(spec)
    assert transport.client._request_signer._credentials.access_key == "node-key"


def test_a_profile_goes_as_the_credentials_of_the_moment_with_a_warning(aws_conn, moto_server, monkeypatch, tmp_path,
                                                                        capsys):
    profiles = tmp_path / "credentials"
    profiles.write_text("[sweeps]\naws_access_key_id = profile-key\naws_secret_access_key = profile-secret\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(profiles))
    conn_id = _conn(monkeypatch, moto_server, "aws_profile", extra={"profile_name": "sweeps"})
    spec = SqsDelayHook(aws_conn_id=conn_id).transport_spec()
    assert spec["client"]["aws_access_key_id"] == "profile-key"
    logged = capsys.readouterr().out  # Airflow's task logging writes to standard output
    assert "credentials of this moment, which expire" in logged and "profile-secret" not in logged
