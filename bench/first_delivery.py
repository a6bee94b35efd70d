"""The first delivery of a burst, A/B: an earlier commit's package beside the working tree's, and graphile-worker.

The experiment (bench_throughput.py --ab COMMIT): N messages of 200 B (20,000) stored `lead` seconds (24) ahead in
one call, all due at one instant T; one pump process asleep until T (woken by the store); an SQL-table queue in the
same database; a consumer process polling it from 50 ms before T. Each side runs in processes of its own whose
PYTHONPATH puts its checkout's `airflow_delay_provider` first (the earlier commit from a temporary detached git
worktree), on a schema of its own made by its own migrations, in turns, `rounds` each. Per burst:

- the pump's first insert after T: the earliest `enqueued_at` of the queue's rows (the database's clock when the row
  was inserted) less T;
- the first delivery after T: when the consumer first received a row of the burst, less T;
- the drain rate from T: N over the time from T to the consumer's last arrival.

What the sides call of the package (the store, the pump, the SQL transport's receive and ack) is the same in both.
With `graphile`, graphile-worker (bench/graphile, installed by `npm ci`) runs the same burst in the same rounds: N
jobs added in one call with run_at T, a worker with 24 concurrent jobs, a local queue and a 100 ms poll; its first
job's start and its last job's end are measured from T as the pump's.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAPHILE = ROOT / "bench" / "graphile"
QUEUE = "orders"
TABLE_PREFIX = "delayed_messages_"
FIGURES = ("first_insert_ms", "first_delivery_ms", "drain_rate", "insert_rate")
#: graphile-worker tuned for a burst: concurrency 24, a local queue of jobs fetched in batches, 100 ms poll.
GRAPHILE_SETTINGS = {"concurrency": 24, "local_queue": 500, "poll_ms": 100, "complete_batch_ms": 0}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


# -- inside a side's processes: the package of that side's checkout -----------------------------------------------
def _package(checkout: str) -> None:
    """Put `checkout`'s package first and check that it is the one imported."""
    sys.path.insert(0, checkout)
    import airflow_delay_provider

    where = Path(airflow_delay_provider.__file__).resolve()
    if not where.is_relative_to(Path(checkout).resolve()):
        raise SystemExit(f"imported {where}, not the package of {checkout}")


def pump(spec: dict) -> None:
    """A pump asleep until its messages are due, woken by the store, until it is killed."""
    from datetime import UTC, datetime

    from airflow_delay_provider.core.pump import Pump, PumpConfig
    from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
    from airflow_delay_provider.transports.sql import SqlTableTransport

    store = SqlDelayedMessageStore(spec["url"], schema=spec["schema"])
    transport = SqlTableTransport(spec["url"], schema=spec["schema"], table_prefix=TABLE_PREFIX)
    store.next_due()  # a running pump has its connection open, and its clock offset read
    print("ready", flush=True)
    Pump(store, transport, PumpConfig(batch_size=1000)).run(deadline=datetime.fromtimestamp(spec["deadline"], UTC))


def consume(spec: dict) -> None:
    """Polls the queue (1,000 at a time, `poll_ms` between empty polls) from 50 ms before the due time read from
    stdin, acks what it got; prints when each id first arrived and when the pump inserted it."""
    from airflow_delay_provider.transports.sql import SqlTableTransport

    transport = SqlTableTransport(spec["url"], schema=spec["schema"], table_prefix=TABLE_PREFIX)
    transport.depth(QUEUE)  # the pooled connection is open before the clock starts
    print("ready", flush=True)
    due = float(sys.stdin.readline())
    time.sleep(max(0.0, due - 0.05 - time.time()))
    arrived, inserted, last_inserted, received = poll(transport, QUEUE, spec["n"], spec["timeout"], spec["poll_ms"])
    print(json.dumps({"received": received, "distinct": len(arrived), "early": sum(t < due for t in inserted),
                      "first": min(arrived.values(), default=None), "last": max(arrived.values(), default=None),
                      "first_inserted": min(inserted, default=None), "last_inserted": last_inserted}), flush=True)


def poll(transport, queue: str, n: int, timeout: float, poll_ms: float,
         linger: float = 0.0) -> tuple[dict[str, float], list[float], float | None, int]:
    """Receives `queue` (1,000 at a time, `poll_ms` between empty polls) and acks what it got, until `n` distinct
    ids arrived and `linger` seconds more (duplicates would come meanwhile), or `timeout`. Returns when each id
    first arrived, when the pump inserted each batch's first row (its `enqueued_at`) and the last row, and how many
    were received."""
    arrived: dict[str, float] = {}
    inserted: list[float] = []
    last_inserted = None
    received = 0
    deadline = time.monotonic() + timeout
    linger_until = None
    while time.monotonic() < deadline and (linger_until is None or time.monotonic() < linger_until):
        batch = transport.receive(queue, max_messages=1000, visibility_timeout=600)
        now = time.time()
        if not batch:
            time.sleep(poll_ms / 1000)
            continue
        received += len(batch)
        inserted.append(min(m.enqueued_at.timestamp() for m in batch))
        last_inserted = max(last_inserted or 0.0, max(m.enqueued_at.timestamp() for m in batch))
        for m in batch:
            arrived.setdefault(m.message_id, now)
        transport.ack(queue, [m.receipt for m in batch])
        if linger_until is None and len(arrived) >= n:
            linger_until = time.monotonic() + linger
    return arrived, inserted, last_inserted, received


def side(spec: dict) -> None:
    """One burst on this checkout's package: a schema of its own, a pump and a consumer, the burst; prints figures."""
    import psycopg

    from airflow_delay_provider.core.delays import utcnow
    from airflow_delay_provider.core.message import DelayedMessage
    from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
    from airflow_delay_provider.transports.sql import SqlTableTransport

    store = SqlDelayedMessageStore(spec["url"], schema=spec["schema"])
    procs: list[subprocess.Popen] = []
    try:
        store.create_schema()
        SqlTableTransport(spec["url"], schema=spec["schema"], table_prefix=TABLE_PREFIX).provision(QUEUE)
        store.next_due()
        pumped = _start(procs, {**spec, "role": "pump", "deadline": time.time() + spec["lead"] + spec["timeout"]})
        time.sleep(0.5)  # its first wait only opens the LISTEN connection: let it fall asleep
        consumer = _start(procs, {**spec, "role": "consume"}, stdin=True)
        due_at = utcnow().replace(microsecond=0) + _seconds(spec["lead"])
        due = due_at.timestamp()
        consumer.stdin.write(f"{due!r}\n")
        consumer.stdin.flush()
        store.store([DelayedMessage(QUEUE, b"x" * 200, due_at, {}, uuid.uuid4().hex) for _ in range(spec["n"])])
        stored_ahead = due - time.time()
        out, _ = consumer.communicate(timeout=spec["lead"] + spec["timeout"] + 30)
        got = json.loads(out.splitlines()[-1])
        pumped.kill()
        pumped.wait()
        figures = {"first_insert_ms": (got["first_inserted"] - due) * 1000,
                   "first_delivery_ms": (got["first"] - due) * 1000,
                   "drain_rate": got["distinct"] / (got["last"] - due),
                   "insert_rate": got["distinct"] / (got["last_inserted"] - due),
                   "missing": spec["n"] - got["distinct"],
                   "duplicates": got["received"] - got["distinct"], "early": got["early"],
                   "stored_s_ahead": stored_ahead}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        store.close()
        with psycopg.connect(libpq(spec["url"]), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{spec["schema"]}" CASCADE')
    print(json.dumps(figures), flush=True)


def _seconds(s: float):
    from datetime import timedelta

    return timedelta(seconds=s)


def _start(procs: list[subprocess.Popen], spec: dict, stdin: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
    procs.append(proc)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the {spec['role']} process did not start (see its stderr above)")
    return proc


# -- the run, in the working tree ------------------------------------------------------------------------------------
def run_side(checkout: Path, spec: dict) -> dict:
    """One burst on `checkout`'s package (in processes whose PYTHONPATH puts it first)."""
    spec = {**spec, "role": "side", "checkout": str(checkout), "schema": f"adp_first_{uuid.uuid4().hex[:8]}"}
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, __file__, json.dumps(spec)], cwd=checkout, env=env, capture_output=True,
                         text=True, timeout=spec["lead"] + spec["timeout"] + 120)
    if out.returncode:
        raise RuntimeError(f"the side of {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def graphile_ready() -> str | None:
    """None when graphile-worker can run here, else why not. Installs bench/graphile's locked packages (npm ci)
    when they are not there yet: the only download, before any measure."""
    if subprocess.run(["node", "--version"], capture_output=True).returncode:
        return "node is not on this machine"
    if not (GRAPHILE / "node_modules" / "graphile-worker").exists():
        log("npm ci in bench/graphile (graphile-worker)")
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=GRAPHILE, capture_output=True, text=True)
        if done.returncode:
            return f"npm ci failed: {done.stderr.strip()[-500:]}"
    return None


def run_graphile(spec: dict) -> dict:
    """The same burst through graphile-worker: N jobs added in one call, all with run_at T."""
    schema = f"gw_{uuid.uuid4().hex[:8]}"
    settings = {"url": libpq(spec["url"]).replace("postgresql://", "postgres://"), "schema": schema, "n": spec["n"],
                **GRAPHILE_SETTINGS}
    proc = subprocess.Popen(["node", str(GRAPHILE / "burst.mjs"), json.dumps(settings)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("graphile-worker did not start (see its stderr above)")
        due = float(int(time.time()) + spec["lead"])
        proc.stdin.write(f"{due!r}\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=spec["lead"] + spec["timeout"] + 30)
        got = json.loads(out.splitlines()[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        import psycopg

        with psycopg.connect(libpq(spec["url"]), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return {"first_job_ms": got["first_ms"] - due * 1000, "drain_rate": got["distinct"] / (got["last_ms"] / 1000 - due),
            "missing": spec["n"] - got["distinct"], "duplicates": got["calls"] - got["distinct"]}


@contextlib.contextmanager
def worktree(commit: str):
    """`commit` checked out in a temporary detached git worktree, removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="bench-first-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def ab(url: str, commit: str, rounds: int, n: int = 20_000, lead: float = 24.0, poll_ms: float = 1.0,
       timeout: float = 120.0, graphile: bool = False) -> dict:
    """`rounds` bursts a side, in turns (the earlier commit and the working tree, each first in every other round,
    then graphile-worker); each side's medians and the ratios working tree / earlier commit of the medians."""
    spec = {"url": url, "n": n, "lead": lead, "poll_ms": poll_ms, "timeout": timeout}
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", commit], capture_output=True, text=True,
                           check=True).stdout.strip()
    why_not = graphile_ready() if graphile else "not asked for (--graphile)"
    runs: dict[str, list[dict]] = {"base": [], "tree": [], "graphile": []}
    with worktree(commit) as base:
        for r in range(1, rounds + 1):
            sides = (("base", base), ("tree", ROOT))
            for name, checkout in sides if r % 2 else sides[::-1]:  # each goes first in every other round
                runs[name].append(run_side(checkout, spec))
                log(f"round {r}/{rounds} {short if name == 'base' else 'working tree'}: " + line(runs[name][-1]))
            if why_not is None:
                runs["graphile"].append(run_graphile(spec))
                got = runs["graphile"][-1]
                log(f"round {r}/{rounds} graphile-worker: first job {got['first_job_ms']:.1f} ms, "
                    f"{got['drain_rate']:,.0f} msg/s")
    medians = {side: {f: statistics.median(x[f] for x in rs) for f in rs[0] if not f.startswith(("missing", "dup"))}
               for side, rs in runs.items() if rs}
    result = {"commit": short, "rounds": rounds, "messages": n, "lead_s": lead, "poll_ms": poll_ms, "runs": runs,
              "medians": medians, "ratios": {f: medians["tree"][f] / medians["base"][f] for f in FIGURES},
              "graphile": {"settings": GRAPHILE_SETTINGS, "version": graphile_version()} if why_not is None
              else {"not_run": why_not}}
    if runs["graphile"]:
        result["graphile"]["pump_vs_graphile"] = medians["tree"]["drain_rate"] / medians["graphile"]["drain_rate"]
        result["graphile"]["pump_inserts_vs_graphile"] = (medians["tree"]["insert_rate"]
                                                          / medians["graphile"]["drain_rate"])
    return result


def graphile_version() -> str:
    lock = json.loads((GRAPHILE / "package-lock.json").read_text())
    return lock["packages"]["node_modules/graphile-worker"]["version"]


def line(x: dict) -> str:
    return (f"first insert {x['first_insert_ms']:.1f} ms, first delivery {x['first_delivery_ms']:.1f} ms, "
            f"{x['drain_rate']:,.0f} msg/s, missing {x['missing']}, duplicates {x['duplicates']}, early {x['early']}")


def each(runs: list[dict], figure: str, fmt: str) -> str:
    return " / ".join(format(x[figure], "," + fmt) for x in runs)


def report(r: dict) -> str:
    """The table: each round's figures, the medians and the ratios of the medians."""
    base, tree = r["runs"]["base"], r["runs"]["tree"]
    out = [f"{r['messages']:,} messages of 200 B stored {r['lead_s']:g} s ahead in one call, due at one instant T; one "
           f"pump asleep until T; the SQL-table queue polled every {r['poll_ms']:g} ms; {r['rounds']} rounds, in turns",
           "", "| code | pump's first insert after T (ms) | first delivery after T (ms) | drain rate from T, delivered "
           "(msg/s) | the pump's insert rate from T (msg/s) |", "|---|---|---|---|---|"]
    for name, rs in ((r["commit"], base), ("working tree", tree)):
        med = r["medians"]["base" if rs is base else "tree"]
        out.append(f"| {name} | " + " | ".join(
            f"**{med[f]:,{(fmt := '.0f' if f.endswith('rate') else '.1f')}}** ({each(rs, f, fmt)})" for f in FIGURES)
                   + " |")
    ratio = r["ratios"]
    out.append(f"| ratio working tree / {r['commit']} (medians) | {ratio['first_insert_ms']:.2f}x | "
               f"{ratio['first_delivery_ms']:.2f}x | {ratio['drain_rate']:.2f}x | {ratio['insert_rate']:.2f}x |")
    lost = {k: sum(x[k] for x in base + tree) for k in ("missing", "duplicates", "early")}
    out.append(f"\nMissing {lost['missing']}, duplicates {lost['duplicates']}, inserted before T {lost['early']} "
               "(both sides, all rounds).")
    g = r["graphile"]
    if "not_run" in g:
        out.append(f"\ngraphile-worker: not run ({g['not_run']}).")
    else:
        gr, med = r["runs"]["graphile"], r["medians"]["graphile"]
        s = g["settings"]
        out += ["", "| same burst, same rounds | first job / delivery after T (ms) | drain rate from T (msg/s): jobs "
                "run / delivered | the pump's insert rate from T (msg/s) |", "|---|---|---|---|",
                f"| graphile-worker {g['version']} (concurrency {s['concurrency']}, local queue {s['local_queue']}, "
                f"poll {s['poll_ms']} ms, completions batched) | **{med['first_job_ms']:,.1f}** "
                f"({each(gr, 'first_job_ms', '.1f')}) | **{med['drain_rate']:,.0f}** "
                f"({each(gr, 'drain_rate', '.0f')}) | |",
                f"| pump -> SQL-table queue, working tree | **{r['medians']['tree']['first_delivery_ms']:,.1f}** | "
                f"**{r['medians']['tree']['drain_rate']:,.0f}** | **{r['medians']['tree']['insert_rate']:,.0f}** |",
                f"\nPump / graphile-worker drain rate: {g['pump_vs_graphile']:.2f}x delivered to the consumer, "
                f"{g['pump_inserts_vs_graphile']:.2f}x inserted into the queue (target >= 1.5x); graphile-worker "
                f"missing {sum(x['missing'] for x in gr)}, run twice {sum(x['duplicates'] for x in gr)}."]
    return "\n".join(out)


if __name__ == "__main__":  # a side's process: one JSON argument
    _spec = json.loads(sys.argv[1])
    _package(_spec["checkout"])
    {"side": side, "pump": pump, "consume": consume}[_spec["role"]](_spec)
