"""Amazon SQS against moto's server: native and unrestricted delays, the -delay.fifo relay."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import DelayError, DestinationNotFoundError, InvalidInputError, InvalidNameError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.transports.sqs import SqsTransport


def make(client, q: int = 2, *endpoints: str) -> SqsTransport:
    transport = SqsTransport(client, queue_delay=q)
    for e in endpoints:
        transport.provision(e)
    return transport


def wait_for(transport: SqsTransport, endpoint: str, n: int, timeout: float) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        batch = transport.receive(endpoint, 10, visibility_timeout=30)
        got.extend((utcnow(), m) for m in batch)
        if batch:
            transport.ack(endpoint, [m.receipt for m in batch])
        else:
            time.sleep(0.1)
    return got


@pytest.mark.parametrize("cycles", [2, 3])
def test_multi_cycle_delay_arrives_intact_and_not_early(sqs_client, cycles):
    q = 1
    t = make(sqs_client, q, "orders")
    delay = cycles * q + 1
    due = utcnow() + timedelta(seconds=delay)
    message = DelayedMessage("orders", b"\xff binary \x00", due, {"k": "v"}, "mc-1")
    assert t.send([message]) == {}
    assert t.receive("orders") == []  # not native: it waits in the delay queue
    handed = 0
    first_seen = None  # when the relay pass that first received the message returned
    deadline = time.monotonic() + 20
    got = []
    while not got and time.monotonic() < deadline:
        counts = t.relay_once("orders", wait_time_seconds=1)
        if first_seen is None and counts.relayed + counts.handed_over:
            first_seen = (utcnow(), counts.relayed)
        handed += counts.handed_over
        got = wait_for(t, "orders", 1, 0.2)
    assert got, "the message never arrived"
    arrived, m = got[0]
    assert (m.message_id, m.body, m.headers) == ("mc-1", b"\xff binary \x00", {"k": "v"})
    assert arrived >= due
    assert handed == 1
    # The relay sends a message back for another cycle while more than one cycle (q) of its delay is left, and
    # hands it over with the rest as the broker's delay once at most a cycle is left. How often it went round
    # depends on when the relay polled (a busy machine can poll a second late), so what must hold is the rule:
    # a pass that returned before due - q received it with more than q left, so it must have sent it back
    # (SQS's clock is this machine's; its timestamps are cut to ms, hence 10 ms to spare).
    assert first_seen is not None
    returned, sent_back = first_seen
    if returned < due - timedelta(seconds=q, milliseconds=10):
        assert sent_back == 1, f"handed over at once {(due - returned).total_seconds():.3f} s before its due time"


def test_native_delay_and_missing_delay_queue(sqs_client):
    t = make(sqs_client, 900)
    t.provision("plain", unrestricted=False)
    due = utcnow() + timedelta(seconds=2)
    assert t.send([DelayedMessage("plain", b"n", due, {}, "n-1")]) == {}
    assert t.receive("plain") == []
    [(arrived, m)] = wait_for(t, "plain", 1, 30)
    assert m.message_id == "n-1" and arrived >= due - timedelta(milliseconds=50)
    failures = t.send([DelayedMessage("plain", b"x", utcnow() + timedelta(seconds=901), {}, "long-1")])
    assert isinstance(failures["long-1"], DestinationNotFoundError)
    assert "does not accept delays longer than 15 minutes" in str(failures["long-1"])
    with pytest.raises(DestinationNotFoundError, match="provision it with unrestricted delays"):
        t.check_delay_queue("plain")


def test_mixed_batch_split_per_destination(sqs_client):
    t = make(sqs_client, 1, "a", "b")
    now = utcnow()
    batch = [DelayedMessage(d, f"{d}{i}".encode(), now + timedelta(seconds=s), {}, f"{d}-{i}")
             for i, (d, s) in enumerate([("a", 0), ("b", 0), ("a", 3), ("b", 2), ("a", 1)])]
    assert t.send(batch) == {}
    got = {m.message_id for _, m in wait_for(t, "a", 1, 30) + wait_for(t, "b", 1, 30)}
    assert {"a-0", "b-1"} <= got
    deadline = time.monotonic() + 15
    while len(got) < 5 and time.monotonic() < deadline:
        t.relay_once("a", 1)
        t.relay_once("b", 1)
        got |= {m.message_id for _, m in wait_for(t, "a", 1, 0.2) + wait_for(t, "b", 1, 0.2)}
    assert got == {m.message_id for m in batch}


def test_verify_catches_misconfigured_delay_queue(sqs_client):
    t = make(sqs_client, 900, "orders")
    assert t.check_delay_queue("orders")["ok"]
    url = sqs_client.get_queue_url(QueueName="orders-delay.fifo")["QueueUrl"]
    sqs_client.set_queue_attributes(QueueUrl=url, Attributes={"DelaySeconds": "60", "MessageRetentionPeriod": "60"})
    with pytest.raises(InvalidInputError,
                       match="DelaySeconds is 60, must be at least 900.*MessageRetentionPeriod is 60"):
        t.check_delay_queue("orders")
    # verify() gives every transport's report shape, here listing the queue as different.
    report = t.verify(["orders"])
    assert report["complete"] is False and report["different"] == ["orders"]
    assert "DelaySeconds is 60" in report["endpoints"]["orders"]["problem"]


def test_verify_of_a_single_name_still_gives_the_delay_queue_check_with_a_deprecation_warning(sqs_client):
    t = make(sqs_client, 900, "orders")
    with pytest.warns(DeprecationWarning, match=r"check_delay_queue\(name\)"):
        report = t.verify("orders")
    assert report == t.check_delay_queue("orders") and report["ok"]


def test_bad_input(sqs_client):
    t = make(sqs_client, 900)
    with pytest.raises(DelayError, match="0..900"):
        t.provision("slow", queue_delay_seconds=901)
    with pytest.raises(InvalidNameError):
        t.provision("bad name!")
    with pytest.raises(InvalidNameError, match="at most 69 characters"):
        t.provision("x" * 70)
    failures = t.send([DelayedMessage("nowhere", b"", utcnow(), {}, "nw")])
    assert isinstance(failures["nw"], DestinationNotFoundError)


def test_pump_dispatches_store_to_sqs(sqs_client, tmp_path):
    from airflow_delay_provider.core.pump import Pump
    from tests.helpers import make_store, messages

    t = make(sqs_client, 900, "orders", "error")
    store = make_store(f"sqlite:///{tmp_path / 's.db'}", None, "delayed")
    store.store(messages(25) + messages(1, destination="nowhere", start=25))
    result = Pump(store, t).run(stop_when_idle=True)
    assert (result.stats.dispatched, result.stats.dead_lettered) == (25, 1)
    got = wait_for(t, "orders", 25, 30)
    assert sorted(m.message_id for _, m in got) == sorted(f"m-{i}" for i in range(25))
    [(_, dead)] = wait_for(t, "error", 1, 30)
    assert dead.message_id == "m-25" and dead.headers["x-delay-failed-destination"] == "nowhere"


def test_sweep_partition_sends_to_sqs_built_from_the_hooks_plain_spec(aws_conn, sqs_client, tmp_path):
    """What a Spark executor does: no Airflow, only the spec the operator resolved from the connection."""
    from airflow_delay_provider.core.pump import Pump
    from airflow_delay_provider.hooks.sqs import SqsDelayHook
    from airflow_delay_provider.transports.registry import from_spec
    from tests.helpers import make_store, messages

    spec = {"kind": "sqs", **SqsDelayHook(aws_conn_id=aws_conn).transport_spec(prefix="sw-")}
    assert spec["client"]["aws_secret_access_key"] == "testing" and spec["client"]["endpoint_url"].startswith("http")
    transport = from_spec(spec)
    transport.provision("orders")
    store = make_store(f"sqlite:///{tmp_path / 's.db'}", None, "delayed")
    store.store(messages(35, delay=-1))
    store.start_sweep("sqs-sweep", utcnow() + timedelta(minutes=1))
    low, high, _ = store.claimed_range("sqs-sweep")
    leased = store.leased_rows("sqs-sweep", store.read_claimed("sqs-sweep", low, high))
    stats = Pump(leased, transport).run(stop_when_idle=True).stats
    assert stats.destinations == {"orders": {"dispatched": 35}}
    got = wait_for(transport, "orders", 35, 30)
    assert sorted(m.message_id for _, m in got) == sorted(f"m-{i}" for i in range(35))
    assert store.count_scheduled() == {} and store.claimed_range("sqs-sweep")[2] == 0


def test_sqs_operators_provision_send_relay_dispatch(run_dag, aws_conn, sqs_client, monkeypatch, tmp_path):
    import json
    from datetime import datetime

    from airflow.sdk import DAG

    from airflow_delay_provider.operators.delay import (
        DispatchDueMessagesOperator,
        ProvisionDelayInfrastructureOperator,
        RelayDelayedMessagesOperator,
        SendDelayedMessageOperator,
    )

    monkeypatch.setenv("AIRFLOW_CONN_STORE_SQS", json.dumps(
        {"conn_type": "delay_store", "schema": str(tmp_path / "store.db"), "extra": {"driver": "sqlite"}}))
    sqs = {"transport": "sqs", "aws_conn_id": aws_conn, "transport_options": {"queue_delay": 1},
           "delay_store_conn_id": "store_sqs"}
    with DAG("t_sqs", schedule=None, start_date=datetime(2026, 1, 1)) as dag:
        provision = ProvisionDelayInfrastructureOperator(task_id="provision", endpoints=["orders"], **sqs)
        slow = ProvisionDelayInfrastructureOperator(task_id="slow", endpoints=["slow"], create_store=False,
                                                    endpoint_options={"queue_delay_seconds": 600}, **sqs)
        native = SendDelayedMessageOperator(task_id="native", destination="orders", body="long", delay_seconds=4, **sqs)
        stored = SendDelayedMessageOperator(task_id="stored", destination="orders", body="stored", delay_seconds=1,
                                            delay_store_conn_id="store_sqs")
        dispatch = DispatchDueMessagesOperator(task_id="dispatch", max_runtime=120, max_messages=1, **sqs)
        relay = RelayDelayedMessagesOperator(task_id="relay", endpoint="orders", max_runtime=8, wait_time_seconds=1,
                                             deferrable=True, poll_interval=0.3, **sqs)
        provision >> slow >> [native, stored] >> dispatch >> relay
    state, states, values = run_dag(dag)
    assert state == "success", states
    transport = SqsTransport(sqs_client, queue_delay=1)
    # What SQS holds at this point says which side missed the message, should the relay not hand it over.
    held = {"delay queue": transport.lifecycle("orders", delay_queue=True), "orders": transport.lifecycle("orders")}
    assert values["relay"]["handed_over"] == 1 and values["relay"]["failed"] == 0, (values["relay"], held)
    assert values["dispatch"]["dispatched"] == 1
    assert values["slow"]["queues"][0]["delay_queue"] == "slow-delay.fifo"
    slow_url = sqs_client.get_queue_url(QueueName="slow")["QueueUrl"]
    assert sqs_client.get_queue_attributes(QueueUrl=slow_url, AttributeNames=["DelaySeconds"])["Attributes"] == {
        "DelaySeconds": "600"}
    got = wait_for(transport, "orders", 2, 30)
    assert sorted(m.body for _, m in got) == [b"long", b"stored"]
    assert {m.message_id for _, m in got} == {values["native"], values["stored"]}


@pytest.mark.parametrize("delay", [0, 3], ids=["native", "through-relay"])
def test_large_body_round_trips_through_s3_and_is_deleted(aws_conn, sqs_client, delay):
    from airflow_delay_provider.hooks.sqs import SqsDelayHook

    hook = SqsDelayHook(aws_conn_id=aws_conn)
    t = hook.get_transport(queue_delay=1, large_body_bucket="delay-bodies")
    t.s3.create_bucket(Bucket="delay-bodies")
    t.provision("orders")
    body = bytes(range(256)) * 1200  # 300 KiB, not UTF-8
    assert t.send([DelayedMessage("orders", body, utcnow() + timedelta(seconds=delay), {"k": "v"}, "big-1")]) == {}
    assert len(t.s3.list_objects_v2(Bucket="delay-bodies").get("Contents", [])) == 1
    deadline = time.monotonic() + 15
    got = []
    while not got and time.monotonic() < deadline:
        if delay:
            t.relay_once("orders", 1)
        got = t.receive("orders")
    [m] = got
    assert m.body == body and m.message_id == "big-1" and m.headers == {"k": "v"}
    assert t.ack("orders", [m.receipt]) == 1
    assert t.s3.list_objects_v2(Bucket="delay-bodies").get("KeyCount", 0) == 0
    small = SqsTransport(sqs_client, queue_delay=1)
    failures = small.send([DelayedMessage("orders", body, utcnow(), {}, "big-2")])
    assert "set large_body_bucket" in str(failures["big-2"])


class FaultyClient:
    """The real moto client, with chosen calls answering as if part of a batch failed."""

    def __init__(self, client, fail_deletes: bool = False, fail_sends: int = 0):
        self._client = client
        self.fail_deletes = fail_deletes
        self.fail_sends = fail_sends
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._client, name)

    def delete_message_batch(self, QueueUrl, Entries):
        self.calls.append("delete_message_batch")
        if self.fail_deletes:
            return {"Successful": [], "Failed": [{"Id": e["Id"], "Code": "InternalError", "SenderFault": False}
                                                 for e in Entries]}
        return self._client.delete_message_batch(QueueUrl=QueueUrl, Entries=Entries)

    def delete_message(self, **kwargs):
        self.calls.append("delete_message")
        return self._client.delete_message(**kwargs)

    def send_message_batch(self, QueueUrl, Entries):
        if self.fail_sends and QueueUrl.endswith("/orders"):
            self.fail_sends -= 1
            return {"Successful": [], "Failed": [{"Id": e["Id"], "Code": "InternalError", "SenderFault": False}
                                                 for e in Entries]}
        return self._client.send_message_batch(QueueUrl=QueueUrl, Entries=Entries)

    def change_message_visibility(self, **kwargs):
        self.calls.append("change_message_visibility")
        return self._client.change_message_visibility(**kwargs)


def test_relay_falls_back_to_single_deletes_and_makes_failed_sends_visible(sqs_client):
    make(sqs_client, 1, "orders")
    t = SqsTransport(FaultyClient(sqs_client, fail_deletes=True, fail_sends=1), queue_delay=1)
    assert t.send([DelayedMessage("orders", b"x", utcnow() + timedelta(seconds=2), {}, "r-1")]) == {}
    counts = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        counts = t.relay_once("orders", 1)
        if counts.failed:
            break
    assert counts.failed == 1 and "change_message_visibility" in t.client.calls  # visible again at once
    handed = 0
    while not handed and time.monotonic() < deadline:
        handed = t.relay_once("orders", 1).handed_over
    assert handed == 1
    assert "delete_message" in t.client.calls  # the failed batch delete was retried singly
    assert t.lifecycle("orders", delay_queue=True) == {"scheduled": 0, "visible": 0, "in_flight": 0}
    [(_, m)] = wait_for(t, "orders", 1, 30)
    assert m.message_id == "r-1"


class Crash(BaseException):
    """Stands for the relay process dying: not an Exception, nothing catches it."""


def crashing_relay(client) -> SqsTransport:
    """A relay (Q = 1 s) that dies right after handing a receive on, before deleting the originals."""
    crashing = FaultyClient(client)

    def crash(**_kwargs):
        raise Crash()

    crashing.delete_message_batch = crash
    return SqsTransport(crashing, queue_delay=1)


def test_relay_crashing_between_send_and_delete_loses_nothing(sqs_client):
    make(sqs_client, 1, "orders")
    t = crashing_relay(sqs_client)
    assert t.send([DelayedMessage("orders", b"x", utcnow() + timedelta(seconds=2), {}, f"k-{i}")
                   for i in range(5)]) == {}
    deadline = time.monotonic() + 10
    with pytest.raises(Crash):
        while time.monotonic() < deadline:
            t.relay_once("orders", 1, visibility_timeout=2)
    # A new relay (the task retried) picks the undeleted messages up again after their visibility timeout.
    survivor = SqsTransport(sqs_client, queue_delay=1)
    while survivor.lifecycle("orders", delay_queue=True) != {"scheduled": 0, "visible": 0, "in_flight": 0}:
        survivor.relay_once("orders", 1, visibility_timeout=2)
        assert time.monotonic() < deadline + 20
    ids = [m.message_id for _, m in wait_for(survivor, "orders", 10, 30)]
    assert set(ids) == {f"k-{i}" for i in range(5)}  # none lost; the crashed batch may come twice


@pytest.mark.parametrize(("sender", "receiver", "long_ok"), [
    (False, False, False), (False, True, False), (True, False, False), (True, True, True)])
def test_sender_receiver_matrix_of_unrestricted_delays(sqs_client, sender, receiver, long_ok):
    t = SqsTransport(sqs_client, queue_delay=2, unrestricted=sender)
    t.provision("orders", unrestricted=receiver)
    now = utcnow()
    short = t.send([DelayedMessage("orders", b"s", now + timedelta(seconds=1), {}, "short")])
    long = t.send([DelayedMessage("orders", b"l", now + timedelta(seconds=5), {}, "long")])
    assert short == {}  # delays up to Q always work
    assert (long == {}) == long_ok


def test_relay_throttles_hand_overs(sqs_client):
    from airflow_delay_provider.core.throttle import TokenBucket

    t = make(sqs_client, 1, "orders")
    assert t.send([DelayedMessage("orders", b"x", utcnow() + timedelta(seconds=2), {}, f"th-{i}")
                   for i in range(8)]) == {}
    throttle = TokenBucket(2)
    held = handed = 0
    first = last = None
    deadline = time.monotonic() + 25
    while handed < 8 and time.monotonic() < deadline:
        counts = t.relay_once("orders", 1, throttle=throttle)
        if counts.handed_over:
            now = time.monotonic()
            first = first or now
            last = now
        handed += counts.handed_over
        held += counts.held
    assert handed == 8 and held > 0
    assert last - first >= 2.5  # 8 messages at 2/s cannot all go within 3 s
    assert len(wait_for(t, "orders", 8, 30)) == 8
