"""The live dashboard in a real headless Chromium (Debian's, driven by Playwright), against a real
gateway whose limit is tripped by real requests: the numbers and charts update every second and
agree with ``/metrics``; the page loads nothing from anywhere but the admin listener.

The screenshot is written to ``$GATEWAY_TEST_ARTIFACTS`` (default: the test's tmp directory).
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import openai
import pytest
from playwright.async_api import Browser

from gateway.clock import FakeClock
from gateway.engine.preflight import load_and_build, parse_and_build
from tests.support import redis_harness
from tests.support.browser import artifacts_dir, dashboard_field, until_shown
from tests.support.gateways import GatewayFactory
from tests.support.llm_upstream import LlmUpstream
from tests.support.metrics import Samples, scrape, scrape_until, value
from tests.support.network import TIMEOUT, get_status
from tests.support.policies import PER_IP_BURST_4, limited_policy, replace_file
from tests.support.processes import run_workers
from tests.support.redis_harness import RedisServer
from tests.support.upstreams import RecordingUpstream

redis_server = redis_harness.redis_server

STATIC = Path(__file__).resolve().parent.parent / "gateway" / "static" / "dashboard"
SHADOW = "  shadow:\n    algorithm: fixed_window\n    limit: 6\n    window: 1h\n    dry_run: true\n"


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
    await until_shown(lambda: page.locator("#limit-per_ip").count(), "the limit's card to be drawn")
    assert await dashboard_field(page, "per_ip", "rejected-total") == "0"

    # rate 1r/m, burst 4, clock frozen: 5 of 12 requests admitted, 7 rejected; the dry-run
    # limit (6 per hour) would have rejected 6.
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        statuses = [await get_status(session, gw.url + f"/p{i}") for i in range(12)]
        assert statuses.count(429) == 7

        async def rejected_shown() -> bool:
            return await dashboard_field(page, "per_ip", "rejected-total") == "7"

        await until_shown(rejected_shown, "the rejected total to reach 7")
        samples, _ = await scrape(session, gw.admin_url)

    metric_rejected = value(
        samples, "gateway_limit_decisions_total", limit="per_ip", result="rejected"
    )
    assert int(await dashboard_field(page, "per_ip", "rejected-total")) == metric_rejected == 7
    assert int(await dashboard_field(page, "per_ip", "allowed-total")) == 5
    assert await dashboard_field(page, "per_ip", "ratio") == f"{7 / 12:.1%}"
    assert await dashboard_field(page, "shadow", "rejected-total") == "6"
    assert await page.is_visible("#limit-shadow .badge.dry")
    assert await page.inner_text("#limit-per_ip .top tbody") == "127.0.0.1\t—\t7\t0"
    assert await dashboard_field(page, "per_ip", "tracked-keys") == "1 key"  # one client

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

    # At least one redraw a second: a tick every whole second, so 4 in any 4.2 s.
    before = await page.evaluate("window.gatewayDashboard.updates")
    await asyncio.sleep(4.2)
    assert await page.evaluate("window.gatewayDashboard.updates") - before >= 4

    await page.screenshot(path=artifacts_dir(tmp_path) / "dashboard.png", full_page=True)
    assert not errors
    # Works offline: everything came from the admin listener (uPlot is vendored).
    assert requested and all(urlsplit(url).netloc == admin.netloc for url in requested), requested
    await page.close()


async def test_dashboard_shows_a_limits_penalty(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, browser: Browser
) -> None:
    """A limit with a penalty: the keys its boxes block now and the requests a block refused,
    as /metrics counts them; a limit without one shows no such line."""
    guarded = (
        "  guarded:\n    algorithm: sliding_log\n    limit: 1\n    window: 1h\n"
        "    penalty: {after: 2, within: 1m, block: 15m, status: 403}\n"
    )
    gw = await start_gateway(
        limited_policy(upstream.url, guarded + SHADOW.replace("dry_run: true", "dry_run: false")),
        clock=FakeClock(),
    )
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(gw.admin_url + "/dashboard/")
    await until_shown(lambda: page.locator("#limit-guarded").count(), "the limit's card")
    assert await page.is_visible("#limit-guarded .penalty")
    assert not await page.is_visible("#limit-shadow .penalty")
    assert await dashboard_field(page, "guarded", "blocked-keys") == "0 keys"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        statuses = [await get_status(session, gw.url + "/") for _ in range(5)]
        assert statuses == [200, 429, 429, 403, 403]  # the 2nd rejection blocks the client

        async def penalty_shown() -> bool:
            return (
                await dashboard_field(page, "guarded", "blocked-keys") == "1 key"
                and await dashboard_field(page, "guarded", "penalized-total") == "2"
            )

        await until_shown(penalty_shown, "1 key blocked, 2 requests refused by it")
        samples, _ = await scrape(session, gw.admin_url)
    assert value(samples, "gateway_limit_blocked_keys", limit="guarded") == 1
    assert value(samples, "gateway_limit_blocked_keys", limit="shadow") == 0
    assert value(samples, "gateway_limit_decisions_total", limit="guarded", result="penalized") == 2
    assert not errors
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
        assert target.startswith(("/dashboard/", "/metrics", "/status")), target


def prometheus_quantile(q: float, samples: Samples, name: str, **labels: str) -> float:
    """PromQL ``histogram_quantile`` over one scrape's cumulative buckets of ``name``."""
    buckets = sorted(
        (float(dict(key)["le"]), count)
        for (sample, key), count in samples.items()
        if sample == name + "_bucket" and all(dict(key).get(k) == v for k, v in labels.items())
    )
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    raise AssertionError("rank beyond the +Inf bucket")


async def test_dashboard_shows_queue_store_policy_and_reloads(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    browser: Browser,
    tmp_path: Path,
) -> None:
    # rate 2r/s, burst 5, no nodelay, clock frozen: of 5 requests at once the 2nd to 5th wait
    # 0.5, 1, 1.5 and 2 s (nginx: excess / rate), so they are in the queue across a tick.
    smooth = "  smooth:\n    algorithm: leaky_bucket\n    rate: 2r/s\n    burst: 5\n"
    path = tmp_path / "policy.yaml"
    path.write_text(limited_policy(upstream.url, smooth))
    gw = await start_gateway(load_and_build(path), clock=FakeClock(), policy_path=str(path))
    # A locale whose own times are 12-hour: the page's are 24-hour whatever the locale.
    page = await browser.new_page(viewport={"width": 1280, "height": 900}, locale="en-US")
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(gw.admin_url + "/dashboard/")
    await until_shown(lambda: page.locator("#limit-smooth").count(), "the limit's card")

    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        # Store and policy, as /metrics and /policy tell them.
        samples, text = await scrape(session, gw.admin_url)
        assert value(samples, "gateway_store_state", store="memory", state="ok") == 1
        assert await page.inner_text("#store") == "memory"
        assert await page.get_attribute("#store", "data-state") == "ok"
        async with session.get(gw.admin_url + "/policy") as resp:
            sha = (await resp.json())["sha256"]
        assert f'gateway_policy_info{{sha256="{sha[:12]}"}} 1.0' in text
        assert await page.inner_text("#policy") == sha[:12]
        assert await page.inner_text("#reload") == "none (0 ok, 0 failed)"

        # Queue depth while the delayed requests wait, then the waits' p50 / p99.
        assert await dashboard_field(page, "smooth", "waiting") == "0"
        sending = [asyncio.create_task(get_status(session, gw.url + "/")) for _ in range(5)]

        async def queue_shown() -> bool:
            depth = await dashboard_field(page, "smooth", "waiting")
            return depth.isdigit() and 1 <= int(depth) <= 4

        await until_shown(queue_shown, "a queue depth of 1 to 4", within_s=3)
        assert await asyncio.gather(*sending) == [200] * 5
        samples, _ = await scrape(session, gw.admin_url)
        wait = "gateway_limit_queue_wait_seconds"
        # The four waits, in the buckets their definitions put them in.
        assert value(samples, wait + "_bucket", limit="smooth", le="0.25") == 0
        assert value(samples, wait + "_bucket", limit="smooth", le="0.5") == 1
        assert value(samples, wait + "_bucket", limit="smooth", le="1.0") == 2
        assert value(samples, wait + "_bucket", limit="smooth", le="2.5") == 4
        p50 = prometheus_quantile(0.5, samples, wait, limit="smooth")
        p99 = prometheus_quantile(0.99, samples, wait, limit="smooth")
        assert (p50, p99) == pytest.approx((1.0, 2.47))  # rank 2 of 4, rank 3.96 of 4
        expected_wait = f"{p50:.2f} s / {p99:.2f} s"  # the page's format for waits of 1 s or more

        async def waits_shown() -> bool:
            return (
                await dashboard_field(page, "smooth", "wait") == expected_wait
                and await dashboard_field(page, "smooth", "waiting") == "0"
            )

        await until_shown(waits_shown, f"p50 / p99 {expected_wait} and an empty queue", 3)
        assert await dashboard_field(page, "smooth", "delayed-total") == "4"

        # One reload from the edited file: the result and the new policy's hash.
        replace_file(path, limited_policy(upstream.url, smooth.replace("burst: 5", "burst: 6")))
        async with session.post(gw.admin_url + "/reload") as resp:
            assert (await resp.json())["result"] in ("ok", "unchanged")  # the watcher may be first
        async with session.get(gw.admin_url + "/policy") as resp:
            new_sha = (await resp.json())["sha256"]
        assert new_sha != sha

        async def reload_shown() -> bool:
            shown = await page.inner_text("#reload")
            return bool(re.fullmatch(r"ok at \d\d:\d\d:\d\d \(1 ok, 0 failed\)", shown)) and (
                await page.inner_text("#policy") == new_sha[:12]
            )

        await until_shown(reload_shown, "the reload and the new hash", within_s=3)
        assert await page.get_attribute("#reload", "data-result") == "ok"

        # A failed reload: shown with its error; the running policy (and its hash) stays.
        replace_file(path, "limits: [not, a, mapping]\n")
        async with session.post(gw.admin_url + "/reload") as resp:
            assert resp.status == 422
            error = (await resp.json())["error"]

        async def failure_shown() -> bool:
            return await page.get_attribute("#reload", "data-result") == "failed"

        await until_shown(failure_shown, "the failed reload", within_s=3)
        shown = await page.inner_text("#reload")
        assert re.fullmatch(r"failed at \d\d:\d\d:\d\d \(1 ok, [12] failed\)", shown), shown
        assert await page.get_attribute("#reload", "title") == error
        assert await page.inner_text("#policy") == new_sha[:12]
    assert not errors
    await page.close()


@pytest.mark.slow
async def test_dashboard_shows_the_whole_gateway_with_two_workers(
    upstream: RecordingUpstream, redis_server: RedisServer, browser: Browser, tmp_path: Path
) -> None:
    # Several workers need a shared store to run limits; the decisions are counted per worker.
    policy = (
        f"store:\n  url: {redis_server.url}\n  key_prefix: 'dash-{uuid.uuid4().hex[:8]}:'\n"
        "limits:\n  per_ip:\n    algorithm: leaky_bucket\n    rate: 1000r/s\n    burst: 1000\n"
        "    nodelay: true\n"
    )
    requests = 40
    async with (
        run_workers(upstream.url, tmp_path, policy) as workers,
        aiohttp.ClientSession(
            timeout=TIMEOUT, connector=aiohttp.TCPConnector(force_close=True)
        ) as session,
    ):
        proxy_url, admin_url, _ = workers
        await scrape_until(session, admin_url, lambda s: value(s, "gateway_workers") == 2, 20)
        # A new connection per request: the kernel spreads them over both workers.
        for i in range(requests):
            assert await get_status(session, proxy_url + f"/r{i}") == 200

        def counted_by(worker: int) -> int:
            file = tmp_path / "metrics" / f"worker-{worker}.json"
            return sum(row[3] for row in json.loads(file.read_text())["requests"])

        # Every answer, whichever worker gives it, has both workers' requests.
        answered_by: set[int] = set()
        for _ in range(40):  # bounded: fresh connections land on both workers long before
            async with session.get(admin_url + "/dashboard/state") as resp:
                body = await resp.json()
            state = body["state"]
            if state["requests"] < requests:  # the other worker publishes once a second
                await asyncio.sleep(0.2)
                continue
            assert state["requests"] == requests
            assert state["limits"]["per_ip"]["allowed"] == requests
            assert state["workers"] == 2 and state["worker_ids"] == [0, 1]
            answered_by.add(body["worker"])
            if answered_by == {0, 1}:
                break
        assert answered_by == {0, 1}
        # Each worker served some of the requests: no one worker's figures are the total.
        assert 0 < counted_by(0) < requests and counted_by(0) + counted_by(1) == requests

        page = await browser.new_page()
        await page.goto(admin_url + "/dashboard/")

        async def whole_gateway_shown() -> bool:
            return (
                await page.inner_text("#requests-total") == str(requests)
                and await page.locator("#limit-per_ip").count() == 1
                and await dashboard_field(page, "per_ip", "allowed-total") == str(requests)
            )

        await until_shown(whole_gateway_shown, f"{requests} requests on the page", 5)
        assert await page.inner_text("#workers") == "2 (ids 0, 1)"
        await page.close()


SIX_LIMITS = """\
  per_ip:
    algorithm: leaky_bucket
    rate: 1r/m
    burst: 20
    nodelay: true
  login:
    algorithm: sliding_window
    limit: 5
    window: 1m
  per_key:
    algorithm: token_bucket
    rate: 1r/m
    burst: 2
    key: ['header:X-Api-Key']
    plans: {gold: {burst: 3}}
    overrides: {key-gold: gold}
  window:
    algorithm: fixed_window
    limit: 1000
    window: 1h
  log:
    algorithm: sliding_log
    limit: 1000
    window: 1h
  shadow:
    algorithm: fixed_window
    limit: 1
    window: 1h
    dry_run: true
"""


def _ratio_pixels_script(limit: str) -> str:
    """Pixels of the ratio series' colour (#6a1b9a) drawn on a limit's ratio chart."""
    return f"""() => {{
        const canvas = document.querySelector('#limit-{limit} .chart.ratio canvas');
        const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let count = 0;
        for (let i = 0; i < data.length; i += 4) {{
            const [r, g, b, a] = [data[i], data[i + 1], data[i + 2], data[i + 3]];
            const near = (v, want) => Math.abs(v - want) < 30;
            if (a > 200 && near(r, 0x6a) && near(g, 0x1b) && near(b, 0x9a)) count++;
        }}
        return count;
    }}"""


async def test_six_limits_read_at_a_glance_at_1400x1000(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, browser: Browser, tmp_path: Path
) -> None:
    """The overview shows every limit without scrolling, the header the gateway's totals, a
    limit that rejected in one second only (an isolated point between gaps) a ratio chart with
    that point drawn, and a top key its plan. The page is drawn from the data it came with:
    its event stream is cut here."""
    gw = await start_gateway(limited_policy(upstream.url, SIX_LIMITS), clock=FakeClock())
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        # The gold key: per_key (its plan's burst of 3) refuses the 4th; then 8 without a key
        # (per_key skips them): login has 2 of its 5 left.
        gold = {"X-Api-Key": "key-gold"}
        statuses = [await get_status(session, gw.url + "/", headers=gold) for _ in range(4)]
        assert statuses == [200, 200, 200, 429]
        statuses = [await get_status(session, gw.url + f"/{i}") for i in range(8)]
        assert statuses == [200, 200] + [429] * 6
        await asyncio.sleep(2.5)  # two ticks: the second holds the rejections, the next none

    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.route("**/dashboard/events", lambda route: route.abort())
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(gw.admin_url + "/dashboard/")
    rows = page.locator("#overview-rows tr")
    assert await rows.count() == 6
    for index in range(6):
        box = await rows.nth(index).bounding_box()
        assert box is not None and box["y"] + box["height"] <= 1000, (index, box)
    assert await page.evaluate("window.scrollY") == 0
    assert await page.inner_text("#requests-total") == "12"
    assert await page.inner_text("#rejected-total") == "7"
    login_row = page.locator('#overview-rows tr[data-limit="login"]')
    assert await login_row.locator(".worst").inner_text() == "127.0.0.1: 6"
    # The worst key of per_key: hashed (an API key), with its plan.
    worst = await page.locator('#overview-rows tr[data-limit="per_key"] .worst').inner_text()
    assert re.fullmatch(r"sha256:[0-9a-f]{12} \(gold\): 1", worst), worst
    assert await page.inner_text("#limit-per_key .top tbody td:nth-child(2)") == "gold"
    backend = page.locator('#server-pools tr[data-upstream="backend"]')
    assert await backend.locator(".state").inner_text() == "ok"
    assert await backend.locator(".server").inner_text() == f"127.0.0.1:{upstream.port} up"
    assert await page.inner_text("#live") != "live"  # never heard from the stream

    # Only the second (or two) the requests came in have a ratio, and it is drawn.
    ratios = await page.evaluate(
        "window.gatewayDashboard.limits.login.ratio.data[1].filter((r) => r !== null)"
    )
    assert 1 <= len(ratios) <= 2 and max(ratios) > 0
    assert await page.evaluate(_ratio_pixels_script("login")) > 10
    await page.click('.range button[data-range="60"]')
    assert await page.get_attribute('.range button[data-range="60"]', "aria-pressed") == "true"
    assert await page.evaluate(_ratio_pixels_script("login")) > 10
    await page.screenshot(path=artifacts_dir(tmp_path) / "dashboard-six-limits.png")

    # One second with a ratio between seconds without traffic: a point with no neighbour,
    # which a line alone never draws.
    await page.evaluate(
        """() => {
            const dash = window.gatewayDashboard;
            const last = dash.history[dash.history.length - 1];
            const history = [];
            for (let i = 59; i >= 0; i--) {
                const limits = i === 30 ? {login: {...last.limits.login, ratio: 0.5}} : {};
                history.push({...last, t: last.t - i, limits});
            }
            dash.receive({history, state: dash.state});
        }"""
    )
    assert await page.evaluate(
        "window.gatewayDashboard.limits.login.ratio.data[1].filter((r) => r !== null)"
    ) == [0.5]
    assert await page.evaluate(_ratio_pixels_script("login")) > 10
    assert not errors
    await page.close()


async def test_dashboard_shows_which_upstream_servers_are_up(
    make_upstream: Callable[[], Awaitable[RecordingUpstream]],
    start_gateway: GatewayFactory,
    browser: Browser,
) -> None:
    alive = await make_upstream()
    dead = await make_upstream()
    dead_port = dead.port
    await dead.runner.cleanup()
    policy = (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        f"upstreams:\n  pool:\n    servers: [{alive.url}, http://127.0.0.1:{dead_port}]\n"
        "    max_fails: 1\n    fail_timeout: 1m\n"
        "routes:\n  - name: all\n    upstream: pool\n"
    )
    gw = await start_gateway(parse_and_build(policy))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        statuses = [await get_status(session, gw.url + "/") for _ in range(4)]
        assert statuses == [200] * 4  # the refused attempt went on to the other server
        samples, _ = await scrape(session, gw.admin_url)
    down = f"127.0.0.1:{dead_port}"
    up = f"127.0.0.1:{alive.port}"
    state = "gateway_upstream_server_state"
    assert value(samples, state, upstream="pool", server=down, state="down") == 1
    assert value(samples, state, upstream="pool", server=up, state="up") == 1
    page = await browser.new_page(locale="en-US")
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(gw.admin_url + "/dashboard/")
    chips = page.locator('#server-pools .pool[data-upstream="pool"] .server')
    await until_shown(lambda: chips.count(), "the pool's servers")
    # The latest failure's time, 24-hour as every time on the page (en-US's own is 12-hour).
    latest = await page.inner_text('#server-pools .pool[data-upstream="pool"] .detail')
    assert re.match(rf"\d\d:\d\d:\d\d {re.escape(down)} ", latest), latest

    async def shown() -> dict[str, str]:
        return {
            (await chip.inner_text()).split(" ")[0]: str(await chip.get_attribute("data-state"))
            for chip in await chips.all()
        }

    assert await shown() == {up: "up", down: "down"}
    assert not errors
    await page.close()


async def test_dashboard_shows_an_upstreams_adaptive_limit_beside_its_latency(
    make_upstream: Callable[[], Awaitable[RecordingUpstream]],
    start_gateway: GatewayFactory,
    browser: Browser,
) -> None:
    """The adaptive panel: the limit, in flight and latency as /metrics has them, and the
    limit and latency drawn over time."""
    upstream = await make_upstream()
    policy = (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        f"upstreams:\n  api:\n    url: {upstream.url}\n"
        "    adaptive: {min_limit: 4, probe_requests: 5}\n"
        "routes:\n  - name: all\n    upstream: api\n"
    )
    gw = await start_gateway(parse_and_build(policy))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(12):
            assert await get_status(session, gw.url + "/") == 200
        samples = await scrape_until(
            session,
            gw.admin_url,
            lambda s: (
                s.get(("gateway_adaptive_min_latency_seconds", frozenset({("upstream", "api")})), 0)
                > 0
            ),
        )
    limit = value(samples, "gateway_adaptive_limit", upstream="api")
    assert limit >= 4
    page = await browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(gw.admin_url + "/dashboard/")
    card = page.locator('#adaptive-upstreams .adaptive-upstream[data-upstream="api"]')
    await until_shown(lambda: card.count(), "the adaptive upstream")
    assert await page.locator("#adaptive").is_visible()
    # As the page writes it (1,000 from the cold start: max_limit).
    assert await card.locator('[data-field="limit"]').inner_text() == f"{int(limit):,}"
    assert await card.locator('[data-field="in-flight"]').inner_text() == "0"
    assert "ms" in await card.locator('[data-field="latency"]').inner_text()

    async def drawn() -> bool:
        series = await page.evaluate(
            "() => { const v = Object.values(window.gatewayDashboard.adaptive)[0];"
            " return [v.limit.data[1].filter((x) => x != null).length,"
            " v.latency.data[2].filter((x) => x != null).length]; }"
        )
        return bool(series[0] >= 2 and series[1] >= 1)

    await until_shown(drawn, "the limit and the minimum latency over time")
    assert not errors
    await page.close()


async def test_dashboard_shows_the_tokens_a_limit_with_cost_from_charged_by_model(
    llm_upstream: LlmUpstream,
    start_gateway: GatewayFactory,
    browser: Browser,
    tmp_path: Path,
) -> None:
    """Five calls through the official ``openai`` client (one streamed), each holding 100
    tokens and using 30, naming models a, a, b, c and none, with ``metrics_max_models: 2``:
    the token limit's card shows 150 charged, 500 held, 350 returned, as ``/metrics`` has
    them, and its models (c past the bound, under "other"); a limit without ``cost_from``
    shows no tokens. A call in flight shows its 100 tokens held now, until it settles."""
    policy = (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        "  metrics_max_models: 2\n"
        f"upstreams:\n  llm:\n    url: {llm_upstream.url}\n"
        "routes:\n  - name: llm\n    match: {path_prefix: /v1/}\n    upstream: llm\n"
        "limits:\n"
        "  tokens:\n    algorithm: fixed_window\n    limit: 100000\n    window: 1h\n"
        "    key: ['header:Authorization']\n    cost_from: openai\n    reserve: 100\n"
        "  calls:\n    algorithm: fixed_window\n    limit: 1000\n    window: 1h\n"
    )
    gw = await start_gateway(parse_and_build(policy))
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0)
    messages: Any = [{"role": "user", "content": " ".join(["hello"] * 10)}]
    try:
        for model in ("model-a", "model-a", "model-b", "model-c", ""):
            if model != "model-b":
                await client.chat.completions.create(model=model, messages=messages, max_tokens=20)
                continue
            stream = await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=20,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for _ in stream:
                pass
    finally:
        await client.close()

    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(gw.admin_url + "/dashboard/")

    async def charged_shown() -> bool:
        return await dashboard_field(page, "tokens", "units-charged") == "150"

    await until_shown(charged_shown, "the tokens charged to reach 150")
    assert await dashboard_field(page, "tokens", "units-held") == "500"
    assert await dashboard_field(page, "tokens", "units-returned") == "350"
    assert await dashboard_field(page, "tokens", "units-in-flight") == "0"
    # Most charged first; "" (none named) and "other" (past the bound) as the page names them.
    assert await page.inner_text("#limit-tokens .units .models tbody") == (
        "model-a\t60\t200\t140\n(none named)\t30\t100\t70\nmodel-b\t30\t100\t70\nother\t30\t100\t70"
    )
    assert not await page.is_visible("#limit-calls .units")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        samples, _ = await scrape(session, gw.admin_url)
    for kind, shown in (("charged", 150), ("held", 500), ("returned", 350)):
        series = {
            dict(labels)["model"]: count
            for (name, labels), count in samples.items()
            if name == f"gateway_limit_{kind}_units_total" and ("limit", "tokens") in labels
        }
        assert set(series) == {"", "model-a", "model-b", "other"}
        assert sum(series.values()) == shown

    # The charged rate, each point's over its interval, adds up to the 150 tokens (each point's
    # rate and interval rounded to 3 decimals: 150/s off by 0.0005 s is 0.075 tokens).
    async def rate_shown() -> bool:
        return await dashboard_field(page, "tokens", "units-rate") != "—"

    await until_shown(rate_shown, "the tokens charged per second")
    integral = await page.evaluate(
        """() => window.gatewayDashboard.history.reduce(
            (sum, point) => sum + ((point.limits.tokens || {}).charged_units || 0) * point.dt, 0)"""
    )
    assert integral == pytest.approx(150, abs=0.2)

    # A call the upstream holds: its 100 tokens are held now, until its answer settles them.
    llm_upstream.hold = asyncio.Event()
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0)
    try:
        call = asyncio.create_task(
            client.chat.completions.create(model="model-a", messages=messages, max_tokens=20)
        )

        async def held_shown() -> bool:
            return await dashboard_field(page, "tokens", "units-in-flight") == "100"

        await until_shown(held_shown, "the tokens held by the call in flight")
        llm_upstream.hold.set()
        await call
    finally:
        await client.close()

    async def settled_shown() -> bool:
        return await dashboard_field(page, "tokens", "units-in-flight") == "0"

    await until_shown(settled_shown, "the call settled")
    assert await dashboard_field(page, "tokens", "units-charged") == "180"
    await page.locator("#limit-tokens").screenshot(
        path=artifacts_dir(tmp_path) / "dashboard-tokens.png"
    )
    assert not errors
    await page.close()
