"""The distributions a packager builds: what the sdist and the wheel carry, and the wheel's metadata. (The wheel
installed into a fresh venv, listed by Airflow and running the demo DAG: `make check-wheel`.)"""

from __future__ import annotations

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
pytestmark = pytest.mark.services  # builds with setuptools fetched by pip into an isolated environment


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    # Built from a copy: building the sdist writes its egg-info into the source tree, where (on sys.path from
    # the checkout) it would register the provider's entry points a second time for the other tests. The copy
    # leaves out what a clean checkout does not have (.gitignore): `make test` builds the compatibility run's venv
    # (1.7 GB) beside the suite, and copying it took a minute.
    source, out = tmp_path_factory.mktemp("source") / "tree", tmp_path_factory.mktemp("dist")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".venv-airflow-*", ".airflow", "dist", "build", "*.egg-info", "__pycache__", "results",
        ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis", "_build"))
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
