"""The Delayed messages page as part of Airflow's UI, in a real browser (Debian's chromium) against `airflow
api-server` with a user of each role: it follows the UI's colour mode and time zone (as the UI stores them), has
no layout break from 1024 to 1920 px wide in either mode (the delivery history and a message's story open), says
what a run now does for a paused destination and which connection a 503 is about, and opens filtered from a task's
extra link.

The api-server is the one test_ui_plugin's page tests ran on just before (tests/shared.py): its store as they left
it, which these tests add their own rows to.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

import pytest

from airflow_delay_provider.core.backlog import Selector
from airflow_delay_provider.core.message import DelayedMessage
from airflow_delay_provider.transports.sql import SqlTableTransport
from airflow_delay_provider.ui.paths import URL_PREFIX, URL_ROUTE, page_url
from tests.browser_helpers import backlog_page, launch_chromium, layout_problems, log_in, screenshot_path
from tests.integration.test_ui_plugin import (
    api_server,  # noqa: F401 - the fixture, for this module
    deliver_due,
    only_these,
)

WIDTHS = (1024, 1400, 1920)
#: Rows of buttons (and the search form) that must each stay on one line.
#: "#dead-search": with one error queue (this api-server's ui_transport) its fields; with several (test_ui_dead_letters'
#: server, whose store recorded two) the "Error queue" choice too.
TOOLBARS = ["#destinations .actions", "#messages .actions", "#search-main", "#search-more", ".pager", ".meta",
            "#bulk", "#matching", "#history-bar", "#history-filter", "#story-form", "#history-legend", "#dead-search"]
#: A destination with a long name, paused, with nothing scheduled: its row has the most buttons (Resume,
#: Purge…, Forget…) and the widest name.
LONG_NAME = "archive.eu-west-1.customer-notifications"
#: A message far ahead, whose due time the page shows in the user's zone.
FAR = datetime(2031, 3, 4, 5, 6, 7, tzinfo=timezone.utc)
#: The widest entries of the delivery history: a long id for a long-named destination, whose first send fails (its
#: failure names the destination) and whose second is delivered; its story is open while the layout is measured.
LONG_ID = "invoice-reminder.2031-03-04T05:06:07Z.customer-000012345678901234567890"
LONG_DEST = "eu-west-1.customer-notifications.invoice-reminders-of-the-month"
#: The modes and zones tried: a light UI in the browser's own zone (none chosen in Airflow), and a dark one in
#: a zone chosen in Airflow's user menu (kept as JSON in localStorage "timezone").
SETTINGS = {
    "light": (None, "2031-03-04 00:06:07 EST",
              "Times in America/New_York, this browser's (Airflow's user menu can choose another)."),
    "dark": ("Asia/Kolkata", "2031-03-04 10:36:07 GMT+5:30",
             "Times in Asia/Kolkata, the time zone chosen in Airflow's user menu."),
}
BACKGROUND = {"light": "rgb(255, 255, 255)", "dark": "rgb(17, 17, 19)"}
#: The two pictures the how-to shows (docs/ with DELAY_UPDATE_SCREENSHOT=1).
FOR_DOCS = {("user", "dark", 1400): "backlog_page_dark_1400.png",
            ("viewer", "light", 1024): "backlog_page_light_1024.png"}
#: What Airflow's UI keeps of the user's choices: next-themes' "theme", and "timezone" as JSON (none: removed).
STORE_CHOICES = """([mode, zone]) => {
  localStorage.setItem("theme", mode);
  if (zone === null) localStorage.removeItem("timezone"); else localStorage.setItem("timezone", JSON.stringify(zone));
}"""


def _frame(page):
    """The page's frame in Airflow's UI."""
    [frame] = [f for f in page.frames if f is not page.main_frame and URL_PREFIX in f.url]
    return frame


def _stress_rows(store) -> None:
    """The widest destination row and a message far ahead (again and again: each role's test adds them if gone)."""
    if LONG_NAME not in store.destinations():
        store.store([DelayedMessage(LONG_NAME, b"{}", FAR, message_id="long-1")])
        store.cancel(Selector(message_ids=("long-1",)))
        store.set_paused([LONG_NAME], True)
    if store.get("far-1") is None:
        store.store([DelayedMessage("orders", b'{"far": true}', FAR, {"order-id": "far"}, message_id="far-1")])
    # A paused one: its state cell holds the badge and a Resume button, the widest state a row has.
    store.pause_messages(Selector(message_ids=("far-1",)))
    if not store.delivery_history(message_id=LONG_ID).entries:
        store.store([DelayedMessage(LONG_DEST, b"{}", datetime.now(timezone.utc), {}, message_id=LONG_ID)])
        transport = SqlTableTransport(store.url)
        transport.provision(LONG_DEST)
        with only_these(store, {LONG_DEST}):
            deliver_due(store, transport, {LONG_DEST: 1})


@pytest.mark.parametrize("role", ["viewer", "user", "op"])
def test_the_page_follows_airflows_mode_and_time_zone_with_no_layout_break_from_1024_to_1920_px(
        api_server, tmp_path, role):  # noqa: F811 - the fixture imported above
    from playwright.sync_api import expect, sync_playwright

    base, store = api_server
    _stress_rows(store)
    shots = Path(os.environ.get("DELAY_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    measured = []
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = log_in(browser, base, role, timezone_id="America/New_York")
        for mode, (zone, due_text, zone_text) in SETTINGS.items():
            page.evaluate(STORE_CHOICES, [mode, zone])
            page.set_viewport_size({"width": WIDTHS[0], "height": 900})
            page.goto(f"{base}/plugin/{URL_ROUTE}", wait_until="networkidle")
            frame = page.frame_locator("iframe[title='Delayed messages']")
            expect(frame.locator("tr[data-message-id='far-1'] td.due")).to_contain_text(due_text)
            expect(frame.locator("#zone")).to_have_text(zone_text)
            # The UI and the page agree on the mode, and the page paints in it.
            assert mode in page.evaluate("document.documentElement.className")
            assert _frame(page).evaluate("document.documentElement.dataset.theme") == mode
            assert _frame(page).evaluate("getComputedStyle(document.body).backgroundColor") == BACKGROUND[mode]
            expect(frame.locator(f"#destinations tr[data-destination='{LONG_NAME}']")).to_contain_text("paused")
            # The widest the counts get: the dead-letter column shown (and, for user and op, three buttons a row).
            expect(frame.get_by_role("columnheader", name="Dead-lettered")).to_be_visible()
            if role != "viewer":  # and the bar of what a filter matches, its count and its three buttons
                frame.locator("#search").get_by_label("Due before").fill("2099-12-31T23:59:59")
                frame.locator("#search").get_by_role("button", name="Search").click()
                expect(frame.locator("#matching-count")).to_contain_text("match this filter")
            # The delivery history's widest entry and its story, open; the chart drawn.
            expect(frame.locator("body")).not_to_have_attribute("aria-busy", "true")
            expect(frame.locator(f"#history tr[data-entry-of='{LONG_ID}'][data-outcome='retried']")).to_contain_text(
                f"ConnectionError: {LONG_DEST} refused")
            expect(frame.locator("#history-chart svg rect.bar.retried").first).to_be_attached()
            frame.locator("#story-id").fill(LONG_ID)
            frame.get_by_role("button", name="Show story").click()
            expect(frame.locator("body")).not_to_have_attribute("aria-busy", "true")
            expect(frame.locator("#story li[data-outcome='delivered']")).to_contain_text(LONG_DEST)
            for width in WIDTHS:
                page.set_viewport_size({"width": width, "height": 900})
                frame_width = _frame(page).evaluate(
                    "new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => "
                    "done(document.documentElement.clientWidth))))")
                problems = layout_problems(_frame(page), TOOLBARS)
                assert problems == [], (role, mode, width, problems)
                all_link = _frame(page).evaluate("(() => { const r = document.querySelector('.link.all')"
                                                 ".getBoundingClientRect(); return [r.width, r.height]; })()")
                measured.append((mode, width, frame_width, all_link))
                # The pictures show the delivery history from its title: its chart and the recent entries.
                _frame(page).evaluate("document.getElementById('history-title').scrollIntoView({block: 'start'})")
                page.screenshot(path=str(shots / f"backlog_{role}_{mode}_{width}.png"))
                if (role, mode, width) in FOR_DOCS:
                    page.screenshot(path=str(screenshot_path(FOR_DOCS[role, mode, width], tmp_path)))
        # The page follows a change made in the UI while it is open (the storage event reaches the frame).
        page.evaluate("localStorage.setItem('theme', 'light')")
        expect(frame.locator("html")).to_have_attribute("data-theme", "light")
        browser.close()
    print(f"\n{role}: (mode, viewport px, frame px, 'All destinations' w x h px):", measured)
    assert len(list(shots.glob(f"backlog_{role}_*.png"))) == len(WIDTHS) * len(SETTINGS)


def test_run_now_on_a_paused_destination_says_it_is_held_until_resumed(api_server):  # noqa: F811
    from playwright.sync_api import expect

    base, store = api_server
    store.store([DelayedMessage("refunds", b"r", FAR, message_id="refunds-far")])  # refunds is paused
    with backlog_page(base, "admin") as (_page, frame):
        row = frame.locator("tr[data-message-id='refunds-far']")
        row.get_by_role("button", name="Run now").click()
        frame.get_by_role("alertdialog").get_by_role("button", name="Run now").click()
        expect(frame.locator("#status")).to_have_text(
            "Made due now; held while paused: 1 message; “refunds” sends nothing until resumed.")
    assert store.get("refunds-far").due_at < FAR
    assert store.destinations()["refunds"]["paused"] is True


def test_a_503_names_the_connection_and_never_its_url(api_server):  # noqa: F811
    """The page's answer to the api-server's 503 for a store that cannot be used (its body as the app gives it,
    tested in test_ui_plugin): the connection's id, the reason, and nothing else."""
    from playwright.sync_api import expect, sync_playwright

    base, _store = api_server
    detail = ("the delayed-message store of connection 'delay_store_default' is not reachable; the server's log "
              "has the details under error id 0123456789ab")
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = log_in(browser, base, "viewer")
        page.route(f"**{URL_PREFIX}/api/**", lambda route: route.fulfill(
            status=503, json={"detail": detail, "error_id": "0123456789ab", "conn_id": "delay_store_default"}))
        page.goto(f"{base}/plugin/{URL_ROUTE}", wait_until="networkidle")
        frame = page.frame_locator("iframe[title='Delayed messages']")
        panel = frame.get_by_role("alert")
        expect(panel).to_contain_text("The delayed-message store cannot be used")
        expect(panel).to_contain_text("the Airflow connection “delay_store_default” ([delay_provider] ui_conn_id)")
        expect(panel).to_contain_text(detail)
        page.unroute(f"**{URL_PREFIX}/api/**")
        frame.get_by_role("button", name="Refresh").click()  # the store is back: the panel goes
        expect(panel).to_be_hidden()
        browser.close()


def test_a_tasks_extra_link_opens_the_page_in_the_ui_on_its_destination_and_messages(api_server):  # noqa: F811
    from playwright.sync_api import expect

    base, store = api_server
    sent = ["orders-1", "orders-4"]
    assert all(store.get(m) is not None for m in sent)
    with backlog_page(base, "viewer", page_url("orders", sent)) as (_page, frame):  # in the UI, not the bare page
        expect(frame.locator("#messages tbody tr")).to_have_count(2)
        assert sorted(frame.locator("#messages tbody tr").evaluate_all(
            "rows => rows.map(r => r.dataset.messageId)")) == sent
        expect(frame.locator("#id-filter")).to_contain_text("Only the 2 messages the link names.")
        expect(frame.locator("input[name=destination]")).to_have_value("orders")
        expect(frame.locator("#histogram-title")).to_have_text("When the scheduled messages of “orders” are due")
        frame.get_by_role("button", name="Show all messages").click()
        expect(frame.locator("#id-filter")).to_be_hidden()
        expect(frame.locator("#messages tbody tr")).not_to_have_count(2)
