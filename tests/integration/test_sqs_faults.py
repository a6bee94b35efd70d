"""Amazon SQS against moto's server: queue-level defaults, duplicates, large bodies and retention."""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta

import pytest
from botocore.exceptions import ClientError

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.transports.sqs import SqsTransport
from tests.integration.test_sqs import Crash, FaultyClient, crashing_relay, make, wait_for

FOURTEEN_DAYS = 1_209_600


def total(t: SqsTransport, endpoint: str, delay_queue: bool = False) -> int:
    """Every message in the queue: delayed, visible and in flight."""
    return sum(t.lifecycle(endpoint, delay_queue=delay_queue).values())


class RecordingClient(FaultyClient):
    """The real moto client, remembering every entry sent and to which queue."""

    def __init__(self, client):
        super().__init__(client)
        self.sent = []

    def send_message_batch(self, QueueUrl, Entries):
        self.sent.extend((QueueUrl, entry) for entry in Entries)
        return self._client.send_message_batch(QueueUrl=QueueUrl, Entries=Entries)


# -- a due message does not inherit the queue's default delay --------------------------------------
def test_pump_sends_a_due_message_past_the_queue_level_delay(sqs_client, tmp_path):
    from airflow_delay_provider.core.pump import Pump
    from tests.helpers import make_store, messages

    t = SqsTransport(RecordingClient(sqs_client), queue_delay=900)
    t.provision("slow", queue_delay_seconds=600)
    store = make_store(f"sqlite:///{tmp_path / 's.db'}", None, "delayed")
    store.store(messages(3, destination="slow"))
    assert Pump(store, t).run(stop_when_idle=True).stats.dispatched == 3
    assert sorted(m.message_id for _, m in wait_for(t, "slow", 3, 3)) == ["m-0", "m-1", "m-2"]
    assert [e["DelaySeconds"] for _, e in t.client.sent] == [0, 0, 0]


def test_relay_final_hop_of_an_overdue_message_overrides_the_queue_level_delay(sqs_client):
    t = SqsTransport(RecordingClient(sqs_client), queue_delay=1)
    t.provision("slow", queue_delay_seconds=600)
    due = utcnow() + timedelta(seconds=2)
    assert t.send([DelayedMessage("slow", b"x", due, {}, "late-1")]) == {}
    time.sleep(3.5)  # the relay was away: by the time it receives the message, it is overdue
    handed, deadline = 0, time.monotonic() + 10
    while not handed and time.monotonic() < deadline:
        handed = t.relay_once("slow", 1).handed_over
    assert handed == 1
    [(arrived, m)] = wait_for(t, "slow", 1, 3)
    assert m.message_id == "late-1" and arrived >= due
    # FIFO queues take no per-message delay; every standard-queue send carries one explicitly.
    for url, entry in t.client.sent:
        assert ("DelaySeconds" in entry) != url.endswith(".fifo"), (url, entry)


# -- large bodies under at-least-once --------------------------------------------------------------
def large_body_transport(aws_conn, bucket: str = "delay-bodies", create: bool = True, **options) -> SqsTransport:
    from airflow_delay_provider.hooks.sqs import SqsDelayHook

    t = SqsDelayHook(aws_conn_id=aws_conn).get_transport(queue_delay=1, large_body_bucket=bucket, **options)
    if create:
        t.s3.create_bucket(Bucket=bucket)
    return t


BODY = bytes(range(256)) * 1200  # 300 KiB: goes to S3


def test_a_duplicate_whose_body_was_consumed_is_dropped_not_a_failed_batch(aws_conn, sqs_client):
    t = large_body_transport(aws_conn)
    t.provision("orders")
    relay = crashing_relay(sqs_client)
    assert t.send([DelayedMessage("orders", BODY, utcnow() + timedelta(seconds=2), {}, "big-1")]) == {}
    deadline = time.monotonic() + 10
    with pytest.raises(Crash):  # handed over, then died before deleting: the relay re-sends it
        while time.monotonic() < deadline:
            relay.relay_once("orders", 1, visibility_timeout=1)
    while total(t, "orders", delay_queue=True) and time.monotonic() < deadline:
        t.relay_once("orders", 1, visibility_timeout=1)
    assert total(t, "orders") == 2  # two copies of one message, one S3 object
    first = []
    while not first and time.monotonic() < deadline:
        first = t.receive("orders", 1)
    assert first[0].body == BODY
    assert t.ack("orders", [first[0].receipt]) == 1  # delivered: its object is deleted
    assert t.send([DelayedMessage("orders", b"small", utcnow(), {}, "plain-1")]) == {}
    got = []
    while not got and time.monotonic() < deadline:
        got = t.receive("orders", 10)  # the duplicate with it must not fail the batch
    assert [m.message_id for m in got] == ["plain-1"]
    assert t.ack("orders", [m.receipt for m in got]) == 1
    assert t.duplicates_dropped == 1
    assert total(t, "orders") == 0  # the duplicate was deleted, not left to come back


def test_any_process_can_ack_a_large_body_and_a_failed_s3_delete_does_not_fail_the_ack(aws_conn):
    t = large_body_transport(aws_conn)
    t.provision("orders")
    assert t.send([DelayedMessage("orders", BODY, utcnow(), {}, f"big-{i}") for i in range(2)]) == {}
    got = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += t.receive("orders", 10)
    assert sorted(m.message_id for m in got) == ["big-0", "big-1"]
    # Another process acks, with receipts that went through JSON (an XCom, say).
    other = large_body_transport(aws_conn, create=False)
    assert other.ack("orders", json.loads(json.dumps([got[0].receipt]))) == 1
    assert t.s3.list_objects_v2(Bucket="delay-bodies")["KeyCount"] == 1

    class FailingS3:
        def __init__(self, s3):
            self._s3 = s3

        def __getattr__(self, name):
            return getattr(self._s3, name)

        def delete_object(self, **_kwargs):
            raise ClientError({"Error": {"Code": "InternalError", "Message": "try again"}}, "DeleteObject")

    other.s3 = FailingS3(other.s3)
    assert other.ack("orders", [got[1].receipt]) == 1  # the lifecycle rule removes the body later
    assert total(t, "orders") == 0


def test_provisioning_expires_bodies_and_keeps_other_lifecycle_rules(aws_conn):
    t = large_body_transport(aws_conn, prefix="dev-")
    other_rule = {"ID": "logs", "Status": "Enabled", "Filter": {"Prefix": "logs/"}, "Expiration": {"Days": 3}}
    t.s3.put_bucket_lifecycle_configuration(Bucket="delay-bodies", LifecycleConfiguration={"Rules": [other_rule]})
    t.provision("orders")
    t.provision("invoices")  # idempotent: still one rule of ours
    rules = t.s3.get_bucket_lifecycle_configuration(Bucket="delay-bodies")["Rules"]
    by_prefix = {r["Filter"]["Prefix"]: r for r in rules}
    assert sorted(by_prefix) == ["dev-delay-bodies/", "logs/"]
    ours = by_prefix["dev-delay-bodies/"]
    assert ours["Status"] == "Enabled"
    # Longer than the longest delay (7 days), a destination's retention (14 days) and a relay outage.
    assert ours["Expiration"]["Days"] >= 28
    assert by_prefix["logs/"]["Expiration"]["Days"] == 3


# -- retention of the delay queue ------------------------------------------------------------------
def retention(sqs_client, queue: str) -> int:
    url = sqs_client.get_queue_url(QueueName=queue)["QueueUrl"]
    attrs = sqs_client.get_queue_attributes(QueueUrl=url, AttributeNames=["MessageRetentionPeriod"])["Attributes"]
    return int(attrs["MessageRetentionPeriod"])


def test_delay_queue_keeps_messages_fourteen_days(sqs_client):
    make(sqs_client, 900, "orders")
    assert retention(sqs_client, "orders-delay.fifo") == FOURTEEN_DAYS


def test_provisioning_updates_a_delay_queue_made_with_four_days(sqs_client):
    sqs_client.create_queue(QueueName="legacy-delay.fifo", Attributes={
        "FifoQueue": "true", "DelaySeconds": "900", "MessageRetentionPeriod": "345600"})
    summary = SqsTransport(sqs_client, queue_delay=900).provision("legacy")
    assert summary["delay_queue"] == "legacy-delay.fifo"
    assert retention(sqs_client, "legacy-delay.fifo") == FOURTEEN_DAYS


def test_verify_warns_when_retention_is_shorter_than_a_relay_outage(sqs_client, caplog):
    t = make(sqs_client, 900, "orders")
    report = t.verify("orders")
    assert report["ok"] and report["warnings"] == [] and report["retention_seconds"] == FOURTEEN_DAYS
    url = sqs_client.get_queue_url(QueueName="orders-delay.fifo")["QueueUrl"]
    sqs_client.set_queue_attributes(QueueUrl=url, Attributes={"MessageRetentionPeriod": "345600"})
    with caplog.at_level(logging.WARNING, logger="airflow_delay_provider.transports.sqs"):
        report = t.verify("orders")
    assert report["ok"]
    [warning] = report["warnings"]
    assert "345600" in warning and "max_relay_downtime" in warning
    assert any(r.levelno == logging.WARNING and "345600" in r.getMessage() for r in caplog.records)
    # A relay that is never down for more than a day is safe with 4 days.
    assert SqsTransport(sqs_client, queue_delay=900, max_relay_downtime=86_400).verify("orders")["warnings"] == []


# -- FIFO deduplication across a relay crash -------------------------------------------------------
def test_relay_crash_before_delete_leaves_one_copy_in_the_delay_queue(sqs_client):
    make(sqs_client, 1, "orders")
    t = crashing_relay(sqs_client)
    assert t.send([DelayedMessage("orders", b"x", utcnow() + timedelta(seconds=60), {}, "dd-1")]) == {}
    deadline = time.monotonic() + 10
    with pytest.raises(Crash):  # sent back for cycle 1, then died before deleting the original
        while time.monotonic() < deadline:
            t.relay_once("orders", 1, visibility_timeout=2)
    assert total(t, "orders", delay_queue=True) == 2  # the original (in flight) and its cycle-1 copy
    survivor = SqsTransport(sqs_client, queue_delay=1)
    relayed = 0
    while not relayed and time.monotonic() < deadline + 10:
        relayed = survivor.relay_once("orders", 1, visibility_timeout=2).relayed
    assert relayed
    assert total(survivor, "orders", delay_queue=True) == 1  # the re-sent cycle 1 was deduplicated
