"""The send and dispatch tasks' extra links to the Delayed messages page: worked out when a real run's tasks end
(`dag.test()`), and read back as Airflow's UI reads them, from the api-server's task-instance links endpoint
(the provider's `extra-links` let it deserialize the links)."""

from __future__ import annotations

import json
from datetime import datetime
from urllib.parse import parse_qs, urlsplit

import pytest

from airflow_delay_provider.links import MAX_LINKED_IDS
from airflow_delay_provider.ui.paths import page_url

START = datetime(2026, 1, 1)
PAGE = "/plugin/delayed-messages/delay-backlog/"


@pytest.fixture
def sqlite_store(tmp_path, monkeypatch) -> str:
    """A `delay_store` connection to a SQLite file of this test's own; its id."""
    monkeypatch.setenv("AIRFLOW_CONN_DELAY_LINKS", json.dumps(
        {"conn_type": "delay_store", "schema": str(tmp_path / "store.db"), "extra": {"driver": "sqlite"}}))
    return "delay_links"


def _links(dag_id: str, run_id: str, task_ids: list[str]) -> dict[str, dict]:
    """{task_id: its extra links}, from Airflow's own api-server app, as the UI asks for them."""
    from airflow.api_fastapi.app import create_app, get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from fastapi.testclient import TestClient

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW__CORE__AUTH_MANAGER",
                  "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager")
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "admin:admin")
        mp.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "a-secret-of-this-test-run-only-" + "x" * 40)
        app = create_app()
        token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
        client = TestClient(app)
        found = {}
        for task_id in task_ids:
            response = client.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/links",
                                  headers={"Authorization": f"Bearer {token}"})
            assert response.status_code == 200, response.text
            found[task_id] = response.json()["extra_links"]
        return found


def test_send_and_dispatch_tasks_link_to_the_page_on_their_destination_and_messages(
        run_dag, sqlite_store, airflow_home):
    from airflow.models.dagrun import DagRun
    from airflow.sdk import DAG
    from airflow.utils.session import create_session

    from airflow_delay_provider.operators.delay import (
        DispatchDueMessagesOperator,
        ProvisionDelayInfrastructureOperator,
        SendDelayedMessageOperator,
    )

    common = {"delay_store_conn_id": sqlite_store}
    big = [{"body": str(i), "delay_seconds": 3600} for i in range(MAX_LINKED_IDS + 1)]
    with DAG("t_extra_links", schedule=None, start_date=START) as dag:
        provision = ProvisionDelayInfrastructureOperator(task_id="provision", endpoints=["q", "other"], **common)
        one = SendDelayedMessageOperator(task_id="one", destination="{{ 'q' }}", body="x", delay_seconds=3600,
                                         **common)
        mixed = SendDelayedMessageOperator(task_id="mixed", destination="q", **common, messages=[
            {"body": "a", "delay_seconds": 3600, "message_id": "m a&b"},
            {"body": "b", "destination": "other", "delay_seconds": 3600, "message_id": "m-2"}])
        many = SendDelayedMessageOperator(task_id="many", destination="q", messages=big, **common)
        dispatch_q = DispatchDueMessagesOperator(task_id="dispatch_q", destinations="q", max_runtime=1, **common)
        dispatch_all = DispatchDueMessagesOperator(task_id="dispatch_all", max_runtime=1, **common)
        provision >> [one, mixed, many] >> dispatch_q >> dispatch_all
    state, states, values = run_dag(dag)
    assert state == "success", states
    with create_session() as session:
        run_id = session.query(DagRun).filter_by(dag_id=dag.dag_id).one().run_id

    links = _links(dag.dag_id, run_id, ["one", "mixed", "many", "dispatch_q", "dispatch_all"])
    urls = {task_id: found["Delayed messages"] for task_id, found in links.items()}
    # One message: its destination and its (derived) id, in the page's place in the UI.
    assert urls["one"] == page_url("q", [values["one"]]) == f"{PAGE}?destination=q&message_id={values['one']}"
    # Two destinations: the page filters by one, so the ids alone (quoted as a query needs).
    assert urls["mixed"] == f"{PAGE}?message_id=m+a%26b&message_id=m-2"
    assert parse_qs(urlsplit(urls["mixed"]).query) == {"message_id": ["m a&b", "m-2"]}
    # More ids than a link carries: the destination alone.
    assert len(values["many"]) == MAX_LINKED_IDS + 1 and urls["many"] == f"{PAGE}?destination=q"
    assert urls["dispatch_q"] == f"{PAGE}?destination=q"
    assert urls["dispatch_all"] == PAGE


@pytest.mark.parametrize("transport", ["rabbitmq", "sqs"])
def test_a_send_through_a_brokers_own_delays_has_no_link(transport):
    """Those messages are on the broker, not in the store the page shows: no link rather than an empty page
    (worked out before any XCom is read: no run needed)."""
    from airflow_delay_provider.links import SentMessagesLink
    from airflow_delay_provider.operators.delay import SendDelayedMessageOperator

    task = SendDelayedMessageOperator(task_id="native", destination="q", transport=transport)
    assert SentMessagesLink().get_link(task, ti_key=None) == ""  # type: ignore[arg-type]
