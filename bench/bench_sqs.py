"""Benchmark: the SQS relay on moto's server, ours (batches of 10) against one message at a time.

Prints relay throughput and SQS requests per relayed message, moto's raw batched-send rate in
the same run, and the relay cost of long delays at SQS's FIFO price. moto stands in for SQS
here: its rates say how the two relays compare, not what AWS would do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import boto3

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import describe, machine  # noqa: E402

from airflow_delay_provider.core.delays import utcnow  # noqa: E402
from airflow_delay_provider.core.message import DelayedMessage  # noqa: E402
from airflow_delay_provider.transports.sqs import SqsTransport, delay_plan, estimate_cost  # noqa: E402
from tests.services import MotoServer  # noqa: E402


class Counting:
    """A boto3 client that counts its API calls."""

    def __init__(self, client):
        self._client = client
        self.calls: Counter = Counter()

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if callable(attr) and not name.startswith("_") and name != "meta":
            def call(*args, **kwargs):
                self.calls[name] += 1
                return attr(*args, **kwargs)
            return call
        return attr


def one_at_a_time(client, fifo_url: str, dest_url: str) -> int:
    """The naive relay: receive one, send one, delete one."""
    got = client.receive_message(QueueUrl=fifo_url, MaxNumberOfMessages=1, WaitTimeSeconds=1,
                                 MessageAttributeNames=["All"], AttributeNames=["All"]).get("Messages", [])
    for m in got:
        attributes = {k: v for k, v in m.get("MessageAttributes", {}).items() if k != "x-delay-seconds"}
        client.send_message(QueueUrl=dest_url, MessageBody=m["Body"], MessageAttributes=attributes)
        client.delete_message(QueueUrl=fifo_url, ReceiptHandle=m["ReceiptHandle"])
    return len(got)


def fill(transport: SqsTransport, n: int, q: int) -> None:
    due = utcnow() + timedelta(seconds=q + 1)  # one cycle in the delay queue, then handed over
    batch = [DelayedMessage("orders", b"x" * 200, due, {}, f"m-{i}") for i in range(n)]
    assert transport.send(batch) == {}
    time.sleep(q + 0.5)  # the queue-level delay passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "sqs.json")
    args = parser.parse_args()
    moto = MotoServer()
    url = moto.url
    r: dict = {}
    try:
        raw = boto3.client("sqs", endpoint_url=url, region_name="us-east-1",
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        n, q = args.messages, 1
        queue = raw.create_queue(QueueName="raw")["QueueUrl"]
        started = time.perf_counter()
        for _i in range(0, n, 10):
            raw.send_message_batch(QueueUrl=queue,
                                   Entries=[{"Id": str(j), "MessageBody": "x" * 200} for j in range(10)])
        r["raw_send_batch"] = n / (time.perf_counter() - started)

        counting = Counting(raw)
        ours = SqsTransport(counting, queue_delay=q)
        ours.provision("orders")
        fill(ours, n, q)
        counting.calls.clear()
        started, moved = time.perf_counter(), 0
        while moved < n:
            moved += ours.relay_once("orders", 1).handed_over
        r["ours_rate"] = n / (time.perf_counter() - started)
        r["ours_requests"] = sum(counting.calls.values()) / n
        raw.purge_queue(QueueUrl=ours._url("orders"))

        fill(ours, n, q)
        counting.calls.clear()
        fifo, dest = ours._url("orders-delay.fifo"), ours._url("orders")
        started, moved = time.perf_counter(), 0
        while moved < n:
            moved += one_at_a_time(counting, fifo, dest)
        r["naive_rate"] = n / (time.perf_counter() - started)
        r["naive_requests"] = sum(counting.calls.values()) / n
    finally:
        moto.stop()

    print(f"\n{describe(machine())}\nmoto's server on loopback, {n} messages relayed once (Q = {q} s)\n")
    print("| relay | messages/s | SQS requests per message and cycle |")
    print("|---|---:|---:|")
    print(f"| **ours: receive 10, batched send, batched delete** | {r['ours_rate']:,.0f} | {r['ours_requests']:.2f} |")
    print(f"| one message at a time | {r['naive_rate']:,.0f} | {r['naive_requests']:.2f} |")
    print(f"| moto's raw send_message_batch (10 per call) | {r['raw_send_batch']:,.0f} | 0.10 |")
    print("\n| delay | FIFO cycles (Q = 900 s) | requests | cost at $0.50 per million |")
    print("|---|---:|---:|---:|")
    for label, seconds in (("1 hour", 3600), ("1 day", 86_400), ("1 year", 31_536_000)):
        plan = delay_plan(seconds)
        print(f"| {label} | {plan.fifo_cycles:,} | {plan.requests():,} | ${estimate_cost(seconds):.6f} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
