"""One limit's keys, as the keys' API (``/keys``, ``gateway keys``) reads and changes them:
which keys it holds (the most used first), one key's state in the policy's words (remaining,
reset, blocked until), reset, block and unblock.

A key is named as the limit builds it, or by its id (``sha256:`` and 12 hex digits of it, as
the list shows it): a key whose parts are API keys is never shown whole.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable
from typing import Any, Final, TypeVar

from gateway.algorithms.penalty_box import PenaltyBox, PenaltyRefusal
from gateway.engine.limit_engine import LimitEngine
from gateway.limits.compiled import Check, CompiledLimit, with_variants
from gateway.limits.keys import SEP, shown_key
from gateway.redact import hashed
from gateway.stores.key_listing import KeyAdmin, key_admin_of
from gateway.stores.penalty_table import PenaltyBoxes, PenaltyTable
from gateway.stores.redis.key_scan import RedisKeyError, RedisKeys
from gateway.stores.redis.store import RedisStore
from gateway.stores.shared.lmdb_store import SharedStore
from gateway.stores.shared.penalties import SharedPenaltyTable

T = TypeVar("T")

# The most keys one listing reads the state of (an admin call, bounded whatever the table).
SCAN_MAX: Final = 10_000


class KeyAdminError(Exception):
    """A question the keys' API cannot answer: ``status`` and a reason for the client."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def limit_named(engine: LimitEngine, name: str) -> CompiledLimit:
    for limit in engine.limits:
        if limit.name == name:
            return limit
    known = ", ".join(limit.name for limit in engine.limits) or "none"
    raise KeyAdminError(404, f"no limit {name!r} (limits: {known})")


def _store(engine: LimitEngine) -> KeyAdmin:
    admin = key_admin_of(engine.store)
    if admin is None:
        raise KeyAdminError(
            501,
            f"the {engine.store.name} store does not list or reset keys (the in-process, "
            "shared and Redis stores do)",
        )
    return admin


def key_from(parts: list[str]) -> str:
    """The key a limit builds from its parts' values (one part: the value itself)."""
    return SEP.join(parts)


async def _variant_of(engine: LimitEngine, limit: CompiledLimit, key: str) -> CompiledLimit:
    """The variant (tier) whose table holds ``key``, or the one its overrides give it."""
    store = key_admin_of(engine.store)
    if store is not None:
        for variant in with_variants([limit]):
            if await _asked(store.holds(variant, key)):
                return variant
    tiering = limit.tiering
    if tiering is not None and tiering.overrides is not None and tiering.plan_from is None:
        resolved = tiering.overrides.resolve(key)
        if resolved is not None:
            return resolved  # type: ignore[no-any-return]
    return limit


async def resolve_key(
    engine: LimitEngine, limit: CompiledLimit, key: str | None, key_id: str | None
) -> str:
    """The key named by its value or by its id (found among the keys the store holds)."""
    if key is not None:
        return key
    if key_id is None:
        raise KeyAdminError(400, "name the key: key (its value) or id (sha256:...)")
    store = _store(engine)
    for variant in with_variants([limit]):
        for held in await _asked(store.keys_held(variant, SCAN_MAX)):
            if hashed(held) == key_id:
                return held
    for held in await _blocked_keys(engine, limit):
        if hashed(held) == key_id:
            return held
    raise KeyAdminError(404, f"no key with id {key_id} in limit {limit.name!r}")


async def _blocked_keys(engine: LimitEngine, limit: CompiledLimit) -> list[str]:
    """The keys in ``limit``'s penalty boxes: blocked ones (in process, shared), or every
    box in Redis (strikes too: a listing reads each key's state, blocked or not)."""
    penalties = engine.penalties.get(limit.name)
    if penalties is not None:
        return [key for key, _ in penalties.blocked(engine.store.clock.now_us())]
    store = engine.store
    if isinstance(store, RedisStore):
        return await _asked(RedisKeys(store).boxed(limit, SCAN_MAX))
    return []


async def key_state(engine: LimitEngine, limit: CompiledLimit, key: str) -> dict[str, Any]:
    """``key``'s state under ``limit`` as the policy says it, looked at (nothing charged)."""
    variant = await _variant_of(engine, limit, key)
    verdict = await engine.store.decide((Check(variant, key),), commit=False)
    decision = verdict.decisions[0]
    plain = limit.spec.top_keys == "plain"
    state: dict[str, Any] = {
        "limit": limit.name,
        "id": hashed(key),
        "key": shown_key(limit.spec.key, key, plain),
        "quota": decision.limit,
        # The look took the next request's unit: what is left now is one more.
        "remaining": min(decision.limit, decision.remaining + 1) if decision.allowed else 0,
        "reset_s": round(decision.reset_s, 3) if math.isfinite(decision.reset_s) else None,
        "allowed_now": decision.allowed,
    }
    if not decision.allowed and math.isfinite(decision.retry_after_s):
        state["retry_after_s"] = round(decision.retry_after_s, 3)
    tier = variant.table.partition("~")[2]
    if tier:
        state["plan"] = None if tier.startswith("=") else tier
    blocked_s = engine.penalty_until(limit, key)
    refusal = verdict.states[0] if verdict.states else None
    if isinstance(refusal, PenaltyRefusal):  # the store's box (Redis), looked at in the call
        blocked_s = (refusal.until_us - (verdict.now_us or 0)) / 1_000_000
    state["blocked_for_s"] = round(blocked_s, 3) if blocked_s is not None else None
    return state


async def top_keys(engine: LimitEngine, limit: CompiledLimit, most: int) -> list[dict[str, Any]]:
    """The keys ``limit`` holds, the most used (least remaining) first, at most ``most``."""
    store = _store(engine)
    keys: list[str] = []
    for variant in with_variants([limit]):
        keys += await _asked(store.keys_held(variant, SCAN_MAX - len(keys)))
    held = set(keys)
    keys += [key for key in await _blocked_keys(engine, limit) if key not in held]
    states = [await key_state(engine, limit, key) for key in keys[:SCAN_MAX]]
    states.sort(key=lambda s: (s["blocked_for_s"] is None, s["remaining"] / max(1, s["quota"])))
    return states[:most]


async def reset_key(engine: LimitEngine, limit: CompiledLimit, key: str) -> bool:
    """Forget ``key``'s state in every table of ``limit`` (its penalty stays: ``unblock``)."""
    store = _store(engine)
    forgot = False
    for variant in with_variants([limit]):
        forgot |= await _asked(store.forget(variant, key))
    return forgot


async def _asked(call: Awaitable[T]) -> T:
    """A store's answer, or the API's 503 naming why it could not give one."""
    try:
        return await call
    except RedisKeyError as exc:
        raise KeyAdminError(503, f"the store could not answer: {exc}") from None


def _penalties(engine: LimitEngine, limit: CompiledLimit) -> PenaltyBoxes:
    kept = engine.penalties.get(limit.name)
    if kept is not None:
        return kept
    if not engine.penalties_supported:
        raise KeyAdminError(
            501,
            f"the {engine.store.name} store does not keep blocks yet (the in-process and "
            "shared stores do)",
        )
    # A block without a penalty on the limit: a box that only operators fill.
    box = PenaltyBox(1, 1.0, 1.0)
    store = engine.store
    table: PenaltyBoxes
    if isinstance(store, SharedStore) and store.path is not None:
        table = SharedPenaltyTable(box, limit.spec.max_keys, store.path, limit.name)
    else:
        table = PenaltyTable(box, limit.spec.max_keys)
    engine.penalties[limit.name] = table
    engine.enable_penalties(limit.name, limit.status)
    return table


def _redis_boxes(engine: LimitEngine, limit: CompiledLimit) -> RedisKeys | None:
    """The Redis store's penalty boxes of ``limit`` (None: the engine keeps them): the calls
    of its requests look them up. A leased limit decides most requests in the replica, with
    no call to look one up in."""
    store = engine.store
    if not isinstance(store, RedisStore):
        return None
    if limit.spec.lease is not None:
        raise KeyAdminError(
            501,
            f"limit {limit.name!r} is leased: its replicas decide most requests without "
            "asking Redis, so a block there would not hold (remove lease to block keys)",
        )
    return RedisKeys(store)


async def block_key(engine: LimitEngine, limit: CompiledLimit, key: str, seconds: float) -> float:
    """Refuse ``key``'s requests under ``limit`` for ``seconds``; the seconds it is blocked."""
    if not (0 < seconds <= 366 * 86_400):
        raise KeyAdminError(400, "for: a duration above 0 and at most a year")
    boxes = _redis_boxes(engine, limit)
    if boxes is not None:
        await _asked(boxes.block(limit, key, seconds))
        return seconds
    now_us = engine.store.clock.now_us()
    _penalties(engine, limit).block(key, now_us + round(seconds * 1_000_000))
    return seconds


async def unblock_key(engine: LimitEngine, limit: CompiledLimit, key: str) -> bool:
    boxes = _redis_boxes(engine, limit)
    if boxes is not None:
        return await _asked(boxes.unblock(limit, key))
    table = engine.penalties.get(limit.name)
    return table is not None and table.clear(key)
