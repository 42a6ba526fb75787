"""Fixtures of the browser tests: the API with its dashboard, a real local worker, Debian's Chromium.

The API runs under uvicorn in a thread on a SQLite file; a `batchinfer worker` process on the tiny model
polls the same file. Playwright drives /usr/bin/chromium (Playwright's own browser download cannot be
reached here); the tests skip only when no Chromium is installed. Screenshots go to results/ui/ (ignored
by git); with UPDATE_DOCS_SCREENSHOT=1 the dashboard's is also written to docs/dashboard.png.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from batchinfer.api.app import create_app
from batchinfer.config import Settings
from batchinfer.store.apikeys import create_key
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.workers import list_workers
from tests.api.helpers import serve
from tests.metrics.helpers import free_port, local_worker, worker_env

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "results" / "ui"
DOCS_SCREENSHOT = REPO / "docs" / "dashboard.png"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_path() -> str | None:
    """Debian's Chromium, if installed (`.ci/run` installs the `chromium` package)."""
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass
class Dashboard:
    """The running API (base URL), its database, the API keys of two owners, and the worker's model."""

    url: str
    sessions: object
    keys: dict[str, str]
    model: str
    metrics_port: int
    tmp: Path


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Dashboard]:
    tmp = tmp_path_factory.mktemp("ui")
    url = f"sqlite:///{tmp / 'ui.db'}"
    upgrade(url)
    settings = Settings(data_dir=tmp / "data", database_url=url, default_model=str(tiny_llama), shard_size=16,
                        api_host="127.0.0.1")
    sessions = session_factory(url)
    keys = {}
    with sessions() as session:
        for owner in ("alice", "bob"):
            keys[owner], _ = create_key(session, name=owner, owner=owner)
    port = free_port()
    env = worker_env(database_url=url, data_dir=tmp / "data", model=tiny_llama)
    log = tmp / "worker.log"
    with local_worker(env, log, metrics_port=port) as proc, serve(create_app(settings)) as base:
        deadline = time.monotonic() + 120
        while True:  # the worker registers once its engine is loaded
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            with sessions() as session:
                if list_workers(session):
                    break
            time.sleep(0.2)
        yield Dashboard(base, sessions, keys, str(tiny_llama), port, tmp)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium installed (Debian: apt-get install chromium); the browser tests need one")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh browser context (no cookies) and page; the test's last screen is saved as a screenshot."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        yield page
    finally:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{request.node.name}-end.png"), full_page=True)
        context.close()


def screenshot(page: Page, name: str, *, docs: bool = False) -> Path:
    """Save the page as results/ui/<name>.png (and as docs/dashboard.png when asked and enabled)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if docs and os.environ.get("UPDATE_DOCS_SCREENSHOT") == "1":
        DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS_SCREENSHOT)
    return path


@pytest.fixture
def sign_in(dashboard: Dashboard) -> Callable[[Page, str], None]:
    """Sign `page` in as `owner` through the login form."""

    def sign_in(page: Page, owner: str) -> None:
        page.goto(f"{dashboard.url}/ui")
        page.wait_for_url("**/ui/login")
        page.fill("input[name=api_key]", dashboard.keys[owner])
        page.click("button[type=submit]")
        page.wait_for_url(f"{dashboard.url}/ui")

    return sign_in
