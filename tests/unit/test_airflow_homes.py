"""The test rig's private Airflow homes (tests/conftest.py): each pytest process removes its own at the end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

INNER = '''
import os
from pathlib import Path


def test_records_its_airflow_home():
    home = Path(os.environ["AIRFLOW_HOME"])
    assert home.is_dir()
    (Path(os.environ["ADP_RECORD"]) / f"{os.getpid()}").write_text(str(home))
'''


@pytest.mark.parametrize("workers", [None, "2"])
def test_each_pytest_process_removes_the_airflow_home_it_made_and_no_other(tmp_path, workers):
    tmp, record = tmp_path / "tmp", tmp_path / "record"
    tmp.mkdir()
    record.mkdir()
    (tmp_path / "test_inner.py").write_text(INNER)
    others = tmp / "adp-airflow-of-another-run"  # another session's home, in the same temporary folder
    others.mkdir()
    # tests.conftest as a plugin of a session of its own, its temporary folders (the homes) in `tmp`.
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
            *(["-n", workers] if workers else []), str(tmp_path / "test_inner.py")]
    env = {**os.environ, "TMPDIR": str(tmp), "ADP_RECORD": str(record)}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    homes = [path.read_text() for path in record.iterdir()]
    assert homes and all(home.startswith(f"{tmp}/adp-airflow-") for home in homes), homes
    assert [path.name for path in tmp.glob("adp-airflow-*")] == [others.name]
