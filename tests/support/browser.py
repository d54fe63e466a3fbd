"""Debian's headless Chromium driven by Playwright (no browser download), for the pages the
admin listener serves."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, async_playwright

from tests.support.waiting import wait_until

CHROMIUM = "/usr/bin/chromium"


def artifacts_dir(tmp_path: Path) -> Path:
    """Where screenshots go: ``$GATEWAY_TEST_ARTIFACTS`` (kept by CI), else the test's tmp."""
    directory = Path(os.environ.get("GATEWAY_TEST_ARTIFACTS", tmp_path))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            yield browser
        finally:
            await browser.close()


async def dashboard_field(page: Page, limit: str, name: str) -> str:
    """The text of one field of one limit's card on the dashboard."""
    return await page.inner_text(f'#limit-{limit} [data-field="{name}"]')


async def until_shown(condition: Callable[[], object], what: str, within_s: float = 8.0) -> None:
    """Until a page shows what ``condition`` (plain or async) looks for; the dashboard updates
    once a second, so a look every 0.1 s."""
    await wait_until(condition, what, within_s, every_s=0.1)
