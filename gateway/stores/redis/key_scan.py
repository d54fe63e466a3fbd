"""The keys' API in Redis: a limit's keys found with SCAN (every master of a cluster), one
key's state dropped with DEL in its own hash slot, a key blocked or unblocked in the limit's
penalty box (the limit noted among those with blocks: block_watch.py). On a connection of its
own, opened for the call: an operator's call never queues behind the request path's scripts."""

from __future__ import annotations

import re
from typing import Any, Final

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import RedisError

from gateway.limits.compiled import CompiledLimit
from gateway.redact import redact_text
from gateway.stores.redis.block_watch import NOTE_SCRIPT, marker_key
from gateway.stores.redis.store import RedisStore

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
# An operator's block, in the box's layout (decide.lua): no strikes, blocked until now + ARGV[2].
_BLOCK: Final = """
local now_us = tonumber(ARGV[1])
if not now_us then
  local t = redis.call('TIME')
  now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local block_us = tonumber(ARGV[2])
redis.call('SET', KEYS[1], string.format('%d %d %d', 0, 0, now_us + block_us),
  'PX', math.floor(block_us / 1000) + 1)
return 1
"""


class RedisKeyError(Exception):
    """Redis could not answer the keys' API (its reason, the URL's password left out)."""


class RedisKeys:
    """``stores.key_listing.KeyAdmin`` over a Redis store's key layout."""

    def __init__(self, store: RedisStore, timeout_s: float = 5.0) -> None:
        self.store = store
        self.timeout_s = timeout_s

    def _client(self) -> Redis | RedisCluster:
        return self.store.admin_client(self.timeout_s)

    async def keys_held(self, limit: CompiledLimit, most: int) -> list[str]:
        plan = self.store.plan(limit)
        return await self._scan(plan.key_head, plan.key_tail, most)

    async def boxed(self, limit: CompiledLimit, most: int) -> list[str]:
        """Up to ``most`` keys with a penalty box of ``limit`` (strikes, or a block)."""
        plan = self.store.plan(limit)
        return await self._scan(plan.key_head, plan.penalty_tail, most)

    async def _scan(self, head: str, tail: str, most: int) -> list[str]:
        pattern = _glob(head) + "*" + _glob(tail) + "*"
        found: list[str] = []
        client = self._client()
        try:
            async for raw in client.scan_iter(match=pattern, count=1000):
                name = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
                at = name.find(tail, len(head))
                if at >= 0:
                    found.append(name[at + len(tail) :])
                if len(found) >= most:
                    break
        except RedisError as exc:
            raise RedisKeyError(redact_text(str(exc))) from None
        finally:
            await client.aclose()
        return found

    async def holds(self, limit: CompiledLimit, key: str) -> bool:
        return bool(await self._call("exists", self.store.plan(limit).redis_key(key)))

    async def forget(self, limit: CompiledLimit, key: str) -> bool:
        return bool(await self._call("delete", self.store.plan(limit).redis_key(key)))

    async def block(self, limit: CompiledLimit, key: str, seconds: float) -> None:
        """Put ``key`` in ``limit``'s penalty box in Redis for ``seconds`` of Redis's clock
        (the store's time source in tests): every replica refuses it."""
        plan = self.store.plan(limit)
        time_source = self.store.time_source
        now = b"" if time_source is None else b"%d" % time_source.now_us()
        block_us = b"%d" % round(seconds * 1_000_000)
        # The limit noted first (every replica's calls read its boxes within a second; this
        # one's at once), then the key's box: a call that reads it finds the block.
        ttl_ms = round(seconds * 1000) + 1
        client = self._client()
        try:
            await client.eval(NOTE_SCRIPT, 1, marker_key(self.store.key_prefix), limit.name, ttl_ms)
            self.store.blocks.note(limit.name)
            await client.eval(_BLOCK, 1, plan.penalty_key(key), now, block_us)
        except RedisError as exc:
            raise RedisKeyError(redact_text(str(exc))) from None
        finally:
            await client.aclose()

    async def unblock(self, limit: CompiledLimit, key: str) -> bool:
        """Empty ``key``'s penalty box (a block's, and the strikes toward one)."""
        return bool(await self._call("delete", self.store.plan(limit).penalty_key(key)))

    async def _call(self, command: str, name: str) -> Any:
        client = self._client()
        try:
            return await getattr(client, command)(name)
        except RedisError as exc:
            raise RedisKeyError(redact_text(str(exc))) from None
        finally:
            await client.aclose()


def _glob(text: str) -> str:
    return _GLOB_SPECIAL.sub(r"\\\1", text)
