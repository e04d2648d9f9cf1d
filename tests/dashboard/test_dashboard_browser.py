"""The dashboard in a real browser: Debian's headless Chromium driven by
Playwright (never `playwright install`: the browser comes from apt).

One walk through what an operator does: load the overview and watch it
refresh, find a job by its key, open its timeline, be refused a replay
without the token, replay it with the token and see the audit row.  Set
DUEBOX_DASHBOARD_SCREENSHOTS=docs/img to refresh the README's screenshots.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import service_missing
from helpers import job_row

from .conftest import TOKEN, Client
from .seed import Seeded

CHROMIUM = os.environ.get("DUEBOX_TEST_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if shutil.which(CHROMIUM) is None:
        service_missing("Chromium (apt-get install -y chromium)",
                        FileNotFoundError(CHROMIUM))
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        service_missing("Playwright for Python (pip install playwright)", exc)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def shots(tmp_path: Path) -> Callable[[Any, str], None]:
    target = Path(os.environ.get("DUEBOX_DASHBOARD_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)

    def shot(page: Any, name: str) -> None:
        path = target / f"dashboard-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 5000, f"{path} is blank"

    return shot


def test_an_operator_finds_a_job_and_replays_it(
        sqlite_seeded: Seeded, serve: Callable[..., Client], browser: Any,
        shots: Callable[[Any, str], None]) -> None:
    s = sqlite_seeded
    base = serve(s.app, token=TOKEN, refresh=0.5).base
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(10_000)
    external: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(base) else external.append(r.url))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    page.goto(base + "/")
    assert page.locator("h2", has_text="Queues").is_visible()
    assert page.locator("#live svg.chart").count() == 2
    stamp = page.locator("#live p.muted").inner_text()
    # The auto-refresh replaces the live part: its timestamp moves on.
    page.wait_for_function("s => document.querySelector('#live p.muted').innerText !== s",
                           arg=stamp)
    shots(page, "overview")

    page.click("nav >> text=Jobs")
    page.fill("input[name=q]", "order-0")
    page.click("form.search button")
    page.wait_for_url(re.compile(rf".*/jobs/{s.keyed}$"))
    assert page.locator("h2", has_text="Timeline").is_visible()
    assert "finished: DEAD" in page.locator("p.where").inner_text()
    timeline = page.locator("h2:has-text('Timeline') + table").inner_text()
    for event in ("created", "due", "started", "finished"):
        assert event in timeline
    attempts = page.locator("h2:has-text('Attempts') + table").inner_text()
    assert "permanent" in attempts
    assert "declined by the provider" in attempts
    shots(page, "job")

    # No token: refused, nothing changed, no audit row.
    form = page.locator("form.action", has=page.locator("button", has_text="Replay"))
    form.locator("input[name=operator]").fill("alice")
    form.locator("input[name=reason]").fill("provider fixed the card check")
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        form.locator("button").click()
    assert posted.value.status == 403
    assert "wrong or missing operator token" in page.locator(".notice.bad").inner_text()
    assert job_row(s.app.engine, s.keyed).state == "DEAD"
    shots(page, "refused")

    page.goto(f"{base}/jobs/{s.keyed}")
    form = page.locator("form.action", has=page.locator("button", has_text="Replay"))
    form.locator("input[name=operator]").fill("alice")
    form.locator("input[name=reason]").fill("provider fixed the card check")
    form.locator("input[name=token]").fill(TOKEN)
    form.locator("button").click()
    page.wait_for_url(re.compile(rf".*/jobs/{s.keyed}\?flash="))
    assert "replayed 1" in page.locator(".notice.ok").inner_text()
    audit = page.locator("table.audit").inner_text()
    assert "replay" in audit
    assert "alice" in audit
    assert "provider fixed the card check" in audit
    assert job_row(s.app.engine, s.keyed).state == "SCHEDULED"

    for path, name in (("/jobs?state=SCHEDULED", "jobs"), ("/dlq", "dlq"),
                       (f"/schedules/{s.schedule_id}", "schedule"),
                       ("/processes", "processes")):
        page.goto(base + path)
        shots(page, name)
    assert external == [], f"the pages fetched from elsewhere: {external}"
    assert errors == [], f"script errors: {errors}"
    page.close()
