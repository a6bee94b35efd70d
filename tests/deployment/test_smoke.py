"""A smoke test of a real deployment, run by `make test-compat` on every supported Airflow minor: a send
triggered through the REST API, a deferred dispatch in the triggerer process, and the backlog page behind the
login, on the example DAGs as a first-time user would run them. The other deployment tests go deeper on the
Airflow that `make test` installs; this one is what each minor must pass."""

from __future__ import annotations

import uuid

import pytest

from airflow_delay_provider.transports.sql import SqlTableTransport
from airflow_delay_provider.ui.plugin import URL_PREFIX
from tests.conftest import PG_URL, ROOT
from tests.helpers import receive_until, store_connection

pytestmark = pytest.mark.smoke


@pytest.fixture(scope="module")
def airflow(deployment, pg_schema, store):  # the store provisioned first, as a deployment's init would
    return deployment(ROOT / "dags", connections={"delay_store_default": store_connection(PG_URL, pg_schema)},
                      expected_dags=["delay_manual_send", "delay_continuous_dispatch"])


def test_a_rest_triggered_send_waits_on_the_backlog_page_and_a_deferred_dispatch_delivers_it(airflow, pg_schema):
    queues = SqlTableTransport(PG_URL, schema=pg_schema)
    queue = f"smoke.{uuid.uuid4().hex[:8]}"
    queues.provision(queue)

    airflow.unpause("delay_manual_send")
    run_id = airflow.trigger("delay_manual_send", {"transport": "sql", "destination": queue, "delay_seconds": 5})
    assert airflow.wait_run("delay_manual_send", run_id, timeout=180) == "success", airflow.logs_tail()
    message_id = airflow.xcom("delay_manual_send", run_id, "send")
    airflow.pause("delay_manual_send")

    # The page's API as the admin sees it (the page itself redirects to the login without a token).
    backlog = airflow.api("GET", f"{URL_PREFIX}/api/backlog")
    assert backlog["destinations"][queue]["scheduled"] == 1 and backlog["can_edit"] is True
    listed = airflow.api("GET", f"{URL_PREFIX}/api/messages", params={"destination": queue})
    assert [m["message_id"] for m in listed["messages"]] == [message_id]
    assert airflow.request("GET", f"{URL_PREFIX}/", user=None, follow_redirects=False).status_code in (302, 303, 307)

    airflow.unpause("delay_continuous_dispatch")
    dispatch_run = airflow.trigger("delay_continuous_dispatch", {"dispatch_seconds": 30})
    got = receive_until(queues, queue, {message_id}, timeout=120)
    assert [m.message_id for m in got] == [message_id], airflow.logs_tail()
    assert airflow.wait_run("delay_continuous_dispatch", dispatch_run, timeout=180) == "success"
    airflow.pause("delay_continuous_dispatch")
    # Unpausing also started the DAG's latest scheduled run, which may have been the one to dispatch it: both
    # dispatch deferred, in the triggerer.
    assert airflow.xcom("delay_continuous_dispatch", dispatch_run, "dispatch")["dispatched_in"] == "triggerer"
    assert airflow.api("GET", f"{URL_PREFIX}/api/backlog")["destinations"][queue]["scheduled"] == 0
