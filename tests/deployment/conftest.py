"""Fixtures over the deployment rig (tests/deployment/rig.py): a real Airflow deployment per test module, and one
that two modules share (tests/shared.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from tests.conftest import PG_URL, ROOT
from tests.deployment.rig import Deployment, DeploymentError, postgres_problem
from tests.helpers import store_connection
from tests.shared import Shared


@pytest.fixture(scope="session")
def postgres_server() -> None:
    """The real PostgreSQL server must answer: each deployment creates (and drops) a database of its own on it."""
    problem = postgres_problem()
    if problem:
        pytest.fail(problem, pytrace=False)


def _start(workdir: Path, dags_folder: str | os.PathLike, connections: Mapping[str, Any] | None = None,
           env: Mapping[str, str] | None = None, *, expected_dags: Iterable[str] | None = None,
           **kwargs: Any) -> Deployment:
    rig = Deployment(workdir, Path(dags_folder), env=env, connections=connections, expected_dags=expected_dags,
                     drop_in_background=True, **kwargs)
    try:
        rig.start()
    except DeploymentError as exc:
        pytest.fail(f"the deployment did not start: {exc}", pytrace=False)
    print(f"\n[deployment] {rig.base_url} db {rig.db_name}: started in {rig.timings['total']:.1f} s "
          f"({', '.join(f'{k} {v:.1f}' for k, v in rig.timings.items() if k != 'total')})")
    return rig


def _stop(rigs: Iterable[Deployment]) -> None:
    """Stop the deployments; a process left behind fails the teardown (a database not dropped, the session's end:
    tests/databases.py)."""
    problems = []
    for rig in rigs:
        rig.stop()
        left = rig.leftovers()
        if left:
            problems.append(f"processes left behind by {rig.workdir}: {[p.pid for p in left]}")
            for p in left:
                p.kill()
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def deployment(postgres_server, tmp_path_factory) -> Iterator[Callable[..., Deployment]]:
    """A factory: ``deployment(dags_folder, connections=None, env=None, **kwargs)`` starts a real deployment
    (api-server, scheduler, dag-processor, triggerer; PostgreSQL) over that dags folder and returns it started.
    Every deployment it started is stopped, and its database dropped, when the module ends; a process left behind
    or a database not dropped is an error of the teardown."""
    started: list[Deployment] = []

    def start(dags_folder: str | os.PathLike, *args: Any, **kwargs: Any) -> Deployment:
        started.append(_start(tmp_path_factory.mktemp("deployment"), dags_folder, *args, **kwargs))
        return started[-1]

    yield start
    _stop(reversed(started))


_EXAMPLES = Shared("examples_deployment")


@contextmanager
def _examples_deployment(pg_schema: str, workdir: Path) -> Iterator[tuple[Deployment, SqlDelayedMessageStore]]:
    hidden = workdir / "plain_install"
    hidden.mkdir()
    # jsonschema registers its date-time check only if this imports: as in an install without the package.
    (hidden / "rfc3339_validator.py").write_text('raise ImportError("not installed, as in a plain install")\n')
    table = f"first_{uuid.uuid4().hex[:6]}"
    store = SqlDelayedMessageStore(PG_URL, schema=pg_schema, table=table)
    store.create_schema()
    rig = _start(workdir / "deployment", ROOT / "dags",
                 connections={"delay_store_default": store_connection(PG_URL, pg_schema, table=table)},
                 env={"PYTHONPATH": str(hidden), "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "5",
                      "SPARK_LOCAL_IP": "127.0.0.1"})
    try:
        yield rig, store
    finally:
        _stop([rig])


@pytest.fixture(scope="module")
def examples_deployment(postgres_server, pg_schema, tmp_path_factory) -> tuple[Deployment, SqlDelayedMessageStore]:
    """(deployment, store): the deployment over the repository's dags folder that test_first_run and then
    test_delivery use (tests/shared.py), as a plain install runs it (no rfc3339-validator, so Airflow checks no
    `format: date-time`), with only the connection of its store: a store of its own (its own tables in this run's
    PostgreSQL schema), created as a deployment's init or `make demo` does."""
    return _EXAMPLES.get(lambda: _examples_deployment(pg_schema, tmp_path_factory.mktemp("examples")))


@pytest.fixture(scope="module")
def store(pg_schema):
    """The store the deployment's `delay_store_default` connection points at (this run's PostgreSQL schema)."""
    store = SqlDelayedMessageStore(PG_URL, schema=pg_schema)
    store.create_schema()
    return store
