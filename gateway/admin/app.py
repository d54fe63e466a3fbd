"""The admin listener: health, readiness and the active policy. Never rate-limited."""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from gateway.admin.auth import AdminAuth, auth_middleware, login_routes
from gateway.admin.keys_api import keys_routes
from gateway.clock import rfc3339
from gateway.edge.responses import SERVER
from gateway.engine.limit_engine import Explanation, LimitEngine, LimitLook
from gateway.limits.keys import RequestFacts
from gateway.limits.routing import normalise_host
from gateway.policy.models import OVERRIDE_PARAMS, Policy
from gateway.policy.overrides import UNLISTED_KEY
from gateway.redact import REDACTED, redact_url
from gateway.stores import SharedStore, store_url

if TYPE_CHECKING:
    from gateway.edge.proxy import ProxyHandler
    from gateway.policy.reload_status import ReloadStatus


class Reloads(Protocol):
    """What ``POST /reload`` and ``/policy`` need of the worker's reloader."""

    status: ReloadStatus

    async def reload(self) -> str: ...


@dataclass(slots=True)
class AdminState:
    """What the admin endpoints report on; the serve loop flips ``ready``."""

    handler: ProxyHandler
    ready: bool = False
    worker_id: int = 0
    reloader: Reloads | None = None
    # server settings as the worker runs them (command-line overrides and bound ports
    # included): a reload cannot move them, so the file's values may not be the ones in force.
    in_force: dict[str, Any] = field(default_factory=dict)
    auth: AdminAuth = field(default_factory=AdminAuth)
    # A worker of several: asks the others to reload as well (after ``POST /reload``).
    reload_siblings: Callable[[], None] | None = None


ADMIN_STATE = web.AppKey("admin_state", AdminState)


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[ADMIN_STATE]
    if state.ready:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "not ready"}, status=503)


async def _policy(request: web.Request) -> web.Response:
    state = request.app[ADMIN_STATE]
    runtime = state.handler.runtime
    reload_status = state.reloader.status if state.reloader is not None else None
    policy = redacted_policy(runtime.loaded.policy)
    policy["server"].update(state.in_force)
    return web.json_response(
        {
            "source": runtime.loaded.source,
            "sha256": runtime.loaded.sha256,
            "loaded_at": runtime.loaded_at,
            "loaded_at_rfc3339": rfc3339(runtime.loaded_at),
            "worker": state.worker_id,
            "store": runtime.engine.store.name,
            "store_url": redact_url(store_url(runtime.loaded.policy.store)),
            "reload": reload_status.shown() if reload_status is not None else None,
            "in_force": state.in_force,
            "pools": {
                name: [dataclasses.asdict(member) for member in target.pool.states()]
                for name, target in runtime.upstreams.items()
            },
            "policy": policy,
        }
    )


def redacted_policy(policy: Policy) -> dict[str, Any]:
    """The policy as JSON with its secrets out: the store URL's password, the admin token,
    the header values that exempt a request from a limit."""
    data = policy.model_dump(mode="json")
    for name, limit in policy.limits.items():
        if limit.exempt_headers:
            data["limits"][name]["exempt_headers"] = {
                header: [REDACTED] * len(values) for header, values in limit.exempt_headers.items()
            }
    data["store"]["url"] = redact_url(policy.store.url)
    if policy.server.admin_token is not None:
        data["server"]["admin_token"] = REDACTED
    return data


async def _reload(request: web.Request) -> web.Response:
    reloader = request.app[ADMIN_STATE].reloader
    if reloader is None:
        return web.json_response({"error": "the gateway runs without a policy file"}, status=409)
    result = await reloader.reload()
    siblings = request.app[ADMIN_STATE].reload_siblings
    if result == "ok" and siblings is not None:
        siblings()
    body = {"result": result, "error": reloader.status.last_error}
    return web.json_response(body, status=200 if result != "failed" else 422)


async def _explain(request: web.Request) -> web.Response:
    """Which limits a request would meet and what each would say, consuming nothing.

    Query: ``method``, ``path`` (may carry a query string), ``host``, ``client_ip`` and any
    number of ``header=Name: value``.
    """
    runtime = request.app[ADMIN_STATE].handler.runtime
    query = request.query
    method = query.get("method", "GET").upper()
    target = query.get("path", "/")
    client_ip = query.get("client_ip", "127.0.0.1")
    host = normalise_host(query.get("host", ""))
    headers: CIMultiDict[str] = CIMultiDict()
    for item in query.getall("header", []):
        name, colon, value = item.partition(":")
        if not colon or not name.strip():
            return _bad_question(f"header={item!r}: write header=Name:value (X-API-Key:abc)")
        headers.add(name.strip(), value.strip())
    try:
        ipaddress.ip_address(client_ip)
    except ValueError:
        # A client the gateway could never see: its answer would be about a key of nobody.
        return _bad_question(
            f"client_ip={client_ip!r}: not an IP address (203.0.113.9, 2001:db8::1)"
        )
    url = URL(target if target.startswith("/") else "/" + target)
    path = url.path
    route = runtime.routes.match(host, path, method)
    engine = runtime.engine
    result: dict[str, Any] = {
        "request": {"method": method, "path": target, "host": host, "client_ip": client_ip},
        "route": route.name if route is not None else None,
        "policy_sha256": runtime.loaded.sha256,
    }
    if route is None:
        result["limits"] = []
        result["verdict"] = {"status": 404, "reason": "no route matches"}
        return web.json_response(result)
    facts = RequestFacts.of(
        client_ip,
        engine.ipv6_prefix,
        route.name,
        method,
        CIMultiDictProxy(headers),
        lambda: url.query,
    )
    explanation = await engine.explain(facts, route, host, path, client_ip)
    if explanation.access is not None:
        result["access"] = explanation.access
    result["limits"] = [_limit_entry(look, engine) for look in explanation.limits]
    result["verdict"] = _verdict(explanation)
    return web.json_response(result)


def _bad_question(reason: str) -> web.Response:
    """A question /explain cannot answer: 400, saying what to ask instead."""
    return web.json_response({"error": reason}, status=400)


def _limit_entry(look: LimitLook, engine: LimitEngine) -> dict[str, Any]:
    limit = look.limit
    entry: dict[str, Any] = {
        "name": limit.name,
        "algorithm": limit.spec.algorithm,
        "dry_run": limit.spec.dry_run,
        "applies": look.applies,
        "waiting": limit.counters.waiting,
    }
    counted = limit.spec
    if counted.charged_after:
        # Admitted while the key has room; what the response says is charged after it.
        charged: dict[str, Any] = {
            "statuses": list(counted.count.statuses) if counted.count is not None else "all",
            "cost_header": counted.cost_header,
        }
        if counted.cost_from is not None:
            charged["cost_from"] = counted.cost_from
        reserve = counted.reserve
        if reserve is not None:  # held by each request in flight
            charged["reserve"] = reserve if isinstance(reserve, int) else reserve.model_dump()
        if counted.hold == "none":
            charged["hold"] = "none"  # admitted free: a burst in flight may all pass
        entry["charged_after_response"] = charged
    if not look.applies:
        return entry
    store = engine.store
    if isinstance(store, SharedStore):
        bound = store.lease_bound(limit)
        if bound is not None:  # decided from the workers' batches (store.worker_lease)
            entry["worker_lease"] = bound
    entry["key"] = look.key
    if look.key is not None and limit.tiering is None and limit.table != limit.name:
        # An override's variant: its own parameters, not the limit's, and the plan that
        # gives them (None for a key with numbers of its own).
        spec = limit.spec.model_dump(mode="json")
        entry["override"] = {
            name: spec[name]
            for name in OVERRIDE_PARAMS
            if name in spec and (name != "timezone" or spec["calendar"])
        }
        tier = limit.table.partition("~")[2]
        entry["plan"] = None if tier.startswith("=") else tier
    elif look.key == UNLISTED_KEY:
        entry["unlisted"] = "shared: every key the overrides do not list shares this bucket"
    if look.key is not None and not look.exempt:
        entry["cost"] = look.cost
    if look.blocked_s is not None:
        entry["penalty"] = {
            "blocked_for_s": round(look.blocked_s, 3),
            "reason": "rejected too often: refused at once until the block ends",
        }
    if look.refused is not None:
        refusal = {"allowed": False, "status": look.refused_status, "reason": look.refused}
        entry["next_request"] = refusal
    elif look.key is None:
        entry["skipped"] = "a key part is missing (on_missing_key: skip)"
    elif look.exempt:
        entry["exempt"] = "exempt from this limit (exempt / exempt_headers / exempt_listed)"
    elif look.unavailable is not None:
        entry["next_request"] = {"allowed": False, "status": 503, "reason": look.unavailable}
    elif look.decision is not None:
        decision = look.decision
        entry["next_request"] = {
            "allowed": decision.allowed,
            "delay_s": decision.delay_s,
            "retry_after_s": decision.retry_after_s,
            "limit": decision.limit,
            "remaining": decision.remaining,
            "reset_s": decision.reset_s,
        }
        if limit.holds_slots:
            # A concurrency limit's key: the slots its requests hold now (on every worker and
            # replica the store counts), of how many.
            # (An admission's remaining is after the next request's cost is taken.)
            free = decision.remaining + (look.cost if decision.allowed else 0)
            entry["slots"] = {"held": decision.limit - free, "free": free, "limit": decision.limit}
        entry["tracked_keys"] = engine.store.tracked_keys(limit.name)
    return entry


def _verdict(explanation: Explanation) -> dict[str, Any]:
    """The engine's outcome for the next request, in words."""
    outcome = explanation.outcome
    verdict = outcome.verdict
    if verdict is None:
        if outcome.status:  # denied by the access list, or the store is down (on_failure: deny)
            return {"status": outcome.status, "reason": outcome.reason}
        reason = "client address is allowed" if explanation.access else "no enforced limit applies"
        return {"status": 200, "delay_s": 0.0, "reason": reason}
    checks = outcome.checks
    if outcome.waits_on is not None:
        limit = outcome.waits_on.limit
        return {
            "status": None,
            "waits_for_slot": limit.name,
            "max_delay_s": limit.spec.max_delay,
            "reason": "over a concurrency limit: waits in line for a slot, first come first "
            "served, then is decided again",
        }
    if not verdict.allowed:
        # Admitted by the algorithm but refused by its queue's bounds, or over the limit.
        queued = verdict.decisions[verdict.rejected_by[0]].allowed
        return {
            "status": outcome.status,
            "rejected_by": [checks[i].limit.name for i in verdict.rejected_by],
            "retry_after_s": outcome.retry_after_s,
            "reason": "queue full or wait over max_delay" if queued else "over the limit",
        }
    delayed_by = verdict.delayed_by
    return {
        "status": 200,
        "delay_s": verdict.delay_s,
        "delayed_by": checks[delayed_by].limit.name if delayed_by is not None else None,
    }


async def _root(request: web.Request) -> web.StreamResponse:
    """A browser opening the admin address lands on the dashboard."""
    raise web.HTTPFound("/dashboard/")


async def _name_server(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp would send ``Server: Python/x aiohttp/y``: versions are nobody's business."""
    response.headers["Server"] = SERVER


def make_admin_app(state: AdminState) -> web.Application:
    """The admin routes behind the token check (``state.auth``, swapped on reload); the
    dashboard's routes are added to the same app, so the same check covers them."""

    def current() -> AdminAuth:
        return state.auth

    app = web.Application(middlewares=[auth_middleware(current)])
    app[ADMIN_STATE] = state
    app.on_response_prepare.append(_name_server)
    app.router.add_routes(login_routes(current))
    app.router.add_get("/", _root)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/policy", _policy)
    app.router.add_post("/reload", _reload)
    app.router.add_get("/explain", _explain)
    app.router.add_routes(keys_routes(lambda: state.handler.runtime.engine, current))
    return app
