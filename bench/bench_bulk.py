"""Benchmark: a cancel of 1,000,000 scheduled messages by a filter in a store of 10,000,000, while a pump delivers.

One run, one PostgreSQL schema of its own (dropped at the end, also on Ctrl-C or an error). The store is filled by
COPY as `store()` leaves it (bench_scale's fill) with --size messages due 1 hour to 7 days later, a tenth of them
for the destination `bulk-target`, and settled (the store's upkeep has analysed it). Then a steady load runs
throughout: a sender storing --rate messages a second due 2 s later for `steady`, a pump delivering them into the
SQL-table queue and a consumer recording each one's lateness (its enqueue time minus its due time, both on the
database's clock). Against that load it measures, in order:

1. the count of `bulk-target`'s messages (the dry run the page and the CLI show before the user confirms);
2. with --with-pause, a pause of them by that filter and a resume, in batches as the cancel goes;
3. the cancel of them by that filter, as the page, the CLI and the operators run it: in batches of 10,000, each its
   own transaction (its time, rate and batches);
4. the same messages written again (COPY), then removed by one statement in one transaction doing the same work
   (`DELETE ... WHERE destination = ...` and their ids remembered): the database's own limit for the work, and what
   one long transaction does to the pump beside it.

Lateness is reported per phase (before, during each removal, after) as p50/p99/max, and per 5 s in the plot.

    .venv/bin/python bench/bench_bulk.py --pg default --plot docs/bench_bulk.png   # docs/benchmarks/bulk.md
    .venv/bin/python bench/bench_bulk.py --size 200000 --target-share 0.1          # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_scale  # noqa: E402
import pgserver  # noqa: E402
from bench_store import finish, libpq, pyplot  # noqa: E402
from bench_throughput import Children, interrupt, log, percentile, save_figure  # noqa: E402
from machine import describe, machine  # noqa: E402

from airflow_delay_provider.core.backlog import BULK_BATCH, Selector  # noqa: E402
from airflow_delay_provider.core.message import DelayedMessage  # noqa: E402
from airflow_delay_provider.core.pump import Pump, PumpConfig  # noqa: E402
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore  # noqa: E402
from airflow_delay_provider.transports.sql import SqlTableTransport  # noqa: E402

STEADY = "steady"
TARGET = "bulk-target"
PREFIX = "bulk_"
BODY = b"x" * 200
WINDOW_S = 5.0


# -- children ------------------------------------------------------------------------------------------
def child(spec: dict) -> None:
    {"send": send, "pump": pump, "consume": consume}[spec["role"]](spec)


def send(spec: dict) -> None:
    """Store `rate` messages a second due 2 s later, in batches of 50, until the file `stop` exists."""
    store = SqlDelayedMessageStore(spec["url"], schema=spec["schema"])
    stop = Path(spec["stop"])
    started, sent = time.monotonic(), 0
    print("ready", flush=True)
    while not stop.exists():
        due = store.clock() + timedelta(seconds=2)
        store.store([DelayedMessage(STEADY, BODY, due, {}, f"s-{sent + i:09d}") for i in range(50)])
        sent += 50
        ahead = sent / spec["rate"] - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)
    print(json.dumps({"sent": sent}), flush=True)


def pump(spec: dict) -> None:
    """Deliver until killed (the run ends it once the consumer has everything)."""
    store = SqlDelayedMessageStore(spec["url"], schema=spec["schema"])
    transport = SqlTableTransport(spec["url"], schema=spec["schema"], table_prefix=PREFIX)
    print("ready", flush=True)
    Pump(store, transport, PumpConfig(batch_size=1000)).run()


def consume(spec: dict) -> None:
    """Receive and ack until the file `stop` holds the number sent and that many were received (or a minute after it
    appeared); then print each message's (enqueue time, lateness ms), in arrival order."""
    transport = SqlTableTransport(spec["url"], schema=spec["schema"], table_prefix=PREFIX)
    stop = Path(spec["stop"])
    seen: list[tuple[float, float]] = []
    until = None
    print("ready", flush=True)
    while until is None or (len(seen) < until[0] and time.monotonic() < until[1]):
        batch = transport.receive(STEADY, max_messages=1000, visibility_timeout=600)
        seen.extend((m.enqueued_at.timestamp(), (m.enqueued_at - m.due_at).total_seconds() * 1000) for m in batch)
        if batch:
            transport.ack(STEADY, [m.receipt for m in batch])
        else:
            time.sleep(0.005)
        if until is None and stop.exists() and stop.read_text().strip():
            until = (int(stop.read_text()), time.monotonic() + 60)
    print(json.dumps({"seen": seen}), flush=True)


# -- the run -------------------------------------------------------------------------------------------
class Bulk:
    def __init__(self, args) -> None:
        self.args = args
        self.schema = f"adp_bulk_{uuid.uuid4().hex[:8]}"
        self.children = Children()
        self.marks: list[tuple[str, float]] = []
        self.r: dict = {"size": args.size, "target_share": args.target_share, "rate": args.rate,
                        "batch": BULK_BATCH}

    def spec(self, **fields) -> dict:
        return {"url": self.args.pg_url, "schema": self.schema, **fields}

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time()))
        log(f"-- {name}")

    def setup(self) -> None:
        self.store = SqlDelayedMessageStore(self.args.pg_url, schema=self.schema)
        self.store.create_schema()
        self.queue = SqlTableTransport(self.args.pg_url, schema=self.schema, table_prefix=PREFIX)
        self.queue.provision(STEADY)
        self.conn = psycopg.connect(libpq(self.args.pg_url), autocommit=True)
        # bench_scale's fill, its destinations a tenth (--target-share) `bulk-target`.
        share = round(self.args.target_share * 100)
        bench_scale.FILL_DESTINATIONS = [TARGET] * share + [f"later-{i:02d}" for i in range(100 - share)]
        self.filler = bench_scale.Bench(argparse.Namespace(**vars(self.args), burst=0))
        self.filler.store, self.filler.conn = self.store, self.conn
        self.store.register_destinations(sorted({*bench_scale.FILL_DESTINATIONS, STEADY}))

    def teardown(self) -> None:
        finish(self.args.pg_url, self.schema, self.children, self.store.close, self.queue.close, self.conn.close)
        log(f"dropped schema {self.schema}")

    def targets(self) -> int:
        return self.conn.execute(f"SELECT count(*) FROM {self.store.table.fullname} WHERE destination = %s",
                                 [TARGET]).fetchone()[0]

    def run(self) -> None:
        self.r["fill"] = self.filler.fill(self.args.size)
        self.r["settle"] = self.filler.settle()
        self.r["targets"] = self.targets()
        log(f"{self.r['targets']:,} of {self.args.size:,} stored messages are {TARGET}'s")
        stops = Path(tempfile.mkdtemp(prefix="adp-bulk-"))
        consumer = self.children.start(self.spec(role="consume", stop=str(stops / "consume")), script=__file__)
        pumper = self.children.start(self.spec(role="pump"), script=__file__)
        sender = self.children.start(self.spec(role="send", rate=self.args.rate, stop=str(stops / "send")),
                                     script=__file__)
        self.mark("before")
        time.sleep(self.args.before)

        self.mark("count")
        started = time.perf_counter()
        counted = self.store.count_selected(Selector(destination=TARGET))
        self.r["count_seconds"] = time.perf_counter() - started
        self.r["counted"] = counted["would_cancel"]
        log(f"count: {counted['would_cancel']:,} in {self.r['count_seconds']:.2f} s")
        if self.args.with_pause:
            self.pause_and_resume()
        self.mark("batched cancel")
        started = time.perf_counter()
        report = self.store.cancel(Selector(destination=TARGET))
        took = time.perf_counter() - started
        self.r["batched"] = {"seconds": took, "cancelled": report["counts"]["cancelled"],
                             "in_flight": report["counts"]["in_flight"], "batches": report["batches"],
                             "rate": report["counts"]["cancelled"] / took}
        log(f"batched cancel: {report['counts']['cancelled']:,} in {took:.1f} s ({report['batches']} batches)")
        self.mark("after batched")
        time.sleep(self.args.after)

        self.mark("refill")
        # The fill's random ids come from a generator seeded by its target: one more than before, so none repeats.
        self.filler.stored = self.args.size + 1 - self.r["targets"]
        bench_scale.FILL_DESTINATIONS = [TARGET]
        self.filler.fill(self.args.size + 1)
        self.mark("rest")
        time.sleep(self.args.after / 2)
        self.mark("one DELETE")
        started = time.perf_counter()
        with psycopg.connect(libpq(self.args.pg_url), autocommit=True) as conn:
            # The same work as the cancel's (the rows gone, their ids remembered from their acceptance, as
            # AcceptedIds.cancelled writes them), in one statement and one transaction.
            deleted = conn.execute(
                f"WITH gone AS (DELETE FROM {self.store.table.fullname} WHERE destination = %s RETURNING message_id, "
                f"stored_at_us) INSERT INTO {self.store.tables.ids.fullname} (message_id, seen_at_us) SELECT "
                "message_id, stored_at_us FROM gone ON CONFLICT (message_id) DO UPDATE SET seen_at_us = "
                "excluded.seen_at_us", [TARGET]).rowcount
        took = time.perf_counter() - started
        self.r["one_statement"] = {"seconds": took, "deleted": deleted, "rate": deleted / took}
        log(f"one DELETE: {deleted:,} in {took:.1f} s")
        self.mark("after one DELETE")
        time.sleep(self.args.after)
        self.mark("end")
        (stops / "send").touch()
        self.r["sent"] = Children.result(sender, 120)["sent"]
        (stops / "consume").write_text(str(self.r["sent"]))
        seen = Children.result(consumer, 300)["seen"]
        pumper.kill()
        pumper.wait()
        shutil.rmtree(stops, ignore_errors=True)
        self.r["received"] = len(seen)
        self.r["phases"] = phases(seen, self.marks)
        self.r["windows"] = windows(seen, self.marks[0][1])
        self.r["marks"] = self.marks


    def pause_and_resume(self) -> None:
        """The same messages paused by the filter and resumed, in batches as the cancel goes: each moves its rows
        into the paused messages' partition and back."""
        for action, change in (("pause", self.store.pause_messages), ("resume", self.store.resume_messages)):
            self.mark(f"batched {action}")
            started = time.perf_counter()
            report = change(Selector(destination=TARGET))
            took = time.perf_counter() - started
            done = report["counts"]["paused" if action == "pause" else "resumed"]
            self.r[action] = {"seconds": took, "changed": done, "batches": report["batches"], "rate": done / took}
            log(f"batched {action}: {done:,} in {took:.1f} s ({report['batches']} batches)")
            self.mark(f"after {action}")
            time.sleep(self.args.after / 2)


def phases(seen: list[list[float]], marks: list[tuple[str, float]]) -> dict:
    """Lateness p50/p99/max (ms) and messages of each phase: between one mark and the next."""
    out = {}
    for (name, start), (_, end) in zip(marks, marks[1:], strict=False):
        late = sorted(ms for at, ms in seen if start <= at < end)
        if late:
            out[name] = {"seconds": end - start, "messages": len(late), "p50": percentile(late, 0.5),
                         "p99": percentile(late, 0.99), "max": late[-1], "early": sum(ms < 0 for ms in late)}
    return out


def windows(seen: list[list[float]], start: float) -> list[dict]:
    by: dict[int, list[float]] = {}
    for at, ms in seen:
        if at >= start:
            by.setdefault(int((at - start) // WINDOW_S), []).append(ms)
    return [{"t": k * WINDOW_S, "p50": percentile(sorted(v), 0.5), "p99": percentile(sorted(v), 0.99),
             "max": max(v), "n": len(v)} for k, v in sorted(by.items())]


def report(r: dict) -> None:
    print(f"\n{describe(r['machine'])}")
    print(f"store: {r['size']:,} messages stored ({r['targets']:,} of {TARGET}), filled in "
          f"{r['fill'].get('fill_seconds', 0):.0f} s, settled in {r['settle']['settle_seconds']:.0f} s; "
          f"steady load {r['rate']:,} msg/s due 2 s later; {r['sent']:,} sent, {r['received']:,} received")
    b, o = r["batched"], r["one_statement"]
    print(f"count of {TARGET}'s messages (the dry run): {r['counted']:,} in {r['count_seconds']:.2f} s")
    print("| removal | messages | seconds | messages/s | transactions |")
    print("|---|---|---|---|---|")
    for action in ("pause", "resume"):
        if action in r:
            a = r[action]
            print(f"| {action} by filter, in batches of {r['batch']:,} | {a['changed']:,} | {a['seconds']:.1f} | "
                  f"{a['rate']:,.0f} | {a['batches']} |")
    print(f"| cancel by filter, in batches of {r['batch']:,} | {b['cancelled']:,} | {b['seconds']:.1f} | "
          f"{b['rate']:,.0f} | {b['batches']} |")
    print(f"| one statement, one transaction (the database's limit) | {o['deleted']:,} | {o['seconds']:.1f} | "
          f"{o['rate']:,.0f} | 1 |")
    print(f"batched / one statement: {b['seconds'] / o['seconds']:.2f}x the time")
    print("\n| phase | seconds | delivered | lateness p50 (ms) | p99 (ms) | max (ms) | early |")
    print("|---|---|---|---|---|---|---|")
    for name, p in r["phases"].items():
        print(f"| {name} | {p['seconds']:.0f} | {p['messages']:,} | {p['p50']:.1f} | {p['p99']:.1f} | "
              f"{p['max']:.0f} | {p['early']} |")


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    w = r["windows"]
    ax.plot([x["t"] for x in w], [x["p99"] for x in w], label="p99")
    ax.plot([x["t"] for x in w], [x["p50"] for x in w], label="p50")
    start = r["marks"][0][1]
    for (name, at), (_, end) in zip(r["marks"], r["marks"][1:], strict=False):
        if name in ("batched pause", "batched resume", "batched cancel", "one DELETE", "refill"):
            ax.axvspan(at - start, end - start, alpha=0.15, color={"refill": "grey"}.get(name, "C3"))
            ax.text(at - start, ax.get_ylim()[1] * 0.95, name, fontsize=8, va="top")
    ax.set_yscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"lateness per {WINDOW_S:.0f} s (ms)")
    ax.set_title(f"Pump lateness at {r['rate']:,} msg/s while {r['targets']:,} of {r['size']:,} stored are removed")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pgserver.add_arguments(parser)
    parser.add_argument("--size", type=int, default=10_000_000, help="messages stored (default 10,000,000)")
    parser.add_argument("--target-share", type=float, default=0.1, help="the share for bulk-target (default 0.1)")
    parser.add_argument("--rate", type=int, default=1000, help="the steady load, messages a second (default 1,000)")
    parser.add_argument("--before", type=float, default=60.0, help="seconds of steady load before the cancel")
    parser.add_argument("--after", type=float, default=60.0, help="seconds of steady load after each removal")
    parser.add_argument("--with-pause", action="store_true",
                        help="before the cancel, pause the same messages by the filter and resume them")
    parser.add_argument("--settle-timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "bulk.json")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("airflow_delay_provider.stores.bulk").setLevel(logging.INFO)
    signal.signal(signal.SIGTERM, interrupt)
    with pgserver.server(args):
        bench = Bulk(args)
        bench.r["machine"] = machine(args.pg_url)
        bench.setup()
        try:
            bench.run()
        finally:
            bench.teardown()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(bench.r, indent=1, default=float))
    report(bench.r)
    if args.plot:
        plot(bench.r, args.plot)


if __name__ == "__main__":
    main()
