"""A real Airflow 3.3 deployment on this machine, as a user would run it, for tests and benchmarks.

The api-server, scheduler, dag-processor and triggerer run as separate processes (``airflow api-server`` ...),
LocalExecutor, each with its own ``AIRFLOW_HOME`` (and ``TMPDIR``) under ``workdir`` as containers would have,
sharing only what a real deployment shares: the dags folder, a PostgreSQL metadata database created for the
run (dropped by ``stop()``), the secrets (fernet key, JWT secret, API secret key) and the simple auth manager's
passwords file. Each component's environment is built from scratch (a few OS variables, the rig's settings,
the caller's ``connections`` and ``env``): the calling process's own ``AIRFLOW__*`` variables never leak in.

    from tests.deployment.rig import Deployment

    with Deployment(workdir, dags_folder, connections={"delay_store_default": {...}}) as d:
        d.unpause("my_dag")
        run_id = d.trigger("my_dag", conf={"x": 1})
        assert d.wait_run("my_dag", run_id, timeout=120) == "success"
        print(d.xcom("my_dag", run_id, "my_task"))

Plain Python (no pytest) so that bench scripts can import it as ``tests.deployment.rig`` from the repo root.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests import waiting
from tests.databases import admin_conninfo, drop, drop_later

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
#: The PostgreSQL server (no database in the URL): every run gets a database of its own there.
PG_SERVER_URL = os.environ.get("DELAY_TEST_PG_SERVER", "postgresql+psycopg://postgres@127.0.0.1:5432")
PG_START_HINT = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
#: user -> role of the simple auth manager (roles: viewer, user, op, admin).
DEFAULT_USERS = {"admin": "admin", "viewer": "viewer"}
#: The only variables of the calling process a component sees (besides what the rig and the caller set).
_OS_PASSTHROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "USER", "LOGNAME")
_FINISHED_RUN_STATES = ("success", "failed")
_HEALTH_KEYS = {"scheduler": "scheduler", "triggerer": "triggerer", "dag-processor": "dag_processor"}

#: Run by a process of its own (own session) per deployment: when the process that started the deployment dies
#: without stop() (SIGKILL, a killed job, a crash), it TERMs then KILLs every process of the deployment (found
#: by their working directory, under the rig's workdir) and drops the database. stop() ends it normally.
_WATCHDOG = r"""
import json, os, signal, sys, time
parent, state_file = int(sys.argv[1]), sys.argv[2]
signal.signal(signal.SIGINT, signal.SIG_IGN)
while os.getppid() == parent:
    time.sleep(0.5)
state = json.load(open(state_file))
root = state["workdir"]

def ours():
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            if cwd == root or cwd.startswith(root + os.sep):
                found.append(int(pid))
    return found

print(time.strftime("%H:%M:%S"), "parent", parent, "gone: tearing the deployment down", flush=True)
for pid in ours():
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        pass
deadline = time.monotonic() + 15
while ours() and time.monotonic() < deadline:
    time.sleep(0.3)
for pid in ours():
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
try:
    import psycopg
    from psycopg import sql
    with psycopg.connect(state["pg_conninfo"], autocommit=True, connect_timeout=10) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                     "AND pid <> pg_backend_pid()", (state["db"],))
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(state["db"])))
    print(time.strftime("%H:%M:%S"), "dropped database", state["db"], flush=True)
except Exception as exc:
    print(time.strftime("%H:%M:%S"), "could not drop", state["db"], repr(exc), flush=True)
"""


def _airflow_bin() -> Path:
    for candidate in (Path(sys.prefix) / "bin" / "airflow", Path(sys.executable).parent / "airflow",
                      ROOT / ".venv" / "bin" / "airflow"):
        if candidate.exists():
            return candidate
    raise FileNotFoundError("no `airflow` executable next to this Python nor in .venv/bin")


class DeploymentError(RuntimeError):
    """A component died, timed out or misbehaved; the message carries the tails of the component logs."""


class RestError(RuntimeError):
    """An HTTP error answer of the REST API."""

    def __init__(self, method: str, path: str, status: int, body: str, server_log: str = ""):
        detail = f"\n----- the api-server's log meanwhile -----\n{server_log}" if server_log else ""
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:2000]}{detail}")
        self.method, self.path, self.status, self.body = method, path, status, body
        self.server_log = server_log


# Airflow 3.2-3.3.2 answers 500 on an asset's events while a run an event created is queued and not yet started
# (the response model requires the run's start_date: apache/airflow#71360, fixed upstream by #71379).
_QUEUED_RUN_BUG = re.compile(r"created_dagruns\.\d+\.start_date")


@dataclass(frozen=True)
class TaskTimes:
    """When a task instance was scheduled, queued, started and ended (UTC, from the REST API)."""

    state: str | None
    try_number: int
    scheduled: datetime | None
    queued: datetime | None
    start: datetime | None
    end: datetime | None
    duration: float | None


def utcnow() -> datetime:
    return datetime.now(UTC)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    """tests.waiting.wait_for at the pace a deployment's REST API and database are read at."""
    return waiting.wait_for(predicate, timeout, what, interval=poll)


def parse_time(value: str | None) -> datetime | None:
    """An ISO timestamp of the REST API as an aware datetime (None stays None)."""
    if not value:
        return None
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_problem(server_url: str = PG_SERVER_URL) -> str | None:
    """None when the PostgreSQL server answers; otherwise a message saying how to start it."""
    import psycopg

    try:
        with psycopg.connect(admin_conninfo(server_url), autocommit=True, connect_timeout=5) as conn:
            conn.execute("select 1")
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable"
        return (f"PostgreSQL is not reachable at {server_url.split('@')[-1]} ({type(exc).__name__}: {exc}). "
                f"The deployment rig needs the real server (trust auth, user postgres): start it with "
                f"`{PG_START_HINT}`, or point DELAY_TEST_PG_SERVER at another one.")
    return None


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 200 * lines - 4096))
            data = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no log file)"
    return "\n".join(data.splitlines()[-lines:])


def _might_contain_dag(path: Path) -> bool:
    """Airflow's default heuristic (safe mode): the file mentions both `airflow` and `dag`."""
    try:
        text = path.read_bytes().lower()
    except OSError:
        return False
    return b"airflow" in text and b"dag" in text


class Deployment:
    """A real deployment; see the module docstring.

    :param workdir: where the components' homes (``workdir/<component>``), the CLI's home (``workdir/cli``) and
        the shared secrets (``workdir/secrets``) go.
    :param dags_folder: the dags folder every component sees (as a mounted volume would be).
    :param env: extra environment of every component, applied last (e.g. ``AIRFLOW__CORE__PARALLELISM``).
    :param connections: ``{conn_id: dict | str}`` given to every component as ``AIRFLOW_CONN_<ID>`` (a dict is
        sent as JSON, a string as is: JSON or URI).
    :param users: ``{username: role}`` of the simple auth manager; the rig generates the passwords.
    :param expected_dags: DAG ids that must be parsed before ``start()`` returns; by default every file of the
        dags folder that might contain a DAG must have given a DAG or an import error.
    :param component_env: ``{component: {name: value}}``, applied after ``env`` and ``connections`` to that
        component only (e.g. the triggerer reaching the store through a proxy that cuts its connections).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        dags_folder: str | os.PathLike,
        env: Mapping[str, str] | None = None,
        connections: Mapping[str, Any] | None = None,
        *,
        users: Mapping[str, str] | None = None,
        expected_dags: Iterable[str] | None = None,
        component_env: Mapping[str, Mapping[str, str]] | None = None,
        pg_server_url: str = PG_SERVER_URL,
        port: int | None = None,
        start_timeout: float = 240.0,
        stop_grace: float = 20.0,
        drop_in_background: bool = False,
    ):
        self.workdir = Path(workdir).resolve()
        self.dags_folder = Path(dags_folder).resolve()
        self.extra_env = {k: str(v) for k, v in (env or {}).items()}
        self.connections = dict(connections or {})
        self.users = dict(users or DEFAULT_USERS)
        self.expected_dags = set(expected_dags) if expected_dags is not None else None
        unknown = set(component_env or {}) - {*COMPONENTS, "cli"}
        if unknown:
            raise ValueError(f"component_env names unknown components {sorted(unknown)}; known: {COMPONENTS}, cli")
        self.component_env = {c: {k: str(v) for k, v in e.items()} for c, e in (component_env or {}).items()}
        self.pg_server_url = pg_server_url
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.drop_in_background = drop_in_background
        self.airflow = _airflow_bin()
        self.name = f"{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:8]}"
        self.db_name = f"adp_rig_{self.name}"
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.homes = {c: self.workdir / c for c in (*COMPONENTS, "cli")}
        self.passwords_file = self.workdir / "secrets" / "simple_auth_manager_passwords.json"
        self.passwords = {user: secrets.token_urlsafe(12) for user in self.users}
        # What every component must share, or they will not trust each other (each home would generate its own):
        # [core] fernet_key (connections/variables stored encrypted), [api_auth] jwt_secret (the scheduler's
        # task tokens checked by the api-server's execution API, REST tokens), [api] secret_key (the api-server
        # fetching task logs from the scheduler's and the triggerer's log servers).
        self.secrets = {
            "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(64),  # HS512 wants >= 64 bytes
            "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
        }
        self._log_ports = {"worker": free_port(), "trigger": free_port()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.started_at: dict[str, datetime] = {}
        #: seconds each start-up phase took (create_db, migrate, api_up, components_healthy, dags_parsed, total)
        self.timings: dict[str, float] = {}
        self._tokens: dict[str, str] = {}
        self._client: httpx.Client | None = None
        self._db_created = False
        self._running = False
        self._watchdog: subprocess.Popen | None = None

    # ------------------------------------------------------------------ environment
    @property
    def sql_alchemy_conn(self) -> str:
        return f"{self.pg_server_url.rstrip('/')}/{self.db_name}"

    def env(self, component: str) -> dict[str, str]:
        """The full environment of a component (or of ``cli``): built from scratch, not from os.environ."""
        home = self.homes[component]
        env = {k: os.environ[k] for k in _OS_PASSTHROUGH if k in os.environ}
        env["PATH"] = str(self.airflow.parent) + os.pathsep + env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        env.update(
            {
                "AIRFLOW_HOME": str(home),
                "TMPDIR": str(home / "tmp"),  # dag bundles etc. default to the temp dir: keep it per container
                "PYTHONUNBUFFERED": "1",
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__PARALLELISM": "4",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
                "AIRFLOW__CORE__AUTH_MANAGER":
                    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{u}:{r}" for u, r in self.users.items()),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.passwords_file),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.sql_alchemy_conn,
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": self.sql_alchemy_conn,
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__API__BASE_URL": self.base_url,
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                # Free ports: other Airflows on this machine (tests, standalone) use the default 8793/8794.
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(self._log_ports["worker"]),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(self._log_ports["trigger"]),
                "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False",
                **self.secrets,
            }
        )
        for conn_id, value in self.connections.items():
            env[f"AIRFLOW_CONN_{conn_id.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        env.update(self.extra_env)
        env.update(self.component_env.get(component, {}))
        return env

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Deployment:
        """Create the database, migrate it, start the four components and wait until the api-server answers,
        every component is healthy and the DAGs are parsed. Raises DeploymentError (and cleans up) otherwise."""
        t0 = time.monotonic()
        deadline = t0 + self.start_timeout
        problem = postgres_problem(self.pg_server_url)
        if problem:
            raise DeploymentError(problem)
        for home in self.homes.values():
            (home / "tmp").mkdir(parents=True, exist_ok=True)
        self.passwords_file.parent.mkdir(parents=True, exist_ok=True)
        self.passwords_file.write_text(json.dumps(self.passwords) + "\n")
        self.passwords_file.chmod(0o600)
        self._running = True
        atexit.register(self.stop)
        try:
            self._start_watchdog()
            self._create_database()
            self.timings["create_db"] = time.monotonic() - t0
            t = time.monotonic()
            with open(self.log_path("cli"), "ab") as log:
                migrate = subprocess.run([str(self.airflow), "db", "migrate"], env=self.env("cli"),
                                         cwd=self.homes["cli"], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, timeout=max(30.0, deadline - time.monotonic()))
            if migrate.returncode != 0:
                raise DeploymentError(f"`airflow db migrate` failed ({migrate.returncode}):\n"
                                      + _tail(self.log_path("cli"), 60))
            self.timings["migrate"] = time.monotonic() - t
            t = time.monotonic()
            for component in COMPONENTS:
                self._spawn(component)
            self._wait(lambda: self.health() is not None, deadline, "the api-server to answer")
            self.timings["api_up"] = time.monotonic() - t
            self._wait(lambda: all(self._healthy(c) for c in _HEALTH_KEYS), deadline,
                       "the scheduler, triggerer and dag-processor to be healthy")
            self.timings["components_healthy"] = time.monotonic() - t
            self._wait(lambda: not self.unparsed(), deadline, "the dag-processor to parse the DAGs",
                       detail=lambda: f"not parsed yet: {sorted(self.unparsed())}")
            self.timings["dags_parsed"] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """TERM every component's process group, KILL what is left after the grace period, drop the database.
        Idempotent."""
        if not self._running:
            return
        self._running = False
        try:
            self._terminate(list(self.procs), self.stop_grace)
        finally:
            if self._client is not None:
                self._client.close()
                self._client = None
            self._drop_database()
            if self._watchdog is not None:
                self._watchdog.terminate()
                self._watchdog.wait(10)
                self._watchdog = None
            atexit.unregister(self.stop)

    def _start_watchdog(self) -> None:
        state_file = self.workdir / "watchdog.json"
        state_file.write_text(json.dumps({"workdir": str(self.workdir), "db": self.db_name,
                                          "pg_conninfo": admin_conninfo(self.pg_server_url)}))
        with open(self.workdir / "watchdog.log", "ab") as log:
            self._watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(state_file)],
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True, cwd="/")

    def _spawn(self, component: str) -> None:
        home = self.homes[component]
        cmd = [str(self.airflow), component]
        if component == "api-server":
            cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path(component), "ab") as log:
            log.write(f"\n===== rig: starting {component} at {utcnow().isoformat()} =====\n".encode())
            log.flush()
            self.procs[component] = subprocess.Popen(
                cmd, env=self.env(component), cwd=home, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.started_at[component] = utcnow()

    def _tree(self, pid: int) -> list[psutil.Process]:
        try:
            parent = psutil.Process(pid)
            return [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _terminate(self, components: list[str], grace: float, sig: int = signal.SIGTERM) -> None:
        """Signal the process groups of ``components``, wait up to ``grace`` s, then SIGKILL the groups and any
        descendant that left its group."""
        tracked: dict[int, psutil.Process] = {}
        for c in components:
            proc = self.procs.get(c)
            if proc is None or proc.poll() is not None:
                continue
            tracked.update({p.pid: p for p in self._tree(proc.pid)})
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for c in components:
                proc = self.procs.get(c)
                if proc is not None and proc.poll() is None:
                    tracked.update({p.pid: p for p in self._tree(proc.pid)})
            alive = [p for p in tracked.values() if _alive(p)]
            if not alive:
                break
            time.sleep(0.2)
        for c in components:
            proc = self.procs.get(c)
            if proc is None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for p in tracked.values():
            if _alive(p):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        psutil.wait_procs(list(tracked.values()), timeout=10)
        for c in components:
            proc = self.procs.get(c)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)

    def kill(self, component: str, sig: int = signal.SIGKILL, grace: float | None = None) -> None:
        """Send ``sig`` to the component's whole process group (as a container runtime would). For SIGKILL,
        SIGTERM and SIGINT, wait until it is gone (SIGKILL after ``grace`` s, by default the stop grace)."""
        proc = self.procs[component]
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            self._terminate([component], 0.0 if sig == signal.SIGKILL else (grace or self.stop_grace), sig)
        else:
            os.killpg(proc.pid, sig)

    def restart(self, component: str, wait: bool = True, timeout: float = 120.0,
                env: Mapping[str, str] | None = None) -> float:
        """Stop the component if it still runs, start it again with the same home and environment (``env``
        changed, for this and later starts) and (with ``wait``) wait until it is healthy again (a heartbeat after
        the restart; the api-server: answering). Returns the seconds it took."""
        t0 = time.monotonic()
        self.component_env.setdefault(component, {}).update({k: str(v) for k, v in (env or {}).items()})
        if self.is_running(component):
            self.kill(component, signal.SIGTERM)
        self._spawn(component)
        if wait:
            since = self.started_at[component]
            if component == "api-server":
                self._wait(lambda: self.health() is not None, t0 + timeout, "the api-server to answer")
            else:
                self._wait(lambda: self._healthy(component, since), t0 + timeout, f"{component} to be healthy")
        return time.monotonic() - t0

    def is_running(self, component: str) -> bool:
        proc = self.procs.get(component)
        return proc is not None and proc.poll() is None

    def pid(self, component: str) -> int:
        return self.procs[component].pid

    def cpu_seconds(self, component: str) -> float:
        """The CPU time the component's process and its children (running or ended) have used so far."""
        total = 0.0
        for p in self._tree(self.pid(component)):
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
        return total

    def status(self) -> dict[str, str]:
        return {c: ("running" if p.poll() is None else f"exited {p.returncode}") for c, p in self.procs.items()}

    def _check_alive(self) -> None:
        dead = {c: p.returncode for c, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise DeploymentError(f"components exited: {dead}\n{self.logs_tail()}")

    def _wait(self, ready, deadline: float, what: str, detail=None, poll: float = 1.0) -> None:
        while True:
            self._check_alive()
            try:
                if ready():
                    return
            except (httpx.TransportError, RestError):
                pass
            if time.monotonic() > deadline:
                extra = f" ({detail()})" if detail else ""
                raise DeploymentError(f"timed out waiting for {what}{extra}; status {self.status()}\n"
                                      f"{self.logs_tail()}")
            time.sleep(poll)

    # ------------------------------------------------------------------ database
    def _create_database(self) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(admin_conninfo(self.pg_server_url), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.db_name)))
        self._db_created = True

    def _drop_database(self) -> None:
        if not self._db_created:
            return
        # The drop waits for a checkpoint (tests/databases.py): a test suite hands it to its dropping thread.
        (drop_later if self.drop_in_background else drop)(admin_conninfo(self.pg_server_url), self.db_name)
        self._db_created = False

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this deployment still alive (none after stop())."""
        return [p for p in airflow_processes(self.workdir) if _alive(p)]

    # ------------------------------------------------------------------ logs
    def log_path(self, component: str) -> Path:
        """The component's stdout+stderr (``<home>/<component>.log``; ``cli`` for db migrate and CLI calls)."""
        return self.homes[component] / f"{component}.log"

    def log_tail(self, component: str, lines: int = 40) -> str:
        return _tail(self.log_path(component), lines)

    def logs_tail(self, lines: int = 25, components: Iterable[str] = COMPONENTS) -> str:
        return "\n".join(f"----- {c} ({self.log_path(c)}) -----\n{self.log_tail(c, lines)}" for c in components)

    def log_since(self, component: str, offset: int, limit: int = 8000) -> str:
        """What the component logged after byte ``offset`` (its last ``limit`` characters)."""
        try:
            with open(self.log_path(component), "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")[-limit:]
        except FileNotFoundError:
            return ""

    def log_size(self, component: str) -> int:
        try:
            return self.log_path(component).stat().st_size
        except FileNotFoundError:
            return 0

    def wait_log(self, component: str, pattern: str, timeout: float = 60.0, since: int = 0) -> str:
        """Wait until the regex ``pattern`` appears in the component's log after byte offset ``since``
        (e.g. ``log_size()`` taken before an action); returns the matching line."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log_path(component), "rb") as f:
                f.seek(since)
                for line in f.read().decode("utf-8", "replace").splitlines():
                    if regex.search(line):
                        return line
            if time.monotonic() > deadline:
                raise DeploymentError(f"{pattern!r} did not appear in the {component} log within {timeout} s\n"
                                      + self.log_tail(component))
            time.sleep(0.5)

    # ------------------------------------------------------------------ CLI (own home, like `compose run`)
    def cli(self, *args: str, timeout: float = 180.0, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([str(self.airflow), *args], env=self.env("cli"), cwd=self.homes["cli"],
                                capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        with open(self.log_path("cli"), "a") as log:
            log.write(f"\n===== rig: airflow {' '.join(args)} -> {result.returncode}\n{result.stdout}{result.stderr}")
        if check and result.returncode != 0:
            raise DeploymentError(f"airflow {' '.join(args)} failed ({result.returncode}):\n"
                                  f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    # ------------------------------------------------------------------ REST
    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.base_url, timeout=30.0)
        return self._client

    def token(self, user: str = "admin") -> str:
        """A JWT of the simple auth manager for ``user`` (POST /auth/token with its password); cached."""
        if user not in self._tokens:
            body = {"username": user, "password": self.passwords[user]}
            r = self._send("POST", "/auth/token", json=body)
            if r.status_code not in (200, 201):
                raise RestError("POST", "/auth/token", r.status_code, r.text)
            self._tokens[user] = r.json()["access_token"]
        return self._tokens[user]

    def _send(self, method: str, path: str, retries: int = 5, **kwargs) -> httpx.Response:
        """One request; retried when it could not have reached the server (or was an idempotent GET that timed
        out): the api-server shares 2 cores with the rest of Airflow."""
        for attempt in range(retries + 1):
            try:
                return self.client.request(method, path, **kwargs)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadTimeout) as exc:
                idempotent = method in ("GET", "HEAD") or isinstance(exc, httpx.ConnectError)
                if attempt == retries or not idempotent:
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def request(self, method: str, path: str, *, user: str | None = "admin", **kwargs) -> httpx.Response:
        """A raw REST call (``path`` like ``/api/v2/dags``) with ``user``'s token (None: no token)."""
        headers = dict(kwargs.pop("headers", None) or {})
        if user is not None:
            headers["Authorization"] = f"Bearer {self.token(user)}"
        return self._send(method, path, headers=headers, **kwargs)

    def api(self, method: str, path: str, *, user: str | None = "admin", **kwargs) -> Any:
        """A REST call returning the decoded JSON; raises RestError on an HTTP error."""
        log_from = self.log_size("api-server")
        r = self.request(method, path, user=user, **kwargs)
        if r.status_code >= 400:
            server_log = self.log_since("api-server", log_from) if r.status_code >= 500 else ""
            raise RestError(method, path, r.status_code, r.text, server_log)
        return r.json() if r.content else None

    def health(self) -> dict | None:
        """GET /api/v2/monitor/health (no login), or None while the api-server does not answer."""
        try:
            r = self.client.get("/api/v2/monitor/health", timeout=10)
        except httpx.TransportError:
            return None
        return r.json() if r.status_code == 200 else None

    def _healthy(self, component: str, since: datetime | None = None) -> bool:
        health = self.health() or {}
        info = health.get(_HEALTH_KEYS[component]) or {}
        if info.get("status") != "healthy":
            return False
        if since is None:
            return True
        beat = parse_time(info.get(f"latest_{_HEALTH_KEYS[component]}_heartbeat"))
        return beat is not None and beat >= since

    def _paginate(self, path: str, key: str, params: Mapping[str, Any] | None = None, user: str = "admin") -> list:
        items: list = []
        offset = 0
        while True:
            page = self.api("GET", path, user=user, params={**(params or {}), "limit": 100, "offset": offset})
            batch = list(page[key])
            items += batch
            offset += len(batch)
            total = page.get("total_entries")
            if not batch or len(batch) < 100 or (total is not None and offset >= total):
                return items

    def dags(self) -> list[dict]:
        return self._paginate("/api/v2/dags", "dags")

    def asset_events(self, asset_name: str) -> list[dict]:
        """The events recorded for the asset named ``asset_name`` (each with its ``extra``), oldest first."""
        def answered() -> tuple[list[dict]] | None:
            try:
                return (self._paginate("/api/v2/assets/events", "asset_events", {"name_pattern": asset_name}),)
            except RestError as exc:
                if exc.status == 500 and _QUEUED_RUN_BUG.search(exc.server_log):
                    return None  # asked again once the queued run has started
                raise

        (events,) = wait_for(answered, 120, f"the api-server to list the events of {asset_name} (#71360)")
        return sorted((e for e in events if e.get("name") == asset_name), key=lambda e: e["timestamp"])

    def dag(self, dag_id: str) -> dict:
        return self.api("GET", f"/api/v2/dags/{dag_id}")

    def import_errors(self) -> list[dict]:
        """Import errors of the dags folder: ``[{"filename", "stack_trace", "bundle_name", ...}]``."""
        return self._paginate("/api/v2/importErrors", "import_errors")

    def unparsed(self) -> set[str]:
        """Expected DAG ids not parsed yet, or (without expected_dags) files of the dags folder that gave neither
        a DAG nor an import error yet."""
        dags = self.dags()
        if self.expected_dags is not None:
            return self.expected_dags - {d["dag_id"] for d in dags}
        files = {str(p.relative_to(self.dags_folder)) for p in self.dags_folder.rglob("*.py") if _might_contain_dag(p)}
        seen = {self._relative(d.get("relative_fileloc") or d.get("fileloc")) for d in dags}
        seen |= {self._relative(e.get("filename")) for e in self.import_errors()}
        return files - seen

    def _relative(self, path: str | None) -> str | None:
        if not path:
            return None
        p = Path(path)
        if p.is_absolute():
            try:
                return str(p.relative_to(self.dags_folder))
            except ValueError:
                return str(p)
        return str(p)

    def wait_dags(self, dag_ids: Iterable[str], timeout: float = 120.0) -> None:
        """Wait until the dag-processor has parsed these DAGs (e.g. after writing a new file)."""
        wanted = set(dag_ids)
        self._wait(lambda: wanted <= {d["dag_id"] for d in self.dags()}, time.monotonic() + timeout,
                   f"DAGs {sorted(wanted)} to be parsed", detail=lambda: f"import errors: {self.import_errors()}")

    def add_connection(self, conn_id: str, value: Mapping[str, Any], user: str = "admin") -> dict:
        """Define a connection in the metadata database through the REST API, as a user does in the UI (the
        ``connections`` given at start are environment variables instead); ``value`` as ``connections`` takes it."""
        body = {"connection_id": conn_id, **{k: v for k, v in value.items() if k != "extra"}}
        if "extra" in value:
            body["extra"] = json.dumps(value["extra"])
        return self.api("POST", "/api/v2/connections", user=user, json=body)

    def set_paused(self, dag_id: str, paused: bool, user: str = "admin") -> dict:
        return self.api("PATCH", f"/api/v2/dags/{dag_id}", user=user, json={"is_paused": paused})

    def unpause(self, dag_id: str, user: str = "admin") -> dict:
        return self.set_paused(dag_id, False, user)

    def pause(self, dag_id: str, user: str = "admin") -> dict:
        return self.set_paused(dag_id, True, user)

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None, *, user: str = "admin",
                logical_date: datetime | str | None = None, run_id: str | None = None) -> str:
        """POST /api/v2/dags/{dag_id}/dagRuns (``logical_date`` null by default); returns the run id. An HTTP
        error (403 for a viewer, 400 for invalid params, 404 for an unknown DAG) raises RestError."""
        if isinstance(logical_date, datetime):
            logical_date = logical_date.isoformat()
        body: dict[str, Any] = {"logical_date": logical_date, "conf": dict(conf or {})}
        if run_id:
            body["dag_run_id"] = run_id
        return self.api("POST", f"/api/v2/dags/{dag_id}/dagRuns", user=user, json=body)["dag_run_id"]

    def dag_run(self, dag_id: str, run_id: str) -> dict:
        return self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")

    def dag_runs(self, dag_id: str, **params: Any) -> list[dict]:
        """The DAG's runs (filters as query parameters, e.g. ``run_type="backfill"``, ``state="success"``)."""
        return self._paginate(f"/api/v2/dags/{dag_id}/dagRuns", "dag_runs", params)

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        return self._paginate(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances", "task_instances")

    def task_instance(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict:
        path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"
        return self.api("GET", path + (f"/{map_index}" if map_index >= 0 else ""))

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        return {(ti["task_id"] if ti["map_index"] < 0 else f"{ti['task_id']}[{ti['map_index']}]"): ti["state"]
                for ti in self.task_instances(dag_id, run_id)}

    def task_times(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> TaskTimes:
        """When the task instance (its current try) was scheduled, queued, started and ended. A deferred task
        keeps its try number and start date when it resumes: its end date is after the resume."""
        ti = self.task_instance(dag_id, run_id, task_id, map_index)
        return TaskTimes(state=ti["state"], try_number=ti["try_number"], scheduled=parse_time(ti.get("scheduled_when")),
                         queued=parse_time(ti.get("queued_when")), start=parse_time(ti.get("start_date")),
                         end=parse_time(ti.get("end_date")), duration=ti.get("duration"))

    def trigger_fired_at(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1,
                         map_index: int = -1) -> datetime | None:
        """When the triggerer fired the task's trigger ("Trigger fired event"), read from the trigger log in the
        triggerer's home (``logs/dag_id=.../attempt=N.log.trigger.<triggerer job id>.log``, JSON lines; with
        several triggerer jobs, e.g. after a restart, the latest firing); None if it did not fire."""
        folder = self.homes["triggerer"] / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        if map_index >= 0:
            folder /= f"map_index={map_index}"
        fired = []
        for path in folder.glob(f"attempt={try_number}.log.trigger.*.log"):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("event") == "Trigger fired event":
                    fired.append(parse_time(entry.get("timestamp")))
        return max(fired) if fired else None

    def wait_task(self, dag_id: str, run_id: str, task_id: str, states: Iterable[str] = ("success",),
                  timeout: float = 120.0, map_index: int = -1, poll: float = 0.5) -> dict:
        """Wait until the task instance is in one of ``states`` (e.g. ``("deferred",)``); returns it."""
        wanted = set(states)
        found: dict = {}

        def ready() -> bool:
            found.update(self.task_instance(dag_id, run_id, task_id, map_index))
            return found.get("state") in wanted

        self._wait(ready, time.monotonic() + timeout, f"{dag_id}/{run_id}/{task_id} to be in {sorted(wanted)}",
                   detail=lambda: f"state {found.get('state')}; tasks {self._safe_states(dag_id, run_id)}", poll=poll)
        return found

    def wait_trigger_assigned(self, dag_id: str, run_id: str, task_id: str, timeout: float = 60.0,
                              map_index: int = -1) -> int:
        """Wait until the deferred task's trigger is assigned to a triggerer (a task can be ``deferred`` for a
        while before a triggerer picks its trigger up); returns the triggerer's job id."""
        found: dict = {}

        def assigned() -> bool:
            ti = self.task_instance(dag_id, run_id, task_id, map_index)
            found.update(ti)
            return ti.get("state") == "deferred" and (ti.get("trigger") or {}).get("triggerer_id") is not None

        self._wait(assigned, time.monotonic() + timeout, f"the trigger of {dag_id}/{run_id}/{task_id} to be assigned",
                   detail=lambda: f"state {found.get('state')}, trigger {found.get('trigger')}", poll=0.3)
        return found["trigger"]["triggerer_id"]

    def wait_trigger_completed(self, dag_id: str, run_id: str, task_id: str, try_number: int,
                               timeout: float = 60.0) -> None:
        """Wait until the triggerer has ended the task's trigger ("trigger completed" in the trigger's log): after a
        run is ended by hand, the triggerer cancels its triggers only seconds later, and until then they run on."""
        folder = self.homes["triggerer"] / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"

        def completed() -> bool:
            return any('"trigger completed"' in p.read_text(errors="replace")
                       for p in folder.glob(f"attempt={try_number}.log.trigger.*.log"))

        self._wait(completed, time.monotonic() + timeout, f"the trigger of {dag_id}/{run_id}/{task_id} to end",
                   detail=lambda: self.log_tail("triggerer"), poll=0.3)

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 180.0, poll: float = 1.0) -> str:
        """Wait until the run has finished; returns its state (success/failed). On time-out raises
        DeploymentError with the run's task instance states and the tails of the component logs."""
        deadline = time.monotonic() + timeout
        state = None
        while True:
            try:
                state = self.dag_run(dag_id, run_id)["state"]
                if state in _FINISHED_RUN_STATES:
                    return state
            except (httpx.TransportError, RestError):
                pass
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"run {dag_id}/{run_id} still {state} after {timeout} s; task instances "
                    f"{self._safe_states(dag_id, run_id)}; components {self.status()}\n{self.logs_tail()}")
            time.sleep(poll)

    def assert_success(self, dag_id: str, run_id: str, timeout: float = 180.0) -> dict:
        """wait_run, and unless the run succeeded raise DeploymentError with its task states, the scheduler's error
        lines about the DAG (e.g. a "state mismatch") and the tails of the component logs; returns the run."""
        state = self.wait_run(dag_id, run_id, timeout)
        if state == "success":
            return self.dag_run(dag_id, run_id)
        errors = [line for line in _tail(self.log_path("scheduler"), 3000).splitlines()
                  if dag_id in line and ("[error" in line or "FAILED" in line or "state mismatch" in line)]
        raise DeploymentError(f"run {dag_id}/{run_id} ended {state}; task instances "
                              f"{self._safe_states(dag_id, run_id)}\nscheduler errors:\n" + "\n".join(errors[-10:])
                              + f"\n{self.logs_tail()}")

    def _safe_states(self, dag_id: str, run_id: str) -> Any:
        try:
            return self.task_states(dag_id, run_id)
        except Exception as exc:  # noqa: BLE001 - only for an error message
            return f"({type(exc).__name__}: {exc})"

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value", map_index: int = -1) -> Any:
        """An XCom value (by default the task's return value) read through the REST API."""
        path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}"
        value = self.api("GET", path, params={"map_index": map_index})["value"]
        if isinstance(value, str):  # stored JSON comes back as a JSON string
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1, map_index: int = -1) -> str:
        """A task's log as the UI shows it: the api-server fetches it from the scheduler's (worker's) log server,
        or the triggerer's while the task is deferred."""
        path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}"
        body = self.api("GET", path, params={"full_content": "true", "map_index": map_index},
                        headers={"Accept": "application/json"})
        content = body.get("content")
        if isinstance(content, list):
            lines = []
            for entry in content:
                if isinstance(entry, dict):
                    lines.append(" ".join(str(entry.get(k)) for k in ("timestamp", "level", "event")
                                          if entry.get(k) is not None))
                    # A failed task's exception is structured beside its "Task failed" line.
                    for error in entry.get("error_detail") or []:
                        if isinstance(error, dict):
                            lines.append(f"{error.get('exc_type')}: {error.get('exc_value')}")
                else:
                    lines.append(str(entry))
            return "\n".join(lines)
        return str(content)

    # ------------------------------------------------------------------ backfill (REST: POST /api/v2/backfills)
    def backfill(self, dag_id: str, from_date: datetime | date | str, to_date: datetime | date | str, *,
                 max_active_runs: int = 10, reprocess_behavior: str = "none", run_backwards: bool = False,
                 dag_run_conf: Mapping[str, Any] | None = None, user: str = "admin") -> dict:
        """Create a backfill through the REST API; returns it (``id``, ``from_date``, ...). Its runs are created
        at once (run_type ``backfill``) and the scheduler runs them; they stay queued while the DAG is paused."""
        body = {"dag_id": dag_id, "from_date": _iso(from_date), "to_date": _iso(to_date),
                "max_active_runs": max_active_runs, "reprocess_behavior": reprocess_behavior,
                "run_backwards": run_backwards}
        if dag_run_conf is not None:
            body["dag_run_conf"] = dict(dag_run_conf)
        return self.api("POST", "/api/v2/backfills", user=user, json=body)

    def backfill_cli(self, dag_id: str, from_date: datetime | date | str, to_date: datetime | date | str, *,
                     max_active_runs: int | None = None, reprocess_behavior: str | None = None,
                     run_backwards: bool = False, dag_run_conf: Mapping[str, Any] | None = None,
                     dry_run: bool = False) -> str:
        """The same through ``airflow backfill create`` (run with the CLI's own home); returns its output."""
        args = ["backfill", "create", "--dag-id", dag_id, "--from-date", _iso(from_date), "--to-date", _iso(to_date)]
        if max_active_runs is not None:
            args += ["--max-active-runs", str(max_active_runs)]
        if reprocess_behavior:
            args += ["--reprocess-behavior", reprocess_behavior]
        if run_backwards:
            args.append("--run-backwards")
        if dag_run_conf is not None:
            args += ["--dag-run-conf", json.dumps(dict(dag_run_conf))]
        if dry_run:
            args.append("--dry-run")
        result = self.cli(*args)
        return result.stdout + result.stderr

    def backfills(self, dag_id: str) -> list[dict]:
        return self._paginate("/api/v2/backfills", "backfills", {"dag_id": dag_id})

    def wait_backfill(self, backfill_id: int, timeout: float = 180.0) -> list[dict]:
        """Wait until the scheduler marks the backfill complete; returns its runs (backfill runs of the DAG whose
        logical date is in the backfill's range), oldest first."""
        info: dict = {}

        def done() -> bool:
            info.update(self.api("GET", f"/api/v2/backfills/{backfill_id}"))
            return info.get("completed_at") is not None

        def runs_so_far() -> str:
            if not info:
                return "?"
            runs = self.dag_runs(info["dag_id"], run_type="backfill")
            return f"runs {[(r['logical_date'], r['state']) for r in runs]}"

        self._wait(done, time.monotonic() + timeout, f"backfill {backfill_id} to complete", detail=runs_so_far)
        lo, hi = parse_time(info["from_date"]), parse_time(info["to_date"])
        runs = [r for r in self.dag_runs(info["dag_id"], run_type="backfill")
                if r.get("logical_date") and lo <= parse_time(r["logical_date"]) <= hi]
        return sorted(runs, key=lambda r: r["logical_date"])


def _iso(value: datetime | date | str) -> str:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=UTC).isoformat()
    return value


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def airflow_processes(workdir: str | os.PathLike | None = None) -> list[psutil.Process]:
    """Processes of a rig under ``workdir`` (of any Airflow when None): to check that nothing is left behind.
    Airflow renames its children with setproctitle (``airflow api_server -- ...``, ``airflow worker --
    LocalExecutor``, ``airflow serve-logs``), which also clobbers /proc/<pid>/environ: the working directory
    (the rig starts every component in its home; children inherit it) tells them apart, AIRFLOW_HOME otherwise."""
    root = str(Path(workdir).resolve()) if workdir is not None else None

    def ours(path: str | None) -> bool:
        return bool(path) and (root is None or path == root or path.startswith(root + os.sep))

    found = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid():
                continue
            if root is None:
                cmdline = " ".join(p.cmdline())
                if "airflow" in cmdline and ("/bin/airflow" in cmdline or cmdline.startswith("airflow ")):
                    found.append(p)
                continue
            if ours(p.cwd()) or ours(p.environ().get("AIRFLOW_HOME")):
                found.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
            continue
    return found
