"""Benchmark: dispatching to RabbitMQ with publisher confirms, and the lateness of native delays.

One run, one broker (a vhost of its own, deleted after): pika's raw windowed-confirm publish rate
(the broker's limit for confirmed publishing), pika with one confirm per message (the naive way),
our pump draining the PostgreSQL store into RabbitMQ, and how late 5,000 messages due in the
same second arrive, through the delay levels and through the store and pump.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pika

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import describe, machine  # noqa: E402

from airflow_delay_provider.core.delays import utcnow  # noqa: E402
from airflow_delay_provider.core.message import DelayedMessage  # noqa: E402
from airflow_delay_provider.core.pump import Pump, PumpConfig  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore  # noqa: E402
from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport  # noqa: E402

BODY = b"x" * 200


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


def raw_windowed(params: pika.ConnectionParameters, queue: str, n: int, window: int = 1000) -> float:
    """pika alone: SelectConnection, confirm mode, `window` messages in flight. Returns msg/s."""
    state = {"sent": 0, "acked": 0, "start": 0.0, "end": 0.0}

    def publish_more(channel):
        while state["sent"] < n and state["sent"] - state["acked"] < window:
            # The same message shape the pump sends: an id, one header, persistent.
            properties = pika.BasicProperties(message_id=uuid.uuid4().hex, delivery_mode=2,
                                              headers={"x-delay-due-at": "2026-01-01T00:00:00+00:00"})
            channel.basic_publish("", queue, BODY, properties, mandatory=True)
            state["sent"] += 1

    def on_ack(frame):
        tag = frame.method.delivery_tag
        state["acked"] = tag if frame.method.multiple else max(state["acked"], tag)
        if state["acked"] >= n:
            state["end"] = time.perf_counter()
            connection.close()
        else:
            publish_more(channel_holder[0])

    def on_channel(channel):
        channel_holder.append(channel)
        channel.confirm_delivery(
            on_ack, callback=lambda _f: (state.update(start=time.perf_counter()), publish_more(channel)))

    channel_holder: list = []
    connection = pika.SelectConnection(params, on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
                                       on_close_callback=lambda c, e: c.ioloop.stop())
    connection.ioloop.start()
    return n / (state["end"] - state["start"])


def one_confirm_each(params: pika.ConnectionParameters, queue: str, n: int) -> float:
    """pika BlockingConnection with confirms: each publish waits for its own confirm."""
    connection = pika.BlockingConnection(params)
    channel = connection.channel()
    channel.confirm_delivery()
    started = time.perf_counter()
    for _ in range(n):
        channel.basic_publish("", queue, BODY, pika.BasicProperties(delivery_mode=2))
    elapsed = time.perf_counter() - started
    connection.close()
    return n / elapsed


def arrivals(params: pika.ConnectionParameters, queue: str, n: int, timeout: float) -> dict[str, float]:
    """Consume `n` messages, returning each message id's arrival time (epoch seconds)."""
    seen: dict[str, float] = {}
    connection = pika.BlockingConnection(params)
    channel = connection.channel()
    deadline = time.monotonic() + timeout
    # auto_ack: a consumer acking one by one would be the bottleneck, not the delivery.
    for method, properties, _body in channel.consume(queue, auto_ack=True, inactivity_timeout=0.5):
        if method is not None:
            seen[properties.message_id] = time.time()
        if len(seen) >= n or time.monotonic() > deadline:
            break
    channel.cancel()
    connection.close()
    return seen


def start_consumer(vhost: str, host: str, queue: str, n: int) -> subprocess.Popen:
    """A consumer in its own process, so the sender's work does not delay the arrival times."""
    return subprocess.Popen([sys.executable, __file__, "--consume", vhost, host, queue, str(n)],
                            stdout=subprocess.PIPE, text=True)


def consumer_result(proc: subprocess.Popen) -> dict[str, float]:
    return json.loads(proc.communicate(timeout=120)[0])


def lateness(due: dict[str, float], arrived: dict[str, float]) -> tuple[float, float, int]:
    late = sorted(arrived[m] - due[m] for m in due if m in arrived)
    return late[len(late) // 2], late[int(len(late) * 0.99) - 1], len(due) - len(late)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--pg-url", default=os.environ.get("DELAY_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--naive-messages", type=int, default=5_000)
    parser.add_argument("--lateness-messages", type=int, default=5_000)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "rabbitmq.json")
    parser.add_argument("--consume", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.consume:
        vhost, host, queue, n = args.consume
        params = pika.ConnectionParameters(host, 5672, vhost, pika.PlainCredentials("guest", "guest"))
        print(json.dumps(arrivals(params, queue, int(n), 60)))
        return

    vhost = f"adp_bench_{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", vhost)
    rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    params = pika.ConnectionParameters(args.host, 5672, vhost, pika.PlainCredentials("guest", "guest"))
    schema = f"adp_bench_{uuid.uuid4().hex[:8]}"
    store = SqlDelayedMessageStore(args.pg_url, schema=schema)
    transport = RabbitMQTransport(params)
    r: dict = {"machine": machine(args.pg_url, rabbitmq=True)}
    try:
        store.create_schema()
        for queue in ("raw", "naive", "orders", "timed", "error"):
            transport.provision(queue)
        listed = subprocess.run(["rabbitmqctl", "-q", "list_queues", "-p", vhost, "name", "type"], check=True,
                                capture_output=True, text=True, timeout=60).stdout.split()
        r["queue_type"] = dict(zip(listed[::2], listed[1::2], strict=False)).get("raw", "?")
        n = args.messages
        log(f"pika raw, windowed confirms: {n} messages")
        r["raw_windowed"] = raw_windowed(params, "raw", n)
        log(f"pika, one confirm per message: {args.naive_messages} messages")
        r["one_confirm"] = one_confirm_each(params, "naive", args.naive_messages)
        log(f"our pump: {n} due messages, PostgreSQL store -> RabbitMQ")
        now = utcnow()
        batch = [DelayedMessage("orders", BODY, now, {}, uuid.uuid4().hex) for _ in range(n)]
        for i in range(0, n, 1000):
            store.store(batch[i : i + 1000])
        started = time.perf_counter()
        result = Pump(store, transport, PumpConfig(batch_size=1000)).run(stop_when_idle=True)
        r["pump"] = result.stats.dispatched / (time.perf_counter() - started)
        assert result.stats.dispatched == n, result.stats.summary()

        m = args.lateness_messages
        # Exactly 4 s from now: the whole-second delays then carry no rounding of their own.
        due_at = utcnow() + timedelta(seconds=4)
        log(f"lateness: {m} messages due at {due_at.time()} through the delay levels")
        native = [DelayedMessage("timed", BODY, due_at, {}, f"n-{i}") for i in range(m)]
        consumer = start_consumer(vhost, args.host, "timed", m)
        assert transport.send(native) == {}
        due = {msg.message_id: due_at.timestamp() for msg in native}
        r["native_p50"], r["native_p99"], r["native_missing"] = lateness(due, consumer_result(consumer))

        due_at = (utcnow() + timedelta(seconds=4)).replace(microsecond=0)
        log(f"lateness: {m} messages due at {due_at.time()} through the store and the pump")
        stored = [DelayedMessage("timed", BODY, due_at, {}, f"s-{i}") for i in range(m)]
        store.store(stored)
        consumer = start_consumer(vhost, args.host, "timed", m)
        Pump(store, transport).run(due_before=due_at + timedelta(seconds=1))
        due = {msg.message_id: due_at.timestamp() for msg in stored}
        r["pump_p50"], r["pump_p99"], r["pump_missing"] = lateness(due, consumer_result(consumer))
    finally:
        transport.close()
        store.close()
        with store.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        rabbitmqctl("delete_vhost", vhost)

    print(f"\n{describe(r['machine'])}\n{args.messages:,} messages of {len(BODY)} B, persistent, to queues "
          f"provisioned by RabbitMQTransport (type: {r['queue_type']}), one run\n")
    print("| measure | msg/s | vs raw windowed confirms |")
    print("|---|---:|---:|")
    print(f"| pika raw, 1,000 confirms in flight (the broker's limit) | {r['raw_windowed']:,.0f} | 100% |")
    print(f"| **our pump, PostgreSQL store -> RabbitMQ, windowed confirms** | {r['pump']:,.0f} | "
          f"{r['pump'] / r['raw_windowed']:.0%} |")
    print(f"| pika, one confirm per message (reference way) | {r['one_confirm']:,.0f} | "
          f"{r['one_confirm'] / r['raw_windowed']:.0%} |")
    print(f"\n| {args.lateness_messages:,} messages due in the same second | lateness p50 | p99 | missing |")
    print("|---|---:|---:|---:|")
    print(f"| native: the 28 delay levels | {r['native_p50'] * 1000:.0f} ms | {r['native_p99'] * 1000:.0f} ms | "
          f"{r['native_missing']} |")
    print(f"| SQL store + pump -> RabbitMQ | {r['pump_p50'] * 1000:.0f} ms | {r['pump_p99'] * 1000:.0f} ms | "
          f"{r['pump_missing']} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
