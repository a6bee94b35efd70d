"""The machine and the versions a benchmark ran on, read from the machine, the servers and the libraries,
so that a table's header is printed by the script that measured it, never typed in."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

LIBRARIES = ("apache-airflow-core", "pika", "psycopg", "SQLAlchemy", "pyspark", "boto3", "moto")
# The server settings that move the stores' figures; a header names those not at PostgreSQL's own default.
PG_SETTINGS = ("shared_buffers", "max_wal_size", "checkpoint_timeout", "wal_compression", "full_page_writes",
               "synchronous_commit", "fsync", "autovacuum", "work_mem", "effective_io_concurrency")


def _first(path: str, prefix: str) -> str | None:
    p = Path(path)
    if not p.exists():
        return None
    return next((line.split(":", 1)[1].strip() for line in p.read_text().splitlines() if line.startswith(prefix)), None)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine(pg_url: str | None = None, rabbitmq: bool = False) -> dict:
    """CPUs, RAM, Python, the PostgreSQL server's version (when `pg_url` is given), RabbitMQ's (when asked:
    through rabbitmqctl) and the installed versions of the libraries in LIBRARIES."""
    mem = _first("/proc/meminfo", "MemTotal")
    info = {"cpus": os.cpu_count(), "cpu_model": _first("/proc/cpuinfo", "model name") or platform.machine(),
            "ram_gib": round(int(mem.split()[0]) / 1024 / 1024, 1) if mem else None,
            "load_average": round(os.getloadavg()[0], 2), "python": platform.python_version(),
            "platform": platform.platform()}
    if pg_url:
        info["postgresql"], info["postgresql_settings"] = postgresql(pg_url)
    if rabbitmq:
        done = subprocess.run(["rabbitmqctl", "-q", "version"], capture_output=True, text=True, timeout=60)
        info["rabbitmq"] = done.stdout.strip() or "?"
    info["libraries"] = {name: v for name in LIBRARIES if (v := _version(name))}
    return info


def postgresql(pg_url: str) -> tuple[str, dict[str, str]]:
    """The server's version and those of PG_SETTINGS it runs with at other values than PostgreSQL's own defaults,
    read from pg_settings at run time."""
    import psycopg

    libpq = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(libpq) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
        changed = dict(conn.execute(
            "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s) AND setting <> boot_val "
            "ORDER BY name", [list(PG_SETTINGS)]).fetchall())
    return version, changed


def settings_text(changed: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "settings as shipped"


def describe(info: dict) -> str:
    """One line for a table's header."""
    parts = [f"{info['cpus']} CPUs ({info['cpu_model']}), {info['ram_gib']} GiB RAM, load average "
             f"{info['load_average']} at start", f"Python {info['python']}"]
    if "postgresql" in info:
        changed = info.get("postgresql_settings", {})
        parts.append(f"PostgreSQL {info['postgresql']} ({settings_text(changed)})")
    if "rabbitmq" in info:
        parts.append(f"RabbitMQ {info['rabbitmq']}")
    parts.append(", ".join(f"{k} {v}" for k, v in info["libraries"].items()))
    return "; ".join(parts)
