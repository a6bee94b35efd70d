"""Profile: where the dispatch pump's time per message goes, stage by stage, on both paths.

Drains N due messages (default 20,000, 200 B) with cProfile on, once per path: the PostgreSQL store
-> a RabbitMQ quorum queue, and the PostgreSQL store -> the SQL-table queue in the same database
(exactly once). Each path also runs once unprofiled at the same size, for scale: profiling inflates
every Python call, so the profile says where the time goes, the unprofiled rate says how much
there is. Own schema and vhost, dropped at the end.

The stages come from the profile's cumulative times of the functions listed in STAGES (update the
names there when the code moves). cProfile keeps only direct caller -> callee edges, so the time a
function spends under a stage's function is estimated the way gprof does: a function's time is
split between its callers in proportion to the time each call edge took. Stages are listed
innermost first: a publish made from inside a confirm callback counts as publishing. "other" is the
profile's total minus the stages, so the rows always add up.

    .venv/bin/python bench/profile_pump.py
    .venv/bin/python bench/profile_pump.py --messages 5000 --plot docs/profile_pump.png
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import signal
import sys
import time
import uuid
from pathlib import Path

import pika
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_rabbitmq import rabbitmqctl  # noqa: E402
from bench_store import libpq, pyplot  # noqa: E402
from bench_throughput import (  # noqa: E402
    BODY,
    QUEUE,
    TABLE_PREFIX,
    WARMUP,
    burst,
    interrupt,
    log,
    rmq_params,
    save_figure,
    warm_up,
)

from airflow_delay_provider.core.delays import utcnow  # noqa: E402
from airflow_delay_provider.core.pump import Pump, PumpConfig  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore  # noqa: E402
from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport  # noqa: E402
from airflow_delay_provider.transports.sql import SqlTableTransport  # noqa: E402

BATCH = 1000

#: (stage, what it covers, functions), innermost first. A function is "<path suffix>:<name>" (every
#: function of that name in a file whose path ends so), or "<caller>><callee>" for only the calls the
#: caller makes directly (the claim's statement, not every statement SQLAlchemy runs); "a|b": either
#: (only reported as stale when neither is in the profile).
STAGES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("publish", "frame marshalling (pika basic_publish, or the publisher's own _marshal) and socket writes; "
                "on the SQL path the queue-table insert", (
        # pika's own publishing, or the publisher's frames written a window at a time: whichever the code uses.
        "pika/channel.py:basic_publish|airflow_delay_provider/transports/rabbitmq/publisher.py:_marshal",
        "airflow_delay_provider/transports/rabbitmq/publisher.py:_write",
        "pika/adapters/utils/io_services_utils.py:_produce",
        "airflow_delay_provider/transports/sql.py:send",
        # The COPY's end and the savepoint's release run from context-manager exits, which cProfile sees
        # called by contextlib (shared by every `with`, the claim's commit too): named directly. In a pump
        # run only the SQL transport's send makes COPYs and savepoints.
        "psycopg/cursor.py:copy",
        "sqlalchemy/engine/base.py:_savepoint_impl",
        "sqlalchemy/engine/base.py:_release_savepoint_impl",
    )),
    ("build properties", "RabbitMQTransport._publication: the headers, exchange and routing key", (
        "airflow_delay_provider/transports/rabbitmq/transport.py:_publication",
    )),
    ("decode", "DelayedMessage objects from the claimed rows", (
        "airflow_delay_provider/stores/tables.py:_message",
        "airflow_delay_provider/stores/tables.py:_rebuild",
    )),
    ("claim", "the claim statement (DELETE ... RETURNING) and fetching its rows", (
        "airflow_delay_provider/stores/sql.py:claim_due>sqlalchemy/engine/base.py:execute",
        "airflow_delay_provider/stores/sql.py:claim_due>sqlalchemy/engine/result.py:all",
    )),
    ("waiting for the claim ahead", "the pump's thread waiting for the batch its worker thread claimed and "
                                    "decoded meanwhile (cProfile sees only the pump's thread)", (
        "concurrent/futures/_base.py:result",
    )),
    ("move", "the SQL path's claim and queue insert in one statement (SqlTableTransport.move_due), rows never "
             "in Python", (
        "airflow_delay_provider/transports/sql.py:move_due",
    )),
    ("settle/commit", "Pump._settle, claim removal and restore, the transaction commit", (
        "airflow_delay_provider/core/pump.py:_settle",
        "airflow_delay_provider/stores/sql.py:restore_unsettled",
        "sqlalchemy/engine/default.py:do_commit",
    )),
    ("confirm handling", "ConfirmingPublisher._on_confirm and waiting in pika's I/O loop", (
        "airflow_delay_provider/transports/rabbitmq/publisher.py:_on_confirm",
        "airflow_delay_provider/transports/rabbitmq/publisher.py:_run",
    )),
)


def _matches(func: tuple, spec: str) -> bool:
    path, _, name = spec.rpartition(":")
    return func[2] == name and func[0].replace(os.sep, "/").endswith(path)


def _short(func: tuple) -> str:
    """`package/module.py:line(name)`, without the checkout's or the virtualenv's path."""
    text = pstats.func_std_string(func)
    return text.split("site-packages/")[-1].replace(str(ROOT) + os.sep, "")


class Attribution:
    """Splits a profile's self times between sets of functions (see the module docstring)."""

    def __init__(self, stats: dict) -> None:
        self.stats = stats  # pstats: func -> (cc, nc, self time, cumulative time, {caller: (cc, nc, tt, ct)})

    def resolve(self, specs: tuple[str, ...]) -> tuple[set, set, list[str]]:
        """The functions and (caller, callee) edges the specs name, and the specs that named nothing."""
        nodes, edges, missing = set(), set(), []
        for spec in specs:
            found = False
            for one in spec.split("|"):
                if ">" in one:
                    caller_spec, callee_spec = one.split(">", 1)
                    pairs = {(c, f) for f, row in self.stats.items() if _matches(f, callee_spec)
                             for c in row[4] if _matches(c, caller_spec)}
                    edges |= pairs
                    found = found or bool(pairs)
                else:
                    funcs = {f for f in self.stats if _matches(f, one)}
                    nodes |= funcs
                    found = found or bool(funcs)
            if not found:
                missing.append(spec)
        return nodes, edges, missing

    def inside(self, nodes: set, edges: set) -> dict:
        """Each function's fraction of time spent under one of `nodes` or one of `edges` (itself included)."""
        memo: dict = {}

        def frac(func, active: frozenset) -> float:
            if func in nodes:
                return 1.0
            if func in memo:
                return memo[func]
            callers = self.stats[func][4] if func in self.stats else {}
            weights = {c: v[3] for c, v in callers.items()}
            total = sum(weights.values())
            if total <= 0:  # no time measured on any edge: weigh by call counts
                weights = {c: v[1] for c, v in callers.items()}
                total = sum(weights.values())
            share = 0.0
            for caller, weight in weights.items():
                if not weight:
                    continue
                if (caller, func) in edges:
                    share += weight / total
                elif caller not in active:  # a recursive cycle adds nothing new
                    share += weight / total * frac(caller, active | {func})
            memo[func] = share
            return share

        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, 20_000))
        try:
            return {f: frac(f, frozenset({f})) for f in self.stats}
        finally:
            sys.setrecursionlimit(old)

    def stages(self) -> tuple[dict[str, float], float, list[str], list[tuple[str, float]]]:
        """Seconds per stage, the total, specs that matched nothing, and the largest parts of "other"."""
        self_time = {f: row[2] for f, row in self.stats.items()}
        total = sum(self_time.values())
        nodes: set = set()
        edges: set = set()
        below = dict.fromkeys(self.stats, 0.0)
        seconds: dict[str, float] = {}
        missing: list[str] = []
        for name, _what, specs in STAGES:
            more_nodes, more_edges, absent = self.resolve(specs)
            missing += absent
            nodes |= more_nodes
            edges |= more_edges
            now = self.inside(nodes, edges)
            # What the stages so far cover, minus what the earlier (inner) ones covered already.
            seconds[name] = sum(self_time[f] * (now[f] - below[f]) for f in self.stats)
            below = now
        rest = sorted(((_short(f), self_time[f] * (1 - below[f])) for f in self.stats), key=lambda x: -x[1])
        return seconds, total, missing, rest[:8]


def reset(conn: psycopg.Connection, store: SqlDelayedMessageStore, sql: SqlTableTransport, channel) -> None:
    conn.execute(f"TRUNCATE {store.table.fullname}, {store.tables.ids.fullname}, {sql.messages.fullname}")
    conn.commit()
    channel.queue_purge(QUEUE)


def fill(store: SqlDelayedMessageStore, n: int) -> None:
    messages = burst(n, utcnow())
    for i in range(0, n, BATCH):
        store.store(messages[i : i + BATCH])


def drain(store: SqlDelayedMessageStore, transport, n: int, profiler: cProfile.Profile | None) -> float:
    pump = Pump(store, transport, PumpConfig(batch_size=BATCH))
    started = time.perf_counter()
    with profiler or contextlib.nullcontext():
        result = pump.run(stop_when_idle=True)
    elapsed = time.perf_counter() - started
    assert result.stats.dispatched == n, result.stats.summary()
    return elapsed


def profile_path(name: str, transport, store, sql, conn, channel, n: int) -> dict:
    reset(conn, store, sql, channel)
    fill(store, n)
    log(f"{name}: {n} messages, unprofiled")
    plain = drain(store, transport, n, None)
    reset(conn, store, sql, channel)
    fill(store, n)
    log(f"{name}: {n} messages, under cProfile")
    profiler = cProfile.Profile()
    profiled = drain(store, transport, n, profiler)
    seconds, total, missing, rest = Attribution(pstats.Stats(profiler).stats).stages()
    stages = {stage: {"us_per_msg": s / n * 1e6, "share": s / total} for stage, s in seconds.items()}
    other = total - sum(seconds.values())
    stages["other"] = {"us_per_msg": other / n * 1e6, "share": other / total}
    return {"messages": n, "unprofiled_rate": n / plain, "unprofiled_us_per_msg": plain / n * 1e6,
            "profiled_wall_us_per_msg": profiled / n * 1e6, "profile_total_us_per_msg": total / n * 1e6,
            "stages": stages, "unmatched": missing,
            "largest_in_other": [{"function": f, "us_per_msg": s / n * 1e6} for f, s in rest]}


def report(results: dict) -> None:
    names = list(results)
    print(f"\nPump time per message by stage, cProfile, {results[names[0]]['messages']:,} messages of {len(BODY)} B "
          f"per path, batches of {BATCH:,}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n")
    print("| stage | " + " | ".join(f"{n}: µs/msg | %" for n in names) + " |")
    print("|---|" + "---:|---:|" * len(names))
    for stage in [s[0] for s in STAGES] + ["other"]:
        row = [results[n]["stages"][stage] for n in names]
        cells = " | ".join(f"{x['us_per_msg']:.1f} | {x['share']:.0%}" for x in row)
        print(f"| {stage} | {cells} |")
    print("| **total (profiled)** | " + " | ".join(f"**{results[n]['profile_total_us_per_msg']:.1f}** | 100%"
                                                  for n in names) + " |")
    # The % column of this row: the unprofiled time as a share of the profiled, i.e. how much profiling inflates.
    print("| unprofiled run of the same size (its share of the profiled time) | " + " | ".join(
        f"{results[n]['unprofiled_us_per_msg']:.1f} ({results[n]['unprofiled_rate']:,.0f} msg/s) | "
        f"{results[n]['unprofiled_us_per_msg'] / results[n]['profile_total_us_per_msg']:.0%}" for n in names) + " |")
    print("\nStages: " + "; ".join(f"{name}: {what}" for name, what, _ in STAGES) + ".")
    for n in names:
        top = ", ".join(f"{x['function']} {x['us_per_msg']:.1f}" for x in results[n]["largest_in_other"][:5])
        print(f"\nLargest self times in other ({n}, µs/msg): {top}")


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    names = list(results)
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(names)
    for stage in [s[0] for s in STAGES] + ["other"]:
        values = [results[n]["stages"][stage]["us_per_msg"] for n in names]
        ax.bar(names, values, bottom=bottom, label=stage, width=0.5)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("µs per message (profiled)")
    ax.set_title("Where the pump's time goes")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--pg-url", default=os.environ.get("DELAY_BENCH_PG_URL",
                                                           "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "profile.json")
    parser.add_argument("--plot", type=Path, help="write a stacked bar chart, one bar per path (needs matplotlib)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, interrupt)  # unwinds like Ctrl-C: the schema and vhost are dropped

    schema, vhost = f"adp_prof_{uuid.uuid4().hex[:8]}", f"adp_prof_{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", vhost)
    results: dict = {}
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        params = rmq_params(args.host, vhost)
        store = SqlDelayedMessageStore(args.pg_url, schema=schema)
        store.create_schema()
        sql = SqlTableTransport(args.pg_url, schema=schema, table_prefix=TABLE_PREFIX)
        sql.provision(QUEUE)
        rmq = RabbitMQTransport(params)
        for queue in (QUEUE, WARMUP):
            rmq.provision(queue)
        warm_up(store, rmq)  # the publisher connection is opened outside the profile
        admin = pika.BlockingConnection(pika.ConnectionParameters(args.host, 5672, vhost, params.credentials,
                                                                  heartbeat=0))
        conn = psycopg.connect(libpq(args.pg_url))
        try:
            results["rabbitmq"] = profile_path("store -> RabbitMQ quorum", rmq, store, sql, conn, admin.channel(),
                                               args.messages)
            results["sql"] = profile_path("store -> SQL-table queue", sql, store, sql, conn, admin.channel(),
                                          args.messages)
        finally:
            rmq.close()
            store.close()
            admin.close()
            conn.close()
    finally:
        with psycopg.connect(libpq(args.pg_url), autocommit=True) as conn:
            conn.execute("SET lock_timeout = '30s'")
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        rabbitmqctl("delete_vhost", vhost)
        log(f"dropped schema {schema} and vhost {vhost}")
    # A spec may fit one path only (or older code): only those matching on neither path are stale.
    for spec in sorted(set.intersection(*(set(r["unmatched"]) for r in results.values()))):
        log(f"no function in either profile matches {spec!r} (renamed? update STAGES)")
    report(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    log(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
