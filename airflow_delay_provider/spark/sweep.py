"""The bulk sweep: a PySpark application that dispatches the due messages of a window in parallel.

1. The driver leases the window's due rows to a claim id (`SqlDelayedMessageStore.start_sweep`) and
   renews the lease while it runs; the pump and other sweeps leave leased rows alone, and a crashed
   sweep's rows are taken over once its lease expires.
2. Spark reads the claimed rows in partitions of the id range: JDBC on PostgreSQL (the driver jar
   from Debian's libpostgresql-jdbc-java), or the Python data source below over SQLAlchemy (SQLite,
   or PostgreSQL without the jar).
3. Each partition runs a Pump over its rows (`LeasedRows`): one transport connection, batches sent
   and settled under row locks, the delivery policy for failures, the error queue when exhausted.
4. The driver sums the partitions' counts, releases what is left of the claim and records the summary
   in the store's sweeps table, where the Airflow operator reads it.

Secrets (the store's URL, broker credentials) come in the environment variable named by SECRET_ENV
(base64 JSON), never in arguments, which spark-submit and Airflow log.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.core.requests import parse_moment
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.core.stats import PumpStats
from airflow_delay_provider.stores.sql import (
    DEFAULT_TABLE,
    SWEEP_COLUMNS,
    SqlDelayedMessageStore,
    check_claim_id,
    from_us,
    to_us,
)
from airflow_delay_provider.transports.registry import from_spec

log = logging.getLogger("airflow_delay_provider.sweep")

#: Holds {"store": {...}, "transport": {...}} as base64 JSON; Spark redacts names with SECRET.
SECRET_ENV = "AIRFLOW_DELAY_SWEEP_SECRET"
#: The line the driver prints last: the summary, for whoever runs spark-submit by hand.
SUMMARY_MARKER = "DELAY_SWEEP_SUMMARY "
SCHEMA = "id long, message_id string, destination string, body binary, headers string, due_at_us long, failures int"
DATA_SOURCE = "airflow_delay_store"
DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"


def encode_secret(store: dict, transport: dict) -> str:
    return base64.b64encode(json.dumps({"store": store, "transport": transport}).encode()).decode()


def load_secret() -> dict:
    raw = os.environ.get(SECRET_ENV)
    if not raw:
        raise InvalidInputError(
            f"the environment variable {SECRET_ENV} is not set: it carries the store and transport "
            "connections (BulkSweepOperator sets it; by hand, see airflow_delay_provider.spark.sweep.encode_secret)"
        )
    try:
        return json.loads(base64.b64decode(raw))
    except ValueError:
        raise InvalidInputError(f"{SECRET_ENV} is not base64-encoded JSON") from None


def store_from_spec(spec: dict) -> SqlDelayedMessageStore:
    return SqlDelayedMessageStore(spec["url"], table=spec.get("table") or DEFAULT_TABLE, schema=spec.get("schema"))


def split_range(low: int, high: int, parts: int) -> list[tuple[int, int]]:
    """[low, high] cut into at most `parts` contiguous inclusive ranges of (nearly) equal width."""
    if high < low:
        return []
    width = high - low + 1
    parts = max(1, min(parts, width))
    bounds = [low + width * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(parts)]


# -- reading the claim -----------------------------------------------------------------------
def _data_source():
    """The Python data source, defined on first use so that importing this module needs no pyspark."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class DelayStoreReader(DataSourceReader):
        def __init__(self, options: dict) -> None:
            # Read where the reader is planned (the driver's side); the instance travels to the executors.
            self.store_spec = load_secret()["store"]
            self.claim_id = check_claim_id(options["claim_id"])
            self.ranges = json.loads(options["ranges"])

        def partitions(self):
            return [InputPartition(tuple(r)) for r in self.ranges]

        def read(self, partition):
            low, high = partition.value
            store = store_from_spec(self.store_spec)
            yield from store.read_claimed(self.claim_id, low, high)

    class DelayStoreDataSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return DATA_SOURCE

        def schema(self) -> str:
            return SCHEMA

        def reader(self, schema):
            return DelayStoreReader(self.options)

    return DelayStoreDataSource


def read_claim(spark, store: SqlDelayedMessageStore, claim_id: str, ranges: list[tuple[int, int]], reader: str):
    """The claimed rows as a DataFrame with one partition per id range."""
    if reader == "jdbc":
        url = store.url
        jdbc_url = f"jdbc:postgresql://{url.host or 'localhost'}:{url.port or 5432}/{url.database}"
        table = ".".join(f'"{part}"' for part in filter(None, (store.schema, store.table_name)))  # checked identifiers
        predicates = [f"claim_id = '{claim_id}' AND id >= {low} AND id <= {high}" for low, high in ranges]
        properties = {"driver": "org.postgresql.Driver", "fetchsize": "10000"}
        if url.username:
            properties["user"] = url.username
        if url.password:
            properties["password"] = str(url.password)
        return spark.read.jdbc(jdbc_url, table, predicates=predicates, properties=properties).select(*SWEEP_COLUMNS)
    spark.dataSource.register(_data_source())
    return (spark.read.format(DATA_SOURCE)
            .option("claim_id", claim_id).option("ranges", json.dumps(ranges)).load())


# -- dispatching a partition (runs in the executors) -------------------------------------------
def dispatch_partitions(secret: dict, claim_id: str, settings: dict) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function mapInArrow runs once per partition: a Pump over the partition's rows, yielding
    one record with its counts as JSON."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        store = store_from_spec(secret["store"])
        transport = from_spec(secret["transport"])
        rows = (row for batch in batches
                for row in zip(*(batch.column(c).to_pylist() for c in SWEEP_COLUMNS), strict=False))
        leased = store.leased_rows(claim_id, rows)
        policies = DeliveryPolicy.parse_each(settings["destination_policies"])
        pump = Pump(
            leased, transport, PumpConfig(**settings["pump"]),
            policy=None if settings["delivery_policy"] is None else DeliveryPolicy.parse(settings["delivery_policy"]),
            policies=policies, throttle_share=1.0 / settings["partitions"],
        )
        stats = PumpStats()
        # Past the sweep's maximum duration a partition stops; the driver releases what is left.
        deadline = None if settings["deadline_us"] is None else from_us(settings["deadline_us"])
        try:
            while leased.remaining and (deadline is None or store.clock() < deadline):
                stats.merge(pump.run(deadline=deadline, stop_when_idle=True).stats)
                if leased.remaining:
                    time.sleep(0.02)  # the rest waits for a throttled destination's tokens
        finally:
            transport.close()
            store.close()
        yield pa.RecordBatch.from_pydict({"stats": [json.dumps({**stats.to_dict(), "skipped": leased.skipped})]})

    return run


# -- the driver ----------------------------------------------------------------------------------
class LeaseKeeper(threading.Thread):
    """Renews the sweep's lease while its rows are being settled, and logs progress (rows left, rate,
    ETA) until stopped. A sweep that settles nothing for a whole lease (its executors lost, its broker
    down) lets the lease expire, so the next sweep or a pump takes its rows over."""

    def __init__(self, store: SqlDelayedMessageStore, claim_id: str, lease_seconds: float, total: int,
                 interval: float) -> None:
        super().__init__(name="lease-keeper", daemon=True)
        self.store, self.claim_id, self.lease_seconds, self.total = store, claim_id, lease_seconds, total
        self.interval = min(interval, lease_seconds / 3)
        self.stopped = threading.Event()
        self.started_at = time.monotonic()

    def run(self) -> None:
        left_before = self.total
        while not self.stopped.wait(self.interval):
            try:
                left = self.store.claimed_range(self.claim_id)[2]
                if left < left_before:
                    self.store.renew_lease(self.claim_id, self.lease_seconds)
                    left_before = left
                else:
                    log.warning("sweep %s: nothing settled in the last %.0f s; the lease is not renewed",
                                self.claim_id, self.interval)
            except Exception as exc:  # the next round tries again; the lease outlasts a few misses
                log.warning("could not renew the lease of sweep %s: %s", self.claim_id, exc)
                continue
            done = self.total - left
            elapsed = time.monotonic() - self.started_at
            rate = done / elapsed if elapsed > 0 else 0.0
            eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
            log.info("sweep %s: %d of %d settled (%.0f rows/s), %d left, ETA %s",
                     self.claim_id, done, self.total, rate, left, eta)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sweep",
                                     description="Dispatch the due delayed messages of a window on Spark.")
    parser.add_argument("--claim-id", default=None, help="unique id of this sweep (default: a new UUID)")
    parser.add_argument("--due-before", required=True, help="ISO time: sweep messages due before it (and already due)")
    parser.add_argument("--due-from", default=None, help="ISO time: and due at or after it (default: no lower bound)")
    parser.add_argument("--lease-seconds", type=float, default=600.0,
                        help="how long the rows stay leased without progress before others may take them over")
    parser.add_argument("--max-seconds", type=float, default=0.0,
                        help="stop after this long and release the rows left (0: no limit)")
    parser.add_argument("--partitions", type=int, default=0, help="0: twice Spark's default parallelism")
    parser.add_argument("--reader", choices=("auto", "jdbc", "python"), default="auto")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--number-of-retries", type=int, default=0)
    parser.add_argument("--error-queue", default="error")
    parser.add_argument("--delivery-policy", default=None,
                        help="delivery-policy JSON or a built-in name (sqs, smtp, ...)")
    parser.add_argument("--destination-policies", default="{}", help="JSON: destination -> policy")
    parser.add_argument("--progress-seconds", type=float, default=10.0)
    return parser.parse_args(argv)


def _policy_arg(value: str | None):
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError:
        return value  # a built-in name


def sweep(spark, secret: dict, args: argparse.Namespace) -> dict:
    """Run one sweep on `spark`; returns the summary (also recorded in the store's sweeps table)."""
    claim_id = check_claim_id(args.claim_id or uuid.uuid4().hex)
    due_before = parse_moment(args.due_before, "due_before")
    due_from = parse_moment(args.due_from, "due_from")
    if due_from is not None and due_from >= due_before:
        raise InvalidInputError(
            f"due_from ({due_from.isoformat()}) must be before due_before ({due_before.isoformat()})")
    settings = {
        "pump": {"batch_size": args.batch_size, "number_of_retries": args.number_of_retries,
                 "error_queue": args.error_queue},
        "delivery_policy": _policy_arg(args.delivery_policy),
        "destination_policies": json.loads(args.destination_policies),
        "deadline_us": None,
    }
    # Checked here, once, before anything is claimed: a malformed policy fails the sweep up front.
    PumpConfig(**settings["pump"])
    if settings["delivery_policy"] is not None:
        DeliveryPolicy.parse(settings["delivery_policy"])
    DeliveryPolicy.parse_each(settings["destination_policies"])

    store = store_from_spec(secret["store"])
    store.create_schema()
    started = time.monotonic()
    if args.max_seconds:
        settings["deadline_us"] = to_us(store.clock()) + int(args.max_seconds * 1e6)
    claim = store.start_sweep(claim_id, due_before, due_from, lease_seconds=args.lease_seconds)
    low, high, total = store.claimed_range(claim_id)
    log.info("sweep %s: window [%s, %s), %d messages claimed (%d taken over from expired leases) in %.1f s",
             claim_id, due_from.isoformat() if due_from else "-", due_before.isoformat(), total,
             claim["taken_over"], time.monotonic() - started)
    summary: dict = {"claim_id": claim_id, "claimed": total, "taken_over": claim["taken_over"]}
    stats = PumpStats()
    skipped = 0
    status = "failed"
    keeper = None
    try:
        if total:
            reader = args.reader
            if reader == "auto":
                reader = "jdbc" if store.is_postgres else "python"
            if reader == "jdbc" and not store.is_postgres:
                raise InvalidInputError("reader 'jdbc' needs a PostgreSQL store; use 'python' for SQLite")
            partitions = args.partitions or 2 * spark.sparkContext.defaultParallelism
            ranges = split_range(low, high, partitions)
            settings["partitions"] = len(ranges)
            summary.update(reader=reader, partitions=len(ranges))
            keeper = LeaseKeeper(store, claim_id, args.lease_seconds, total, args.progress_seconds)
            keeper.start()
            frame = read_claim(spark, store, claim_id, ranges, reader)
            results = frame.mapInArrow(dispatch_partitions(secret, claim_id, settings), "stats string").collect()
            for row in results:
                part = json.loads(row["stats"])
                skipped += part.get("skipped", 0)
                stats.merge(PumpStats.from_dict(part))
        # Rows a partition stopped before (the maximum duration) are released below.
        status = "done" if not store.claimed_range(claim_id)[2] else "timed_out"
    finally:
        if keeper is not None:
            keeper.stop()
        elapsed = time.monotonic() - started
        summary.update(stats.summary())
        summary.update(skipped=skipped, status=status, seconds=round(elapsed, 3),
                       rows_per_second=(round((stats.dispatched + stats.dead_lettered) / elapsed, 1)
                                        if elapsed else None))
        summary["released"] = store.finish_sweep(claim_id, status, summary)
        store.close()
    log.info("sweep %s %s: %s", claim_id, status, json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    secret = load_secret()
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.appName(f"airflow-delay-sweep-{args.claim_id or 'adhoc'}").getOrCreate()
    try:
        summary = sweep(spark, secret, args)
    finally:
        spark.stop()
    print(SUMMARY_MARKER + json.dumps(summary), flush=True)
    return 0
