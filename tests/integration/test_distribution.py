"""The distributions a packager builds: what the sdist and the wheel carry, their metadata, and the wheel installed
(not editable) into a fresh venv with the constraints, where Airflow lists the provider and runs the demo DAG."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import airflow_delay_provider

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.services  # pip installs Airflow into the venv (from pip's cache after `make install`)


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    # Built from a copy: building the sdist writes its egg-info into the source tree, where (on sys.path from
    # the checkout) it would register the provider's entry points a second time for the other tests.
    source, out = tmp_path_factory.mktemp("source") / "tree", tmp_path_factory.mktemp("dist")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".airflow", "dist", "build", "*.egg-info", "__pycache__", "results", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(source)], check=True,
                   capture_output=True, text=True)
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


def test_the_wheel_carries_the_package_data_licenses_and_metadata(dists):
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        names = set(wheel.namelist())
        info = f"airflow_delay_provider-{airflow_delay_provider.__version__}.dist-info"
        metadata = Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert {f"{info}/licenses/LICENSE", f"{info}/licenses/NOTICE", "airflow_delay_provider/py.typed",
            "airflow_delay_provider/stores/schema/0001_messages.sql",
            "airflow_delay_provider/transports/queue_schema/0001_queue_tables.sql"} <= names
    assert any(n.startswith("airflow_delay_provider/ui/static/") for n in names)
    assert metadata["Version"] == airflow_delay_provider.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "Framework :: Apache Airflow :: Provider" in metadata.get_all("Classifier")
    assert any(url.startswith("Changelog, https://") for url in metadata.get_all("Project-URL"))
    assert "apache_airflow_provider" in entry_points and "airflow.plugins" in entry_points
    # PyPI shows the description off the repository: every link in it is absolute.
    description = metadata.get_payload()
    links = re.findall(r"\]\(([^)]+)\)", description)
    assert links and all(link.startswith("https://") for link in links), links


def test_the_sdist_carries_the_example_dags_docs_and_changelog(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"LICENSE", "NOTICE", "CHANGELOG.md", "README.md", "docs/pypi.md", "dags/demo_delayed_delivery.py",
            "docs/howto/index.md", "airflow_delay_provider/transports/queue_schema/0001_queue_tables.sql"} <= names
    assert not any("__pycache__" in n for n in names)


def test_the_wheel_installed_in_a_fresh_venv_is_listed_by_airflow_and_runs_the_demo_dag(dists, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True)
    python, airflow = venv / "bin" / "python", venv / "bin" / "airflow"
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt"),
                              str(dists["wheel"])], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    where = subprocess.run([python, "-c", "import airflow_delay_provider as p; print(p.__file__, p.__version__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    assert where == [str(next(venv.glob("lib/python*/site-packages")) / "airflow_delay_provider" / "__init__.py"),
                     airflow_delay_provider.__version__]  # the installed copy, not this checkout

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHONPATH"))}
    env |= {"AIRFLOW_HOME": str(tmp_path / "home"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    listed = subprocess.run([airflow, "providers", "list", "--output", "json"], capture_output=True, text=True,
                            env=env, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-3000:]
    providers = {p["package_name"]: p["version"] for p in json.loads(listed.stdout)}
    assert providers.get("airflow-delay-provider") == airflow_delay_provider.__version__

    demo = subprocess.run([python, str(ROOT / "scripts" / "demo.py")], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout[-5000:]
    report = dict(re.findall(r"^  (\w+) +(\S+)$", demo.stdout, flags=re.M))
    assert report["delivered"] == report["sent"] != "0", demo.stdout
    assert report["missing"] == report["duplicates"] == report["early"] == "0", demo.stdout
