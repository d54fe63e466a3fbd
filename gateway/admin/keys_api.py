"""The keys' API on the admin listener (behind its token, as every admin route): one limit's
keys listed (the most used first), one key's state read, reset, blocked and unblocked. Each
change is logged with who made it (the admin token's id: a hash, never the token) and why
(the ``reason`` the call must give).

    GET  /keys/LIMIT?top=N
    GET  /keys/LIMIT/key?key=VALUE (or id=sha256:...; key repeated for a key of several parts)
    POST /keys/LIMIT/reset    {"key": ... or "id": ..., "reason": "..."}
    POST /keys/LIMIT/block    {"key": ... or "id": ..., "for": "15m", "reason": "..."}
    POST /keys/LIMIT/unblock  {"key": ... or "id": ..., "reason": "..."}
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from gateway.admin.auth import AdminAuth
from gateway.engine.key_admin import (
    KeyAdminError,
    block_key,
    key_from,
    key_state,
    limit_named,
    reset_key,
    resolve_key,
    top_keys,
    unblock_key,
)
from gateway.engine.limit_engine import LimitEngine
from gateway.policy.units import parse_duration
from gateway.redact import hashed

log = logging.getLogger("gateway.admin")

MAX_TOP: Final = 1000
MAX_REASON: Final = 500

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def keys_routes(
    engine_of: Callable[[], LimitEngine], auth_of: Callable[[], AdminAuth]
) -> list[web.RouteDef]:
    """The routes, reading the running engine and token at each call (a reload swaps both)."""

    def answers(handler: Callable[[web.Request, LimitEngine], Awaitable[Any]]) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                return web.json_response(await handler(request, engine_of()))
            except KeyAdminError as refused:
                return web.json_response({"error": refused.reason}, status=refused.status)

        return handle

    async def listing(request: web.Request, engine: LimitEngine) -> Any:
        limit = limit_named(engine, request.match_info["limit"])
        try:
            top = int(request.query.get("top", "20"))
        except ValueError:
            raise KeyAdminError(400, "top: a whole number") from None
        top = max(1, min(top, MAX_TOP))
        return {
            "limit": limit.name,
            "store": engine.store.name,
            "keys": await top_keys(engine, limit, top),
        }

    async def one(request: web.Request, engine: LimitEngine) -> Any:
        limit = limit_named(engine, request.match_info["limit"])
        parts = request.query.getall("key", [])
        key = await resolve_key(
            engine, limit, key_from(parts) if parts else None, request.query.get("id")
        )
        return await key_state(engine, limit, key)

    async def change(request: web.Request, engine: LimitEngine) -> Any:
        limit = limit_named(engine, request.match_info["limit"])
        action = request.match_info["action"]
        body = await _body(request)
        reason = body.get("reason")
        if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON:
            raise KeyAdminError(400, f"reason: say why, in at most {MAX_REASON} characters")
        key = await resolve_key(engine, limit, _key_of(body), _text(body, "id"))
        result: dict[str, Any] = {"limit": limit.name, "id": hashed(key), "action": action}
        if action == "reset":
            result["reset"] = await reset_key(engine, limit, key)
        elif action == "block":
            given = body.get("for")
            try:
                seconds = parse_duration(given) if isinstance(given, str | int | float) else -1.0
            except ValueError:
                seconds = -1.0
            result["blocked_for_s"] = await block_key(engine, limit, key, seconds)
        else:
            result["unblocked"] = await unblock_key(engine, limit, key)
        log.info(
            "keys: %s of limit %s key %s by token %s, reason: %r",
            action,
            limit.name,
            hashed(key),
            _token_id(auth_of()),
            reason.strip(),
        )
        result["state"] = await key_state(engine, limit, key)
        return result

    return [
        web.get("/keys/{limit}", answers(listing)),
        web.get("/keys/{limit}/key", answers(one)),
        web.post("/keys/{limit}/{action:reset|block|unblock}", answers(change)),
    ]


def _token_id(auth: AdminAuth) -> str:
    """Who: the admin token's id (its hash), or that the admin listener has no token."""
    return hashed(auth.token) if auth.token is not None else "none (no admin token set)"


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise KeyAdminError(400, "the body: a JSON object") from None
    if not isinstance(body, dict):
        raise KeyAdminError(400, "the body: a JSON object")
    return body


def _text(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise KeyAdminError(400, f"{name}: a string")
    return value


def _key_of(body: dict[str, Any]) -> str | None:
    """``key``: the value (a string), or the values of a key of several parts (a list)."""
    value = body.get("key")
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return key_from(value)
    raise KeyAdminError(400, "key: a string, or a list of strings for a key of several parts")
