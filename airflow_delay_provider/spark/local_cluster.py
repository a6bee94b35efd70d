"""A Spark standalone cluster on this machine: a master and workers as separate JVMs on 127.0.0.1.

For trying a cluster sweep without a cluster, and for the tests and benchmark that run one: the
workers get the environment you give them (`path`: what their executors find on PATH), not this
process's, so their executors see what a cluster node would: Java and a Python, nothing of this
venv. Starts from the Spark that PySpark installed (its `bin/spark-class`).

    with LocalCluster(workers=2) as cluster:
        ...  # a `spark` connection whose host is cluster.master_url, as BulkSweepOperator's conn_id
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


class LocalCluster:
    """A master and `workers` workers of `cores` cores and `memory` each, stopped on exit.

    :param path: the PATH of the workers and so of their executors (default: /usr/bin:/bin).
    :param env: more environment for the workers (e.g. AIRFLOW_DELAY_EXECUTOR_PYTHON).
    """

    def __init__(self, workers: int = 2, cores: int = 1, memory: str = "1g", path: str = "/usr/bin:/bin",
                 env: dict[str, str] | None = None, start_timeout: float = 120.0) -> None:
        self.workers, self.cores, self.memory, self.path = workers, cores, memory, path
        self.extra_env = env or {}
        self.start_timeout = start_timeout
        self.directory = Path(tempfile.mkdtemp(prefix="adp-spark-cluster-"))
        #: Known once started: every port is chosen by the system (a port picked free here could be taken by
        #: another process before Spark binds it).
        self.master_url = ""
        self.ui_port = 0
        self.processes: list[subprocess.Popen] = []

    def _environment(self) -> dict[str, str]:
        home = spark_home()
        env = {
            "PATH": self.path, "HOME": os.environ.get("HOME", "/tmp"), "SPARK_HOME": str(home),
            "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(self.directory / "logs"),
            "SPARK_WORKER_DIR": str(self.directory / "work"), "LANG": "C.UTF-8",
            # No REST submission server: it binds a fixed port (6066) that another cluster may hold.
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
        }
        java_home = os.environ.get("JAVA_HOME")
        if not java_home and shutil.which("java"):
            java_home = str(Path(shutil.which("java")).resolve().parent.parent)  # type: ignore[arg-type]
        if java_home:
            env["JAVA_HOME"] = java_home
        return {**env, **self.extra_env}

    def _start(self, name: str, *args: str) -> None:
        spark_class = spark_home() / "bin" / "spark-class"
        log = open(self.directory / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.processes.append(subprocess.Popen([str(spark_class), *args], env=self._environment(), stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True, cwd=self.directory))
        log.close()

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as response:
            return json.load(response)

    def alive_workers(self) -> int:
        try:
            return sum(worker["state"] == "ALIVE" for worker in self.state()["workers"])
        except (OSError, ValueError):
            # Refused, or a reply that is not yet the state's JSON (an empty body was seen on a busy machine
            # while the master started): not ready, asked again until the start's deadline.
            return 0

    def _wait(self, until, what: str, deadline: float) -> None:
        while not until():
            dead = [p.args[1] for p in self.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}"
                                 for f in sorted(self.directory.glob("*.log")))
                self.stop()
                raise RuntimeError(f"the local Spark cluster did not start: {what} ({len(dead)} process(es) exited):"
                                   f"\n{logs}")
            time.sleep(0.2)

    def _master_bound(self) -> bool:
        """Whether the master has said where it listens (its log), reading its URL and web UI's port."""
        text = (self.directory / "master.log").read_text(errors="replace")
        url = re.search(r"Starting Spark master at (spark://\S+)", text)
        ui = re.search(r"Successfully started service 'MasterUI' on port (\d+)", text)
        if url and ui:
            self.master_url, self.ui_port = url.group(1), int(ui.group(1))
        return bool(url and ui)

    def start(self) -> LocalCluster:
        (self.directory / "work").mkdir()
        deadline = time.monotonic() + self.start_timeout
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", "0", "--webui-port", "0")
        self._wait(self._master_bound, "the master did not say where it listens", deadline)
        for i in range(self.workers):
            self._start(f"worker-{i}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                        "--cores", str(self.cores), "--memory", self.memory, "--webui-port", "0",
                        "--work-dir", str(self.directory / "work"), self.master_url)
        self._wait(lambda: self.alive_workers() >= self.workers, f"fewer than {self.workers} workers alive", deadline)
        return self

    def stop(self) -> None:
        for proc in reversed(self.processes):  # workers first, so none reconnects to a new master
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.processes.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # python -m airflow_delay_provider.spark.local_cluster: runs until interrupted
    with LocalCluster(workers=int(sys.argv[1]) if len(sys.argv) > 1 else 2) as running:
        print(f"master {running.master_url}, web UI http://127.0.0.1:{running.ui_port}; Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
