"""The web dashboard in a real browser (Playwright + Debian's Chromium) against a real API and worker.

A user signs in with an API key, uploads a JSONL file from the page and watches its job reach completed
(live progress, tokens/s chart, download); cancels another job while the worker runs it; and another
owner's job answers 404. Each test saves a screenshot (results/ui/).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.ui.conftest import Dashboard, screenshot
from tests.workers.helpers import read_lines, write_requests

pytestmark = pytest.mark.integration  # a browser, a server and a worker process

SignIn = Callable[[Page, str], None]


def _upload(page: Page, dashboard: Dashboard, path: Path, *, model: str | None = None) -> str:
    """Upload `path` from the jobs page; returns the batch id of the page it opens."""
    page.goto(f"{dashboard.url}/ui")
    page.fill("#upload input[name=model]", model or dashboard.model)
    page.set_input_files("#upload input[name=file]", str(path))
    page.click("#upload button[type=submit]")
    page.wait_for_url("**/ui/batches/batch_*")
    return page.url.rsplit("/", 1)[-1]


def test_upload_from_the_page_and_watch_the_job_complete(page: Page, dashboard: Dashboard,
                                                         sign_in: SignIn, tmp_path: Path) -> None:
    ids = write_requests(tmp_path / "prompts.jsonl", 160, max_tokens=40)
    with (tmp_path / "prompts.jsonl").open("ab") as out:
        out.write(b'{"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions"}\n')
    sign_in(page, "alice")
    batch_id = _upload(page, dashboard, tmp_path / "prompts.jsonl")

    expect(page.locator("#batch-status")).to_have_text("completed", timeout=120_000)
    expect(page.locator("#done")).to_contain_text("161 / 161")
    chart = page.locator("#chart")
    expect(chart).to_have_attribute("data-final", "true", timeout=15_000)
    assert int(chart.get_attribute("data-points") or 0) >= 1
    expect(chart.locator("canvas")).to_be_visible()
    expect(page.locator("#errors")).to_contain_text("line 161")  # the broken line, previewed
    screenshot(page, "job-completed")

    with page.expect_download() as download:
        page.click("#download-output")
    assert download.value.suggested_filename == f"{batch_id}_output.jsonl"
    lines = read_lines(Path(download.value.path()))
    assert [line["custom_id"] for line in lines] == ids
    with page.expect_download() as errors:
        page.click("#download-errors")
    (error_line,) = read_lines(Path(errors.value.path()))
    assert error_line["custom_id"] == "broken"

    page.goto(f"{dashboard.url}/ui")
    row = page.locator(f"tr[data-batch={batch_id}]")
    expect(row).to_contain_text("completed")
    expect(row).to_contain_text("161 / 161")
    workers = page.locator("#workers tbody tr")
    expect(workers).to_have_count(1)
    expect(workers.first).to_contain_text("llama")  # the worker's model
    expect(workers.first).to_contain_text(f":{dashboard.metrics_port}")
    screenshot(page, "dashboard")


def test_cancel_a_running_job_from_its_page(page: Page, dashboard: Dashboard, sign_in: SignIn,
                                            tmp_path: Path) -> None:
    write_requests(tmp_path / "long.jsonl", 1000, max_tokens=64)
    sign_in(page, "alice")
    batch_id = _upload(page, dashboard, tmp_path / "long.jsonl")
    expect(page.locator("#batch-status")).to_have_text("in_progress")
    page.wait_for_function("() => !document.querySelector('#done').textContent.trim().startsWith('0 /')",
                           timeout=90_000)  # the worker is on it
    expect(page.locator("#eta")).not_to_have_text("\u2014", timeout=10_000)  # measured once requests finished
    page.wait_for_function("() => Number(document.querySelector('#chart').dataset.points) >= 3",
                           timeout=20_000)  # the tokens/s line is drawn while the job runs

    overview = page.context.new_page()  # the jobs page while the job runs: the README's screenshot
    overview.goto(f"{dashboard.url}/ui")
    expect(overview.locator(f"tr[data-batch={batch_id}]")).to_contain_text("in_progress")
    throughput = "parseFloat(document.querySelector('#workers tbody tr td.num').textContent)"
    # The worker's heartbeat reports its throughput (every 10 s while busy).
    overview.wait_for_function(f"() => {throughput} > 50", timeout=30_000)
    screenshot(overview, "dashboard-running", docs=True)
    overview.close()
    screenshot(page, "job-running")

    page.once("dialog", lambda dialog: dialog.accept())  # "Cancel batch_N? Finished results are kept."
    page.click("text=Cancel batch")
    expect(page.locator("#batch-status")).to_have_text("cancelled", timeout=30_000)
    done = int(page.locator("#done").inner_text().split("/")[0])
    assert 0 < done < 1000
    expect(page.locator("text=Cancel batch")).to_have_count(0)
    screenshot(page, "job-cancelled")

    with page.expect_download() as results:  # what finished before the cancel is kept
        page.click("#download-output")
    lines = read_lines(Path(results.value.path()))
    assert len(lines) == done and all(line["response"]["status_code"] == 200 for line in lines)


def test_another_owners_job_is_a_404(page: Page, dashboard: Dashboard, sign_in: SignIn,
                                     tmp_path: Path) -> None:
    write_requests(tmp_path / "mine.jsonl", 4)
    sign_in(page, "alice")
    alices = _upload(page, dashboard, tmp_path / "mine.jsonl")
    page.context.clear_cookies()

    sign_in(page, "bob")
    expect(page.locator(f"tr[data-batch={alices}]")).to_have_count(0)  # not in bob's list
    response = page.goto(f"{dashboard.url}/ui/batches/{alices}")
    assert response is not None and response.status == 404
    expect(page.locator("h1")).to_have_text("404: no such batch")
    screenshot(page, "other-owner-404")
    for path in ("status", "timeline", "download/output", "download/errors"):
        answer = page.request.get(f"{dashboard.url}/ui/batches/{alices}/{path}")
        assert answer.status == 404, path
    refused = page.request.post(f"{dashboard.url}/ui/batches/{alices}/cancel", headers={"HX-Request": "true"})
    assert refused.status == 404


def test_sign_in_keeps_the_key_out_of_page_scripts(page: Page, dashboard: Dashboard, sign_in: SignIn) -> None:
    page.goto(f"{dashboard.url}/ui")
    page.wait_for_url("**/ui/login")
    page.fill("input[name=api_key]", "bi-not-a-key")
    page.click("button[type=submit]")
    expect(page.locator(".message.bad")).to_contain_text("unknown or revoked")
    screenshot(page, "login-refused")

    sign_in(page, "alice")
    (cookie,) = page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    assert page.evaluate("document.cookie") == ""  # no script on the page can read the key
    # A state-changing request without htmx's header (a cross-site form could send one) is refused.
    assert page.request.post(f"{dashboard.url}/ui/logout").status == 403
    page.click("text=Sign out")
    page.wait_for_url("**/ui/login")
    assert page.context.cookies() == []


def test_a_refused_upload_says_why_on_the_page(page: Page, dashboard: Dashboard, sign_in: SignIn,
                                               tmp_path: Path) -> None:
    write_requests(tmp_path / "in.jsonl", 2)
    sign_in(page, "bob")
    page.fill("#upload input[name=completion_window]", "99999999d")
    page.set_input_files("#upload input[name=file]", str(tmp_path / "in.jsonl"))
    page.click("#upload button[type=submit]")
    expect(page.locator("#upload-result .message.bad")).to_contain_text("completion_window")
    assert page.url == f"{dashboard.url}/ui"  # no batch was opened
    screenshot(page, "upload-refused")
