"""Regenerate docs/dashboard.png: a real gateway (in process, real clock) under a minute of mixed
traffic, photographed in headless Chromium.

    python3 docs/dashboard_screenshot.py [--seconds 60] [--out docs/dashboard.png]

Needs what the dashboard tests need: Playwright's Python package and Debian's chromium (the path
is ``$CHROMIUM``, default /usr/bin/chromium). Everything listens on loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.engine.preflight import parse_and_build
from gateway.serving.lifecycle import Gateway

DOCS = Path(__file__).resolve().parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

# Clients are told apart by X-Forwarded-For (the traffic all comes from 127.0.0.1).
POLICY = """\
server:
  listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  trusted_proxies: [127.0.0.1/32]
upstreams:
  backend:
    url: {upstream}
routes:
  - name: login
    match: {{path: /api/login, methods: [POST]}}
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
    while loop.time() < end:
        method, path = ("POST", "/api/login") if rng.random() < 0.1 else ("GET", "/items")
        try:
            async with session.request(method, url + path, headers={"X-Forwarded-For": ip}) as resp:
                await resp.read()
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(rng.expovariate(rate))


async def _attacker(session: aiohttp.ClientSession, url: str, ip: str, end: float) -> None:
    """Bursts of 30 requests now and then: over per_ip's burst, so some are rejected."""
    loop = asyncio.get_running_loop()
    rng = random.Random(ip)
    while (pause := rng.uniform(5, 15)) < end - loop.time():
        await asyncio.sleep(pause)
        burst = [
            session.post(url + "/api/login", headers={"X-Forwarded-For": ip}) for _ in range(30)
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
    gateway = Gateway(parse_and_build(POLICY.format(upstream=f"http://127.0.0.1:{port}"), "demo"))
    await gateway.start()
    url = f"http://127.0.0.1:{gateway.proxy_port}"
    admin = f"http://127.0.0.1:{gateway.admin_port}"
    try:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM)
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.goto(admin + "/dashboard/")
            end = asyncio.get_running_loop().time() + seconds
            connector = aiohttp.TCPConnector(limit=200)
            async with aiohttp.ClientSession(connector=connector) as session:
                await asyncio.gather(
                    *(_client(session, url, ip, 1.6, end) for ip in CLIENTS),
                    *(_attacker(session, url, ip, end) for ip in ATTACKERS),
                )
            await asyncio.sleep(1.5)  # the last second's point reaches the page
            await page.screenshot(path=out, full_page=True)
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
