"""Every action on delayed messages in Airflow's audit log (the `log` table, Browse > Audit Log, the REST API's
event logs), with its user, what it acted on and its counts: from the page, in Airflow's own api-server app, and
from `airflow delayed-messages`, parsed by Airflow's own command line."""

from __future__ import annotations

import getpass
import json
import uuid

from airflow_delay_provider import audit
from tests.integration.test_cli import _cli, _schedule, on_sqlite  # noqa: F401 - a fixture
from tests.integration.test_ui_plugin import airflow_app, client, store  # noqa: F401 - fixtures


def test_the_pages_actions_are_in_airflows_audit_log_with_their_user_target_and_counts(client, store):  # noqa: F811
    before = len(audit.recent(200))
    assert client("admin", "POST", "/api/cancel", json={"message_ids": ["orders-0", "nope"]}).status_code == 200
    assert client("admin", "POST", "/api/pause", json={"destinations": ["orders"]}).status_code == 200
    dry = client("admin", "POST", "/api/purge", json={"destination": "orders", "dry_run": True}).json()
    assert dry["would_purge"] == 5
    assert client("viewer", "POST", "/api/cancel", json={"destination": "orders"}).status_code == 403
    assert client("user", "POST", "/api/purge", json={"destination": "orders", "dry_run": False}).json()["purged"] == 5
    # Newest first; the dry run and the refused action are not there.
    listed = client("viewer", "GET", "/api/actions", params={"limit": 200}).json()["actions"]
    assert len(audit.recent(200)) == before + 3
    latest = listed[:3]
    assert [(a["action"], a["user"], a["source"]) for a in latest] == [
        ("purge", "user", "page"), ("pause", "admin", "page"), ("cancel", "admin", "page")]
    assert latest[2]["counts"] == {"cancelled": 1, "unknown": 1}
    assert latest[2]["target"] == {"message_ids": ["orders-0", "nope"]}
    assert latest[1]["counts"] == {"changed": 1} and latest[1]["target"] == {"destinations": ["orders"]}
    assert latest[0]["counts"] == {"purged": 5} and latest[0]["target"] == {"destination": "orders"}
    # Where Airflow shows its own: the REST API's event logs (the Audit Log view reads them).
    logs = client("admin", "GET", "/../api/v2/eventLogs",
                  params={"event": "delayed_messages.purge", "order_by": "-when", "limit": 1}).json()
    [entry] = logs["event_logs"]
    assert entry["owner"] == "user" and json.loads(entry["extra"])["counts"] == {"purged": 5}
    assert not any("order 0" in json.dumps(a) for a in listed)  # no body, ever


def test_the_command_lines_actions_are_in_the_audit_log_and_its_dry_runs_are_not(on_sqlite):  # noqa: F811
    conn_id, cli_store, queues = on_sqlite
    queues.provision("error")
    ids = _schedule(cli_store, "orders", 3)
    before = audit.recent(200)
    assert _cli("cancel", "--conn-id", conn_id, "--id", ids[0], "--header", "k=0").returncode == 0
    assert _cli("purge", "--conn-id", conn_id, "--destination", "orders").returncode == 0  # a dry run
    assert _cli("dead-letters", "--conn-id", conn_id).returncode == 0  # a listing changes nothing
    assert _cli("purge", "--conn-id", conn_id, "--destination", "orders", "--yes").returncode == 0
    added = audit.recent(200)[: len(audit.recent(200)) - len(before)]
    assert [(a["action"], a["user"], a["source"]) for a in added] == [
        ("purge", getpass.getuser(), "cli"), ("cancel", getpass.getuser(), "cli")]
    assert added[1]["target"] == {"message_ids": [ids[0]], "headers": {"k": "0"}}
    assert added[1]["counts"] == {"cancelled": 1, "unknown": 0}
    assert added[0]["counts"] == {"purged": 2} and added[0]["target"] == {"destination": "orders"}
    assert all(a in audit.recent(200, conn_id) for a in added)
    assert not any(a in audit.recent(200, "another_connection") for a in added)


def test_an_edit_from_the_page_changes_the_message_and_the_audit_log_names_it_without_its_body(client, store):  # noqa: F811
    message = store.get("orders-1")
    change = {"message_id": "orders-1", "body": "secret new body", "headers": {"k": "v"}}
    assert client("viewer", "POST", "/api/edit", json=change).status_code == 403
    assert store.get("orders-1") == message
    report = client("user", "POST", "/api/edit", json=change).json()
    assert report["edited"] == ["orders-1"]
    now = store.get("orders-1")
    assert (now.body, now.headers, now.due_at) == (b"secret new body", {"k": "v"}, message.due_at)
    refused = client("user", "POST", "/api/edit", json={"message_id": "orders-1"})
    assert refused.status_code == 400 and "an edit needs a new body and/or new headers" in refused.text
    [latest] = client("viewer", "GET", "/api/actions", params={"limit": 1}).json()["actions"]
    assert (latest["action"], latest["user"], latest["target"], latest["counts"]) == (
        "edit", "user", {"message_id": "orders-1"}, {"edited": 1, "unknown": 0})
    assert "secret new body" not in json.dumps(latest) and '"k"' not in json.dumps(latest["target"])


def test_recent_finds_one_connections_actions_behind_many_of_others(on_sqlite):  # noqa: F811
    """Filtered in the query: 12 newer actions of other connections do not hide the older one asked for, and a
    connection id with LIKE's wildcards matches only itself."""
    mine = f"mine_{uuid.uuid4().hex[:6]}"
    assert audit.record("cancel", "me", "cli", mine, {"message_ids": ["a"]}, {"cancelled": ["a"]})
    for i in range(12):
        other = mine.replace("_", "X") if i % 2 else f"{mine}2"
        assert audit.record("pause", "me", "cli", other, {"destinations": ["d"]}, {"changed": ["d"]})
    [found] = audit.recent(1, mine)
    assert (found["action"], found["target"]) == ("cancel", {"message_ids": ["a"]})
    assert [a["action"] for a in audit.recent(50, mine)] == ["cancel"]
    assert len(audit.recent(50, f"{mine}2")) == 6
