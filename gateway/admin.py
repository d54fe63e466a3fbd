"""The admin listener: health, readiness and the active policy. Never rate-limited."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.proxy import ProxyHandler


@dataclass(slots=True)
class AdminState:
    """What the admin endpoints report on; the serve loop flips ``ready``."""

    handler: ProxyHandler
    ready: bool = False
    worker_id: int = 0


ADMIN_STATE = web.AppKey("admin_state", AdminState)


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[ADMIN_STATE]
    if state.ready:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "not ready"}, status=503)


async def _policy(request: web.Request) -> web.Response:
    runtime = request.app[ADMIN_STATE].handler.runtime
    return web.json_response(
        {
            "source": runtime.loaded.source,
            "sha256": runtime.loaded.sha256,
            "loaded_at": runtime.loaded_at,
            "policy": runtime.loaded.policy.model_dump(mode="json"),
        }
    )


def make_admin_app(state: AdminState) -> web.Application:
    app = web.Application()
    app[ADMIN_STATE] = state
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/policy", _policy)
    return app
