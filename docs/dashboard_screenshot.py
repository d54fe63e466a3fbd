"""Regenerate docs/dashboard.png: a real gateway (in process, real clock, six limits, one upstream
down) under a minute of mixed traffic, photographed in headless Chromium at 1400x1000.

    python3 docs/dashboard_screenshot.py [--seconds 60] [--out docs/dashboard.png]

Needs what the dashboard tests need: Playwright's Python package and Debian's chromium (the path
is ``$CHROMIUM``, default /usr/bin/chromium). Everything listens on loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.engine.preflight import parse_and_build
from gateway.serving.lifecycle import Gateway

DOCS = Path(__file__).resolve().parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

# Clients are told apart by X-Forwarded-For (the traffic all comes from 127.0.0.1). Six limits;
# a second upstream, "billing", is down (nothing listens on its port), so its failures show.
POLICY = """\
server:
  listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  trusted_proxies: [127.0.0.1/32]
  limit_log_level: off
upstreams:
  backend:
    url: {upstream}
  billing:
    url: http://127.0.0.1:{closed}
    connect_timeout: 200ms
routes:
  - name: login
    match: {{path: /api/login, methods: [POST]}}
    upstream: backend
  - name: billing
    match: {{path_prefix: /billing}}
    upstream: billing
  - name: search
    match: {{path_prefix: /search}}
    upstream: backend
  - name: default
    upstream: backend
limits:
  per_ip:
    algorithm: leaky_bucket
    rate: 5r/s
    burst: 10
    nodelay: true
  global:
    algorithm: leaky_bucket
    rate: 40r/s
    burst: 20
    key: [global]
  per_key:
    algorithm: token_bucket
    rate: 1800r/m
    burst: 60
    key: ['header:X-API-Key']
    on_missing_key: client_ip
    plans:
      gold: {{rate: 600r/m, burst: 20}}
    overrides:
      key-gold-1: gold
      key-gold-2: gold
    unlisted: shared
  search:
    algorithm: sliding_log
    limit: 20
    window: 10s
    key: [client_ip]
    match: {{routes: [search]}}
  api_window:
    algorithm: fixed_window
    limit: 3000
    window: 1m
    key: [global]
  login_attempts:
    algorithm: sliding_window
    limit: 5
    window: 1m
    match: {{routes: [login]}}
    dry_run: true
"""

CLIENTS = [f"10.0.{i // 200}.{i % 200 + 1}" for i in range(25)]
ATTACKERS = ["192.0.2.99", "198.51.100.23", "198.51.100.7"]


async def _client(
    session: aiohttp.ClientSession, url: str, ip: str, rate: float, end: float
) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(ip)
    key = {"10.0.0.1": "key-gold-1", "10.0.0.2": "key-gold-2"}.get(ip, f"anon-{rng.randrange(9)}")
    while loop.time() < end:
        roll = rng.random()
        if roll < 0.1:
            method, path = "POST", "/api/login"
        elif roll < 0.13:
            method, path = "GET", "/billing/invoices"
        elif roll < 0.3:
            method, path = "GET", "/search?q=x"
        else:
            method, path = "GET", "/items"
        headers = {"X-Forwarded-For": ip, "X-API-Key": key}
        try:
            async with session.request(method, url + path, headers=headers) as resp:
                await resp.read()
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(rng.expovariate(rate))


async def _attacker(session: aiohttp.ClientSession, url: str, ip: str, end: float) -> None:
    """Bursts of 30 requests now and then, each with a key it made up: over per_ip's burst,
    so some are rejected, and the made-up keys share one bucket (unlisted: shared)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(ip)
    while (pause := rng.uniform(5, 15)) < end - loop.time():
        await asyncio.sleep(pause)
        burst = [
            session.post(
                url + "/api/login",
                headers={"X-Forwarded-For": ip, "X-API-Key": f"made-up-{rng.randrange(10**9)}"},
            )
            for _ in range(30)
        ]
        for response in await asyncio.gather(*burst, return_exceptions=True):
            if isinstance(response, aiohttp.ClientResponse):
                response.release()


async def main(seconds: float, out: Path) -> None:
    from playwright.async_api import async_playwright

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    upstream = web.Application()
    upstream.router.add_route("*", "/{tail:.*}", ok)
    runner = web.AppRunner(upstream)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    with socket.socket() as closed:  # a port nothing listens on: the billing upstream
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
    policy = POLICY.format(upstream=f"http://127.0.0.1:{port}", closed=closed_port)
    gateway = Gateway(parse_and_build(policy, "demo"))
    await gateway.start()
    url = f"http://127.0.0.1:{gateway.proxy_port}"
    admin = f"http://127.0.0.1:{gateway.admin_port}"
    try:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM)
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            await page.goto(admin + "/dashboard/")
            loop = asyncio.get_running_loop()
            end = loop.time() + seconds + 3  # traffic goes on while the picture is taken
            connector = aiohttp.TCPConnector(limit=200)
            async with aiohttp.ClientSession(connector=connector) as session:
                traffic = asyncio.gather(
                    *(_client(session, url, ip, 1.6, end) for ip in CLIENTS),
                    *(_attacker(session, url, ip, end) for ip in ATTACKERS),
                )
                await asyncio.sleep(seconds)
                await page.click('.range button[data-range="60"]')  # the minute of traffic
                await page.screenshot(path=out)  # the first screen: what 1400x1000 shows
                await traffic
            await browser.close()
    finally:
        await gateway.stop()
        await runner.cleanup()
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="traffic before the picture")
    parser.add_argument("--out", type=Path, default=DOCS / "dashboard.png")
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.out))
