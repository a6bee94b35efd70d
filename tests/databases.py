"""Databases of the tests' own on the shared PostgreSQL server, dropped in the background.

PostgreSQL's DROP DATABASE waits for an immediate checkpoint, which writes out every dirty buffer of the server:
with the suite's other workers writing, one took 10-100 s (pg_stat_bgwriter after two runs: 19 requested
checkpoints, 399 s writing and 161 s syncing), all of it in the teardown of the test that made the database.
Each process drops its databases in one thread of its own instead, while its next tests run; `wait_for_drops()`
(the end of its session) waits for them and reports any that was not dropped.

Plain Python (no pytest), so the deployment rig's users (the benchmarks) may import it too.
"""

from __future__ import annotations

import queue
import threading

_PENDING: queue.Queue[tuple[str, str] | None] = queue.Queue()
_FAILED: list[str] = []
_THREAD: threading.Thread | None = None
_LOCK = threading.Lock()


def admin_conninfo(server_url: str) -> str:
    """libpq's form of a SQLAlchemy URL of the server, on its `postgres` database."""
    from sqlalchemy.engine import make_url

    return make_url(server_url).set(drivername="postgresql", database="postgres").render_as_string(
        hide_password=False)


def drop(conninfo: str, name: str) -> None:
    """Drop database `name` now (its sessions ended first)."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(conninfo, autocommit=True, connect_timeout=10) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                     "AND pid <> pg_backend_pid()", (name,))
        try:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        except psycopg.errors.SyntaxError:  # PostgreSQL < 13
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))


def drop_later(conninfo: str, name: str) -> None:
    """Drop database `name` in this process's dropping thread (started at the first call)."""
    global _THREAD
    with _LOCK:
        if _THREAD is None:
            _THREAD = threading.Thread(target=_drops, name="drop-databases", daemon=True)
            _THREAD.start()
    _PENDING.put((conninfo, name))


def wait_for_drops(timeout: float = 600.0) -> list[str]:
    """Wait until every database handed to `drop_later` is dropped; returns the problems (empty when all were)."""
    global _THREAD
    with _LOCK:
        thread, _THREAD = _THREAD, None
    if thread is not None:
        _PENDING.put(None)
        thread.join(timeout)
        if thread.is_alive():
            _FAILED.append(f"the databases were not all dropped within {timeout:.0f} s")
    failed, _FAILED[:] = list(_FAILED), []
    return failed


def _drops() -> None:
    while (item := _PENDING.get()) is not None:
        conninfo, name = item
        try:
            drop(conninfo, name)
        except Exception as exc:  # noqa: BLE001 - reported at the session's end
            _FAILED.append(f"database {name} was not dropped: {type(exc).__name__}: {exc}")
