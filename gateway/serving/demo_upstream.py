"""A small backend the gateway can start itself, so a fresh install has something to proxy to."""

from __future__ import annotations

import asyncio
import socket
import time

from aiohttp import web


async def _index(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "service": "gateway demo upstream",
            "path": request.path_qs,
            "method": request.method,
            "x_forwarded_for": request.headers.get("X-Forwarded-For"),
            "time": time.time(),
        }
    )


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response(
        {
            "method": request.method,
            "path": request.path_qs,
            "headers": dict(request.headers),
            "body_bytes": len(body),
        }
    )


async def _slow(request: web.Request) -> web.Response:
    delay_ms = min(int(request.query.get("ms", "500")), 30_000)
    await asyncio.sleep(delay_ms / 1000)
    return web.json_response({"slept_ms": delay_ms})


def make_demo_app() -> web.Application:
    app = web.Application()
    app.router.add_route("*", "/echo{tail:.*}", _echo)
    app.router.add_get("/slow", _slow)
    app.router.add_route("*", "/{tail:.*}", _index)
    return app


class DemoUpstream:
    """The demo backend on a free loopback port: bound at construction, so a runtime can be built
    with its address before anything starts, and served from ``start``."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.address: tuple[str, int] = ("127.0.0.1", self._sock.getsockname()[1])
        self._runner = web.AppRunner(make_demo_app(), access_log=None)

    async def start(self) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    async def close(self) -> None:
        if self._runner.server is not None:
            await self._runner.cleanup()
        self._sock.close()

    def discard(self) -> None:
        """Release the port of a demo upstream that was never started."""
        self._sock.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m gateway.serving.demo_upstream --listen 0.0.0.0:8000``: the demo backend alone,
    for deploy/compose/docker-compose.yml (it answers JSON about the request, serves no files)."""
    import argparse

    from gateway.policy.models import split_host_port

    parser = argparse.ArgumentParser(prog="python -m gateway.serving.demo_upstream")
    parser.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT")
    host, port = split_host_port(parser.parse_args(argv).listen)
    web.run_app(make_demo_app(), host=host, port=port, access_log=None, print=None)


if __name__ == "__main__":
    main()
