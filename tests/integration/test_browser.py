"""A real browser (Debian's chromium, headless, driven by Playwright) against `airflow standalone`:
the manual send DAG's trigger form, filled in and submitted, and the message delivered after its delay."""

from __future__ import annotations

import shutil
import time
from datetime import timedelta

import pytest

from airflow_delay_provider.core.delays import utcnow
from airflow_delay_provider.core.pump import Pump
from airflow_delay_provider.stores.sql import SqlDelayedMessageStore
from airflow_delay_provider.transports.sql import SqlTableTransport
from tests.browser_helpers import (
    airflow_env,
    airflow_process,
    get_json,
    launch_chromium,
    require_chromium,
    screenshot_path,
)
from tests.conftest import ROOT
from tests.services import free_port


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """`airflow standalone` (scheduler, dag-processor, triggerer, api-server) on a free port, with
    only the manual send DAG, no login; yields (base URL, AIRFLOW_HOME)."""
    require_chromium()
    home = tmp_path_factory.mktemp("standalone")
    dags = home / "dags"
    dags.mkdir()
    shutil.copy(ROOT / "dags" / "delay_manual_send.py", dags)
    port = free_port()
    env = airflow_env(
        home, port,
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",
        AIRFLOW__CORE__PARALLELISM="4",
        AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
        AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
    )
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        return any(d["dag_id"] == "delay_manual_send" for d in get_json(base + "/api/v2/dags")["dags"])

    with airflow_process(["standalone"], env, home, ready):
        yield base, home


def test_trigger_form_in_a_browser_sends_a_message_delivered_after_its_delay(standalone, tmp_path):
    from playwright.sync_api import sync_playwright

    screenshot = screenshot_path("manual_send_form.png", tmp_path)
    base, home = standalone
    url = f"sqlite:///{home / 'delay_store.db'}"  # the store of the standalone's delay_store_default
    queue = SqlTableTransport(url)
    queue.provision("browser.q")

    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(f"{base}/dags/delay_manual_send", wait_until="networkidle")
        page.get_by_role("button", name="Trigger").first.click()
        form = page.get_by_role("dialog")
        delay = form.locator("input[name=element_delay_seconds]")
        delay.fill("999999999")
        delay.blur()
        assert delay.input_value() == "315576000"  # the form holds the delay to its ten-year maximum
        delay.fill("3")
        form.locator("#element_destination").fill("browser.q")
        form.locator("#element_body").fill('{"from": "the browser"}')
        page.screenshot(path=str(screenshot))
        triggered_at = utcnow()
        form.get_by_role("button", name="Trigger").click()
        page.wait_for_timeout(1000)
        browser.close()

    deadline = time.monotonic() + 120
    run = None
    while time.monotonic() < deadline:
        try:
            runs = get_json(f"{base}/api/v2/dags/delay_manual_send/dagRuns")["dag_runs"]
        except OSError:  # the api-server shares 2 cores with the whole of Airflow: ask again
            continue
        run = runs[0] if runs else None
        if run and run["state"] in ("success", "failed"):
            break
        time.sleep(1)
    assert run is not None and run["state"] == "success", run
    assert run["conf"]["destination"] == "browser.q" and run["conf"]["delay_seconds"] == 3

    store = SqlDelayedMessageStore(url)
    [(destination, count)] = store.count_scheduled().items()
    assert (destination, count) == ("browser.q", 1)
    due = store.next_due()
    assert triggered_at + timedelta(seconds=3) <= due <= utcnow() + timedelta(seconds=3)
    Pump(store, queue).run(deadline=utcnow() + timedelta(seconds=30), stop_when_idle=False,
                           due_before=due + timedelta(microseconds=1))
    delivered_at = utcnow()
    [message] = queue.receive("browser.q")
    assert message.body == b'{"from": "the browser"}'
    assert delivered_at >= due  # never early
    assert screenshot.stat().st_size > 10_000
