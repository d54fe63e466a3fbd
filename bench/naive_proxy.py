"""The naive aiohttp reverse proxy: the baseline the gateway is measured against.

What a Python developer writes first: one ``web.Application`` with a catch-all
handler that forwards through one shared ``aiohttp.ClientSession`` and streams
the body back with ``StreamResponse``. Deliberately untuned: default connector,
default event loop (no uvloop), default access logger. It drops the hop-by-hop
headers so that it is a working proxy, not a strawman.

Run: ``python bench/naive_proxy.py --upstream http://127.0.0.1:8081 --port 8080``.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDictProxy

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM_KEY = web.AppKey("upstream", str)


def _end_to_end(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP]


async def proxy(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSION_KEY]
    url = request.app[UPSTREAM_KEY] + request.raw_path
    request_headers = [(k, v) for k, v in _end_to_end(request.headers) if k.lower() != "host"]
    body = request.content if request.body_exists else None
    async with session.request(
        request.method, url, headers=request_headers, data=body, allow_redirects=False
    ) as upstream:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in _end_to_end(upstream.headers):
            response.headers.add(name, value)
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


def make_app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM_KEY] = upstream.rstrip("/")

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        # auto_decompress off: a proxy passes bytes through unchanged.
        async with aiohttp.ClientSession(auto_decompress=False) as session:
            app[SESSION_KEY] = session
            yield

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:8081")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(make_app(args.upstream), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
