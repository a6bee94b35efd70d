"""The bulk sweep: a PySpark application that dispatches the due messages of a window in parallel.

With the direct reader (the default):

1. The driver opens the sweep's lease row (`SqlDelayedMessageStore.open_sweep`), plans the id range of
   the window's rows (`window_range`), cuts it into one range per partition, and renews the lease
   while rows are being settled; the pump and other sweeps leave leased rows alone, and a crashed
   sweep's rows are taken over once its lease expires.
2. Each partition, in a Python worker with its own store and transport connections, works on its id
   range: rows bound for SQL-table queues in the store's own database are leased and moved by one
   statement per batch (`SqlTableTransport.move_window`); the rest is leased (`lease_range`), read page
   by page and sent by a Pump (`LeasedRows`): batches sent and settled under row locks, the delivery
   policy for failures, the error queue when exhausted. Only its counts (a line of JSON) go back
   through Spark; no message crosses the JVM.
3. The driver sums the partitions' counts, releases what is left of the claim and records the summary
   in the store's sweeps table, where the Airflow operator reads it.

The JDBC and Python-data-source readers instead lease the whole window in the driver
(`start_sweep`) and have Spark read the claimed rows into a DataFrame, whose partitions run the same
Pump through mapInArrow: JDBC on PostgreSQL (the driver jar from Debian's libpostgresql-jdbc-java),
the Python data source below over SQLAlchemy.

Secrets (the store's URL, broker credentials) come in a file readable by its owner only, named by
`--secret-file` (BulkSweepOperator writes it and deletes it when the sweep ends), or in the environment
variable named by SECRET_ENV (base64 JSON) when the application is run by hand; never in arguments,
which spark-submit and Airflow log and `ps` shows. The driver reads them and hands them to the partitions
inside their tasks, over Spark's own connections: encrypt those (`spark.network.crypto.enabled`) on a
network others can read.
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
from airflow_delay_provider.core.history import DEFAULT_HISTORY_DAYS
from airflow_delay_provider.core.ports import DelayedMessageStore
from airflow_delay_provider.core.pump import Pump, PumpConfig, moved_stats
from airflow_delay_provider.core.requests import parse_moment
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.core.stats import PumpStats
from airflow_delay_provider.spark import jdbc
from airflow_delay_provider.stores.sql import (
    DEFAULT_DEDUP_WINDOW_SECONDS,
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
#: How partitions get their rows: "direct" leases and reads them in each partition's own process;
#: "jdbc" and "python" read the rows the driver leased through Spark. "auto" is "direct".
READERS = ("auto", "direct", "jdbc", "python")
#: Rows a direct partition reads per query: each page is a short transaction, never one held open while
#: a throttled destination paces the sends.
PAGE_ROWS = 10_000


def encode_secret(store: dict, transport: dict) -> str:
    return base64.b64encode(json.dumps({"store": store, "transport": transport}).encode()).decode()


def load_secret(secret_file: str | None = None) -> dict:
    """The store and transport specs: from `secret_file` (JSON: the operator's own file in client mode, a mounted
    Kubernetes Secret in cluster mode; never one spark-submit ships), else from the SECRET_ENV variable."""
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                return json.load(f)
        except FileNotFoundError:
            raise InvalidInputError(f"the secret file {secret_file} was not found") from None
        except ValueError:
            raise InvalidInputError(f"the secret file {secret_file} is not JSON") from None
    raw = os.environ.get(SECRET_ENV)
    if not raw:
        raise InvalidInputError(
            f"no --secret-file and the environment variable {SECRET_ENV} is not set: one of them carries the "
            "store and transport connections (BulkSweepOperator writes the file; by hand, see "
            "airflow_delay_provider.spark.sweep.encode_secret)"
        )
    try:
        return json.loads(base64.b64decode(raw))
    except ValueError:
        raise InvalidInputError(f"{SECRET_ENV} is not base64-encoded JSON") from None


def store_from_spec(spec: dict) -> SqlDelayedMessageStore:
    # The connection's window: the ids of the retries it stores are kept by it (stores/dedup.py); its retention
    # of the delivery history, which the sweep's batches write to.
    window = spec.get("dedup_window_seconds", DEFAULT_DEDUP_WINDOW_SECONDS)
    return SqlDelayedMessageStore(spec["url"], table=spec.get("table") or DEFAULT_TABLE, schema=spec.get("schema"),
                                  dedup_window_seconds=window,
                                  history_days=spec.get("history_days", DEFAULT_HISTORY_DAYS))


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
            self.store_spec = load_secret(options.get("secret_file"))["store"]
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


def read_claim(spark, store: SqlDelayedMessageStore, claim_id: str, ranges: list[tuple[int, int]], reader: str,
               secret_file: str | None = None):
    """The claimed rows as a DataFrame with one partition per id range."""
    if reader == "jdbc":
        table = ".".join(f'"{part}"' for part in filter(None, (store.schema, store.table_name)))  # checked identifiers
        predicates = [f"claim_id = '{claim_id}' AND id >= {low} AND id <= {high}" for low, high in ranges]
        frame = jdbc.read(spark, store.url, table, predicates)  # with the store's TLS settings
        return frame.select(*SWEEP_COLUMNS)
    spark.dataSource.register(_data_source())
    reading = spark.read.format(DATA_SOURCE).option("claim_id", claim_id).option("ranges", json.dumps(ranges))
    if secret_file:
        reading = reading.option("secret_file", secret_file)  # a path: the options show in Spark's UI
    return reading.load()


# -- dispatching a partition (runs in the executors) -------------------------------------------
def partition_pump(store: DelayedMessageStore, transport, settings: dict) -> Pump:
    """The Pump of one partition over `store` (its leased rows), with the sweep's policies and its share of
    each throttled destination's rate."""
    return Pump(
        store, transport, PumpConfig(**settings["pump"]),
        policy=None if settings["delivery_policy"] is None else DeliveryPolicy.parse(settings["delivery_policy"]),
        policies=DeliveryPolicy.parse_each(settings["destination_policies"]),
        throttle_share=1.0 / settings["partitions"],
    )


def pump_rows(store: SqlDelayedMessageStore, transport, claim_id: str, rows: Iterator[tuple], settings: dict) -> dict:
    """A Pump over one partition's claimed rows (SWEEP_COLUMNS tuples) until they are settled or the sweep's
    deadline passes; returns its counts."""
    leased = store.leased_rows(claim_id, rows)
    pump = partition_pump(leased, transport, settings)
    stats = PumpStats()
    # Past the sweep's maximum duration a partition stops; the driver releases what is left.
    deadline = None if settings["deadline_us"] is None else from_us(settings["deadline_us"])
    while leased.remaining and (deadline is None or store.clock() < deadline):
        stats.merge(pump.run(deadline=deadline, stop_when_idle=True).stats)
        if leased.remaining:
            time.sleep(0.02)  # the rest waits for a throttled destination's tokens
    return {**stats.to_dict(), "skipped": leased.skipped}


def dispatch_partitions(secret: dict, claim_id: str, settings: dict) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The function mapInArrow runs once per partition of the rows Spark read (readers "jdbc" and
    "python"): a Pump over them, yielding one record with its counts as JSON."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        store = store_from_spec(secret["store"])
        transport = from_spec(secret["transport"])
        rows = (row for batch in batches
                for row in zip(*(batch.column(c).to_pylist() for c in SWEEP_COLUMNS), strict=False))
        try:
            counts = pump_rows(store, transport, claim_id, rows, settings)
        finally:
            transport.close()
            store.close()
        yield pa.RecordBatch.from_pydict({"stats": [json.dumps(counts)]})

    return run


def claimed_pages(store: SqlDelayedMessageStore, claim_id: str, low: int, high: int) -> Iterator[tuple]:
    """The rows a sweep holds in [low, high], in id order, read PAGE_ROWS rows per query."""
    while low <= high:
        page = list(store.read_claimed(claim_id, low, high, limit=PAGE_ROWS))
        yield from page
        if len(page) < PAGE_ROWS:
            return
        low = page[-1][0] + 1


def move_rows(store: SqlDelayedMessageStore, transport, claim_id: str, spans: list[tuple[int, int]],
              settings: dict) -> tuple[PumpStats, dict]:
    """Where the destinations are SQL-table queues of the store's database, the partition's rows are leased and
    moved into them by one statement per batch, exactly once, as the pump moves them: rows never come to Python
    and no lease is written row by row. Throttled destinations (the same rule as the pump's), missing queues
    and rows others held at that moment are left to the lease and the Pump over the rest (pump_rows).
    Returns the counts and {"claimed": n, "taken_over": m} of the rows moved."""
    stats, leased = PumpStats(), {"claimed": 0, "taken_over": 0}
    if not transport.moves_from(store):
        return stats, leased
    excluded = partition_pump(store, transport, settings).move_exclusions()
    if excluded is None:
        return stats, leased  # every destination is throttled
    batch = settings["pump"]["batch_size"]
    deadline = None if settings["deadline_us"] is None else from_us(settings["deadline_us"])
    for low, high in spans:
        while deadline is None or store.clock() < deadline:
            got = transport.move_window(store, claim_id, low, high, batch, excluded)
            if got is None:
                return stats, leased  # the sweep finished meanwhile
            moved, taken_over = got
            stats.merge(moved_stats(moved, store.clock()))
            n = sum(count for _, _, count in moved)
            leased["claimed"] += n
            leased["taken_over"] += taken_over
            if n < batch:
                break
    return stats, leased


def sweep_ranges(secret: dict, claim_id: str, settings: dict) -> Callable[[Iterator[tuple[int, int]]], Iterator[str]]:
    """The function mapPartitions runs once per partition of id ranges (reader "direct"): move what can be moved
    inside the database (move_rows), lease the rest of the ranges, then a Pump over their rows, read here;
    yields the counts as JSON, with what was leased and taken over.

    After the moves a partition leases the rest of its ranges before sending, even past the deadline, so that
    the window is the sweep's as with the other readers: whatever is not sent is released by the driver."""

    def run(ranges: Iterator[tuple[int, int]]) -> Iterator[str]:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        spans = list(ranges)
        store = store_from_spec(secret["store"])
        transport = from_spec(secret["transport"])
        try:
            moved, leases = move_rows(store, transport, claim_id, spans, settings)
            for low, high in spans:
                lease = store.lease_range(claim_id, low, high)
                leases = {k: leases[k] + lease[k] for k in leases}
            rows = (row for low, high in spans for row in claimed_pages(store, claim_id, low, high))
            counts = pump_rows(store, transport, claim_id, rows, settings)
            if moved.dispatched:
                moved.merge(PumpStats.from_dict(counts))
                counts = {**moved.to_dict(), "skipped": counts["skipped"]}
        finally:
            transport.close()
            store.close()
        yield json.dumps({**counts, **leases})

    return run


# -- the driver ----------------------------------------------------------------------------------
class LeaseKeeper(threading.Thread):
    """Renews the sweep's lease while its rows are being settled, and logs progress (rows left, rate,
    ETA) until stopped. A sweep that settles nothing for a whole lease (its executors lost, its broker
    down) lets the lease expire, so the next sweep or a pump takes its rows over."""

    def __init__(self, store: SqlDelayedMessageStore, claim_id: str, lease_seconds: float, total: int,
                 interval: float) -> None:
        """`total`: the rows the sweep expects to settle, for the progress log (claimed, or planned when
        the partitions lease)."""
        super().__init__(name="lease-keeper", daemon=True)
        self.store, self.claim_id, self.lease_seconds, self.total = store, claim_id, lease_seconds, total
        self.interval = min(interval, lease_seconds / 3)
        self.stopped = threading.Event()
        self.started_at = time.monotonic()

    def run(self) -> None:
        settled_before = 0
        while not self.stopped.wait(self.interval):
            try:
                # Settled = leased so far - still held: partitions leasing more rows is no progress.
                leased, held = self.store.sweep_progress(self.claim_id)
                if leased - held > settled_before:
                    self.store.renew_lease(self.claim_id, self.lease_seconds)
                    settled_before = leased - held
                else:
                    log.warning("sweep %s: nothing settled in the last %.0f s; the lease is not renewed",
                                self.claim_id, self.interval)
            except Exception as exc:  # the next round tries again; the lease outlasts a few misses
                log.warning("could not renew the lease of sweep %s: %s", self.claim_id, exc)
                continue
            left = max(self.total - settled_before, 0)
            elapsed = time.monotonic() - self.started_at
            rate = settled_before / elapsed if elapsed > 0 else 0.0
            eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
            log.info("sweep %s: %d of %d settled (%.0f rows/s), %d left, ETA %s",
                     self.claim_id, settled_before, self.total, rate, left, eta)

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
    parser.add_argument("--reader", choices=READERS, default="auto")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--number-of-retries", type=int, default=0)
    parser.add_argument("--error-queue", default="error")
    parser.add_argument("--delivery-policy", default=None,
                        help="delivery-policy JSON or a built-in name (sqs, smtp, ...)")
    parser.add_argument("--destination-policies", default="{}", help="JSON: destination -> policy")
    parser.add_argument("--progress-seconds", type=float, default=10.0)
    parser.add_argument("--secret-file", default=None,
                        help=f"JSON file of the store and transport connections (default: ${SECRET_ENV})")
    return parser.parse_args(argv)


def _policy_arg(value: str | None):
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError:
        return value  # a built-in name


def sweep(spark, secret: dict, args: argparse.Namespace) -> dict:
    """Run one sweep on `spark` (a SparkSession, or a SparkContext for the direct reader); returns the summary
    (also recorded in the store's sweeps table)."""
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
    reader = resolve_reader(args.reader, store)
    # A sweep writes: it creates or upgrades the store only where its connection allows it (auto_migrate).
    if secret["store"].get("auto_migrate"):
        store.create_schema()
    else:
        store.check_ready(current=True)
    started = time.monotonic()
    if args.max_seconds:
        settings["deadline_us"] = to_us(store.clock()) + int(args.max_seconds * 1e6)
    if reader == "direct":
        # The partitions lease their own ranges and add to the counts as they do.
        store.open_sweep(claim_id, due_before, due_from, lease_seconds=args.lease_seconds)
        claim = {"claimed": 0, "taken_over": 0}
        low, high, total = store.window_range(claim_id)
        what = "to lease in the partitions"
    else:
        claim = store.start_sweep(claim_id, due_before, due_from, lease_seconds=args.lease_seconds)
        low, high, total = store.claimed_range(claim_id)
        what = f"claimed ({claim['taken_over']} taken over from expired leases)"
    log.info("sweep %s: window [%s, %s), %d messages %s in %.1f s", claim_id,
             due_from.isoformat() if due_from else "-", due_before.isoformat(), total, what,
             time.monotonic() - started)
    summary: dict = {"claim_id": claim_id, **claim}
    stats = PumpStats()
    skipped = 0
    status = "failed"
    keeper = None
    try:
        if total:
            context = getattr(spark, "sparkContext", spark)
            partitions = args.partitions or 2 * context.defaultParallelism
            ranges = split_range(low, high, partitions)
            settings["partitions"] = len(ranges)
            summary.update(reader=reader, partitions=len(ranges))
            keeper = LeaseKeeper(store, claim_id, args.lease_seconds, total, args.progress_seconds)
            keeper.start()
            if reader == "direct":
                results = (context.parallelize(ranges, len(ranges))
                           .mapPartitions(sweep_ranges(secret, claim_id, settings)).collect())
            else:
                frame = read_claim(spark, store, claim_id, ranges, reader, args.secret_file)
                results = [row["stats"] for row in
                           frame.mapInArrow(dispatch_partitions(secret, claim_id, settings), "stats string").collect()]
            for result in results:
                part = json.loads(result)
                skipped += part.get("skipped", 0)
                summary["claimed"] += part.get("claimed", 0)
                summary["taken_over"] += part.get("taken_over", 0)
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


def resolve_reader(reader: str, store: SqlDelayedMessageStore) -> str:
    """The reader a sweep of `store` uses: "auto" is "direct"; "jdbc" needs PostgreSQL."""
    if reader not in READERS:
        raise InvalidInputError(f"reader {reader!r} is not supported; choose one of {list(READERS)}")
    if reader == "jdbc" and not store.is_postgres:
        raise InvalidInputError("reader 'jdbc' needs a PostgreSQL store; use 'direct' or 'python' for SQLite")
    if reader == "jdbc":
        jdbc.connection(store.url)  # a store URL pgjdbc cannot honour fails here, before anything is leased
    return "direct" if reader == "auto" else reader


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    name = f"airflow-delay-sweep-{args.claim_id or 'adhoc'}"
    if args.reader in ("auto", "direct"):
        # The direct reader only runs functions over id ranges: a SparkContext, without a SQL session's start-up
        # (about 2 s measured on local[2]).
        from pyspark import SparkConf, SparkContext

        spark = SparkContext.getOrCreate(SparkConf().setAppName(name))
    else:
        from pyspark.sql import SparkSession

        spark = SparkSession.builder.appName(name).getOrCreate()
    try:
        summary = sweep(spark, load_secret(args.secret_file), args)
    finally:
        spark.stop()
    print(SUMMARY_MARKER + json.dumps(summary), flush=True)
    return 0
