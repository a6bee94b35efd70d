"""The backlog page (Browse > Delayed messages): the plugin as Airflow loads it; its JSON endpoints in
Airflow's own api-server app, behind SimpleAuthManager's roles, on a real store (SQLite and the real
PostgreSQL); and the page in a real browser (Debian's chromium) against `airflow api-server`."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import HEADER_FAILED_DESTINATION, HEADER_GAVE_UP, DelayedMessage
from airflow_delay_provider.core.pump import Pump, PumpConfig
from airflow_delay_provider.core.retry_policy import DeliveryPolicy
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport
from airflow_delay_provider.ui.plugin import URL_PREFIX, URL_ROUTE, DelayBacklogPlugin
from tests.browser_helpers import (
    BIN_DIR,
    PASSWORDS,
    airflow_env,
    airflow_process,
    backlog_page,
    get_json,
    launch_chromium,
    log_in,
    require_chromium,
    screenshot_path,
)
from tests.conftest import PG_URL, copy_migrated_sqlite
from tests.helpers import make_store, make_transport
from tests.integration.test_pump import FlakyTransport
from tests.services import free_port
from tests.shared import Shared

SIMPLE_AUTH_MANAGER = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
USERS = "admin:admin,viewer:viewer,user:user"
ACTIONS = {  # every POST of the page, with a body that would change something
    "cancel": {"message_ids": ["orders-0"]},
    "run-now": {"message_ids": ["orders-5"]},
    "pause": {"destinations": ["orders"]},
    "resume": {"destinations": ["refunds"]},
    "purge": {"destination": "orders", "dry_run": False},
    "reschedule": {"destination": "orders", "delay_seconds": 60},
    "pause-messages": {"headers": {"tenant": "acme"}},
    "resume-messages": {"destination": "orders"},
    "count": {"destination": "orders"},
}


def seed(store: SqlDelayedMessageStore) -> None:
    """orders: 6 messages (2 due) with 300-byte bodies; refunds: 2 due, paused."""
    now = utcnow()
    dues = [-60, -30, 1800, 7200, 40_000, 200_000]
    store.store([DelayedMessage("orders", f"<b>order {i}</b>".encode().ljust(300, b"."), now + timedelta(seconds=s),
                                {"order-id": str(i), "tenant": "zenith" if i % 2 else "acme"}, message_id=f"orders-{i}")
                 for i, s in enumerate(dues)])
    store.store([DelayedMessage("refunds", b"r", now - timedelta(seconds=10 - i), {"refund": str(i)},
                                message_id=f"refunds-{i}") for i in range(2)])
    store.set_paused(["refunds"], True)


# -- Airflow's api-server app, in this process ----------------------------------------------------------------
@pytest.fixture(scope="module")
def airflow_app(airflow_home):
    """Airflow's own api-server app (`create_app`, plugins mounted as in `airflow api-server`), with
    SimpleAuthManager's users admin, viewer and user; yields (app, {role: JWT})."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW__CORE__AUTH_MANAGER", SIMPLE_AUTH_MANAGER)
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", USERS)
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "False")
        mp.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "a-secret-of-this-test-run-only-" + "x" * 40)
        from airflow.api_fastapi.app import create_app, get_auth_manager
        from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

        app = create_app()
        tokens = {role: get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=role, role=role))
                  for role in ("admin", "viewer", "user")}
        tokens["nobody"] = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="nobody", role=None))
        yield app, tokens


@pytest.fixture(scope="module")
def client(airflow_app):
    from fastapi.testclient import TestClient

    app, tokens = airflow_app
    with TestClient(app) as test_client:
        def call(role: str | None, method: str, path: str, **kwargs):
            headers = {"Authorization": f"Bearer {tokens[role]}"} if role else {}
            return test_client.request(method, URL_PREFIX + path, headers=headers, follow_redirects=False, **kwargs)

        yield call


@pytest.fixture
def store(db, monkeypatch):
    """A seeded store on each database, and the page pointed at it through `[delay_provider] ui_conn_id`."""
    url, schema, table = db
    store = make_store(url, schema, table)
    seed(store)
    extra = {"url": url, "table": table, **({"db_schema": schema} if schema else {})}
    monkeypatch.setenv("AIRFLOW_CONN_DELAY_UI_TEST", json.dumps({"conn_type": "delay_store", "extra": extra}))
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_CONN_ID", "delay_ui_test")
    return store


def test_airflow_loads_the_plugin_from_the_entry_point_only(airflow_app, client):
    from airflow import plugins_manager

    from airflow_delay_provider.get_provider_info import get_provider_info

    [entry] = [e for e in entry_points(group="airflow.plugins") if e.name == "delay_backlog"]
    assert entry.load() is DelayBacklogPlugin
    # Not also in the provider's own list, which [core] lazy_discover_providers = False loads besides.
    assert "plugins" not in get_provider_info()
    assert DelayBacklogPlugin not in plugins_manager._load_providers_plugins()[0]

    apps, _ = plugins_manager.get_fastapi_plugins()
    assert [a["url_prefix"] for a in apps if a["name"] == "Delayed messages backlog"] == [URL_PREFIX]
    views, _ = plugins_manager._get_ui_plugins()
    [view] = [v for v in views if v["url_route"] == URL_ROUTE]
    assert view == {"name": "Delayed messages", "href": "/delay-backlog/", "icon": "/delay-backlog/static/icon.svg",
                    "url_route": "delayed-messages", "category": "browse", "destination": "nav"}

    app, tokens = airflow_app
    from fastapi.testclient import TestClient

    listed = TestClient(app).get("/api/v2/plugins", headers={"Authorization": f"Bearer {tokens['viewer']}"}).json()
    [plugin] = [p for p in listed["plugins"] if p["name"] == "delay_backlog"]
    assert plugin["external_views"][0]["href"] == "/delay-backlog/"
    assert plugin["fastapi_apps"][0]["url_prefix"] == URL_PREFIX


@pytest.mark.parametrize("lazy_discover_providers", ["default", "False"])
def test_airflow_loads_the_plugin_once_and_reports_no_plugin_import_error(tmp_path, lazy_discover_providers):
    """An Airflow of its own (AIRFLOW_HOME, configuration) as `airflow plugins` and the api-server see it."""
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", None)
    env.pop("AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS", None)
    if lazy_discover_providers != "default":
        env["AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS"] = lazy_discover_providers

    def run(*args: str) -> tuple[str, str]:
        # Not in the source tree: its setuptools metadata (*.egg-info) would be a second copy of the package.
        done = subprocess.run(args, capture_output=True, text=True, check=True, env=env, cwd=tmp_path, timeout=300)
        return done.stdout.strip().splitlines()[-1], done.stdout + done.stderr

    listing, listing_output = run(str(BIN_DIR / "airflow"), "plugins", "-o", "json")
    assert [p["name"] for p in json.loads(listing)].count("delay_backlog") == 1
    errors, errors_output = run(sys.executable, "-c", "import json; from airflow import plugins_manager; "
                                                      "print(json.dumps(plugins_manager.get_import_errors()))")
    assert json.loads(errors) == {}
    assert "already registered" not in listing_output + errors_output


def test_without_a_login_the_page_sends_to_airflow_login_and_the_api_refuses(client):
    page = client(None, "GET", "/")
    assert page.status_code == 307 and page.headers["location"].startswith("/auth/login?next=")
    assert client(None, "GET", "/api/backlog").status_code == 401
    assert client(None, "GET", "/api/messages").status_code == 401
    assert client(None, "POST", "/api/cancel", json=ACTIONS["cancel"]).status_code == 401


def test_the_page_and_its_files_carry_a_strict_content_security_policy(client):
    page = client("viewer", "GET", "/")
    assert page.status_code == 200 and "<title>Delayed messages</title>" in page.text
    for response in (page, client(None, "GET", "/static/backlog.js")):
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'self'" in policy
        assert response.headers["x-content-type-options"] == "nosniff"


def test_a_user_without_a_role_may_not_read(client, store):
    assert client("nobody", "GET", "/api/backlog").status_code == 403
    assert client("nobody", "GET", "/api/messages").status_code == 403


def test_a_viewer_reads_counts_and_messages_without_bodies_and_every_action_is_refused(client, store):
    backlog = client("viewer", "GET", "/api/backlog").json()
    assert backlog["can_edit"] is False and backlog["user"] == "viewer" and backlog["conn_id"] == "delay_ui_test"
    orders, refunds = backlog["destinations"]["orders"], backlog["destinations"]["refunds"]
    assert (orders["scheduled"], orders["due"], orders["paused"]) == (6, 2, False)
    assert orders["histogram"] == {"due": 2, "next_minute": 0, "next_hour": 1, "next_day": 2, "later": 1}
    assert (refunds["scheduled"], refunds["due"], refunds["paused"]) == (2, 2, True)
    page = client("viewer", "GET", "/api/messages").json()
    assert len(page["messages"]) == 8 and page["can_edit"] is False
    assert all("body" not in m and m["body_bytes"] > 0 for m in page["messages"])

    before = store.count_scheduled(), store.destinations()
    for action, body in [*ACTIONS.items(), ("purge", {"destination": "orders", "dry_run": True})]:
        response = client("viewer", "POST", f"/api/{action}", json=body)
        assert response.status_code == 403, (action, response.text)
        assert "edit access" in response.json()["detail"]
    assert (store.count_scheduled(), store.destinations()) == before


def test_an_admin_sees_bodies_cut_short_and_cancels_runs_now_pauses_resumes_and_purges(client, store):
    [message] = client("admin", "GET", "/api/messages", params={"message_id": "orders-2"}).json()["messages"]
    assert message["body"].startswith("<b>order 2</b>") and len(message["body"]) == 200
    assert message["body_truncated"] is True and message["body_bytes"] == 300

    cancelled = client("admin", "POST", "/api/cancel", json={"message_ids": ["orders-0", "nope"]}).json()
    assert cancelled["cancelled"] == ["orders-0"] and cancelled["unknown"] == ["nope"]
    assert store.get("orders-0") is None

    ran = client("admin", "POST", "/api/run-now", json={"message_ids": ["orders-5"]}).json()
    assert ran["rescheduled"] == ["orders-5"]
    assert store.get("orders-5").due_at <= utcnow()

    assert client("admin", "POST", "/api/pause", json={"destinations": ["orders"]}).json()["changed"] == ["orders"]
    assert client("admin", "GET", "/api/backlog").json()["destinations"]["orders"]["paused"] is True
    assert client("admin", "POST", "/api/resume", json={"destinations": ["orders", "refunds"]}).json() == {
        "paused": False, "changed": ["orders", "refunds"], "unchanged": []}
    assert not any(d["paused"] for d in store.destinations().values())

    dry = client("admin", "POST", "/api/purge", json={"destination": "orders", "dry_run": True}).json()
    assert dry == {"destination": "orders", "dry_run": True, "would_purge": 5, "in_flight": 0}
    assert store.count_scheduled()["orders"] == 5
    purged = client("admin", "POST", "/api/purge", json={"destination": "orders", "dry_run": False}).json()
    assert purged["purged"] == 5
    assert store.count_scheduled() == {"refunds": 2}

    refused = client("admin", "POST", "/api/forget", json={"destinations": ["refunds"]})
    assert refused.status_code == 400 and "still have scheduled messages" in refused.json()["detail"]
    forgot = client("admin", "POST", "/api/forget", json={"destinations": ["orders"]}).json()
    assert forgot["forgotten"] == ["orders"] and forgot["purged"] == {"orders": 0}
    assert "orders" not in client("admin", "GET", "/api/backlog").json()["destinations"]


def test_simple_auth_managers_user_role_may_edit_dags_so_it_may_act(client, store):
    response = client("user", "POST", "/api/cancel", json={"destination": "refunds"})
    assert response.status_code == 200 and response.json()["counts"]["cancelled"] == 2


def test_search_by_destination_header_and_id_and_page_through(client, store):
    def ids(**params):
        return [m["message_id"] for m in client("viewer", "GET", "/api/messages", params=params).json()["messages"]]

    assert ids(destination="refunds") == ["refunds-0", "refunds-1"]
    assert ids(header="tenant=zenith") == ["orders-1", "orders-3", "orders-5"]
    assert ids(header=["tenant=acme", "order-id=2"]) == ["orders-2"]
    assert ids(message_id="orders-4") == ["orders-4"]
    seen, after = [], None
    while True:
        page = client("viewer", "GET", "/api/messages", params={"limit": 3, **({"after": after} if after else {})})
        seen += [m["message_id"] for m in page.json()["messages"]]
        if not (after := page.json()["next"]):
            break
    assert seen == ["orders-0", "orders-1", "refunds-0", "refunds-1", "orders-2", "orders-3", "orders-4", "orders-5"]


def test_a_filter_is_counted_then_changed_by_editors_and_searching_bodies_is_theirs_too(client, store):
    """By a due window, a header and a body text: the count first (changing nothing), then cancel, run now and
    reschedule of what matches; a viewer may not search bodies, count or act, and sees a body search hidden in
    the recent actions."""
    now = utcnow()

    def ids(role="admin", **params):
        response = client(role, "GET", "/api/messages", params=params)
        assert response.status_code == 200, response.text
        return [m["message_id"] for m in response.json()["messages"]]

    assert ids(body_contains="order 3") == ["orders-3"]
    assert ids(due_from=now.isoformat(), due_before=(now + timedelta(hours=3)).isoformat()) == ["orders-2", "orders-3"]
    refused = client("viewer", "GET", "/api/messages", params={"body_contains": "order"})
    assert refused.status_code == 403 and "searching message bodies" in refused.json()["detail"]
    assert client("viewer", "POST", "/api/count", json={"destination": "orders"}).status_code == 403

    zenith = {"headers": {"tenant": "zenith"}, "due_from": (now - timedelta(hours=1)).isoformat()}
    counted = client("user", "POST", "/api/count", json=zenith).json()
    assert (counted["would_cancel"], counted["in_flight"], counted["confirm"]) == (3, 0, False)
    assert client("user", "POST", "/api/count", json={**zenith, "action": "run_now"}).json()["would_reschedule"] == 3
    assert store.count_scheduled() == {"orders": 6, "refunds": 2}  # counting changed nothing
    later = (now + timedelta(days=5)).isoformat()
    moved = client("user", "POST", "/api/reschedule", json={**zenith, "deliver_at": later}).json()
    assert sorted(moved["rescheduled"]) == ["orders-1", "orders-3", "orders-5"] and moved["counts"]["in_flight"] == 0
    assert {store.get(f"orders-{i}").due_at.isoformat() for i in (1, 3, 5)} == {later}
    ran = client("user", "POST", "/api/run-now", json={"body_contains": "order 5"}).json()
    assert ran["rescheduled"] == ["orders-5"] and store.get("orders-5").due_at <= utcnow()
    gone = client("admin", "POST", "/api/cancel", json={"destination": "orders", "body_contains": "order",
                                                        "due_from": (now + timedelta(days=1)).isoformat()}).json()
    assert sorted(gone["cancelled"]) == ["orders-1", "orders-3"] and gone["batches"] == 1
    assert store.count_scheduled() == {"orders": 4, "refunds": 2}

    seen = {role: client(role, "GET", "/api/actions").json()["actions"][0] for role in ("admin", "viewer")}
    assert seen["admin"]["action"] == "cancel" and seen["admin"]["counts"] == {"cancelled": 2}
    assert seen["admin"]["target"]["body_contains"] == "order"
    assert seen["viewer"]["target"]["body_contains"] == "(hidden)"
    bad = client("admin", "POST", "/api/cancel", json={"body_contains": "x" * 201})
    assert bad.status_code == 422


def test_editors_pause_a_filter_the_page_marks_and_counts_it_held_and_a_resume_releases_it(client, store):
    """A pause by a header match: counted first, then every reader sees the messages held (in the list, the counts
    and a story), a claim passes over them, and a resume by ids and one by the filter release them; the audit log
    has each with its user and counts."""
    acme = {"headers": {"tenant": "acme"}}
    assert client("user", "POST", "/api/count", json={**acme, "action": "pause"}).json()["would_pause"] == 3
    paused = client("user", "POST", "/api/pause-messages", json=acme).json()
    assert sorted(paused["paused"]) == ["orders-0", "orders-2", "orders-4"] and paused["counts"]["paused"] == 3
    page = client("viewer", "GET", "/api/messages", params={"destination": "orders"}).json()["messages"]
    assert {m["message_id"]: m["held"] for m in page} == {f"orders-{i}": i % 2 == 0 for i in range(6)}
    assert client("viewer", "GET", "/api/backlog").json()["destinations"]["orders"]["held"] == 3
    assert client("viewer", "GET", "/api/story", params={"message_id": "orders-0"}).json()["state"] == "held"
    with store.claim_due(utcnow(), 10) as claim:  # orders-0 is due: held, it is not taken
        assert sorted(m.message_id for m in claim.messages) == ["orders-1"]
    assert client("user", "POST", "/api/count", json={**acme, "action": "resume"}).json()["would_resume"] == 3

    one = client("admin", "POST", "/api/resume-messages", json={"message_ids": ["orders-2"]}).json()
    assert one["resumed"] == ["orders-2"]
    rest = client("user", "POST", "/api/resume-messages", json=acme).json()
    assert sorted(rest["resumed"]) == ["orders-0", "orders-4"]
    assert client("viewer", "GET", "/api/backlog").json()["destinations"]["orders"]["held"] == 0
    actions = client("viewer", "GET", "/api/actions", params={"limit": 3}).json()["actions"]
    assert [(a["action"], a["user"], a["counts"]) for a in actions] == [
        ("resume_messages", "user", {"resumed": 2}), ("resume_messages", "admin", {"resumed": 1, "unknown": 0}),
        ("pause_messages", "user", {"paused": 3})]
    assert actions[-1]["target"] == {"headers": {"tenant": "acme"}}


def test_bad_input_is_a_400_that_says_why(client, store):
    url = store.url
    server = [store.table_name, url.database if url.get_backend_name() == "sqlite" else f"{url.host}:{url.port}",
              *([f"{url.username}@", store.schema] if url.get_backend_name() == "postgresql" else [])]

    def detail(method, path, status=400, **kwargs):
        response = client("admin", method, path, **kwargs)
        assert response.status_code == status, response.text
        # The user's own mistake, said plainly; nothing of the server's (its database, schema or table).
        assert not [part for part in server if part in response.text], response.text
        return response.json()["detail"]

    assert "key=value" in detail("GET", "/api/messages", params={"header": "tenant"})
    assert "cursor" in detail("GET", "/api/messages", params={"after": "garbage"})
    assert "would apply to every message" in detail("POST", "/api/cancel", json={})
    assert "unknown destination" in detail("POST", "/api/pause", json={"destinations": ["nowhere"]})
    assert "unknown destination" in detail("POST", "/api/purge", json={"destination": "nowhere"})
    assert "application/json" in detail("POST", "/api/cancel", status=415, data={"message_ids": "orders-1"})
    detail("GET", "/api/messages", status=422, params={"limit": 0})
    assert store.count_scheduled() == {"orders": 6, "refunds": 2}


# -- the delivery history: made by a real pump, read by each role -------------------------------------------------
#: Two retries at once, then the error queue: a failed send is due again straight away.
RETRY_AT_ONCE = DeliveryPolicy(1, 1, 2, num_no_delay_retries=2)


def deliver_due(store, transport: SqlTableTransport, fail: dict[str, int]) -> None:
    """A pump of the test's own hands over everything due to `transport`'s queues, batch after batch until nothing is
    (a retry is due again at once), sends to `fail`'s destinations failing that many times first; a destination
    without a queue is dead-lettered to `error`."""
    pump = Pump(store, FlakyTransport(transport, fail), PumpConfig(retry_jitter=0), policy=RETRY_AT_ONCE,
                sleep=lambda _s: None)
    while (stats := pump.dispatch_batch()) is not None and stats.batches:
        pass
    assert stats is not None, "the store failed during the dispatch"


@pytest.fixture
def delivered(store, db):
    """The seeded store after a pump's work: orders-0 and orders-1 delivered, ship-1 retried once then delivered,
    ship-2 delivered, lost-1 dead-lettered (its destination has no queue), and orders-2 cancelled through the page."""
    url, schema, table = db
    now = utcnow()
    store.store([DelayedMessage("shipments", b'{"parcel": 1}', now - timedelta(seconds=3), {}, "ship-1"),
                 DelayedMessage("shipments", b'{"parcel": 2}', now - timedelta(seconds=2), {}, "ship-2"),
                 DelayedMessage("nowhere", b'{"lost": true}', now - timedelta(seconds=1), {}, "lost-1")])
    deliver_due(store, make_transport(url, schema, table, "orders", "shipments", "error"), {"shipments": 1})
    assert store.get("ship-1") is None and store.get("lost-1") is None
    return store


def history_of(client, role, **params) -> dict:
    response = client(role, "GET", "/api/history", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_every_reader_reads_the_history_newest_first_by_outcome_and_destination_with_no_bodies(client, delivered):
    cancelled = client("admin", "POST", "/api/cancel", json={"message_ids": ["orders-2"]}).json()
    assert cancelled["cancelled"] == ["orders-2"]
    found = history_of(client, "viewer")
    assert found["history_days"] == 7 and found["next"] is None
    entries = found["entries"]
    assert sorted((e["message_id"], e["outcome"], e["attempts"]) for e in entries) == [
        ("lost-1", "dead_lettered", 1), ("orders-0", "delivered", 1), ("orders-1", "delivered", 1),
        ("orders-2", "cancelled", 0), ("ship-1", "delivered", 2), ("ship-1", "retried", 1), ("ship-2", "delivered", 1)]
    assert [e["handed_at"] for e in entries] == sorted((e["handed_at"] for e in entries), reverse=True)
    assert entries[0]["message_id"] == "orders-2"  # the cancel came last
    assert all("body" not in e and "headers" not in e for e in entries)
    [lost] = [e for e in entries if e["message_id"] == "lost-1"]
    assert lost["destination"] == "nowhere" and "not found" in lost["detail"] and lost["stored_at"]
    [retried] = [e for e in entries if e["outcome"] == "retried"]
    assert retried["detail"] == "ConnectionError: shipments refused" and retried["lateness_ms"] >= 0
    assert history_of(client, "admin") == found  # an editor reads the same

    def ids(**params):
        return [(e["message_id"], e["outcome"]) for e in history_of(client, "viewer", **params)["entries"]]

    assert ids(outcome="dead_lettered") == [("lost-1", "dead_lettered")]
    assert ids(outcome="retried") == [("ship-1", "retried")]
    assert sorted(ids(destination="shipments")) == [("ship-1", "delivered"), ("ship-1", "retried"),
                                                   ("ship-2", "delivered")]
    assert ids(message_id="ship-1") == [("ship-1", "retried"), ("ship-1", "delivered")]  # a story's order
    newest = entries[0]["handed_at"]
    assert ("orders-2", "cancelled") not in ids(before=newest)
    assert ids(since=newest) == [("orders-2", "cancelled")]


def test_pages_of_the_history_follow_the_cursor_through_a_batch_handed_over_at_one_time(client, delivered):
    """The pump hands a batch over at one time: paging by `after` (the `next` of the page before) shows each entry
    once, where the page's last time alone (`before`) would skip the rest of its batch."""
    everything = [(e["message_id"], e["outcome"]) for e in history_of(client, "viewer")["entries"]]
    seen, after, pages = [], None, 0
    while pages < 5:  # 6 entries, 2 a page: 3 pages (a cursor that went unheard would never end)
        page = history_of(client, "viewer", limit=2, **({"after": after} if after else {}))
        seen += [(e["message_id"], e["outcome"]) for e in page["entries"]]
        pages += 1
        if not (after := page["next"]):
            break
    assert seen == everything and pages == 3
    assert client("viewer", "GET", "/api/history", params={"after": "garbage"}).status_code == 400


def test_the_history_chart_counts_each_minute_for_every_reader(client, delivered):
    chart = client("viewer", "GET", "/api/history/chart").json()
    assert chart["window"] == "1h" and chart["destination"] is None and chart["history_days"] == 7
    assert chart["since"] < chart["until"]
    minutes = chart["minutes"]
    assert sum(m["delivered"] for m in minutes) == 4
    assert (sum(m["retried"] for m in minutes), sum(m["dead_lettered"] for m in minutes)) == (1, 1)
    assert all(m["p50_ms"] is not None and 0 <= m["p50_ms"] <= m["p99_ms"] for m in minutes if m["delivered"])
    assert all(chart["since"][:16] <= m["minute"][:16] and m["minute"] < chart["until"] for m in minutes)
    for window in ("6h", "24h"):
        wider = client("admin", "GET", "/api/history/chart", params={"window": window}).json()
        assert wider["window"] == window and sum(m["delivered"] for m in wider["minutes"]) == 4
    ships = client("viewer", "GET", "/api/history/chart", params={"destination": "shipments"}).json()
    assert ships["destination"] == "shipments"
    assert [(m["delivered"], m["retried"], m["dead_lettered"]) for m in ships["minutes"]] in (
        [(2, 1, 0)], [(1, 1, 0), (1, 0, 0)])  # a retry may be handed over in the next minute
    assert client("viewer", "GET", "/api/history/chart", params={"destination": "refunds"}).json()["minutes"] == []


def test_a_story_shows_each_attempt_and_a_scheduled_messages_body_only_to_editors(client, delivered):
    def story(role, message_id):
        response = client(role, "GET", "/api/story", params={"message_id": message_id})
        assert response.status_code == 200, response.text
        return response.json()

    flaky = story("viewer", "ship-1")
    assert flaky["state"] == "delivered" and flaky["scheduled"] is None and flaky["stored_at"]
    assert [(s["outcome"], s["attempts"]) for s in flaky["history"]] == [("retried", 1), ("delivered", 2)]
    assert "shipments refused" in flaky["history"][0]["detail"]
    assert story("viewer", "lost-1")["state"] == "dead_lettered"
    assert story("viewer", "never-sent") == {"message_id": "never-sent", "state": "unknown", "scheduled": None,
                                             "stored_at": None, "history": [], "history_days": 7}

    seen = story("viewer", "orders-4")
    assert seen["state"] == "scheduled" and seen["history"] == []
    assert seen["scheduled"]["headers"] == {"order-id": "4", "tenant": "acme"}
    assert seen["scheduled"]["body_bytes"] == 300 and "body" not in seen["scheduled"]
    assert "order 4" not in json.dumps(seen)
    for editor in ("user", "admin"):
        assert story(editor, "orders-4")["scheduled"]["body"].startswith("<b>order 4</b>")


def test_the_history_refuses_a_reader_without_a_role_and_says_which_window_and_outcome_are_allowed(client, store):
    for path, params in (("/api/history", {}), ("/api/history/chart", {}), ("/api/story", {"message_id": "x"})):
        assert client("nobody", "GET", path, params=params).status_code == 403
        assert client(None, "GET", path, params=params).status_code == 401
    window = client("viewer", "GET", "/api/history/chart", params={"window": "2h"})
    assert window.status_code == 422 and all(w in window.text for w in ("'1h'", "'6h'", "'24h'")), window.text
    outcome = client("viewer", "GET", "/api/history", params={"outcome": "lost"})
    assert outcome.status_code == 422, outcome.text
    assert all(o in outcome.text for o in ("delivered", "retried", "dead_lettered", "cancelled")), outcome.text
    assert client("viewer", "GET", "/api/story", params={"message_id": ""}).status_code == 422
    assert client("viewer", "GET", "/api/history", params={"limit": 0}).status_code == 422
    assert client("viewer", "GET", "/api/history", params={"since": "yesterday"}).status_code == 400


def test_with_history_days_0_the_page_is_told_that_no_history_is_kept(client, db, monkeypatch):
    url, schema, table = db
    store = SqlDelayedMessageStore(url, table=table, schema=schema, history_days=0)
    store.create_schema()
    store.store([DelayedMessage("orders", b"x", utcnow(), {}, "off-1")])
    deliver_due(store, make_transport(url, schema, table, "orders"), {})
    extra = {"url": url, "table": table, "history_days": 0, **({"db_schema": schema} if schema else {})}
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_CONN_ID", _conn(monkeypatch, "delay_ui_off", extra))
    assert history_of(client, "viewer") == {"entries": [], "next": None, "history_days": 0}
    chart = client("viewer", "GET", "/api/history/chart").json()
    assert (chart["minutes"], chart["history_days"]) == ([], 0)
    assert client("viewer", "GET", "/api/story", params={"message_id": "off-1"}).json()["state"] == "unknown"


def test_with_a_transport_set_the_page_counts_its_dead_letters_per_destination(client, monkeypatch, tmp_path):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    seed(make_store(url, None, "delayed_messages"))
    transport = SqlTableTransport(url)  # the `sql` transport of the store's own database
    transport.provision("error")
    now = utcnow()
    transport.send([DelayedMessage(d, b"x", now, message_id=f"dead-{i}").dead_lettered("error", "503", now)
                    for i, d in enumerate(["orders", "orders", "refunds"])])
    monkeypatch.setenv("AIRFLOW_CONN_DELAY_UI_TEST", json.dumps({"conn_type": "delay_store", "extra": {"url": url}}))
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_CONN_ID", "delay_ui_test")
    assert client("viewer", "GET", "/api/backlog").json()["dead_letters"] is None  # no transport set: no column

    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT", "sql")
    assert client("viewer", "GET", "/api/backlog").json()["dead_letters"] == {
        "transport": "sql", "error_queue": "error", "per_destination": {"orders": 2, "refunds": 1}, "total": 3,
        "more": False}
    assert len(transport.peek("error", 10)) == 3  # looked at, not consumed

    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT", "rabbitmq")  # no rabbitmq_default here
    response = client("viewer", "GET", "/api/backlog")
    assert response.status_code == 200 and response.json()["destinations"]["orders"]["scheduled"] == 6
    assert response.json()["dead_letters"]["error"]


# -- what a failure shows: an error id, never the server's details ------------------------------------------
#: The login and database of the connections below: neither may reach a response.
HIDDEN_USER, HIDDEN_DB = "adp_hidden_user", "adp_hidden_db"
HIDDEN_PASSWORD = "adp-hidden-password"
REQUESTS = [  # every endpoint that reaches the store, as the role that may call it
    ("viewer", "GET", "/api/backlog", {}),
    ("viewer", "GET", "/api/messages", {}),
    *[("admin", "POST", f"/api/{action}", {"json": body}) for action, body in ACTIONS.items()],
]


def failure_id(body: dict, *details: str) -> str:
    """The error id `body` carries, after checking that its text names none of `details` and no exception type."""
    text = json.dumps(body)
    for detail in details:
        assert detail not in text, (detail, text)
    assert not re.search(r"\w+(Error|Exception|Warning)\b|Traceback", text), text
    assert re.fullmatch(r"[0-9a-f]{12}", body["error_id"]), body
    return body["error_id"]


def logged(caplog, error_id: str) -> str:
    """The one line of the server's log that carries `error_id`, with its traceback if any."""
    [line] = [r.getMessage() + (r.exc_text or "") for r in caplog.records if error_id in r.getMessage()]
    return line


def _conn(monkeypatch, name: str, extra: dict) -> str:
    monkeypatch.setenv(f"AIRFLOW_CONN_{name.upper()}", json.dumps({"conn_type": "delay_store", "extra": extra}))
    return name


@pytest.fixture
def pg_store(pg, monkeypatch):
    """A store on the real PostgreSQL with orders and refunds scheduled, and the page pointed at it;
    (store, schema, table)."""
    url, schema, table = pg
    store = make_store(url, schema, table)
    seed(store)
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_CONN_ID", _conn(
        monkeypatch, "delay_ui_pg", {"url": url, "table": table, "db_schema": schema}))
    return store, schema, table


@pytest.mark.parametrize("server", ["closed_port", "no_such_database"])
@pytest.mark.parametrize(("role", "method", "path", "kwargs"), REQUESTS, ids=[r[2] for r in REQUESTS])
def test_an_unreachable_store_is_a_503_with_an_error_id_and_the_details_only_in_the_log(
        client, monkeypatch, caplog, server, role, method, path, kwargs):
    # Nothing listens on a free port; the real PostgreSQL has no database of that name.
    real = make_url(PG_URL)
    where = f"127.0.0.1:{free_port()}" if server == "closed_port" else f"{real.host}:{real.port}"
    user = HIDDEN_USER if server == "closed_port" else real.username
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_CONN_ID", _conn(
        monkeypatch, "delay_ui_down", {"url": f"postgresql+psycopg://{user}@{where}/{HIDDEN_DB}"}))
    caplog.set_level(logging.WARNING, logger="airflow_delay_provider")
    response = client(role, method, path, **kwargs)
    assert response.status_code == 503, response.text
    error_id = failure_id(response.json(), f"{user}@", where.split(":")[0], f":{where.split(':')[1]}", HIDDEN_DB)
    assert error_id in response.json()["detail"] and "not reachable" in response.json()["detail"]
    # The connection by its id (the page's 503 view names it), never by its URL.
    assert "of connection 'delay_ui_down'" in response.json()["detail"]
    assert response.json()["conn_id"] == "delay_ui_down"
    line = logged(caplog, error_id)
    assert "UnavailableError" in line and f"{user}@{where}/{HIDDEN_DB}" in line


def test_a_failure_on_a_reachable_store_is_a_500_with_an_error_id_and_the_details_only_in_the_log(
        client, pg_store, caplog):
    store, schema, table = pg_store
    real = make_url(PG_URL)
    with store.engine.begin() as conn:  # a store some other release or hand changed: every read fails
        conn.exec_driver_sql(f'ALTER TABLE "{schema}"."{table}" DROP COLUMN due_at_us')
    caplog.set_level(logging.WARNING, logger="airflow_delay_provider")
    for path in ("/api/backlog", "/api/messages"):
        response = client("viewer", "GET", path)
        assert response.status_code == 500, response.text
        error_id = failure_id(response.json(), schema, table, "due_at_us", f"{real.username}@",
                              f"{real.host}:{real.port}", real.database)
        assert "due_at_us" in logged(caplog, error_id) and table in logged(caplog, error_id)


@pytest.mark.parametrize("mistake", ["undefined_connection", "not_a_store_table"])
def test_a_misconfigured_store_is_the_servers_failure_not_a_400_of_the_users(client, pg, monkeypatch, caplog,
                                                                             mistake):
    url, schema, table = pg
    if mistake == "undefined_connection":
        conn_id, details = "adp_ui_undefined", ("adp_ui_undefined", "AIRFLOW_CONN")
    else:  # another application's table where the store should be
        from sqlalchemy import create_engine

        engine = create_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            conn.exec_driver_sql(f'CREATE TABLE "{schema}"."{table}" (id int)')
        engine.dispose()
        conn_id, details = _conn(monkeypatch, "delay_ui_other", {"url": url, "table": table, "db_schema": schema}), (
            schema, table)
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_CONN_ID", conn_id)
    caplog.set_level(logging.WARNING, logger="airflow_delay_provider")
    for role, method, path, kwargs in REQUESTS:
        response = client(role, method, path, **kwargs)
        assert response.status_code == 500, response.text
        assert all(detail in logged(caplog, failure_id(response.json(), *details)) for detail in details)


@pytest.mark.parametrize("mistake", ["not_provisioned", "postgres_connection"])
def test_a_store_that_is_not_there_is_a_503_saying_what_to_do_and_no_request_creates_it(client, pg, monkeypatch,
                                                                                       caplog, mistake):
    from sqlalchemy import create_engine, text

    url, schema, table = pg
    schema = f"{schema}_ui_{mistake[:3]}"  # a schema nobody created: a typo of the connection's
    real = make_url(PG_URL)
    fields = {"host": real.host, "port": real.port or 5432, "login": real.username, "password": HIDDEN_PASSWORD,
              "schema": real.database}
    conn_id = f"delay_ui_{mistake}"
    extra = {"db_schema": schema, "table": table}
    conn_type = "delay_store" if mistake == "not_provisioned" else "postgres"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": conn_type, **fields,
                                                                      "extra": extra}))
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_CONN_ID", conn_id)
    caplog.set_level(logging.WARNING, logger="airflow_delay_provider")
    engine = create_engine(url)
    try:
        _requests_say_the_store_is_not_there(client, caplog, conn_id, schema, table, mistake)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"),
                                {"s": schema}).scalar() == 0
    finally:
        with engine.begin() as conn:  # had anything made it
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()


def _requests_say_the_store_is_not_there(client, caplog, conn_id: str, schema: str, table: str, mistake: str):
    for role, method, path, kwargs in REQUESTS:
        response = client(role, method, path, **kwargs)
        assert response.status_code == 503, (path, response.text)
        detail = response.json()["detail"]
        assert HIDDEN_PASSWORD not in response.text and "[SQL" not in response.text, response.text
        assert f"connection {conn_id!r}" in detail and response.json()["conn_id"] == conn_id, detail
        if mistake == "not_provisioned":
            assert f"schema {schema!r}" in detail and f"table {table!r}" in detail, detail
            assert f"has no tables yet: run the provisioning DAG or `airflow delayed-messages db upgrade --conn-id " \
                   f"{conn_id}`" in detail, detail
        else:
            assert "is of type 'postgres'; the delay store needs a connection of type 'delay_store'" in detail, detail
        assert response.json()["error_id"] in logged(caplog, response.json()["error_id"])


@pytest.mark.parametrize("failure", ["unreachable_sql_transport", "undefined_rabbitmq_connection"])
def test_a_dead_letter_count_that_fails_shows_an_error_id_and_the_details_only_in_the_log(
        client, pg_store, monkeypatch, caplog, failure):
    port = free_port()
    if failure == "unreachable_sql_transport":  # the transport's database: a closed port
        transport, conn_id = "sql", _conn(monkeypatch, "delay_ui_dead", {
            "url": f"postgresql+psycopg://{HIDDEN_USER}@127.0.0.1:{port}/{HIDDEN_DB}"})
        details, in_log = (HIDDEN_USER, HIDDEN_DB, "127.0.0.1", f":{port}"), f"{HIDDEN_USER}@127.0.0.1:{port}"
    else:
        transport, conn_id = "rabbitmq", "adp_ui_undefined_rabbit"
        details, in_log = (conn_id,), conn_id
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT", transport)
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT_CONN_ID", conn_id)
    caplog.set_level(logging.WARNING, logger="airflow_delay_provider")
    response = client("viewer", "GET", "/api/backlog")
    assert response.status_code == 200 and response.json()["destinations"]["orders"]["scheduled"] == 6
    dead = response.json()["dead_letters"]
    assert dead["transport"] == transport and "per_destination" not in dead
    error_id = failure_id(dead, *details)
    assert error_id in dead["error"] and in_log in logged(caplog, error_id)


def test_a_transport_that_cannot_peek_says_so_without_the_exceptions_text(client, pg_store, rabbit_vhost,
                                                                          monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_RABBIT_UI", json.dumps({
        "conn_type": "rabbitmq", "host": "127.0.0.1", "port": 5672, "login": "guest", "password": "guest",
        "schema": rabbit_vhost}))
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT", "rabbitmq")
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT_CONN_ID", "rabbit_ui")
    dead = client("viewer", "GET", "/api/backlog").json()["dead_letters"]
    # Not a failure (nothing to log): RabbitMQ never shows a message without delivering it.
    assert dead == {"transport": "rabbitmq", "error_queue": "error",
                    "error": "the rabbitmq transport cannot show its error queue without consuming it"}


# -- the page in a real browser, against `airflow api-server` -------------------------------------------------
_API_SERVER = Shared("page_api_server")


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    """`airflow api-server` (one worker) on a free port with a user of each of SimpleAuthManager's roles (named
    after it), and a seeded SQLite store as `delay_store_default`: (base URL, the store). This module's page tests
    run on it first, then test_ui_looks' (tests/shared.py)."""
    require_chromium()
    return _API_SERVER.get(lambda: _api_server(tmp_path_factory.mktemp("api_server")))


@contextmanager
def _api_server(home: Path, ui_transport: str | None = "sql") -> Iterator[tuple[str, SqlDelayedMessageStore]]:
    """The api-server of `api_server`; `ui_transport` None: with no `[delay_provider] ui_transport`, so that the page
    finds the error queues the store recorded (stores/routes.py), none until a test records one."""
    (home / "passwords.json").write_text(json.dumps(PASSWORDS))
    port = free_port()
    env = airflow_env(
        home, port,
        AIRFLOW__CORE__AUTH_MANAGER=SIMPLE_AUTH_MANAGER,
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS=",".join(f"{role}:{role}" for role in PASSWORDS),
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(home / "passwords.json"),
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="False",
        AIRFLOW__API__WORKERS="1",
    )
    # "sql": count the dead letters of the store database's queues. Whatever the tests' own environment says, the
    # server has exactly this (or no) transport set, and the store of delay_store_default.
    for name in ("AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT", "AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT_CONN_ID",
                 "AIRFLOW__DELAY_PROVIDER__UI_ERROR_QUEUE", "AIRFLOW__DELAY_PROVIDER__UI_CONN_ID"):
        env.pop(name, None)
    if ui_transport is not None:
        env["AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT"] = ui_transport
    copy_migrated_sqlite(home / "airflow.db")  # where airflow_env's Airflow has its metadata
    store = SqlDelayedMessageStore(f"sqlite:///{home / 'delay_store.db'}")
    store.create_schema()
    seed(store)
    now = utcnow()
    store.store([  # for the picture: something due within the minute, and a body that tries to be HTML
        DelayedMessage("orders", b"{}", now + timedelta(seconds=50), {"order-id": "6"}, message_id="orders-6"),
        DelayedMessage("emails", b'<img src=x onerror="document.title=\'pwned\'">', now + timedelta(hours=3),
                       {"to": "<script>alert(1)</script>"}, message_id="<i>emails-1</i>"),
    ])
    transport = SqlTableTransport(store.url)
    transport.provision("error")
    transport.send([DelayedMessage("orders", b"{}", now, message_id=f"dead-{i}").dead_lettered("error", "503", now)
                    for i in range(2)])
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        return get_json(base + "/api/v2/monitor/health")["metadatabase"]["status"] == "healthy"

    with airflow_process(["api-server"], env, home, ready):
        yield base, store


def test_an_admin_opens_the_page_from_the_browse_menu_and_cancels_a_message_after_confirming(api_server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, store = api_server
    screenshot = screenshot_path("backlog_page.png", tmp_path)
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = log_in(browser, base, "admin")
        page.get_by_role("button", name="Browse").click()
        page.get_by_role("menuitem", name="Delayed messages").click()
        page.wait_for_url(f"**/plugin/{URL_ROUTE}**")
        frame = page.frame_locator("iframe[title='Delayed messages']")

        # The histogram: five bars, with the counts of the store.
        bars = frame.locator("#chart svg rect.bar")
        expect(bars).to_have_count(5)
        counts = {bucket: int(bars.nth(i).get_attribute("data-count"))
                  for i, bucket in enumerate(["due", "next_minute", "next_hour", "next_day", "later"])}
        assert counts["due"] + counts["next_minute"] == 5  # 4 due, 1 due within the minute (or already)
        assert (counts["next_hour"], counts["next_day"], counts["later"]) == (1, 3, 1)
        expect(frame.locator("#destinations tbody tr")).to_have_count(3)
        expect(frame.locator("#destinations tr[data-destination='refunds']")).to_contain_text("paused")
        expect(frame.get_by_role("columnheader", name="Dead-lettered")).to_be_visible()
        expect(frame.locator("#destinations tr[data-destination='orders'] td").nth(4)).to_have_text("2")

        # The table: every message, bodies and headers as text (nothing in them becomes HTML).
        expect(frame.locator("#messages tbody tr")).to_have_count(10)
        email = frame.locator("#messages tbody tr").filter(has_text="<i>emails-1</i>")
        expect(email).to_contain_text("to=<script>alert(1)</script>")
        expect(email).to_contain_text("<img src=x onerror=")
        assert frame.locator("#messages img, #messages i, #messages script").count() == 0
        assert page.title() != "pwned"

        # Cancel asks first: "Keep" leaves the message, confirming cancels it.
        row = frame.locator("tr[data-message-id='orders-3']")
        row.get_by_role("button", name="Cancel").click()
        dialog = frame.get_by_role("alertdialog")
        expect(dialog).to_contain_text("Cancel 1 message?")
        dialog.get_by_role("button", name="Keep").click()
        expect(dialog).to_be_hidden()
        # The page reloads its tables after any answer and ignores clicks until that is done.
        expect(frame.locator("body")).not_to_have_attribute("aria-busy", "true")
        assert store.get("orders-3") is not None
        row.get_by_role("button", name="Cancel").click()
        dialog.get_by_role("button", name="Cancel messages").click()
        expect(frame.locator("#status")).to_have_text("Cancelled 1 message.")
        expect(row).to_have_count(0)
        assert store.get("orders-3") is None
        expect(frame.locator("#destinations tr[data-destination='orders'] td").nth(1)).to_have_text("6")
        frame.locator("h1").scroll_into_view_if_needed()
        page.screenshot(path=str(screenshot))

        # Pause, then purge (a dry run counts first, the confirmation says how many), per destination.
        emails = frame.locator("#destinations tr[data-destination='emails']")
        emails.get_by_role("button", name="Pause").click()
        dialog.get_by_role("button", name="Pause").click()
        expect(emails).to_contain_text("paused")
        assert store.destinations()["emails"]["paused"] is True
        emails.get_by_role("button", name="Purge…").click()
        expect(dialog).to_contain_text("Purge 1 scheduled message of “emails”?")
        dialog.get_by_role("button", name="Purge 1").click()
        expect(frame.locator("#status")).to_have_text("Purged 1 message of emails.")
        expect(frame.locator("#messages tbody tr").filter(has_text="emails-1")).to_have_count(0)
        assert "emails" not in store.count_scheduled()
        browser.close()
    assert screenshot.stat().st_size > 10_000


def test_a_viewer_sees_the_backlog_without_actions_or_bodies_and_is_refused_one(api_server, tmp_path):
    from playwright.sync_api import expect

    base, store = api_server
    screenshot = screenshot_path("backlog_page_viewer.png", tmp_path)
    with backlog_page(base, "viewer") as (page, frame):
        expect(frame.locator("#who")).to_contain_text("viewer · read only")
        expect(frame.locator("tr[data-message-id='orders-4']")).to_contain_text("300 bytes")
        expect(frame.locator("tr[data-message-id='orders-4']")).to_contain_text("order-id=4")  # headers are shown
        expect(frame.locator("#chart svg rect.bar")).to_have_count(5)
        for name in ("Cancel", "Run now", "Edit", "Pause", "Resume", "Purge…", "Cancel selected"):
            expect(frame.get_by_role("button", name=name, exact=True)).to_have_count(0)
        # A search by a filter lists what matches, with neither a body search nor the actions on all of it.
        expect(frame.get_by_label("Body contains")).to_be_hidden()
        frame.locator("#search").get_by_label("Destination").fill("orders")
        frame.locator("#search").get_by_role("button", name="Search").click()
        expect(frame.locator("#messages tbody tr").first).to_contain_text("orders")
        expect(frame.locator("#matching")).to_be_hidden()
        expect(frame.locator("#messages input[type=checkbox]")).to_have_count(0)
        expect(frame.locator("#messages")).not_to_contain_text("order 4")  # no bodies, sizes only
        frame.locator("h1").scroll_into_view_if_needed()
        page.screenshot(path=str(screenshot))

        # The server refuses the action too, whatever the page shows.
        refused = page.request.post(f"{base}{URL_PREFIX}/api/cancel", data={"message_ids": ["orders-4"]})
        assert refused.status == 403
        refused = page.request.post(f"{base}{URL_PREFIX}/api/edit", data={"message_id": "orders-4", "body": "x"})
        assert refused.status == 403
    assert store.get("orders-4") is not None and store.get("orders-4").body.startswith(b"<b>order 4</b>")
    assert screenshot.stat().st_size > 10_000


@pytest.mark.parametrize("role", ["user", "op"])
def test_the_roles_that_may_edit_dags_see_bodies_and_actions_and_run_a_message_now(api_server, tmp_path, role):
    """SimpleAuthManager's user and op may edit DAGs, so they may act; the how-to shows the user's page."""
    from playwright.sync_api import expect

    base, store = api_server
    message_id = {"user": "orders-5", "op": "orders-2"}[role]  # due in 2 days, in 30 min
    screenshot = screenshot_path(f"backlog_page_{role}.png", tmp_path)
    edited = f"edit-{role}"  # a message of this test's own (cancelled at the end: the others see the seeded store)
    store.store([DelayedMessage("orders", b"typo", utcnow() + timedelta(hours=1), {"order-id": "9"}, edited)])
    due = store.get(edited).due_at
    with backlog_page(base, role) as (page, frame):
        expect(frame.locator("#who")).to_contain_text(f"{role} · may act")
        row = frame.locator(f"tr[data-message-id='{message_id}']")
        expect(row).to_contain_text("order")  # the body's first bytes
        expect(row.get_by_role("button", name="Run now")).to_be_visible()
        frame.locator("h1").scroll_into_view_if_needed()
        page.screenshot(path=str(screenshot))
        row.get_by_role("button", name="Run now").click()
        frame.get_by_role("alertdialog").get_by_role("button", name="Run now").click()
        expect(frame.locator("#status")).to_have_text("Made due now: 1 message.")

        # Edit another message's body and headers: the dialog keeps the due time and says so.
        expect(frame.locator("body")).not_to_have_attribute("aria-busy", "true")  # the page has reloaded
        # Exactly "Edit": the message's id ("edit-user") is a button too, which opens its story.
        frame.locator(f"tr[data-message-id='{edited}']").get_by_role("button", name="Edit", exact=True).click()
        dialog = frame.get_by_role("dialog", name="Edit message")
        expect(dialog).to_contain_text("The due time stays")
        expect(dialog.locator("#edit-body")).to_have_value("typo")
        expect(dialog.locator("#edit-headers")).to_have_value("order-id=9")
        dialog.locator("#edit-body").fill('{"order": "corrected"}')
        dialog.locator("#edit-headers").fill("order-id=corrected")
        dialog.get_by_role("button", name="Save").click()
        expect(frame.locator("#status")).to_have_text(f"Edited {edited}: new body and headers, same due time.")
        expect(frame.locator(f"tr[data-message-id='{edited}']")).to_contain_text('{"order": "corrected"}')
        expect(frame.locator("#actions tbody tr").first).to_contain_text("edit")
    assert store.get(message_id).due_at <= utcnow()
    now = store.get(edited)
    assert (now.body, now.headers, now.due_at) == (b'{"order": "corrected"}', {"order-id": "corrected"}, due)
    store.cancel(Selector(message_ids=(edited,)))
    assert screenshot.stat().st_size > 10_000


@pytest.mark.parametrize("role", ["user", "op"])
def test_editors_search_bodies_and_change_everything_a_filter_matches_after_seeing_its_count(api_server, role):
    """Messages of this test's own (a marker in their bodies, so the others see the store as seeded): the filter's
    count on the page, a reschedule of what it matches to a time typed in the user's zone, then a cancel of the
    rest, each confirmed on a button that says how many; the recent actions show the filter."""
    from playwright.sync_api import expect

    base, store = api_server
    now = utcnow()
    marker = f"bulk-{role}"
    ids = [f"{marker}-{i}" for i in range(5)]
    store.store([DelayedMessage("orders", f"{marker} {'vip' if i < 3 else 'plain'}".encode(),
                                now + timedelta(hours=2 + i), {}, m) for i, m in enumerate(ids)])
    with backlog_page(base, role) as (_page, frame):
        form = frame.locator("#search")
        form.get_by_label("Body contains").fill(f"{marker} vip")
        form.get_by_role("button", name="Search").click()
        expect(frame.locator("#messages tbody tr")).to_have_count(3)
        expect(frame.locator("#matching-count")).to_have_text("3 scheduled messages match this filter.")

        frame.get_by_role("button", name="Reschedule all matching…").click()
        chooser = frame.get_by_role("dialog", name="Reschedule the matching messages")
        expect(chooser).to_contain_text("The 3 messages matching body containing")
        # Two days ahead at 10:00:00 wall time in the browser's zone (UTC here, as the UI's timezone is unset).
        day = (now + timedelta(days=2)).date().isoformat()
        chooser.locator("#reschedule-at").fill(f"{day}T10:00:00")
        chooser.get_by_role("button", name="Next").click()
        dialog = frame.get_by_role("alertdialog")
        expect(dialog).to_contain_text("Move 3 scheduled messages matching body containing")
        dialog.get_by_role("button", name="Reschedule 3").click()
        expect(frame.locator("#status")).to_have_text("Rescheduled 3 messages.")
        assert {store.get(m).due_at.isoformat() for m in ids[:3]} == {f"{day}T10:00:00+00:00"}

        expect(frame.locator("body")).not_to_have_attribute("aria-busy", "true")
        form.get_by_label("Body contains").fill(marker)
        form.get_by_role("button", name="Search").click()
        expect(frame.locator("#matching-count")).to_have_text("5 scheduled messages match this filter.")
        # Paused and resumed by the filter, each confirmed on a button with its count; the list shows them held.
        frame.get_by_role("button", name="Pause all matching…").click()
        expect(dialog).to_contain_text(f"Pause 5 scheduled messages matching body containing “{marker}”?")
        dialog.get_by_role("button", name="Pause 5").click()
        expect(frame.locator("#status")).to_have_text("Paused 5 messages.")
        expect(frame.locator("body")).not_to_have_attribute("aria-busy", "true")  # the page reloaded: act again
        expect(frame.locator("#messages tbody .badge.held")).to_have_count(5)
        assert store.backlog("orders")["destinations"]["orders"]["held"] >= 5
        frame.get_by_role("button", name="Resume all matching…").click()
        expect(dialog).to_contain_text(f"Resume 5 paused messages matching body containing “{marker}”?")
        dialog.get_by_role("button", name="Resume 5").click()
        expect(frame.locator("#status")).to_have_text("Resumed 5 messages.")
        expect(frame.locator("body")).not_to_have_attribute("aria-busy", "true")
        expect(frame.locator("#messages tbody .badge.held")).to_have_count(0)
        frame.get_by_role("button", name="Cancel all matching…").click()
        expect(dialog).to_contain_text(f"Cancel 5 scheduled messages matching body containing “{marker}”?")
        dialog.get_by_role("button", name="Keep").click()
        expect(frame.locator("body")).not_to_have_attribute("aria-busy", "true")
        assert all(store.get(m) is not None for m in ids)
        frame.get_by_role("button", name="Cancel all matching…").click()
        dialog.get_by_role("button", name="Cancel 5").click()
        expect(frame.locator("#status")).to_have_text("Cancelled 5 messages.")
        expect(frame.locator("#matching-count")).to_have_text("0 scheduled messages match this filter.")
        expect(frame.get_by_role("button", name="Cancel all matching…")).to_be_disabled()
        latest = frame.locator("#actions tbody tr").first
        expect(latest).to_contain_text(f"body containing “{marker}”")
        expect(latest).to_contain_text("cancelled 5")
        expect(latest).to_contain_text(role)
    assert [m for m in ids if store.get(m) is not None] == []


def test_a_mistyped_destination_with_dead_letters_is_forgotten_after_a_second_confirmation(api_server):
    """Refused while its dead letters remain: the page says why and offers to force it; forced, the name goes
    and its dead letters stay in the error queue."""
    from playwright.sync_api import expect

    base, store = api_server
    now = utcnow()
    store.store([DelayedMessage("ordrs", b"{}", now + timedelta(hours=1), message_id="typo-1")])
    store.cancel(Selector(message_ids=("typo-1",)))  # known, nothing scheduled
    queues = SqlTableTransport(store.url)
    queues.send([DelayedMessage("ordrs", b"{}", now, message_id="typo-dead").dead_lettered("error", "no queue", now)])
    with backlog_page(base, "admin") as (_page, frame):
        row = frame.locator("#destinations tr[data-destination='ordrs']")
        row.get_by_role("button", name="Forget…").click()
        dialog = frame.get_by_role("alertdialog")
        dialog.get_by_role("button", name="Forget", exact=True).click()
        expect(dialog).to_contain_text("still holds their dead letters")
        dialog.get_by_role("button", name="Forget anyway").click()
        expect(frame.locator("#status")).to_have_text("Forgot ordrs; its dead letters are still in the error queue.")
        expect(row).to_have_count(0)
    assert "ordrs" not in store.destinations()
    left = [m.message_id for m in queues.peek("error", 10) if m.headers[HEADER_FAILED_DESTINATION] == "ordrs"]
    assert left == ["typo-dead"]


def test_dead_letters_are_listed_for_each_role_and_an_admin_redrives_and_deletes_them_seen_in_recent_actions(
        api_server):
    """Two dead letters of its own (deleted by the end, so the other page tests see the store as seeded)."""
    from playwright.sync_api import expect

    base, store = api_server
    transport = SqlTableTransport(store.url)
    now = utcnow()
    ids = ["page-dl-0", "page-dl-1"]
    gave_up = {HEADER_GAVE_UP: "backoff phase: all 3 retries used (4 attempts)"}
    transport.send([DelayedMessage("orders", b'{"refund": 7}', now, gave_up, message_id=m).dead_lettered(
        "error", "410 gone for good", now) for m in ids])
    with backlog_page(base, "viewer") as (_, frame):
        row = frame.locator("#dead-letters tr[data-message-id='page-dl-0']")
        expect(row).to_contain_text("410 gone for good")
        expect(row).to_contain_text("13 bytes")  # a size, not the body
        expect(frame.locator("#dead-letters input[type=checkbox]")).to_have_count(0)
        # The detail: why the policy gave up, every header; the body's size only.
        row.get_by_role("button", name="page-dl-0").click()
        detail = frame.locator("#dead-letters tr[data-detail-of='page-dl-0']")
        expect(detail.locator("dt", has_text="Gave up").locator("xpath=following-sibling::dd[1]")).to_have_text(
            "backoff phase: all 3 retries used (4 attempts)")
        expect(detail).to_contain_text("x-delay-failed-destination=orders")
        expect(detail).to_contain_text("Body: 13 bytes, shown to the roles that may act.")
        expect(detail).not_to_contain_text("refund")
    with backlog_page(base, "admin") as (_, frame):
        dialog = frame.get_by_role("alertdialog")
        row = frame.locator("#dead-letters tr[data-message-id='page-dl-0']")
        expect(row).to_contain_text('{"refund": 7}')
        row.get_by_role("button", name="page-dl-0").click()
        expect(frame.locator("#dead-letters tr[data-detail-of='page-dl-0'] pre.body")).to_have_text('{"refund": 7}')
        row.get_by_role("checkbox").check()
        frame.get_by_role("button", name="Redrive selected").click()
        expect(dialog).to_contain_text("Store 1 dead letter again")
        dialog.get_by_role("button", name="Redrive").click()
        # Its destination has no queue on the transport: it stays, and the page says why.
        expect(frame.locator("#status")).to_contain_text("'orders' is not provisioned")
        expect(frame.locator("body")).not_to_have_attribute("aria-busy", "true")  # the redrive's reload is done
        for m in ids:
            frame.locator(f"#dead-letters tr[data-message-id='{m}']").get_by_role("checkbox").check()
        frame.get_by_role("button", name="Delete selected").click()
        expect(dialog).to_contain_text("Delete 2 dead letters for good?")
        dialog.get_by_role("button", name="Delete").click()
        expect(frame.locator("#status")).to_have_text("Deleted 2 dead letters.")
        expect(frame.locator("#dead-letters tr[data-message-id='page-dl-0']")).to_have_count(0)
        latest = frame.locator("#actions tbody tr").first
        expect(latest).to_contain_text("delete dead letters")
        expect(latest).to_contain_text("admin")
        expect(latest).to_contain_text("deleted 2")
    assert {m.message_id for m in transport.peek("error", 10)} & set(ids) == set()


# -- the delivery history on the page ---------------------------------------------------------------------------
#: The messages of the page's history (page_history): delivered, retried then delivered, dead-lettered, scheduled.
FLAKY, DELIVERED, LOST, LATER, QUIET = "ship-flaky", "ship-ok", "pallet-lost", "ship-later", "quiet-1"
BATCH = [f"ship-batch-{i}" for i in range(10)]
LATER_BODY = '{"parcel": "secret-4"}'


@contextmanager
def only_these(store: SqlDelayedMessageStore, destinations: set[str]) -> Iterator[None]:
    """Every other destination paused meanwhile, and resumed after (those paused before stay so): a pump of a test's
    own hands over only `destinations`' due messages, and the other tests' stay as they expect them."""
    others = [d for d, s in store.destinations().items() if not s["paused"] and d not in destinations]
    if others:
        store.set_paused(others, True)
    try:
        yield
    finally:
        if others:
            store.set_paused(others, False)


@pytest.fixture(scope="module")
def page_history(api_server):
    """History in the page's store, made by a pump of the test's own on the SQL-table queues of its database:
    `shipments` (provisioned) takes FLAKY at the second attempt, DELIVERED and a batch of ten at the first; `warehouse`
    has no queue, so LOST goes to the error queue. LATER stays scheduled (with a body only editors see), and
    QUIET is the one message of `quiet`, due in a year: a destination with no history."""
    base, store = api_server
    now = utcnow()
    store.store([DelayedMessage("shipments", b'{"parcel": 1}', now - timedelta(seconds=5), {"carrier": "dhl"}, FLAKY),
                 DelayedMessage("shipments", b'{"parcel": 2}', now - timedelta(seconds=4), {"carrier": "dhl"},
                                DELIVERED),
                 *[DelayedMessage("shipments", b"{}", now - timedelta(seconds=3), {}, m) for m in BATCH],
                 DelayedMessage("warehouse", b'{"pallet": 3}', now - timedelta(seconds=2), {}, LOST),
                 DelayedMessage("shipments", LATER_BODY.encode(), now + timedelta(hours=2), {"carrier": "ups"}, LATER),
                 DelayedMessage("quiet", b"{}", now + timedelta(days=365), {}, QUIET)])
    transport = SqlTableTransport(store.url)
    transport.provision("shipments")
    with only_these(store, {"shipments", "warehouse"}):
        deliver_due(store, transport, {"shipments": 1})
    assert [store.get(m) for m in (FLAKY, DELIVERED, LOST, *BATCH)] == [None] * 13
    return base, store


def _settled(frame) -> None:
    """Wait until the page has loaded what the last step asked for (it is aria-busy until then)."""
    from playwright.sync_api import expect

    expect(frame.locator("body")).not_to_have_attribute("aria-busy", "true")


def _bar_counts(frame, kind: str) -> int:
    return sum(int(n) for n in frame.locator(f"#history-chart rect.bar.{kind}").evaluate_all(
        "bars => bars.map(b => b.dataset.count)"))


@pytest.mark.parametrize("role", ["viewer", "op"])
def test_the_delivery_history_shows_its_chart_its_entries_by_outcome_and_each_messages_story(page_history, tmp_path,
                                                                                              role):
    """The chart of the last hour (the deliveries as bars, p50 and p99 lateness as lines), another window and a
    destination of the page's; the recent entries, by outcome and page after page; a message's story opened from
    either list or by its id: the attempts of a retried and of a dead-lettered message, and a scheduled one's row,
    whose body only the roles that may edit see."""
    from playwright.sync_api import expect

    base, store = page_history
    screenshot = tmp_path / f"history_{role}.png"
    with backlog_page(base, role) as (page, frame):
        _settled(frame)
        # The chart: 12 delivered (the batch, FLAKY and DELIVERED), FLAKY's retry and LOST's dead letter stacked on
        # them; both lateness lines; its name says it all for a screen reader.
        chart = frame.locator("#history-chart svg")
        expect(chart).to_have_attribute("aria-label", re.compile(r"^Deliveries per minute to all destinations in "
                                                                 r"the last hour: \d+ delivered"))
        assert _bar_counts(frame, "delivered") >= 12
        assert _bar_counts(frame, "retried") >= 1 and _bar_counts(frame, "dead_lettered") >= 1
        for line in ("p50", "p99"):
            assert int(frame.locator(f"#history-chart path.line.{line}").get_attribute("data-points")) >= 1
        expect(frame.locator("#history-legend")).to_be_visible()
        expect(frame.locator("#history-kept")).to_have_text("Kept 7 days (the connection's history_days).")

        # Another window, and a destination of the page's: its own numbers, or the empty state.
        frame.locator("#history-window").select_option("6h")
        _settled(frame)
        expect(frame.locator("#history-chart-title")).to_contain_text("in the last 6 hours")
        frame.locator("#history-destination").select_option("shipments")
        _settled(frame)
        expect(chart).to_have_attribute("aria-label", re.compile(
            r"^Deliveries per minute to “shipments” in the last 6 hours: 12 delivered, 1 retried, 0 dead-lettered"))
        assert _bar_counts(frame, "delivered") == 12 and _bar_counts(frame, "dead_lettered") == 0
        expect(frame.locator("#search input[name=destination]")).to_have_value("shipments")  # the page's choice
        expect(frame.locator("#history tbody tr")).to_have_count(13)  # the recent entries follow it
        frame.locator("#destinations tr[data-destination='quiet']").get_by_role("button", name="quiet").click()
        _settled(frame)
        expect(frame.locator("#history-destination")).to_have_value("quiet")
        expect(frame.locator("#history-chart")).to_have_text("No deliveries to “quiet” in the last 6 hours.")
        expect(frame.locator("#history-legend")).to_be_hidden()
        expect(frame.locator("#history tbody")).to_have_text("No messages of “quiet” in the history.")
        frame.locator("#history-destination").select_option("")
        _settled(frame)
        expect(frame.locator("#history-chart-title")).to_contain_text("to all destinations")

        # The recent entries: delivered and dead-lettered ones, with the failure; then only the dead-lettered.
        recent = frame.locator("#history")
        ok = recent.locator(f"tr[data-entry-of='{DELIVERED}']")
        expect(ok).to_have_attribute("data-outcome", "delivered")
        expect(ok).to_contain_text("shipments")
        lost = recent.locator(f"tr[data-entry-of='{LOST}']")
        expect(lost).to_have_attribute("data-outcome", "dead_lettered")
        expect(lost.locator("td.detail")).to_contain_text("not found")
        expect(lost).to_contain_text("dead-lettered")
        frame.locator("#history-outcome").select_option("dead_lettered")
        _settled(frame)
        expect(lost).to_be_visible()
        expect(ok).to_have_count(0)
        assert set(recent.locator("tbody tr").evaluate_all("rows => rows.map(r => r.dataset.outcome)")) == {
            "dead_lettered"}
        frame.locator("#history-outcome").select_option("")
        _settled(frame)

        # Page after page (10 a page): each entry once, the batch of one hand-over time across two pages.
        frame.locator("#history-limit").select_option("10")
        _settled(frame)
        seen = []
        for number in range(1, 20):
            expect(frame.locator("#history-info")).to_contain_text(f"Page {number} · ")
            seen += recent.locator("tbody tr").evaluate_all(
                "rows => rows.map(r => [r.dataset.entryOf, r.dataset.outcome, r.cells[4].textContent])")
            if frame.locator("#history-older").is_disabled():
                break
            frame.locator("#history-older").click()
            _settled(frame)
        assert number >= 2 and len(seen) == len({tuple(s) for s in seen})
        mine = sorted((m, o) for m, o, _ in seen if m in {FLAKY, DELIVERED, LOST, *BATCH})
        assert mine == sorted([(FLAKY, "retried"), (FLAKY, "delivered"), (DELIVERED, "delivered"),
                               (LOST, "dead_lettered"), *[(m, "delivered") for m in BATCH]])
        frame.locator("#history-newest").click()
        _settled(frame)
        expect(frame.locator("#history-info")).to_contain_text("Page 1 · 10 entries")
        frame.locator("#history-limit").select_option("50")
        _settled(frame)

        # A story from the recent list: the retry, then the delivery.
        recent.locator(f"tr[data-entry-of='{FLAKY}'][data-outcome='delivered']").get_by_role("button").click()
        _settled(frame)
        story = frame.locator("#story")
        expect(story.locator(".story-head .badge")).to_have_text("delivered")
        steps = story.locator("ol.timeline li")
        expect(steps).to_have_count(3)
        expect(steps.nth(0)).to_contain_text("Stored")
        expect(steps.nth(1)).to_contain_text("Attempt 1: retried")
        expect(steps.nth(1)).to_contain_text("ConnectionError: shipments refused")
        expect(steps.nth(2)).to_contain_text("Attempt 2: delivered")
        expect(frame.locator("#story-id")).to_have_value(FLAKY)

        # A story by its id: the dead letter's one attempt and why.
        frame.locator("#story-id").fill(LOST)
        frame.get_by_role("button", name="Show story").click()
        _settled(frame)
        expect(story.locator(".story-head .badge")).to_have_text("dead-lettered")
        expect(story.locator("li[data-outcome='dead_lettered']")).to_contain_text("Attempt 1: dead-lettered")
        expect(story.locator("li[data-outcome='dead_lettered']")).to_contain_text("not found")

        # A scheduled message's story from the scheduled list: its row and headers; its body for editors only.
        frame.locator(f"#messages tr[data-message-id='{LATER}']").get_by_role("button", name=LATER).click()
        _settled(frame)
        expect(story.locator(".story-head .badge")).to_have_text("scheduled")
        expect(story.locator("li.scheduled")).to_contain_text("due in 2 h")
        expect(story.locator(".headers")).to_have_text("carrier=ups")
        if role == "viewer":
            expect(story.locator("pre.body")).to_have_count(0)
            expect(story).to_contain_text("Body: 22 bytes, shown to the roles that may act.")
            expect(story).not_to_contain_text("secret-4")
        else:
            expect(story.locator("pre.body")).to_have_text(LATER_BODY)
        page.screenshot(path=str(screenshot))  # the story in view (opening it scrolled there)
        frame.locator("#story-id").fill("never-sent")
        frame.get_by_role("button", name="Show story").click()
        _settled(frame)
        expect(story.locator(".story-head .badge")).to_have_text("unknown")
        expect(story).to_contain_text("never stored under this id")
    assert store.get(LATER) is not None  # reading changed nothing
    assert screenshot.stat().st_size > 10_000
