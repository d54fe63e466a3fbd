"""Admin routes: ``/metrics`` for Prometheus, ``/status`` (upstream failures, store, policy),
``/dashboard`` (a static page and its vendored chart
library) and its live feed ``/dashboard/events`` (server-sent events: the last 15 minutes at
once, then a point a second)."""

from __future__ import annotations

import json
from pathlib import Path

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from gateway.clock import rfc3339
from gateway.observability.observer import Observability, dashboard_state, upstreams_state

STATIC_DIR = Path(__file__).resolve().parent.parent / "static" / "dashboard"

OBSERVABILITY = web.AppKey("observability", Observability)


def _observability(request: web.Request) -> Observability:
    return request.app[OBSERVABILITY]


async def _metrics(request: web.Request) -> web.Response:
    obs = _observability(request)
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    body = encoder(obs.registry)
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


async def _dashboard_redirect(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/dashboard/")


# Where the page carries its first data, so it is drawn at load (a `chromium --screenshot` of
# it shows the figures), before the event stream's first message.
INITIAL_DATA = '<script id="initial-data" type="application/json">null</script>'


async def _dashboard_page(request: web.Request) -> web.Response:
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    data = json.dumps(_observability(request).initial_data(), separators=(",", ":"))
    # Inside <script>, "</" could end the element: JSON allows "<\/" for it.
    embedded = INITIAL_DATA.replace("null", data.replace("</", "<\\/"))
    return web.Response(
        text=page.replace(INITIAL_DATA, embedded),
        content_type="text/html",
        headers={"Cache-Control": "no-cache"},
    )


async def _state(request: web.Request) -> web.Response:
    """The whole gateway now, the history the page would draw, and which worker answered: for
    scripts and tests."""
    obs = _observability(request)
    snapshot = obs.gateway_snapshot()
    return web.json_response(
        {
            "state": dashboard_state(snapshot),
            "history": list(obs.timeline.points),
            "worker": obs.worker_id,
        }
    )


async def _status(request: web.Request) -> web.Response:
    """The whole gateway's health beyond readiness: each upstream's recent failures (over all
    workers), the store's state, the policy in force and its last reload."""
    obs = _observability(request)
    snapshot = obs.gateway_snapshot()
    reload = snapshot.reload
    return web.json_response(
        {
            "at": snapshot.at,
            "at_rfc3339": rfc3339(snapshot.at),
            "workers": snapshot.workers,
            "policy": {"sha256": list(snapshot.policy_sha256), "source": snapshot.policy_source},
            "reload": reload.shown() if reload is not None else None,
            "store": {"name": snapshot.store_name, "state": snapshot.store.state},
            "upstreams": upstreams_state(snapshot),
        }
    )


async def _events(request: web.Request) -> web.StreamResponse:
    obs = _observability(request)
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # a proxy in front must not hold the stream back
        }
    )
    await response.prepare(request)
    queue = obs.subscribe()
    try:
        await response.write(obs.initial_message())
        while (message := await queue.get()) is not None:
            await response.write(message)
    except ConnectionResetError:
        pass  # the page was closed
    finally:
        obs.unsubscribe(queue)
    return response


def install(app: web.Application, obs: Observability) -> None:
    """Add ``/metrics`` and ``/dashboard`` to the admin app; the observer's tick runs with it."""
    app[OBSERVABILITY] = obs
    obs.run_with(app)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/status", _status)
    app.router.add_get("/dashboard", _dashboard_redirect)
    app.router.add_get("/dashboard/", _dashboard_page)
    app.router.add_get("/dashboard/state", _state)
    app.router.add_get("/dashboard/events", _events)
    app.router.add_static("/dashboard/static/", STATIC_DIR, follow_symlinks=False)
