"""What the real-browser tests share: Debian's chromium (driven by Playwright), an Airflow process of the
test's own on a free port, and where a test's screenshot goes.

Playwright's own browser download is unreachable, so the tests drive /usr/bin/chromium (`make test`
installs it). Set DELAY_UPDATE_SCREENSHOT=1 to write the screenshots into docs/ instead of the test's
temporary folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from airflow_delay_provider.ui.paths import URL_ROUTE
from tests.conftest import ROOT

CHROMIUM = "/usr/bin/chromium"
BIN_DIR = Path(sys.executable).parent
#: The passwords of the users of SimpleAuthManager's four roles (each user named after its role).
PASSWORDS = {role: f"{role}-password" for role in ("admin", "op", "user", "viewer")}


def require_chromium() -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (`make test` does)", pytrace=False)


def launch_chromium(playwright):
    """Headless Debian chromium."""
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])


def log_in(browser, base: str, user: str, **context_options):
    """A page of a new browser context (`context_options`: Playwright's, e.g. timezone_id), logged in as `user`
    through Airflow's login form."""
    context = browser.new_context(**{"viewport": {"width": 1400, "height": 1000}, **context_options})
    page = context.new_page()
    page.goto(base + "/", wait_until="networkidle")  # Airflow sends the browser to its login form
    page.get_by_label("Username").fill(user)
    page.get_by_label("Password").fill(PASSWORDS[user])
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(base + "/", timeout=30_000)
    return page


@contextmanager
def backlog_page(base: str, user: str, path: str = f"/plugin/{URL_ROUTE}") -> Iterator[tuple[Any, Any]]:
    """Chromium logged in to Airflow's UI at `base` as `user`, on the backlog page in the UI (or at `path`) once
    the network is idle: yields (the page, a locator of the backlog page's frame); the browser is closed after."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = log_in(browser, base, user)
            page.goto(base + path, wait_until="networkidle")
            yield page, page.frame_locator("iframe[title='Delayed messages']")
        finally:
            browser.close()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=15) as response:
        return json.load(response)


def screenshot_path(name: str, tmp_path: Path) -> Path:
    """docs/<name> when DELAY_UPDATE_SCREENSHOT is set, else a file in the test's temporary folder."""
    return ROOT / "docs" / name if os.environ.get("DELAY_UPDATE_SCREENSHOT") else tmp_path / name


def airflow_env(home: Path, port: int, **settings: str) -> dict[str, str]:
    """The environment of an Airflow of its own: AIRFLOW_HOME `home` (its own SQLite metadata database, not
    the tests'), the api-server on 127.0.0.1:`port`, no examples, and `delay_store_default` a SQLite store
    at home/delay_store.db; `settings` are added (AIRFLOW__SECTION__KEY names)."""
    env = {
        **os.environ,
        "PATH": str(BIN_DIR) + os.pathsep + os.environ.get("PATH", ""),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        **settings,
    }
    env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", None)  # its own SQLite database, not the tests'
    env["AIRFLOW_CONN_DELAY_STORE_DEFAULT"] = json.dumps(
        {"conn_type": "delay_store", "schema": str(home / "delay_store.db"), "extra": {"driver": "sqlite"}})
    return env


@contextmanager
def airflow_process(args: list[str], env: dict[str, str], home: Path, ready: Callable[[], bool],
                    timeout: float = 180) -> Iterator[subprocess.Popen]:
    """`airflow <args>` in a session of its own, logging to home/<args[0]>.log, until `ready()` (connection
    errors count as not yet); stopped (SIGTERM, then SIGKILL) at the end."""
    log_path = home / f"{args[0]}.log"
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until the block ends
    proc = subprocess.Popen([str(BIN_DIR / "airflow"), *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    name = f"airflow {args[0]}"
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ready():
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                pytest.fail(f"{name} exited: {log_path.read_text()[-3000:]}", pytrace=False)
            time.sleep(1)
        else:
            pytest.fail(f"{name} did not come up: {log_path.read_text()[-3000:]}", pytrace=False)
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


#: What counts as a layout break on a page: tests/layout_problems.js (a function evaluated in the page).
LAYOUT_PROBLEMS_JS = (Path(__file__).parent / "layout_problems.js").read_text()


def layout_problems(frame, toolbars: list[str]) -> list[str]:
    """LAYOUT_PROBLEMS_JS in a Playwright frame (or page), the toolbars given as CSS selectors."""
    return frame.evaluate(LAYOUT_PROBLEMS_JS, toolbars)
