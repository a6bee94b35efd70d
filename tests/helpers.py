"""Small builders shared by the tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores import engine
from airflow_delay_provider.stores.engine import START_SECONDS
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport


def store_connection(url: str, db_schema: str, table: str | None = None) -> dict:
    """A `delay_store` connection (as AIRFLOW_CONN_* JSON takes it) to `db_schema` of the PostgreSQL at `url`."""
    from sqlalchemy.engine import make_url

    parts = make_url(url)
    extra = {"db_schema": db_schema, **({"table": table} if table else {})}
    return {"conn_type": "delay_store", "host": parts.host, "port": parts.port or 5432, "login": parts.username,
            "schema": parts.database, "extra": extra}


def make_store(url, schema, table) -> SqlDelayedMessageStore:
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    return store


def make_transport(url, schema, table, *queues: str) -> SqlTableTransport:
    transport = SqlTableTransport(url, schema=schema, table_prefix=f"{table}_")
    for queue in queues:
        transport.provision(queue)
    return transport


def plan_nodes(plan: dict) -> list[dict]:
    """A node of a JSON plan (EXPLAIN or auto_explain) and all the nodes below it."""
    return [plan] + [n for child in plan.get("Plans", []) for n in plan_nodes(child)]


def messages(n: int, destination: str = "orders", delay: float = 0.0, start: int = 0) -> list[DelayedMessage]:
    due = utcnow() + timedelta(seconds=delay)
    return [DelayedMessage(destination, f"body-{i}".encode(), due, {"n": str(i)}, f"m-{i}")
            for i in range(start, start + n)]


def drain(transport: SqlTableTransport, queue: str) -> list:
    received = []
    while batch := transport.receive(queue, max_messages=1000):
        received.extend(batch)
        transport.ack(queue, [m.receipt for m in batch])
    return received


def receive_until(queues: SqlTableTransport, queue: str, expected: set[str], timeout: float) -> list:
    """Every delivery to `queue` (duplicates included) until all `expected` ids arrived, or `timeout`, and what
    arrives in the second after: a copy delivered twice comes right behind."""
    got, seen = [], set()
    deadline = time.monotonic() + timeout
    while not expected <= seen and time.monotonic() < deadline:
        batch = queues.receive(queue, max_messages=1000)
        got.extend(batch)
        seen.update(m.message_id for m in batch)
        if batch:
            queues.ack(queue, [m.receipt for m in batch])
        else:
            time.sleep(0.05)
    time.sleep(1.0)
    return got + drain(queues, queue)


def collect(transport, queue: str, expected: int, timeout: float, bounds: bool = False) -> list:
    """Consume until `expected` distinct messages arrived and the queue is empty, or `timeout`;
    returns (arrival time, message) for every delivery, duplicates included: the time its receive returned.

    With `bounds`, (arrived after, arrived by, message): a receive returns what is in the queue (up to 500), so a
    message arrived after the start of the last receive before its own that returned fewer (None before the first),
    and by the end of its own. On a busy machine one receive can take seconds, and only the first bound is the
    broker's lateness rather than the collector's."""
    got, seen = [], set()
    cleared = None  # the start of the last receive that found the queue empty
    deadline = time.monotonic() + timeout
    while (len(seen) < expected or transport.depth(queue)["visible"]) and time.monotonic() < deadline:
        started = utcnow()
        batch = transport.receive(queue, max_messages=500)
        now = utcnow()
        got.extend(((cleared, now, m) if bounds else (now, m)) for m in batch)
        if len(batch) < 500:
            cleared = started
        seen.update(m.message_id for m in batch)
        if batch:
            transport.ack(queue, [m.receipt for m in batch])
        else:
            time.sleep(0.02)
    return got


def orders(store, n=10, destination="orders", due_in=3600.0, body=b"x") -> datetime:
    """`n` messages `<destination>-<i>` with an `order-id` header, due `due_in + i` s from now; returns that now."""
    now = utcnow()
    store.store([DelayedMessage(destination, body, now + timedelta(seconds=due_in + i),
                                {"order-id": str(i)}, message_id=f"{destination}-{i}") for i in range(n)])
    return now


#: spread_backlog's due times of `orders` (seconds from now): two due, then one per histogram bucket, two later.
SPREAD = (-10, -1, 30, 120, 7200, 90_000, 500_000)


def spread_backlog(store) -> None:
    """`orders` due across the backlog histogram, and two due `refunds`, paused."""
    now = utcnow()
    store.store([DelayedMessage("orders", b"", now + timedelta(seconds=s), message_id=f"o{i}")
                 for i, s in enumerate(SPREAD)])
    orders(store, 2, destination="refunds", due_in=-3)
    store.set_paused(["refunds"], True)


def consume_ids(parameters, queue: str, expected: int, quiet: float) -> Counter:
    """How often each message id arrived in a RabbitMQ queue, read with a window of 1,000 unacknowledged
    deliveries and acknowledged in bulk: the transport's receive() asks for each message in turn, which takes
    minutes for 100,000 on a busy machine. Stops once `expected` distinct ids arrived and the queue holds no
    more (a copy sent twice is counted too), or when `quiet` seconds pass with nothing (a lost message ends it).
    Call it once the senders are done: what they sent is in the queue by then."""
    import pika

    ids: Counter = Counter()
    connection = pika.BlockingConnection(parameters)
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1000)
        tag = acked = 0
        last = time.monotonic()
        for method, properties, _body in channel.consume(queue, inactivity_timeout=0.5):
            if method is None:  # nothing buffered here: all arrived, or still on its way
                if len(ids) >= expected and channel.queue_declare(queue, passive=True).method.message_count == 0:
                    break
                if time.monotonic() - last > quiet:
                    break
                continue
            last = time.monotonic()
            ids[properties.message_id] += 1
            tag = method.delivery_tag
            if tag - acked >= 500:
                channel.basic_ack(tag, multiple=True)
                acked = tag
        if tag > acked:
            channel.basic_ack(tag, multiple=True)
        channel.cancel()
    finally:
        connection.close()
    return ids


def bare_python(where: Path) -> Path:
    """A venv at `where` of this Python's minor version with nothing installed, as a cluster node has; its bin/."""
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(where)],
                   check=True)
    return where / "bin"


class EngineClock:
    """The time module for `stores.engine`, with a time.monotonic the test moves: readings of where scans start
    (IndexStart) come when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    @classmethod
    def install(cls, monkeypatch) -> EngineClock:
        """A new clock, in place of the engine module's time for the test."""
        clock = cls()
        monkeypatch.setattr(engine, "time", clock)
        return clock

    def monotonic(self) -> float:
        return self.now

    def reading_due(self) -> None:
        """Move on to the time of the next reading, without a wait that would postpone it."""
        self.now += START_SECONDS

    def __getattr__(self, name: str):
        return getattr(time, name)


class HeldClock:
    """A clock the test moves: the store's clock port (`ClockedStore`) and, installed with `install`, the time
    module of the store's and the pump's modules (their monotonic time moves with it)."""

    START = datetime(2026, 5, 1, 10, 58, 30, tzinfo=UTC)

    def __init__(self) -> None:
        self.now = self.START

    def clock(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def monotonic(self) -> float:
        return 1_000.0 + (self.now - self.START).total_seconds()

    def sleep(self, _seconds: float) -> None:
        """Nothing sleeps: a breaker's wait after a failure would only let the clock the test holds stand."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    def hold_breakers(self, pump):
        """Put a pump's breakers on this clock (they keep their timings): its outages last as long as the test
        says, and nothing sleeps. Returns the pump."""
        from airflow_delay_provider.core.breakers import CircuitBreaker

        for name in ("fetch_breaker", "dispatch_breaker"):
            breaker = getattr(pump, name)
            setattr(pump, name, CircuitBreaker(breaker.name, breaker.time_to_trigger, clock=self.monotonic,
                                               sleep=self.sleep))
        pump.recovery_breaker._clock = self.monotonic
        return pump

    def install(self, monkeypatch, *modules) -> HeldClock:
        for module in modules:
            monkeypatch.setattr(module, "time", self)
        return self


class ClockedStore(SqlDelayedMessageStore):
    """The SQL store on a clock the test holds (its `local_clock`) in place of the database's, with no upkeep in
    threads: a test runs the move between partitions itself (`later.run()`)."""

    def clock(self) -> datetime:
        return self._local_clock()

    def upkeep(self) -> None:
        pass


class FakeTI:
    """What an operator's execute() reads of its task instance outside Airflow (the keys its message ids derive
    from), and what it pushes to XCom besides its return value (`pushed`)."""

    def __init__(self, dag_id: str = "d", run_id: str = "r", task_id: str = "t", map_index: int = -1) -> None:
        self.dag_id, self.run_id, self.task_id, self.map_index = dag_id, run_id, task_id, map_index
        self.pushed: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.pushed[key] = value
