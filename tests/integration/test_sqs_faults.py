"""Amazon SQS against moto's server: queue-level defaults, duplicates, large bodies, retention, batches SQS
refuses in part or whole, clocks, and requests SQS throttles."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from datetime import timedelta

import pytest
from botocore.exceptions import ClientError

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.transports.sqs import RelayCounts, SqsTransport
from tests.integration.test_sqs import Crash, FaultyClient, crashing_relay, make, wait_for
from tests.waiting import wait_for as wait_until

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
    assert sorted(m.message_id for _, m in wait_for(t, "slow", 3, 30)) == ["m-0", "m-1", "m-2"]
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
    [(arrived, m)] = wait_for(t, "slow", 1, 30)
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
    deadline = time.monotonic() + 30
    with pytest.raises(Crash):  # handed over, then died before deleting: the relay re-sends it
        while time.monotonic() < deadline:
            relay.relay_once("orders", 1, visibility_timeout=1)

    def relayed() -> bool:  # the delay queue emptied by a relay that does not crash
        if total(t, "orders", delay_queue=True):
            t.relay_once("orders", 1, visibility_timeout=1)
            return False
        return True

    wait_until(relayed, 30, "the relay to hand the message over again")
    assert total(t, "orders") == 2  # two copies of one message, one S3 object
    first = wait_until(lambda: t.receive("orders", 1), 30, "the first copy")
    assert first[0].body == BODY
    assert t.ack("orders", [first[0].receipt]) == 1  # delivered: its object is deleted
    # The relay counts on SQS's clock in whole seconds: the second copy may still be delayed for a second.
    wait_until(lambda: t.lifecycle("orders")["visible"] >= 1, 30, "the second copy to be visible")
    assert t.send([DelayedMessage("orders", b"small", utcnow(), {}, "plain-1")]) == {}
    got = wait_until(lambda: t.receive("orders", 10), 30, "plain-1")  # the duplicate with it must not fail the batch
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
    report = t.check_delay_queue("orders")
    assert report["ok"] and report["warnings"] == [] and report["retention_seconds"] == FOURTEEN_DAYS
    url = sqs_client.get_queue_url(QueueName="orders-delay.fifo")["QueueUrl"]
    sqs_client.set_queue_attributes(QueueUrl=url, Attributes={"MessageRetentionPeriod": "345600"})
    with caplog.at_level(logging.WARNING, logger="airflow_delay_provider.transports.sqs.transport"):
        report = t.check_delay_queue("orders")
    assert report["ok"]
    [warning] = report["warnings"]
    assert "345600" in warning and "max_relay_downtime" in warning
    assert any(r.levelno == logging.WARNING and "345600" in r.getMessage() for r in caplog.records)
    # A relay that is never down for more than a day is safe with 4 days.
    safe = SqsTransport(sqs_client, queue_delay=900, max_relay_downtime=86_400)
    assert safe.check_delay_queue("orders")["warnings"] == []


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


# -- batches: split by size, a refused message is its own failure, an outage fails only what was not taken --
def limit_message_size(sqs_client, queue: str, size: int) -> None:
    url = sqs_client.get_queue_url(QueueName=queue)["QueueUrl"]
    sqs_client.set_queue_attributes(QueueUrl=url, Attributes={"MaximumMessageSize": str(size)})


def received_ids(t: SqsTransport, endpoint: str, expected: int, timeout: float = 10) -> list[str]:
    """Every delivery's id until `expected` arrived and the queue is empty (duplicates would show)."""
    ids, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = t.receive(endpoint, 10)
        ids += [m.message_id for m in batch]
        if batch:
            t.ack(endpoint, [m.receipt for m in batch])
        elif len(ids) >= expected and total(t, endpoint) == 0:
            break
        else:
            time.sleep(0.1)
    return ids


def test_the_relay_splits_hand_overs_by_size(sqs_client):
    t = make(sqs_client, 1, "orders")
    body = b"x" * (200 * 1024)  # ten of them are 2 MB: more than one batch may carry
    assert t.send([DelayedMessage("orders", body, utcnow() + timedelta(seconds=2), {}, f"big-{i}")
                   for i in range(10)]) == {}
    handed, deadline = 0, time.monotonic() + 20
    while handed < 10 and time.monotonic() < deadline:
        handed += t.relay_once("orders", 1).handed_over
    assert handed == 10
    assert sorted(received_ids(t, "orders", 10)) == sorted(f"big-{i}" for i in range(10))
    assert total(t, "orders", delay_queue=True) == 0


@pytest.mark.parametrize("error_queue", [True, False], ids=["dead-lettered", "no-error-queue"])
def test_a_relayed_message_the_destination_refuses_for_good_holds_back_nothing(sqs_client, caplog, error_queue):
    t = make(sqs_client, 1, "orders", *(["error"] if error_queue else []))
    limit_message_size(sqs_client, "orders", 1024)
    due = utcnow() + timedelta(seconds=2)
    assert t.send([DelayedMessage("orders", b"a", due, {}, "ok-1"),
                   DelayedMessage("orders", b"y" * 2000, due, {"k": "v"}, "too-big"),
                   DelayedMessage("orders", b"b", due, {}, "ok-2")]) == {}
    totals, deadline = RelayCounts(), time.monotonic() + 20
    with caplog.at_level(logging.ERROR, logger="airflow_delay_provider.transports.sqs.relay"):
        while totals.handed_over < 2 and time.monotonic() < deadline:
            totals.add(t.relay_once("orders", 1))
    assert totals.handed_over == 2
    assert sorted(received_ids(t, "orders", 2)) == ["ok-1", "ok-2"]
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "too-big" in record.getMessage() and "'orders'" in record.getMessage()
    if error_queue:
        assert totals.dead_lettered == 1
        [dead] = [m for _, m in wait_for(t, "error", 1, 30)]
        assert dead.message_id == "too-big" and dead.body == b"y" * 2000 and dead.headers["k"] == "v"
        assert dead.headers["x-delay-failed-destination"] == "orders"
        assert "shorter than 1024 bytes" in dead.headers["x-delay-failure-reason"]
        assert total(t, "orders", delay_queue=True) == 0
    else:  # kept, hidden: not tried again in a tight loop
        assert totals.failed == 1
        assert t.lifecycle("orders", delay_queue=True) == {"scheduled": 0, "visible": 0, "in_flight": 1}
        again = t.relay_once("orders", 1)
        assert (again.handed_over, again.failed, again.relayed) == (0, 0, 0)


def refusing_batch(sqs_client, size: int = 1024) -> list[DelayedMessage]:
    """Twelve messages due now, the last one larger than the `orders` queue takes."""
    limit_message_size(sqs_client, "orders", size)
    now = utcnow()
    return [DelayedMessage("orders", f"body-{i}".encode() if i < 11 else b"z" * 2000, now, {}, f"m-{i}")
            for i in range(12)]


def test_send_natively_fails_only_the_refused_message_and_sends_the_others_once(sqs_client, tmp_path):
    from airflow_delay_provider.core.breakers import CircuitBreaker
    from airflow_delay_provider.core.errors import CriticalError, DelayProviderError
    from airflow_delay_provider.core.sending import send_natively
    from tests.helpers import make_store

    t = make(sqs_client, 900, "orders")
    store = make_store(f"sqlite:///{tmp_path / 's.db'}", None, "delayed")
    batch = refusing_batch(sqs_client)
    with pytest.raises(DelayProviderError) as refused:
        send_natively(store, t, batch, CircuitBreaker("sending", 5))
    assert not isinstance(refused.value, CriticalError), refused.value
    assert "1 of 12 message(s) were refused" in str(refused.value)
    assert "m-11: SQS queue 'orders' refused message m-11" in str(refused.value)
    assert "shorter than 1024 bytes" in str(refused.value)
    assert sorted(received_ids(t, "orders", 11)) == sorted(f"m-{i}" for i in range(11))  # each exactly once
    assert store.unseen([m.message_id for m in batch]) == ["m-11"]  # the sent ones are recorded


def test_the_pump_dead_letters_the_refused_message_and_dispatches_the_others_once(sqs_client, tmp_path):
    from airflow_delay_provider.core.pump import Pump, PumpConfig
    from tests.helpers import make_store

    t = make(sqs_client, 900, "orders", "error")
    store = make_store(f"sqlite:///{tmp_path / 's.db'}", None, "delayed")
    store.store(refusing_batch(sqs_client))
    result = Pump(store, t, PumpConfig(time_to_trigger_dispatch_circuit_breaker=3)).run(stop_when_idle=True)
    assert (result.stats.dispatched, result.stats.dead_lettered) == (11, 1)
    assert sorted(received_ids(t, "orders", 11)) == sorted(f"m-{i}" for i in range(11))
    [dead] = [m for _, m in wait_for(t, "error", 1, 30)]
    assert dead.message_id == "m-11" and "refused message m-11" in dead.headers["x-delay-failure-reason"]


class FailingOnce(FaultyClient):
    """The real moto client, whose `n`-th send_message_batch fails as SQS's own outage would."""

    def __init__(self, client, n: int):
        super().__init__(client)
        self.n = n

    def send_message_batch(self, QueueUrl, Entries):
        self.n -= 1
        if self.n == 0:
            raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "try again"},
                               "ResponseMetadata": {"HTTPStatusCode": 503}}, "SendMessageBatch")
        return self._client.send_message_batch(QueueUrl=QueueUrl, Entries=Entries)


def test_an_outage_fails_only_the_batches_sqs_did_not_take(sqs_client, tmp_path):
    from airflow_delay_provider.core.breakers import CircuitBreaker
    from airflow_delay_provider.core.errors import UnavailableError
    from airflow_delay_provider.core.sending import send_natively
    from tests.helpers import make_store

    make(sqs_client, 900, "orders")
    t = SqsTransport(FailingOnce(sqs_client, 2), queue_delay=900)
    batch = [DelayedMessage("orders", f"b{i}".encode(), utcnow(), {}, f"o-{i}") for i in range(25)]
    failures = t.send(batch)  # the 10 of the first batch went; the second failed, the third was not tried
    assert sorted(failures) == sorted(f"o-{i}" for i in range(10, 25))
    assert all(isinstance(e, UnavailableError) for e in failures.values())
    assert "ServiceUnavailable" in str(failures["o-10"])
    # Through send_natively the failed ones go again, and none of the accepted ones does.
    t = SqsTransport(FailingOnce(sqs_client, 2), queue_delay=900)
    again = [DelayedMessage("orders", f"b{i}".encode(), utcnow(), {}, f"p-{i}") for i in range(25)]
    store = make_store(f"sqlite:///{tmp_path / 's.db'}", None, "delayed")
    assert send_natively(store, t, again, CircuitBreaker("sending", 10)) == 25
    ids = received_ids(t, "orders", 35)
    assert sorted(ids) == sorted([f"o-{i}" for i in range(10)] + [f"p-{i}" for i in range(25)])


# -- clocks: one per path ------------------------------------------------------------------------------
AHEAD = timedelta(hours=1)


def test_a_native_send_counts_the_delay_on_the_clock_it_was_given(sqs_client):
    t = make(sqs_client, 900, "orders").use_clock(lambda: utcnow() + AHEAD)  # the store's clock, an hour ahead
    due = t.clock() + timedelta(seconds=2)  # two seconds from now, on that clock
    assert t.send([DelayedMessage("orders", b"x", due, {}, "c-1")]) == {}
    assert [m.message_id for _, m in wait_for(t, "orders", 1, 30)] == ["c-1"]
    assert total(t, "orders", delay_queue=True) == 0  # natively, not an hour through the relay


def test_a_redelivered_message_is_not_handed_over_early_when_the_host_clock_runs_ahead(sqs_client, monkeypatch):
    from airflow_delay_provider.transports.sqs import relay

    t = make(sqs_client, 2, "orders")
    due = utcnow() + timedelta(seconds=8)
    assert t.send([DelayedMessage("orders", b"x", due, {}, "skew-1")]) == {}
    # Someone received it from the delay queue without relaying it: the relay's next receive is a redelivery.
    url = sqs_client.get_queue_url(QueueName="orders-delay.fifo")["QueueUrl"]
    deadline = time.monotonic() + 10
    while not sqs_client.receive_message(QueueUrl=url, VisibilityTimeout=0, WaitTimeSeconds=1).get("Messages"):
        assert time.monotonic() < deadline, "the message never became visible in the delay queue"
    real = relay.utcnow
    monkeypatch.setattr(relay, "utcnow", lambda: real() + AHEAD)  # this host's clock runs an hour ahead of SQS's
    t.use_clock(lambda: real() + AHEAD)
    counts = RelayCounts()
    while not counts.relayed + counts.handed_over:
        counts = t.relay_once("orders", 1)
        assert time.monotonic() < deadline + 5
    assert (counts.relayed, counts.handed_over) == (1, 0)  # six seconds are left on SQS's clock
    got = []
    while not got:
        t.relay_once("orders", 1)
        got = wait_for(t, "orders", 1, 0.2)
        assert time.monotonic() < deadline + 25
    [(arrived, m)] = got
    assert m.message_id == "skew-1" and arrived >= due


# -- throttling: retried where it would duplicate or hide messages, else the package's error ----------
class Throttling:
    """The real moto client, remembering every entry sent and to which queue, whose calls named in `times`
    SQS throttles: that many times each, or every time (None)."""

    def __init__(self, client, **times):
        self._client = client
        self.times = times
        self.throttled = Counter()
        self.sent = []

    def __getattr__(self, name):
        call = getattr(self._client, name)
        if name not in self.times:
            return call

        def throttled(**kwargs):
            left = self.times[name]
            if left is None or left > 0:
                self.times[name] = None if left is None else left - 1
                self.throttled[name] += 1
                raise ClientError({"Error": {"Code": "Throttling", "Message": "Rate exceeded"},
                                   "ResponseMetadata": {"HTTPStatusCode": 400}},
                                  "".join(part.title() for part in name.split("_")))
            return call(**kwargs)

        return throttled

    def send_message_batch(self, QueueUrl, Entries):
        self.sent.extend((QueueUrl, entry) for entry in Entries)
        return self._client.send_message_batch(QueueUrl=QueueUrl, Entries=Entries)


def no_credentials_in(sqs_client, *texts: str) -> None:
    secrets = sqs_client._request_signer._credentials.get_frozen_credentials()
    for text in texts:
        assert secrets.access_key not in text and secrets.secret_key not in text, text


def relay_all(t: SqsTransport, endpoint: str, timeout: float = 30) -> RelayCounts:
    """Relay until the delay queue is empty (nothing delayed, visible or in flight there)."""
    totals = RelayCounts()

    def emptied() -> bool:
        if total(t, endpoint, delay_queue=True):
            totals.add(t.relay_once(endpoint, 1, visibility_timeout=2))
            return False
        return True

    wait_until(emptied, timeout, f"the delay queue of {endpoint!r} to empty")
    return totals


def test_a_delete_throttled_after_the_sends_is_retried_within_the_pass(sqs_client):
    make(sqs_client, 1, "orders")
    client = Throttling(sqs_client, delete_message_batch=3)
    t = SqsTransport(client, queue_delay=1)
    ids = [f"t-{i}" for i in range(5)]
    assert t.send([DelayedMessage("orders", b"x", utcnow() + timedelta(seconds=2), {}, i) for i in ids]) == {}
    totals = relay_all(t, "orders")
    # A delete comes only after a pass's sends: these struck after SQS had taken them.
    assert client.throttled["delete_message_batch"] == 3
    assert (totals.handed_over, totals.failed) == (5, 0)
    assert sorted(received_ids(t, "orders", 5)) == ids  # each once: the retried delete left no copy behind


def test_a_delete_throttled_for_good_fails_the_pass_unavailable_and_loses_nothing(sqs_client, caplog):
    from airflow_delay_provider.core.errors import UnavailableError

    make(sqs_client, 1, "orders")
    client = Throttling(sqs_client, delete_message_batch=None, delete_message=None)
    t = SqsTransport(client, queue_delay=1)
    ids = [f"g-{i}" for i in range(5)]
    assert t.send([DelayedMessage("orders", b"x", utcnow() + timedelta(seconds=2), {}, i) for i in ids]) == {}
    deadline = time.monotonic() + 20
    with caplog.at_level(logging.DEBUG, logger="airflow_delay_provider"), pytest.raises(UnavailableError) as failed:
        while time.monotonic() < deadline:
            t.relay_once("orders", 1, visibility_timeout=2)
    message = str(failed.value)
    assert "'orders-delay.fifo'" in message and "Throttling" in message, message
    no_credentials_in(sqs_client, message, caplog.text)
    assert client.throttled["delete_message_batch"] > 1  # retried with backoff before it gave up
    handed = {e["MessageAttributes"]["x-message-id"]["StringValue"]
              for url, e in client.sent if url.endswith("/orders")}
    assert handed  # the failed pass had sent these on before its delete
    # Not deleted, they come back after their visibility timeout and go again: the only duplicates.
    survivor = SqsTransport(sqs_client, queue_delay=1)
    relay_all(survivor, "orders")
    got = Counter(received_ids(survivor, "orders", len(ids) + len(handed), timeout=30))
    assert got == {i: 2 if i in handed else 1 for i in ids}
    assert sum(got.values()) - len(ids) == len(handed)


@pytest.mark.parametrize("why", ["send outage", "held"])
def test_a_throttled_visibility_change_neither_fails_the_pass_nor_loses_the_message(sqs_client, caplog, why):
    from airflow_delay_provider.core.throttle import TokenBucket

    make(sqs_client, 1, "orders")
    # A send outage makes its messages visible at once; a held one (the destination's rate) comes back in a second.
    inner = FaultyClient(sqs_client, fail_sends=1 if why == "send outage" else 0)
    client = Throttling(inner, change_message_visibility=None)
    t = SqsTransport(client, queue_delay=1)
    ids = [f"v-{i}" for i in range(5)]
    assert t.send([DelayedMessage("orders", b"x", utcnow() + timedelta(seconds=2), {}, i) for i in ids]) == {}
    throttle = TokenBucket(1) if why == "held" else None
    totals, deadline = RelayCounts(), time.monotonic() + 30
    with caplog.at_level(logging.WARNING, logger="airflow_delay_provider"):
        while totals.handed_over < 5 and time.monotonic() < deadline:
            totals.add(t.relay_once("orders", 1, visibility_timeout=1, throttle=throttle))
    assert totals.handed_over == 5
    assert client.throttled["change_message_visibility"] == (totals.failed if why == "send outage" else totals.held) > 0
    assert "Throttling" in caplog.text
    no_credentials_in(sqs_client, caplog.text)
    assert sorted(received_ids(t, "orders", 5)) == ids  # hidden until their visibility timeout, then relayed once
    assert total(t, "orders", delay_queue=True) == 0


@pytest.mark.parametrize("call", ["receive", "ack", "depth", "check_delay_queue"])
def test_a_throttled_request_of_the_transport_raises_unavailable_naming_the_queue(sqs_client, call):
    from airflow_delay_provider.core.errors import UnavailableError

    plain = make(sqs_client, 1, "orders")
    assert plain.send([DelayedMessage("orders", b"x", utcnow(), {}, "u-1")]) == {}
    [received] = wait_until(lambda: plain.receive("orders", 1), 10, "u-1")
    op = {"receive": "receive_message", "ack": "delete_message_batch", "depth": "get_queue_attributes",
          "check_delay_queue": "get_queue_attributes"}[call]
    client = Throttling(sqs_client, **{op: None})
    t = SqsTransport(client, queue_delay=1)
    args = {"ack": ("orders", [received.receipt])}.get(call, ("orders",))
    with pytest.raises(UnavailableError) as failed:
        getattr(t, call)(*args)
    queue = "orders-delay.fifo" if call == "check_delay_queue" else "orders"
    assert f"{queue!r}" in str(failed.value) and "Throttling" in str(failed.value), failed.value
    no_credentials_in(sqs_client, str(failed.value))
    if call == "ack":  # retried with backoff before it gave up; the message is still there, and acked later
        assert client.throttled[op] > 1
        assert total(plain, "orders") == 1
        assert plain.ack("orders", [received.receipt]) == 1


def test_a_throttled_provisioning_is_unavailable_not_a_refusal(sqs_client):
    """SQS throttling a queue's creation says nothing about the request: an outage to try again, not the
    InvalidInputError of a queue SQS refuses."""
    from airflow_delay_provider.core.errors import UnavailableError

    client = Throttling(sqs_client, create_queue=None)
    with pytest.raises(UnavailableError, match="'orders'.*Throttling") as failed:
        SqsTransport(client, queue_delay=1).provision("orders")
    no_credentials_in(sqs_client, str(failed.value))
    assert SqsTransport(sqs_client, queue_delay=1).provision("orders")["queue"] == "orders"
