"""`make check-wheel`: the wheel `make dist` built, installed (not editable) without extras into a fresh venv
with constraints.txt, as a user of the SQL store or RabbitMQ installs it: `pip check` passes; boto3, PySpark and the
amazon and Spark providers are not there; the package's core modules, the provider info, the CLI and the UI plugin
import; an SQS or Spark operator's import fails naming its extra; Airflow lists the provider at its version and its
connection types; the example DAGs parse but for the SQS relay's and the Spark sweep's, which name their extra; and
the demo DAG delivers every message once, none early. Prints one line per step; exits 1 on the first failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What the extras install, and must not be importable without them.
EXTRAS_ONLY = ("boto3", "botocore", "pyspark", "airflow.providers.amazon", "airflow.providers.apache.spark")
CORE_MODULES = ("airflow_delay_provider.get_provider_info", "airflow_delay_provider.cli.definition",
                "airflow_delay_provider.ui.plugin", "airflow_delay_provider.operators.delay",
                "airflow_delay_provider.operators.send", "airflow_delay_provider.operators.dispatch",
                "airflow_delay_provider.operators.provision", "airflow_delay_provider.sensors.delay_store",
                "airflow_delay_provider.triggers.delay_store", "airflow_delay_provider.hooks.rabbitmq",
                "airflow_delay_provider.stores.sql", "airflow_delay_provider.transports.sql",
                "airflow_delay_provider.transports.rabbitmq", "airflow_delay_provider.core.pump")
#: A feature's module, and the extra its error must name.
FEATURES = {"airflow_delay_provider.operators.sqs": "amazon", "airflow_delay_provider.hooks.sqs": "amazon",
            "airflow_delay_provider.triggers.sqs": "amazon", "airflow_delay_provider.operators.sweep": "spark"}
WITHOUT_EXTRAS = f"""
import importlib, importlib.util, json, sys
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False
report = {{"found": [m for m in {EXTRAS_ONLY!r} if found(m)], "refused": {{}}}}
for module in {CORE_MODULES!r}:
    importlib.import_module(module)
for module in {list(FEATURES)!r}:
    try:
        importlib.import_module(module)
    except ImportError as error:
        report["refused"][module] = str(error)
from airflow.dag_processing.dagbag import DagBag
report["dag_errors"] = sorted(p.rsplit("/", 1)[-1] for p in DagBag(dag_folder=sys.argv[1]).import_errors)
print(json.dumps(report))
"""


def without_extras(python: Path, env: dict, cwd: str) -> str | None:
    """What is wrong with the venv as the core alone, or None."""
    done = step("core imports, features without their extra", [python, "-c", WITHOUT_EXTRAS, str(ROOT / "dags")],
                env=env, cwd=cwd)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["found"]:
        return f"installed without extras, yet {report['found']} can be imported"
    for module, extra in FEATURES.items():
        if f'pip install "airflow-delay-provider[{extra}]"' not in report["refused"].get(module, ""):
            return f"importing {module} without the [{extra}] extra: {report['refused'].get(module, 'no error')}"
    if report["dag_errors"] != ["delay_sqs_relay.py", "spark_bulk_sweep.py"]:
        return f"example DAGs that fail to import without the extras: {report['dag_errors']}"
    print(f"check_wheel: without extras: {', '.join(EXTRAS_ONLY)} absent; {len(CORE_MODULES)} core modules import; "
          f"{len(FEATURES)} feature modules name their extra, e.g. {report['refused'][next(iter(FEATURES))]}")
    return None


def step(what: str, command: list[str], **kwargs) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    print(f"check_wheel: {what}: exit {done.returncode} in {time.monotonic() - started:.0f} s", flush=True)
    if done.returncode != 0:
        print(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(1)
    return done


def main() -> int:
    import airflow_delay_provider

    version = airflow_delay_provider.__version__
    wheel = next((ROOT / "dist").glob(f"airflow_delay_provider-{version}-*.whl"), None)
    if wheel is None:
        print("check_wheel: no wheel in dist/: run `make dist` first")
        return 1
    with tempfile.TemporaryDirectory(prefix="check-wheel-") as tmp:
        venv = Path(tmp) / "venv"
        python = venv / "bin" / "python"
        step("fresh venv", [getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)])
        # No byte-compiling at install: a third of the install's time, and Python compiles what it imports anyway.
        step(f"pip install {wheel.name} -c constraints.txt (no extras)",
             [python, "-m", "pip", "install", "--quiet", "--no-compile", "-c", str(ROOT / "constraints.txt"),
              str(wheel)])
        step("pip check", [python, "-m", "pip", "check"])
        where = step("import", [python, "-c", "import airflow_delay_provider as p; print(p.__file__)"], cwd=tmp)
        if not where.stdout.strip().startswith(str(venv)):
            print(f"check_wheel: imported {where.stdout.strip()}, not the installed copy")
            return 1
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHONPATH"))}
        env |= {"AIRFLOW_HOME": str(Path(tmp) / "home"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
        wrong = without_extras(python, env, tmp)
        if wrong:
            print(f"check_wheel: {wrong}")
            return 1
        hooks = step("airflow providers hooks", [venv / "bin" / "airflow", "providers", "hooks", "--output", "json"],
                     env=env, cwd=tmp)
        types = {h.get("connection_type") for h in json.loads(hooks.stdout[hooks.stdout.index("["):])}
        if not {"delay_store", "rabbitmq"} <= types:
            print(f"check_wheel: airflow providers hooks lists no delay_store and rabbitmq connection types: {types}")
            return 1
        step("airflow delayed-messages --help", [venv / "bin" / "airflow", "delayed-messages", "--help"], env=env,
             cwd=tmp)
        listed = step("airflow providers list", [venv / "bin" / "airflow", "providers", "list", "--output", "json"],
                      env=env, cwd=tmp)
        if '"airflow-delay-provider"' not in listed.stdout or f'"{version}"' not in listed.stdout:
            print(f"check_wheel: airflow providers list does not show airflow-delay-provider {version}")
            return 1
        demo = step("the demo DAG", [python, str(ROOT / "scripts" / "demo.py")], env=env, cwd=tmp)
        report = dict(re.findall(r"^  (\w+) +(\S+)$", demo.stdout, flags=re.M))
        if not (report.get("delivered") == report.get("sent") != "0"
                and report.get("missing") == report.get("duplicates") == report.get("early") == "0"):
            print(f"check_wheel: the demo DAG did not deliver every message once, none early: {report}")
            return 1
        print(f"check_wheel: {wheel.name} in a fresh venv: listed by Airflow, demo delivered {report['delivered']} "
              f"of {report['sent']}, none missing, twice or early")
    return 0


if __name__ == "__main__":
    sys.exit(main())
