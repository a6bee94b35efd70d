"""The executors' environment archive: what it holds, and its launcher on a node with only a Python."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest

from airflow_delay_provider.spark import environment
from tests.helpers import bare_python

VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory):
    where = tmp_path_factory.mktemp("env")
    archive = environment.build_archive(where / "env.tar.gz")
    with tarfile.open(archive.path) as tar:
        tar.extractall(where / "environment", filter="tar")
    return archive, where / "environment"


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A Python of this minor version with nothing installed, as a node has."""
    return bare_python(tmp_path_factory.mktemp("bare"))


def test_the_archive_holds_the_drivers_and_not_airflow(unpacked):
    archive, root = unpacked
    names = {d.split("==")[0].lower() for d in archive.distributions}
    assert {"sqlalchemy", "psycopg", "psycopg-binary", "pika", "boto3", "botocore"} <= names
    assert not {n for n in names if n.startswith("apache-airflow") or n in ("pyarrow", "pyspark")}
    assert json.loads((root / "manifest.json").read_text())["python"] == VERSION
    assert (root / "site-packages" / "airflow_delay_provider" / "spark" / "sweep.py").is_file()
    assert not (root / "site-packages" / "airflow").exists()
    # Only the AWS models the transport uses; compiled modules without their sources.
    assert sorted(p.name for p in (root / "site-packages" / "botocore" / "data").iterdir() if p.is_dir()) == \
        ["s3", "sqs", "sts"]
    assert not list((root / "site-packages" / "sqlalchemy").rglob("*.pyx"))
    # Bytecode that holds whatever times the files get when unpacked (hash-based, never checked).
    cache = root / "site-packages" / "airflow_delay_provider" / "spark" / "__pycache__"
    pyc = cache / f"sweep.{sys.implementation.cache_tag}.pyc"
    assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 0b01
    assert archive.size_bytes == archive.path.stat().st_size


def test_the_launcher_runs_a_bare_python_of_this_version_with_the_sweep_importable(unpacked, bare, tmp_path):
    _, root = unpacked
    code = "import sys, airflow_delay_provider.spark.sweep, psycopg, pika, boto3; print(sys.executable)"
    ran = subprocess.run([str(root / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": f"{bare}:/usr/bin:/bin"})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == str(bare / f"python{VERSION}")  # found on PATH, nothing of this venv
    chosen = subprocess.run([str(root / "bin" / "python"), "-c", "import sys; print(sys.executable)"],
                            capture_output=True, text=True, cwd=tmp_path,
                            env={"PATH": "/nonexistent", "AIRFLOW_DELAY_EXECUTOR_PYTHON": str(bare / "python")})
    assert chosen.returncode == 0 and chosen.stdout.strip() == str(bare / "python")


def test_without_a_python_of_this_version_the_launcher_says_what_is_missing(unpacked, tmp_path):
    _, root = unpacked
    ran = subprocess.run([str(root / "bin" / "python"), "-c", "pass"], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": str(tmp_path)})
    assert ran.returncode == 127
    assert f"no Python {VERSION} on this node" in ran.stderr and "AIRFLOW_DELAY_EXECUTOR_PYTHON" in ran.stderr


def test_the_cache_builds_once_per_content(tmp_path):
    first = environment.cached_archive(directory=tmp_path)
    again = environment.cached_archive(directory=tmp_path)
    assert first.build_seconds > 0 and again.build_seconds == 0 and again.path == first.path
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no partial file left


def test_a_python_the_task_chose_is_the_one_the_launcher_runs_or_it_says_why_not(unpacked, bare, tmp_path):
    _, root = unpacked
    chosen = {"AIRFLOW_DELAY_EXECUTOR_PYTHON": str(bare / "python"),
              "AIRFLOW_DELAY_EXECUTOR_PYTHON_FROM": "PYSPARK_PYTHON in this process's environment"}
    code = "import sys, airflow_delay_provider.spark.sweep; print(sys.executable)"
    ran = subprocess.run([str(root / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", **chosen})
    assert ran.returncode == 0 and ran.stdout.strip() == str(bare / "python"), ran.stderr
    other = tmp_path / "python3.9"  # a Python of another minor version, as far as asking it tells
    other.write_text("#!/bin/sh\necho 3.9\n")
    other.chmod(0o755)
    for python, what in ((other, "Python 3.9"), (tmp_path / "none", "not runnable on this node")):
        ran = subprocess.run([str(root / "bin" / "python"), "-c", "pass"], capture_output=True, text=True,
                             cwd=tmp_path, env={"PATH": f"{bare}:/usr/bin:/bin", **chosen,  # python3.11 is there...
                                                "AIRFLOW_DELAY_EXECUTOR_PYTHON": str(python)})
        assert ran.returncode == 127, ran.stdout  # ...but the task chose another: no silent substitute
        assert f"PYSPARK_PYTHON in this process's environment names {python}, which is {what}" in ran.stderr
        assert f"built for Python {VERSION}" in ran.stderr
