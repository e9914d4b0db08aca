"""Debian's Chromium driven by Playwright (its own browser download cannot reach the internet), and
where the screenshots a person looks at land."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

SHOTS = Path(__file__).resolve().parents[2] / "test-output" / "ui"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.contextmanager
def chromium_page() -> Iterator:
    """A Playwright page in Debian's Chromium, 1400x1000, 30 s for anything to appear."""
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(30_000)
        try:
            yield page
        finally:
            browser.close()


def open_artifact(url: str, artifact_id: str, heading: str, shot: str, *texts: str) -> None:
    """The artifact's page in the UI: its first heading starts with `heading`, each of `texts` is
    on the page; a screenshot of it lands in SHOTS/`shot`."""
    from playwright.sync_api import expect

    with chromium_page() as page:
        page.goto(f"{url}/artifacts/artifact/{artifact_id}")
        expect(page.locator("h1", has_text=heading).first).to_be_visible()
        for text in texts:
            expect(page.get_by_text(text).first).to_be_visible()
        page.screenshot(path=SHOTS / shot, full_page=True)
