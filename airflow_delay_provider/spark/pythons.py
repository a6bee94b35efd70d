"""The Pythons a sweep's driver and executors run, and the archive of the executors' environment shipped for them.

A Python the user chose (PYSPARK_PYTHON in the Airflow worker's environment, as many Spark setups have, or in
`env_vars`, or `spark.pyspark.python` in `conf`) is the one that runs, and it gets the shipped archive's packages
first on its path through the archive's launcher; run bare, it would fail every task with `No module named
'airflow_delay_provider'`. What cannot work is refused before anything is submitted where this machine can tell,
and `ExecutorSetup.description`, which the task logs, says what really runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.spark import environment
from airflow_delay_provider.spark.setup import SparkTarget


@dataclass
class ExecutorSetup:
    """What spark-submit gets so that the driver and the executors run a Python that has the sweep."""

    conf: dict[str, str]
    archives: str | None
    env_vars: dict[str, str]
    description: str


def _pyspark_home(bin_dir: str) -> str | None:
    """The home of the PySpark package whose spark-submit is in `bin_dir`, or None for a Spark distribution's.
    That spark-submit looks for its home with $PYSPARK_DRIVER_PYTHON or $PYSPARK_PYTHON, which may well be a
    Python without PySpark (the nodes' own): then it finds none and fails."""
    if not os.path.isfile(os.path.join(bin_dir, "find_spark_home.py")):
        return None
    from airflow_delay_provider.spark.local_cluster import spark_home

    home = spark_home()
    return str(home) if (home / "bin" / "spark-class").is_file() else None


def _user_python(conf: dict, env_vars: dict, key: str, env: str) -> tuple[str, str] | None:
    """The Python a setting of the user's chose (conf, then env_vars, then this process's environment) and that
    setting, as the log names it."""
    for python, setting in ((conf.get(key), f"{key} in conf"), (env_vars.get(env), f"{env} in env_vars"),
                            (os.environ.get(env), f"{env} in this process's environment")):
        if python:
            return python, setting
    return None


#: Where a cluster manager takes the environment of a driver that runs on a node (cluster mode).
_DRIVER_ENV = {"kubernetes": "spark.kubernetes.driverEnv.", "yarn": "spark.yarn.appMasterEnv."}
#: What a chosen Python is asked: its minor version (for the archive's packages), or to import the sweep.
_VERSION = "import sys; print('%d.%d' % sys.version_info[:2])"
_SWEEP = "import airflow_delay_provider.spark.sweep"  # Spark puts PySpark on the path itself


def _ask(python: str, code: str) -> tuple[bool, str]:
    """Run `code` in `python`: whether it succeeded, and its output's or its error's last line."""
    try:
        # From "/": not this directory (a checkout of this package), which the executors do not run in.
        ran = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(getattr(exc, "strerror", None) or exc)
    lines = (ran.stdout if ran.returncode == 0 else ran.stderr).strip().splitlines()
    return ran.returncode == 0, lines[-1] if lines else f"exit status {ran.returncode}"


def _check_here(chosen: tuple[str, str], search: str | None, version: bool) -> None:
    """Refuse, naming the setting, a chosen Python that runs on this machine and cannot work: of another minor
    version than the archive's (`version`), or without the sweep. `search`: the PATH a name is looked up on
    here; None when a name is looked up by the workers, on their own PATH: then only a path is checked here,
    and a name is left to the archive's launcher on the node."""
    python, setting = chosen
    found = python if os.path.isabs(python) else None if search is None else shutil.which(python, path=search)
    if found is None and search is None:
        return
    ok, said = _ask(found, _VERSION if version else _SWEEP) if found else (False, "not found on the PATH here")
    wanted = environment.python_version()
    if ok and (not version or said == wanted):
        return
    if ok:
        raise InvalidInputError(f"{setting} names {python}, a Python {said}, and the archive's packages are built for "
                                f"Python {wanted}: point it at a Python {wanted}, or unset it")
    raise InvalidInputError(f"{setting} names {python}, which cannot {'run' if version else 'import the sweep'} "
                            f"({said}): unset it, or point it at a Python that has airflow-delay-provider")


def _through_launcher(conf: dict, key: str, env_prefix: str, chosen: tuple[str, str]) -> None:
    """The archive's launcher runs the chosen Python (that one or none) with the archive's packages first on its
    path: a Python of the user's without them fails every task with No module named 'airflow_delay_provider'."""
    conf[key] = f"./{environment.ALIAS}/bin/python"
    conf[env_prefix + environment.PYTHON_ENV], conf[env_prefix + environment.PYTHON_FROM_ENV] = chosen


def executor_setup(target: SparkTarget, executor_env: str | None, bin_dir: str, *, conf: dict | None = None,
                   env_vars: dict | None = None, archives: str | None = None, with_arrow: bool = False,
                   cache: str | None = None) -> ExecutorSetup:
    """The Pythons of the driver and executors, and the archive shipped for them, with what runs in words.

    `executor_env`: "auto" ships the archive of this environment (built once, then cached) unless the master
    is local, where executors run this Python; a path or URL ships that archive (see
    `airflow_delay_provider.spark.environment`); None ships nothing. A Python the user chose (a
    `spark.pyspark.python` / `spark.pyspark.driver.python` in `conf`, PYSPARK_PYTHON / PYSPARK_DRIVER_PYTHON
    in `env_vars` or this process's environment) is the one that runs, with the shipped archive's packages on
    its path. One that cannot work is refused before anything is submitted where this machine can tell: a
    Python of another minor version than the archive's where every executor runs here, one without the sweep
    where nothing is shipped to this machine's executors, or for the driver in client mode."""
    conf, env_vars = dict(conf or {}), dict(env_vars or {})
    home = _pyspark_home(bin_dir)
    if target.kind in ("local", "standalone"):  # the provider hands env_vars to spark-submit's own process
        env_vars["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        if target.one_host and "SPARK_LOCAL_IP" not in os.environ and "SPARK_LOCAL_IP" not in env_vars:
            env_vars["SPARK_LOCAL_IP"] = "127.0.0.1"  # all on this machine: nothing listens beyond loopback
        if home and "SPARK_HOME" not in os.environ:
            env_vars.setdefault("SPARK_HOME", home)
    else:  # elsewhere they become the driver's environment on the cluster: spark-submit finds itself on PATH
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        if home:
            os.environ.setdefault("SPARK_HOME", home)
    # The PATH spark-submit runs with: a local master's executors and a client-mode driver look Pythons up on it.
    here = env_vars["PATH"] if target.kind in ("local", "standalone") else os.environ["PATH"]
    launcher = f"./{environment.ALIAS}/bin/python"
    ships = executor_env not in (None, "auto") or executor_env == "auto" and not target.local
    executors = _user_python(conf, env_vars, "spark.pyspark.python", "PYSPARK_PYTHON")
    if executors is not None and executors[0] == launcher:
        executors = None  # the launcher itself: no choice of a Python
    if executors is not None and target.one_host:  # checked before the archive is built: a refusal comes at once
        _check_here(executors, here if target.local else None, version=ships)
    driver = _user_python(conf, env_vars, "spark.pyspark.driver.python", "PYSPARK_DRIVER_PYTHON")
    if driver is not None and not target.cluster_mode:  # it runs here
        _check_here(driver, here, version=False)

    shipped = None
    if executor_env == "auto" and not target.local:
        built = environment.cached_archive(with_arrow=with_arrow, directory=cache)
        shipped = str(built.path)
        how = (f"built in {built.build_seconds:.1f} s" if built.build_seconds else "cached") + \
            f", {built.size_bytes / 2**20:.1f} MiB"
    elif executor_env not in (None, "auto"):
        shipped = str(executor_env)
        if "://" not in shipped and not os.path.isfile(shipped):
            raise InvalidInputError(
                f"executor_env {shipped!r} does not exist: build it with `python -m "
                f"airflow_delay_provider.spark.environment -o {shipped}`, pass its URL, or use executor_env='auto'")
        how = "given"
    packages = node = ""
    if shipped is not None:
        archives = ",".join(filter(None, [archives, f"{shipped}#{environment.ALIAS}"]))
        packages = f"with the packages of the archive {shipped} ({how}) first on its path"
        node = f"the node's Python {environment.python_version()} {packages} (the archive's launcher)"

    if executors is not None and shipped is not None:
        _through_launcher(conf, "spark.pyspark.python", "spark.executorEnv.", executors)
        runs = f"{executors[0]} ({executors[1]}) {packages}, through the archive's launcher"
    elif executors is not None:
        runs = f"{executors[0]} ({executors[1]}), with nothing shipped" + ("" if target.local else
                                                                           ": it must have the sweep installed")
    elif shipped is not None:
        conf["spark.pyspark.python"], runs = launcher, node
    elif target.local:
        conf["spark.pyspark.python"], runs = sys.executable, f"{sys.executable} (this Python)"
    else:
        runs = "the cluster's default Python (PYSPARK_PYTHON on its nodes), with nothing shipped"

    if not target.cluster_mode and driver is None:  # the driver runs here: this Python has the package
        conf["spark.pyspark.driver.python"] = drives = sys.executable
    elif not target.cluster_mode and driver is not None:
        drives = f"{driver[0]} ({driver[1]})"
    elif driver is not None and shipped is not None and target.kind in _DRIVER_ENV:
        _through_launcher(conf, "spark.pyspark.driver.python", _DRIVER_ENV[target.kind], driver)
        drives = f"{driver[0]} ({driver[1]}) {packages}, through the archive's launcher"
    elif driver is not None:
        drives = f"{driver[0]} ({driver[1]})"
    elif shipped is not None:
        conf["spark.pyspark.driver.python"], drives = launcher, node
    else:
        drives = "the cluster's default Python"
    description = f"executors run {runs}; the driver ({target.deploy_mode} mode on {target.master}) runs {drives}"
    return ExecutorSetup(conf, archives, env_vars, description)
