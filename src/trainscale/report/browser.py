"""Open a report page in headless Chromium (Debian's /usr/bin/chromium) and check it as a reader
would see it: every image decoded, no console errors; a screenshot of the page."""

from __future__ import annotations

import shutil
from pathlib import Path

from trainscale.errors import TrainscaleError

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise TrainscaleError("no Chromium found; install Debian's 'chromium' package (make installs it)")


def check_page(page_path: str | Path, screenshot: str | Path | None = None) -> dict:
    """-> {"images": n, "broken_images": [...], "console_errors": [...], "title": ...}."""
    from playwright.sync_api import sync_playwright

    url = Path(page_path).resolve().as_uri()
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url, wait_until="load")
        images = page.eval_on_selector_all(
            "img", "els => els.map(e => ({src: e.getAttribute('src'), ok: e.complete && e.naturalWidth > 0}))")
        title = page.title()
        if screenshot is not None:
            Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    return {"images": len(images), "broken_images": [i["src"] for i in images if not i["ok"]],
            "console_errors": errors, "title": title}
