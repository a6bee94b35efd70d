"""The backlog page's dead letters, through Airflow's own api-server app and SimpleAuthManager's roles, on the SQL
transport of the store's database: listed with filters without consuming anything, bodies for editors only,
redriven and deleted by id, destination or all (a dry run first), each action in the audit log."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from airflow_delay_provider import audit
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.helpers import make_store
from tests.integration.test_ui_plugin import airflow_app, client, seed  # noqa: F401 - fixtures


@pytest.fixture
def dead(monkeypatch, tmp_path):
    """A seeded store with 4 dead letters in its SQL transport's error queue: 2 of orders (a 503), 1 of refunds (a
    timeout, a day earlier), 1 of a destination not provisioned; the page set to that transport."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = make_store(url, None, "delayed_messages")
    seed(store)
    transport = SqlTableTransport(url)
    for queue in ("error", "orders", "refunds"):
        transport.provision(queue)
    now = utcnow()
    transport.send([
        DelayedMessage("orders", b"o-body-0", now, message_id="dead-0").dead_lettered("error", "503 from orders", now),
        DelayedMessage("orders", b"o-body-1", now, message_id="dead-1").dead_lettered("error", "503 from orders", now),
        DelayedMessage("refunds", b"r-body", now, message_id="dead-2").dead_lettered(
            "error", "timed out", now - timedelta(days=1)),
        DelayedMessage("gone", b"g-body", now, message_id="dead-3").dead_lettered("error", "no such queue", now),
    ])
    monkeypatch.setenv("AIRFLOW_CONN_DELAY_UI_TEST", json.dumps({"conn_type": "delay_store", "extra": {"url": url}}))
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_CONN_ID", "delay_ui_test")
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT", "sql")
    return store, transport


def _ids(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [d["message_id"] for d in response.json()["dead_letters"]]


def test_dead_letters_are_listed_with_filters_and_bodies_only_for_editors_consuming_nothing(client, dead):  # noqa: F811
    _, transport = dead
    viewer = client("viewer", "GET", "/api/dead-letters").json()
    assert viewer["available"] is True and viewer["can_edit"] is False
    assert [d["message_id"] for d in viewer["dead_letters"]] == ["dead-0", "dead-1", "dead-2", "dead-3"]
    assert all(d["body"] is None and d["body_bytes"] > 0 for d in viewer["dead_letters"])
    [first] = [d for d in client("admin", "GET", "/api/dead-letters").json()["dead_letters"] if d["message_id"] ==
               "dead-0"]
    assert (first["body"], first["destination"], first["last_error"]) == ("o-body-0", "orders", "503 from orders")
    assert _ids(client("viewer", "GET", "/api/dead-letters", params={"destination": "orders"})) == ["dead-0", "dead-1"]
    assert _ids(client("viewer", "GET", "/api/dead-letters", params={"message_id": ["dead-2", "dead-3"]})) == [
        "dead-2", "dead-3"]
    assert _ids(client("viewer", "GET", "/api/dead-letters", params={"failure": "TIMED"})) == ["dead-2"]
    since = (utcnow() - timedelta(hours=1)).isoformat()
    assert _ids(client("viewer", "GET", "/api/dead-letters", params={"since": since})) == ["dead-0", "dead-1",
                                                                                           "dead-3"]
    bad = client("viewer", "GET", "/api/dead-letters", params={"since": "yesterday"})
    assert bad.status_code == 400 and "ISO 8601" in bad.json()["detail"]
    assert len(transport.peek("error", 10)) == 4  # looked at, never consumed


def test_editors_redrive_and_delete_dead_letters_a_dry_run_first_and_viewers_may_not(client, dead):  # noqa: F811
    store, transport = dead
    for path, body in (("redrive", {"message_ids": ["dead-0"]}), ("delete", {"everything": True, "dry_run": False})):
        assert client("viewer", "POST", f"/api/dead-letters/{path}", json=body).status_code == 403
    neither = client("admin", "POST", "/api/dead-letters/delete", json={})
    assert neither.status_code == 400 and "everything" in neither.json()["detail"]
    before = len(audit.recent(200))

    redriven = client("admin", "POST", "/api/dead-letters/redrive", json={"destination": "orders"}).json()
    assert redriven["redriven"] == 2 and redriven["destinations"] == {"orders": 2}
    assert store.count_scheduled()["orders"] == 8  # the seeded 6 and the 2 redriven
    # A destination that is not provisioned: left in the error queue, with the reason.
    kept = client("admin", "POST", "/api/dead-letters/redrive", json={"message_ids": ["dead-3"]}).json()
    assert kept["redriven"] == 0 and "'gone' is not provisioned" in kept["skipped_messages"][0]["reason"]

    dry = client("user", "POST", "/api/dead-letters/delete", json={"everything": True}).json()
    assert dry["dry_run"] is True and dry["would_delete"] == 2
    assert _ids(client("viewer", "GET", "/api/dead-letters")) == ["dead-2", "dead-3"]
    gone = client("user", "POST", "/api/dead-letters/delete", json={"message_ids": ["dead-2"], "dry_run": False})
    assert gone.json()["deleted"] == 1
    assert _ids(client("viewer", "GET", "/api/dead-letters")) == ["dead-3"]

    recorded = audit.recent(200)[: len(audit.recent(200)) - before]
    assert [(a["action"], a["user"]) for a in recorded] == [
        ("delete_dead_letters", "user"), ("redrive", "admin"), ("redrive", "admin")]  # not the dry run
    assert recorded[0]["counts"] == {"deleted": 1} and recorded[2]["counts"] == {"redriven": 2}


def test_without_a_transport_set_the_page_says_what_to_set(client, dead, monkeypatch):  # noqa: F811
    monkeypatch.delenv("AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT")
    listing = client("viewer", "GET", "/api/dead-letters").json()
    assert listing["available"] is False and "ui_transport" in listing["reason"]
    refused = client("admin", "POST", "/api/dead-letters/redrive", json={"everything": True})
    assert refused.status_code == 400 and "ui_transport" in refused.json()["detail"]
