"""Where a store's messages go once due (stores/routes.py): provisioning and every dispatcher record their transport,
connection and error queue, on SQLite and the real PostgreSQL; a store older than the routes records nothing and
keeps working; a bad route is refused before anything is written."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import inspect

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.hooks.delay_store import DelayStoreHook
from airflow_delay_provider.operators.dispatch import DispatchDueMessagesOperator
from airflow_delay_provider.operators.provision import ProvisionDelayInfrastructureOperator
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from tests.helpers import FakeTI
from tests.integration.test_airflow import _pg_conn


@pytest.fixture(params=["sqlite", "postgres"])
def conn_id(request, tmp_path, monkeypatch, airflow_home):
    if request.param == "sqlite":
        conn_id = f"routes_{uuid.uuid4().hex[:8]}"
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(
            {"conn_type": "delay_store", "schema": str(tmp_path / "store.db"), "extra": {"driver": "sqlite"}}))
        return conn_id
    return _pg_conn(monkeypatch, request.getfixturevalue("pg_schema"), f"r_{uuid.uuid4().hex[:10]}")


def test_provisioning_and_each_dispatcher_record_where_messages_go(conn_id):
    ti = {"ti": FakeTI()}
    ProvisionDelayInfrastructureOperator(task_id="p", delay_store_conn_id=conn_id, endpoints=["orders"],
                                         error_queue="failed").execute(ti)
    store = DelayStoreHook(conn_id).get_store()
    [provisioned] = store.routes.routes()
    assert (provisioned["transport"], provisioned["conn_id"], provisioned["error_queue"]) == ("sql", None, "failed")
    assert provisioned["scope"] == {"endpoints": ["orders"]}

    store.store([DelayedMessage("orders", b"x", utcnow() - timedelta(seconds=1), {}, "due-1")])
    dispatched = DispatchDueMessagesOperator(task_id="d", delay_store_conn_id=conn_id, destinations=["orders"],
                                             max_runtime=1, error_queue="failed").execute(ti)
    assert dispatched["dispatched"] == 1
    [seen] = store.routes.routes()  # the same route, seen again, with the dispatcher's scope
    assert seen["scope"] == {"destinations": ["orders"], "prefix": None} and seen["seen_at"] >= provisioned["seen_at"]
    DispatchDueMessagesOperator(task_id="d2", delay_store_conn_id=conn_id, max_runtime=1,
                                error_queue="other_errors").execute(ti)
    assert [r["error_queue"] for r in store.routes.routes()] == ["other_errors", "failed"]  # newest first


def test_a_store_older_than_the_routes_records_none_and_a_bad_route_is_refused(db):
    url, schema, table = db
    old = SqlDelayedMessageStore(url, table=table, schema=schema)
    old.migrate(up_to=12)
    assert old.routes.record("sql", None, "error", {}) is False and old.routes.routes() == []
    with old.engine.connect() as conn:
        assert not inspect(conn).has_table(old.tables.routes.name, schema=schema)  # nothing was created
    old.migrate()
    with pytest.raises(InvalidInputError, match="transport 'kafka' is not supported; choose one of \\['sql'"):
        old.routes.record("kafka", None, "error", {})
    with pytest.raises(InvalidInputError, match="destination"):
        old.routes.record("sql", None, "bad\nqueue", {})
    assert old.routes.routes() == []
    assert old.routes.record("rabbitmq", "rabbitmq_prod", "error", {"prefix": "orders."}) is True
    assert [(r["transport"], r["conn_id"]) for r in old.routes.routes()] == [("rabbitmq", "rabbitmq_prod")]
