"""`make check-wheel`: the wheel `make dist` built, installed (not editable) into a fresh venv
with constraints.txt, where `pip check` passes, Airflow lists the provider at its version and the demo DAG delivers
every message once, none early. Prints one line per step; exits 1 on the first failure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
        step(f"pip install {wheel.name} -c constraints.txt", [python, "-m", "pip", "install", "--quiet", "--no-compile",
                                                               "-c", str(ROOT / "constraints.txt"), str(wheel)])
        step("pip check", [python, "-m", "pip", "check"])
        where = step("import", [python, "-c", "import airflow_delay_provider as p; print(p.__file__)"], cwd=tmp)
        if not where.stdout.strip().startswith(str(venv)):
            print(f"check_wheel: imported {where.stdout.strip()}, not the installed copy")
            return 1
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHONPATH"))}
        env |= {"AIRFLOW_HOME": str(Path(tmp) / "home"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
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
