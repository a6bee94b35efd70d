"""Fault injection: what reaches the consumers when pumps are killed, connections cut and relays die mid-cycle.

The scenarios of tests/faults (the same code), without pytest, on a schema, a vhost and a moto server of
this run's own, all removed afterwards:

- store -> RabbitMQ: 20,000 messages in PostgreSQL, 30% due at once, the rest over 12 s; two pump processes
  reach the store and the broker through TCP proxies. While they dispatch: SIGKILL a pump 3 times (it is
  started again), cut every RabbitMQ connection 4 times and every PostgreSQL connection 4 times (once each
  followed by 1.5 s of refused connections), pg_terminate_backend the pumps' backends twice.
- store -> SQL table in the same database: the same kills and terminations, 5 PostgreSQL cuts, no broker.
- SQS (moto): 200 messages, 10% due at once, the rest delayed 4-9 s through the -delay.fifo relay (1 s per
  cycle); the relay process is killed 4 times, 3 of them between handing a receive on and deleting it.

Prints a markdown table (for docs/benchmarks/faults.md) and the machine and versions.

    python bench/bench_faults.py
    python bench/bench_faults.py --messages 50000 --json bench/results/faults.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faults.scenarios import (  # noqa: E402
    PG_URL,
    ServiceUnavailable,
    check_postgres,
    check_rabbitmq,
    markdown_table,
    pump_faults,
    sqs_relay_faults,
)
from tests.services import MotoServer  # noqa: E402


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rabbitmqctl(*args: str) -> str:
    return subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, text=True, timeout=60).stdout


def versions(pg_url: str) -> dict:
    import moto
    import pika
    import psycopg
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.connect() as conn:
        pg = conn.exec_driver_sql("SHOW server_version").scalar()
    engine.dispose()
    rabbit = rabbitmqctl("version").strip()
    return {"postgresql": pg, "rabbitmq": rabbit, "moto": moto.__version__, "psycopg": psycopg.__version__,
            "pika": pika.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg-url", default=PG_URL)
    parser.add_argument("--messages", type=int, default=20_000, help="messages of each pump scenario")
    parser.add_argument("--sqs-messages", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None, help="also write the counts here")
    parser.add_argument("--verbose", action="store_true", help="log each fault as it is injected")
    args = parser.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        check_postgres(args.pg_url)
        check_rabbitmq()
    except ServiceUnavailable as exc:
        sys.exit(str(exc))

    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    schema = f"adp_bench_{uuid.uuid4().hex[:8]}"
    vhost = f"adp_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(args.pg_url, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    rabbitmqctl("add_vhost", vhost)
    rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    results = []
    try:
        log(f"store -> RabbitMQ, two pumps, {args.messages:,} messages, under faults")
        results.append(pump_faults("rabbitmq", schema, vhost, pg_url=args.pg_url, messages=args.messages))
        log(results[-1].summary())
        log(f"store -> SQL table in the same database, two pumps, {args.messages:,} messages, under faults")
        results.append(pump_faults("sql", schema, pg_url=args.pg_url, messages=args.messages))
        log(results[-1].summary())
        log(f"SQS relay (moto) killed mid-cycle, {args.sqs_messages} messages")
        with MotoServer() as moto:
            results.append(sqs_relay_faults(moto.url, messages=args.sqs_messages))
        log(results[-1].summary())
        found = versions(args.pg_url)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
        rabbitmqctl("delete_vhost", vhost)

    print(f"\nFault injection: PostgreSQL {found['postgresql']}, RabbitMQ {found['rabbitmq']} (quorum queues, "
          f"publisher confirms), moto {found['moto']}; psycopg {found['psycopg']}, pika {found['pika']}; "
          f"Python {platform.python_version()}, {os.cpu_count()} cores, {platform.platform()}\n")
    print(markdown_table(results))
    problems = [f"{r.scenario}: {e}" for r in results for e in r.errors]
    problems += [f"{r.scenario}: {r.lost} lost, {r.early} early" for r in results if r.lost or r.early]
    problems += [f"{r.scenario}: {r.duplicates} duplicates > {r.duplicate_bound}" for r in results
                 if r.duplicates > r.duplicate_bound]
    if problems:
        print("\nPROBLEMS:\n" + "\n".join(problems))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": [r.as_dict() for r in results], "versions": found,
                                         "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                     "platform": platform.platform()}}, indent=2, default=str))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
