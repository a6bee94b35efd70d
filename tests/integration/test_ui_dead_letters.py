"""The backlog page's dead letters, through Airflow's own api-server app and SimpleAuthManager's roles, on the SQL
transport of the store's database: listed with filters without consuming anything, bodies for editors only,
redriven and deleted by id, destination or all (a dry run first), each action in the audit log; and in a real
browser against `airflow api-server` with no `[delay_provider] ui_transport`, the error queues the store recorded,
one chosen on the page."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from airflow_delay_provider import audit
from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.browser_helpers import backlog_page, layout_problems, require_chromium
from tests.helpers import make_store
from tests.integration.test_ui_looks import TOOLBARS, WIDTHS, _frame
from tests.integration.test_ui_plugin import _api_server, _settled, airflow_app, client, seed  # noqa: F401 - fixtures


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


def test_without_a_setting_the_page_finds_the_error_queues_the_store_recorded(client, dead, monkeypatch):  # noqa: F811
    store, transport = dead
    monkeypatch.delenv("AIRFLOW__DELAY_PROVIDER__UI_TRANSPORT")
    store.routes.record("sql", "delay_ui_test", "error", {"endpoints": ["orders", "refunds"]})  # as provisioning does
    listing = client("viewer", "GET", "/api/dead-letters").json()
    assert listing["available"] is True and [(r["transport"], r["error_queue"]) for r in listing["routes"]] == [
        ("sql", "error")]
    assert "delay_ui_test" not in json.dumps(listing)  # no connection's name on the page
    assert _ids(client("viewer", "GET", "/api/dead-letters")) == ["dead-0", "dead-1", "dead-2", "dead-3"]

    # A dispatcher with an error queue of its own, seen later: listed first, the other still there by its key.
    transport.provision("late_errors")
    now = utcnow()
    transport.send([DelayedMessage("orders", b"l", now, message_id="late-0").dead_lettered("late_errors", "x", now)])
    store.routes.record("sql", "delay_ui_test", "late_errors", {"destinations": None, "prefix": "orders"})
    listing = client("viewer", "GET", "/api/dead-letters").json()
    late, first = listing["routes"]
    assert (late["error_queue"], first["error_queue"]) == ("late_errors", "error") and listing["route"] == late["key"]
    assert [d["message_id"] for d in listing["dead_letters"]] == ["late-0"]
    assert _ids(client("viewer", "GET", "/api/dead-letters", params={"route": first["key"]}))[:1] == ["dead-0"]
    bad = client("viewer", "GET", "/api/dead-letters", params={"route": "nope"})
    assert bad.status_code == 400 and f"route must be one of {late['key']} (sql late_errors)" in bad.json()["detail"]

    counts = client("viewer", "GET", "/api/backlog").json()["dead_letters"]
    assert counts["total"] == 5 and counts["per_destination"]["orders"] == 3
    # Forgetting `refunds` is refused while a known error queue holds its dead letters.
    refused = client("admin", "POST", "/api/forget", json={"destinations": ["refunds"]})
    assert refused.status_code == 400 and "still holds their dead letters" in refused.json()["detail"]

    redriven = client("admin", "POST", "/api/dead-letters/redrive",
                      json={"everything": True, "route": late["key"]}).json()
    assert redriven["redriven"] == 1 and store.get("late-0") is not None
    assert _ids(client("viewer", "GET", "/api/dead-letters", params={"route": first["key"]})) == [
        "dead-0", "dead-1", "dead-2", "dead-3"]  # the other queue untouched


# -- the page in a real browser, with no transport set: the error queues the store recorded ---------------------
#: The error queue a dispatcher of its own records in `routes_server`'s store, besides `error`: a long name, the widest
#: choice the dead-letter search gets.
EU = "errors.eu-west-1.customer-notifications"
#: The error queues as the page's "Error queue" choice names them, the most recently seen first.
QUEUES = [f"{EU} (sql)", "error (sql)"]
#: The body of EU's dead letter that has the id of one in `error` (dead-1, whose body is "{}").
EU_BODY = '{"eu": 1}'


@pytest.fixture(scope="module")
def routes_server(tmp_path_factory):
    """`airflow api-server` as the page's browser tests have it (test_ui_plugin's api_server: a seeded store, whose
    SQL error queue `error` holds dead-0 and dead-1 of orders), but with no `[delay_provider] ui_transport`. The
    store records two error queues of its own database, as provisioning and a dispatcher would: `error`, then EU (so
    the most recent), which holds eu-0 of refunds and a dead-1 of its own (another body, the same id). orders is
    provisioned, so a redrive of its dead letters stores them again. (base URL, store, transport)."""
    require_chromium()
    with _api_server(tmp_path_factory.mktemp("routes_server"), ui_transport=None) as (base, store):
        transport = SqlTableTransport(store.url)
        for queue in (EU, "orders"):
            transport.provision(queue)
        now = utcnow()
        transport.send([
            DelayedMessage("refunds", b'{"eu": 0}', now, message_id="eu-0").dead_lettered(EU, "eu 503", now),
            DelayedMessage("orders", EU_BODY.encode(), now, message_id="dead-1").dead_lettered(EU, "eu 410", now),
        ])
        store.routes.record("sql", None, "error", {"endpoints": ["orders", "refunds"]})  # as provisioning does
        store.routes.record("sql", None, EU, {"destinations": None, "prefix": "eu"})  # a dispatcher, later
        assert [r["error_queue"] for r in store.routes.routes()] == [EU, "error"]
        yield base, store, transport
        transport.close()


def _listed(frame) -> list[str]:
    """The ids of the dead letters the page lists, once it has loaded."""
    _settled(frame)
    return frame.locator("#dead-letters tbody tr[data-message-id]").evaluate_all(
        "rows => rows.map(r => r.dataset.messageId)")


def _queue_ids(transport: SqlTableTransport, queue: str) -> list[str]:
    return sorted(m.message_id for m in transport.peek(queue, 10))


def test_with_no_transport_set_the_page_offers_each_error_queue_the_store_recorded_and_acts_on_the_chosen_one(
        routes_server):
    """The most recent error queue listed first, an "Error queue" choice of both, the other listed once chosen; a
    viewer sees the choice and no action, an editor's redrive of a dead letter takes it from the chosen queue only
    (the other queue holds one of the same id: it stays). The dead-letter search, with the choice of a long queue
    name, stays on one line from 1024 to 1920 px (test_ui_looks' layout check)."""
    from playwright.sync_api import expect

    base, store, transport = routes_server
    with backlog_page(base, "viewer") as (_page, frame):
        choice = frame.locator("#dead-search").get_by_label("Error queue")
        expect(choice).to_be_visible()
        expect(choice.locator("option")).to_have_text(QUEUES)
        expect(frame.locator("#dead-note")).to_contain_text(f"2 dead letters in sql queue {EU},")
        assert sorted(_listed(frame)) == ["dead-1", "eu-0"]
        # The counts take every error queue: orders' two in `error` and one in EU.
        expect(frame.get_by_role("columnheader", name="Dead-lettered")).to_be_visible()
        expect(frame.locator("#destinations tr[data-destination='orders'] td").nth(4)).to_have_text("3")
        expect(frame.locator("#destinations tr[data-destination='refunds'] td").nth(4)).to_have_text("1")
        # Neither bodies nor actions, on either queue.
        expect(frame.locator("#dead-letters")).not_to_contain_text(EU_BODY)
        choice.select_option(label="error (sql)")
        expect(frame.locator("#dead-note")).to_contain_text("2 dead letters in sql queue error,")
        assert sorted(_listed(frame)) == ["dead-0", "dead-1"]
        expect(frame.locator("#dead-letters input[type=checkbox]")).to_have_count(0)
        for name in ("Redrive selected", "Delete selected"):
            expect(frame.get_by_role("button", name=name)).to_have_count(0)

    with backlog_page(base, "user") as (page, frame):
        choice = frame.locator("#dead-search").get_by_label("Error queue")
        expect(choice.locator("option")).to_have_text(QUEUES)
        assert sorted(_listed(frame)) == ["dead-1", "eu-0"]
        expect(frame.locator("#dead-letters tr[data-message-id='dead-1']")).to_contain_text(EU_BODY)
        assert "#dead-search" in TOOLBARS
        for width in WIDTHS:
            page.set_viewport_size({"width": width, "height": 900})
            _frame(page).evaluate("new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
            problems = layout_problems(_frame(page), TOOLBARS)
            assert problems == [], (width, problems)
        choice.select_option(label="error (sql)")
        expect(frame.locator("#dead-note")).to_contain_text("in sql queue error,")
        assert sorted(_listed(frame)) == ["dead-0", "dead-1"]
        row = frame.locator("#dead-letters tr[data-message-id='dead-1']")
        expect(row).not_to_contain_text(EU_BODY)  # the `error` queue's dead-1
        row.get_by_role("checkbox").check()
        frame.get_by_role("button", name="Redrive selected").click()
        dialog = frame.get_by_role("alertdialog")
        expect(dialog).to_contain_text("Store 1 dead letter again")
        dialog.get_by_role("button", name="Redrive").click()
        expect(frame.locator("#status")).to_have_text("Redriven 1 dead letter.")
        # The page stays on the chosen queue, without the redriven letter.
        assert _listed(frame) == ["dead-0"]
        expect(choice.locator("option:checked")).to_have_text("error (sql)")
    assert store.get("dead-1").body == b"{}"  # the `error` queue's, stored again for orders
    assert _queue_ids(transport, "error") == ["dead-0"]
    assert _queue_ids(transport, EU) == ["dead-1", "eu-0"]  # the other queue's, its dead-1 too, stay
