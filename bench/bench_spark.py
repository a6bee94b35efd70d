"""Benchmark: the Spark bulk sweep vs the single-process pump on the same 1,000,000 due messages.

One run, PostgreSQL store, two destinations: the SQL-table transport and RabbitMQ. For each: the
pump in its own process, the sweep with each reader (direct: partitions lease and read their rows
themselves; jdbc: the driver leases the window and Spark reads it) on local[1] and local[2] (SQL) or
local[2] (RabbitMQ), the direct reader on a Spark standalone cluster on this machine (a master and two
1-core workers as their own JVMs, whose executors run the shipped executor archive on a Python with
nothing of ours), and the raw limit (a bare batched claim for the database, pika with windowed
confirms for the broker).
Wall time includes Spark's start-up (the application's, not the cluster's); peak memory is sampled over
the spark-submit process tree and, on the cluster, the executors the workers start.
`make bench` runs it with 1,000,000 messages; --messages makes it smaller.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pika
import psutil
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_rabbitmq import rabbitmqctl, raw_windowed  # noqa: E402
from bench_store import libpq, log, peak_rss_mb, raw_claim, raw_copy, raw_rows  # noqa: E402
from machine import describe, machine  # noqa: E402

from airflow_delay_provider.core.pump import Pump, PumpConfig  # noqa: E402
from airflow_delay_provider.spark import sweep as sweep_app  # noqa: E402
from airflow_delay_provider.spark.environment import ALIAS, Archive, build_archive  # noqa: E402
from airflow_delay_provider.spark.local_cluster import LocalCluster  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore  # noqa: E402
from airflow_delay_provider.transports.registry import from_spec  # noqa: E402

SPARK_SUBMIT = Path(sys.executable).with_name("spark-submit")
APP = Path(sweep_app.__file__).with_name("sweep_app.py")
#: The readers compared: the direct one, whose rows never cross the JVM, and JDBC, which reads them through Spark.
READERS = ("direct", "jdbc")
#: The standalone cluster's workers: as many cores in all as local[2], each worker a node of its own.
WORKERS, CORES = 2, 1
CLUSTER = f"standalone cluster ({WORKERS} workers x {CORES} core, shipped archive)"


def fill(url: str, qualified: str, n: int) -> None:
    """n due rows in a freshly vacuumed table, so no run pays for the dead rows of the one before."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {qualified}")
    with psycopg.connect(libpq(url)) as conn:
        for start in range(0, n, 100_000):
            raw_copy(conn, qualified, raw_rows(min(100_000, n - start), start))


def pump_child(url: str, schema: str, table: str, transport_json: str) -> None:
    """Run in its own process, so its peak RSS is the pump's alone."""
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    transport = from_spec(json.loads(transport_json))
    started = time.perf_counter()
    result = Pump(store, transport, PumpConfig(batch_size=1000)).run(stop_when_idle=True)
    elapsed = time.perf_counter() - started
    transport.close()
    print(json.dumps({"dispatched": result.stats.dispatched, "seconds": elapsed, "peak_rss_mb": peak_rss_mb()}))


def run_pump(url: str, schema: str, table: str, transport: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--pump-child", url, schema, table, json.dumps(transport)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


class TreeMemory(threading.Thread):
    """Peak RSS of a process tree, split into the JVM (Spark's driver and, in local mode, executors),
    the Python driver and the Python workers (summed). On a cluster, the executors are the children of
    `daemons` (the master and workers) and count with the tree; the daemons' own JVMs, which stand
    whatever runs, are summed apart."""

    def __init__(self, pid: int, daemons: tuple[int, ...] = ()) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.daemons = [psutil.Process(daemon) for daemon in daemons]
        self.peak = {"jvm_mb": 0.0, "python_driver_mb": 0.0, "python_workers_mb": 0.0}
        if daemons:
            self.peak["cluster_daemons_mb"] = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            groups = dict.fromkeys(self.peak, 0.0)
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                for daemon in self.daemons:
                    groups["cluster_daemons_mb"] += daemon.memory_info().rss / 2**20
                    procs += daemon.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for proc in procs:
                try:
                    cmd = " ".join(proc.cmdline())
                    rss = proc.memory_info().rss / 2**20
                except psutil.Error:
                    continue
                if "java" in proc.name():
                    groups["jvm_mb"] += rss
                elif "sweep_app.py" in cmd:
                    groups["python_driver_mb"] += rss
                elif "python" in proc.name():
                    groups["python_workers_mb"] += rss
            for key, value in groups.items():
                self.peak[key] = max(self.peak[key], value)


def run_sweep(url: str, schema: str, table: str, transport: dict, master: str, reader: str,
              options: tuple[str, ...] = (), daemons: tuple[int, ...] = ()) -> dict:
    """spark-submit of the sweep; `options` go before the application, `daemons` are a cluster's (TreeMemory)."""
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               **{sweep_app.SECRET_ENV: sweep_app.encode_secret({"url": url, "table": table, "schema": schema},
                                                                transport)})
    command = [str(SPARK_SUBMIT), "--master", master, "--jars", sweep_app.DEFAULT_JDBC_JAR, "--driver-memory", "2g",
               "--conf", "spark.ui.enabled=false", *options, str(APP), "--due-before", "9999-01-01T00:00:00+00:00",
               "--reader", reader]
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    memory = TreeMemory(proc.pid, daemons)
    memory.start()
    output, _ = proc.communicate()
    wall = time.perf_counter() - started
    memory.done.set()
    memory.join()
    lines = [line for line in output.splitlines() if line.startswith(sweep_app.SUMMARY_MARKER)]
    if proc.returncode or not lines:
        raise SystemExit(f"the sweep failed ({proc.returncode}):\n{output[-4000:]}")
    summary = json.loads(lines[-1][len(sweep_app.SUMMARY_MARKER):])
    return {"dispatched": summary["dispatched"], "seconds": wall, "sweep_seconds": summary["seconds"],
            "partitions": summary["partitions"], **memory.peak}


def bare_python(where: Path) -> Path:
    """The bin of a venv of this Python with nothing installed: what a cluster node has."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(where)], check=True)
    return where / "bin"


def run_on_cluster(url: str, schema: str, table: str, transport: dict, archive: Archive, bare_bin: Path) -> dict:
    """The direct reader on a standalone cluster started for this run alone, its executors on the shipped archive
    and the bare Python (first on the workers' PATH, where the archive's launcher looks). The cluster's start-up
    is timed apart, not in the wall time: a cluster stands before a sweep is submitted to it."""
    started = time.perf_counter()
    with LocalCluster(workers=WORKERS, cores=CORES, memory="1g", path=f"{bare_bin}:/usr/bin:/bin") as cluster:
        start_seconds = time.perf_counter() - started
        # spark.pyspark.python points the driver's Python too: it runs here, on this venv's.
        options = ("--archives", f"{archive.path}#{ALIAS}", "--conf", f"spark.pyspark.python=./{ALIAS}/bin/python",
                   "--conf", f"spark.pyspark.driver.python={sys.executable}", "--conf", "spark.executor.memory=512m")
        result = run_sweep(url, schema, table, transport, cluster.master_url, "direct", options,
                           tuple(proc.pid for proc in cluster.processes))
    return {**result, "cluster_start_seconds": start_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default=os.environ.get("DELAY_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--rabbit-host", default="127.0.0.1")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "spark.json")
    parser.add_argument("--pump-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pump_child:
        pump_child(*args.pump_child)
        return
    n, url = args.messages, args.url
    header = describe(machine(url, rabbitmq=True))
    scratch = tempfile.TemporaryDirectory(prefix="bench-spark-")
    # Built here, not taken from the cache, so the report says what building it costs.
    archive = build_archive(Path(scratch.name) / "sweep-executor-env.tar.gz")
    log(f"executor archive: {archive.describe()}, built in {archive.build_seconds:.1f} s")
    bare_bin = bare_python(Path(scratch.name) / "bare")
    schema, table, vhost = f"bench_spark_{uuid.uuid4().hex[:8]}", "dm", f"bench_spark_{uuid.uuid4().hex[:8]}"
    store = SqlDelayedMessageStore(url, table=table, schema=schema)
    store.create_schema()
    qualified = f"{schema}.{table}"
    sql = {"kind": "sql", "url": url, "schema": schema, "table_prefix": "q_"}
    from_spec(sql).provision("orders")
    rabbitmqctl("add_vhost", vhost)
    rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    rabbit = {"kind": "rabbitmq", "host": args.rabbit_host, "virtual_host": vhost, "prefix": "bench"}
    broker = from_spec(rabbit)
    for queue in ("orders", "error"):
        broker.provision(queue)
    params = pika.ConnectionParameters(args.rabbit_host, virtual_host=vhost)

    def purge() -> None:
        with pika.BlockingConnection(params) as conn:
            conn.channel().queue_purge("orders")

    results: dict[str, dict] = {}
    try:
        fill(url, qualified, n)
        with psycopg.connect(libpq(url)) as conn:
            started = time.perf_counter()
            claimed = raw_claim(conn, qualified)
            results["sql: raw limit (bare batched claim, 1 process)"] = {
                "dispatched": claimed, "seconds": time.perf_counter() - started}
        runs = [("sql", "pump (1 process)", lambda: run_pump(url, schema, table, sql))]
        runs += [("sql", f"sweep {master}, {reader} reader",
                  lambda master=master, reader=reader: run_sweep(url, schema, table, sql, master, reader))
                 for master in ("local[1]", "local[2]") for reader in READERS]
        # The direct reader alone on the cluster: the others need pyarrow in the archive (170 MB more).
        runs.append(("sql", f"sweep {CLUSTER}, direct reader",
                     lambda: run_on_cluster(url, schema, table, sql, archive, bare_bin)))
        runs.append(("rabbitmq", "pump (1 process)", lambda: run_pump(url, schema, table, rabbit)))
        runs += [("rabbitmq", f"sweep local[2], {reader} reader",
                  lambda reader=reader: run_sweep(url, schema, table, rabbit, "local[2]", reader))
                 for reader in READERS]
        runs.append(("rabbitmq", f"sweep {CLUSTER}, direct reader",
                     lambda: run_on_cluster(url, schema, table, rabbit, archive, bare_bin)))
        for destination, name, run in runs:
            fill(url, qualified, n)
            log(f"{n} due messages stored; {destination}: {name}")
            result = run()
            assert result["dispatched"] == n, result
            results[f"{destination}: {name}"] = result
            log(f"  {result['dispatched'] / result['seconds']:,.0f} msg/s over {result['seconds']:.1f} s"
                + (f" (the cluster started in {result['cluster_start_seconds']:.1f} s before)"
                   if "cluster_start_seconds" in result else ""))
            if destination == "rabbitmq":
                purge()
        raw_n = min(n, 200_000)
        rate = raw_windowed(params, "orders", raw_n)
        results["rabbitmq: raw limit (pika windowed confirms, 1 process)"] = {"dispatched": raw_n,
                                                                            "seconds": raw_n / rate}
        purge()
    finally:
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        rabbitmqctl("delete_vhost", vhost)
        scratch.cleanup()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"messages": n, "archive": {"size_bytes": archive.size_bytes,
                                                                "build_seconds": archive.build_seconds},
                                     "results": results}, indent=2))
    report(n, results, header, archive)


def report(n: int, results: dict[str, dict], header: str, archive: Archive) -> None:
    def mb(r: dict, key: str) -> str:
        return f"{r[key]:,.0f}" if key in r else "-"

    print(f"\n{header}\nBulk sweep of {n:,} due messages, PostgreSQL store, one run; wall time includes Spark's "
          "start-up\n")
    print("| destination: runner | wall s | msg/s | sweep s (after Spark's start-up) | msg/s in the sweep | JVM MB "
          "| Python driver MB | Python workers MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        driver = mb(r, "python_driver_mb") if "python_driver_mb" in r else mb(r, "peak_rss_mb")
        sweep = (f"{r['sweep_seconds']:.1f} | {r['dispatched'] / r['sweep_seconds']:,.0f}" if "sweep_seconds" in r
                 else "- | -")
        print(f"| {name} | {r['seconds']:.1f} | {r['dispatched'] / r['seconds']:,.0f} | {sweep} | {mb(r, 'jvm_mb')} "
              f"| {driver} | {mb(r, 'python_workers_mb')} |")
    pump, local = results.get("sql: pump (1 process)"), results.get("sql: sweep local[2], direct reader")
    one = results.get("sql: sweep local[1], direct reader")
    if pump and local and one:
        wall, own = pump["seconds"] / local["seconds"], pump["seconds"] / local["sweep_seconds"]
        scale_wall, scale_own = one["seconds"] / local["seconds"], one["sweep_seconds"] / local["sweep_seconds"]
        print(f"\nSQL, direct reader: local[2] against the pump {wall:.2f}x by wall time, {own:.2f}x by the sweep's "
              f"own time; local[1] -> local[2] {scale_wall:.2f}x by wall time, {scale_own:.2f}x by the sweep's "
              "own time.")
    clusters = {}
    for destination, title in (("sql", "SQL"), ("rabbitmq", "RabbitMQ")):
        pump = results.get(f"{destination}: pump (1 process)")
        local = results.get(f"{destination}: sweep local[2], direct reader")
        cluster = results.get(f"{destination}: sweep {CLUSTER}, direct reader")
        if pump and local and cluster:
            clusters[destination] = cluster
            print(f"{title}, direct reader: the standalone cluster against local[2] "
                  f"{local['seconds'] / cluster['seconds']:.2f}x by wall time, "
                  f"{local['sweep_seconds'] / cluster['sweep_seconds']:.2f}x by the sweep's own time; against the "
                  f"pump {pump['seconds'] / cluster['seconds']:.2f}x by wall time, "
                  f"{pump['seconds'] / cluster['sweep_seconds']:.2f}x by the sweep's own time.")
    if clusters:
        starts = ", ".join(f"{r['cluster_start_seconds']:.1f}" for r in clusters.values())
        daemons = max(r["cluster_daemons_mb"] for r in clusters.values())
        print(f"\nThe standalone cluster is a master and {WORKERS} workers of {CORES} core and 1g as their own JVMs, "
              f"all on this one {os.cpu_count()}-CPU machine with the driver, PostgreSQL and RabbitMQ: its figures "
              "are for that case, not for a cluster of machines. Started anew for each of its runs, in "
              f"{starts} s, which the wall time leaves out; the sweep's own time includes launching the executors "
              "and unpacking the archive in each (local mode has its executor from its start-up). Its memory "
              "columns count the driver and the executors (a JVM each), not the master's and workers' own JVMs "
              f"({daemons:,.0f} MB together at peak). Its executors ran the shipped archive "
              f"({archive.size_bytes / 2**20:.1f} MiB, built in {archive.build_seconds:.1f} s, without pyarrow, so "
              "the direct reader only) on a Python with nothing of this project.")


if __name__ == "__main__":
    main()
