"""A pump in its own process, for the concurrency and crash tests: prints its counts as JSON (its last line).

    pump_worker.py STORE_URL SCHEMA TABLE TRANSPORT_URL BATCH [--due-before ISO] [--hold-at-claim K]

Without options it dispatches until nothing is due (stop_when_idle).

--due-before ISO: it dispatches what is due before that time and stops when nothing is left before it,
sleeping until messages fall due meanwhile; it prints `sleeping` when its pump first sleeps on the store's
LISTEN connection (from then on a stored or rescheduled message wakes it).

--hold-at-claim K: it stops inside its K-th batch: after the statement claiming the batch's rows ran and the
batch was sent, before the claim commits, it prints `holding <backend pid of the claim's connection>` and
sleeps, for a test to kill it there.

`Worker` (imported by the tests) starts it and reads what it prints.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    """pump_worker.py in a process of its own; its output is read as it comes (a thread per worker)."""

    def __init__(self, store_url: str, schema: str | None, table: str, transport_url: str, batch: int = 500,
                 due_before: datetime | None = None, hold_at_claim: int | None = None) -> None:
        args = [store_url, schema or "", table, transport_url, str(batch)]
        if due_before is not None:
            args += ["--due-before", due_before.isoformat()]
        if hold_at_claim is not None:
            args += ["--hold-at-claim", str(hold_at_claim)]
        self.proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True,
                                     cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._new.put(line.rstrip("\n"))
        self._new.put(None)  # end of output

    def wait_line(self, prefix: str, timeout: float) -> str:
        """The first line (from those not yet read) starting with `prefix`; fails the test if the worker
        ends, or `timeout` passes, first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._new.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"worker {self.pid} printed no {prefix!r} within {timeout} s: "
                                     f"{self.lines}") from None
            if line is None:
                self._new.put(None)
                raise AssertionError(f"worker {self.pid} ended (code {self.proc.wait()}) without printing "
                                     f"{prefix!r}: {self.lines}")
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def result(self, timeout: float) -> dict:
        """Wait for the worker to end; its counts (the JSON it printed last). Fails if it failed."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        while not self._new.empty() and (line := self._new.get_nowait()) is not None:
            self.lines.append(line)
        assert code == 0, f"worker {self.pid} exited with {code}: {self.lines}"
        return json.loads(self.lines[-1])

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _hold_inside_claim(engine, table: str, hold_at: int) -> None:
    """Sleep before the commit of the `hold_at`-th transaction that claimed rows of the store's table (a
    claim, or a move into queue tables), after printing `holding <backend pid>`."""
    from sqlalchemy import event

    claiming = re.compile(rf'DELETE FROM (\S+\.)?"?{re.escape(table)}"?\s')
    claims = 0

    @event.listens_for(engine, "after_cursor_execute")
    def seen(conn, cursor, statement, parameters, context, executemany):
        if claiming.search(statement):
            conn.info["claiming"] = True

    @event.listens_for(engine, "rollback")
    def rolled_back(conn):
        conn.info.pop("claiming", None)

    @event.listens_for(engine, "commit")
    def committing(conn):
        nonlocal claims
        if not conn.info.pop("claiming", False):
            return
        claims += 1
        if claims == hold_at:
            print(f"holding {conn.connection.dbapi_connection.info.backend_pid}", flush=True)
            time.sleep(3600)


def main(argv: list[str]) -> None:
    import argparse
    import logging

    from airflow_delay_provider.core.pump import Pump, PumpConfig
    from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
    from airflow_delay_provider.transports.sql import SqlTableTransport

    parser = argparse.ArgumentParser()
    for name in ("store_url", "schema", "table", "transport_url"):
        parser.add_argument(name)
    parser.add_argument("batch", type=int)
    parser.add_argument("--due-before", type=datetime.fromisoformat)
    parser.add_argument("--hold-at-claim", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    schema = args.schema or None
    store = SqlDelayedMessageStore(args.store_url, table=args.table, schema=schema)
    transport = SqlTableTransport(args.transport_url, schema=schema if args.transport_url == args.store_url else None,
                                  table_prefix=f"{args.table}_")
    if args.hold_at_claim is not None:
        _hold_inside_claim(store.engine, args.table, args.hold_at_claim)
    pump = Pump(store, transport, PumpConfig(batch_size=args.batch))
    if args.due_before is None:
        result = pump.run(stop_when_idle=True)
    else:
        wait = store.wait
        told = False

        def wait_telling(until: datetime) -> None:
            nonlocal told
            if not told and store.waiting.listener is not None and not store.waiting.listener.closed:
                told = True  # this call sleeps on the LISTEN connection (the first only opens it)
                print("sleeping", flush=True)
            wait(until)

        store.wait = wait_telling
        result = pump.run(due_before=args.due_before)
    print(json.dumps({"reason": result.reason, **result.stats.summary()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
