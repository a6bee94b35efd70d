"""Fixtures over the deployment rig (tests/deployment/rig.py): a real Airflow deployment per test module."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.deployment.rig import Deployment, DeploymentError, postgres_problem


@pytest.fixture(scope="session")
def postgres_server() -> None:
    """The real PostgreSQL server must answer: each deployment creates (and drops) a database of its own on it."""
    problem = postgres_problem()
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="module")
def deployment(postgres_server, tmp_path_factory) -> Callable[..., Deployment]:
    """A factory: ``deployment(dags_folder, connections=None, env=None, **kwargs)`` starts a real deployment
    (api-server, scheduler, dag-processor, triggerer; PostgreSQL) over that dags folder and returns it started.
    Every deployment it started is stopped, and its database dropped, when the module ends; a process left behind
    or a database not dropped is an error of the teardown."""
    started: list[Deployment] = []

    def start(dags_folder: str | os.PathLike, connections: Mapping[str, Any] | None = None,
              env: Mapping[str, str] | None = None, *, expected_dags: Iterable[str] | None = None,
              **kwargs: Any) -> Deployment:
        rig = Deployment(tmp_path_factory.mktemp("deployment"), Path(dags_folder), env=env, connections=connections,
                         expected_dags=expected_dags, **kwargs)
        started.append(rig)
        try:
            rig.start()
        except DeploymentError as exc:
            pytest.fail(f"the deployment did not start: {exc}", pytrace=False)
        print(f"\n[deployment] {rig.base_url} db {rig.db_name}: started in {rig.timings['total']:.1f} s "
              f"({', '.join(f'{k} {v:.1f}' for k, v in rig.timings.items() if k != 'total')})")
        return rig

    yield start

    problems = []
    for rig in reversed(started):
        rig.stop()
        left = rig.leftovers()
        if left:
            problems.append(f"processes left behind by {rig.workdir}: {[p.pid for p in left]}")
            for p in left:
                p.kill()
        if rig.database_exists():
            problems.append(f"database {rig.db_name} was not dropped")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def store(pg_schema):
    """The store the deployment's `delay_store_default` connection points at (this run's PostgreSQL schema)."""
    from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
    from tests.conftest import PG_URL

    store = SqlDelayedMessageStore(PG_URL, schema=pg_schema)
    store.create_schema()
    return store
