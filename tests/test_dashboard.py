"""The live dashboard in a real headless Chromium (Debian's, driven by Playwright), against a real
gateway whose limit is tripped by real requests: the numbers and charts update every second and
agree with ``/metrics``; the page loads nothing from anywhere but the admin listener.

The screenshot is written to ``$GATEWAY_TEST_ARTIFACTS`` (default: the test's tmp directory).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from playwright.async_api import Browser, Page, async_playwright

from gateway.clock import FakeClock
from tests.conftest import GatewayFactory, RecordingUpstream
from tests.test_metrics import PER_IP_BURST_4, TIMEOUT, get_status, limited_policy, scrape, value

CHROMIUM = "/usr/bin/chromium"
STATIC = Path(__file__).resolve().parent.parent / "gateway" / "static" / "dashboard"
SHADOW = "  shadow:\n    algorithm: fixed_window\n    limit: 6\n    window: 1h\n    dry_run: true\n"


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            yield browser
        finally:
            await browser.close()


async def wait_until(
    page: Page, condition: Callable[[], object], what: str, within_s: float = 8.0
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within_s}s waiting for {what}")
        await asyncio.sleep(0.1)


async def field(page: Page, limit: str, name: str) -> str:
    return await page.inner_text(f'#limit-{limit} [data-field="{name}"]')


def artifacts_dir(tmp_path: Path) -> Path:
    directory = Path(os.environ.get("GATEWAY_TEST_ARTIFACTS", tmp_path))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


async def test_dashboard_shows_rejections_live_and_agrees_with_metrics(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    browser: Browser,
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    gw = await start_gateway(limited_policy(upstream.url, PER_IP_BURST_4 + SHADOW), clock=clock)
    admin = urlsplit(gw.admin_url)
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    await page.goto(gw.admin_url + "/dashboard")
    assert page.url == gw.admin_url + "/dashboard/"
    await wait_until(
        page, lambda: page.locator("#limit-per_ip").count(), "the limit's card to be drawn"
    )
    assert await field(page, "per_ip", "rejected-total") == "0"

    # rate 1r/m, burst 4, clock frozen: 5 of 12 requests admitted, 7 rejected; the dry-run
    # limit (6 per hour) would have rejected 6.
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        statuses = [await get_status(session, gw.url + f"/p{i}") for i in range(12)]
        assert statuses.count(429) == 7

        async def rejected_shown() -> bool:
            return await field(page, "per_ip", "rejected-total") == "7"

        await wait_until(page, rejected_shown, "the rejected total to reach 7")
        samples, _ = await scrape(session, gw.admin_url)

    metric_rejected = value(
        samples, "gateway_limit_decisions_total", limit="per_ip", result="rejected"
    )
    assert int(await field(page, "per_ip", "rejected-total")) == metric_rejected == 7
    assert int(await field(page, "per_ip", "allowed-total")) == 5
    assert await field(page, "per_ip", "ratio") == f"{7 / 12:.1%}"
    assert await field(page, "shadow", "rejected-total") == "6"
    assert await page.is_visible("#limit-shadow .badge.dry")
    assert await page.inner_text("#limit-per_ip .top tbody") == "127.0.0.1\t7\t0"

    # The rejection chart: per-second rates, each over its point's interval, add up to the
    # 7 rejections.
    chart = await page.evaluate(
        """() => {
            const view = window.gatewayDashboard.limits["per_ip"];
            return {
                dt: window.gatewayDashboard.history.map((point) => point.dt),
                rejected: view.rates.data[3],
                ratio: view.ratio.data[1],
            };
        }"""
    )
    integral = sum(
        (rate or 0) * dt for rate, dt in zip(chart["rejected"], chart["dt"], strict=True)
    )
    assert integral == pytest.approx(7, abs=0.05)
    # 7 of 12 overall: whichever seconds the requests fell in, one of them shows at least that.
    assert max(r for r in chart["ratio"] if r is not None) >= 7 / 12 - 1e-9

    # At least one redraw a second.
    before = await page.evaluate("window.gatewayDashboard.updates")
    await asyncio.sleep(4.2)
    assert await page.evaluate("window.gatewayDashboard.updates") - before >= 3

    await page.screenshot(path=artifacts_dir(tmp_path) / "dashboard.png", full_page=True)
    assert not errors
    # Works offline: everything came from the admin listener (uPlot is vendored).
    assert requested and all(urlsplit(url).netloc == admin.netloc for url in requested), requested
    await page.close()


async def test_event_stream_sends_history_first_and_ends_at_shutdown(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(limited_policy(upstream.url, PER_IP_BURST_4))
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(gw.admin_url + "/dashboard/events") as resp,
    ):
        assert resp.headers["Content-Type"] == "text/event-stream"
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"event: init\ndata: {")
        second = await resp.content.readuntil(b"\n\n")
        assert second.startswith(b"event: point\ndata: {")
        loop = asyncio.get_running_loop()
        started = loop.time()
        await gw.gateway.stop()
        rest = await resp.content.read()  # the server ends the stream, it does not hang
        assert loop.time() - started < 5
        assert b"event: init" not in rest


async def test_page_and_vendored_chart_library_are_served_with_its_license(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(limited_policy(upstream.url, PER_IP_BURST_4))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(gw.admin_url + "/dashboard/static/vendor/uPlot.LICENSE") as resp:
            assert resp.status == 200
            assert "MIT License" in await resp.text()
        async with session.get(gw.admin_url + "/dashboard/static/vendor/uPlot.iife.min.js") as r:
            assert r.status == 200
            assert (await r.text()).startswith("/*! https://github.com/leeoniya/uPlot (v1.6.")
        async with session.get(gw.admin_url + "/dashboard/static/../../proxy.py") as resp:
            assert resp.status in (403, 404)
    html = (STATIC / "index.html").read_text()
    # No CDN: every script, stylesheet and link points into this gateway.
    for target in re.findall(r'(?:src|href)="([^"]+)"', html):
        assert target.startswith(("/dashboard/", "/metrics")), target
