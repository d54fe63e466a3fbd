"""What the keys' API (``/keys``) asks of a store beyond deciding: the keys it holds for a
limit's table, whether it holds one, and one forgotten (reset). A store that cannot answers
the API 501."""

from __future__ import annotations

from typing import Protocol

from gateway.limits.compiled import CompiledLimit
from gateway.stores.memory import MemoryStore
from gateway.stores.shared.lmdb_store import SharedStore


class KeyAdmin(Protocol):
    async def keys_held(self, limit: CompiledLimit, most: int) -> list[str]:
        """Up to ``most`` keys whose state the store holds in ``limit``'s table."""
        ...

    async def holds(self, limit: CompiledLimit, key: str) -> bool:
        """Whether the store holds ``key``'s state in ``limit``'s table."""
        ...

    async def forget(self, limit: CompiledLimit, key: str) -> bool:
        """Drop ``key``'s state in ``limit``'s table (its next request starts afresh);
        whether it was held."""
        ...


class MemoryKeys:
    """``KeyAdmin`` in process."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    async def keys_held(self, limit: CompiledLimit, most: int) -> list[str]:
        return self.store.keys_held(limit.table, most)

    async def holds(self, limit: CompiledLimit, key: str) -> bool:
        return self.store.holds(limit.table, key)

    async def forget(self, limit: CompiledLimit, key: str) -> bool:
        return self.store.forget(limit.table, key)


class SharedKeys:
    """``KeyAdmin`` over the workers' shared store: every worker's keys."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store

    async def keys_held(self, limit: CompiledLimit, most: int) -> list[str]:
        return self.store.keys_held(limit, most)

    async def holds(self, limit: CompiledLimit, key: str) -> bool:
        return self.store.holds(limit, key)

    async def forget(self, limit: CompiledLimit, key: str) -> bool:
        return self.store.forget(limit, key)


def key_admin_of(store: object) -> KeyAdmin | None:
    """The keys' API over ``store``, if it has one (in process, shared, Redis)."""
    if isinstance(store, MemoryStore):
        return MemoryKeys(store)
    if isinstance(store, SharedStore):
        return SharedKeys(store)
    from gateway.stores.redis.key_scan import RedisKeys
    from gateway.stores.redis.store import RedisStore

    if isinstance(store, RedisStore):
        return RedisKeys(store)
    return None
