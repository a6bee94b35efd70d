"""The backlog page (Browse > Delayed messages): the plugin as Airflow loads it; its JSON endpoints in
Airflow's own api-server app, behind SimpleAuthManager's roles, on a real store (SQLite and the real
PostgreSQL); and the page in a real browser (Debian's chromium) against `airflow api-server`."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta
from importlib.metadata import entry_points

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport
from airflow_delay_provider.ui.plugin import URL_PREFIX, URL_ROUTE, DelayBacklogPlugin
from tests.browser_helpers import (
    BIN_DIR,
    airflow_env,
    airflow_process,
    get_json,
    launch_chromium,
    require_chromium,
    screenshot_path,
)
from tests.helpers import make_store
from tests.services import free_port

SIMPLE_AUTH_MANAGER = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
USERS = "admin:admin,viewer:viewer,user:user"
ACTIONS = {  # every POST of the page, with a body that would change something
    "cancel": {"message_ids": ["orders-0"]},
    "run-now": {"message_ids": ["orders-5"]},
    "pause": {"destinations": ["orders"]},
    "resume": {"destinations": ["refunds"]},
    "purge": {"destination": "orders", "dry_run": False},
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


def test_airflow_loads_the_plugin_from_the_entry_point_and_the_provider_info(airflow_app, client):
    from airflow import plugins_manager

    from airflow_delay_provider.get_provider_info import get_provider_info

    [entry] = [e for e in entry_points(group="airflow.plugins") if e.name == "delay_backlog"]
    assert entry.load() is DelayBacklogPlugin
    # What Airflow loads from the provider's own list when [core] lazy_discover_providers is False.
    assert {"name": "delay_backlog", "plugin-class": "airflow_delay_provider.ui.plugin.DelayBacklogPlugin"} \
        in get_provider_info()["plugins"]
    assert DelayBacklogPlugin in plugins_manager._load_providers_plugins()[0]

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


def test_bad_input_is_a_400_that_says_why(client, store):
    def detail(method, path, status=400, **kwargs):
        response = client("admin", method, path, **kwargs)
        assert response.status_code == status, response.text
        return response.json()["detail"]

    assert "key=value" in detail("GET", "/api/messages", params={"header": "tenant"})
    assert "cursor" in detail("GET", "/api/messages", params={"after": "garbage"})
    assert "would apply to every message" in detail("POST", "/api/cancel", json={})
    assert "unknown destination" in detail("POST", "/api/pause", json={"destinations": ["nowhere"]})
    assert "unknown destination" in detail("POST", "/api/purge", json={"destination": "nowhere"})
    assert "application/json" in detail("POST", "/api/cancel", status=415, data={"message_ids": "orders-1"})
    detail("GET", "/api/messages", status=422, params={"limit": 0})
    assert store.count_scheduled() == {"orders": 6, "refunds": 2}


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


def test_an_unreachable_store_is_a_503(client, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_DELAY_UI_DOWN", json.dumps(
        {"conn_type": "delay_store", "extra": {"url": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x"}}))
    monkeypatch.setenv("AIRFLOW__DELAY_PROVIDER__UI_CONN_ID", "delay_ui_down")
    response = client("viewer", "GET", "/api/backlog")
    assert response.status_code == 503 and "not reachable" in response.json()["detail"]


# -- the page in a real browser, against `airflow api-server` -------------------------------------------------
PASSWORDS = {"admin": "admin-password", "viewer": "viewer-password"}


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    """`airflow api-server` (one worker) on a free port with SimpleAuthManager's admin and viewer, and a
    seeded SQLite store as `delay_store_default`; yields (base URL, the store)."""
    require_chromium()
    home = tmp_path_factory.mktemp("api_server")
    (home / "passwords.json").write_text(json.dumps(PASSWORDS))
    port = free_port()
    env = airflow_env(
        home, port,
        AIRFLOW__CORE__AUTH_MANAGER=SIMPLE_AUTH_MANAGER,
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin,viewer:viewer",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(home / "passwords.json"),
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="False",
        AIRFLOW__API__WORKERS="1",
        AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT="sql",  # count the dead letters of the store database's queues
    )
    env.pop("AIRFLOW__DELAY_PROVIDER__UI_CONN_ID", None)
    subprocess.run([str(BIN_DIR / "airflow"), "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL)
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


def _log_in(browser, base: str, user: str):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(base + "/", wait_until="networkidle")  # Airflow sends the browser to its login form
    page.get_by_label("Username").fill(user)
    page.get_by_label("Password").fill(PASSWORDS[user])
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(base + "/", timeout=30_000)
    return page


def test_an_admin_opens_the_page_from_the_browse_menu_and_cancels_a_message_after_confirming(api_server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, store = api_server
    screenshot = screenshot_path("backlog_page.png", tmp_path)
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = _log_in(browser, base, "admin")
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


def test_a_viewer_sees_the_backlog_without_actions_or_bodies_and_is_refused_one(api_server):
    from playwright.sync_api import expect, sync_playwright

    base, store = api_server
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = _log_in(browser, base, "viewer")
        page.goto(f"{base}/plugin/{URL_ROUTE}", wait_until="networkidle")
        frame = page.frame_locator("iframe[title='Delayed messages']")
        expect(frame.locator("#who")).to_contain_text("viewer · read only")
        expect(frame.locator("tr[data-message-id='orders-4']")).to_contain_text("300 bytes")
        expect(frame.locator("#chart svg rect.bar")).to_have_count(5)
        for name in ("Cancel", "Run now", "Pause", "Resume", "Purge…", "Cancel selected"):
            expect(frame.get_by_role("button", name=name, exact=True)).to_have_count(0)
        expect(frame.locator("#messages input[type=checkbox]")).to_have_count(0)
        expect(frame.locator("#messages")).not_to_contain_text("order 4")  # no bodies, sizes only

        # The server refuses the action too, whatever the page shows.
        refused = page.request.post(f"{base}{URL_PREFIX}/api/cancel", data={"message_ids": ["orders-4"]})
        assert refused.status == 403
        browser.close()
    assert store.get("orders-4") is not None
